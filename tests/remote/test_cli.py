"""``specdec generate --remote`` against ``specdec serve`` (both the real CLI), compared with local runs.

The served target is the bundled 15.7 M-parameter SmolLM2 draft (fast on a CPU); the edge drafts
with the same folder.  ``test_real_smollm2_pair`` does the same with the real SmolLM2-135M target.
"""

from __future__ import annotations

import json

import pytest

from serverproc import ServerProcess
from specdec.cli import main

MODEL = "smollm2-135m-draft"
KEY = "cli-test-key"
PROMPT = "def fibonacci(n):"


pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def server():
    with ServerProcess.cli("--target", MODEL, "--draft", "ngram", "--api-key", KEY) as srv:
        yield srv


def _run(capsys, *argv: str) -> tuple[int, dict | None, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    payload = json.loads(captured.out) if code == 0 and "--json" in argv else None
    return code, payload, captured.err


def test_remote_greedy_and_coupled_equal_local(server, capsys):
    common = ["-p", PROMPT, "-n", "16", "--gamma", "4", "--json"]
    code, local, _ = _run(capsys, "generate", "--target", MODEL, "--draft", MODEL, *common)
    assert code == 0
    code, remote, err = _run(capsys, "generate", "--remote", server.url, "--api-key", KEY, "--draft", MODEL, *common)
    assert code == 0, err
    assert remote["token_ids"] == local["token_ids"] and remote["text"] == local["text"]
    code, hybrid, err = _run(capsys, "generate", "--remote", server.url, "--api-key", KEY, "--draft", MODEL + "+lookup", *common)
    assert code == 0, err
    assert hybrid["token_ids"] == local["token_ids"] and hybrid["stats"]["drafter"] == MODEL + "+lookup"
    st = remote["stats"]
    for key in ("bytes_up", "bytes_down", "rtt_ms", "cloud_prefill_ms", "edge_time_ms", "cloud_calls_per_token"):
        assert st[key] > 0, key
    assert st["lossless"] is True and st["method"] == "greedy" and st["target"] == MODEL
    assert remote["remote"]["wire"] == "greedy" and remote["remote"]["retries"] == 0
    assert st["cloud_calls_per_token"] == pytest.approx(remote["remote"]["verify_calls"] / st["generated_tokens"])
    sampled = ["-t", "0.8", "--top-p", "0.95", "--seed", "3"]
    code, local, _ = _run(capsys, "generate", "--target", MODEL, "--draft", "none", "--method", "coupled", *common, *sampled)
    code, remote, err = _run(capsys, "generate", "--remote", server.url, "--api-key", KEY, "--draft", MODEL, *common, *sampled)
    assert code == 0, err
    assert remote["remote"]["wire"] == "coupled" and remote["token_ids"] == local["token_ids"]


def test_remote_min_tokens_allowed_ids_and_bad_words_equal_local(server, capsys):
    """--min-tokens, --allowed-token-id and --bad-word over the wire give local decoding's tokens
    (greedy, and coupled sampling with a seed), which they change."""
    common = ["-p", PROMPT, "-n", "16", "--gamma", "4", "--json"]
    code, free, _ = _run(capsys, "generate", "--target", MODEL, "--draft", "none", *common)
    word = next(w for w in free["text"].split() if w.isalpha() and len(w) > 2)
    allowed = [t for t in range(2, 4000) if t != free["token_ids"][1]]  # 0-1: end-of-text ids; one token of free's out
    options = ["--min-tokens", "12", "--bad-word", word, *[f"--allowed-token-id={t}" for t in allowed]]
    for sampled in ([], ["-t", "0.8", "--seed", "3"]):
        method = ["--method", "coupled"] if sampled else []
        code, local, err = _run(capsys, "generate", "--target", MODEL, "--draft", "none", *method, *common, *options, *sampled)
        assert code == 0, err
        code, remote, err = _run(capsys, "generate", "--remote", server.url, "--api-key", KEY, "--draft", MODEL, *common,
                                 *options, *sampled)
        assert code == 0, err
        assert remote["token_ids"] == local["token_ids"] and remote["text"] == local["text"]
        assert word not in local["text"] and set(local["token_ids"]) <= set(allowed)
        if not sampled:
            assert local["token_ids"] != free["token_ids"]


def test_structured_output_over_the_wire_equals_local(server, capsys):
    """--regex, --choice and --json-schema with --remote: the server reads the grammar with its own
    tokenizer; greedy and seeded (coupled) runs give local decoding's tokens, which obey it."""
    pytest.importorskip("llguidance")
    schema = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                         "additionalProperties": False})
    # the choice case also sends a filter over the grammar: allowing only end-of-text (2), it gives way
    # wherever the grammar needs a word, and the grammar holds
    cases = [(["-p", "The year was", "--regex", " [0-9]{4}"], lambda t: len(t) == 5 and t[1:].isdigit()),
             (["-p", "The review was", "--choice", "good", "--choice", "bad", "--allowed-token-id=2"], lambda t: t in ("good", "bad")),
             (["-p", "Is the sky blue? Answer in JSON:", "--json-schema", schema], lambda t: json.loads(t)["ok"] in (True, False))]
    for args, obeys in cases:
        for sampled in ([], ["-t", "1", "--seed", "7"]):
            common = [*args, "-n", "12", "--gamma", "3", "--json", *sampled]
            method = ["--method", "coupled"] if sampled else []
            code, local, err = _run(capsys, "generate", "--target", MODEL, "--draft", "none", *method, *common)
            assert code == 0, err
            code, remote, err = _run(capsys, "generate", "--remote", server.url, "--api-key", KEY, "--draft", MODEL, *common)
            assert code == 0, err
            assert remote["token_ids"] == local["token_ids"] and obeys(local["text"]), (args, sampled, local["text"])


