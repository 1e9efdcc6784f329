"""The quantised targets' fused layer loop (``torch.ops.specdec.fused_layers``, ``csrc/layers.cpp``).

Decoding steps, chain and tree verification passes and a batching server's passes of a 4-bit or
int8 (W8A8, few-row kernel) model run the whole layer loop in one compiled call; masked prefills
and passes beyond the int8 kernel's rows stay on the TorchScript loop.  The two must agree bit for
bit — otherwise a pass on one and a pass on the other would score the same tokens differently —
so every test here compares the fused call with the TorchScript loop on the same weights and
cache: logits and every key and value written, for 1-17 rows after a prompt, token trees and
batched passes of several sequences, for
Llama, Qwen2 (biased query/key/value), Qwen3 (query and key head norms) and Gemma 3 (output norms,
tanh-GELU, a second rotary table; its reference is the Python loop) layouts, 4-bit and int8 layers
(with SmoothQuant factors), and for the layer subsets self-speculative drafts run (skipped sub-layers, their own
cache slots).  Batch invariance of the fused call itself (a block = its tokens one by one) is
``test_quantized.py``'s block test, which now runs on it for 4-bit and int8 models.
"""

from __future__ import annotations

import pytest
import torch

from specdec.models import kernels
from specdec.models import linear as linear_mod
from specdec.models.linear import vnni_available, w8a8_available
from specdec.models.native import NativeCausalLM
from tiny import make_tiny, on_python_loop, tiny_llama_weights

pytestmark = pytest.mark.skipif(not (kernels.q4_available() and w8a8_available()),
                                reason="the quantised targets need the kernel library and fbgemm")

# q6: the 4-bit target with its value projections and one down projection from Q6_K blocks
MODELS = [("llama", 32, "q4"), ("qwen2", 32, "q4"), ("llama", 128, "q4"), ("llama", 32, "int8"), ("qwen2", 128, "int8"),
          ("qwen2", 256, "q6"), ("qwen3", 64, "q4"), ("qwen3", 128, "int8"), ("gemma3", 64, "q4"), ("gemma3", 128, "int8")]


@pytest.fixture(scope="module", params=MODELS, ids=[f"{a}-d{h // 4}-{q}" for a, h, q in MODELS])
def q4_model(request, tmp_path_factory):
    arch, hidden, quant = request.param
    if quant == "int8" and not vnni_available():
        pytest.skip("the int8 few-row kernel needs 512-bit VNNI, or AVX2 on a CPU without VNNI")
    # (Gemma 3: random norm gains, so its output norms' gains are not all the same)
    folder = make_tiny(tmp_path_factory.mktemp(f"{arch}{hidden}"), model_type=arch, hidden=hidden, layers=3,
                       norms=arch == "gemma3")
    gguf = None
    if quant == "q6":
        from tests.models.test_q6 import write_q6_gguf

        gguf, quant = write_q6_gguf(folder / "m.gguf", hidden=hidden, layers=3), "q4"
    # int8: the calibration pass gives SmoothQuant factors (the layers' smooth inputs)
    model = NativeCausalLM.from_folder(folder, batch_invariant=True, quant=quant, int8_kernel="fbgemm", gguf=gguf)
    assert gguf is None or model.layers[0].down.packed6.numel() > 0
    if model.scripted is None or model.scripted.fused is None:
        pytest.skip("TorchScript or the fused loop is not available here")
    return model


@pytest.fixture(autouse=True)
def _every_row_count_on_the_int8_kernel(monkeypatch):
    """The int8 kernel's AVX2 build takes every row count by default (linear.AVX2_ROWS) and its VNNI
    build up to 16; here both take 16, so the same cases run on either CPU and passes of more rows
    still check the unfused loop's fbgemm path against the fused one's."""
    monkeypatch.setattr(linear_mod, "AVX2_ROWS", linear_mod.VNNI_ROWS)


def _unfused(model, run):
    """``run()`` with the fused call switched off: the TorchScript loop (the reference), or for
    Gemma 3, whose layer only the fused call compiles, the Python loop."""
    saved, model.scripted.fused = model.scripted.fused, None
    try:
        return run()
    finally:
        model.scripted.fused = saved


def test_fused_loop_runs_only_for_quantised_layers_on_the_kernels(tmp_path):
    folder = make_tiny(tmp_path / "m", layers=1)
    assert NativeCausalLM.from_folder(folder, batch_invariant=True, quant="q4", int8_kernel="fbgemm").scripted.fused is not None
    int8 = NativeCausalLM.from_folder(folder, batch_invariant=True, quant="int8", int8_kernel="fbgemm").scripted
    assert (int8.fused is not None) == vnni_available()
    assert NativeCausalLM.from_folder(folder, batch_invariant=True).scripted.fused is None  # float32


