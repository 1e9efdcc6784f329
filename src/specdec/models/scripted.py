"""The native decoder's layer loop compiled with TorchScript: the same ops, without Python.

A SmolLM2 step runs 30 layers of about 45 small ops each; in eager PyTorch every op pays a few
microseconds of Python and argument parsing, which at 135 M parameters is as much time as the
weights take to stream through memory (measured on a 2-core EPYC: 6-8 ms of a 13 ms int8 step
is overhead; a 30-layer model with 64-wide layers still needs 6 ms).  This module runs the same
per-layer computation as :meth:`NativeCausalLM.hidden` — the same ATen ops on the same shapes,
in the same order — from TorchScript's interpreter, which cuts that overhead by more than half.
Because the ops and shapes are identical, the results are bitwise identical to the Python loop
(tested), so batch invariance and every exactness guarantee carry over.

Scope: every pass of :meth:`NativeCausalLM.hidden` and of ``forward_batch`` (a batching
server's ragged pass: run without Python, it also leaves the interpreter lock to the server's
request threads while it computes): single positions, the batch-invariant
per-row attention (a target's verification pass), exact tree attention (each node over the
prefix and its own path, laid out in place; see :func:`specdec.tree.attention_schedule`) and the
fast mode's one masked attention call (a prefill, a draft's tree pass), and layer subsets
(:meth:`NativeCausalLM.run_layers`: a self-speculative draft's early exit or skipped
sub-layers) through a plan of ``[layer, attention on, MLP on, cache slot]`` steps.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.kv_cache import GROW_STEP
from specdec.models import kernels
from specdec.models import linear as linear_mod
from specdec.models.linear import q4_reference, q6_reference, wide_product

#: exact attention reads keys in whole blocks of this many positions (the cache's allocation step,
#: so a block never reaches past the buffer); see ``native._attend_rows``
ATTENTION_BLOCK = GROW_STEP
#: row r: 0 up to column r, -inf after it (the masked tail of a query's last key block)
BLOCK_MASK = torch.full((ATTENTION_BLOCK, ATTENTION_BLOCK), float("-inf")).triu_(1)  # [B, B]

W8A8 = 0
PACKED = 1
DENSE = 2
ONEDNN_INT8 = 3  # chunks[i] = [packed int8 weight, column scales, zero points]
Q4 = 4  # q4[i] = [gain, col, packed, packed6] on the kernel, [gain, col, codes, d, m(, weights6, d6)] on the ATen reference
F32 = 5  # dense[i] = the weight packed for specdec::f32_linear


class Weights(NamedTuple):
    """Every linear layer's weights, by index (4 per layer: qkv, out, gate_up, down), for each kind."""

    kinds: List[int]
    q8: Dict[int, torch.classes.quantized.LinearPackedParamsBase]
    staging: Dict[int, Tensor]
    reduce_range: bool
    chunks: Dict[int, List[Tensor]]
    bounds: Dict[int, List[int]]
    dense: Dict[int, Tensor]
    bias: Dict[int, Tensor]
    smooth: Dict[int, Tensor]
    wide: Dict[int, List[Tensor]]  # W8A8 layers also packed for oneDNN (linear.wide_packing) ...
    wide_rows: Dict[int, int]  # ... which runs their products of this many rows or more
    vnni: Dict[int, List[Tensor]]  # W8A8 layers packed for the few-row kernel (linear.vnni_packing) ...
    vnni_rows: int  # ... which runs their products of at most this many rows
    attend: bool  # exact attention on the compiled kernel (kernels.attention_kernel), else ATen ops
    q4: Dict[int, List[Tensor]]  # Q4Linear layers (see Q4) ...
    n_out: Dict[int, int]  # output features of the Q4 and F32 layers
    head_norms: Dict[int, List[Tensor]]  # layer -> [query norm's gain, key norm's gain] (Qwen3), [d] each


