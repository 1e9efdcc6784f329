"""Linear layers for the CPU fast path.

On x86 CPUs, oneDNN with weights reordered once into its blocked layout runs a decode-sized
matmul (1-16 rows) close to memory bandwidth, about twice as fast as the default MKL path for one
row and three to four times as fast for 9 rows (measured on this project's 2-core CI machine).
Packed for 16 rows, its results are also *batch-invariant*: row ``i`` of an ``n``-row product is
bitwise the same whatever ``n`` is, which is what lets greedy speculative decoding reproduce
plain greedy decoding exactly.

Elsewhere (CUDA, no oneDNN, exotic dtypes) it falls back to ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

#: batch-size hint given to oneDNN when it reorders weights; >= 9 gives batch invariance
PACK_ROWS = 16
#: oneDNN splits reductions longer than this differently for different row counts; longer
#: inputs are cut into chunks of at most this many features and the partial products summed in a
#: fixed order, which keeps every product batch-invariant (measured: K <= 1024 is, K = 1536 not)
MAX_INVARIANT_K = 1024


def _spend_quantised_deprecation_warning() -> None:
    """torch 2.13 warns, once per process, that its quantised tensors are deprecated; specdec's
    int8 paths use them on purpose (torch is pinned below 2.14).  Without this, that warning landed
    in the middle of every ``specdec generate``'s output, wherever a quantised tensor was first
    made.  The warning is torch's warn-once, so one silenced call here spends it for the process;
    nothing else is filtered."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.quantize_per_tensor(torch.zeros(1), 1.0, 0, torch.quint8)


_spend_quantised_deprecation_warning()


def _onednn_available() -> bool:
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and torch.backends.mkldnn.is_available()


def bf16_fast() -> bool:
    """True when oneDNN has native bfloat16 matmuls on this CPU (AVX512-BF16 / AMX)."""
    try:
        return _onednn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


_PACKABLE = {torch.float32: _onednn_available, torch.bfloat16: bf16_fast}


#: in "fast" mode, float32 weights with fewer elements than this use the dense MKL path: for one
#: row times a small matrix a oneDNN call costs ~15 us of fixed overhead, MKL 5-11 us (measured at
#: 256x256 to 256x768); from ~0.3 M elements up, and for several rows, oneDNN is as fast or faster
DENSE_BELOW = 300_000


def tensor_bytes(*tensors: Tensor | None) -> int:
    """Bytes the given tensors hold (None: nothing), as a layer's ``nbytes`` counts them."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class Linear:
    """``y = x @ W.T + b`` with the weight prepared once for the device it lives on.

    ``mode="invariant"`` always packs for oneDNN (batch-invariant, fastest for the target's
    matrices); ``mode="fast"`` keeps small matrices dense (lowest latency for one row of a small
    draft model) and packs the large ones (the LM head).
    """

    __slots__ = ("weight", "bias", "packed", "out_features", "_bounds", "f32")
    # packed: one oneDNN weight per input chunk (see MAX_INVARIANT_K), or None for the fallback
    # f32: the weight packed for torch.ops.specdec.f32_linear (float32, "invariant"), or None

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *, pack: bool = True, mode: str = "invariant") -> None:
        self.weight: Tensor | None = weight.contiguous()  # [out, in]; dropped once packed
        self.bias = bias
        self.out_features = weight.shape[0]
        self.packed: list[Tensor] | None = None
        self.f32: Tensor | None = None
        packable = _PACKABLE.get(weight.dtype)
        small = mode == "fast" and weight.numel() < DENSE_BELOW and weight.dtype == torch.float32
        if (pack and mode == "invariant" and weight.dtype == torch.float32 and weight.device.type == "cpu"
                and f32_kernel_available()):
            # the compiled product: sums in a fixed order per row, weights streamed once for up
            # to four rows; ~25 % faster than oneDNN for the few rows of a decoding step
            self.f32 = torch.ops.specdec.f32_pack(self.weight)
            self.weight = None
        elif pack and not small and weight.device.type == "cpu" and packable is not None and packable():
            k = weight.shape[1]
            n_chunks = -(-k // MAX_INVARIANT_K)
            bounds = [round(i * k / n_chunks) for i in range(n_chunks + 1)]
            try:
                self.packed = [
                    torch.ops.mkldnn._reorder_linear_weight(self.weight[:, a:b].contiguous(), PACK_ROWS)
                    for a, b in zip(bounds, bounds[1:])
                ]
                self._bounds = bounds
                self.weight = None
            except RuntimeError:
                self.packed = None

    def __call__(self, x: Tensor) -> Tensor:  # x: [n, in] -> [n, out]
        return self._product(x, self.bias)

    @property
    def nbytes(self) -> int:
        """Bytes the layer holds: its weight in whichever form it lives (dense, the compiled
        kernel's packing with its padded columns, or oneDNN's chunks) and the bias."""
        return tensor_bytes(self.weight, self.f32, self.bias, *(self.packed or ()))

    def scaled(self, x: Tensor, row_scale: Tensor) -> Tensor:  # x: [n, in], row_scale: [n, 1]
        """``row_scale * (x @ W.T) + b``: a per-row factor applied before the bias (how a folded
        RMSNorm's 1/rms enters; a pointwise step, so batch invariance is kept)."""
        y = self._product(x, None)
        return y.mul_(row_scale) if self.bias is None else torch.addcmul(self.bias, y, row_scale)

    def _product(self, x: Tensor, bias: Tensor | None) -> Tensor:
        if self.f32 is not None:
            y = torch.ops.specdec.f32_linear(x, self.f32, self.out_features)
            return y if bias is None else y + bias
        if self.packed is not None:
            if len(self.packed) == 1:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed[0], bias, "none", [None], "")
            b = self._bounds
            y = torch.ops.mkldnn._linear_pointwise(x[:, b[0] : b[1]], self.packed[0], bias, "none", [None], "")
            for i in range(1, len(self.packed)):
                y = y + torch.ops.mkldnn._linear_pointwise(x[:, b[i] : b[i + 1]], self.packed[i], None, "none", [None], "")
            return y
        return F.linear(x, self.weight, bias)


def f32_kernel_available() -> bool:
    """True when ``torch.ops.specdec.f32_linear`` runs here (the kernel library loaded and
    ``SPECDEC_F32_KERNEL`` is not 0).  A batch-invariant float32 target takes it for every
    product, whatever the row count: its bits differ from oneDNN's, so one process never mixes
    the two."""
    import os

    from specdec.models import kernels

    return os.environ.get("SPECDEC_F32_KERNEL", "1") != "0" and kernels.load()


def int8_available() -> bool:
    """True when torch has a CPU engine for dynamically quantised int8 linears (fbgemm / x86)."""
    try:
        return bool({"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines)) and hasattr(
            torch.ops.quantized, "linear_dynamic"
        )
    except (AttributeError, RuntimeError):
        return False


class Int8Linear:
    """``y ≈ x @ W.T + b`` with ``W`` stored as per-output-channel int8 (dynamic quantisation).

    For the *draft* only, where precision never affects exactness: a one-row product with the
    SmolLM2 draft's 49,152 × 256 LM head reads 12.6 MB instead of 50 MB (measured on a 2-core AVX2
    EPYC: 0.5 ms against 2.0 ms for packed float32).  Activations are quantised per call.
    """

    __slots__ = ("packed", "out_features")

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        w = weight.detach().float().contiguous()  # [out, in]
        scales = (w.abs().amax(dim=1).clamp_min(1e-8) / 127.0).double()
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)
        qw = torch.quantize_per_channel(w, scales, zero_points, axis=0, dtype=torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float())
        self.out_features = w.shape[0]

    def __call__(self, x: Tensor) -> Tensor:  # x: [n, in] float32 -> [n, out] float32
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, True)


