"""Linear layers for the CPU fast path.

On x86 CPUs, oneDNN with weights reordered once into its blocked layout runs a decode-sized
matmul (1-16 rows) close to memory bandwidth, about twice as fast as the default MKL path for one
row and three to four times as fast for 9 rows (measured on this project's 2-core CI machine).
Packed for 16 rows, its results are also *batch-invariant*: row ``i`` of an ``n``-row product is
bitwise the same whatever ``n`` is, which is what lets greedy speculative decoding reproduce
plain greedy decoding exactly (DESIGN.md §4 rule 1).

Elsewhere (CUDA, no oneDNN, exotic dtypes) it falls back to ``torch.nn.functional.linear``.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

#: batch-size hint given to oneDNN when it reorders weights; >= 9 gives batch invariance
PACK_ROWS = 16
#: oneDNN splits reductions longer than this differently for different row counts; longer
#: inputs are cut into chunks of at most this many features and the partial products summed in a
#: fixed order, which keeps every product batch-invariant (measured: K <= 1024 is, K = 1536 not)
MAX_INVARIANT_K = 1024


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


class Linear:
    """``y = x @ W.T + b`` with the weight prepared once for the device it lives on.

    ``mode="invariant"`` always packs for oneDNN (batch-invariant, fastest for the target's
    matrices); ``mode="fast"`` keeps small matrices dense (lowest latency for one row of a small
    draft model) and packs the large ones (the LM head).
    """

    __slots__ = ("weight", "bias", "packed", "out_features", "_bounds")
    # packed: one oneDNN weight per input chunk (see MAX_INVARIANT_K), or None for the fallback

    def __init__(self, weight: Tensor, bias: Tensor | None = None, *, pack: bool = True, mode: str = "invariant") -> None:
        self.weight: Tensor | None = weight.contiguous()  # [out, in]; dropped once packed
        self.bias = bias
        self.out_features = weight.shape[0]
        self.packed: list[Tensor] | None = None
        packable = _PACKABLE.get(weight.dtype)
        small = mode == "fast" and weight.numel() < DENSE_BELOW and weight.dtype == torch.float32
        if pack and not small and weight.device.type == "cpu" and packable is not None and packable():
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
        if self.packed is not None:
            if len(self.packed) == 1:
                return torch.ops.mkldnn._linear_pointwise(x, self.packed[0], self.bias, "none", [None], "")
            b = self._bounds
            y = torch.ops.mkldnn._linear_pointwise(x[:, b[0] : b[1]], self.packed[0], self.bias, "none", [None], "")
            for i in range(1, len(self.packed)):
                y = y + torch.ops.mkldnn._linear_pointwise(x[:, b[i] : b[i + 1]], self.packed[i], None, "none", [None], "")
            return y
        return F.linear(x, self.weight, self.bias)


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
        with warnings.catch_warnings():  # torch marks its quantised tensors as deprecated (2.13)
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scales, zero_points, axis=0, dtype=torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float())
        self.out_features = w.shape[0]

    def __call__(self, x: Tensor) -> Tensor:  # x: [n, in] float32 -> [n, out] float32
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, True)
