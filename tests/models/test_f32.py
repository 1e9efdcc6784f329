"""The float32 target's compiled product (``torch.ops.specdec.f32_linear``, ``models/csrc/f32.cpp``).

Its promise is batch invariance by construction: each row's sums run front to back, one multiply
and one add per term, so row ``i`` of an ``n``-row product is bitwise the row alone, for every
``n``, thread count and column split.  Checked on shapes that exercise the packing's edges
(outputs not a multiple of the 64-column groups), rows of very different magnitudes and bias /
row scales through ``Linear``; whole models are covered by the float32-invariant kind of
``test_quantized.py`` (TorchScript loop, batched passes, trees) and the real-weights tests.
"""

from __future__ import annotations

import pytest
import torch

from specdec.models import linear as linear_mod
from specdec.models.linear import DENSE_BELOW, MAX_INVARIANT_K, Linear, _onednn_available, bf16_fast, f32_kernel_available

needs_f32 = pytest.mark.skipif(not f32_kernel_available(), reason="the float32 kernel needs a C++ compiler")


@needs_f32
@pytest.mark.parametrize("shape", [(576, 576), (100, 96), (33, 7), (3072, 576), (64, 1536)])
def test_rows_are_bitwise_alone_and_close_to_float64(shape):
    n_out, k = shape
    g = torch.Generator().manual_seed(n_out + k)
    w = torch.randn(n_out, k, generator=g) * 0.05
    x = torch.randn(17, k, generator=g) * (torch.rand(17, 1, generator=g) * 50 + 1e-3)
    packed = torch.ops.specdec.f32_pack(w)
    solo = torch.cat([torch.ops.specdec.f32_linear(x[i : i + 1], packed, n_out) for i in range(17)])
    for n in (2, 3, 4, 5, 8, 9, 16, 17):
        assert torch.equal(torch.ops.specdec.f32_linear(x[:n], packed, n_out), solo[:n]), n
    want = (x.double() @ w.double().T).float()
    assert torch.allclose(solo, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@needs_f32
def test_bits_do_not_depend_on_the_thread_count():
    w = torch.randn(3072, 576, generator=torch.Generator().manual_seed(2)) * 0.05
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(3))
    packed = torch.ops.specdec.f32_pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.specdec.f32_linear(x, packed, 3072)
        torch.set_num_threads(max(2, threads))
        many = torch.ops.specdec.f32_linear(x, packed, 3072)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


@needs_f32
def test_linear_takes_the_kernel_in_invariant_mode_only(monkeypatch):
    g = torch.Generator().manual_seed(4)
    w, bias = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    x, scale = torch.randn(6, 96, generator=g), torch.rand(6, 1, generator=g) + 0.5
    lin = Linear(w, bias)
    assert lin.f32 is not None and lin.weight is None
    y = torch.ops.specdec.f32_linear(x, lin.f32, 200)
    assert torch.equal(lin(x), y + bias)
    assert torch.equal(lin.scaled(x, scale), torch.addcmul(bias, y, scale))
    assert torch.equal(lin(x[:4]), torch.cat([lin(x[i : i + 1]) for i in range(4)]))
    assert Linear(w, bias, mode="fast").f32 is None  # drafts keep oneDNN / MKL
    assert Linear(w.bfloat16(), mode="invariant").f32 is None
    monkeypatch.setenv("SPECDEC_F32_KERNEL", "0")
    assert Linear(w, bias).f32 is None and linear_mod.f32_kernel_available() is False


