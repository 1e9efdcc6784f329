"""Batch generation on the real 4-bit SmolLM2-135M target: every result is the prompt decoded
alone, speculatively with the shipped draft (greedy, and seeded sampling's coupled rule)."""

from __future__ import annotations

from dataclasses import replace

from specdec.drafters import ModelDrafter
from specdec.engine import Engine
from specdec.sampling import SamplingConfig

PROMPTS = ["What is a hash table?", "Write a haiku about rain.", "def fibonacci(n):", "List three uses of copper.",
           "Explain recursion to a child."]


def test_batched_results_equal_speculative_decoding_alone(q4_target, smollm2):
    plain = Engine(q4_target, None, "none")
    speculative = Engine(q4_target, ModelDrafter(smollm2[1].model), "smollm2-135m-draft")
    for sampling in (SamplingConfig(temperature=0.0, max_new_tokens=40), SamplingConfig(temperature=1.0, max_new_tokens=40, seed=3)):
        got = plain.generate_batch(PROMPTS, sampling, batch=3, chat=True)
        for i, (prompt, res) in enumerate(zip(PROMPTS, got)):
            alone = speculative.generate(prompt, replace(sampling, seed=res.seed if sampling.seed is not None else None), chat=True,
                                         gamma=3)
            assert res.token_ids == alone.token_ids and res.text == alone.text, (sampling.temperature, i)
            assert alone.stats.target_calls < len(alone.token_ids)  # it did speculate