def test_remote_logprobs_equal_local(server, capsys):
    """--logprobs K with --remote: the server's target scores each committed token, as local decoding does."""
    common = ["-p", PROMPT, "-n", "12", "--gamma", "3", "--json", "--logprobs", "3", "-t", "0.8", "--seed", "5"]
    code, local, err = _run(capsys, "generate", "--target", MODEL, "--draft", "none", "--method", "coupled", *common)
    assert code == 0, err
    code, remote, err = _run(capsys, "generate", "--remote", server.url, "--api-key", KEY, "--draft", MODEL, *common)
    assert code == 0, err
    assert remote["token_ids"] == local["token_ids"]
    assert [e["id"] for e in remote["logprobs"]] == remote["token_ids"]
    for mine, theirs in zip(remote["logprobs"], local["logprobs"]):
        assert mine["token"] == theirs["token"] and mine["logprob"] == pytest.approx(theirs["logprob"], abs=1e-4)
        assert [t["id"] for t in mine["top"]] == [t["id"] for t in theirs["top"]]


def test_remote_chat_with_its_own_template_equals_local(server, capsys):
    """--chat --chat-template with --remote: the edge renders the conversation with the given
    template (not the model's), so the tokens equal local decoding's with the same template."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
    common = ["-p", "Name a colour.", "--chat", "--chat-template", template, "-n", "10", "--gamma", "3", "--json"]
    code, local, err = _run(capsys, "generate", "--target", MODEL, "--draft", "none", *common)
    assert code == 0, err
    code, plain, err = _run(capsys, "generate", "--target", MODEL, "--draft", "none", *common[5:], "-p",
                            "[user] Name a colour.\n[assistant]")
    assert code == 0, err
    code, remote, err = _run(capsys, "generate", "--remote", server.url, "--api-key", KEY, "--draft", MODEL, *common)
    assert code == 0, err
    assert remote["token_ids"] == local["token_ids"] == plain["token_ids"]
    assert remote["stats"]["prompt_tokens"] == local["stats"]["prompt_tokens"]


def test_sparse_q_gating_and_env_key(server, capsys, monkeypatch):
    monkeypatch.setenv("SPECDEC_API_KEY", KEY)
    base = ["generate", "--remote", server.url, "--draft", MODEL, "-p", "It costs $25 on March 3 and", "-n", "10", "--json"]
    code, out, err = _run(capsys, *base, "--method", "block", "-t", "0.8", "--seed", "1", "--q-top-k", "8")
    assert code == 0, err
    assert out["remote"]["wire"] == "sparse-q" and out["remote"]["q_top_k"] == 8 and out["stats"]["lossless"] is True
    code, out, err = _run(capsys, *base, "--gate", "shape", "-t", "0", "--gamma", "6", "--rounds")
    assert code == 0, err
    # the gate judges every drafted round; a last round with one token left drafts nothing (the
    # target's pass alone emits it), so which rounds drafted follows from the emitted counts
    left, drafted = 10, 0
    for r in out["rounds"]:
        drafted += left > 1
        left -= r["emitted"]
    assert len(out["rounds"]) == out["stats"]["target_calls"]
    assert out["gate"]["policy"] == "shape" and out["gate"]["rounds"] == drafted
    # the default drafter (MODEL+lookup) drafts with the model alone under a gate, and says so
    default = [a for a in base if a not in ("--draft", MODEL, "--json")]
    code = main([*default, "--gate", "shape", "-t", "0", "--gamma", "6"])
    err = capsys.readouterr().err
    assert code == 0 and f"drafting with {MODEL} alone" in err and f"loading draft {MODEL}\n" in err, err
    code, out, err = _run(capsys, *base, "--wire", "lossy-scalar", "-t", "1", "--seed", "2")
    assert code == 0, err
    assert out["stats"]["lossless"] is False and out["stats"]["method"] == "lossy_resample_p"
    # human-readable mode streams the text and says LOSSY in the summary line
    code = main(base[:-1] + ["--wire", "lossy-scalar", "-t", "1", "--seed", "2"])
    captured = capsys.readouterr()
    assert code == 0 and "LOSSY" in captured.err and captured.out.strip()


def test_a_remote_reply_runs_to_the_servers_context_and_says_so(capsys):
    """Against a server whose context is 64 positions (``--max-model-len``), a reply that asks for
    more than the prompt leaves stops at the context's last position, drafted or not, and stderr
    says it stopped there (as a local run's does)."""
    with ServerProcess.cli("--target", MODEL, "--draft", "none", "--api-key", KEY, "--max-model-len", "64") as srv:
        common = ["--remote", srv.url, "--api-key", KEY, "-p", "word " * 20, "-n", "60", "--json"]
        code, plain, err = _run(capsys, "generate", "--draft", "none", "--tokenizer", MODEL, *common)
        assert code == 0, err
        st = plain["stats"]
        assert st["prompt_tokens"] + st["generated_tokens"] == 64 and st["finish_reason"] == "length"
        assert f"context of 64 positions: {st['generated_tokens']} of the 60 tokens asked" in err
        code, drafted, err = _run(capsys, "generate", "--draft", MODEL, "--gamma", "6", *common)
        assert code == 0 and drafted["token_ids"] == plain["token_ids"], err


def test_an_interactive_remote_chat_reuses_each_turn_on_both_sides(server, capsys, monkeypatch):
    """``generate --remote URL --interactive``: every turn's reply equals the local interactive chat's
    (greedy), and from the second turn on the server copies the conversation so far from the session
    the last turn ended (said in the summary line) while the edge's draft copies its own rows."""
    import io
    import re

    import specdec.server.prefix_cache as pc

    made: list = []

    class Counting(pc.PrefixCache):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    lines = "and then?\nwhy so?\n\n"
    common = ["-n", "8", "-i", "-p", "hello there", "--system", "Be brief.", "--gamma", "3"]
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    code = main(["generate", "--target", MODEL, "--draft", MODEL, *common])
    local = capsys.readouterr()
    assert code == 0, local.err
    monkeypatch.setattr(pc, "PrefixCache", Counting)
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    code = main(["generate", "--remote", server.url, "--api-key", KEY, "--draft", MODEL, *common])
    remote = capsys.readouterr()
    assert code == 0, remote.err
    assert remote.out == local.out and local.err.count("tokens in") == 3  # three replies, the same text
    summaries = [line for line in remote.err.splitlines() if "tokens/cloud call" in line]
    cached = [int(m.group(1)) if (m := re.search(r"(\d+) prompt tokens cached on the server", line)) else 0 for line in summaries]
    assert len(cached) == 3 and cached[0] == 0 and cached[1] > 10 and cached[2] > cached[1]
    assert len(made) == 1 and made[0].reused_tokens > 0  # the edge's draft cache


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--wire", "greedy", "-t", "1"], "wire mode greedy needs temperature 0"),
        (["--draft", "ngram"], "needs --tokenizer"),
        (["--api-key", "wrong"], "HTTP 401: missing or invalid API key"),
        (["--method", "coupled", "--wire", "sparse-q", "-t", "1"], "not available in wire mode"),
        (["--draft", "kangaroo+lookup"], "drafts with the target's own layers, which stay on the server"),
        (["--draft", "layerskip:2"], "drafts with the target's own layers, which stay on the server"),
        (["--gate", "shape", "--gate-entropy-bits", "nan"], "T_H (entropy bits) must be a finite number >= 0, got nan"),
        (["--gate", "shape", "--gate-margin", "-0.1"], "T_margin must be in [0, 1], got -0.1"),
        (["--gate", "shape", "--gate-rare-max-count", "-1"], "rare-token count must be >= 0"),
        (["--gate-margin", "0.5"], "--gate-margin tunes the edge gate, which is off"),  # was ignored in silence
        (["--gate-r-hard", "0.5", "--gate-rules", "none"], "--gate-r-hard, --gate-rules tune the edge gate, which is off"),
    ],
)
def test_cli_errors_are_one_line(server, capsys, monkeypatch, extra, message):
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    argv = ["generate", "--remote", server.url, "--api-key", KEY, "--draft", MODEL, "-p", PROMPT, "-n", "4"]
    code = main(argv + extra)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("specdec: error:") and message in err[-1]


