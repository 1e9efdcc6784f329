"""``specdec generate --prompts-file``: the prompts file, the results file, resuming, and bad input."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from specdec import batch_file, fim
from specdec.batch_file import SHAPING, Job, OrderedWriter, done_lines, needs_chat, parse_prompt_lines, settings_key
from specdec.cli import main
from specdec.engine import Engine, EngineConfig
from specdec.errors import SpecdecError
from tiny import make_tiny

LINES = ['"def add(a, b):"', '{"prompt": "Hello there", "system": "Be brief."}', "",
         '{"messages": [{"role": "user", "content": "What is 2+2?"}]}', '"The weather"', '{"prompt": "Once upon"}']


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return str(make_tiny(tmp_path_factory.mktemp("target"), seed=0, max_positions=256))


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_prompt_lines_parse_and_bad_lines_name_their_number():
    got = parse_prompt_lines("\n".join(LINES), "f")
    assert [p.text for p in got] == ["def add(a, b):", "Hello there", None, "The weather", "Once upon"]
    assert got[2].messages == [{"role": "user", "content": "What is 2+2?"}]
    for bad, why in [('{"prompt": 3}', "must be strings"), ("[1, 2]", "neither a string"), ("{oops", "not JSON"),
                     ('{"prompt": "a", "messages": []}', "exactly one"), ('{"messages": [{"role": "user"}]}', "non-empty list"),
                     # a misspelt field was ignored (the prompt ran without its system message)
                     ('{"prompt": "Hi", "sytem": "be terse"}', "unknown field 'sytem'"),
                     ('{"messages": [{"role": "user", "content": "Hi"}], "system": "a pirate"}', "take no \"system\""),
                     ('{"messages": [{"role": "user", "content": "Hi"}], "suffix": "x"}', "take no \"system\" or \"suffix\""),
                     ('{"id": 3}', "exactly one"), ('{"messages": []}', "non-empty list"),
                     ('{"prompt": "a", "suffix": 3}', "must be strings"),
                     ('{"prompt": "a", "suffix": "b", "system": "c"}', "takes no \"system\"")]:
        with pytest.raises(SpecdecError, match=f"f line 2: .*{why}"):
            parse_prompt_lines('"fine"\n' + bad, "f")
    assert [p.text for p in parse_prompt_lines('"a"\n   \n\t\n"b"', "f")] == ["a", "b"]  # blank: whitespace too
    kept = parse_prompt_lines('{"prompt": "Hi", "id": 7, "metadata": {"k": 1}}', "f")  # echoed back, not refused
    assert kept[0].text == "Hi" and kept[0].value["id"] == 7
    # U+2028 / U+0085 inside a string (json.dumps(..., ensure_ascii=False) writes them raw): one line
    assert [p.text for p in parse_prompt_lines('"a\u2028b\u0085c"\r\n"d"', "f")] == ["a\u2028b\u0085c", "d"]


def test_which_lines_need_the_chat_template():
    """Messages always, a line with its own system message always, a plain line with --chat, and a
    line that fills a gap never (it is plain text: with --chat it is refused for that, not for a
    model's missing template)."""
    got = parse_prompt_lines("\n".join(LINES[:2] + LINES[3:4] + ['{"prompt": "def f(", "suffix": ")"}']), "f")
    assert [needs_chat(p, chat=False) for p in got] == [False, True, True, False]
    assert [needs_chat(p, chat=True) for p in got] == [True, True, True, False]


def test_the_settings_key_leaves_the_default_cache_type_out():
    """Results written before ``--kv-dtype`` existed keep their key: the option counts only where
    it is set to something other than ``auto``."""
    args = SimpleNamespace(**{name: None for name in SHAPING})
    key = settings_key(args)
    assert settings_key(SimpleNamespace(**vars(args), kv_dtype="auto")) == key
    assert settings_key(SimpleNamespace(**vars(args), kv_dtype="float16")) != key
    assert settings_key(SimpleNamespace(**{**vars(args), "seed": 1})) != key


def test_more_results_than_prompts_is_a_file_for_other_prompts(tmp_path):
    prompts = parse_prompt_lines('"a"\n"b"', "f")
    out = tmp_path / "r.jsonl"
    out.write_text("".join(json.dumps({"index": i, "prompt": p}) + "\n" for i, p in enumerate(["a", "b", "c"])))
    with pytest.raises(SpecdecError, match="other prompts \\(line 3\\)"):
        done_lines(out, prompts)
    out.write_text("".join(json.dumps({"index": i, "prompt": p}) + "\n" for i, p in enumerate(["a", "b"])))
    assert done_lines(out, prompts) == (2, len(out.read_bytes()))


def test_results_in_input_order_equal_single_prompt_generation(capsys, target, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(LINES) + "\n")
    code, out, err = _run(capsys, "generate", "--prompts-file", str(prompts), "--target", target, "-n", "10",
                          "-t", "1", "--seed", "40", "--batch", "2")
    assert code == 0 and "5 prompts" in err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in rows] == list(range(5)) and [r["seed"] for r in rows] == [40, 41, 42, 43, 44]
    assert rows[1]["prompt"] == {"prompt": "Hello there", "system": "Be brief."}
    # prompt 1 alone (its own system message: the chat template), with its seed, with the default draft
    code, alone, _ = _run(capsys, "generate", "-p", "Hello there", "--chat", "--system", "Be brief.", "--target", target,
                          "--draft", target, "-n", "10", "-t", "1", "--seed", "41", "--json")
    assert json.loads(alone)["token_ids"] == rows[1]["token_ids"]
    code, alone, _ = _run(capsys, "generate", "-p", "Once upon", "--target", target, "--draft", "none", "-n", "10",
                          "-t", "1", "--seed", "44", "--json")
    assert json.loads(alone)["token_ids"] == rows[4]["token_ids"] and json.loads(alone)["text"] == rows[4]["text"]


