"""The llama.cpp rows of ``specdec bench``: planning, metrics and report on synthetic samples, the
GGUF export's tensor layout, and the runner and its draft against a scripted stand-in for the
binding (none of this needs llama.cpp itself)."""

import json
import sys
import types

import numpy as np
import pytest
import torch

from specdec.bench import gguf_export, report, runner
from specdec.bench.gguf_export import export_llama, gguf_name, rope_halves_to_pairs
from specdec.bench.workloads import BUILTIN
from specdec.errors import SpecdecError


def _row(mode, prompt, tps, *, t=0.0, gen=128, calls=128, sha="x", prefill=0.05, **extra):
    return {"mode": mode, "method": mode, "gamma": None, "temperature": t, "prompt_id": prompt, "category": "code",
            "seed": 0, "tokens_per_s": tps, "wall_s": gen / tps, "ttft_s": prefill, "prefill_s": prefill,
            "generated_tokens": gen, "target_calls": calls, "tokens_per_target_call": gen / calls,
            "lossless": True, "tokens_sha1": sha, **extra}


def _engine_fields(calls, gen, prop=0, acc=0):
    return {"draft_tokens_proposed": prop, "draft_tokens_accepted": acc, "acceptance_per_position": [],
            "proposed_per_position": [], "draft_s": 0.0, "target_s": 1.0, "verify_s": 0.0, "kv_peak_bytes": 0}


def _samples():
    rows = []
    for i, p in enumerate("abc"):
        rows.append(_row("llamacpp_plain", p, 100.0, sha=f"p{p}"))
        # the speculative llama.cpp row: 64 calls for 128 tokens, 200 drafted of which 64 kept
        rows.append(_row("llamacpp_spec", p, [150.0, 50.0, 100.0][i], calls=64, sha=f"p{p}" if p != "c" else "other",
                         draft_tokens_proposed=200, draft_tokens_accepted=64, draft_calls=63))
        rows.append(_row("plain_paired", p, 80.0, sha=f"p{p}" if p == "a" else "q", **_engine_fields(128, 128)))
        rows.append({**_row("speculative", p, [160.0, 240.0, 80.0][i], calls=50, sha="s", **_engine_fields(50, 128, 100, 78)),
                     "method": "greedy", "gamma": "auto"})
    return rows


def test_rows_are_compared_with_llamacpp_plain_prompt_by_prompt():
    stats = {g.mode: g for g in report.aggregate(_samples())}
    assert stats["speculative"].speedup_vs_llamacpp == pytest.approx(1.6)  # median of 1.6, 2.4, 0.8
    assert stats["plain_paired"].speedup_vs_llamacpp == pytest.approx(0.8)
    assert stats["llamacpp_spec"].speedup_vs_llamacpp == pytest.approx(1.0)  # median of 1.5, 0.5, 1.0
    assert stats["llamacpp_plain"].speedup_vs_llamacpp == pytest.approx(1.0)


def test_llamacpp_metrics_and_greedy_agreement():
    stats = {g.mode: g for g in report.aggregate(_samples())}
    spec = stats["llamacpp_spec"]
    assert spec.tokens_per_call == pytest.approx(2.0) and spec.tokens_per_call_se == pytest.approx(0.0)
    assert spec.acceptance == pytest.approx(64 / 200) and spec.mean_gamma == pytest.approx(200 / 63)
    assert spec.same_tokens_as_llamacpp == (2, 3)
    assert stats["plain_paired"].same_tokens_as_llamacpp == (1, 3)
    assert stats["llamacpp_plain"].same_tokens_as_llamacpp is None  # not compared with itself
    assert stats["llamacpp_plain"].tokens_per_call == pytest.approx(1.0)
    # decode tok/s leaves the prompt's forward pass out: 128 / (1.28 - 0.05)
    assert stats["llamacpp_plain"].decode_tokens_per_s_median == pytest.approx(128 / (1.28 - 0.05))


def test_greedy_agreement_is_only_counted_at_temperature_zero():
    rows = [_row("llamacpp_plain", "a", 100.0, t=1.0, sha="1"), _row("llamacpp_spec", "a", 100.0, t=1.0, sha="1")]
    spec = [g for g in report.aggregate(rows) if g.mode == "llamacpp_spec"][0]
    assert spec.same_tokens_as_llamacpp is None


