"""GGUF's Q6_K blocks as shipped: reading the super-blocks, the Q6_K columns of the compiled 4-bit
product and their ATen reference, and a model whose value and down projections ship as Q6_K.

Every comparison is bitwise (``torch.equal``) against an independent computation: gguf's own
dequantiser for the reading, ``q6_reference`` (float32 matmuls of exact integers) for the kernel.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.models import kernels
from specdec.models.linear import Q4Linear, Q6Blocks, q46_reference, quantize_q4_1

from kernel_child import decode_in_child
from tests.models.test_q4 import on_one_and_two_threads
from tiny import make_tiny

needs_q4 = pytest.mark.skipif(not kernels.q4_available(), reason="the 4-bit kernel needs a C++ compiler")


def _q6_k_raw(rng: np.random.Generator, rows: int, k: int, *, extreme: bool = False) -> np.ndarray:
    """Random Q6_K super-blocks (uint8 [rows, k / 256 * 210]): every code and scale byte pattern;
    ``extreme``: every code 0 or 63 and every scale -128 or 127 (the largest integer sums)."""
    n = rows * (k // 256)
    codes = rng.integers(0, 256, (n, 192), dtype=np.uint8)
    sc = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    if extreme:
        codes = np.where(rng.random((n, 192)) < 0.5, 0, 255).astype(np.uint8)
        sc = np.where(rng.random((n, 16)) < 0.5, 0x80, 0x7F).astype(np.uint8)
    d = (rng.random(n) * 2e-4 + 1e-6).astype(np.float16)
    return np.concatenate([codes, sc, d.view(np.uint8).reshape(n, 2)], axis=1).reshape(rows, -1)


def _blocks(raw: np.ndarray) -> Q6Blocks:
    from specdec.models.gguf_blocks import q6_k_blocks

    return q6_k_blocks(torch.from_numpy(raw).view(raw.shape[0], -1, 210))


def _ref(lin_blocks: tuple) -> list[torch.Tensor]:
    """Q4Linear's reference operands for (Q4 blocks or None, Q6 blocks), written out here."""
    b4, b6 = lin_blocks
    k = b6.shape[1]
    nb = k // 32
    four = ([b4.codes().permute(1, 2, 0).float().contiguous(), b4.d.float().T.contiguous(), b4.m.float().T.contiguous()]
            if b4 is not None else [torch.zeros(nb, 32, 0), torch.zeros(nb, 0), torch.zeros(nb, 0)])
    n6, nb = b6.codes.shape[:2]
    weights = b6.sc.float().repeat_interleave(16, dim=2) * (b6.codes.float() - 32)  # [N, nb, 32]
    return four + [weights.permute(1, 2, 0).contiguous(), b6.d.float().T.contiguous()]


