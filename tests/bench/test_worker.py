"""The bench worker (specdec.bench.worker), run in this process on a tiny random model (no worker
process, rows caught from ``_emit``): which rows a job makes and how they are labelled, how prompts
are encoded, the job's threads, what Hugging Face ``generate`` and llama.cpp are asked for (fakes),
and the end-of-sequence ids the Hugging Face rows stop at."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specdec.bench import report, worker
from specdec.bench.workloads import BUILTIN


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny import make_tiny

    return str(make_tiny(tmp_path_factory.mktemp("tiny") / "m"))


@pytest.fixture
def rows(monkeypatch):
    out = []
    monkeypatch.setattr(worker, "_emit", out.append)
    return out


def _job(tiny, **kw):
    return worker.Job(target=tiny, draft=kw.pop("draft", tiny), prompts=[], max_new_tokens=3, gammas=["2"], **kw)


CODE = BUILTIN[0]
CHAT = next(p for p in BUILTIN if p.chat)


def test_coupled_gets_its_own_plain_reference_only_above_temperature_zero(tiny, rows):
    """``--methods coupled`` at T = 0 and T = 1: the coupled plain reference runs at T = 1 only (at
    T = 0 every rule is greedy decoding); ``default`` is the rule ``generate`` would pick at each T
    (greedy at 0, block without a seed at T > 0); one drafter: rows do not name it."""
    worker.run_engine(_job(tiny, mode="speculative", temperatures=[0.0, 1.0], methods=["default", "coupled"]), [CODE])
    samples = [r for r in rows if "mode" in r]
    refs = [(r["temperature"], r["mode"]) for r in samples if r["mode"] != "speculative"]
    assert sorted(refs) == [(0.0, "plain_paired"), (1.0, "plain_paired"), (1.0, report.PAIRED_COUPLED)]
    spec = {(r["temperature"], r["method"]) for r in samples if r["mode"] == "speculative"}
    assert spec == {(0.0, "greedy"), (0.0, "coupled"), (1.0, "block"), (1.0, "coupled")}
    assert not any("draft" in r for r in samples)


def test_a_chat_prompt_is_encoded_with_the_chat_template_and_plain_rows_name_their_mode(tiny, rows):
    """A chat prompt reaches the model through its chat template (as ``generate --chat``), a code
    prompt as raw text; the plain mode's rows say ``plain`` as their method and the rule apart."""
    from specdec.models.registry import load_tokenizer
    from specdec.text import encode_prompt

    worker.run_engine(_job(tiny, mode="plain", draft="none", temperatures=[0.0]), [CODE, CHAT])
    tok = load_tokenizer(Path(tiny))
    samples = {r["prompt_id"]: r for r in rows if "mode" in r}
    want = len(encode_prompt(tok, CHAT.text, chat=True))
    assert want != len(encode_prompt(tok, CHAT.text, chat=False))  # the premise
    assert samples[CHAT.id]["prompt_tokens"] == want
    assert samples[CODE.id]["prompt_tokens"] == len(encode_prompt(tok, CODE.text, chat=False))
    assert {(r["method"], r["rule"]) for r in samples.values()} == {("plain", "greedy")}


def test_the_worker_runs_with_the_jobs_threads(monkeypatch):
    """``threads`` in the job sets torch's threads before anything runs (the bench's --threads)."""
    ran, threads = [], []
    spec = {"mode": "plain", "target": "t", "draft": "none", "prompts": [], "temperatures": [0.0], "threads": 3}
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(spec)))
    monkeypatch.setattr(worker, "run_engine", lambda job, prompts: ran.append(job.mode))
    monkeypatch.setattr(worker, "_emit", lambda row: None)
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    assert worker.main() == 0 and ran == ["plain"] and threads == [3]


class FakeHF:
    """transformers' model as run_hf uses it: generate records its arguments, writes two tokens."""

    calls: list[dict] = []

    def __init__(self):
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(eos_token_id=2)
        self.generation_config = SimpleNamespace(num_assistant_tokens=5)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls()

    def eval(self):
        return self

    def generate(self, x, attention_mask, streamer, **kwargs):
        FakeHF.calls.append(kwargs)
        streamer.put(x)  # the prompt
        streamer.put(torch.tensor([5]))
        streamer.put(torch.tensor([6]))
        return torch.cat([x, torch.tensor([[5, 6]])], dim=1)