def test_markdown_has_the_llamacpp_section_only_when_llamacpp_ran(tmp_path):
    cfg = {"command": "specdec bench", "target": "t", "draft": "d", "draft_dtype": "auto", "prompts": [{"category": "code"}],
           "max_new_tokens": 128, "repeats": 1, "seed": 0, "top_p": None, "repetition_penalty": None, "batch_invariant": True}
    out = report.write({"config": cfg, "samples": _samples()}, tmp_path, make_plots=False)
    text = (tmp_path / "README.md").read_text()
    assert "## Against llama.cpp on the same GGUF" in text
    section = text.split("## Against llama.cpp on the same GGUF")[1]
    line = next(x for x in section.splitlines() if x.startswith("| llamacpp_spec "))
    assert "| 1.00 |" in line and "2/3" in line
    without = [s for s in _samples() if not s["mode"].startswith("llamacpp")]
    report.write({"config": cfg, "samples": without}, tmp_path / "b", make_plots=False)
    assert "llama.cpp" not in (tmp_path / "b" / "README.md").read_text()
    assert out["stats"]


def _cfg(modes, variants=("plain", "spec")):
    return runner.BenchConfig(target="smollm2-135m", draft="smollm2-135m-draft", prompts=BUILTIN[:3], modes=modes,
                              temperatures=(0.0, 1.0), llamacpp=variants)


def test_llamacpp_rows_run_inside_the_speculative_worker_when_it_runs():
    cfg = _cfg(("plain", "speculative", "llamacpp"))
    assert runner._llamacpp_host(cfg) == "speculative"
    assert runner._job(cfg, "speculative")["llamacpp"] == ["plain", "spec"]
    assert "llamacpp" not in runner._job(cfg, "plain")
    # 3 prompts x 2 temperatures: speculative (1 paired plain + 1 setting) plus 2 llama.cpp rows each
    assert runner._count(cfg, "speculative") == 3 * 2 * (2 + 2)
    assert runner._count(cfg, "llamacpp") == 0


def test_llamacpp_runs_in_its_own_worker_without_the_speculative_mode():
    cfg = _cfg(("plain", "llamacpp"), ("plain", "spec", "lookup"))
    assert runner._llamacpp_host(cfg) == "llamacpp"
    assert runner._job(cfg, "llamacpp")["llamacpp"] == ["plain", "spec", "lookup"]
    assert runner._count(cfg, "llamacpp") == 3 * 2 * 3
    assert runner._llamacpp_host(_cfg(("plain", "speculative"))) is None


