"""The llama.cpp bench rows against the real models (skipped without the ``llamacpp`` extra):
the draft converted to GGUF computes what the native draft computes, and llama.cpp's speculative
rows emit the same greedy tokens as its plain row."""

from __future__ import annotations

import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")

from specdec.bench.gguf_export import draft_gguf  # noqa: E402
from specdec.bench.llamacpp import LlamaCppRunner  # noqa: E402
from specdec.models.registry import gguf_file, load  # noqa: E402
from specdec.text import encode_prompt  # noqa: E402

PROMPTS = [
    ("def flatten(nested):\n    \"\"\"Yield the items of nested lists, depth first.\"\"\"\n", False),
    ("Give me three tips for writing clear emails.", True),
]


@pytest.fixture(scope="module")
def draft():
    return load("smollm2-135m-draft")


@pytest.fixture(scope="module")
def ids(draft):
    return [encode_prompt(draft.tokenizer, p, chat=c) for p, c in PROMPTS]


def test_converted_draft_matches_the_native_draft(draft, ids):
    path = draft_gguf("smollm2-135m-draft", gguf_file("smollm2-135m"))
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=1, logits_all=True, verbose=False)
    for prompt in ids:
        llm.reset()
        llm.eval(prompt)
        ours = torch.from_numpy(llm.scores[: len(prompt)].copy())  # [n, V]
        with torch.no_grad():
            ref = draft.model.forward(torch.tensor(prompt), draft.model.new_cache(512))  # [n, V]
        # llama.cpp rounds activations to float16 for float16 weights: close, not equal
        assert (ours - ref).abs().max().item() < 0.25
        assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.95


def test_llamacpp_speculative_rows_keep_plain_greedy_output(draft, ids):
    runner = LlamaCppRunner.load(gguf_file("smollm2-135m"), ["plain", "spec", "lookup"], draft="smollm2-135m-draft",
                                 eos_ids=draft.eos_ids, threads=1)  # one thread: llama.cpp's spin against a second worker
    for prompt in ids:
        rows = {v: runner.generate(v, prompt, temperature=0.0, seed=0, max_new=48) for v in ("plain", "spec", "lookup")}
        assert rows["plain"]["tokens_per_target_call"] == 1.0
        assert rows["spec"]["tokens_sha1"] == rows["plain"]["tokens_sha1"]
        assert rows["lookup"]["tokens_sha1"] == rows["plain"]["tokens_sha1"]
        assert rows["spec"]["tokens_per_target_call"] > 1.2  # the converted draft really drafts
        assert rows["spec"]["draft_tokens_proposed"] >= rows["spec"]["draft_tokens_accepted"] > 0
    # seeded sampling is reproducible (below: prompts past the binding's 512-row logits buffer)
    a = runner.generate("plain", ids[1], temperature=1.0, seed=3, max_new=32)
    b = runner.generate("plain", ids[1], temperature=1.0, seed=3, max_new=32)
    assert a["tokens_sha1"] == b["tokens_sha1"]


def test_llamacpp_speculative_rows_run_past_512_positions(draft, ids):
    # the binding sized its buffer of every position's logits (which a draft model turns on) by
    # n_batch, 512 rows: a prompt and reply past that failed inside eval
    long = (ids[0] * 60)[:600]  # [600] token ids
    assert len(long) == 600
    runner = LlamaCppRunner.load(gguf_file("smollm2-135m"), ["plain", "spec", "lookup"], draft="smollm2-135m-draft",
                                 eos_ids=draft.eos_ids, threads=1)
    rows = {v: runner.generate(v, long, temperature=0.0, seed=0, max_new=32) for v in ("plain", "spec", "lookup")}
    for v, row in rows.items():
        assert row["prompt_tokens"] == 600
        assert row["generated_tokens"] == 32 or row["finish_reason"] == "eos", v
    # not compared with plain's tokens: past a few hundred positions llama.cpp's own speculative
    # output is not always its plain output (NOTES.md, "Long prompts")