def test_hf_rows_sample_from_the_whole_distribution_and_time_the_first_token(tiny, rows, monkeypatch):
    """At T > 0 Hugging Face samples with top-k off (its default would keep 50 tokens) and top-p 1
    unless set; greedy at T = 0; TTFT is taken at the first generated token (a fake clock ticking
    one second per reading: start 0, first token 1, end 2)."""
    import transformers

    FakeHF.calls = []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", FakeHF.from_pretrained)
    clock = itertools.count()
    monkeypatch.setattr(worker, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    worker.run_hf(_job(tiny, mode="hf_plain", temperatures=[0.0, 1.0]), [CODE])
    hot = [c for c in FakeHF.calls if c["do_sample"]]
    cold = [c for c in FakeHF.calls if not c["do_sample"]]
    assert hot and all(c["top_k"] == 0 and c["top_p"] == 1.0 and c["temperature"] == 1.0 for c in hot)
    assert cold and not any("temperature" in c for c in cold)
    samples = [r for r in rows if "mode" in r]
    assert [(r["generated_tokens"], r["ttft_s"], r["wall_s"]) for r in samples] == [(2, 1.0, 2.0)] * 2


def test_llamacpp_rows_pass_top_p_only_above_zero_and_spec_settings_on_spec_rows_only(rows, monkeypatch):
    """llama.cpp's rows: top-p reaches llama.cpp at T > 0 only (greedy at T = 0, as specdec's rows);
    ``draft_max`` / ``draft_p_min`` label the ``spec`` variant's rows, not ``plain`` or ``lookup``."""
    from specdec.bench import llamacpp

    seen = []

    def run_rows(runner, variants, ids, *, temperature, seed, max_new, top_p, repetition_penalty, make_row):
        seen.append((temperature, top_p))
        return [make_row(v, {"generated_tokens": 1}) for v in variants]

    monkeypatch.setattr(llamacpp, "run_rows", run_rows)
    job = worker.Job(mode="speculative", target="t", draft="d", prompts=[], temperatures=[0.0, 1.0], top_p=0.9,
                     llamacpp=["plain", "spec", "lookup"], llamacpp_draft_max=8, llamacpp_p_min=0.5)
    for t in (0.0, 1.0):
        worker._llamacpp_rows(job, None, CODE, [1, 2], t, 0)
    assert seen == [(0.0, None), (1.0, 0.9)]
    labels = {r["mode"]: (r.get("draft_max"), r.get("draft_p_min")) for r in rows}
    assert labels == {"llamacpp_plain": (None, None), "llamacpp_spec": (8, 0.5), "llamacpp_lookup": (None, None)}


def test_the_llamacpp_context_holds_the_longest_prompt_the_reply_and_one_draft(monkeypatch):
    """The runner's context is sized for the longest prompt, max_new_tokens and one draft of the
    job's ``llamacpp_draft_max`` (a bigger draft than the default needs a bigger context)."""
    from specdec.bench import llamacpp
    from specdec.models import registry

    loaded = {}
    monkeypatch.setattr(registry, "gguf_file", lambda target: "t.gguf")
    monkeypatch.setattr(llamacpp.LlamaCppRunner, "load", classmethod(lambda cls, *a, **kw: loaded.update(kw) or "runner"))
    job = worker.Job(mode="llamacpp", target="t", draft="d", prompts=[], temperatures=[0.0], max_new_tokens=100,
                     llamacpp=["spec"], llamacpp_draft_max=300, threads=2)
    assert worker._llamacpp_runner(job, frozenset({2}), {"a": [0] * 1900, "b": [0] * 10}) == "runner"
    assert llamacpp.context_for(1900, 100, 300) != llamacpp.context_for(1900, 100, 0)  # the premise
    assert loaded["n_ctx"] == llamacpp.context_for(1900, 100, 300)
    assert (loaded["draft_max"], loaded["p_min"], loaded["threads"]) == (300, job.llamacpp_p_min, 2)


def test_hf_rows_run_on_a_target_whose_config_lists_several_eos_ids(tmp_path, rows):
    """A config.json listing several end-of-sequence ids (as Llama 3's): the Hugging Face rows run
    (the ids were put in a set beside the tokenizer's: a list is unhashable) and stop at every id
    specdec's own rows stop at (the config's list, generation_config.json's and the tokenizer's)."""
    import transformers

    from tiny import make_tiny

    folder = make_tiny(tmp_path / "m")
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = [2, 5]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    seen = []
    real = transformers.GenerationMixin.generate

    def generate(self, *args, **kwargs):
        seen.append(kwargs["eos_token_id"])
        return real(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformers.GenerationMixin, "generate", generate)
        worker.run_hf(worker.Job(mode="hf_plain", target=str(folder), draft="none", prompts=[], temperatures=[0.0],
                                 max_new_tokens=3), [CODE])
    from specdec.models.registry import load_tokenizer

    want = sorted({2, 5, 7, load_tokenizer(folder).eos_token_id})
    assert [r["mode"] for r in rows if "mode" in r] == ["hf_plain"] and seen and all(ids == want for ids in seen)
