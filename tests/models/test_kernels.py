"""The compiled few-row int8 kernel (``torch.ops.specdec.q8_linear``, ``models/csrc/q8.cpp``).

Its promise is fbgemm's output, bit for bit, for every row count: then which kernel runs a
product (fbgemm, oneDNN, this one) never changes a result, and a machine without a compiler runs
the same quantised target, only slower.  Checked here on matrices whose shapes exercise every
edge of the packing (columns not a multiple of the 64-column groups, inputs not a multiple of
the 4-byte dot products), rows of very different magnitudes with outlier channels, bias, smoothing
and a per-row scale; and across processes, with the kernel switched off.  The kernel has a 512-bit
VNNI build (fbgemm's 8-bit activations on such CPUs) and an AVX2 build (its 7-bit activations on
CPUs without VNNI); these tests run whichever this CPU has (``test_kernel_builds.py`` also runs the
AVX2 build on a VNNI CPU, against fbgemm with 7-bit activations).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import specdec.models.linear as linear_mod
from specdec.models import kernels
from specdec.models.linear import W8A8Linear, vnni_available, vnni_packing, w8a8_available
from specdec.models.quantize import column_absmax, smoothing
from kernel_child import decode_in_child
from tiny import make_tiny

needs_vnni = pytest.mark.skipif(not (w8a8_available() and vnni_available()),
                                reason="the few-row int8 kernel needs a C++ compiler, fbgemm and 512-bit VNNI "
                                "(or AVX2 on a CPU without VNNI)")


def _pair(w, bias=None, smooth=None) -> tuple[W8A8Linear, W8A8Linear]:
    """(the layer with the kernel, the same layer on fbgemm alone)."""
    lin = W8A8Linear(w, bias, smooth=smooth)
    ref = W8A8Linear(w, bias, smooth=smooth)
    ref.packed  # noqa: B018 - fbgemm's weight (on AVX2 rebuilt from the kernel's packing), before the kernel goes
    ref.vnni = None
    return lin, ref


@needs_vnni
@pytest.mark.parametrize("shape", [(384, 160), (77, 37), (64, 4), (1000, 1536), (130, 9)])
@pytest.mark.parametrize("extras", ["plain", "bias+smooth"])
def test_kernel_is_bitwise_fbgemm_for_every_row_count(shape, extras, monkeypatch):
    monkeypatch.setattr(linear_mod, "AVX2_ROWS", linear_mod.VNNI_ROWS)  # both builds up to 16 rows, fbgemm beyond
    out_f, in_f = shape
    g = torch.Generator().manual_seed(out_f + in_f)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[min(3, out_f - 1)] *= 20  # one output channel with a much larger scale
    x = torch.randn(40, in_f, generator=g) * (torch.rand(40, 1, generator=g) * 10 + 0.01)
    x[:, in_f // 2] *= 40  # an outlier channel
    x[5] = 0.0  # an all-zero row (its scale is clamped)
    bias = smooth = None
    if extras != "plain":
        bias = torch.randn(out_f, generator=g)
        smooth = smoothing(x.abs().amax(0), w)
    lin, ref = _pair(w, bias, smooth)
    assert lin.vnni is not None and ref.vnni is None
    scale = torch.rand(40, 1, generator=g) + 0.5
    for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 16):  # blocks of 3 (AVX2) or 4 (VNNI) rows, of 5 (AVX2) from 4
        assert n <= linear_mod.few_rows(lin._reduce_range)
        assert torch.equal(lin(x[:n]), ref(x[:n])), n
        assert torch.equal(lin.scaled(x[:n], scale[:n]), ref.scaled(x[:n], scale[:n])), n
    # rows past the kernel's limit run on fbgemm: a row's bits do not depend on which ran it
    rows = torch.cat([lin(x[i : i + 1]) for i in range(40)])
    assert torch.equal(lin(x), rows)
    # the default settings: the AVX2 build takes every row count (40 rows: eight blocks of five)
    monkeypatch.setattr(linear_mod, "AVX2_ROWS", linear_mod.ALL_ROWS)
    assert torch.equal(lin(x), ref(x))


@needs_vnni
def test_fbgemm_weights_rebuilt_from_the_kernels_packing_are_the_quantised_weights(monkeypatch):
    """Where the kernel takes every row count (its AVX2 build) a layer packs no fbgemm weight and
    keeps no int8 copy besides the kernel's packing; asked for fbgemm's weight later (a test that
    lowers the row setting) it rebuilds the quantised weight from that packing.  That must be the
    weight quantisation made: the same int8 values and float64 scales (read back from fbgemm's
    packing of each), here against a layer that packed fbgemm's weight from the quantised one."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(77, 37, generator=g) * 0.05
    w[3] *= 30
    smooth = torch.rand(37, generator=g) + 0.5
    monkeypatch.setattr(linear_mod, "AVX2_ROWS", 3)
    eager = W8A8Linear(w, smooth=smooth)  # packs fbgemm's weight when built
    assert eager._packed is not None
    monkeypatch.setattr(linear_mod, "AVX2_ROWS", linear_mod.ALL_ROWS)
    lazy = W8A8Linear(w, smooth=smooth)
    assert (lazy._packed is None) == (kernels.q8_zero() == 64) and lazy._qw is None
    lazy._packed = None  # a VNNI build packed it when built: rebuild it here too
    qa, _ = torch.ops.quantized.linear_unpack(eager.packed)
    qb, _ = torch.ops.quantized.linear_unpack(lazy.packed)
    assert qa.shape == qb.shape == (77, 39)
    assert torch.equal(qa.int_repr(), qb.int_repr())
    assert torch.equal(qa.q_per_channel_scales(), qb.q_per_channel_scales())
    assert torch.equal(qa.q_per_channel_zero_points(), qb.q_per_channel_zero_points())
    x = torch.randn(20, 37, generator=g)
    monkeypatch.setattr(linear_mod, "AVX2_ROWS", 0)
    monkeypatch.setattr(linear_mod, "VNNI_ROWS", 0)
    assert torch.equal(eager(x), lazy(x))  # both on fbgemm