def test_fused_passes_are_bitwise_the_scripted_loop(q4_model):
    model = q4_model
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 1000, (40,), generator=g)
    for n in (1, 2, 3, 4, 5, 6, 7, 9, 17):
        block = torch.randint(0, 1000, (n,), generator=g)

        def run(block=block) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            cache = model.new_cache(128)
            model.forward(prompt, cache)  # a prefill (TorchScript either way: several rows, per-row attention)
            step = model.forward(prompt[:1], cache)  # a decoding step
            logits = torch.cat([step, model.forward(block, cache)])  # a verification pass of n rows
            return logits, cache.k[:, :, : cache.length].clone(), cache.v[:, :, : cache.length].clone()

        fused, scripted = run(), _unfused(model, run)
        for a, b in zip(fused, scripted):
            assert torch.equal(a, b), n


def test_fused_tree_passes_are_bitwise_the_scripted_loop(q4_model):
    """A tree verification pass (nodes over their paths, read in place by the attention kernel),
    also one scored in two parts (``prefix``: a tree region already in the cache)."""
    model = q4_model
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, 1000, (30,), generator=g)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, -1, 6, 3])  # two roots, depths up to 3
    nodes = torch.randint(0, 1000, (parents.numel(),), generator=g)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = model.new_cache(64)
        model.forward(prompt, cache)
        base = cache.length
        whole = model.forward_tree(nodes, parents, cache)
        cache.truncate(base)
        first = model.forward_tree(nodes[:4], parents[:4], cache)
        rest = model.forward_tree(nodes[4:], parents, cache, prefix=base)
        return torch.cat([whole, first, rest]), cache.k[:, :, : cache.length].clone(), cache.v[:, :, : cache.length].clone()

    fused, scripted = run(), _unfused(model, run)
    for a, b in zip(fused, scripted):
        assert torch.equal(a, b)


def test_fused_batched_passes_are_bitwise_the_scripted_loop(q4_model):
    """A batching server's pass (``forward_batch``): sequences of 1, 4 and 9 rows at different cache
    lengths, the linear layers over all their rows, attention per sequence."""
    model = q4_model
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 1000, (n,), generator=g) for n in (5, 33, 17)]
    blocks = [torch.randint(0, 1000, (n,), generator=g) for n in (1, 4, 9)]

    def run() -> list[torch.Tensor]:
        caches = [model.new_cache(64) for _ in prompts]
        for p, c in zip(prompts, caches):
            model.forward(p, c)
        out = model.forward_batch([(b, c, False) for b, c in zip(blocks, caches)])
        return out + [c.k[:, :, : c.length].clone() for c in caches] + [c.v[:, :, : c.length].clone() for c in caches]

    fused, scripted = run(), _unfused(model, run)
    for a, b in zip(fused, scripted):
        assert torch.equal(a, b)


def test_fused_layer_subsets_are_bitwise_the_scripted_loop(q4_model):
    """``run_layers`` with a plan (self-speculative drafts): skipped attention / MLP sub-layers and
    cache slots other than the layer index, raw residual stream out (no final norm)."""
    model = q4_model
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, model.cfg.hidden_size, generator=g)
    plans = [
        [(0, True, True), (1, False, True), (2, True, False)],  # the second layer's attention skipped, the last's MLP
        [(2, True, True), (0, True, True)],  # any order, cache slots 0 and 1
    ]
    for steps in plans:
        slots = list(range(len(steps)))

        def run(steps=steps, slots=slots) -> tuple[torch.Tensor, torch.Tensor]:
            cache = model.new_cache(32)
            cache.reserve(3)
            first = model.run_layers(x[:3], cache, steps, start=0, slots=slots)
            cache.reserve(2)
            second = model.run_layers(x[3:], cache, steps, start=3, slots=slots)
            return torch.cat([first, second]), cache.k[:, :, :5].clone()

        fused, scripted = run(), _unfused(model, run)
        assert torch.equal(fused[0], scripted[0]) and torch.equal(fused[1], scripted[1])


def test_fused_passes_with_feature_taps_are_bitwise_the_scripted_loop(q4_model):
    """A target-aware drafter's pass (``forward_features``): the residual stream after each tapped
    layer count, copied by the one fused call as it goes, for 1, 3 and 6 rows and taps before,
    inside and between the layers; logits and cache as the plain pass."""
    model = q4_model
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, 1000, (20,), generator=g)
    for taps in ((1,), (0, 2), (1, 2), (0, 1, 2)):
        for n in (1, 3, 6):
            block = torch.randint(0, 1000, (n,), generator=g)

            def run(block=block, taps=taps) -> tuple[torch.Tensor, ...]:
                cache = model.new_cache(64)
                model.forward(prompt, cache)
                logits, feats = model.forward_features(block, cache, taps)
                return logits, feats, cache.k[:, :, : cache.length].clone(), cache.v[:, :, : cache.length].clone()

            fused, scripted = run(), _unfused(model, run)
            for a, b in zip(fused, scripted):
                assert torch.equal(a, b), (taps, n)
            cache = model.new_cache(64)
            model.forward(prompt, cache)
            assert torch.equal(fused[0], model.forward(block, cache))


