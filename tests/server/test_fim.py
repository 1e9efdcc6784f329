"""OpenAI's ``suffix`` on ``/v1/completions``: fill in the middle on a model with the markers."""

from __future__ import annotations

import openai
import pytest

from serverproc import DRAFT_MODEL, ServerProcess
from tiny import draft_renaming

pytestmark = pytest.mark.usefixtures("single_thread")

#: four unused added tokens of the bundled draft, named as Qwen2.5-Coder's markers (ids 3, 4, 5, 6)
QWEN_MARKERS = {"<repo_name>": "<|fim_prefix|>", "<reponame>": "<|fim_suffix|>", "<file_sep>": "<|fim_middle|>",
                "<filename>": "<|fim_pad|>"}
BEFORE, AFTER = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"


@pytest.fixture(scope="module")
def filling(tmp_path_factory):
    folder = draft_renaming(tmp_path_factory.mktemp("fim"), QWEN_MARKERS)
    with ServerProcess.cli("--target", str(folder), "--draft", str(folder), "--dtype", "float32", "--gamma", "4") as srv, \
            srv.openai() as c:
        yield c, folder, srv.url


def test_a_suffix_fills_the_gap_between_prefix_and_suffix(filling):
    """The prompt the model reads is marker, prefix, marker, suffix, marker; greedy speculative
    decoding of it equals plain greedy decoding of those ids locally, streamed or not; the model's
    <|fim_pad|> ends the middle (a stop token, left out of the text); echo is refused with it."""
    from specdec.engine import Engine, EngineConfig
    from specdec.sampling import SamplingConfig

    client, folder, _ = filling
    kw = dict(model=folder.name, prompt=BEFORE, suffix=AFTER, max_tokens=16, temperature=0)
    out = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    local = Engine.build(EngineConfig(target=str(folder), draft="none", dtype="float32"))
    enc = lambda text: local.target.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    ids = [3, *enc(BEFORE), 4, *enc(AFTER), 5]
    assert out.model_extra["prompt_token_ids"] == ids
    ref = local.generate(ids, SamplingConfig(temperature=0.0, max_new_tokens=16, stop_token_ids=(0, 6)))
    assert out.text == ref.text and out.model_extra["token_ids"] == ref.token_ids
    streamed = client.completions.create(**kw, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.text
    closed = client.completions.create(**kw, logit_bias={"6": 100})
    assert closed.choices[0].finish_reason == "stop" and closed.choices[0].text == "" and closed.usage.completion_tokens == 1
    assert client.completions.create(**{**kw, "prompt": ""}).choices[0].text is not None  # a gap at the file's start
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(**kw, echo=True)


def test_a_suffix_on_a_model_without_markers_is_refused(client):
    """A 400 that says why; an empty suffix is no suffix (a plain completion)."""
    with pytest.raises(openai.BadRequestError, match="no fill-in-the-middle tokens"):
        client.completions.create(model=DRAFT_MODEL, prompt=BEFORE, suffix=AFTER, max_tokens=4)
    assert client.completions.create(model=DRAFT_MODEL, prompt=BEFORE, suffix="", max_tokens=4).choices[0].text


def test_generate_fills_a_gap_from_the_command_line(filling, capsys):
    """``generate --suffix``: speculative = plain greedy, locally and drafted at the edge against the
    server; clashing options and a model without markers are clear errors (exit 2, no traceback)."""
    from specdec.cli import main

    _, folder, url = filling
    base = ["generate", "-p", BEFORE, "--suffix", AFTER, "--target", str(folder), "-n", "12", "-t", "0", "--json"]
    outs = []
    for extra in (["--draft", "none"], ["--draft", str(folder)]):
        assert main(base + extra) == 0
        outs.append(__import__("json").loads(capsys.readouterr().out))
    assert main(base + ["--remote", url, "--draft", str(folder)]) == 0  # drafted here, verified on the server
    outs.append(__import__("json").loads(capsys.readouterr().out))
    assert outs[0]["token_ids"] == outs[1]["token_ids"] == outs[2]["token_ids"]
    assert outs[0]["stats"]["prompt_tokens"] == outs[1]["stats"]["prompt_tokens"]
    for extra in (["--chat"], ["--interactive"]):
        assert main(base[:-1] + extra) == 2
        assert "--suffix" in capsys.readouterr().err
    assert main(["generate", "-p", BEFORE, "--suffix", AFTER, "--target", DRAFT_MODEL, "--draft", "none", "-n", "4"]) == 2
    assert "no fill-in-the-middle tokens" in capsys.readouterr().err


def test_a_prompts_file_fills_gaps_line_by_line(filling, tmp_path, capsys):
    """``--prompts-file`` lines with a ``"suffix"``: each result is what ``generate --suffix`` gives
    for that line alone (greedy), a plain line beside them what ``generate`` gives; a suffix with a
    system message is a clear error.  The plain line comes first: the end-of-file stop applies
    wherever any line fills a gap, not only where the first one does."""
    import json

    from specdec.cli import main

    _, folder, _ = filling
    lines = ["def mul(a, b):", {"prompt": BEFORE, "suffix": AFTER}, {"prompt": "", "suffix": AFTER}]
    src = tmp_path / "prompts.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    common = ["--target", str(folder), "-n", "10", "-t", "0"]
    assert main(["generate", "--prompts-file", str(src), *common]) == 0
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    alone = []
    for line in lines:
        argv = ["-p", line] if isinstance(line, str) else ["-p", line["prompt"], "--suffix", line["suffix"]]
        assert main(["generate", *argv, *common, "--draft", "none", "--json"]) == 0
        alone.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert [r["token_ids"] for r in rows] == alone and rows[1]["prompt_tokens"] > rows[2]["prompt_tokens"]
    assert main(["generate", "--prompts-file", str(src), *common, "--allowed-token-id", "6"]) == 0  # <|fim_pad|> only
    rows = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert all(r["finish_reason"] != "length" and r["generated_tokens"] == 1 and r["text"] == "" for r in rows)
    src.write_text(json.dumps({"prompt": BEFORE, "suffix": AFTER, "system": "x"}) + "\n")
    assert main(["generate", "--prompts-file", str(src), *common]) == 2
    assert "suffix" in capsys.readouterr().err


def test_a_suffix_keeps_the_requests_own_stop_token_ids(filling):
    client, folder, _ = filling
    kw = dict(model=folder.name, prompt=BEFORE, suffix=AFTER, max_tokens=16, temperature=0)
    free = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    ids = free.model_extra["token_ids"]
    at = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])  # a token's first appearance, not the first
    cut = client.completions.create(**kw, extra_body={"stop_token_ids": [ids[at]], "return_token_ids": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["token_ids"] == ids[:at + 1]


def test_a_truncated_fill_in_the_middle_prompt_keeps_its_markers_and_suffix(filling):
    """``truncate_prompt_tokens`` with a suffix: the prompt loses the prefix's first tokens, never a
    marker nor the suffix (cut from the left as it stands, the model would read no prefix marker);
    a limit the suffix and markers alone exceed is a 400."""
    client, folder, _ = filling
    kw = dict(model=folder.name, prompt=BEFORE, suffix=AFTER, max_tokens=4, temperature=0)
    whole = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0].model_extra["prompt_token_ids"]
    prefix_marker, suffix_at = whole[0], whole.index(4)
    assert prefix_marker == 3 and suffix_at > 3
    k = len(whole) - 2
    cut = client.completions.create(**kw, extra_body={"return_token_ids": True, "truncate_prompt_tokens": k})
    ids = cut.choices[0].model_extra["prompt_token_ids"]
    assert ids == [3, *whole[3:]] and cut.usage.prompt_tokens == k
    with pytest.raises(openai.BadRequestError, match="suffix and the markers alone"):
        client.completions.create(**kw, extra_body={"truncate_prompt_tokens": len(whole) - suffix_at})
