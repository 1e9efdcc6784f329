"""Calibration for the int8 target: per-channel input ranges of every linear layer.

:class:`~specdec.models.linear.W8A8Linear` quantises each activation row with one scale, so a
few large channels (LLMs have them) set the step for all the others.  SmoothQuant (Xiao et al.
2023) moves part of each channel's range into the weights: with ``s_j = max|X_j|^a /
max|W_j|^(1-a)``, ``X W^T == (X / s) (W s)^T`` exactly, and both factors quantise better.  The
ranges ``max|X_j|`` come from one float32 forward pass over a short built-in text (code, prose
and chat), done once at load time.  Measured on SmolLM2-135M (1,023 held-out tokens of code and
prose): KL(float32 || int8) 0.072 -> 0.020 and top-1 agreement 0.86 -> 0.91 with a = 0.5.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import Tensor

#: SmoothQuant's migration strength
ALPHA = 0.5

CALIBRATION_TEXT = '''User: Could you explain how a hash table handles collisions, with a short example?
Assistant: Sure. A hash table stores each key in a bucket chosen by its hash. When two keys land
in the same bucket, the table needs a rule to keep both. With separate chaining, every bucket
holds a small list, and a lookup walks that list comparing keys. With open addressing, the table
probes the next free slot instead. Here is a minimal chained table in Python:

class ChainedTable:
    def __init__(self, size=8):
        self.buckets = [[] for _ in range(size)]

    def put(self, key, value):
        bucket = self.buckets[hash(key) % len(self.buckets)]
        for i, (k, _) in enumerate(bucket):
            if k == key:
                bucket[i] = (key, value)
                return
        bucket.append((key, value))

    def get(self, key, default=None):
        for k, v in self.buckets[hash(key) % len(self.buckets)]:
            if k == key:
                return v
        return default

The average cost of a lookup stays constant as long as the load factor, the number of entries
divided by the number of buckets, stays small; most implementations resize the table when it
passes a threshold such as 0.75.

Licensed under the terms of this agreement, the recipient may copy and distribute the work,
provided that the notices are kept intact and any modified files carry prominent notices stating
that they were changed. On 3 March 2021, at 14:05, the committee met in Geneva to discuss 12
proposals; 7 were accepted, 4 were deferred and one was withdrawn.
'''


def calibration_ids(folder: Path) -> Tensor | None:
    """The calibration text tokenised with the model's own tokenizer ([n] int64), or None."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    return torch.tensor(_calibration_ids(path.read_bytes()), dtype=torch.long)


def calibration_source(folder: Path) -> str | None:
    """A digest of what :func:`calibration_ids` computes the ids from (tokenizer.json's bytes, the
    text, the ``tokenizers`` library's version), without parsing the file, or None without one."""
    import hashlib
    import importlib.metadata as md

    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    h = hashlib.sha256(path.read_bytes())
    h.update(b"\0" + CALIBRATION_TEXT.encode() + b"\0" + md.version("tokenizers").encode())
    return h.hexdigest()


@functools.lru_cache(maxsize=4)
def _calibration_ids(tokenizer_json: bytes) -> tuple[int, ...]:
    """The calibration text's ids under the tokenizer these bytes describe (as the file configures
    it), its parse shared with the folder's tokenizer (:func:`specdec.tokenizer.parsed`)."""
    from specdec.tokenizer import parsed

    return tuple(parsed(tokenizer_json).encode(CALIBRATION_TEXT).ids)


class RangeRecorder:
    """Wraps a float linear layer and records the per-channel max |input| it sees."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.bias = inner.bias
        self.absmax: Tensor | None = None  # [in]

    def record(self, x: Tensor) -> None:  # x: [n, in]
        """Note the range of inputs ``x`` without computing the product."""
        m = x.detach().abs().amax(0).float()
        self.absmax = m if self.absmax is None else torch.maximum(self.absmax, m)

    def __call__(self, x: Tensor) -> Tensor:
        self.record(x)
        return self.inner(x)

    def scaled(self, x: Tensor, row_scale: Tensor) -> Tensor:
        self.record(x * row_scale)
        return self.inner.scaled(x, row_scale)


def column_absmax(weight: Tensor) -> Tensor:  # [out, in] -> [in]
    """``weight.abs().amax(0)``; for float32 weights on the compiled kernels without the [out, in]
    copy of ``abs`` (~10 s of loading the int8 Qwen2.5-Coder-1.5B on two cores; a max is exact)."""
    from specdec.models import kernels

    w = weight.detach()
    if w.dtype == torch.float32 and kernels.load():
        return torch.ops.specdec.absmax_columns(w)
    return w.abs().amax(0)


def smoothing(absmax: Tensor | None, weight: Tensor, alpha: float = ALPHA, *,
              column_gain: Tensor | None = None) -> Tensor | None:
    """SmoothQuant factors ``s`` [in] for ``weight`` [out, in] given input ranges [in] —
    for ``weight * column_gain`` where a gain [in] is given, without making that product: rounding
    is monotone, so a column's largest |w·g| is bit for bit its largest |w| times |g|."""
    if absmax is None:
        return None
    x = absmax.clamp_min(1e-5)
    w = column_absmax(weight).float()
    if column_gain is not None:
        w = w * column_gain.float().abs()
    w = w.clamp_min(1e-5)
    return (x.pow(alpha) / w.pow(1.0 - alpha)).clamp(1e-2, 1e2)