def test_a_tokenizer_other_than_the_servers_is_refused_before_any_round(server, capsys, tmp_path):
    """An edge tokenizer that gives two ids to each other's tokens (same size, same files otherwise)
    is refused when the session opens, before a round: its drafts and its text would mean other
    tokens.  The server's own tokenizer files pass, and /health reports the digest they share."""
    import shutil

    import httpx

    from specdec.models.registry import load_tokenizer, resolve
    from specdec.tokenizer import vocab_digest

    folder = resolve(MODEL).folder
    same, swapped = tmp_path / "same", tmp_path / "swapped"
    for dest in (same, swapped):
        dest.mkdir()
        for f in folder.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")) or f.name == "config.json":
                shutil.copy(f, dest / f.name)
    data = json.loads((swapped / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = (tok for tok, i in vocab.items() if i in (1000, 1001))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(data))
    health = httpx.get(server.url + "/health", timeout=60).json()
    assert health["vocab_digest"] == vocab_digest(load_tokenizer(same)) != vocab_digest(load_tokenizer(swapped))
    argv = ["generate", "--remote", server.url, "--api-key", KEY, "--draft", "ngram", "-p", PROMPT, "-n", "4", "--json"]
    code, payload, err = _run(capsys, *argv, "--tokenizer", str(same))
    assert code == 0 and payload["token_ids"], err
    code, _, err = _run(capsys, *argv, "--tokenizer", str(swapped))
    assert code == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("specdec: error:") and "tokenizer is not this server's" in last
    assert "Traceback" not in err


@pytest.mark.slow
def test_real_smollm2_pair(capsys):
    """The real SmolLM2-135M target in the cloud, the distilled draft on the edge: greedy = local."""
    common = ["-p", "def quicksort(items):", "-n", "12", "--gamma", "4", "--json"]
    code, local, err = _run(capsys, "generate", "--target", "smollm2-135m", "--draft", MODEL, *common)
    assert code == 0, err
    with ServerProcess.cli("--target", "smollm2-135m", "--draft", "ngram") as srv:
        code, remote, err = _run(capsys, "generate", "--remote", srv.url, "--draft", MODEL, *common)
    assert code == 0, err
    assert remote["stats"]["target"] == "smollm2-135m"
    assert remote["token_ids"] == local["token_ids"]
    assert remote["stats"]["acceptance_rate"] > 0 and remote["stats"]["lossless"] is True


class _Called(Exception):
    pass


@pytest.fixture
def edge(monkeypatch):
    """The arguments of the command's generate_remote call."""
    import specdec.remote.edge as edge_mod

    seen: dict = {}

    def stub(prompt_ids, sampling, remote, **kwargs):
        seen.update(kwargs, prompt_ids=prompt_ids, sampling=sampling, remote=remote)
        raise _Called

    monkeypatch.setattr(edge_mod, "generate_remote", stub)
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)

    def run(*argv: str) -> dict:
        seen.clear()
        with pytest.raises(_Called):
            main(["generate", "--remote", "http://127.0.0.1:9", "-p", "def f(x):", "-n", "5", *argv])
        return dict(seen)

    return run