def test_out_file_resumes_after_the_results_it_holds(capsys, target, tmp_path, monkeypatch):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(LINES))
    out = tmp_path / "r.jsonl"
    argv = ["generate", "--prompts-file", str(prompts), "--target", target, "-n", "8", "-t", "1", "--seed", "9",
            "--out", str(out), "--logprobs", "1"]
    assert _run(capsys, *argv)[0] == 0
    whole = out.read_text()
    lines = whole.splitlines(keepends=True)
    assert len(lines) == 5 and "logprobs" in json.loads(lines[0])
    out.write_text("".join(lines[:2]) + lines[2][:30] + " " * len(whole))  # interrupted while writing the third result
    code, stdout, err = _run(capsys, *argv)
    assert code == 0 and stdout == "" and "first 2 of 5" in err and "3 prompts" in err
    assert out.read_text() == whole  # prompt i keeps seed + i: the same results
    for changed in (["-t", "0.5"], ["-n", "9"], ["--seed", "8"], ["--chat"]):  # results another run would not make
        code, _, err = _run(capsys, *argv, *changed)
        assert code == 2 and "made with other options (line 1" in err and out.read_text() == whole, changed
    with monkeypatch.context() as m:  # all done: no model is even loaded
        m.setattr("specdec.engine.Engine.build", lambda *a, **k: pytest.fail("a model was loaded"))
        code, stdout, err = _run(capsys, *argv, "--batch", "3")  # batching never changes a result
    assert code == 0 and stdout == "" and "all 5 results are already in" in err and out.read_text() == whole
    prompts.write_text('"something else"\n' + "\n".join(LINES[1:]))
    code, _, err = _run(capsys, *argv)
    assert code == 2 and "holds results for other prompts (line 1)" in err and out.read_text() == whole


@pytest.mark.parametrize("content", ["# My notes\n\nkeep me\n", "\n" + "{}\n", "one line, no newline",
                                     '{"index": 0, "prompt": "def add(a, b):"}\nnot json\n'])
def test_an_out_file_that_is_not_a_results_file_is_never_overwritten(capsys, target, tmp_path, content):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(LINES))
    out = tmp_path / "notes.md"
    out.write_text(content)
    code, stdout, err = _run(capsys, "generate", "--prompts-file", str(prompts), "--target", target, "-n", "4",
                             "--out", str(out))
    assert code == 2 and "is not a results file" in err and "Traceback" not in err and out.read_text() == content, err