@pytest.mark.parametrize("taps", [(1,), (0, 2), (1, 2, 3)], ids=["one", "embedding", "last-layer"])
def test_batched_passes_with_feature_taps_are_each_sequences_own_features(q4_model, taps):
    """A batching server's pass that carries feature drafters' sequences (``forward_batch`` with
    ``taps``): each such sequence gets logits and features bitwise what ``forward_features`` gives it
    alone, the others plain logits; fused and TorchScript loops alike (tap 3 = the last layer's
    output, which the fused call does not copy out: that pass runs the Python loop)."""
    model = q4_model
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 1000, (n,), generator=g) for n in (5, 33, 17)]
    blocks = [torch.randint(0, 1000, (n,), generator=g) for n in (1, 4, 9)]
    asked = [taps, None, taps[:1]]

    def caches() -> list:
        out = [model.new_cache(64) for _ in prompts]
        for p, c in zip(prompts, out):
            model.forward(p, c)
        return out

    def run() -> list:
        return model.forward_batch([(b, c, last) for b, c, last in zip(blocks, caches(), (False, False, True))],
                                   taps=asked)

    alone = []
    for b, c, t, last in zip(blocks, caches(), asked, (False, False, True)):
        alone.append(model.forward(b, c, last_only=last) if t is None
                     else model.forward_features(b, c, t, last_only=last))
    for got in (run(), _unfused(model, run)):
        assert isinstance(got[1], torch.Tensor) and torch.equal(got[1], alone[1])
        for i in (0, 2):
            logits, feats = got[i]
            assert feats.shape == (blocks[i].numel(), len(asked[i]) + 1, model.cfg.hidden_size)
            assert torch.equal(logits, alone[i][0]) and torch.equal(feats, alone[i][1]), i


def test_fused_call_refuses_a_cache_too_short():
    with pytest.raises(RuntimeError, match="beyond the cache"):
        k = torch.zeros(1, 1, 4, 8)
        torch.ops.specdec.fused_layers(torch.zeros(2, 8), torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), k, k.clone(), 3, 1,
                                       1, 8, torch.tensor([1e-5]),
                                       torch.classes.specdec.FusedWeights([4] * 4, [torch.empty(0)] * 20, [8] * 4), [], True)


def test_fused_weights_are_checked_once_when_made():
    """The layer weights are one object built per model (a list of ~600 tensors cost ~50 µs of
    dispatch per call); its constructor refuses what the calls used to refuse."""
    with pytest.raises(RuntimeError, match="five tensors"):
        torch.classes.specdec.FusedWeights([4] * 4, [torch.empty(0)] * 19, [8] * 4)
    with pytest.raises(RuntimeError, match="unknown kind"):
        torch.classes.specdec.FusedWeights([4, 4, 4, 7], [torch.empty(0)] * 20, [8] * 4)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.classes.specdec.FusedWeights([4] * 4, [torch.empty(0), torch.zeros(3, dtype=torch.float64)] + [torch.empty(0)] * 18,
                                           [8] * 4)


@pytest.fixture(scope="module")
def fast_q4():
    """A 4-bit model in fast mode (a draft's: masked attention for multi-row passes)."""
    cfg, w = tiny_llama_weights()
    model = NativeCausalLM(cfg, w, quant="q4")
    if model.scripted is None or model.scripted.fused is None:
        pytest.skip("the fused layer call needs the compiled kernels")
    return model


def test_fast_mode_passes_of_a_fused_model_are_bitwise_the_python_loop(fast_q4):
    """A fast-mode model's multi-row passes (a prefill, a draft's tree, a batched pass) take one
    masked attention call per layer, not the fused call's exact rows: bitwise the Python loop's."""
    model = fast_q4
    ids = torch.arange(3, 15)

    def passes():
        cache = model.new_cache(64)
        prefill = model.forward(ids[:7], cache)
        tree = model.forward_tree(ids[7:12], torch.tensor([-1, 0, 0, 1, 1]), cache)
        a, b = model.new_cache(64), model.new_cache(64)
        model.forward(ids[:3], a)
        batched = model.forward_batch([(ids[3:8], a, False), (ids[:4], b, False)])
        return [prefill, tree, *batched]

    for got, want in zip(passes(), on_python_loop(model, passes)):
        assert torch.equal(got, want)