def test_the_remote_timeout_bounds_the_whole_round(edge):
    remote = edge("--draft", "ngram", "--tokenizer", MODEL, "--remote-timeout", "7.5")["remote"]
    assert remote.timeout_s == 7.5 and remote.retry_budget_s == 7.5


def test_the_api_key_comes_from_the_environment_unless_given(edge, monkeypatch):
    assert edge("--draft", "ngram", "--tokenizer", MODEL)["remote"].api_key is None
    monkeypatch.setenv("SPECDEC_API_KEY", "from-env")
    assert edge("--draft", "ngram", "--tokenizer", MODEL)["remote"].api_key == "from-env"
    assert edge("--draft", "ngram", "--tokenizer", MODEL, "--api-key", "given")["remote"].api_key == "given"


@pytest.mark.parametrize("method, wire", [("lossy-resample-p", "lossy-scalar"), ("lossy_p_threshold", "lossy-scalar"),
                                          ("token", "sparse-q"), ("coupled", "coupled")])
def test_a_method_picks_its_wire_mode(edge, method, wire):
    remote = edge("--draft", "ngram", "--tokenizer", MODEL, "-t", "1", "--seed", "1", "--method", method)["remote"]
    assert remote.wire == wire


def test_a_model_free_drafter_ends_at_its_tokenizers_eos(edge):
    from specdec.models.registry import load_tokenizer, resolve

    eos = load_tokenizer(resolve(MODEL).folder).eos_token_id
    got = edge("--draft", "ngram", "--tokenizer", MODEL)
    assert eos is not None and got["eos_ids"] == frozenset({eos}) and got["drafter_name"] == "ngram"


