"""4-bit weight blocks read from a GGUF file as shipped (for the ``q4`` target).

A GGUF model's layer matrices come as Q4_0 / Q4_1 blocks (32 inputs of one output: 4-bit codes,
a float16 scale and, for Q4_1, a float16 minimum; Q4_0 is Q4_1 with ``m = -8 d``, which float16
represents exactly), or as Q4_K super-blocks of eight such blocks (read as Q4_1 blocks with the
file's codes and float16 block scales: :func:`q4_k_blocks`).  :func:`read_q4_blocks` returns them
under the Hugging Face names the native backend uses, with llama.cpp's row permutation of the
query and key projections of Llama models undone (the one ``transformers`` undoes when it converts
the file), so that dequantising a block gives the converted float32 weight (tested; a Q4_K block
up to its float16 scales).  With ``q6=True`` it also returns Q6_K super-blocks (6-bit codes under
int8 scales per 16 inputs and a float16 scale per 256: :func:`q6_k_blocks`), which the 4-bit kernel
runs as shipped too.  Matrices of other block types are not returned; the loader quantises those
from float32 (:func:`specdec.models.linear.quantize_q4_1`).
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from specdec.models.linear import Q4Blocks, Q6Blocks

#: GGUF tensor name (within ``blk.N.``) -> Hugging Face name (within ``model.layers.N.``)
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
#: architectures whose query / key rows llama.cpp's converter permutes (interleaved rotary halves)
PERMUTED = ("llama",)


def _unpermute(rows: int, n_head: int) -> torch.Tensor:
    """The GGUF row index of each Hugging Face row of a permuted q / k projection ([rows] int64)."""
    dim = rows // n_head // 2
    return torch.arange(rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(rows)


#: GGUF metadata value types -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
#: ggml block types read here: (bytes per block of 32, has a minimum)
_Q4_TYPES = {2: ("Q4_0", 18), 3: ("Q4_1", 20)}
#: ggml's Q4_K: super-blocks of 256 inputs (8 blocks of 32), 144 bytes each
_Q4_K, _Q4_K_BYTES = 12, 144
#: ggml's Q6_K: super-blocks of 256 inputs, 210 bytes each
_Q6_K, _Q6_K_BYTES = 14, 210


class _Header(NamedTuple):
    arch: str
    alignment: int
    data_start: int  # file offset of the tensor data section
    tensors: list[tuple[str, list[int], int, int]]  # (name, dims (inner first), ggml type, offset)
    block_count: object = None  # the ``<arch>.block_count`` it declares (its layers), as written


def gguf_architecture(path: str | Path) -> str:
    """The ``general.architecture`` a GGUF file declares (``llama``, ``qwen2``, ``gemma3``, ...)."""
    try:
        return _read_header(path).arch
    except _DAMAGED as exc:
        raise ValueError(f"{path} is not a readable GGUF file ({type(exc).__name__})") from None


#: what parsing a damaged or hostile GGUF raises (a count past the file, nesting, a bad field)
_DAMAGED = (struct.error, UnicodeDecodeError, OverflowError, RecursionError, ValueError, RuntimeError, MemoryError)


def _read_header(path: str | Path) -> _Header:
    """The metadata and tensor table of a GGUF file (what GGUFReader parses, without building
    an array per tensor and per vocabulary entry), parsed once per process for each version of
    the file (the engine asks whether a target ships 4-bit blocks, then reads them)."""
    st = os.stat(path)
    return _parse_header(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _parse_header(path: str, size: int, mtime_ns: int) -> _Header:  # size, mtime: the cache key
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def unpack(fmt: str):
            nonlocal pos
            value = struct.unpack_from("<" + fmt, buf, pos)[0]
            pos += struct.calcsize("<" + fmt)
            return value

        def skip(n: int) -> None:  # past n bytes that the file must hold
            nonlocal pos
            if n > len(buf) - pos:
                raise ValueError(f"{path}: the GGUF header runs past the end of the file")
            pos += n

        def string() -> str:
            n = unpack("Q")
            skip(n)
            return buf[pos - n : pos].decode("utf-8", "replace")

        def value(kind: int, nested: bool = False):
            if kind in _SCALARS:
                return unpack(_SCALARS[kind])
            if kind == 8:
                return string()
            if kind == 9:
                inner, count = unpack("I"), unpack("Q")
                if inner in _SCALARS:  # skipped whole
                    skip(count * struct.calcsize(_SCALARS[inner]))
                elif inner == 8:  # strings (a vocabulary, merges): skipped, never decoded
                    length = struct.Struct("<Q").unpack_from
                    if count > (len(buf) - pos) // 8:
                        raise ValueError(f"{path}: a GGUF array holds more strings than the file has room for")
                    for _ in range(count):
                        skip(8 + length(buf, pos)[0])
                elif inner == 9 and nested:
                    raise ValueError(f"{path}: GGUF arrays nested more than one deep")
                else:  # arrays of arrays: each at least 12 bytes
                    if count > (len(buf) - pos) // 12:
                        raise ValueError(f"{path}: a GGUF array holds more entries than the file has room for")
                    for _ in range(count):
                        value(inner, nested=True)
                return None
            raise ValueError(f"unknown GGUF value type {kind}")

        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        pos = 4
        unpack("I")  # version
        n_tensors, n_kv = unpack("Q"), unpack("Q")
        # a key-value record takes at least 13 bytes (key length, type, a one-byte value), a tensor's 24
        if n_kv > len(buf) // 13 or n_tensors > len(buf) // 24:
            raise ValueError(f"{path}: the GGUF header counts more records than the file has room for")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(unpack("I"))
        tensors = []
        for _ in range(n_tensors):
            name = string()
            dims = [unpack("Q") for _ in range(unpack("I"))]
            tensors.append((name, dims, unpack("I"), unpack("Q")))
        alignment = meta.get("general.alignment", 32)  # 0 is no alignment: refused below, as llama.cpp does
        if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
            raise ValueError(f"{path}: general.alignment must be a positive whole number, got {alignment!r}")
        data_start = -(-pos // alignment) * alignment
    arch = str(meta.get("general.architecture") or "")
    return _Header(arch, alignment, data_start, tensors, meta.get(f"{arch}.block_count"))


def check_block_count(path: str | Path) -> None:
    """Refuse a GGUF whose layer tensors (``blk.N.*``) do not match the layer count it declares
    (``<arch>.block_count``): layers past it would be dropped without a word, and a missing last
    layer makes another model. A ConfigError naming both; a header this reader cannot parse is
    left to the converter, which reports it."""
    from specdec.errors import ConfigError

    try:
        header = _read_header(path)
    except (OSError, *_DAMAGED):
        return
    held = {int(p[1]) for p in (name.split(".") for name, *_ in header.tensors) if p[0] == "blk" and len(p) > 2 and p[1].isdigit()}
    declared = header.block_count
    if not held or not isinstance(declared, int) or isinstance(declared, bool):
        return
    if held != set(range(declared)):
        top = max(held)
        holds = f"layers 0..{top}" if held == set(range(top + 1)) else "layers " + ", ".join(map(str, sorted(held)))
        raise ConfigError(f"{path}: {header.arch}.block_count declares {declared} layers but the file holds "
                          f"{holds}; the file is damaged or edited")


def _layer_name(name: str) -> str | None:
    """``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` (None: not a layer matrix)."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in LAYER_NAMES or parts[3] != "weight":
        return None
    return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.weight"


def ships_q4(ref: str) -> bool:
    """Whether the model ``ref`` (registry name or path) comes as a GGUF whose layer matrices are
    mostly (by weight count) Q4_0 / Q4_1 / Q4_K blocks: the ones the ``q4`` target runs as shipped
    (Q4_K with its block scales rounded to float16, see :func:`q4_k_blocks`).
    False for anything else, and for a name that does not resolve (loading reports that)."""
    from specdec.errors import SpecdecError
    from specdec.models.registry import gguf_file

    try:
        path = gguf_file(ref)
    except (SpecdecError, OSError):
        return False
    try:
        header = _read_header(path)
    except (OSError, *_DAMAGED):
        return False  # an unreadable file is reported when it is loaded
    sizes = [(kind, math.prod(dims)) for name, dims, kind, _ in header.tensors if _layer_name(name)]
    total = sum(n for _, n in sizes)
    return total > 0 and 2 * sum(n for kind, n in sizes if kind in _Q4_TYPES or kind == _Q4_K) >= total


def read_q4_blocks(path: str | Path, n_heads: int, n_kv_heads: int, *, q6: bool = False) -> dict[str, Q4Blocks | Q6Blocks]:
    """Every Q4_0 / Q4_1 / Q4_K layer matrix of the GGUF at ``path``, by Hugging Face weight name
    (Q4_K as Q4_1 blocks: see :func:`q4_k_blocks`), and with ``q6`` every Q6_K one (as
    :class:`Q6Blocks`: see :func:`q6_k_blocks`) and an untied LM head of any of those types
    (``output.weight``, as ``lm_head.weight``).  A damaged file is a one-line :class:`ConfigError`."""
    from specdec.errors import ConfigError

    try:
        return _read_blocks(path, n_heads, n_kv_heads, q6=q6)
    except _DAMAGED as exc:
        raise ConfigError(f"cannot read the 4-bit blocks of {path} ({type(exc).__name__}: {exc})".splitlines()[0]) from None


#: inputs per block and bytes per block of the block types read here
_BLOCK_BYTES = {2: (32, 18), 3: (32, 20), _Q4_K: (256, _Q4_K_BYTES), _Q6_K: (256, _Q6_K_BYTES)}


def _read_blocks(path: str | Path, n_heads: int, n_kv_heads: int, *, q6: bool) -> dict[str, Q4Blocks | Q6Blocks]:
    header = _read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, Q4Blocks | Q6Blocks] = {}
    kinds = (*_Q4_TYPES, _Q4_K, *((_Q6_K,) if q6 else ()))
    for name, dims, kind, offset in header.tensors:
        hf = "lm_head.weight" if q6 and name == "output.weight" else _layer_name(name)
        if hf is None or kind not in kinds:
            continue
        k, n = (dims or [0])[0], math.prod(dims[1:])  # inputs (inner), outputs
        start = header.data_start + offset
        per_block, block_bytes = _BLOCK_BYTES[kind]
        if k < 1 or k % per_block or start + n * (k // per_block) * block_bytes > len(data):
            raise ValueError(f"tensor {name} of {dims} does not fit whole blocks inside the file")
        if kind == _Q6_K:
            raw = np.array(data[start : start + n * (k // 256) * _Q6_K_BYTES])
            b = q6_k_blocks(torch.from_numpy(raw).view(n, k // 256, _Q6_K_BYTES))
        elif kind == _Q4_K:
            raw = np.array(data[start : start + n * (k // 256) * _Q4_K_BYTES])
            b = q4_k_blocks(torch.from_numpy(raw).view(n, k // 256, _Q4_K_BYTES))
        else:
            label, size = _Q4_TYPES[kind]
            raw = np.array(data[start : start + n * (k // 32) * size])  # a copy: [N * nb * size]
            blocks = torch.from_numpy(raw).view(n, k // 32, size)
            d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]  # [N, nb]
            if label == "Q4_1":
                m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]
                qs = blocks[..., 4:20]
            else:
                m = d * -8.0  # exact: a power of two
                qs = blocks[..., 2:18]
            b = Q4Blocks(qs.contiguous(), d.contiguous(), m.contiguous())
        part = name.split(".")[2] if name.startswith("blk.") else ""
        if header.arch in PERMUTED and part in ("attn_q", "attn_k"):
            b = b.take(_unpermute(n, n_heads if part == "attn_q" else n_kv_heads))
        out[hf] = b
    del data
    return out


def q4_k_blocks(raw: torch.Tensor) -> Q4Blocks:
    """ggml's Q4_K super-blocks (uint8 [N, K/256, 144]) as Q4_1 blocks with the file's 4-bit codes.

    A super-block holds a float16 scale ``d`` and minimum scale ``dmin``, eight 6-bit scales
    ``sc_j`` and mins ``m_j`` (12 bytes, packed as llama.cpp's ``get_scale_min_k4`` reads them) and
    128 bytes of codes; input i of block j is ``(d * sc_j) * q - (dmin * m_j)``, i.e. a Q4_1 block
    with scale ``d * sc_j`` and minimum ``-(dmin * m_j)``.  Those products are exact in float32 but
    need up to 17 significant bits, and Q4_1 keeps them as float16 (11 bits): they are rounded to
    nearest, a relative change of at most 2^-11 of a block's scale and minimum (the codes, what the
    4 bits hold, are the file's).  In the codes a 64-input chunk's 32 bytes hold block 2c in their low
    nibbles and block 2c + 1 in their high ones; Q4_1's byte i holds inputs i and i + 16.
    """
    n, ns, _ = raw.shape
    d = raw[..., 0:2].contiguous().view(torch.float16)[..., 0].float()  # [N, S]
    dmin = raw[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    sc = raw[..., 4:16].long()  # [N, S, 12]
    scale = torch.cat([sc[..., 0:4] & 63, (sc[..., 8:12] & 0x0F) | ((sc[..., 0:4] >> 6) << 4)], -1)  # [N, S, 8]
    mins = torch.cat([sc[..., 4:8] & 63, (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)], -1)
    q = raw[..., 16:144].reshape(n, ns, 4, 32)  # [N, S, chunk, byte]
    codes = torch.stack([q & 0x0F, q >> 4], dim=3).reshape(n, ns * 8, 32)  # [N, blocks, input]
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # [N, nb, 16]
    block_d = (d[..., None] * scale.float()).reshape(n, ns * 8).half()
    block_m = (-(dmin[..., None] * mins.float())).reshape(n, ns * 8).half()
    return Q4Blocks(qs.contiguous(), block_d.contiguous(), block_m.contiguous())


def q6_k_blocks(raw: torch.Tensor) -> Q6Blocks:
    """ggml's Q6_K super-blocks (uint8 [N, K/256, 210]) as :class:`Q6Blocks`, codes and scales as
    shipped.

    A super-block holds 128 bytes of low nibbles ``ql``, 64 bytes of high bit pairs ``qh``, sixteen
    int8 scales (one per 16 inputs, in input order) and a float16 scale ``d``; input i's weight is
    ``d * sc[i // 16] * (q_i - 32)``.  In each half of 128 inputs (64 bytes of ``ql``, 32 of ``qh``),
    input 32 * c + l (quarter c, l < 32) takes the low nibble of ``ql[l]`` (c = 0), of ``ql[32 + l]``
    (c = 1), the high nibble of ``ql[l]`` (c = 2) or of ``ql[32 + l]`` (c = 3), and bits 2c, 2c + 1
    of ``qh[l]`` as its top two bits (llama.cpp's ``dequantize_row_q6_K``).
    """
    n, ns, _ = raw.shape
    ql = raw[..., 0:128].reshape(n, ns, 2, 2, 32)  # [N, S, half, ql's first / second 32 bytes, l]
    qh = raw[..., 128:192].reshape(n, ns, 2, 32)  # [N, S, half, l]
    low = torch.stack([ql[..., 0, :] & 0x0F, ql[..., 1, :] & 0x0F, ql[..., 0, :] >> 4, ql[..., 1, :] >> 4], 3)
    high = torch.stack([(qh >> (2 * c)) & 0x03 for c in range(4)], 3)  # [N, S, half, quarter, l]
    codes = (low | (high << 4)).reshape(n, ns * 8, 32)  # [N, blocks, input]
    sc = raw[..., 192:208].contiguous().view(torch.int8).reshape(n, ns * 8, 2)
    d = raw[..., 208:210].contiguous().view(torch.float16)[..., 0]  # [N, S]
    return Q6Blocks(codes.contiguous(), d.repeat_interleave(8, dim=1).contiguous(), sc.contiguous())