def test_bench_cli_rejects_bad_llamacpp_options(capsys):
    from specdec.cli import main

    for argv in (["--llamacpp", "plain,medusa"], ["--llamacpp-draft-max", "0"], ["--llamacpp-p-min", "1.5"]):
        assert main(["bench", "--modes", "plain", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("specdec: error:") and "Traceback" not in err


# ----------------------------------------------------------------------------- GGUF export


def _rotate_half_rope(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """Hugging Face Llama rotary embedding of one head vector ``[d]`` (feature i pairs with i + d/2)."""
    d = x.numel()
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [d/2]
    ang = torch.cat([pos * inv, pos * inv])
    rot = torch.cat([-x[d // 2:], x[: d // 2]])
    return x * torch.cos(ang) + rot * torch.sin(ang)


def _interleaved_rope(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """GGUF ``llama`` rotary embedding (features 2j and 2j + 1 rotate together)."""
    d = x.numel()
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    c, s = torch.cos(pos * inv), torch.sin(pos * inv)
    a, b = x[0::2], x[1::2]
    out = torch.empty_like(x)
    out[0::2], out[1::2] = a * c - b * s, a * s + b * c
    return out


def test_rope_reordering_makes_interleaved_rope_match_hf_attention_scores():
    g = torch.Generator().manual_seed(0)
    heads, d, dim = 3, 8, 12
    wq = torch.randn(heads * d, dim, generator=g, dtype=torch.float64)
    wk = torch.randn(heads * d, dim, generator=g, dtype=torch.float64)
    x1, x2 = torch.randn(dim, generator=g, dtype=torch.float64), torch.randn(dim, generator=g, dtype=torch.float64)
    pq = torch.from_numpy(rope_halves_to_pairs(wq.numpy(), heads))
    pk = torch.from_numpy(rope_halves_to_pairs(wk.numpy(), heads))
    for h in range(heads):
        sl = slice(h * d, (h + 1) * d)
        hf = _rotate_half_rope(wq[sl] @ x1, 5, 1e4) @ _rotate_half_rope(wk[sl] @ x2, 2, 1e4)
        gg = _interleaved_rope(pq[sl] @ x1, 5, 1e4) @ _interleaved_rope(pk[sl] @ x2, 2, 1e4)
        assert gg.item() == pytest.approx(hf.item(), rel=1e-12)
        # negative control: without the reordering the scores differ
        wrong = _interleaved_rope(wq[sl] @ x1, 5, 1e4) @ _interleaved_rope(wk[sl] @ x2, 2, 1e4)
        assert abs(wrong.item() - hf.item()) > 1e-3


def test_gguf_names_and_bad_inputs():
    assert gguf_name("model.layers.3.self_attn.q_proj.weight") == "blk.3.attn_q.weight"
    assert gguf_name("model.layers.0.mlp.down_proj.weight") == "blk.0.ffn_down.weight"
    assert gguf_name("model.embed_tokens.weight") == "token_embd.weight"
    with pytest.raises(SpecdecError):
        gguf_name("model.layers.0.self_attn.q_norm.weight")
    with pytest.raises(SpecdecError):
        rope_halves_to_pairs(np.zeros((10, 4)), 4)


def test_an_exported_draft_reads_back_as_the_same_weights(tmp_path):
    """The draft llama.cpp runs is specdec's draft written as a GGUF: a tiny Llama exported in
    float32 and converted back (transformers' GGUF reader undoes the rotary reordering) has every
    tensor bitwise the original's, the tied LM head written once, the shape fields of its config and
    the target GGUF's tokenizer verbatim.  (The live test, which runs it through llama.cpp, skips
    where llama-cpp-python is not installed.)"""
    import gguf
    from safetensors.torch import load_file

    from specdec.models import registry
    from tiny import make_tiny

    from safetensors.torch import save_file

    folder = make_tiny(tmp_path / "tiny", seed=3, layers=2)  # 4 heads, 2 key/value heads, tied
    want = load_file(str(folder / "model.safetensors"))
    # a tied checkpoint that stores its LM head anyway (some exports do): written once, as the embedding
    save_file(want | {"lm_head.weight": want["model.embed_tokens.weight"].clone()}, str(folder / "model.safetensors"))
    ref = registry.gguf_file("smollm2-135m")
    out = export_llama(folder, tmp_path / "tiny.gguf", tokenizer_from=ref, dtype="float32")
    back = registry.convert_gguf(out, tmp_path / "back")
    got = load_file(str(back / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    reader = gguf.GGUFReader(str(out))
    values = {k: reader.fields[f"llama.{k}"].contents() for k in (
        "block_count", "attention.head_count", "attention.head_count_kv", "rope.freq_base", "embedding_length",
        "context_length", "attention.layer_norm_rms_epsilon")}
    assert values == {"block_count": 2, "attention.head_count": 4, "attention.head_count_kv": 2,
                      "rope.freq_base": 10000.0, "embedding_length": 32, "context_length": 256,
                      "attention.layer_norm_rms_epsilon": pytest.approx(1e-6)}
    assert "output.weight" not in {t.name for t in reader.tensors}
    tokens = gguf.GGUFReader(str(ref)).fields["tokenizer.ggml.tokens"].contents()
    assert reader.fields["tokenizer.ggml.tokens"].contents() == tokens and not list(tmp_path.glob("*.partial"))
    half = gguf.GGUFReader(str(export_llama(folder, tmp_path / "half.gguf", tokenizer_from=ref)))  # float16
    kinds = {t.name: t.tensor_type.name for t in half.tensors}
    assert kinds["blk.0.attn_norm.weight"] == kinds["output_norm.weight"] == "F32"  # norms: llama.cpp wants float32
    assert kinds["blk.0.attn_q.weight"] == kinds["token_embd.weight"] == "F16"


def test_llamacpp_variants_take_turns_with_specdecs_runs():
    """In the speculative worker llama.cpp's variants are arms of the same rotation as the plain
    references and the drafters' runs: no run is always first, none always right after llama.cpp's."""
    from specdec.bench import worker

    arms = worker._arms(["plain", "spec"], [("plain_paired", "greedy")], [("engine", "draft", "greedy", "auto")])
    assert [a.kind for a in arms] == ["llamacpp", "llamacpp", "reference", "engine"]
    assert (arms[2].method, arms[3].engine, arms[3].gamma) == ("greedy", "engine", "auto")

    def names(prompt, rep):
        return [a.name for a in worker._in_turn(arms, prompt, rep)]

    assert names(0, 0) == ["plain", "spec", "plain_paired", "draft"]
    assert names(1, 0) == ["spec", "plain_paired", "draft", "plain"]
    assert names(3, 0) == ["draft", "plain", "spec", "plain_paired"]
    assert names(4, 0) == names(0, 0) and names(0, 1) == names(1, 0)  # and one place on at the next repeat
    assert {names(i, 0)[0] for i in range(4)} == {"plain", "spec", "plain_paired", "draft"}
    assert worker._in_turn([], 3, 1) == []


def test_llamacpp_context_holds_the_longest_prompt_its_reply_and_one_draft():
    from specdec.bench.llamacpp import N_CTX, context_for

    assert context_for(40, 128) == N_CTX  # short prompts keep the smallest context
    assert context_for(1_900, 128, 16) == 2_048  # 1,900 + 128 + 16 + 1 = 2,045 fits
    assert context_for(1_950, 128, 16) == 2_304  # 2,095, rounded up to 256
    assert context_for(1_904, 128, 16) == 2_304  # 1,904 + 128 + 16 = 2,048, and the draft's call one more
    n = context_for(3_000, 256, 16)
    assert n % 256 == 0 and n >= 3_000 + 256 + 16 + 1 and n - 256 < 3_000 + 256 + 16 + 1


class _FakeLlama:
    """A scripted stand-in for ``llama_cpp.Llama``: ``eval`` appends to the sequence (from
    ``n_tokens``, as the binding does), the next-token logits are ``LOGITS[last token]``, and
    ``generate`` evaluates the prompt, then one token a call, each the logits' arg-max."""

    LOGITS: dict[int, list[float]] = {}
    made: list["_FakeLlama"] = []

    def __init__(self, model_path: str, **kwargs) -> None:
        self.kwargs, self.evals, self.seed, self.generate_kwargs = kwargs, [], None, None
        self.input_ids, self.n_tokens = np.zeros(64, dtype=np.intc), 0
        _FakeLlama.made.append(self)

    def eval(self, tokens) -> None:
        self.evals.append(list(tokens))
        self.input_ids[self.n_tokens:self.n_tokens + len(tokens)] = tokens
        self.n_tokens += len(tokens)
        _CLOCK[0] += len(tokens)  # a token scored costs one (fake) second

    def reset(self) -> None:
        self.n_tokens = 0

    def set_seed(self, seed: int) -> None:
        self.seed = seed

    def last_logits(self) -> np.ndarray:
        return np.asarray(self.LOGITS[int(self.input_ids[self.n_tokens - 1])], dtype=np.float32)

    def generate(self, ids, **kwargs):
        self.generate_kwargs = kwargs
        self.eval(ids)
        while True:
            tok = int(np.argmax(self.last_logits()))
            yield tok
            self.eval([tok])


_CLOCK = [0.0]


@pytest.fixture
def fake_binding(monkeypatch):
    """``llama_cpp`` (and its ``llama_speculative``) as the scripted stand-in, on a fake clock."""
    from specdec.bench import llamacpp

    module = types.SimpleNamespace(Llama=_FakeLlama)
    speculative = types.SimpleNamespace(LlamaPromptLookupDecoding=lambda: "lookup drafter")
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", speculative)
    monkeypatch.setattr(llamacpp, "_last_logits", lambda llm: llm.last_logits())
    monkeypatch.setattr(llamacpp, "time", types.SimpleNamespace(perf_counter=lambda: _CLOCK[0]))
    monkeypatch.setattr("specdec.bench.gguf_export.draft_gguf", lambda draft, target: target.with_name("draft.gguf"))
    _FakeLlama.made.clear()
    inf = -np.inf  # next tokens: 1 -> 2 (p = 0.5 exactly, tied with 6), 2 -> 3 (p ~0.90), 3 -> 4 (~0.22),
    _FakeLlama.LOGITS = {1: [inf, inf, 0, inf, inf, inf, 0], 2: [0, 0, 0, 4, 0, 0, 0],  # 4 -> 5, 5 -> 6 (~1),
                         3: [0, 0, 0, 0, 0.5, 0, 0], 4: [0, 0, 0, 0, 0, 9, 0],  # 6 -> 0 (~0.22)
                         5: [0, 0, 0, 0, 0, 0, 9], 6: [0.5, 0, 0, 0, 0, 0, 0]}
    return llamacpp


def test_the_gguf_draft_keeps_its_cache_in_step_and_stops_below_p_min(fake_binding):
    """The draft model drafts greedily while its top probability is at least ``p_min`` (0.5 exactly
    goes on, as llama.cpp's ``p < p_min`` test does), stops after the first token below it, and does
    not feed its last token back; the next call keeps the common prefix and always re-scores one
    token, so its logits are fresh."""
    llm = _FakeLlama("draft.gguf")
    draft = fake_binding.GGUFDraft(llm, draft_max=8, p_min=0.5)
    assert draft(np.asarray([1], dtype=np.intc)).tolist() == [2, 3, 4]  # 4 came at p ~0.27: the last
    assert llm.evals == [[1], [2], [3]] and llm.n_tokens == 3
    assert draft(np.asarray([1, 2, 3], dtype=np.intc)).tolist() == [4]  # the whole prefix kept: [3] again
    assert llm.evals[3:] == [[3]]
    assert draft(np.asarray([1, 2, 6], dtype=np.intc)).tolist() == [0]  # 6 follows 2: from there
    assert llm.evals[4:] == [[6]] and (draft.calls, draft.proposed) == (3, 5)
    short = fake_binding.GGUFDraft(_FakeLlama("draft.gguf"), draft_max=2, p_min=0.0)
    assert short(np.asarray([3], dtype=np.intc)).tolist() == [4, 5] and short.llm.evals == [[3], [4]]
    draft.reset()
    assert (draft.calls, draft.proposed, draft.seconds, llm.n_tokens) == (0, 0, 0.0, 0)


def test_the_runner_loads_each_variant_and_counts_one_generations_calls(fake_binding, tmp_path):
    """Every model gets the job's context, threads and flash attention; the speculative ones score
    every position (``logits_all``, sized by the context); a row counts the target's calls, the
    tokens they scored and the prompt's pass of the generation it describes, passes the sampler
    llama.cpp's settings (top-k and min-p off), the seed and the penalty, and stops at
    ``max_new`` or an end-of-sequence token."""
    runner = fake_binding.LlamaCppRunner.load(tmp_path / "t.gguf", ["plain", "spec", "lookup"], draft="d",
                                              eos_ids=frozenset({0}), threads=3, n_ctx=4096)
    target, draft_llm, spec, lookup = _FakeLlama.made
    for llm in _FakeLlama.made:
        assert llm.kwargs["n_ctx"] == 4096 and llm.kwargs["n_threads"] == llm.kwargs["n_threads_batch"] == 3
        assert llm.kwargs["flash_attn"] is True
    assert not target.kwargs.get("logits_all") and not draft_llm.kwargs.get("logits_all")
    assert spec.kwargs["logits_all"] and lookup.kwargs["logits_all"] and lookup.kwargs["draft_model"] == "lookup drafter"
    assert spec.kwargs["draft_model"] is runner.draft and runner.draft.llm is draft_llm
    assert runner.draft_gguf == tmp_path / "draft.gguf"
    row = runner.generate("plain", [1, 1, 1, 2], temperature=0.7, seed=11, max_new=3, top_p=0.9, repetition_penalty=1.2)
    assert target.seed == 11 and target.generate_kwargs == dict(temp=0.7, top_k=0, top_p=0.9, min_p=0.0, typical_p=1.0,
                                                                repeat_penalty=1.2)
    assert (row["generated_tokens"], row["finish_reason"]) == (3, "length")  # 3, 4, 5
    assert (row["target_calls"], row["target_tokens_scored"], row["prefill_s"]) == (3, 6, 4.0)
    row = runner.generate("plain", [5], temperature=0.0, seed=1, max_new=10)  # 6, then 0: the end
    assert (row["generated_tokens"], row["finish_reason"], row["target_calls"], row["target_tokens_scored"]) == (2, "eos", 2, 2)
    assert row["prefill_s"] == 1.0 and target.generate_kwargs["repeat_penalty"] == 1.0


def test_context_for_a_need_of_exactly_a_multiple_of_256_is_that_multiple():
    from specdec.bench.llamacpp import context_for

    assert context_for(2_159, 128, 16) == 2_304  # 2,159 + 128 + 16 + 1 = 2,304 exactly: no extra 256


def test_the_runner_passes_draft_max_and_p_min_on_to_its_draft(fake_binding, tmp_path):
    runner = fake_binding.LlamaCppRunner.load(tmp_path / "t.gguf", ["spec"], draft="d", eos_ids=frozenset({0}),
                                              threads=1, draft_max=5, p_min=0.3)
    assert (runner.draft.draft_max, runner.draft.p_min) == (5, 0.3)


def test_a_plain_row_times_the_first_token_and_fingerprints_every_token(fake_binding, tmp_path):
    """On the fake clock (a scored token costs a second): prompt [1, 1, 1, 2] then 3, 4, 5; the first
    token comes after the prompt's 4 s, the last after 6 s; calls 3; the fingerprint is of all 3 tokens."""
    runner = fake_binding.LlamaCppRunner.load(tmp_path / "t.gguf", ["plain"], draft="d", eos_ids=frozenset({0}), threads=1)
    row = runner.generate("plain", [1, 1, 1, 2], temperature=0.0, seed=0, max_new=3)
    assert (row["ttft_s"], row["wall_s"], row["tokens_per_s"]) == (4.0, 6.0, 0.5)
    assert (row["prompt_tokens"], row["tokens_per_target_call"]) == (4, 1.0)
    assert row["tokens_sha1"] == fake_binding.tokens_sha1([3, 4, 5])


def test_every_generation_starts_from_an_empty_context(fake_binding, tmp_path, monkeypatch):
    """No prompt-prefix reuse between generations: the model is reset before each one."""
    runner = fake_binding.LlamaCppRunner.load(tmp_path / "t.gguf", ["plain"], draft="d", eos_ids=frozenset({0}), threads=1)
    seen, real = [], _FakeLlama.generate

    def generate(self, ids, **kwargs):
        seen.append(self.n_tokens)
        return real(self, ids, **kwargs)

    monkeypatch.setattr(_FakeLlama, "generate", generate)
    runner.generate("plain", [1, 2], temperature=0.0, seed=0, max_new=2)
    runner.generate("plain", [1, 2], temperature=0.0, seed=0, max_new=2)
    assert seen == [0, 0]


def _speculative_generate(self, ids, **kwargs):
    """The binding's loop, scripted: score the prompt, then each time the draft's proposal after the
    newest token is scored with it in one call (the draft drafts the target's greedy tokens, so all are kept)."""
    self.generate_kwargs = kwargs
    seq = list(ids)
    self.eval(ids)
    while True:
        tok = int(np.argmax(self.last_logits()))
        yield tok
        seq.append(tok)
        drafted = self.kwargs["draft_model"](np.asarray(seq, dtype=np.intc)).tolist()
        self.eval([tok, *drafted])
        seq.extend(drafted)
        yield from drafted


def test_a_speculative_row_counts_its_own_generations_draft_only(fake_binding, tmp_path, monkeypatch):
    """Prompt [1]: the target scores [1] -> 2; the draft proposes 3, 4 (4 at p ~0.22 < 0.75 ends it),
    scored as [2, 3, 4] -> 5; then 6, 0 (the end) scored as [5, 6, 0]: 6 tokens in 3 calls, 4 proposed
    in 2 draft calls, 6 - 3 = 3 counted accepted (rate 3 / 4); the next generation counts afresh."""
    monkeypatch.setattr(_FakeLlama, "generate", _speculative_generate)
    runner = fake_binding.LlamaCppRunner.load(tmp_path / "t.gguf", ["spec"], draft="d", eos_ids=frozenset({0}), threads=1)
    for _ in range(2):
        row = runner.generate("spec", [1], temperature=0.0, seed=0, max_new=16)
        assert (row["generated_tokens"], row["target_calls"], row["finish_reason"]) == (6, 3, "eos")
        assert (row["draft_tokens_proposed"], row["draft_calls"], row["draft_tokens_accepted"]) == (4, 2, 3)
        assert row["acceptance_rate"] == 0.75


def test_run_rows_passes_the_sampling_settings_on_in_the_order_given(fake_binding, tmp_path):
    runner = fake_binding.LlamaCppRunner.load(tmp_path / "t.gguf", ["plain", "lookup"], draft="d",
                                              eos_ids=frozenset({0}), threads=1)
    rows = fake_binding.run_rows(runner, ["lookup", "plain"], [1, 2], temperature=0.7, seed=3, max_new=2, top_p=0.9,
                                 repetition_penalty=1.3, make_row=lambda v, stats: v)
    assert rows == ["lookup", "plain"]
    for llm in _FakeLlama.made:
        assert (llm.seed, llm.generate_kwargs["top_p"], llm.generate_kwargs["repeat_penalty"]) == (3, 0.9, 1.3)


def test_an_unknown_variant_is_refused_when_loading(fake_binding, tmp_path):
    with pytest.raises(ValueError, match="unknown llama.cpp variant 'medusa'"):
        fake_binding.LlamaCppRunner.load(tmp_path / "t.gguf", ["plain", "medusa"], draft="d", eos_ids=frozenset(), threads=1)


# ----------------------------------------------------------------------------- GGUF export


def test_rope_reordering_refuses_an_odd_head_size():
    """12 rows in 4 heads is 3 features a head: no halves to pair (a SpecdecError, not numpy's ValueError)."""
    with pytest.raises(SpecdecError, match="heads of even size"):
        rope_halves_to_pairs(np.zeros((12, 4)), 4)


VOCAB, HIDDEN, HEADS, KV, HEAD_DIM = 16, 16, 2, 1, 4  # head_dim given, not hidden / heads (8)


def _reference(path):
    """A GGUF holding only what export_llama reads of the target's: its vocabulary size and tokenizer."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _llama(folder, *, tied=True, **config):
    """A one-layer Llama folder written by hand (config.json + model.safetensors)."""
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
           "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HEAD_DIM,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 128,
           "tie_word_embeddings": tied, **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(0)
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,),
              "model.layers.0.input_layernorm.weight": (HIDDEN,), "model.layers.0.post_attention_layernorm.weight": (HIDDEN,),
              "model.layers.0.self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
              "model.layers.0.self_attn.k_proj.weight": (KV * HEAD_DIM, HIDDEN),
              "model.layers.0.self_attn.v_proj.weight": (KV * HEAD_DIM, HIDDEN),
              "model.layers.0.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
              "model.layers.0.mlp.gate_proj.weight": (2 * HIDDEN, HIDDEN),
              "model.layers.0.mlp.up_proj.weight": (2 * HIDDEN, HIDDEN),
              "model.layers.0.mlp.down_proj.weight": (HIDDEN, 2 * HIDDEN)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    save_file({k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}, str(folder / "model.safetensors"))
    return folder


def test_an_export_writes_the_configs_head_size_rope_base_file_type_and_untied_head(tmp_path):
    """head_dim from the config (not hidden / heads), the config's rope_theta, the float16 file type,
    and an untied LM head written as output.weight."""
    import gguf

    out = export_llama(_llama(tmp_path / "m", tied=False), tmp_path / "m.gguf", tokenizer_from=_reference(tmp_path / "r.gguf"))
    reader = gguf.GGUFReader(str(out))
    assert reader.fields["llama.rope.dimension_count"].contents() == HEAD_DIM
    assert reader.fields["llama.rope.freq_base"].contents() == 500000.0
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_F16)
    assert "output.weight" in {t.name for t in reader.tensors}


@pytest.mark.parametrize("config, says", [
    ({"model_type": "mistral"}, "only llama is supported"),
    ({"vocab_size": VOCAB + 1}, "vocabulary sizes differ"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0}}, "only the default rotary embedding"),
])
def test_an_export_refuses_what_llama_cpp_would_run_differently(tmp_path, config, says):
    with pytest.raises(SpecdecError, match=says):
        export_llama(_llama(tmp_path / "m", **config), tmp_path / "m.gguf", tokenizer_from=_reference(tmp_path / "r.gguf"))
    assert not list(tmp_path.glob("m.gguf*"))


def test_an_export_stopped_midway_leaves_no_file_at_its_name(tmp_path, monkeypatch):
    """The GGUF appears under its name only once whole: draft_gguf would reuse a cut file for good."""
    import gguf

    folder, ref = _llama(tmp_path / "m"), _reference(tmp_path / "r.gguf")

    def fail(self, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(KeyboardInterrupt):
        export_llama(folder, tmp_path / "m.gguf", tokenizer_from=ref)
    assert not (tmp_path / "m.gguf").exists()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """draft_gguf with the registry and the export scripted: ``calls`` lists each export's (folder, tokenizer, dtype)."""
    from specdec.models import registry

    folder = tmp_path / "draft"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    calls, asked = [], []

    def export(folder, out, *, tokenizer_from, dtype="float16"):
        calls.append((folder, tokenizer_from, dtype))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"gguf")
        return out

    def resolve(ref):
        asked.append(ref)
        return types.SimpleNamespace(folder=folder)

    monkeypatch.setattr(registry, "resolve", resolve)
    monkeypatch.setattr(registry, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(gguf_export, "export_llama", export)
    return types.SimpleNamespace(folder=folder, calls=calls, asked=asked)


def test_draft_gguf_converts_once_per_draft_target_and_dtype(cache, tmp_path):
    """The draft model of ``NAME+lookup`` is NAME; a second call reuses the file; another target's
    tokenizer, another dtype (passed on) or new weights convert again."""
    import os

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first = gguf_export.draft_gguf("mine+lookup", a)
    assert cache.asked == ["mine"] and cache.calls == [(cache.folder, a, "float16")]
    assert gguf_export.draft_gguf("mine", a) == first and len(cache.calls) == 1
    assert gguf_export.draft_gguf("mine", b) != first and cache.calls[-1][1] == b
    assert gguf_export.draft_gguf("mine", a, dtype="float32") != first and cache.calls[-1][2] == "float32"
    weights = cache.folder / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # retrained: the same size, a later time
    assert gguf_export.draft_gguf("mine", a) != first and len(cache.calls) == 4


def test_draft_gguf_refuses_a_folder_without_weights(cache, tmp_path):
    (cache.folder / "model.safetensors").unlink()
    with pytest.raises(SpecdecError, match="has no model.safetensors to convert"):
        gguf_export.draft_gguf("mine", tmp_path / "a.gguf")
    assert cache.calls == []


def _export(tmp_path, **config):
    import gguf

    folder = _llama(tmp_path / "m", **config)
    out = export_llama(folder, tmp_path / "m.gguf", tokenizer_from=_reference(tmp_path / "r.gguf"))
    return folder, gguf.GGUFReader(str(out))


def test_an_export_takes_the_rope_base_from_rope_parameters(tmp_path):
    """transformers 5 keeps the base in rope_parameters (the bundled draft's config does): it wins over
    the default 10000 when the config has no top-level rope_theta."""
    _, reader = _export(tmp_path, rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 250000.0})
    assert reader.fields["llama.rope.freq_base"].contents() == 250000.0


def test_key_rows_are_paired_within_each_key_value_head_not_each_query_head(tmp_path):
    """One key/value head of 4 features (HEADS = 2 query heads): rows (0, 1, 2, 3) become (0, 2, 1, 3)
    -- feature j pairs with j + 2; split by the query heads' count they would stay put."""
    from safetensors.numpy import load_file

    assert (KV, HEAD_DIM) == (1, 4)
    folder, reader = _export(tmp_path)
    k = load_file(str(folder / "model.safetensors"))["model.layers.0.self_attn.k_proj.weight"]
    [got] = [t for t in reader.tensors if t.name == "blk.0.attn_k.weight"]
    want = k[[0, 2, 1, 3]].astype(np.float16)
    assert np.array_equal(np.asarray(got.data).reshape(want.shape), want)


def test_a_float16_export_keeps_the_norms_in_float32(tmp_path):
    _, reader = _export(tmp_path)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.attn_norm.weight"] == kinds["blk.0.ffn_norm.weight"] == kinds["output_norm.weight"] == "F32"
    assert kinds["blk.0.attn_k.weight"] == kinds["token_embd.weight"] == "F16"


@pytest.mark.parametrize("config", [
    # transformers 4.x writes the scaling under "rope_scaling" (Llama 3.x: rope_type llama3)
    {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}},
    {"rope_scaling": {"type": "linear", "factor": 2.0}},  # the older spelling of the scaling kind
    {"rope_parameters": {"type": "linear", "factor": 2.0, "rope_theta": 500000.0}},
])
def test_an_export_refuses_rope_scaling_in_either_spelling(tmp_path, config):
    """Scaled rotary embeddings run differently in llama.cpp's default ``llama`` rope: refused
    whichever key (rope_parameters / rope_scaling) and field (rope_type / type) the config uses,
    as the native backend reads them."""
    with pytest.raises(SpecdecError, match="only the default rotary embedding"):
        export_llama(_llama(tmp_path / "m", **config), tmp_path / "m.gguf", tokenizer_from=_reference(tmp_path / "r.gguf"))
    assert not list(tmp_path.glob("m.gguf*"))