def _linear(
    i: int,
    x: Tensor,
    row_scale: Optional[Tensor],
    wt: Weights,
) -> Tensor:  # x: [n, in], row_scale: [n, 1] -> [n, out]; mirrors Linear / W8A8Linear / W8A8OneDNNLinear / Q4Linear exactly
    kind = wt.kinds[i]
    smooth = wt.smooth
    b: Optional[Tensor] = None
    if i in wt.bias:
        b = wt.bias[i]
    if kind == 4:  # Q4
        q = wt.q4[i]
        if len(q) == 4:
            y = torch.ops.specdec.q4_linear(x, q[0], q[2], wt.n_out[i], q[1], q[3])
        elif len(q) == 5:
            y = q4_reference(x, q[0], q[2], q[3], q[4], q[1])
        else:  # Q6_K columns after the 4-bit ones
            y = torch.cat([q4_reference(x, q[0], q[2], q[3], q[4], torch.empty(0)), q6_reference(x, q[0], q[5], q[6])], 1)
            if q[1].numel() > 0:
                y = y * q[1]
        if row_scale is None:
            if b is not None:
                return y + b
            return y
        if b is not None:
            return torch.addcmul(b, y, row_scale)
        return y.mul_(row_scale)
    if kind == 0:  # W8A8
        n = x.shape[0]
        sm: Optional[Tensor] = None
        if i in smooth:
            sm = smooth[i]
        if i in wt.vnni and n <= wt.vnni_rows and not (i in wt.wide and n >= wt.wide_rows[i]):
            v = wt.vnni[i]
            y, s = torch.ops.specdec.q8_linear(x, sm, v[0], v[1], v[2])  # bitwise what fbgemm gives
        else:
            if sm is not None:
                x = x * sm
            s = x.abs().amax(1, True).clamp_min_(1e-30)
            if i in wt.wide and n >= wt.wide_rows[i]:
                y = wide_product(x / s, wt.wide[i])  # bitwise what fbgemm gives
            else:
                staged = wt.staging[i][:n]
                torch.div(x, s, out=staged[:, : x.shape[1]])
                y = torch.ops.quantized.linear_dynamic(staged, wt.q8[i], wt.reduce_range)
        if row_scale is not None:
            s = s * row_scale
        if b is not None:
            return torch.addcmul(b, y, s)
        return y.mul_(s)
    if kind == 3:  # ONEDNN_INT8
        w = wt.chunks[i]
        if i in smooth:
            x = x * smooth[i]
        s = x.abs().amax(1, True).clamp_min_(1e-30)
        xq = torch.round(x / (s / 127.0)).to(torch.int8)
        y = torch.ops.onednn.qlinear_pointwise(xq, 1.0, 0, w[0], w[1], w[2], None, 1.0, 0, torch.float32, "none", [], "")
        if row_scale is not None:
            s = s * row_scale
        if b is not None:
            return torch.addcmul(b, y, s)
        return y.mul_(s)
    inner_bias = b if row_scale is None else None
    if kind == 5:  # F32
        y = torch.ops.specdec.f32_linear(x, wt.dense[i], wt.n_out[i])
        if inner_bias is not None:
            y = y + inner_bias
    elif kind == 1:  # PACKED
        ws = wt.chunks[i]
        if len(ws) == 1:
            y = torch.ops.mkldnn._linear_pointwise(x, ws[0], inner_bias, "none", [], "")
        else:
            bd = wt.bounds[i]
            y = torch.ops.mkldnn._linear_pointwise(x[:, bd[0] : bd[1]], ws[0], inner_bias, "none", [], "")
            for c in range(1, len(ws)):
                y = y + torch.ops.mkldnn._linear_pointwise(x[:, bd[c] : bd[c + 1]], ws[c], None, "none", [], "")
    else:
        y = F.linear(x, wt.dense[i], inner_bias)
    if row_scale is None:
        return y
    if b is not None:
        return torch.addcmul(b, y, row_scale)
    return y.mul_(row_scale)


def _mlp(lin: int, x: Tensor, eps: Tensor, width: int, w: Weights) -> Tensor:  # [n, D] -> [n, D]
    """The MLP sub-layer with its residual (linear layers ``lin + 2``: gate_up, ``lin + 3``: down)."""
    gate_up = _linear(lin + 2, x, _inv_rms(x, eps, width), w)
    gate, up = gate_up.chunk(2, -1)
    return x + _linear(lin + 3, F.silu(gate) * up, None, w)


def _inv_rms(x: Tensor, eps: Tensor, width: int) -> Tensor:  # [n, D] -> [n, 1]
    norm = torch.linalg.vector_norm(x, 2.0, [-1], True)
    return torch.rsqrt(torch.addcmul(eps, norm, norm, value=1.0 / width))