def test_a_results_file_that_takes_no_writes_is_a_one_line_error(capsys, target, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"hi"\n')
    code, _, err = _run(capsys, "generate", "--prompts-file", str(prompts), "--target", target, "-n", "4", "--out", "/dev/full")
    assert code == 2 and "cannot write" in err and "Traceback" not in err, err


def test_structured_output_gives_each_prompt_its_own_matcher(capsys, target, tmp_path):
    """--json-object over a file: every result is what -p gives for that prompt with its seed."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(LINES))
    code, out, err = _run(capsys, "generate", "--prompts-file", str(prompts), "--target", target, "-n", "12",
                          "-t", "1", "--seed", "5", "--json-object", "--batch", "3")
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    for i, text in ((0, "def add(a, b):"), (3, "The weather")):
        code, alone, _ = _run(capsys, "generate", "-p", text, "--target", target, "--draft", "none",
                              "-n", "12", "-t", "1", "--seed", str(5 + i), "--json-object", "--json")
        assert rows[i]["prompt"] == text and json.loads(alone)["token_ids"] == rows[i]["token_ids"], i
    assert all(r["text"].startswith("{") for r in rows if r["text"])


@pytest.mark.parametrize("extra, message", [
    (["-p", "x"], "not both"),
    (["--interactive"], "drop --interactive"),
    (["--json"], "drop --json"),
    (["--draft", "ngram"], "--draft applies to one prompt's speculative decoding"),
    (["--gamma", "4", "--tree", "8"], "--gamma, --tree apply"),
    (["--regex", "("], "invalid grammar"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--system", "s"], "--system needs --chat"),
    (["--logprobs", "30"], "between 0 and 20"),
])
def test_bad_combinations_fail_before_any_model_loads(capsys, tmp_path, extra, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"hi"\n')
    code, out, err = _run(capsys, "generate", "--prompts-file", str(prompts), "--target", "no-such-model", *extra)
    assert code == 2 and message in err and "Traceback" not in err and out == ""


def test_bad_files_and_stray_batch_flags(capsys, tmp_path):
    for content, message in [(None, "cannot read the prompts file"), ("\n\n", "holds no prompts"), (b"\xff\n", "not valid UTF-8")]:
        path = tmp_path / "p.jsonl"
        if content is None:
            path = tmp_path / "missing.jsonl"
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
        code, _, err = _run(capsys, "generate", "--prompts-file", str(path), "--target", "no-such-model")
        assert code == 2 and message in err, err
    (tmp_path / "ok.jsonl").write_text('"hi"\n')
    code, _, err = _run(capsys, "generate", "--prompts-file", str(tmp_path / "ok.jsonl"), "--out", str(tmp_path))
    assert code == 2 and "is a folder" in err
    code, out, err = _run(capsys, "generate", "--prompts-file", str(tmp_path / "ok.jsonl"), "--target", "no-such-model",
                          "--out", str(tmp_path / "missing" / "r.jsonl"))  # refused before the (unknown) model is looked up
    assert code == 2 and f"the folder {tmp_path / 'missing'} does not exist" in err and "Traceback" not in err and out == ""
    code, _, err = _run(capsys, "generate", "-p", "hi", "--out", "x.jsonl")
    assert code == 2 and "go with --prompts-file" in err


def test_every_prompt_is_checked_before_any_is_decoded(capsys, target, tmp_path):
    out = tmp_path / "r.jsonl"
    for bad, message in [('""', "prompt 1 (counting from 0): the prompt is empty"),
                         (json.dumps("word " * 400), "prompt 1 (counting from 0) has")]:
        prompts = tmp_path / "p.jsonl"
        prompts.write_text('"fine"\n' + bad + "\n")
        code, stdout, err = _run(capsys, "generate", "--prompts-file", str(prompts), "--target", target, "-n", "4",
                                 "--out", str(out))
        assert code == 2 and message in err and "Traceback" not in err, err
        assert not out.exists()  # nothing decoded, nothing written


def test_greedy_results_name_no_seed_and_repeat_byte_for_byte(capsys, target, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(LINES))
    runs = [_run(capsys, "generate", "--prompts-file", str(prompts), "--target", target, "-n", "6")[1] for _ in range(2)]
    assert runs[0] == runs[1] and all(json.loads(line)["seed"] is None for line in runs[0].splitlines())


def test_a_prompt_that_fills_the_context_exactly_is_refused(capsys, target, tmp_path):
    tok = Engine.build(EngineConfig(target=target, draft="none", dtype="float32")).target.tokenizer
    ids = tok.encode("word " * 400, add_special_tokens=False)[:256]
    text = tok.decode(ids)
    assert len(tok.encode(text, add_special_tokens=False)) == 256  # the context, to the token
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps(text) + "\n")
    out = tmp_path / "r.jsonl"
    code, _, err = _run(capsys, "generate", "--prompts-file", str(prompts), "--target", target, "-n", "4", "--out", str(out))
    assert code == 2 and "prompt 0 (counting from 0) has 256 tokens" in err and "Traceback" not in err, err
    assert not out.exists()


def test_generated_tokens_is_each_results_token_count(capsys, target, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"def add(a, b):"\n"Once upon"\n')
    code, out, _ = _run(capsys, "generate", "--prompts-file", str(prompts), "--target", target, "-n", "6", "--seed", "1")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(rows) == 2 and all(r["generated_tokens"] == len(r["token_ids"]) > 0 for r in rows)


@pytest.mark.parametrize("name, a, b", [("top_p", 0.9, 1.0), ("top_k", 5, 0), ("min_p", 0.1, 0.0), ("temperature", 0.0, 1.0),
                                        ("seed", 1, 2), ("max_new_tokens", 8, 9), ("stop", ["x"], None), ("logprobs", 2, None),
                                        ("repetition_penalty", 1.2, 1.0), ("regex", "[0-9]", None), ("target", "a", "b")])
def test_every_sampling_and_output_option_changes_the_settings_key(name, a, b):
    """A rerun with another top_p (etc.) must not go on after results made with the old one: each
    option that shapes a result is in SHAPING and changes the key."""
    assert name in SHAPING
    base = {n: None for n in SHAPING}
    assert settings_key(SimpleNamespace(**{**base, name: a})) != settings_key(SimpleNamespace(**{**base, name: b}))


@dataclass(frozen=True)
class _Sampling:
    stop_token_ids: tuple = ()
    seed: int | None = None
    greedy: bool = True


def test_one_filled_line_makes_the_end_of_file_tokens_end_every_lines_output(monkeypatch, tmp_path):
    """Where ANY line has a suffix (not only where all do), the model's end-of-file tokens are stop
    tokens for the whole job (module docstring).  Fake engine and FIM style: only the sampling
    handed to generate_batch is looked at."""
    monkeypatch.setattr(fim, "require_style", lambda tok: "style")
    monkeypatch.setattr(fim, "stop_ids", lambda tok, style, given: tuple(sorted(set(given) | {99})))
    monkeypatch.setattr(fim, "prompt_ids", lambda tok, prefix, suffix, style=None: [1, 2, 3])
    seen = {}

    class FakeEngine:
        target = SimpleNamespace(model=SimpleNamespace(max_length=64), tokenizer=object())

        def encode(self, text, chat, system):
            return [5, 6]

        def generate_batch(self, ids, sampling, **kw):
            seen["stop"] = sampling.stop_token_ids

    prompts = parse_prompt_lines('"plain"\n{"prompt": "def f(", "suffix": ")"}', "f")
    job = Job(prompts, tmp_path / "out.jsonl", 0, 0)
    args = SimpleNamespace(chat=False, system=None, batch=2, method=None, logprobs=None)
    batch_file.run(FakeEngine(), job, args, _Sampling(stop_token_ids=(7,)), lambda m: None)
    assert seen["stop"] == (7, 99)


@pytest.mark.parametrize("line", ["3", "null", "true", "1.5"])
def test_a_json_line_that_is_neither_string_nor_object_names_its_line(line):
    """A number / null / boolean line is a one-line SpecdecError naming the line, not a TypeError."""
    with pytest.raises(SpecdecError, match="f line 2: neither a string nor an object"):
        parse_prompt_lines('"ok"\n' + line, "f")


def _rows(*rows):
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_a_result_whose_index_is_out_of_place_is_a_file_for_other_prompts(tmp_path):
    """Each line's "index" must be its position: results for the same prompts but numbered otherwise
    (another file, edited, or two files joined) are not gone on from."""
    prompts = parse_prompt_lines('"a"\n"a"', "f")
    out = tmp_path / "r.jsonl"
    out.write_text(_rows({"index": 0, "prompt": "a"}, {"index": 5, "prompt": "a"}))
    with pytest.raises(SpecdecError, match="other prompts \\(line 2\\)"):
        done_lines(out, prompts)


def test_results_written_before_the_settings_key_existed_are_gone_on_from(tmp_path):
    """A result line without "settings" (an older file) is not refused for its settings; one whose
    settings differ is."""
    prompts = parse_prompt_lines('"a"\n"b"', "f")
    out = tmp_path / "r.jsonl"
    out.write_text(_rows({"index": 0, "prompt": "a"}))
    assert done_lines(out, prompts, "abc123") == (1, len(out.read_bytes()))
    out.write_text(_rows({"index": 0, "prompt": "a", "settings": "other"}))
    with pytest.raises(SpecdecError, match="other options \\(line 1"):
        done_lines(out, prompts, "abc123")


class _Stream(io.StringIO):
    """A text stream that records what had been written at each flush."""

    def __init__(self):
        super().__init__()
        self.flushed: list[str] = []

    def flush(self):
        self.flushed.append(self.getvalue())


def test_results_arriving_out_of_order_are_written_in_input_order_each_line_flushed():
    """OrderedWriter holds a result until every earlier one is written, then writes all it can at
    once, flushing after each line (an interrupted job keeps every line it wrote)."""
    prompts = parse_prompt_lines('"a"\n"b"\n"c"', "f")
    stream = _Stream()
    writer = OrderedWriter(stream, prompts, 0, lambda res: {"text": res})
    writer.add(2, "C")
    writer.add(1, "B")
    assert stream.getvalue() == ""  # prompt 0 is not done yet
    writer.add(0, "A")
    rows = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(r["index"], r["prompt"], r["text"]) for r in rows] == [(0, "a", "A"), (1, "b", "B"), (2, "c", "C")]
    assert len(stream.flushed) == 3 and [s.count("\n") for s in stream.flushed] == [1, 2, 3]


def test_a_messages_line_keeps_only_each_messages_role_and_content():
    """A "messages" line's messages reach the template as {"role", "content"} alone, whatever else a
    message object holds; the line itself is echoed as written."""
    line = {"messages": [{"role": "user", "content": "Hi", "name": "bob"}]}
    got = parse_prompt_lines(json.dumps(line), "f")[0]
    assert got.messages == [{"role": "user", "content": "Hi"}] and got.value == line


def test_a_message_whose_content_is_not_a_string_is_refused():
    with pytest.raises(SpecdecError, match="f line 1: .*non-empty list"):
        parse_prompt_lines('{"messages": [{"role": "user", "content": 3}]}', "f")


def test_a_resumed_job_numbers_its_results_from_where_it_goes_on(tmp_path):
    """generate_batch numbers the prompts it is given from 0; a job going on after 1 done result
    writes them as results 1, 2, ... with their own prompts, after the line it kept."""
    prompts = parse_prompt_lines('"a"\n"b"\n"c"', "f")
    out = tmp_path / "r.jsonl"
    kept = _rows({"index": 0, "prompt": "a", "text": "x"})
    out.write_text(kept)

    class FakeEngine:
        target = SimpleNamespace(model=SimpleNamespace(max_length=64), tokenizer=object())

        def encode(self, text, chat, system):
            return [5, 6]

        def generate_batch(self, ids, sampling, on_result, **kw):
            assert len(ids) == 2
            for i in (1, 0):
                on_result(SimpleNamespace(index=i, text=f"t{i}", token_ids=[1] * (i + 1), finish_reason="length",
                                          prompt_tokens=2, seed=None, method="plain", logprobs=None))

    job = Job(prompts, out, 1, len(kept))
    args = SimpleNamespace(chat=False, system=None, batch=2, method=None, logprobs=None)
    batch_file.run(FakeEngine(), job, args, _Sampling(), lambda m: None)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["index"], r["prompt"], r["text"]) for r in rows] == [(0, "a", "x"), (1, "b", "t0"), (2, "c", "t1")]
    assert [r["generated_tokens"] for r in rows[1:]] == [1, 2]


def test_a_last_line_without_a_newline_is_a_cut_result_only_if_it_starts_as_one(tmp_path):
    """done_lines drops an unterminated last line only where it begins as a result line does
    (a job stopped while writing it); any other unterminated text is not a results file, so the
    rerun does not cut it away."""
    prompts = parse_prompt_lines('"a"\n"b"', "f")
    out = tmp_path / "r.jsonl"
    out.write_text("one line, no newline")
    with pytest.raises(SpecdecError, match="not a results file \\(line 1\\)"):
        done_lines(out, prompts)
    kept = _rows({"index": 0, "prompt": "a"})
    out.write_text(kept + '{"index": 1, "prom')
    assert done_lines(out, prompts) == (1, len(kept))