def test_tree_min_prob_and_output_constraints_reach_the_edge(edge):
    got = edge("--draft", "ngram", "--tokenizer", MODEL, "--tree", "6", "--tree-min-prob", "0.4",
               "--allowed-token-id", "1", "--allowed-token-id", "2", "--allowed-token-id", "3")
    assert got["tree"] == 6 and got["tree_min_prob"] == 0.4
    constraint = got["sampling"].constraint
    assert constraint is not None and tuple(constraint.allowed_ids) == (1, 2, 3)


def test_the_gate_gets_the_thresholds_given(edge):
    gate = edge("--draft", MODEL, "--gate", "shape", "--gate-entropy-bits", "1.5", "--gate-margin", "0.05",
                "--gate-rules", "none")["gate"]
    assert gate.cfg.t_entropy_bits == 1.5 and gate.cfg.t_margin == 0.05 and gate.cfg.rules == frozenset()


def test_the_edge_vocabulary_is_the_draft_models(edge, tmp_path):
    """A draft model whose embedding is padded past its tokenizer (49,216 rows, 49,152 tokens) drafts
    those ids too: the edge's bound is the model's vocabulary, not the tokenizer's length."""
    from tiny import make_tiny

    folder = make_tiny(tmp_path / "padded", layers=1, vocab=49216)
    got = edge("--draft", str(folder), "--draft-dtype", "float32")
    assert got["vocab_size"] == 49216 and len(got["tokenizer"]) == 49152


NGRAM = ("--draft", "ngram", "--tokenizer", MODEL)


def test_every_gate_threshold_reaches_the_gate(edge):
    """--gate-nll-bits, --gate-mc-var, --gate-r-hard and --gate-rare-max-count each reach the gate's
    configuration (and the rule triggers), not just the entropy and margin thresholds."""
    gate = edge("--draft", MODEL, "--gate", "shape", "--gate-nll-bits", "3.5", "--gate-mc-var", "0.25",
                "--gate-r-hard", "0.75", "--gate-rare-max-count", "4", "--gate-rules", "number,rare")["gate"]
    cfg = gate.cfg
    assert cfg.t_nll_bits == 3.5 and cfg.t_mc_var == 0.25 and cfg.r_hard == 0.75 and cfg.rare_max_count == 4
    assert cfg.rules == frozenset({"number", "rare"}) and cfg.policy == "shape"
    assert gate.triggers.rules == cfg.rules and gate.triggers.rare_max_count == 4
    assert gate.draft_model is not None  # the draft model, for MC-dropout


def test_the_lossy_timeout_and_method_reach_the_client(edge):
    """--lossy-timeout-commit-ms and --method travel in the RemoteConfig."""
    remote = edge(*NGRAM, "-t", "1", "--seed", "1", "--method", "lossy-resample-p",
                  "--lossy-timeout-commit-ms", "250")["remote"]
    assert remote.lossy_timeout_commit_ms == 250 and remote.method == "lossy-resample-p"
    assert edge(*NGRAM)["remote"].lossy_timeout_commit_ms is None