def _head_norm(x: Tensor, gain: Tensor, eps: Tensor) -> Tensor:  # [n, h, d] -> [n, h, d]
    """native._head_norm: each head's RMS norm, its inverse RMS as _inv_rms computes it."""
    norm = torch.linalg.vector_norm(x, 2.0, [-1], True)
    return x * torch.rsqrt(torch.addcmul(eps, norm, norm, value=1.0 / x.shape[-1])) * gain


def _normed(qk: Tensor, li: int, hq: int, eps: Tensor, w: Weights) -> Tensor:  # [n, H + Hkv, d]
    """native.NativeCausalLM._normed: Qwen3's query and key head norms where layer ``li`` has them."""
    if li not in w.head_norms:
        return qk
    g = w.head_norms[li]
    return torch.cat([_head_norm(qk[:, :hq], g[0], eps), _head_norm(qk[:, hq:], g[1], eps)], 1)


def _rows(x: Tensor, rows: List[int]) -> Tensor:
    """native._rows: ``x[rows]`` as a slice (one row) or index_select."""
    if len(rows) == 1:
        return x[rows[0] : rows[0] + 1]
    return x.index_select(0, torch.tensor(rows, dtype=torch.long))


def _attend_rows(q: Tensor, k: Tensor, v: Tensor, start: int, block_mask: Tensor) -> Tensor:  # q: [n, H, d] -> [n, H d]
    """Exact attention of consecutive query positions ``start ..``: native._attend_rows_aten, op for op."""
    n, hq, d = q.shape[0], q.shape[1], q.shape[2]
    hk = k.shape[0]
    if q.dtype != torch.float32:
        rows: List[Tensor] = []
        for j in range(n):
            rows.append(F.scaled_dot_product_attention(
                q[j].view(1, hq, 1, d), k[:, : start + j + 1].unsqueeze(0), v[:, : start + j + 1].unsqueeze(0),
                enable_gqa=True, scale=1.0,
            ).view(1, -1))
        return torch.cat(rows)
    g = hq // hk
    block = block_mask.shape[0]
    outs: List[Tensor] = []
    for j in range(n):
        length = start + j + 1
        padded = (length + block - 1) // block * block
        if padded > k.shape[1]:
            raise ValueError("the cache does not hold whole attention blocks")
        r0 = length - 1 - (padded - block)
        scores = torch.bmm(q[j].view(hk, g, d), k[:, :padded].transpose(1, 2))
        if r0 < block - 1:
            scores.narrow(2, padded - block, block).add_(block_mask[r0])
        outs.append(torch.bmm(torch.softmax(scores, -1), v[:, :padded]).view(1, hq * d))
    if len(outs) == 1:
        return outs[0]
    return torch.cat(outs)


def _attend_exact(q: Tensor, k: Tensor, v: Tensor, start: int, block_mask: Tensor, kernel: bool) -> Tensor:
    """native._attend_rows: the compiled kernel for float32 rows where the process uses it."""
    if kernel and q.dtype == torch.float32:
        return torch.ops.specdec.attend(q, k, v, start, None)
    return _attend_rows(q, k, v, start, block_mask)