@needs_f32
def test_kernel_refuses_mismatched_inputs():
    packed = torch.ops.specdec.f32_pack(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.specdec.f32_linear(torch.randn(2, 63), packed, 40)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.specdec.f32_pack(torch.randn(4, 4).double())


def test_a_linears_byte_count_follows_the_form_its_weight_lives_in(monkeypatch):
    """``Linear.nbytes``: dense weight and bias; the compiled kernel's packing, whose last group of
    64 output columns is padded (200 outputs hold 256 columns); oneDNN's packed chunks, at least
    the dense weight (the packing may pad too); a bfloat16 weight at two bytes a value."""
    g = torch.Generator().manual_seed(5)
    w, bias = torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    dense = 200 * 96 * 4
    assert Linear(w, bias, pack=False).nbytes == dense + 200 * 4
    assert Linear(w, pack=False).nbytes == dense
    assert Linear(w.bfloat16(), pack=False).nbytes == dense // 2
    if f32_kernel_available():
        lin = Linear(w, bias)
        assert lin.f32 is not None and lin.nbytes == 256 * 96 * 4 + 200 * 4
    monkeypatch.setenv("SPECDEC_F32_KERNEL", "0")
    packed = Linear(w, bias)
    if packed.packed is not None:  # oneDNN packs float32 here
        assert packed.weight is None and packed.nbytes >= dense + 200 * 4


def _front_to_back(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = torch.zeros(x.shape[0], w.shape[0])
    for c in range(x.shape[1]):
        y = y + x[:, c : c + 1] * w[:, c]  # one float32 product, then one float32 sum, per term
    return y


@needs_f32
@pytest.mark.parametrize("shape", [(200, 37), (64, 16), (7, 5), (130, 96)])
def test_each_row_is_summed_front_to_back_with_separate_roundings(shape):
    n_out, k = shape
    g = torch.Generator().manual_seed(n_out * 31 + k)
    w = torch.randn(n_out, k, generator=g)
    x = torch.randn(9, k, generator=g) * (torch.rand(9, 1, generator=g) * 50 + 1e-3)
    packed = torch.ops.specdec.f32_pack(w)
    want = _front_to_back(x, w)
    for n in (1, 2, 3, 4, 5, 9):  # every register block (1-4 rows) and a remainder
        assert torch.equal(torch.ops.specdec.f32_linear(x[:n], packed, n_out), want[:n]), n


@pytest.mark.skipif(not _onednn_available(), reason="needs oneDNN's packed float32 linear")
def test_a_chunked_product_adds_its_bias_once(monkeypatch):
    monkeypatch.setenv("SPECDEC_F32_KERNEL", "0")  # oneDNN's packing, not the compiled kernel's
    g = torch.Generator().manual_seed(1)
    k = 2 * MAX_INVARIANT_K + 100
    w, bias = torch.randn(24, k, generator=g) * 0.05, torch.randn(24, generator=g) * 10
    lin = Linear(w, bias)
    assert lin.packed is not None and len(lin.packed) == 3
    x = torch.randn(5, k, generator=g)
    want = x.double() @ w.double().T + bias.double()
    assert torch.allclose(lin(x).double(), want, atol=1e-3)
    scale = torch.rand(5, 1, generator=g) + 0.5
    assert torch.allclose(lin.scaled(x, scale).double(), (want - bias.double()) * scale.double() + bias.double(), atol=1e-3)


needs_onednn = pytest.mark.skipif(not _onednn_available(), reason="needs oneDNN's packed float32 linear")


@needs_onednn
def test_fast_mode_keeps_only_weights_below_dense_below_dense():
    """``mode="fast"``: float32 weights with *fewer* elements than DENSE_BELOW stay dense (MKL);
    a weight of exactly DENSE_BELOW elements is packed for oneDNN."""
    assert DENSE_BELOW == 300 * 1000
    at = Linear(torch.zeros(300, 1000), mode="fast")
    below = Linear(torch.zeros(299, 1000), mode="fast")
    assert at.packed is not None and at.weight is None
    assert below.packed is None and below.weight is not None


@needs_onednn
@pytest.mark.parametrize("k, chunks", [(MAX_INVARIANT_K, 1), (MAX_INVARIANT_K + 1, 2), (2 * MAX_INVARIANT_K, 2),
                                       (2 * MAX_INVARIANT_K + 1, 3)])
def test_inputs_are_cut_into_the_fewest_chunks_of_at_most_max_invariant_k(monkeypatch, k, chunks):
    """oneDNN's packing cuts the inputs into ceil(K / MAX_INVARIANT_K) chunks, none longer than
    MAX_INVARIANT_K (exact multiples take no extra, empty-ish chunk), and the chunked product is x @ W.T."""
    monkeypatch.setenv("SPECDEC_F32_KERNEL", "0")  # oneDNN's packing, not the compiled kernel's
    g = torch.Generator().manual_seed(k)
    w = torch.randn(8, k, generator=g) * 0.05
    lin = Linear(w)
    assert lin.packed is not None and len(lin.packed) == chunks
    b = lin._bounds
    assert b[0] == 0 and b[-1] == k and max(hi - lo for lo, hi in zip(b, b[1:])) <= MAX_INVARIANT_K
    x = torch.randn(3, k, generator=g)
    assert torch.allclose(lin(x).double(), x.double() @ w.double().T, atol=1e-3)


@needs_onednn
def test_a_chunked_layers_byte_count_covers_every_chunk(monkeypatch):
    """``nbytes`` of a layer packed in three oneDNN chunks counts them all: at least the dense weight."""
    monkeypatch.setenv("SPECDEC_F32_KERNEL", "0")
    k = 2 * MAX_INVARIANT_K + 100
    lin = Linear(torch.randn(24, k, generator=torch.Generator().manual_seed(1)))
    assert lin.packed is not None and len(lin.packed) == 3
    assert lin.nbytes >= 24 * k * 4
    assert lin.nbytes == linear_mod.tensor_bytes(*lin.packed)


def test_the_f32_kernel_is_on_by_default_wherever_the_library_loads(monkeypatch):
    """Without ``SPECDEC_F32_KERNEL`` in the environment the compiled float32 product is used
    wherever the kernel library loads (only ``0`` turns it off): a float32 invariant Linear takes it."""
    from specdec.models import kernels

    monkeypatch.delenv("SPECDEC_F32_KERNEL", raising=False)
    loaded = bool(kernels.load())
    assert linear_mod.f32_kernel_available() is loaded
    assert (Linear(torch.randn(8, 16)).f32 is not None) is loaded
    monkeypatch.setenv("SPECDEC_F32_KERNEL", "1")
    assert linear_mod.f32_kernel_available() is loaded


@pytest.mark.skipif(not bf16_fast(), reason="needs oneDNN's native bfloat16 matmuls")
def test_fast_mode_keeps_only_small_float32_weights_dense_not_bfloat16_ones():
    """DENSE_BELOW applies to float32 weights alone: a small bfloat16 weight in ``mode="fast"`` is
    still packed for oneDNN (its product is then x @ W.T to bfloat16 rounding)."""
    g = torch.Generator().manual_seed(6)
    w = (torch.randn(24, 40, generator=g) * 0.1).bfloat16()
    lin = Linear(w, mode="fast")
    assert lin.packed is not None and lin.weight is None
    x = torch.randn(3, 40, generator=g).bfloat16()
    assert torch.allclose(lin(x).float(), x.float() @ w.float().T, atol=0.05)