def cpu_has(*flags: str) -> bool:
    """True when /proc/cpuinfo lists any of ``flags`` (False where there is no such file)."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return any(f" {flag}" in text for flag in flags)


def _has_vnni() -> bool:
    """True when the CPU has VNNI (u8 x s8 dot products accumulate in int32, never saturating)."""
    return cpu_has("avx512_vnni", "avx_vnni")


def _smoothed(weight: Tensor, smooth: Tensor | None, *, pad: int = 0) -> tuple[Tensor, Tensor | None]:
    """``(W * smooth, 1 / smooth)``: the float weight [out, in] with SmoothQuant's per-input-channel
    factors moved in, and the factors the activations are multiplied by (None without smoothing).
    ``pad``: the weight comes back [out, in + pad], its last columns zero (written in place: no
    concatenated copy of a large head)."""
    w = weight.detach().float()
    if pad:
        n, k = w.shape
        out = w.new_empty(n, k + pad)
        out[:, k:] = 0
        if smooth is None:
            out[:, :k] = w
        else:
            torch.mul(w, smooth.float(), out=out[:, :k])
        return out, None if smooth is None else (1.0 / smooth.float()).contiguous()
    if smooth is None:
        return w, None
    return w * smooth.float(), (1.0 / smooth.float()).contiguous()


class W8A8Linear:
    """``y ≈ x @ W.T + b`` with int8 weights (per output channel) and int8 activations (per row).

    The target-side quantized linear: fbgemm's dynamic int8 matmul with integer accumulation.
    fbgemm picks one activation scale for the whole input tensor, which would make a row's
    result depend on the other rows; here every row is first divided by its own max-abs value
    and two extra input columns, +1 and -1 (with zero weights), pin the tensor's range to
    exactly [-1, 1].  The quantisation of a row then depends on that row alone, and int32
    accumulation is exact whatever the kernel's blocking, so row ``i`` of an ``n``-row product is
    bitwise the same for every ``n`` (batch-invariant by construction, tested for 1..64 rows).

    Activations use 8 bits where the CPU has VNNI and 7 bits elsewhere (fbgemm's
    ``reduce_range``, which avoids int16 saturation on AVX2).  Not thread-safe: one forward pass
    at a time per model (the staging buffer is reused).
    """

    __slots__ = ("_packed", "_qw", "_scales", "bias", "inv_smooth", "in_features", "out_features", "_buf", "_views",
                 "_reduce_range", "wide", "wide_rows", "vnni")

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *, smooth: Tensor | None = None,
                 wide: bool = False) -> None:
        """``smooth`` [in] (optional): per-input-channel factors moved from the activations into
        the weights before quantisation (SmoothQuant, Xiao et al. 2023): ``x @ W.T ==
        (x / smooth) @ (W * smooth).T``, which evens out activation outliers that would otherwise
        set each row's quantisation step.  ``wide``: also pack the same int8 weights for oneDNN,
        which then runs products of :func:`wide_rows` rows or more with bitwise the same result
        (see :func:`wide_packing`; needs VNNI and oneDNN's int8 linear)."""
        self._reduce_range = not _has_vnni()
        n, k = weight.shape
        qw: Tensor | None = None
        vnni: list[Tensor] | None = None
        if not wide and vnni_available(self._reduce_range):
            # the kernel's packing straight from the float weight in one compiled pass: bitwise what
            # the steps below make (quantize_per_channel, then vnni_packing), ~10x faster
            packed, comp, col, scales = torch.ops.specdec.q8_quantize(
                weight.detach().float(), None if smooth is None else smooth.float())
            inv_smooth = None if smooth is None else (1.0 / smooth.float()).contiguous()
            vnni = [packed, comp, col]
        else:
            w, inv_smooth = _smoothed(weight, smooth, pad=2)  # [out, in + 2]: two zero columns
            lo, hi = torch.aminmax(w, dim=1)  # max |w| per row, as abs().amax() gives it, without a copy
            scales = (torch.maximum(hi, -lo).clamp_min(1e-12) / 127.0).double()
            qw = torch.quantize_per_channel(w, scales, torch.zeros(n, dtype=torch.long), axis=0, dtype=torch.qint8)
            del w
            if vnni_available(self._reduce_range):
                vnni = vnni_packing(qw.int_repr()[:, :k], scales)
        self._finish(n, k, scales, vnni, qw, inv_smooth, bias, wide)

    def _finish(self, n: int, k: int, scales: Tensor, vnni: list[Tensor] | None, qw: Tensor | None,
                inv_smooth: Tensor | None, bias: Tensor | None, wide: bool) -> None:
        """Everything after quantisation, shared by a new layer and one read back (:meth:`from_state`):
        ``qw`` (qint8 [out, in + 2]) or ``vnni`` (the kernel's packing) holds the int8 weights."""
        #: [packed int8 weight, zero-point compensation, column scales] for the few-row kernel
        #: (kernels.q8_linear: bitwise fbgemm, products of up to few_rows(reduce_range) rows), None where it is absent
        self.vnni = vnni
        self.inv_smooth = inv_smooth
        # fbgemm's packed weight (:attr:`packed`), made below unless no row count runs on fbgemm
        self._packed: Tensor | None = None
        self._qw: Tensor | None = qw
        self._scales = scales  # float64 [out]: what packed is made from, with the int8 weights
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.in_features, self.out_features = k, n
        self._buf = self._staging(16)
        self._views: dict[int, tuple[Tensor, Tensor]] = {}  # n -> (staged [n, in + 2], its [n, in] part)
        #: [oneDNN-packed int8 weight, column scales, zero points] for products of wide_rows rows or more
        self.wide: list[Tensor] | None = None
        self.wide_rows = wide_rows(n, k)
        if wide:
            if self._reduce_range:
                raise ValueError("the wide int8 kernel needs VNNI (8-bit activations)")
            q = qw if qw is not None else self._unpacked()
            self.wide = wide_packing(q.int_repr()[:, :k], scales)
        if not self.fbgemm_unused:
            self.packed  # noqa: B018 - packed now, never inside a timed pass
        self._qw = None  # packed, or rebuilt from the kernel's packing if ever asked for (_unpacked)

    def state(self) -> dict[str, Tensor] | None:
        """What :meth:`from_state` rebuilds this layer from — the kernel's packing (int8 weights
        [groups, in / 4, group width, 4], zero-point terms, column factors), the float64 weight
        scales, and the bias and smoothing where there are any — or None where the layer has no
        kernel packing (its int8 weights then live in fbgemm's packed form, which cannot be saved)."""
        if self.vnni is None:
            return None
        out = {"packed": self.vnni[0], "comp": self.vnni[1], "col": self.vnni[2], "scales": self._scales}
        if self.bias is not None:
            out["bias"] = self.bias
        if self.inv_smooth is not None:
            out["inv_smooth"] = self.inv_smooth
        return out

    @classmethod
    def from_state(cls, state: dict[str, Tensor], in_features: int, *, wide: bool = False) -> "W8A8Linear":
        """The layer :meth:`state` was taken from, without the float weight: the same int8 weights,
        scales and packing, so every product is bitwise the original layer's.  The kernel must
        run here with the same build as where the state was taken (the caller keys on it)."""
        self = cls.__new__(cls)
        self._reduce_range = not _has_vnni()
        if not vnni_available(self._reduce_range):
            raise ValueError("a W8A8 layer's saved packing needs the few-row int8 kernel")
        scales = state["scales"]
        self._finish(scales.numel(), in_features, scales, [state["packed"], state["comp"], state["col"]], None,
                     state.get("inv_smooth"), state.get("bias"), wide)
        return self

    @classmethod
    def scaled_rows(cls, rows: Tensor, gain: Tensor, *, smooth: Tensor | None = None, wide: bool = False,
                    block: int = 8192) -> "W8A8Linear":
        """The layer ``W8A8Linear(rows * gain, smooth=smooth, wide=wide)`` — ``rows`` [out, in]
        float32, ``gain`` [in] scaling its columns (an LM head with the final norm's weight folded
        in) — without making the whole product: where the few-row kernel packs straight from float
        weights, ``block`` rows at a time are multiplied, quantised and packed in place (the
        quantisation is per output row and the packing groups whole rows, so the same bits).  The
        tied head of Qwen2.5-Coder-1.5B is a 0.9 GB product that a build no longer holds."""
        reduce_range = not _has_vnni()
        if wide or not vnni_available(reduce_range):
            return cls(rows * gain, smooth=smooth, wide=wide)
        n, k = rows.shape
        sm = None if smooth is None else smooth.float()
        packed: Tensor | None = None
        comp = torch.empty(n, dtype=torch.int32)
        col = torch.empty(n, dtype=torch.float32)
        scales = torch.empty(n, dtype=torch.float64)
        for r0 in range(0, n, block):
            r1 = min(n, r0 + block)
            p, comp[r0:r1], col[r0:r1], scales[r0:r1] = torch.ops.specdec.q8_quantize((rows[r0:r1] * gain).float(), sm)
            group = p.shape[2]  # [groups, in / 4, group, 4]
            assert block % group == 0, "a block of rows must hold whole packing groups"
            if packed is None:
                packed = torch.empty(((n + group - 1) // group, *p.shape[1:]), dtype=p.dtype)
            packed[r0 // group : r0 // group + p.shape[0]] = p
        assert packed is not None, "a layer with no rows"
        self = cls.__new__(cls)
        self._reduce_range = reduce_range
        self._finish(n, k, scales, [packed, comp, col], None, None if sm is None else (1.0 / sm).contiguous(), None,
                     False)
        return self

    def select_outputs(self, ids: Tensor) -> "W8A8Linear | None":
        """A layer computing output columns ``ids`` [r] alone, in that order, bitwise as this one
        computes them: a reduced draft vocabulary's LM head (SmolLM2's int8 head under the q4
        target).  Each column's int32 sum and epilogue depend on its own weights, zero-point term
        and factor alone, and a row's activation scale on the row alone, so the few-row kernel's
        packing is copied column by column (the last group padded with zero columns, as ``q8_pack``
        pads).  None where the layer kept no such packing (its weights in fbgemm's form only)."""
        if self.vnni is None:
            return None
        ids = ids.long().reshape(-1)
        packed, comp, col = self.vnni  # [groups, in / 4, G, 4], [out], [out]
        groups, k4, size, four = packed.shape
        r = int(ids.numel())
        cols = packed.permute(0, 2, 1, 3).reshape(groups * size, k4, four)[ids]  # [r, in / 4, 4]
        taken = torch.zeros((-(-r // size)) * size, k4, four, dtype=packed.dtype)
        taken[:r] = cols
        taken = taken.view(-1, size, k4, four).permute(0, 2, 1, 3).contiguous()  # [ceil(r / G), in / 4, G, 4]
        out = W8A8Linear.__new__(W8A8Linear)
        out._reduce_range = self._reduce_range
        out._finish(r, self.in_features, self._scales[ids].contiguous(),
                    [taken, comp[ids].contiguous(), col[ids].contiguous()], None, self.inv_smooth,
                    None if self.bias is None else self.bias[ids], False)
        return out

    @property
    def nbytes(self) -> int:
        """The bytes this layer holds: the kernel's packing, scales, bias, smoothing (and fbgemm's
        packed weight, where made, counted as its int8 weights)."""
        held = tensor_bytes(*(self.vnni or ()), self._scales, self.bias, self.inv_smooth)
        if self._packed is not None:
            held += self.out_features * (self.in_features + 2)
        if self.wide is not None:
            held += self.out_features * self.in_features
        return int(held)

    @property
    def fbgemm_unused(self) -> bool:
        """True when no row count runs on fbgemm (with the module's row settings as they are now):
        the AVX2 build of the few-row kernel takes every row count (``AVX2_ROWS``), or its VNNI build
        takes up to VNNI_ROWS rows and the wide one takes over at or below VNNI_ROWS + 1 (an LM head
        under the mixed kernel, which ``auto`` picks for Qwen2.5-Coder-1.5B on an AMX CPU).  Such a
        matrix packs fbgemm's weight only if something asks for it: packing that head (151,936 x
        1,536) took 2.8 s of every start-up, and all of the int8 Qwen2.5-Coder-1.5B 20 s on machine H."""
        if self.vnni is None:
            return False
        if self._reduce_range:
            return AVX2_ROWS >= ALL_ROWS
        return self.wide is not None and self.wide_rows <= VNNI_ROWS + 1

    @property
    def packed(self) -> Tensor:
        """fbgemm's packed weight (``quantized.linear_prepack`` of the int8 weight [out, in + 2]),
        made once, when first asked for (a matrix that runs on fbgemm at all is packed when it is
        built; the others only if a row setting is lowered later, as tests do)."""
        if self._packed is None:
            qw = self._qw if self._qw is not None else self._unpacked()
            self._packed = torch.ops.quantized.linear_prepack(qw, None)
            self._qw = None
        return self._packed

    def _unpacked(self) -> Tensor:  # qint8 [out, in + 2]: the quantised weight back from the kernel's layout
        assert self.vnni is not None, "the int8 weights were released with the few-row kernel's packing"
        packed = self.vnni[0]  # [groups, in / 4, columns per group, 4]
        groups, k4, size, _ = packed.shape
        q = packed.permute(0, 2, 1, 3).reshape(groups * size, k4 * 4)[: self.out_features, : self.in_features]
        q = torch.cat([q, torch.zeros(self.out_features, 2, dtype=torch.int8)], dim=1)  # the two pinned columns' zeros
        zeros = torch.zeros(self.out_features, dtype=torch.long)
        return torch._make_per_channel_quantized_tensor(q, self._scales, zeros, 0)

    def _staging(self, rows: int) -> Tensor:  # [rows, in + 2]: normalised rows, then +1, -1
        buf = torch.empty(rows, self.in_features + 2)
        buf[:, -2] = 1.0
        buf[:, -1] = -1.0
        return buf

    def _staged(self, n: int) -> tuple[Tensor, Tensor]:
        views = self._views.get(n)
        if views is None:
            # made as normal tensors whatever the caller's mode: a buffer or view made under
            # inference mode could not be written outside it by a later pass ("Inplace update to
            # inference tensor"), and the passes of a target shared by several drafters run both ways
            with torch.inference_mode(False):
                if n > self._buf.shape[0]:
                    self._buf = self._staging(max(n, 2 * self._buf.shape[0]))
                    self._views.clear()
                staged = self._buf[:n]
                views = self._views[n] = (staged, staged[:, : self.in_features])
        return views

    def __call__(self, x: Tensor) -> Tensor:  # x: [n, in] float32 -> [n, out] float32
        return self.scaled(x, None)

    def scaled(self, x: Tensor, row_scale: Tensor | None) -> Tensor:  # x: [n, in], row_scale: [n, 1]
        """``row_scale * (x @ W.T) + b`` (see :meth:`Linear.scaled`)."""
        if self.vnni is not None and x.shape[0] <= few_rows(self._reduce_range) and (self.wide is None or x.shape[0] < self.wide_rows):
            # [n, out], [n, 1]: the row preparation below and the product, bitwise, in one call
            y, s = torch.ops.specdec.q8_linear(x, self.inv_smooth, *self.vnni)
        else:
            if self.inv_smooth is not None:
                x = x * self.inv_smooth
            # max |x| per row; abs + amax is the same value as vector_norm(x, inf) (a max is exact in
            # any order) and 5-12x cheaper for multi-row inputs on this CPU (29 vs 4.6 us at 17 x 576)
            s = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)  # [n, 1]
            if self.wide is not None and x.shape[0] >= self.wide_rows:
                y = wide_product(x / s, self.wide)  # [n, out], bitwise what fbgemm gives
            else:
                staged, part = self._staged(x.shape[0])
                torch.div(x, s, out=part)
                y = torch.ops.quantized.linear_dynamic(staged, self.packed, self._reduce_range)  # [n, out]
        if row_scale is not None:
            s = s * row_scale
        if self.bias is not None:
            return torch.addcmul(self.bias, y, s)
        return y.mul_(s)


#: where the mixed int8 kernel switches from fbgemm to oneDNN, per matrix: fbgemm's cost grows by
#: ~3 us per row per million weights, oneDNN's (AMX) hardly grows up to 16 rows but each call
#: costs ~20 us more.  Measured on a 2-core Sapphire Rapids, weights streamed from memory, us per
#: call for 1 / 4 / 9 rows, fbgemm vs oneDNN: 576 x 960 34/55, 38/56, 49/59; 576 x 3072
#: 100/125, 131/125, 179/132; 1536 x 576 50/72, 61/70, 82/79; 576 x 49152 1264/1361,
#: 1702/1405, 2140/1466; 1536 x 17920 1182/1201, 1524/1219, 1911/1282.  So a matrix of m million
#: weights switches at 1 + WIDE_WEIGHTS / m rows (rounded up), and never below WIDE_MIN_ROWS:
#: whole Qwen2.5-Coder-1.5B passes of 2 rows were slower with its largest matrices on oneDNN.
WIDE_WEIGHTS = 7_000_000
WIDE_MIN_ROWS = 3


def wide_rows(out_features: int, in_features: int) -> int:
    """The row count from which the mixed kernel runs a matrix of this shape on oneDNN."""
    return max(WIDE_MIN_ROWS, 1 + -(-WIDE_WEIGHTS // (out_features * in_features)))


#: ``auto`` takes the mixed kernel only for models where it pays within a verification pass: the
#: weight-weighted median of the layer matrices' switch rows must be at most this.  Measured:
#: Qwen2.5-Coder-1.5B (median 3) runs a 5-row pass 20 % faster on mixed; SmolLM2-135M (median 5:
#: its matrices are small) runs the same passes as fast on either (benchmarks/int8-kernel-curves)
#: and decoded 2-3 % slower on mixed in a paired run of the 16 built-in prompts, so it stays on fbgemm.
WIDE_AUTO_ROWS = 4


def mixed_pays(shapes: list[tuple[int, int]]) -> bool:
    """Whether ``auto`` should run layer matrices of these ``(out, in)`` shapes on the mixed kernel."""
    if not shapes:
        return False
    rows = sorted((wide_rows(n, k), n * k) for n, k in shapes)
    half, seen = sum(w for _, w in rows) / 2, 0
    for r, w in rows:
        seen += w
        if seen >= half:
            return r <= WIDE_AUTO_ROWS
    return False


#: the activation step fbgemm's dynamic linear picks for an input whose range is exactly [-1, 1]
#: with 8-bit activations ((1 - (-1)) / 255, zero point 128): what :class:`W8A8Linear` feeds it
_FBGEMM_STEP = 2.0 / 255.0
_FBGEMM_ZERO = 128
#: fbgemm's step and zero point with ``reduce_range`` (CPUs without VNNI: 7-bit activations)
_FBGEMM_STEP_7BIT = 2.0 / 127.0
_FBGEMM_ZERO_7BIT = 64


def wide_packing(q: Tensor, scales: Tensor) -> list[Tensor]:
    """The int8 weight ``q`` [out, in] (per-channel ``scales`` [out], as packed for fbgemm) packed
    for oneDNN so that :func:`wide_product` computes bitwise what fbgemm's dynamic linear does.

    Both kernels accumulate the same integers exactly in int32 (the activations are quantised by
    the same routine, fbgemm's, with the same step and zero point); fbgemm then multiplies each
    accumulator by ``float32(act_step * w_scale[j])``, which is the column scale given to oneDNN
    here with unit input and output scales.  Tested bitwise for 1..64 rows and on whole models."""
    step = torch.tensor(_FBGEMM_STEP, dtype=torch.float32)
    col = (step * scales.float()).contiguous()  # [out] float32 products, as fbgemm forms them
    # a 16-row hint: packed for one row, oneDNN's LM-head product took 11x longer (measured)
    packed = torch.ops.onednn.qlinear_prepack(q.contiguous(), [16, q.shape[1]])
    return [packed, col, torch.zeros(q.shape[0], dtype=torch.int)]


def wide_product(x: Tensor, wide: list[Tensor]) -> Tensor:  # x: [n, in] rows in [-1, 1] -> [n, out]
    """fbgemm's dynamic int8 product of rows normalised to [-1, 1], on oneDNN (see :func:`wide_packing`).

    Also compiled into the TorchScript layer loop, which cannot read module globals: the literals
    are ``_FBGEMM_STEP`` and ``_FBGEMM_ZERO``."""
    q = torch.quantize_per_tensor(x, 2.0 / 255.0, 128, torch.quint8).int_repr()  # [n, in] uint8
    return torch.ops.onednn.qlinear_pointwise(q, 1.0, 128, wide[0], wide[1], wide[2], None, 1.0, 0, torch.float32,
                                              "none", [], "")


#: the largest product the few-row VNNI kernel runs.  Per matrix (2-core Sapphire Rapids, weights
#: hot, us per call for 1 / 3 / 5 rows, fbgemm vs the kernel): 576 x 960 24/12, 28/16, 28/23;
#: 576 x 3072 32/16, 42/31, 53/46; 1536 x 576 26/16, 28/23, 31/35; 576 x 49152 746/756, 889/908,
#: 896/1007.  Whole SmolLM2-135M passes (weights streamed, interleaved in one process, median ms
#: for 1 / 2 / 3 / 4 / 5 / 9 / 17 rows): fbgemm only 14.9 / 17.0 / 17.9 / 19.4 / 21.3 / 24.9 / 32.8,
#: the kernel up to 16 rows 13.7 / 15.2 / 15.9 / 17.9 / 19.4 / 22.5 / 33.0.  The AVX2 build (machine H, a
#: Zen 3), time against fbgemm's for 1 / 2 / 3 / 5 / 9 / 16 rows: SmolLM2's LM head (49,152 x 576)
#: 0.84 / 0.78 / 0.78 / 0.93 / 1.00 / 1.17, a 1536 x 576 layer 0.36 / 0.42 / 0.52 / 0.61 / 0.75 / 0.88;
#: in whole passes of the int8 Qwen2.5-Coder-1.5B (fused loop on the kernel against TorchScript on
#: fbgemm, median ms for 1 / 2 / 3 / 4 / 5 / 9 / 17 rows) 110 / 107 / 117 / 116 / 122 / 169 / 299 on
#: fbgemm against 101 / 106 / 109 / 137 / 136 / 232 / 323: its larger matrices' groups (98-573 KB)
#: no longer stay in cache for a second block of rows.  So the AVX2 build now runs products of more
#: than three rows a 16-column group at a time, in blocks of five rows whose accumulators stay in
#: registers (``line_rows`` in csrc/q8.cpp), against fbgemm in one process (machine H, weights
#: streamed, kernel / fbgemm for 4 / 8 / 16 / 64 rows, benchmarks/avx2-int8-rows-h): 49,152 x 576
#: 0.62 / 0.78 / 0.98 / 0.79, 16,384 x 256 0.51 / 0.58 / 0.60 / 0.85, 17,920 x 1,536 0.88 / 1.17 /
#: 1.11 / 1.02, 1,536 x 8,960 0.80 / 0.86 / 0.87 / 0.95, and level from 128 to 512 rows.  It takes
#: every row count (``AVX2_ROWS``), so fbgemm's weights are never packed there.
VNNI_ROWS = 16
ALL_ROWS = 1 << 30
AVX2_ROWS = ALL_ROWS


def few_rows(reduce_range: bool) -> int:
    """The most rows a W8A8 product runs on the few-row kernel: ``VNNI_ROWS`` with its 512-bit VNNI
    build, ``AVX2_ROWS`` (every row count) with its AVX2 build (module settings, read per call).  Where the
    kernel runs at all its build matches fbgemm's activations (:func:`vnni_available`), so the
    layer's ``reduce_range`` (7-bit activations) names the AVX2 build."""
    return AVX2_ROWS if reduce_range else VNNI_ROWS


def vnni_available(reduce_range: bool | None = None) -> bool:
    """True when the few-row kernel (``torch.ops.specdec.q8_linear``) runs here and quantises the
    activations as fbgemm does on this CPU: 8-bit with VNNI (the kernel's 512-bit VNNI build), 7-bit
    without (fbgemm's ``reduce_range``; the kernel's AVX2 build).  A CPU with 256-bit VNNI only
    has the AVX2 build but 8-bit fbgemm activations: no kernel there.  ``reduce_range``: what a
    layer already read from the CPU (None: read it now)."""
    from specdec.models import kernels

    if reduce_range is None:
        reduce_range = not _has_vnni()
    return kernels.q8_zero() == (_FBGEMM_ZERO_7BIT if reduce_range else _FBGEMM_ZERO)


def vnni_packing(q: Tensor, scales: Tensor) -> list[Tensor] | None:
    """The int8 weight ``q`` [out, in] (per-channel ``scales`` [out], as packed for fbgemm) laid out
    for ``torch.ops.specdec.q8_linear``: [packed weight, ``zero * sum_k q_jk`` (fbgemm's zero-point
    term, int32), ``float32(act_step * w_scale[j])`` (its epilogue's column factor, formed as for
    :func:`wide_packing`)], with this build's zero point and step (:func:`vnni_available`).  None
    where the AVX2 build's int16 pair sums could saturate: a weight of -128 (symmetric per-channel
    quantisation gives -127 at the least)."""
    from specdec.models import kernels

    zero = kernels.q8_zero()
    if zero == _FBGEMM_ZERO_7BIT and int(q.min()) < -127:
        return None
    step = torch.tensor(_FBGEMM_STEP if zero == _FBGEMM_ZERO else _FBGEMM_STEP_7BIT, dtype=torch.float32)
    col = (step * scales.float()).contiguous()
    comp = (zero * q.sum(1, dtype=torch.int32)).contiguous()  # exact: |sum| <= 128 * 127 * in
    return [torch.ops.specdec.q8_pack(q.contiguous()), comp, col]


def w8a8_available() -> bool:
    """True when torch has fbgemm's dynamic int8 linear (x86 CPUs)."""
    return int8_available() and "fbgemm" in torch.backends.quantized.supported_engines


def onednn_int8_available() -> bool:
    """True when torch has oneDNN's static int8 linear (``onednn::qlinear_pointwise``)."""
    try:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")
    except (AttributeError, RuntimeError):
        return False


#: which int8 kernel the int8 target uses.  fbgemm is the fastest for a few rows but its cost grows
#: with the row count; oneDNN's, on CPUs with AMX int8 tiles, hardly does, but it costs more per
#: call (measured on a 2-core Sapphire Rapids: plain decoding 70 vs 93 tok/s with oneDNN alone;
#: benchmarks/spr-int8-*-vs-llamacpp).  "mixed" runs each matrix on fbgemm below wide_rows() rows
#: and on oneDNN from there with bitwise the same results (W8A8Linear ``wide``); "auto" = mixed where the CPU has AMX
#: int8 (and the model's matrices are large enough for it to pay: see WIDE_AUTO_ROWS), fbgemm
#: elsewhere with fbgemm, oneDNN where only oneDNN is there
INT8_KERNELS = ("auto", "fbgemm", "onednn", "mixed")


def mixed_available() -> bool:
    """True when the mixed kernel can run here: fbgemm with 8-bit activations (VNNI) and oneDNN's int8 linear."""
    return w8a8_available() and _has_vnni() and onednn_int8_available()


def int8_kernel(choice: str = "auto", shapes: list[tuple[int, int]] | None = None) -> str:
    """Resolve an int8 kernel choice; ``SPECDEC_INT8_KERNEL`` (fbgemm | onednn | mixed) overrides ``auto``.
    ``shapes``: the model's layer matrices ``(out, in)``, if known; ``auto`` then takes the mixed
    kernel only where :func:`mixed_pays`."""
    import os

    from specdec.errors import ConfigError

    if choice == "auto":
        choice = os.environ.get("SPECDEC_INT8_KERNEL", "auto")
    if choice not in INT8_KERNELS:
        raise ConfigError(f"unknown int8 kernel {choice!r}; choose one of {', '.join(INT8_KERNELS)}")
    if choice == "auto":
        if mixed_available() and cpu_has("amx_int8") and (shapes is None or mixed_pays(shapes)):
            return "mixed"
        return "fbgemm" if w8a8_available() or not onednn_int8_available() else "onednn"
    if choice == "onednn" and not onednn_int8_available():
        raise ConfigError("the onednn int8 kernel needs a torch build with oneDNN's qlinear (x86)")
    if choice == "onednn" and not _has_vnni():
        # without VNNI, oneDNN sums u8 x s8 products in pairs that saturate at int16 (measured on
        # an AVX2 Zen 3: 2-6x fbgemm's error, and smoothing made it worse); fbgemm avoids that
        raise ConfigError("the onednn int8 kernel needs a CPU with VNNI (without it its products saturate); use fbgemm")
    if choice == "mixed" and not mixed_available():
        raise ConfigError("the mixed int8 kernel needs fbgemm and oneDNN's int8 linear and a CPU with VNNI")
    return choice


class W8A8OneDNNLinear:
    """``y ≈ x @ W.T + b`` with int8 weights (per output channel) and int8 activations (per row),
    on oneDNN's int8 matmul.

    Where the CPU has AMX int8 tiles, oneDNN's matmul cost hardly grows with the row count
    (measured on a 2-core Sapphire Rapids: the 121 matrices of SmolLM2-135M take ~10 ms for 1
    row and for 9 rows, against 7.7 and 14 ms with fbgemm), but whole model steps were slower
    than with fbgemm there (see :data:`INT8_KERNELS`), so it is opt-in.  Exactness argument, as for :class:`W8A8Linear`: each row is quantised with its own
    scale (``round(x / (max|x| / 127))``, symmetric, no zero point), the kernel accumulates
    ``int8 × int8`` products in int32 (exact in any blocking), and its epilogue multiplies each
    element by its column's weight scale with unit input and output scales, so row ``i`` of an
    ``n``-row product is bitwise the same for every ``n`` (tested for 1..64 rows).
    """

    __slots__ = ("packed", "w_scale", "w_zero", "bias", "inv_smooth", "in_features", "out_features")

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *, smooth: Tensor | None = None) -> None:
        w, self.inv_smooth = _smoothed(weight, smooth)
        n, k = w.shape
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [out]
        q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        # the 1/127 of the activations' step is folded into the weights' scales
        self.w_scale = (scale / 127.0).contiguous()
        self.w_zero = torch.zeros(n, dtype=torch.int)
        # a 16-row hint: packed for one row, oneDNN's LM-head product took 11x longer (measured)
        self.packed = torch.ops.onednn.qlinear_prepack(q, [16, k])
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.in_features, self.out_features = k, n

    def __call__(self, x: Tensor) -> Tensor:  # x: [n, in] float32 -> [n, out] float32
        return self.scaled(x, None)

    def scaled(self, x: Tensor, row_scale: Tensor | None) -> Tensor:  # x: [n, in], row_scale: [n, 1]
        """``row_scale * (x @ W.T) + b`` (see :meth:`Linear.scaled`)."""
        if self.inv_smooth is not None:
            x = x * self.inv_smooth
        s = x.abs().amax(dim=1, keepdim=True).clamp_min_(1e-30)  # [n, 1]
        xq = torch.round(x / (s / 127.0)).to(torch.int8)  # [n, in], |xq| <= 127
        y = torch.ops.onednn.qlinear_pointwise(
            xq, 1.0, 0, self.packed, self.w_scale, self.w_zero, None, 1.0, 0, torch.float32, "none", [], ""
        )  # [n, out] = int32 accumulator * column scale
        if row_scale is not None:
            s = s * row_scale
        if self.bias is not None:
            return torch.addcmul(self.bias, y, s)
        return y.mul_(s)


# ----------------------------------------------------------------------------- 4-bit weights

#: inputs per 4-bit block (GGUF's Q4_0 / Q4_1 block size)
Q4_BLOCK = 32


class Q4Blocks(NamedTuple):
    """A weight [N, K] in GGUF's Q4_1 layout: per output column and block of 32 inputs, 4-bit
    codes ``w``, a scale ``d`` and a minimum ``m``; the weight is ``d * w + m`` (float32)."""

    qs: Tensor  # uint8 [N, K/32, 16]: byte i of a block holds inputs i (low nibble) and i + 16 (high)
    d: Tensor  # float16 [N, K/32]
    m: Tensor  # float16 [N, K/32]

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * Q4_BLOCK

    def codes(self) -> Tensor:  # uint8 [N, K/32, 32], input order
        return torch.cat([self.qs & 0x0F, self.qs >> 4], dim=-1)

    def dequantize(self) -> Tensor:  # float32 [N, K]
        w = self.d.float()[..., None] * self.codes().float() + self.m.float()[..., None]
        return w.reshape(self.qs.shape[0], -1)

    def take(self, rows: Tensor) -> "Q4Blocks":
        """The output columns ``rows`` [r] (a selection or permutation)."""
        return Q4Blocks(self.qs[rows], self.d[rows], self.m[rows])

    @staticmethod
    def cat(parts: list["Q4Blocks"]) -> "Q4Blocks":
        """Stacked along the outputs (q, k and v into one qkv weight)."""
        return Q4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("qs", "d", "m")))


class Q6Blocks(NamedTuple):
    """A weight [N, K] from GGUF's Q6_K super-blocks, cut into the 4-bit kernel's blocks of 32
    inputs: per output column and block, 6-bit codes ``q`` (0..63), the super-block's float16 scale
    ``d`` and an int8 scale per sub-block of 16 inputs; the weight is ``d * sc * (q - 32)``, exact in
    float32 (11 + 8 + 6 significant bits at most)."""

    codes: Tensor  # uint8 [N, K/32, 32], input order
    d: Tensor  # float16 [N, K/32] (each super-block's d, once per block of 32)
    sc: Tensor  # int8 [N, K/32, 2]: inputs 0-15 and 16-31 of the block

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * Q4_BLOCK

    def integer_weights(self) -> Tensor:  # float32 [N, K/32, 32]: sc * (q - 32), integers
        n, nb, _ = self.codes.shape
        return (self.sc.float()[..., None] * (self.codes.float() - 32.0).view(n, nb, 2, 16)).reshape(n, nb, 32)

    def dequantize(self) -> Tensor:  # float32 [N, K]: d * sc * (q - 32), exact
        return (self.d.float()[..., None] * self.integer_weights()).reshape(self.codes.shape[0], -1)

    def take(self, rows: Tensor) -> "Q6Blocks":
        """The output columns ``rows`` [r] (a selection or permutation)."""
        return Q6Blocks(self.codes[rows], self.d[rows], self.sc[rows])

    @staticmethod
    def cat(parts: list["Q6Blocks"]) -> "Q6Blocks":
        """Stacked along the outputs."""
        return Q6Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "d", "sc")))


def quantize_q4_1(weight: Tensor) -> Q4Blocks:
    """A float weight [N, K] as Q4_1 blocks (K padded with zero inputs to a multiple of 32): per
    block, ``m = min``, ``d = (max - min) / 15`` (both rounded to float16 first) and
    ``w = round((x - m) / d)`` clamped to 0..15 — llama.cpp's rule, used for weights that do not
    come as 4-bit blocks (a float model, or another GGUF block type)."""
    w = weight.detach().float()
    n, k = w.shape
    pad = -k % Q4_BLOCK
    if pad:
        w = F.pad(w, (0, pad))
    b = w.view(n, -1, Q4_BLOCK)  # [N, nb, 32]
    lo, hi = b.amin(-1), b.amax(-1)
    d = ((hi - lo) / 15.0).half()
    m = lo.half()
    df = d.float()[..., None]
    q = torch.where(df != 0, torch.round((b - m.float()[..., None]) / df), torch.zeros_like(b)).clamp_(0, 15)
    q = q.to(torch.uint8)
    return Q4Blocks((q[..., :16] | (q[..., 16:] << 4)).contiguous(), d, m)


def _activation_blocks(x: Tensor, gain: Tensor, nb: int) -> tuple[Tensor, Tensor]:
    """The 4-bit product's activation side (``csrc/q4.cpp``'s ``quantize_rows``) with ATen ops: x
    [n, K] times ``gain`` where given, zero-padded to ``nb`` blocks of 32 -> (codes ``round(x / e)``
    float32 [n, nb, 32], steps ``e = max|x| / 127`` [n, nb])."""
    n, k = x.shape[0], x.shape[1]
    if gain.numel() > 0:
        x = x * gain
    if nb * 32 > k:
        x = F.pad(x, [0, nb * 32 - k])
    xb = x.reshape(n, nb, 32)
    e = xb.abs().amax(-1) / 127.0  # [n, nb]
    ee = e.unsqueeze(-1)
    q = torch.where(ee != 0, torch.round(xb / ee), torch.zeros_like(xb)).clamp_(-127.0, 127.0)  # [n, nb, 32]
    return q, e


def q4_reference(x: Tensor, gain: Tensor, codes: Tensor, d: Tensor, m: Tensor, col: Tensor) -> Tensor:
    """``torch.ops.specdec.q4_linear`` with ATen ops, bitwise (and how the target runs where the
    kernel library did not build).  x: [n, K]; gain [K] or empty; codes float32 [nb, 32, N] (the
    4-bit codes, input order); d, m float32 [nb, N]; col [N] or empty -> [n, N].

    Every float step is the kernel's, element for element: the block steps ``e = max|x| / 127``,
    the codes ``round(x / e)``, ``e * sum(codes)``; the integer dot products come from a float32
    matmul whose every partial sum is an integer below 2**24 (|code products| <= 1,905, 32 per
    block), hence exact in any order; then the blocks in input order."""
    n = x.shape[0]
    nb = codes.shape[0]
    q, e = _activation_blocks(x, gain, nb)
    s = e * q.sum(-1)  # [n, nb]
    acc = torch.bmm(q.transpose(0, 1), codes)  # [nb, n, N], exact integers
    y = torch.zeros(n, codes.shape[2], dtype=x.dtype)
    for b in range(nb):
        t = d[b] * e[:, b : b + 1]  # [n, N]
        y = y + t * acc[b]
        y = y + m[b] * s[:, b : b + 1]
    if col.numel() > 0:
        y = y * col
    return y


def q6_reference(x: Tensor, gain: Tensor, weights: Tensor, d: Tensor) -> Tensor:
    """The Q6_K columns of ``torch.ops.specdec.q4_linear`` with ATen ops, bitwise (see
    :func:`q4_reference`).  x: [n, K]; gain [K] or empty; weights float32 [nb, 32, N] (each
    weight's integer ``sc * (q - 32)``, input order); d float32 [nb, N] (the super-block's scale)
    -> [n, N], before any column factor.

    The activation blocks are :func:`q4_reference`'s; each block's integer dot product
    ``sum_j sc_j sum_i (q_i - 32) a_i`` is a float32 matmul whose every partial sum is an integer
    below 2**24 (|products| <= 128 * 32 * 127, 32 per block), exact in any order; then
    ``y + (d * e) * sum`` block by block in input order."""
    n = x.shape[0]
    q, e = _activation_blocks(x, gain, weights.shape[0])
    acc = torch.bmm(q.transpose(0, 1), weights)  # [nb, n, N], exact integers
    y = torch.zeros(n, weights.shape[2], dtype=x.dtype)
    for b in range(weights.shape[0]):
        y = y + (d[b] * e[:, b : b + 1]) * acc[b]
    return y


def q46_reference(x: Tensor, gain: Tensor, ref: list[Tensor], col: Tensor) -> Tensor:
    """A :class:`Q4Linear`'s product from its reference operands ``ref`` (see ``Q4Linear.ref``): the
    4-bit columns, then any Q6_K columns, then the column factor, as the kernel orders them."""
    if len(ref) == 3:
        return q4_reference(x, gain, ref[0], ref[1], ref[2], col)
    y = torch.cat([q4_reference(x, gain, ref[0], ref[1], ref[2], torch.empty(0)),
                   q6_reference(x, gain, ref[3], ref[4])], 1)
    if col.numel() > 0:
        y = y * col
    return y


def _packed_owners(kind: str) -> Tensor:  # -> long [32, w]
    """Which bytes of one block's stream in a packed group of 32 columns (``q4_pack``: 640 bytes,
    ``q6_pack``: 896) belong to each column: read off the packer itself, by packing a group where
    one column's every bit is set and the others are zero.  Every byte belongs to one column."""
    cached = _OWNERS.get(kind)
    if cached is not None:
        return cached
    rows = []
    one = torch.tensor([1.0009765625], dtype=torch.float16)  # both of its bytes non-zero
    for c in range(32):
        hot = torch.zeros(32, dtype=torch.bool)
        hot[c] = True
        if kind == "q4":
            qs = torch.where(hot[:, None, None], 0xFF, 0).to(torch.uint8).expand(32, 1, 16).contiguous()
            d = torch.where(hot[:, None], one, torch.zeros(1, dtype=torch.float16))  # [32, 1]
            packed = torch.ops.specdec.q4_pack(qs, d, d.clone())
        else:
            codes = torch.where(hot[:, None, None], 63, 0).to(torch.uint8).expand(32, 1, 32).contiguous()
            d = torch.where(hot[:, None], one, torch.zeros(1, dtype=torch.float16))
            sc = torch.where(hot[:, None, None], -1, 0).to(torch.int8).expand(32, 1, 2).contiguous()
            packed = torch.ops.specdec.q6_pack(codes, d, sc)
        rows.append(packed.reshape(-1).nonzero().reshape(-1))
    owners = torch.stack(rows)  # [32, w]
    size = owners.numel()
    if sorted(owners.reshape(-1).tolist()) != list(range(size)):
        raise RuntimeError(f"{kind}_pack's layout does not give each column bytes of its own")
    _OWNERS[kind] = owners
    return owners


_OWNERS: dict[str, Tensor] = {}


def _take_packed(packed: Tensor, cols: Tensor, kind: str) -> Tensor:  # [G, nb, B] uint8, cols [r] -> [ceil(r/32), nb, B]
    """The packed groups of columns ``cols`` of a packed layer, in that order (the last group
    padded with zero columns, as the packer pads)."""
    owners = _packed_owners(kind)  # [32, w]
    g, nb, b = packed.shape
    r = cols.numel()
    out = torch.zeros(-(-r // 32), nb, b, dtype=torch.uint8)
    blocks = torch.arange(nb)[None, :, None]  # [1, nb, 1]
    k = torch.arange(r)
    for slot in range(32):
        dst = k[slot::32]  # new columns in this slot of their group
        src = cols[dst]
        vals = packed[(src // 32)[:, None, None], blocks, owners[src % 32][:, None, :]]  # [m, nb, w]
        out[(dst // 32)[:, None, None], blocks, owners[slot][None, None, :]] = vals
    return out


def q4_kernel_available() -> bool:
    """True when ``torch.ops.specdec.q4_linear`` runs here (the kernel library loaded)."""
    from specdec.models import kernels

    return kernels.q4_available()


class Q4Linear:
    """``y ≈ x @ W.T + b`` with ``W`` as Q4_1 blocks (4-bit codes, a float16 scale and minimum per
    32 inputs; GGUF's weights as shipped) and activations quantised to 8 bits per block of 32.

    Every output row depends on that row alone — the activation blocks are quantised per row, the
    integer sums are exact and the float steps fixed (see ``csrc/q4.cpp``) — so row ``i`` of an
    ``n``-row product is bitwise the same for every ``n``, on the kernel and on the ATen reference
    alike.  ``gain`` [K]: an input factor applied before quantisation (an RMSNorm's weight, which
    cannot be folded into 4-bit blocks as it is into float weights); ``col`` [N]: an output
    factor (the attention's 1 / sqrt(d) on the query columns).

    ``blocks6``: further output columns, after those of ``blocks``, from GGUF's Q6_K super-blocks as
    shipped (see ``csrc/q4.cpp``); ``blocks`` may then be None (a layer of Q6_K blocks alone), and
    otherwise must hold whole groups of 32 columns."""

    __slots__ = ("packed", "packed6", "ref", "gain", "col", "bias", "in_features", "out_features")

    def __init__(self, blocks: Q4Blocks | None, bias: Tensor | None = None, *, gain: Tensor | None = None,
                 col: Tensor | None = None, in_features: int | None = None, blocks6: Q6Blocks | None = None) -> None:
        if blocks is None and blocks6 is None:
            raise ValueError("a 4-bit layer needs Q4 or Q6_K blocks")
        n4, k = blocks.shape if blocks is not None else (0, blocks6.shape[1])
        n6 = 0 if blocks6 is None else blocks6.shape[0]
        if blocks6 is not None and (n4 % 32 or blocks6.shape[1] != k):
            raise ValueError("Q6_K columns follow whole groups of 32 4-bit columns with the same inputs")
        self.out_features = n4 + n6
        self.in_features = k if in_features is None else in_features
        self.gain = torch.empty(0) if gain is None else gain.detach().float().contiguous()
        self.col = torch.empty(0) if col is None else col.detach().float().contiguous()
        self.bias = None if bias is None else bias.detach().float().contiguous()
        #: the kernel's packing (q4_pack's, empty where every column is Q6_K; packed6: q6_pack's or
        #: empty), or None (then ref: [codes [nb, 32, N4], d [nb, N4], m [nb, N4]] float32, and where
        #: there are Q6_K columns [sc * (codes - 32) [nb, 32, N6], d [nb, N6]] after them)
        self.packed: Tensor | None = None
        self.packed6: Tensor = torch.empty(0, dtype=torch.uint8)
        self.ref: list[Tensor] | None = None
        if q4_kernel_available():
            self.packed = (torch.ops.specdec.q4_pack(blocks.qs, blocks.d, blocks.m) if blocks is not None
                           else torch.empty(0, dtype=torch.uint8))
            if blocks6 is not None:
                self.packed6 = torch.ops.specdec.q6_pack(blocks6.codes, blocks6.d, blocks6.sc)
        else:
            nb = -(-k // Q4_BLOCK)
            self.ref = ([blocks.codes().permute(1, 2, 0).float().contiguous(), blocks.d.float().T.contiguous(),
                         blocks.m.float().T.contiguous()] if blocks is not None
                        else [torch.zeros(nb, 32, 0), torch.zeros(nb, 0), torch.zeros(nb, 0)])
            if blocks6 is not None:
                self.ref += [blocks6.integer_weights().permute(1, 2, 0).contiguous(), blocks6.d.float().T.contiguous()]

    def state(self) -> dict[str, Tensor] | None:
        """What :meth:`from_state` rebuilds this layer from (the kernel's packing, the input gain and
        output factors, empty where there are none, and the bias where there is one), or None where
        the kernel does not run and the layer holds the reference form."""
        if self.packed is None:
            return None
        out = {"q4_packed": self.packed, "q4_gain": self.gain, "q4_col": self.col}
        if self.packed6.numel():
            out["q6_packed"] = self.packed6
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    @classmethod
    def from_state(cls, state: dict[str, Tensor], out_features: int, in_features: int) -> "Q4Linear":
        """The layer :meth:`state` was taken from: the same packing, hence bitwise the same products
        (the kernel must run here with the build the state was taken with: the caller keys on it)."""
        if not q4_kernel_available():
            raise ValueError("a 4-bit layer's saved packing needs the 4-bit kernel")
        self = cls.__new__(cls)
        self.out_features, self.in_features = out_features, in_features
        self.gain, self.col, self.bias = state["q4_gain"], state["q4_col"], state.get("bias")
        self.packed, self.ref = state["q4_packed"], None
        self.packed6 = state.get("q6_packed", torch.empty(0, dtype=torch.uint8))
        return self

    def select_outputs(self, ids: Tensor) -> "Q4Linear | None":
        """A layer computing output columns ``ids`` [r] alone, in that order, bitwise as this one
        computes them (each column's product depends on that column's bytes alone): a reduced
        draft vocabulary's LM head.  The packing's bytes are copied, not the blocks re-packed (a
        model read back from disk has no blocks).  None where the kept 4-bit columns would not
        all come first in whole groups of 32 before Q6_K ones (the kernel's order)."""
        ids = ids.long().reshape(-1)
        n4 = self.out_features - self._n6()
        four, six = ids[ids < n4], ids[ids >= n4] - n4
        if six.numel() and (four.numel() % 32 or not bool((ids[: four.numel()] < n4).all())):
            return None
        out = Q4Linear.__new__(Q4Linear)
        out.in_features, out.out_features = self.in_features, int(ids.numel())
        out.gain = self.gain
        out.col = self.col[ids].contiguous() if self.col.numel() else self.col
        out.bias = None if self.bias is None else self.bias[ids].contiguous()
        if self.packed is not None:
            out.ref = None
            out.packed = (_take_packed(self.packed, four, "q4") if four.numel()
                          else torch.empty(0, dtype=torch.uint8))
            out.packed6 = _take_packed(self.packed6, six, "q6") if six.numel() else torch.empty(0, dtype=torch.uint8)
        else:
            assert self.ref is not None
            out.packed, out.packed6 = None, torch.empty(0, dtype=torch.uint8)
            out.ref = [t[..., four].contiguous() for t in self.ref[:3]] + [t[..., six].contiguous() for t in self.ref[3:]]
        return out

    @property
    def nbytes(self) -> int:
        """The bytes this layer holds: the kernel's packing (or the reference's blocks), the column
        factors and the bias (the gain is the model's norm weight, shared)."""
        return tensor_bytes(self.packed, self.packed6, self.col, self.bias, *(self.ref or ()))

    def _n6(self) -> int:
        """How many output columns come from Q6_K blocks (the last ones)."""
        if self.packed is not None:  # (an empty ``packed`` holds no group: shape (0,))
            return self.out_features - 32 * self.packed.shape[0] if self.packed6.numel() else 0
        assert self.ref is not None
        return self.ref[3].shape[-1] if len(self.ref) > 3 else 0

    def product(self, x: Tensor) -> Tensor:  # x: [n, in] float32 -> [n, out]
        if self.packed is not None:
            return torch.ops.specdec.q4_linear(x, self.gain, self.packed, self.out_features, self.col, self.packed6)
        return q46_reference(x, self.gain, self.ref, self.col)

    def __call__(self, x: Tensor) -> Tensor:
        return self.scaled(x, None)

    def scaled(self, x: Tensor, row_scale: Tensor | None) -> Tensor:  # x: [n, in], row_scale: [n, 1]
        """``row_scale * (x @ W.T) + b`` (see :meth:`Linear.scaled`)."""
        y = self.product(x)
        if row_scale is None:
            return y if self.bias is None else y + self.bias
        return y.mul_(row_scale) if self.bias is None else torch.addcmul(self.bias, y, row_scale)