def test_an_empty_api_key_variable_means_no_key(edge, monkeypatch):
    """SPECDEC_API_KEY set but empty sends no bearer token (None), not an empty one."""
    monkeypatch.setenv("SPECDEC_API_KEY", "")
    assert edge(*NGRAM)["remote"].api_key is None


def test_q_top_k_reaches_the_edge(edge):
    assert edge(*NGRAM, "-t", "1", "--seed", "1", "--wire", "sparse-q", "--q-top-k", "5")["q_top_k"] == 5
    assert edge(*NGRAM)["q_top_k"] == 16


def test_ngram_drafts_with_an_ngram_drafter_and_none_with_nothing(edge):
    from specdec import defaults
    from specdec.drafters import NgramDrafter

    got = edge(*NGRAM)
    assert isinstance(got["drafter"], NgramDrafter)
    assert got["drafter"].max_ngram == defaults.NGRAM_MAX and got["drafter"].min_ngram == defaults.NGRAM_MIN
    got = edge("--draft", "none", "--tokenizer", MODEL)
    assert got["drafter"] is None and got["drafter_name"] == "none"


def test_a_temperature_factor_with_a_model_free_drafter_is_one_error_line(capsys):
    """--draft ngram has no distribution to scale: --draft-temperature-factor 0.5 with it is refused in
    one line (exit 2) with --remote, as without it."""
    code = main(["generate", "--remote", "http://127.0.0.1:9", "-p", "hi", "-n", "2", *NGRAM,
                 "--draft-temperature-factor", "0.5"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("specdec: error:") and "draft temperature factor" in err[-1]


def test_the_draft_options_reach_the_draft_loader(edge, monkeypatch):
    """--backend, --dtype, --draft-dtype, --draft-vocab and --draft-temperature-factor reach the
    EngineConfig the edge's draft is loaded with."""
    import specdec.engine as engine

    configs = []
    real = engine.load_draft

    def spy(cfg, *a, **k):
        configs.append(cfg)
        return real(cfg, *a, **k)

    monkeypatch.setattr(engine, "load_draft", spy)
    edge("--draft", MODEL, "--backend", "native", "--dtype", "bfloat16", "--draft-dtype", "float32",
         "--draft-vocab", "full", "--draft-temperature-factor", "0.7", "-t", "1", "--seed", "1")
    (cfg,) = configs
    assert cfg.draft == MODEL and cfg.backend == "native" and cfg.dtype == "bfloat16"
    assert cfg.draft_dtype == "float32" and cfg.draft_vocab == "full" and float(cfg.draft_temperature_factor) == 0.7


@pytest.mark.parametrize("draft, message", [
    ("self", "drafts with the target's own layers, which stay on the server"),
    ("smollm2-135m-eagle3", "reads the target's hidden states, which a remote target does not send"),
])
def test_drafters_that_need_the_target_are_refused_at_the_edge(capsys, monkeypatch, draft, message):
    """Self-speculation and draft heads need the target's layers or features, which stay on the
    server: one error line, exit 2, before anything is sent."""
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    code = main(["generate", "--remote", "http://127.0.0.1:9", "-p", "hi", "-n", "2", "--draft", draft])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("specdec: error:") and message in err[-1], err


def test_a_suffix_at_the_edge_fills_in_the_middle_with_the_edges_tokenizer(capsys, monkeypatch):
    """--suffix with --remote builds the fill-in-the-middle prompt at the edge: a tokenizer without
    FIM markers (the shipped draft's) is refused in one line instead of sending a plain prompt."""
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    code = main(["generate", "--remote", "http://127.0.0.1:9", "-p", "def f(", "--suffix", "\n    return x", "-n", "2", *NGRAM])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("specdec: error:") and "fill" in err[-1].lower(), err


def test_an_interactive_remote_chat_passes_the_same_options_each_turn(edge, monkeypatch):
    """--interactive: each turn's generate_remote gets the command's gamma, tree options, q_top_k,
    eos ids and vocabulary, as the one-shot run does."""
    import specdec.cli as cli

    def one_turn(turn, system, sampling, first=None):
        return turn([{"role": "user", "content": first or "hi"}], sampling)

    monkeypatch.setattr(cli, "chat_loop", one_turn)
    got = edge(*NGRAM, "-i", "-t", "1", "--seed", "1", "--wire", "sparse-q", "--q-top-k", "5", "--gamma", "3",
               "--tree", "4", "--tree-min-prob", "0.3")
    once = edge(*NGRAM, "-t", "1", "--seed", "1", "--wire", "sparse-q", "--q-top-k", "5", "--gamma", "3",
                "--tree", "4", "--tree-min-prob", "0.3")
    assert got["q_top_k"] == 5 and got["gamma"] == 3 and got["tree"] == 4 and got["tree_min_prob"] == 0.3
    for key in ("q_top_k", "gamma", "tree", "tree_min_prob", "eos_ids", "vocab_size", "drafter_name"):
        assert got[key] == once[key], key


def test_bad_words_reach_the_edges_constraint(edge):
    """--bad-word builds the edge's constraint (banned token sequences from the edge's tokenizer,
    the target's): without it the edge would draft, and send, the banned word's tokens."""
    from specdec.models.registry import load_tokenizer, resolve
    from specdec.token_filter import bad_word_ids

    constraint = edge(*NGRAM, "--bad-word", "hello")["sampling"].constraint
    assert constraint is not None
    tok = load_tokenizer(resolve(MODEL).folder)
    expected = {tuple(s) for s in bad_word_ids(tok, ["hello"])}
    assert expected and expected <= set(constraint.banned)


def test_a_head_with_lookup_is_refused_as_a_head_at_the_edge(capsys, monkeypatch):
    """``--draft HEAD+lookup --remote URL``: _is_head is asked about the whole value
    (``smollm2-135m-medusa+lookup``) instead of its base, so the head is not recognised, the edge tries
    to load 'smollm2-135m-medusa' as a draft model, and the error says "unknown model" (after logging
    "loading draft ...") instead of saying a head needs the target's hidden states."""
    monkeypatch.delenv("SPECDEC_API_KEY", raising=False)
    code = main(["generate", "--remote", "http://127.0.0.1:9", "-p", "hi", "-n", "2", "--draft", "smollm2-135m-medusa+lookup"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("specdec: error:")
    assert "reads the target's hidden states" in err[-1] and "unknown model" not in err[-1], err


def test_prompt_lookup_stays_in_front_unless_the_gate_is_on(edge, monkeypatch):  # noqa: F811
    """NAME+lookup drafts with prompt lookup first; only the edge gate (which judges the draft model's
    tokens one by one) drops the lookup, so with --gate off it must reach the drafter."""
    import specdec.engine as engine

    lookups = []
    real = engine.model_drafter

    def spy(cfg, draft, *a, lookup=False, **k):
        lookups.append(lookup)
        return real(cfg, draft, *a, lookup=lookup, **k)

    monkeypatch.setattr(engine, "model_drafter", spy)
    edge("--draft", f"{MODEL}+lookup")
    edge("--draft", f"{MODEL}+lookup", "--gate", "shape")
    assert lookups == [True, False]


def test_the_gate_frequency_table_reaches_the_rare_rule(edge, tmp_path):  # noqa: F811
    """--gate-freq loads the table (over the edge's vocabulary) into the rule triggers; without it the
    rare rule has no table and is off."""
    table = tmp_path / "freq.json"
    table.write_text(json.dumps({"7": 3}))
    triggers = edge(*NGRAM, "--gate", "shape", "--gate-freq", str(table), "--gate-rules", "rare")["gate"].triggers
    assert triggers.frequency is not None and int(triggers.frequency[7]) == 3 and triggers.frequency.numel() == 49152
    assert triggers.check("", 8) == ("rare",) and triggers.check("", 7) == ()
    assert edge(*NGRAM, "--gate", "shape", "--gate-rules", "rare")["gate"].triggers.frequency is None


def test_the_summary_line_says_how_many_prompt_tokens_the_server_had_cached():
    """The stderr summary names the prompt tokens the server's prefix cache copied (a chat's later
    turns), and says nothing about a cache when there were none."""
    from types import SimpleNamespace

    from specdec.remote.command import _summary_line

    stats = {"generated_tokens": 5, "wall_s": 1.0, "tokens_per_s": 5.0, "tokens_per_target_call": 2.5,
             "acceptance_rate": 0.5, "bytes_up": 10, "bytes_down": 20, "rtt_ms": 3.0, "method": "greedy"}

    def out(cached: int):
        return SimpleNamespace(summary=lambda: stats, lossless=True,
                               remote={"wire": "greedy", "session_cached_tokens": cached, "unverified_tokens": 0})

    assert "| 12 prompt tokens cached on the server" in _summary_line(out(12))
    assert "cached" not in _summary_line(out(0))