@needs_vnni
def test_kernel_quantises_rows_as_aten_does_on_the_hard_values():
    """The kernel quantises rows itself, by fbgemm's rule (ATen's quantize_per_tensor for quint8):
    one fused multiply-add x * (1 / step) + zero in float32, rounded half to even (step 2/255 and
    zero 128 with VNNI, 2/127 and 64 without).  Random rows rarely tell that apart from a separate
    multiply and add, or from other tie rules, so the rows here are made of the values that do:
    from 6 M seeded uniforms in [-1, 1], those where the multiply-then-add rounds differently, and
    those the fused result puts exactly on .5.  Each row holds a 1.0 (its max, so the values reach
    the quantiser unchanged)."""
    step, zero = (2.0 / 255.0, 128.0) if kernels.q8_zero() == 128 else (2.0 / 127.0, 64.0)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(6_000_000, generator=g, dtype=torch.float64).float() * 2 - 1  # [6M]
    inv = torch.tensor(1.0) / torch.tensor(step, dtype=torch.float32)
    fused = (x.double() * inv.double() + zero).float()  # exact product and sum, one rounding
    split = (x * inv) + zero
    hard = x[(torch.round(fused) != torch.round(split)) | ((fused % 1) == 0.5)]  # [h]
    assert hard.numel() >= 30  # 60+ with VNNI's 8-bit step, ~40 with the 7-bit one
    m = min(4, hard.numel() // 15)
    rows = hard[: 15 * m].reshape(m, 15)  # [m, 15]
    rows = torch.cat([torch.ones(m, 1), rows], dim=1)  # [m, 16]
    w = torch.randn(96, 16, generator=torch.Generator().manual_seed(3)) * 0.05
    lin, ref = _pair(w)
    for n in (1, 2, 3, 4):
        for i in range(0, rows.shape[0] - n + 1, n):
            assert torch.equal(lin(rows[i : i + n]), ref(rows[i : i + n])), (n, i)


@needs_vnni
@pytest.mark.parametrize("shape", [(64, 576), (70, 33), (130, 258), (1, 3), (65, 4), (17, 9)])
def test_the_packed_layout_is_groups_of_columns_by_steps_of_4_inputs(shape):
    """``q8_pack``: row j's inputs 4c..4c+3 at [j // G, c, j % G, :], zero padding past the
    matrix (the layout written out here with tensor ops), for whole and partial groups and steps.
    G is 64 columns for the VNNI build (four 16-lane accumulators) and 16 for the AVX2 build (one
    64-byte line a step, so that each group is one contiguous stream)."""
    n, k = shape
    size = 64 if kernels.q8_zero() == 128 else 16
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=torch.Generator().manual_seed(n * k))
    ng, k4 = -(-n // size), -(-k // 4)
    padded = torch.zeros(ng * size, k4 * 4, dtype=torch.int8)
    padded[:n, :k] = w
    want = padded.reshape(ng, size, k4, 4).permute(0, 2, 1, 3).contiguous()  # [ng, k4, G, 4]
    assert torch.equal(torch.ops.specdec.q8_pack(w), want)
    assert torch.equal(torch.ops.specdec.q8_pack(w.t().contiguous().t()), want)  # a strided weight too


def _aten_quantised(w: torch.Tensor, smooth: torch.Tensor | None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The kernel's packing and the float64 scales the way W8A8Linear made them before q8_quantize:
    smoothing product, per-row max |.|, scale = max / 127, quantize_per_channel, vnni_packing."""
    ws, _ = linear_mod._smoothed(w, smooth, pad=2)
    lo, hi = torch.aminmax(ws, dim=1)
    scales = (torch.maximum(hi, -lo).clamp_min(1e-12) / 127.0).double()
    with warnings.catch_warnings():  # torch marks its quantised tensors as deprecated (2.13)
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(ws, scales, torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
    return vnni_packing(qw.int_repr()[:, : w.shape[1]], scales), scales


def _hard_row(n: int, g: torch.Generator) -> torch.Tensor:
    """A row with max |.| 1 (scale float32(1/127)) whose other values sit a few ulps from the
    half-way points between codes, where rounding v * (1 / scale) and v / scale part ways."""
    scale = torch.tensor(1.0) / 127.0
    k = torch.randint(-127, 127, (n,), generator=g).float()
    v = (k + 0.5) * scale
    ulps = torch.randint(-3, 4, (n,), generator=g)
    for _ in range(3):  # step each value up to three ulps up or down
        v = torch.where(ulps > 0, torch.nextafter(v, torch.tensor(2.0)), torch.where(ulps < 0, torch.nextafter(v, torch.tensor(-2.0)), v))
        ulps = ulps - ulps.sign()
    v[0] = 1.0
    return v


@needs_vnni
@pytest.mark.parametrize("shape", [(1000, 1536), (77, 37), (130, 9), (17, 4)])
@pytest.mark.parametrize("smoothed", [False, True])
def test_quantising_in_one_compiled_pass_is_the_aten_path_bit_for_bit(shape, smoothed):
    """``q8_quantize`` (the weight's smoothing, scales, quantisation, packing and column sums in one
    compiled pass) makes what the ATen calls make: the same packed codes, zero-point terms, column
    factors and float64 scales, for zero rows, outlier rows, tiny values and rows built on the
    rounding boundaries (where a division instead of the product with the inverse scale rounds 1-10
    % of values differently: counted here, so the test can tell the two apart)."""
    out_f, in_f = shape
    g = torch.Generator().manual_seed(out_f * in_f + smoothed)
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    w[min(3, out_f - 1)] *= 40
    w[min(5, out_f - 1)] = 0.0
    w[min(6, out_f - 1), ::2] = 1e-39  # subnormal
    hard_rows = min(out_f - 8, 64) if out_f > 8 else 0
    for r in range(hard_rows):
        w[8 + r] = _hard_row(in_f, g) * (0.5 + r / 64)
    smooth = torch.rand(in_f, generator=g) * 3 + 0.2 if smoothed else None
    packed, comp, col, scales = torch.ops.specdec.q8_quantize(w, smooth)
    (ref_packed, ref_comp, ref_col), ref_scales = _aten_quantised(w, smooth)
    assert torch.equal(scales, ref_scales)
    assert torch.equal(packed, ref_packed)
    assert torch.equal(comp, ref_comp)
    assert torch.equal(col, ref_col)
    if hard_rows and not smoothed and in_f >= 1000:
        hard = w[8 : 8 + hard_rows]
        s32 = ref_scales[8 : 8 + hard_rows].float()[:, None]
        assert int((torch.round(hard * (1.0 / s32)) != torch.round(hard / s32)).sum()) >= 100
    lin = W8A8Linear(w, smooth=smooth)  # the layer takes this path where the kernel runs
    assert all(torch.equal(a, b) for a, b in zip(lin.vnni, (ref_packed, ref_comp, ref_col)))


@needs_vnni
@pytest.mark.parametrize("shape", [(200, 37), (64, 16), (1000, 96), (3, 8)])
@pytest.mark.parametrize("smoothed", [False, True])
def test_a_head_quantised_a_block_of_rows_at_a_time_is_the_whole_product_bit_for_bit(shape, smoothed):
    """``W8A8Linear.scaled_rows(rows, gain)`` (an LM head with the final norm's weight folded in,
    multiplied and quantised ``block`` rows at a time so that the [V, D] product is never whole)
    is the layer made from the whole product: the same smoothing factors — computed from the rows'
    column maxima times |gain|, with negative and tiny gains among them — and the same packed codes,
    zero-point terms, column factors and scales, whether the blocks divide the rows or not."""
    out_f, in_f = shape
    g = torch.Generator().manual_seed(out_f + in_f + smoothed)
    rows = torch.randn(out_f, in_f, generator=g)
    rows[0] *= 30  # an outlier row
    gain = torch.randn(in_f, generator=g)  # signed, as a norm's weight may be
    gain[0] = 1e-30  # products that fall below float32's normal range
    gain[-1] = -0.0
    absmax = torch.rand(in_f, generator=g) * 8 if smoothed else None
    smooth = smoothing(absmax, rows, column_gain=gain)
    want_smooth = smoothing(absmax, rows * gain)
    assert (smooth is None) == (not smoothed)
    if smoothed:
        assert torch.equal(smooth, want_smooth)
    want = W8A8Linear(rows * gain, smooth=want_smooth).state()
    for block in (64, 128, 4096):  # whole packing groups on either build (64 columns VNNI, 16 AVX2)
        got = W8A8Linear.scaled_rows(rows, gain, smooth=smooth, block=block).state()
        assert set(got) == set(want)
        for k in want:
            assert torch.equal(got[k], want[k]), (block, k)


@pytest.mark.skipif(not kernels.load(), reason="needs the compiled kernels (a C++ compiler)")
@pytest.mark.parametrize("shape", [(300, 257), (1, 5), (7, 1), (1000, 600)])
def test_column_absmax_is_abs_then_amax(shape):
    """``quantize.column_absmax`` (the smoothing's per-input max |w|, compiled without abs's copy)
    equals ``w.abs().amax(0)`` bit for bit, with signed zeros, infinities and a NaN among the values."""
    g = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    w = torch.randn(shape, generator=g) * torch.rand(shape[1], generator=g) * 5
    w[0, 0] = -0.0
    if shape[1] > 3:
        w[-1, 1] = float("-inf")
        w[0, 2] = float("nan")
        w[:, 3] = -0.0
    got = column_absmax(w)
    want = w.abs().amax(0)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))
    assert torch.equal(torch.nan_to_num(column_absmax(w.t().contiguous().t())), torch.nan_to_num(got))  # a strided weight too


@needs_vnni
def test_kernel_refuses_mismatched_inputs():
    w = torch.randn(70, 33)
    lin = W8A8Linear(w)
    packed, comp, col = lin.vnni
    x = torch.randn(2, 32)  # one input feature short
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.specdec.q8_linear(x, None, packed, comp, col)
    with pytest.raises(RuntimeError, match="int8"):
        torch.ops.specdec.q8_pack(w)


@needs_vnni
def test_the_avx2_build_refuses_weights_whose_pair_sums_could_saturate():
    """AVX2's u8 x s8 pair sums are exact in int16 for codes up to 128 and weights down to -127,
    which per-channel symmetric quantisation never goes below; a weight of -128 (two of them
    against codes of 128 would overflow) keeps the matrix on fbgemm.  The VNNI build sums in int32
    and takes any weight."""
    q = torch.randint(-127, 128, (70, 33), dtype=torch.int8, generator=torch.Generator().manual_seed(2))
    scales = torch.rand(70, dtype=torch.float64) * 0.01 + 1e-3
    assert vnni_packing(q, scales) is not None
    q[4, 7] = -128
    assert (vnni_packing(q, scales) is None) == (kernels.q8_zero() == 64)


def _child(folder: Path, **env: str) -> tuple[dict, str]:
    return decode_in_child(folder, "int8", **env)


@pytest.mark.skipif(not w8a8_available(), reason="this torch build has no fbgemm int8 engine")
def test_the_same_quantised_target_with_and_without_the_kernel(tmp_path):
    """A process with the kernels switched off (``SPECDEC_KERNELS=0``) and one whose compiler
    fails both decode, with the same bits; a process with the int8 kernel but ATen attention
    (``SPECDEC_ATTENTION=0``) has those bits too (the int8 kernel is bitwise fbgemm); with the
    attention kernel as well, the logits differ only in rounding (its own reduction order)."""
    folder = make_tiny(tmp_path / "tiny")
    off, _ = _child(folder, SPECDEC_KERNELS="0")
    assert off["q8"] is False
    broken, err = _child(folder, CXX="false", SPECDEC_CACHE=str(tmp_path / "cache"))
    assert broken["q8"] is False and "did not build" in err
    assert broken["logits"] == off["logits"] and broken["sum"] == off["sum"]
    if vnni_available():
        q8, _ = _child(folder, SPECDEC_ATTENTION="0")
        assert q8["q8"] is True
        assert q8["logits"] == off["logits"] and q8["sum"] == off["sum"]
        on, _ = _child(folder)
        assert on["logits"] != off["logits"]
        assert torch.allclose(torch.tensor(on["logits"]), torch.tensor(off["logits"]), rtol=1e-4, atol=1e-4)


needs_q8 = pytest.mark.skipif(not kernels.q8_available(), reason="the few-row int8 product needs 512-bit VNNI")


@needs_q8
def test_an_all_zero_row_gets_the_clamped_factor_and_fbgemms_product():
    """The op's own outputs for an all-zero row: the factor is max(max |x|, 1e-30) and the product
    fbgemm's for the staged row.  Through W8A8Linear an unclamped factor (0: NaN codes) still gives
    zeros, since the factor multiplies the product, so only the op's contract shows it."""
    g = torch.Generator().manual_seed(5)
    n_out, k = 70, 37
    w = torch.randn(n_out, k + 2, generator=g) * 0.05
    w[:, k:] = 0.0  # the two pinned columns' weights
    scales = (w.abs().amax(1).clamp_min(1e-12) / 127.0).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(w, scales, torch.zeros(n_out, dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    x = torch.randn(3, k, generator=g)
    x[1] = 0.0
    got, s = torch.ops.specdec.q8_linear(x, None, *vnni_packing(qw.int_repr()[:, :k], scales))
    assert s[1, 0] == torch.tensor(1e-30, dtype=torch.float32)
    staged = torch.cat([x / s, torch.ones(3, 1), -torch.ones(3, 1)], 1)
    assert torch.equal(got, torch.ops.quantized.linear_dynamic(staged, packed, False))  # 8-bit activations with VNNI)


@pytest.mark.skipif(not (w8a8_available() and vnni_available()), reason="needs fbgemm and the few-row int8 kernel")
def test_the_aten_quantisation_is_the_kernels_for_negative_extremes(monkeypatch):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(77, 37, generator=g) * 0.05
    w[3] = -w[3].abs() * 20  # a row whose largest magnitude is negative
    w[10, 5] = -3.0
    smooth = torch.rand(37, generator=g) + 0.5
    kernel = W8A8Linear(w, smooth=smooth)
    monkeypatch.setattr(linear_mod, "vnni_available", lambda *args: False)
    aten = W8A8Linear(w, smooth=smooth)
    assert kernel.vnni is not None and aten.vnni is None
    qa, _ = torch.ops.quantized.linear_unpack(kernel.packed)
    qb, _ = torch.ops.quantized.linear_unpack(aten.packed)
    assert torch.equal(qa.int_repr(), qb.int_repr())
    assert torch.equal(qa.q_per_channel_scales(), qb.q_per_channel_scales())
