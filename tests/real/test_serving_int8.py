"""The int8 SmolLM2-135M target as a server runs it: batched passes and prefix-cache prefills are
bitwise what the target computes alone, on each int8 kernel; and the mixed kernel (fbgemm for
few rows, oneDNN for many: the default on a CPU with AMX) is the fbgemm target bit for bit."""

from __future__ import annotations

import threading

import pytest
import torch

from specdec.models.linear import _has_vnni, mixed_available, onednn_int8_available, w8a8_available
from specdec.models.registry import load
from specdec.server.prefix_cache import PrefixCache
from specdec.server.scheduler import BatchedModel, Scheduler, SchedulerConfig
from specdec.text import encode_prompt

KERNELS = [
    pytest.param("fbgemm", marks=pytest.mark.skipif(not w8a8_available(), reason="no fbgemm int8 engine")),
    pytest.param("onednn", marks=pytest.mark.skipif(not (onednn_int8_available() and _has_vnni()),
                                                      reason="no oneDNN int8 linear, or no VNNI")),
    pytest.param("mixed", marks=pytest.mark.skipif(not mixed_available(), reason="no mixed int8 kernel here")),
]
SYSTEM = "You are a careful assistant. Answer briefly and exactly."
QUESTIONS = ["What is a hash table?", "Explain recursion to a child.", "Name three sorting algorithms."]


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_batched_prefix_cached_prefills_are_bitwise_solo_on_int8_weights(smollm2, kernel):
    target = load("smollm2-135m", quant="int8", batch_invariant=True, int8_kernel=kernel)
    model = target.model
    assert model.int8_kernel == kernel
    tok = target.tokenizer
    prompts = [torch.tensor(encode_prompt(tok, q, chat=True, system=SYSTEM)) for q in QUESTIONS]  # [n] each, shared system part
    steps = [torch.tensor([tok.encode(" The")[0]]), torch.tensor(tok.encode(" answer is")[:2])]

    solo = []
    for p in prompts:
        c = model.new_cache(256)
        solo.append([model.forward(p, c, last_only=True)] + [model.forward(s, c) for s in steps])

    pc = PrefixCache(64 << 20)
    served = BatchedModel(model, Scheduler(model, SchedulerConfig(max_tokens=64, chunk=16)), prefix_cache=pc)
    got: list[list[torch.Tensor] | None] = [None] * (2 * len(prompts))

    def run(i: int) -> None:
        c = served.new_cache(256)
        p = prompts[i % len(prompts)]
        got[i] = [served.forward(p, c, last_only=True)] + [served.forward(s, c) for s in steps]

    for wave in (range(len(prompts)), range(len(prompts), 2 * len(prompts))):  # stored, then reused
        threads = [threading.Thread(target=run, args=(i,)) for i in wave]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i, out in enumerate(got):
        ref = solo[i % len(prompts)]
        assert out is not None and all(torch.equal(a, b) for a, b in zip(out, ref)), i
    assert pc.hits >= len(prompts) and pc.reused_tokens > 0


@pytest.mark.slow
@pytest.mark.skipif(not mixed_available(), reason="no mixed int8 kernel here")
def test_mixed_kernel_is_the_fbgemm_target_bit_for_bit(smollm2):
    """Passes of 1 to 33 rows (single steps, verification blocks, a tree, a prefill) give bitwise
    the fbgemm target's logits and keys/values, whichever kernel ran each matrix: SmolLM2's LM head
    switches to oneDNN at 3 rows, its MLP at 5 and 9, its attention projections at 14 and 23."""
    mixed = load("smollm2-135m", quant="int8", batch_invariant=True, int8_kernel="mixed").model
    fb = load("smollm2-135m", quant="int8", batch_invariant=True, int8_kernel="fbgemm").model
    assert mixed.int8_kernel == "mixed" and fb.int8_kernel == "fbgemm"
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, mixed.vocab_size, (40,), generator=g)
    blocks = [torch.randint(0, mixed.vocab_size, (n,), generator=g) for n in (1, 3, 5, 9, 17, 33, 1)]
    parents = torch.tensor([-1, -1, 0, 1, 2, 2, 3, 4, 5])  # a 9-node tree after the blocks
    tree = torch.randint(0, mixed.vocab_size, (parents.numel(),), generator=g)
    outs = {}
    for name, m in (("mixed", mixed), ("fbgemm", fb)):
        c = m.new_cache(256)
        got = [m.forward(prompt, c)] + [m.forward(b, c) for b in blocks]
        got.append(m.forward_tree(tree, parents, c))
        outs[name] = (got, c.k[:, :, : c.length].clone(), c.v[:, :, : c.length].clone())
    for a, b in zip(outs["mixed"][0], outs["fbgemm"][0]):
        assert torch.equal(a, b)
    assert torch.equal(outs["mixed"][1], outs["fbgemm"][1]) and torch.equal(outs["mixed"][2], outs["fbgemm"][2])