def _inputs(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * (torch.rand(n, 1, generator=g) * 20 + 1e-3)
    x[:, 7 % k] *= 40  # an outlier channel
    if n > 3:
        x[3] = 0.0  # a row whose every block step is 0
    return x


# ----------------------------------------------------------------------------- reading


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q6_k_super_blocks_are_read_as_shipped(tmp_path, arch):
    """Every weight of a Q6_K matrix dequantises bitwise to what gguf's own dequantiser gives
    (codes, nibble order, high bits and scales as llama.cpp lays them out), the query rows of a
    Llama file unpermuted; without ``q6`` they are not returned (the loader quantises them)."""
    import gguf

    from specdec.models.gguf_blocks import read_q4_blocks
    from tests.models.test_q4 import _hf_unpermute, _write_raw_gguf

    rng = np.random.default_rng(6)
    q = _q6_k_raw(rng, 64, 512)  # 4 heads of 16
    down = _q6_k_raw(rng, 40, 256)
    path = tmp_path / "six.gguf"
    _write_raw_gguf(path, {"blk.0.attn_q.weight": (q, "Q6_K"), "blk.0.ffn_down.weight": (down, "Q6_K")}, arch)
    assert read_q4_blocks(path, n_heads=4, n_kv_heads=2) == {}
    blocks = read_q4_blocks(path, n_heads=4, n_kv_heads=2, q6=True)

    def shipped(raw: np.ndarray) -> np.ndarray:
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(raw.shape[0], -1)

    want = _hf_unpermute(shipped(q), 4) if arch == "llama" else shipped(q)
    got = blocks["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(got, Q6Blocks) and got.codes.max() <= 63
    assert np.array_equal(got.dequantize().numpy(), want)
    assert np.array_equal(blocks["model.layers.0.mlp.down_proj.weight"].dequantize().numpy(), shipped(down))


# ----------------------------------------------------------------------------- the product


@needs_q4
@pytest.mark.parametrize("shape", [(0, 64, 256), (64, 40, 256), (96, 256, 512), (32, 7, 768)])
@pytest.mark.parametrize("extras", ["none", "gain+col"])
def test_q6_columns_are_bitwise_the_reference_and_batch_invariant(shape, extras):
    """The kernel's Q6_K columns (alone, or after whole groups of 4-bit columns; a partial last
    group) against ``q6_reference`` for 1-17 rows, each row bitwise what it gives alone."""
    n4, n6, k = shape
    rng = np.random.default_rng(n4 + n6 + k)
    g = torch.Generator().manual_seed(k)
    b4 = quantize_q4_1(torch.randn(n4, k, generator=g) * 0.05) if n4 else None
    b6 = _blocks(_q6_k_raw(rng, n6, k))
    gain = torch.rand(k, generator=g) + 0.5 if extras != "none" else None
    col = torch.rand(n4 + n6, generator=g) + 0.1 if extras != "none" else None
    lin = Q4Linear(b4, gain=gain, col=col, in_features=k, blocks6=b6)
    assert lin.packed6.numel() > 0 and lin.out_features == n4 + n6
    x = _inputs(17, k, seed=k + 1)
    solo = torch.cat([lin.product(x[i : i + 1]) for i in range(17)])
    for n in (1, 2, 3, 4, 5, 6, 7, 9, 16, 17):
        got = lin.product(x[:n])
        assert torch.equal(got, q46_reference(x[:n], lin.gain, _ref((b4, b6)), lin.col)), n
        assert torch.equal(got, solo[:n]), n
    assert torch.equal(solo[3], torch.zeros(n4 + n6))
    # close to the float product with the dequantised weights (8-bit activations)
    w = torch.cat([b4.dequantize() if b4 is not None else torch.zeros(0, k), b6.dequantize()])
    want = (x * (1 if gain is None else gain)) @ w.T * (1 if col is None else col)
    assert (solo - want).norm() / want.norm() < 0.03


@needs_q4
def test_the_largest_integer_sums_do_not_saturate():
    """Codes 0 / 63 and activations at +-127 everywhere: the int16 pair sums of the AVX2 path at
    their largest (4 x 63 x 127) still give the reference's exact sums."""
    rng = np.random.default_rng(3)
    b6 = _blocks(_q6_k_raw(rng, 64, 512, extreme=True))
    lin = Q4Linear(None, blocks6=b6)
    x = torch.where(torch.rand(6, 512, generator=torch.Generator().manual_seed(0)) < 0.5, -1.0, 1.0)
    for rows in (1, 3, 6):
        assert torch.equal(lin.product(x[:rows]), q46_reference(x[:rows], lin.gain, _ref((None, b6)), lin.col))


@needs_q4
def test_q6_bits_do_not_depend_on_the_thread_count():
    """A mixed layer big enough to be cut between two threads (by bytes, across the 4-bit and Q6_K
    groups) gives the same bits on one thread."""
    rng = np.random.default_rng(8)
    b4 = quantize_q4_1(torch.randn(1792, 1536, generator=torch.Generator().manual_seed(1)) * 0.05)
    lin = Q4Linear(b4, blocks6=_blocks(_q6_k_raw(rng, 256, 1536)))
    x = _inputs(5, 1536, seed=2)
    one, many = on_one_and_two_threads(lambda: lin.product(x))
    assert torch.equal(one, many)


@needs_q4
def test_the_layer_without_the_kernel_is_the_kernel_s_product(monkeypatch):
    """Where the library did not build, the layer keeps the reference's operands: the same bits."""
    rng = np.random.default_rng(4)
    b4 = quantize_q4_1(torch.randn(32, 256, generator=torch.Generator().manual_seed(5)) * 0.05)
    b6 = _blocks(_q6_k_raw(rng, 40, 256))
    x = _inputs(6, 256, seed=3)
    col = torch.rand(72) + 0.5
    on = Q4Linear(b4, col=col, blocks6=b6).product(x)
    monkeypatch.setattr(kernels, "q4_available", lambda: False)
    off = Q4Linear(b4, col=col, blocks6=b6)
    assert off.packed is None and torch.equal(off.product(x), on)


@needs_q4
@pytest.mark.parametrize("kernel", ["kernel", "reference"])
@pytest.mark.parametrize("shape", [(96, 0), (0, 70), (64, 40)])
def test_selected_outputs_are_bitwise_the_layer_s_columns(shape, kernel, monkeypatch):
    """``select_outputs`` (a reduced vocabulary's LM head): the packed bytes of the chosen columns
    copied into new groups give each column bitwise what the whole layer gives it, for sorted
    subsets, single columns, every column and (4-bit columns alone) any order; with both kinds of
    columns the kept 4-bit ones must fill whole groups of 32, else there is no such layer (None)."""
    if kernel == "reference":
        monkeypatch.setattr(kernels, "q4_available", lambda: False)
    n4, n6 = shape
    k, n = 256, n4 + n6
    g = torch.Generator().manual_seed(n)
    b4 = quantize_q4_1(torch.randn(n4, k, generator=g) * 0.05) if n4 else None
    b6 = _blocks(_q6_k_raw(np.random.default_rng(n), n6, k)) if n6 else None
    lin = Q4Linear(b4, torch.randn(n, generator=g), gain=torch.rand(k, generator=g) + 0.5,
                   col=torch.rand(n, generator=g) + 0.1, in_features=k, blocks6=b6)
    assert (lin.packed is None) == (kernel == "reference")
    x = _inputs(5, k, seed=n)
    full = lin(x)  # [5, n]
    one_kind = n4 if not n6 else n6  # subsets of one kind's columns (the Q6_K ones where there are)
    picks = [torch.arange(n), torch.tensor([n - 1]), n - one_kind + torch.tensor([0, one_kind - 1]),
             n - one_kind + torch.sort(torch.randperm(one_kind, generator=g)[: one_kind // 2 + 3]).values]
    if not n6:
        picks.append(torch.randperm(n, generator=g)[:37])  # any order
    if n4 and n6:
        picks += [torch.tensor([0, 7]),  # 4-bit columns alone
                  torch.cat([torch.arange(32), n4 + torch.tensor([1, 5, 39])])]  # one whole group, then Q6_K
    for ids in picks:
        sub = lin.select_outputs(ids)
        assert sub is not None and sub.out_features == ids.numel(), ids
        assert torch.equal(sub(x), full[:, ids]), ids
    if n4 and n6:
        assert lin.select_outputs(torch.tensor([3, n4 + 2])) is None  # a part group of 4-bit columns before Q6_K


@needs_q4
def test_the_q6_kernel_refuses_bad_inputs():
    b6 = _blocks(_q6_k_raw(np.random.default_rng(0), 32, 256))
    with pytest.raises(RuntimeError, match="0..63"):
        torch.ops.specdec.q6_pack(b6.codes | 64, b6.d, b6.sc)
    with pytest.raises(RuntimeError, match="sc must be"):
        torch.ops.specdec.q6_pack(b6.codes, b6.d, b6.sc.to(torch.uint8))
    packed6 = torch.ops.specdec.q6_pack(b6.codes, b6.d, b6.sc)
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="shapes"):  # 64 columns from one group of 32
        torch.ops.specdec.q4_linear(x, torch.empty(0), torch.empty(0, dtype=torch.uint8), 64, torch.empty(0), packed6)
    with pytest.raises(ValueError, match="whole groups"):
        Q4Linear(quantize_q4_1(torch.randn(20, 256)), blocks6=b6)


# ----------------------------------------------------------------------------- a whole model


def write_q6_gguf(path: Path, *, hidden: int = 256, layers: int = 2, head_rows: int = 0) -> Path:
    """A GGUF for :func:`tiny.make_tiny`'s Qwen2 model whose value projections (two KV heads of
    ``hidden / 4``), layer 0's down projection and, with ``head_rows``, an untied LM head ship as
    Q6_K, the rest left to the loader."""
    from tests.models.test_q4 import _write_raw_gguf

    rng = np.random.default_rng(9)
    tensors = {f"blk.{i}.attn_v.weight": (_q6_k_raw(rng, hidden // 2, hidden), "Q6_K") for i in range(layers)}
    tensors["blk.0.ffn_down.weight"] = (_q6_k_raw(rng, hidden, 2 * hidden), "Q6_K")
    if head_rows:
        tensors["output.weight"] = (_q6_k_raw(rng, head_rows, hidden), "Q6_K")
    _write_raw_gguf(path, tensors, "qwen2")
    return path


def _q6_model(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny untied Qwen2 model whose head ships as Q6_K too."""
    folder = make_tiny(tmp_path / "m", model_type="qwen2", hidden=256, layers=2, tied=False)
    return folder, write_q6_gguf(tmp_path / "m.gguf", head_rows=49152)


@needs_q4
def test_a_model_runs_its_q6_k_matrices_as_shipped(tmp_path):
    """The value projection's Q6_K rows become the fused qkv layer's last columns, the down
    projection a layer of Q6_K columns alone, and the untied head the 4-bit product's Q6_K columns
    with the final norm's weight as its input gain (no calibration: nothing is re-quantised); its
    logits are the dequantised file's within the activations' rounding."""
    from specdec.models.native import NativeCausalLM

    folder, path = _q6_model(tmp_path)
    model = NativeCausalLM.from_folder(folder, quant="q4", batch_invariant=True, int8_kernel="fbgemm", gguf=path)
    first, second = model.layers
    assert first.qkv.packed6.numel() > 0 and first.down.packed6.numel() > 0 and first.down.packed.numel() == 0
    assert second.qkv.packed6.numel() > 0 and second.down.packed6.numel() == 0
    assert first.qkv.out_features == 256 + 2 * 128
    head = model.lm_head
    assert isinstance(head, Q4Linear) and head.packed6.numel() > 0 and head.out_features == 49152
    from specdec.models.gguf_blocks import read_q4_blocks

    w = read_q4_blocks(path, 4, 2, q6=True)["lm_head.weight"].dequantize()  # [V, D]
    h = torch.randn(3, 256)
    want = (h * head.gain) @ w.T
    assert (head(h) - want).norm() / want.norm() < 0.03
    # without the head in the file, the int8 head as before
    other = NativeCausalLM.from_folder(folder, quant="q4", batch_invariant=True, int8_kernel="fbgemm",
                                       gguf=write_q6_gguf(tmp_path / "p.gguf"))
    assert not isinstance(other.lm_head, Q4Linear)


@needs_q4
def test_a_q6_head_cut_to_a_reduced_vocabulary_gives_its_rows_bit_for_bit(tmp_path):
    """``reduced_head``: the shipped Q6_K head's packed columns for a draft vocabulary's ids give
    those ids' logits bitwise as the whole head does (compact, or scattered with -inf elsewhere)."""
    from specdec.models.native import NativeCausalLM

    folder, path = _q6_model(tmp_path)
    model = NativeCausalLM.from_folder(folder, quant="q4", batch_invariant=True, int8_kernel="fbgemm", gguf=path)
    ids = torch.sort(torch.randperm(49152, generator=torch.Generator().manual_seed(0))[:5000]).values
    reduced = model.reduced_head(ids)
    assert reduced is not None and reduced.rows.out_features == 5000
    packed = reduced.rows.packed6  # 157 groups of 32 columns (the last padded), 8 blocks of 896 bytes
    assert packed.shape == (157, 8, 896) and reduced.nbytes == packed.numel() + 5000 * 8
    x = torch.randn(3, 256)
    whole = model.head(x)  # [3, V]
    assert torch.equal(reduced.logits(x, compact=True), whole[:, ids])
    scattered = reduced.logits(x)
    keep = torch.zeros(49152, dtype=torch.bool)
    keep[ids] = True
    assert torch.equal(scattered[:, keep], whole[:, keep]) and bool(torch.isinf(scattered[:, ~keep]).all())


@needs_q4
def test_a_q6_model_decodes_the_same_with_and_without_the_kernel(tmp_path):
    """A process without the kernel library (the ATen reference) decodes the Q6_K model with
    bitwise the logits of one with the kernel (ATen attention in both; the fused layer loop is held
    to the TorchScript loop in test_fused_layers)."""
    from specdec.models.linear import w8a8_available

    if not w8a8_available():
        pytest.skip("the 4-bit target's LM head needs fbgemm")
    folder, path = _q6_model(tmp_path)
    off, _ = decode_in_child(folder, "q4", path, SPECDEC_KERNELS="0")
    on, _ = decode_in_child(folder, "q4", path, SPECDEC_ATTENTION="0")
    assert off["q4"] is False and on["q4"] is True
    assert on["logits"] == off["logits"] and on["sum"] == off["sum"]
    plain, _ = decode_in_child(folder, "q4")  # the Q6_K blocks do change the model
    assert plain["sum"] != on["sum"]


@needs_q4
def test_a_q6_model_is_kept_on_disk_and_read_back_bit_for_bit(tmp_path, monkeypatch):
    """The quantised-layer cache keeps the Q6_K packings (a layer of Q6_K columns alone has an empty
    4-bit packing) and the head as shipped: a second load reads them, not the GGUF, and scores a
    prefill and a 4-row pass bit for bit as the first."""
    from specdec.models import gguf_blocks
    from specdec.models.linear import Q4Linear, w8a8_available
    from specdec.models.native import NativeCausalLM

    if not w8a8_available():
        pytest.skip("the 4-bit target's loader needs fbgemm")
    monkeypatch.setenv("SPECDEC_QUANTISED_CACHE", str(tmp_path / "quantised"))
    folder, path = _q6_model(tmp_path)

    def load() -> NativeCausalLM:
        return NativeCausalLM.from_folder(folder, quant="q4", batch_invariant=True, int8_kernel="fbgemm", gguf=path)

    first = load()
    assert list((tmp_path / "quantised").glob("*.safetensors"))

    def no_gguf(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the second load read the GGUF")

    monkeypatch.setattr(gguf_blocks, "read_q4_blocks", no_gguf)
    second = load()
    assert isinstance(second.lm_head, Q4Linear) and second.layers[0].down.packed.numel() == 0
    ids = torch.randint(0, 1000, (10,), generator=torch.Generator().manual_seed(3))
    outs = []
    for model in (first, second):
        cache = model.new_cache(32)
        outs.append(torch.cat([model.forward(ids[:6], cache), model.forward(ids[6:], cache)]))
    assert torch.equal(outs[0], outs[1])


def _q6(n: int, k: int, seed: int) -> Q6Blocks:
    """Random Q6_K columns [n, k] in the kernel's blocks of 32 inputs."""
    g = torch.Generator().manual_seed(seed)
    nb = k // 32
    return Q6Blocks(torch.randint(0, 64, (n, nb, 32), generator=g).to(torch.uint8),
                    (torch.rand(n, nb, generator=g) * 0.01 + 1e-3).half(),
                    torch.randint(-60, 60, (n, nb, 2), generator=g).to(torch.int8))


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_q4), False])
def test_q6_columns_with_other_inputs_than_the_4bit_ones_are_refused(monkeypatch, kernel):
    """Q6_K columns follow the 4-bit ones over the *same* inputs: 256 4-bit inputs with 512-input
    Q6_K columns is a ValueError, with or without the kernel."""
    if not kernel:
        monkeypatch.setattr(kernels, "q4_available", lambda: False)
    b4 = quantize_q4_1(torch.randn(32, 256, generator=torch.Generator().manual_seed(1)))
    with pytest.raises(ValueError, match="same inputs"):
        Q4Linear(b4, blocks6=_q6(16, 512, 2))
    Q4Linear(b4, blocks6=_q6(16, 256, 2))  # the same inputs: fine


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_q4), False])
def test_a_cut_with_a_q6_column_before_whole_4bit_groups_is_refused(monkeypatch, kernel):
    """``select_outputs`` keeps the kernel's order (4-bit groups first, then Q6_K columns): ids
    asking for a Q6_K column *before* a whole group of 32 4-bit columns get None, not a layer that
    would give the columns in another order; the same columns in kernel order are cut bitwise."""
    if not kernel:
        monkeypatch.setattr(kernels, "q4_available", lambda: False)
    g = torch.Generator().manual_seed(5)
    lin = Q4Linear(quantize_q4_1(torch.randn(32, 256, generator=g) * 0.05), blocks6=_q6(16, 256, 6))
    x = torch.randn(3, 256, generator=g)
    assert lin.select_outputs(torch.cat([torch.tensor([32 + 1]), torch.arange(32)])) is None
    ids = torch.cat([torch.arange(32), torch.tensor([32 + 1])])
    assert torch.equal(lin.select_outputs(ids)(x), lin(x)[:, ids])


@needs_q4
def test_a_layers_byte_count_includes_its_q6_packing():
    """``nbytes`` of a layer with Q6_K columns counts q6_pack's bytes as well as q4_pack's."""
    from specdec.models.linear import tensor_bytes

    b4 = quantize_q4_1(torch.randn(32, 256, generator=torch.Generator().manual_seed(1)))
    lin = Q4Linear(b4, blocks6=_q6(64, 256, 2))
    assert lin.packed6.numel() > 0
    assert lin.nbytes == tensor_bytes(lin.packed, lin.packed6)
    assert lin.nbytes > Q4Linear(b4).nbytes + 64 * 256 * 6 // 8  # at least 6 bits a weight more