def _layers(
    x: Tensor,  # [n, D]
    cos: Tensor,  # [n, 1, d]
    sin: Tensor,  # [n, 1, d], signed (see native._rotate)
    k_all: Tensor,  # [Lyr, Hkv, T, d]
    v_all: Tensor,
    start: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    eps: Tensor,
    w: Weights,
    mask: Optional[Tensor],  # [n, end] additive: one masked attention call per layer (fast mode)
    tree_start: int,  # first slot of a token tree's region (exact tree attention), else -1
    tree_steps: List[List[int]],  # per visited node: [row, attended length, slot, node, ...]
    tree_perm: Optional[Tensor],  # [n] visited rows -> node order
    tree_paths: Optional[Tensor],  # [n, E] with the attention kernel: each node's path slots (native._TreeLayout.paths)
    taps: List[int],  # layer counts whose residual stream is returned (target-aware drafters)
    plan: List[List[int]],  # [layer, attention on, MLP on, cache slot] per step; [] = every layer
    final_norm: bool,  # scale by the final RMS (the LM head's input), else the raw residual stream
    block_mask: Tensor,  # [B, B] exact attention's last-block mask (native._BLOCK_MASK)
) -> Tuple[Tensor, List[Tensor]]:  # (the LM head's input [n, D], residual stream [n, D] per tap)
    n = x.shape[0]
    tapped: List[Tensor] = []
    if 0 in taps:
        tapped.append(x)
    end = start + n
    hq, hk, d = n_heads, n_kv_heads, head_dim
    width = x.shape[1]
    q_size = hq * d
    qk_size = (hq + hk) * d
    if len(plan) == 0:
        plan = [[li, 1, 1, li] for li in range(len(w.kinds) // 4)]
    for step_ in plan:
        li = step_[0]
        lin = 4 * li
        if step_[1] == 0:  # attention skipped: nothing written to the cache
            if step_[2] != 0:
                x = _mlp(lin, x, eps, width, w)
            if li + 1 in taps:
                tapped.append(x)
            continue
        qkv = _linear(lin, x, _inv_rms(x, eps, width), w)
        qk = _normed(qkv[:, :qk_size].view(n, hq + hk, d), li, hq, eps, w)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
        k_cache = k_all[step_[3]]
        v_cache = v_all[step_[3]]
        k_cache[:, start:end] = qk[:, hq:].transpose(0, 1)
        v_cache[:, start:end] = qkv[:, qk_size:].view(n, hk, d).transpose(0, 1)
        if mask is not None:  # fast mode: one masked call (prefill, a draft's tree)
            attn = F.scaled_dot_product_attention(
                qk[:, :hq].transpose(0, 1).unsqueeze(0), k_cache[:, :end].unsqueeze(0), v_cache[:, :end].unsqueeze(0),
                attn_mask=mask, enable_gqa=hq != hk, scale=1.0,
            )[0].transpose(0, 1).reshape(n, q_size)
        elif tree_start >= 0 and tree_paths is not None:  # the kernel reads each node's path in place
            attn = torch.ops.specdec.attend(qk[:, :hq], k_cache, v_cache, tree_start, tree_paths)
        elif tree_start >= 0:  # exact tree attention: each node sees cache[:start] + its path, in place
            k_new = k_cache[:, tree_start:end].clone()
            v_new = v_cache[:, tree_start:end].clone()
            outs: List[Tensor] = []
            run: List[int] = []  # visited rows whose paths extend one another (native: attend_invariant)
            first = 0
            moved = False
            q_all = qk[:, :hq]
            for step in tree_steps:
                extends = len(run) > 0 and step[1] == first + len(run)
                for c in range((len(step) - 2) // 2):
                    if step[2 + 2 * c] != step[1] - 1:
                        extends = False
                if len(run) > 0 and not extends:
                    outs.append(_attend_rows(_rows(q_all, run), k_cache, v_cache, first - 1, block_mask))
                    run = []
                if len(run) == 0:
                    first = step[1]
                for c in range((len(step) - 2) // 2):
                    k_cache[:, step[2 + 2 * c]] = k_new[:, step[3 + 2 * c]]
                    v_cache[:, step[2 + 2 * c]] = v_new[:, step[3 + 2 * c]]
                    moved = True
                run.append(step[0])
            outs.append(_attend_rows(_rows(q_all, run), k_cache, v_cache, first - 1, block_mask))
            if moved:
                k_cache[:, tree_start:end] = k_new
                v_cache[:, tree_start:end] = v_new
            attn = outs[0] if len(outs) == 1 else torch.cat(outs)
            if tree_perm is not None:
                attn = attn.index_select(0, tree_perm)
        else:
            attn = _attend_exact(qk[:, :hq], k_cache, v_cache, start, block_mask, w.attend)
        x = x + _linear(lin + 1, attn, None, w)
        if step_[2] != 0:
            x = _mlp(lin, x, eps, width, w)
        if li + 1 in taps:
            tapped.append(x)
    if final_norm:
        return x * _inv_rms(x, eps, width), tapped
    return x, tapped


def _layers_batch(
    x: Tensor,  # [M, D] the rows of every sequence, concatenated
    cos: Tensor,  # [M, 1, d]
    sin: Tensor,  # [M, 1, d], signed (see native._rotate)
    k_caches: List[Tensor],  # per sequence [Lyr, Hkv, T_i, d]
    v_caches: List[Tensor],
    starts: List[int],  # per sequence: the cache position of its first row
    sizes: List[int],  # per sequence: its rows
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    eps: Tensor,
    w: Weights,
    exact: bool,  # batch-invariant per-row attention for every sequence (else one masked call for multi-row ones)
    block_mask: Tensor,  # [B, B] exact attention's last-block mask
) -> Tensor:  # the LM head's input [M, D]
    """NativeCausalLM._forward_batch's layer loop, op for op: the linear layers over all rows at
    once, attention per sequence against its own cache with the shapes a solo pass uses."""
    total = x.shape[0]
    hq, hk, d = n_heads, n_kv_heads, head_dim
    width = x.shape[1]
    q_size = hq * d
    qk_size = (hq + hk) * d
    for li in range(len(w.kinds) // 4):
        lin = 4 * li
        qkv = _linear(lin, x, _inv_rms(x, eps, width), w)
        qk = _normed(qkv[:, :qk_size].view(total, hq + hk, d), li, hq, eps, w)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, -1), sin)
        parts: List[Tensor] = []
        o = 0
        for s in range(len(sizes)):
            n = sizes[s]
            start = starts[s]
            end = start + n
            k_cache = k_caches[s][li]
            v_cache = v_caches[s][li]
            k_cache[:, start:end] = qk[o : o + n, hq:].transpose(0, 1)
            v_cache[:, start:end] = qkv[o : o + n, qk_size:].view(n, hk, d).transpose(0, 1)
            q = qk[o : o + n, :hq]
            if exact or n == 1:
                parts.append(_attend_exact(q, k_cache, v_cache, start, block_mask, w.attend))
            else:
                mask = torch.full((n, end), float("-inf"), dtype=q.dtype).triu_(start + 1)
                parts.append(F.scaled_dot_product_attention(
                    q.transpose(0, 1).unsqueeze(0), k_cache[:, :end].unsqueeze(0), v_cache[:, :end].unsqueeze(0),
                    attn_mask=mask, enable_gqa=hq != hk, scale=1.0,
                )[0].transpose(0, 1).reshape(n, q_size))
            o += n
        attn = torch.cat(parts)
        x = x + _linear(lin + 1, attn, None, w)
        x = _mlp(lin, x, eps, width, w)
    return x * _inv_rms(x, eps, width)


#: whether TorchScript's graph executor optimises the compiled loops.  Off: its profiling executor
#: spends ~200-300 ms on each of a function's first specialisations (the first two calls, then
#: again for new input shapes), which landed in the first requests' time to first token (a cold
#: `specdec generate`: ~280 -> ~90 ms), and the optimised graph was no faster -- the loop's ops
#: are opaque kernels with nothing to fuse (one-row and four-row passes within ±1 %, paired).  It
#: also means the graph that runs is the one the tests compare with the Python loop, from the
#: first call on.  The flag is thread-local in torch, so it is set around each call.
JIT_OPTIMIZE = False


def _call(fn, *args):  # noqa: ANN001, ANN002, ANN202 - a scripted function and its arguments
    """Call a compiled loop with TorchScript's graph optimiser set by :data:`JIT_OPTIMIZE`."""
    with torch.jit.optimized_execution(JIT_OPTIMIZE):
        return fn(*args)


_compiled_batch = None


def compiled_batch_layers():
    """The TorchScript-compiled batched layer loop (once per process), or None."""
    global _compiled_batch
    if _compiled_batch is None:
        kernels.load()  # the ops the loop names exist before it is compiled
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _compiled_batch = torch.jit.script(_layers_batch)
        except Exception:  # noqa: BLE001 - any failure means: use the Python loop
            _compiled_batch = False
    return _compiled_batch or None


_compiled = None


def compiled_layers():
    """The TorchScript-compiled layer loop (compiled once per process), or None where TorchScript
    is unavailable."""
    global _compiled
    if _compiled is None:
        kernels.load()  # the ops the loop names exist before it is compiled
        try:
            with warnings.catch_warnings():  # TorchScript is in maintenance mode; it still runs
                warnings.simplefilter("ignore")
                _compiled = torch.jit.script(_layers)
        except Exception:  # noqa: BLE001 - any failure means: use the Python loop
            _compiled = False
    return _compiled or None


class ScriptedLayers:
    """The layer weights of a :class:`NativeCausalLM` laid out for :func:`_layers`."""

    def __init__(self, layers: list) -> None:
        from specdec.models.linear import Linear, Q4Linear, W8A8Linear, W8A8OneDNNLinear

        self.fn = compiled_layers()
        self.kinds: list[int] = []
        self.q8: dict[int, object] = {}
        self.staging: dict[int, Tensor] = {}
        self.chunks: dict[int, list[Tensor]] = {}
        self.bounds: dict[int, list[int]] = {}
        self.dense: dict[int, Tensor] = {}
        self.bias: dict[int, Tensor] = {}
        self.smooth: dict[int, Tensor] = {}  # W8A8 input factors (inverse smoothing)
        self.wide: dict[int, list[Tensor]] = {}  # W8A8 layers' oneDNN packing (linear.wide_packing)
        self.wide_rows: dict[int, int] = {}
        self.vnni: dict[int, list[Tensor]] = {}  # W8A8 layers' few-row kernel packing (linear.vnni_packing)
        self.q4: dict[int, list[Tensor]] = {}  # Q4Linear layers (see Q4)
        self.n_out: dict[int, int] = {}  # Q4 and F32 layers' output features
        #: Qwen3's query and key norms by layer ([q gain (the attention scale folded in), k gain])
        self.head_norms: dict[int, list[Tensor]] = {
            li: [layer.q_norm, layer.k_norm] for li, layer in enumerate(layers) if getattr(layer, "q_norm", None) is not None}
        #: Gemma 3's layer (output norms, tanh-GELU, two rotary tables): only the fused call runs
        #: it; the passes it does not take return None, and the caller runs the Python loop
        self.gemma = any(getattr(layer, "post_attn", None) is not None for layer in layers)
        self._w8a8_at: dict[int, W8A8Linear] = {}  # the W8A8 layers by index
        self._q8_few = -1  # the few-row setting self.q8 was made for (see _fbgemm)
        self.reduce_range = False
        for layer in layers:
            for lin in (layer.qkv, layer.out, layer.gate_up, layer.down):
                i = len(self.kinds)
                if lin.bias is not None:
                    self.bias[i] = lin.bias
                if isinstance(lin, W8A8Linear):
                    self.kinds.append(W8A8)
                    self._w8a8_at[i] = lin
                    if lin.inv_smooth is not None:
                        self.smooth[i] = lin.inv_smooth
                    self.reduce_range = lin._reduce_range
                    if lin.wide is not None:
                        self.wide[i] = lin.wide
                        self.wide_rows[i] = lin.wide_rows
                    if lin.vnni is not None:
                        self.vnni[i] = lin.vnni
                elif isinstance(lin, Q4Linear):
                    self.kinds.append(Q4)
                    self.q4[i] = [lin.gain, lin.col, lin.packed, lin.packed6] if lin.packed is not None else [lin.gain, lin.col, *lin.ref]
                    self.n_out[i] = lin.out_features
                elif isinstance(lin, W8A8OneDNNLinear):
                    self.kinds.append(ONEDNN_INT8)
                    self.chunks[i] = [lin.packed, lin.w_scale, lin.w_zero]
                    if lin.inv_smooth is not None:
                        self.smooth[i] = lin.inv_smooth
                elif isinstance(lin, Linear) and lin.f32 is not None:
                    self.kinds.append(F32)
                    self.dense[i] = lin.f32
                    self.n_out[i] = lin.out_features
                elif isinstance(lin, Linear) and lin.packed is not None:
                    self.kinds.append(PACKED)
                    self.chunks[i] = list(lin.packed)
                    self.bounds[i] = list(lin._bounds)
                elif isinstance(lin, Linear):
                    self.kinds.append(DENSE)
                    self.dense[i] = lin.weight
                else:
                    raise TypeError(f"no scripted path for {type(lin).__name__}")
        self._rows = 0
        self._ensure(16)
        #: every layer matrix a 4-bit product or a W8A8 few-row product on the compiled kernels:
        #: decoding steps, chain and tree verification passes and (exact) batched passes run the
        #: whole loop as one compiled call
        #: (csrc/layers.cpp, bitwise this loop); None where a layer is of another kind or the
        #: kernels did not load
        self.fused: torch.ScriptObject | None = None  # a torch.classes.specdec.FusedWeights
        #: the most rows the fused call takes: W8A8 layers only on the few-row kernel's range
        self.fused_rows: int = 1 << 30
        self._q8_fused = False
        fusable = all((k == Q4 and len(self.q4[i]) == 4) or (k == W8A8 and i in self.vnni) for i, k in enumerate(self.kinds))
        if self.kinds and fusable and kernels.load():
            empty = torch.empty(0)
            weights: list[Tensor] = []
            for i, k in enumerate(self.kinds):
                bias = self.bias.get(i, empty).float().contiguous()
                if k == Q4:
                    gain, col, packed, packed6 = self.q4[i]
                    weights += [gain, col, packed, packed6, bias]
                else:
                    packed, comp, col = self.vnni[i]
                    weights += [self.smooth.get(i, empty), col, packed, comp, bias]
                    if i in self.wide:
                        self.fused_rows = min(self.fused_rows, self.wide_rows[i] - 1)
            # one object, checked once: passed as a list, the tensors cost ~50 µs of dispatch a call
            self.fused = torch.classes.specdec.FusedWeights(
                [4 if k == Q4 else 0 for k in self.kinds], weights, [self.n_out.get(i, 0) for i in range(len(self.kinds))])
            if self.head_norms:  # [q gain, k gain] per layer, float32 [d] each (empty: none)
                self.fused.set_head_norms([t.float().contiguous() for li in range(len(self.kinds) // 4)
                                           for t in self.head_norms.get(li, [empty, empty])])
            if self.gemma:  # output norms' gains (attention's, MLP's) and rotary table per layer
                self.fused.set_gemma([g.float().contiguous() for layer in layers for g in (layer.post_attn, layer.post_mlp)],
                                     [int(layer.rope) for layer in layers])
            windows = [int(getattr(layer, "window", None) or 0) for layer in layers]
            if any(windows):  # sliding-window layers: rows past the window attend to it alone
                self.fused.set_windows(windows)
            self._q8_fused = W8A8 in self.kinds

    def _fuses(self, x: Tensor) -> bool:
        """Whether the fused call can take these rows now: float32, exact attention on the kernel,
        and W8A8 layers within their few-row kernel's range (``linear.few_rows``, read per call as
        ``_linear`` does) and below their oneDNN switch."""
        if self.fused is None or x.dtype != torch.float32 or not kernels.attention_kernel():
            return False
        return x.shape[0] <= (min(self.fused_rows, linear_mod.few_rows(self.reduce_range)) if self._q8_fused else self.fused_rows)

    def _ensure(self, rows: int) -> None:
        if rows <= self._rows:
            return
        for lin in self._w8a8_at.values():
            lin._staged(rows)  # grows the staging buffer
        self.staging = {i: lin._buf for i, lin in self._w8a8_at.items()}
        self._rows = min(lin._buf.shape[0] for lin in self._w8a8_at.values()) if self._w8a8_at else 1 << 30

    def _fbgemm(self, few: int) -> dict[int, object]:
        """fbgemm's packed weights of the W8A8 layers that run some row count on fbgemm under the
        few-row setting ``few`` (none on the AVX2 build, which takes every row count; packed when
        first needed, e.g. after a test lowers the setting)."""
        if few != self._q8_few:
            self.q8 = {i: lin.packed for i, lin in self._w8a8_at.items() if not lin.fbgemm_unused}
            self._q8_few = few
        return self.q8

    def weights(self) -> Weights:
        """The tables as the scripted loops take them (the staging buffers may have grown)."""
        few = linear_mod.few_rows(self.reduce_range)
        return Weights(self.kinds, self._fbgemm(few), self.staging, self.reduce_range, self.chunks, self.bounds, self.dense,  # type: ignore[arg-type]
                       self.bias, self.smooth, self.wide, self.wide_rows, self.vnni, few,
                       kernels.attention_kernel(), self.q4, self.n_out, self.head_norms)

    def __call__(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache, start: int, cfg, eps: Tensor, *,
        mask: Tensor | None = None, tree=None, taps: dict[int, Tensor] | None = None,
        plan: list[list[int]] | None = None, local: tuple[Tensor, Tensor] | None = None, past_window: bool = False,
    ) -> Tensor | None:
        """``mask``: fast-mode attention (one masked call per layer); ``tree``: a
        ``native._TreeLayout`` for exact per-node tree attention; neither: per-row attention.
        ``taps`` (layer count -> filled with the residual stream after that many layers, [n, D])
        as in :meth:`NativeCausalLM.hidden`.  ``plan``: run only these ``[layer, attention on,
        MLP on, cache slot]`` steps and return the raw residual stream (no final norm), as
        :meth:`NativeCausalLM.run_layers` does.  ``local``: the sliding layers' own rotary rows
        (Gemma 3), cos / sin [n, 1, d].  ``past_window``: some row at or past a sliding window,
        which only the fused call windows.  None where the pass is Gemma 3's or
        past a window and the fused call does not take it (the caller's Python loop runs it)."""
        n_layers = len(self.kinds) // 4
        if mask is None and (tree is None or tree.paths is not None) and self._fuses(x) \
                and (not taps or plan is None and all(0 <= k < n_layers for k in taps)):
            tree_start, paths = (-1, None) if tree is None else (tree.start, tree.paths)
            cos_l, sin_l = (None, None) if local is None else local
            if not taps:
                return torch.ops.specdec.fused_layers(
                    x, cos, sin, cache.k, cache.v, start, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, eps, self.fused,
                    [v for step in plan for v in step] if plan else [], plan is None, tree_start, paths,
                    cos_local=cos_l, sin_local=sin_l)
            # a feature drafter's pass: the call copies the residual stream after each tapped layer
            # count into ``out`` as it goes (one call per stretch between taps cost ~0.25-0.5 ms a tap)
            if 0 in taps:
                taps[0] = x
            inner = sorted(k for k in taps if k > 0)
            out = x.new_empty(len(inner), x.shape[0], x.shape[1])  # [taps, n, D]
            y = torch.ops.specdec.fused_layers(
                x, cos, sin, cache.k, cache.v, start, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, eps, self.fused,
                [], True, tree_start, paths, inner, out if inner else None, cos_local=cos_l, sin_local=sin_l)
            for j, k in enumerate(inner):
                taps[k] = out[j]
            return y
        if self.gemma or past_window:
            return None
        self._ensure(x.shape[0])
        tree_start, steps, perm, paths = -1, [], None, None
        if tree is not None:
            tree_start, paths = tree.start, tree.paths
            if paths is None:
                steps, perm = tree.scripted_steps()
        wanted = [k for k in sorted(taps) if 0 <= k <= len(self.kinds) // 4] if taps else []
        out, tapped = _call(
            self.fn, x, cos, sin, cache.k, cache.v, start, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, eps,
            self.weights(), mask, tree_start, steps, perm, paths, wanted, plan or [], plan is None, BLOCK_MASK,
        )
        if taps:
            for k, t in zip(wanted, tapped):
                taps[k] = t
        return out

    def batch(self, x: Tensor, cos: Tensor, sin: Tensor, caches: list, starts: list[int], sizes: list[int], cfg,
              eps: Tensor, *, exact: bool, taps: dict[int, Tensor] | None = None,
              local: tuple[Tensor, Tensor] | None = None, past_window: bool = False,
              ) -> Tensor | None:  # x: [M, D] -> [M, D]
        """:meth:`NativeCausalLM.forward_batch`'s layers (None where the batched loop did not compile,
        where ``taps`` are asked of a pass the fused call does not run, or where Gemma 3's pass is not
        the fused call's: the Python loop runs those).  ``taps``, ``local`` and ``past_window`` as
        :meth:`__call__` takes them, over all M rows."""
        n_layers = len(self.kinds) // 4
        if exact and self._fuses(x) and (not taps or all(0 <= k < n_layers for k in taps)):
            # the same ops in one compiled call (csrc/layers.cpp), which copies the tapped residual
            # streams out as it goes
            inner = sorted(k for k in taps if k > 0) if taps else []
            out = x.new_empty(len(inner), x.shape[0], x.shape[1]) if inner else None  # [taps, M, D]
            y = torch.ops.specdec.fused_layers_batch(
                x, cos, sin, [c.k for c in caches], [c.v for c in caches], starts, sizes, cfg.n_heads, cfg.n_kv_heads,
                cfg.head_dim, eps, self.fused, inner, out, cos_local=None if local is None else local[0],
                sin_local=None if local is None else local[1])
            if taps:
                if 0 in taps:
                    taps[0] = x
                for j, k in enumerate(inner):
                    taps[k] = out[j]  # type: ignore[index]
            return y
        if taps or self.gemma or past_window:
            return None
        fn = compiled_batch_layers()
        if fn is None:
            return None
        self._ensure(x.shape[0])
        return _call(
            fn, x, cos, sin, [c.k for c in caches], [c.v for c in caches], starts, sizes, cfg.n_heads, cfg.n_kv_heads,
            cfg.head_dim, eps, self.weights(), exact, BLOCK_MASK,
        )
