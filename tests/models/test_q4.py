"""The 4-bit target path: GGUF's Q4_0 / Q4_1 blocks as shipped, ``Q4Linear``, the compiled
``q4_linear`` kernel and its ATen reference.

The promise: every output row depends on its own input row alone (batch invariance, so a
verification pass scores a block bitwise as decoding scores its tokens one by one), and the
kernel computes bitwise what the ATen reference computes (so a machine without a compiler runs
the same 4-bit target, only slower).  Checked on shapes that exercise every edge of the packing
(outputs not a multiple of the 32-column groups, inputs not a multiple of the 32-input blocks),
rows of very different magnitudes, all-zero rows, gain and column factors; on a GGUF written here
with both block types and a Llama query / key permutation; and on whole tiny models (the
TorchScript loop, trees, batched passes, block = token by token: ``test_quantized.py`` runs every
kind, ``q4`` included).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.models import kernels
from specdec.models.linear import Q4Blocks, Q4Linear, q4_reference, quantize_q4_1
from kernel_child import decode_in_child
from tiny import make_tiny

needs_q4 = pytest.mark.skipif(not kernels.q4_available(), reason="the 4-bit kernel needs a C++ compiler")


def _ref_args(b: Q4Blocks) -> list[torch.Tensor]:
    return [b.codes().permute(1, 2, 0).float().contiguous(), b.d.float().T.contiguous(), b.m.float().T.contiguous()]


def _inputs(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=g) * (torch.rand(n, 1, generator=g) * 20 + 1e-3)  # very different row scales
    x[:, 5 % k] *= 40  # an outlier channel
    if n > 3:
        x[3] = 0.0  # a row whose every block step is 0
    return x


def test_quantize_q4_1_round_trips_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(70, 96, generator=g) * 0.05
    w[0, :32] = 0.25  # a constant block: d = 0, every code 0, the value exactly m
    b = quantize_q4_1(w)
    assert b.qs.shape == (70, 3, 16) and b.qs.dtype == torch.uint8 and b.d.dtype == torch.float16
    assert b.codes().max() <= 15
    back = b.dequantize()
    step = b.d.float().repeat_interleave(32, dim=1)
    # float16 rounding of m and d adds a little to the half step
    assert ((back - w).abs() <= step * 0.5 + 1e-3).all()
    assert torch.equal(back[0, :32], torch.full((32,), float(torch.tensor(0.25).half())))
    padded = quantize_q4_1(w[:, :90])  # 90 inputs: the last block padded with zeros
    assert padded.shape == (70, 96)
    assert torch.equal(padded.dequantize()[:, :64], back[:, :64])


@needs_q4
@pytest.mark.parametrize("shape", [(576, 576), (100, 96), (33, 64), (7, 40), (96, 1536)])
@pytest.mark.parametrize("extras", ["none", "gain+col"])
def test_kernel_is_bitwise_the_reference_and_batch_invariant(shape, extras):
    n_out, k = shape
    g = torch.Generator().manual_seed(n_out + k)
    b = quantize_q4_1(torch.randn(n_out, k, generator=g) * 0.05)
    gain = torch.rand(k, generator=g) + 0.5 if extras != "none" else None
    col = torch.rand(n_out, generator=g) + 0.1 if extras != "none" else None
    lin = Q4Linear(b, gain=gain, col=col, in_features=k)
    assert lin.packed is not None
    x = _inputs(17, k, seed=k)
    solo = torch.cat([lin.product(x[i : i + 1]) for i in range(17)])
    for n in (1, 2, 3, 4, 5, 8, 9, 16, 17):
        got = lin.product(x[:n])
        assert torch.equal(got, q4_reference(x[:n], lin.gain, *_ref_args(b), lin.col)), n
        assert torch.equal(got, solo[:n]), n
    assert torch.equal(solo[3], torch.zeros(n_out))  # a zero row gives zeros
    # and close to the float product with the dequantised weights
    w = b.dequantize()[:, :k]
    want = (x * (1 if gain is None else gain)) @ w.T * (1 if col is None else col)
    assert ((solo - want).norm() / want.norm()) < 0.02


@needs_q4
def test_products_from_several_threads_at_once_keep_their_own_activations():
    """The kernel keeps each calling thread's quantised activations between calls: products run
    at the same time from several threads (torch.ops releases the GIL, so Python threads can run
    products at once), with different row counts, give what each gives alone.  400 products."""
    import threading

    b = quantize_q4_1(torch.randn(1024, 576, generator=torch.Generator().manual_seed(4)) * 0.05)
    lin = Q4Linear(b)
    inputs = [_inputs(n, 576, seed=20 + n) for n in (1, 3, 6, 17)]
    want = [lin.product(x) for x in inputs]
    bad: list[int] = []

    def work(i: int) -> None:
        for _ in range(100):
            if not torch.equal(lin.product(inputs[i]), want[i]):
                bad.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def on_one_and_two_threads(run):  # noqa: ANN001, ANN201 - a call and what it returns
    """``run()`` on one thread, then on two (or more): both results."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(max(2, threads))
        return one, run()
    finally:
        torch.set_num_threads(threads)


@needs_q4
def test_kernel_bits_do_not_depend_on_the_thread_count():
    b = quantize_q4_1(torch.randn(3072, 576, generator=torch.Generator().manual_seed(2)) * 0.05)
    lin = Q4Linear(b)
    x = _inputs(5, 576, seed=9)
    one, many = on_one_and_two_threads(lambda: lin.product(x))
    assert torch.equal(one, many)


def test_reference_without_the_kernel_is_the_layer_s_product(monkeypatch):
    """Where the library did not build, ``Q4Linear`` keeps the reference's operands and runs it."""
    monkeypatch.setattr(kernels, "q4_available", lambda: False)
    b = quantize_q4_1(torch.randn(40, 64, generator=torch.Generator().manual_seed(3)) * 0.05)
    bias = torch.randn(40)
    lin = Q4Linear(b, bias)
    assert lin.packed is None
    x = _inputs(6, 64, seed=1)
    scale = torch.rand(6, 1) + 0.5
    want = q4_reference(x, torch.empty(0), *_ref_args(b), torch.empty(0))
    assert torch.equal(lin(x), want + bias)
    assert torch.equal(lin.scaled(x, scale), torch.addcmul(bias, want, scale))


@needs_q4
def test_kernel_refuses_mismatched_inputs():
    b = quantize_q4_1(torch.randn(40, 64) * 0.05)
    packed = torch.ops.specdec.q4_pack(b.qs, b.d, b.m)
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.specdec.q4_linear(torch.randn(2, 96), torch.empty(0), packed, 40, torch.empty(0))
    with pytest.raises(RuntimeError, match="gain"):
        torch.ops.specdec.q4_linear(torch.randn(2, 64), torch.ones(3), packed, 40, torch.empty(0))
    with pytest.raises(RuntimeError, match="float16"):
        torch.ops.specdec.q4_pack(b.qs, b.d.float(), b.m)


# ----------------------------------------------------------------------------- GGUF blocks


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]], arch: str = "llama",
                tokens: list[str] | None = None) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    if tokens is not None:  # a vocabulary: an array of strings in the metadata, before the tensor table
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
    for name, (w, kind) in tensors.items():
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        data = gguf.quants.quantize(w, qtype) if kind != "F32" else w
        writer.add_tensor(name, data, raw_dtype=qtype if kind != "F32" else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _hf_unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """How transformers undoes llama.cpp's query / key row permutation (written out here)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_blocks_are_read_as_shipped_with_llama_rows_unpermuted(tmp_path, arch):
    import gguf

    from specdec.models.gguf_blocks import read_q4_blocks

    rng = np.random.default_rng(0)
    q = (rng.standard_normal((64, 96)) * 0.05).astype(np.float32)  # 4 heads of 16
    k = (rng.standard_normal((32, 96)) * 0.05).astype(np.float32)  # 2 KV heads of 16
    down = (rng.standard_normal((96, 64)) * 0.05).astype(np.float32)
    path = tmp_path / "m.gguf"
    _write_gguf(path, {"blk.0.attn_q.weight": (q, "Q4_1"), "blk.0.attn_k.weight": (k, "Q4_0"),
                       "blk.0.ffn_down.weight": (down, "F32"), "blk.0.attn_norm.weight": (np.ones(96, np.float32), "F32")},
                arch=arch)
    blocks = read_q4_blocks(path, n_heads=4, n_kv_heads=2)
    assert set(blocks) == {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"}
    for name, w, kind, heads in (("q_proj", q, "Q4_1", 4), ("k_proj", k, "Q4_0", 2)):
        shipped = gguf.quants.dequantize(gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, kind)),
                                         getattr(gguf.GGMLQuantizationType, kind))
        want = _hf_unpermute(shipped, heads) if arch == "llama" else shipped
        got = blocks[f"model.layers.0.self_attn.{name}.weight"].dequantize().numpy()
        assert np.array_equal(got, want), name


def _q4_k_raw(rng: np.random.Generator, rows: int, k: int, exact: bool) -> np.ndarray:
    """Random Q4_K super-blocks (uint8 [rows, k / 256 * 144]): every code, 6-bit scale and min
    byte pattern possible; ``exact``: d and dmin powers of two, so each block's scale ``d * sc`` and
    minimum ``dmin * m`` are float16 values and Q4_1 holds them without rounding."""
    n = rows * (k // 256)
    if exact:
        d = np.ldexp(1.0, rng.integers(-14, -6, n)).astype(np.float16)
        dmin = np.ldexp(1.0, rng.integers(-14, -6, n)).astype(np.float16)
    else:
        d = (rng.random(n) * 2e-3 + 1e-5).astype(np.float16)
        dmin = (rng.random(n) * 2e-3).astype(np.float16)
    blocks = np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2),
                             rng.integers(0, 256, (n, 140), dtype=np.uint8)], axis=1)
    return blocks.reshape(rows, -1)


def _write_raw_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]], arch: str) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q4_k_super_blocks_are_read_as_q4_1_blocks_with_the_file_s_codes(tmp_path, arch):
    """Qwen2.5-Coder's GGUF ships its layers as Q4_K: 8 blocks of 32 inputs per super-block, each
    with a 6-bit scale and min under a float16 pair.  They become Q4_1 blocks with the same codes;
    the block scale and minimum (exact float32 products) are rounded to float16, which changes a
    weight by at most 2^-11 of its block's scale and minimum (bitwise the file's where the products
    are float16 values, e.g. d and dmin powers of two).  gguf's own dequantiser is the reference."""
    import gguf

    from specdec.models.gguf_blocks import read_q4_blocks, ships_q4

    rng = np.random.default_rng(5)
    q_exact = _q4_k_raw(rng, 64, 512, exact=True)  # 4 heads of 16 (query rows, permuted for llama)
    up = _q4_k_raw(rng, 48, 256, exact=False)
    path = tmp_path / "k.gguf"
    _write_raw_gguf(path, {"blk.0.attn_q.weight": (q_exact, "Q4_K"), "blk.0.ffn_up.weight": (up, "Q4_K")}, arch)
    assert ships_q4(str(path))
    blocks = read_q4_blocks(path, n_heads=4, n_kv_heads=2)

    def shipped(raw: np.ndarray) -> np.ndarray:
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).reshape(raw.shape[0], -1)

    want = shipped(q_exact)
    want = _hf_unpermute(want, 4) if arch == "llama" else want
    assert np.array_equal(blocks["model.layers.0.self_attn.q_proj.weight"].dequantize().numpy(), want)
    b = blocks["model.layers.0.mlp.up_proj.weight"]
    got, want = b.dequantize().numpy(), shipped(up)
    raw = torch.from_numpy(up).view(48, 1, 144)
    d, dmin = raw[..., 0:2].contiguous().view(torch.float16).float(), raw[..., 2:4].contiguous().view(torch.float16).float()
    # |weight error| <= 15 |scale error| + |min error| <= (15 * 63 d + 63 dmin) * 2^-11 (d, dmin per super-block)
    bound = ((15 * 63 * d + 63 * dmin) * 2.0 ** -11).numpy().reshape(48, 1)
    assert np.all(np.abs(got - want) <= bound)
    # the codes are the file's: a weight's code is where it sits between its block's min and scale
    codes = b.codes().reshape(48, -1).numpy().astype(np.float64)
    scale = np.repeat(b.d.float().numpy(), 32, axis=1).astype(np.float64)
    mins = np.repeat(b.m.float().numpy(), 32, axis=1).astype(np.float64)
    live = scale > 0
    assert np.array_equal(np.rint((want - mins)[live] / scale[live]), codes[live])


def test_the_gguf_header_skips_string_arrays_and_is_read_again_when_the_file_changes(tmp_path):
    """The header parse steps over a vocabulary (an array of strings) without decoding it, finds the
    tensor table after it, and is cached per version of the file: rewriting the file in place
    gives the new table."""
    import os

    from specdec.models.gguf_blocks import _read_header

    rng = np.random.default_rng(2)
    path = tmp_path / "m.gguf"
    vocab = ["<s>", "é", "hello", "\u2581world", "x" * 300] * 40
    _write_gguf(path, {"blk.0.ffn_up.weight": (rng.standard_normal((64, 96)).astype(np.float32), "Q4_1")}, tokens=vocab)
    first = _read_header(path)
    assert first.arch == "llama" and [t[:3] for t in first.tensors] == [("blk.0.ffn_up.weight", [96, 64], 3)]
    assert _read_header(path) is first  # parsed once
    stat = os.stat(path)
    _write_gguf(path, {"blk.0.ffn_up.weight": (rng.standard_normal((64, 96)).astype(np.float32), "Q4_0"),
                       "blk.0.ffn_down.weight": (rng.standard_normal((96, 64)).astype(np.float32), "F32")}, tokens=vocab[:7])
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a later version, even on a coarse clock
    second = _read_header(path)
    assert [t[:3] for t in second.tensors] == [("blk.0.ffn_up.weight", [96, 64], 2), ("blk.0.ffn_down.weight", [64, 96], 0)]
    assert second.data_start % second.alignment == 0 and second.data_start < first.data_start


def test_auto_runs_q4_for_a_gguf_whose_layers_ship_as_4bit_blocks(tmp_path, monkeypatch):
    """``--dtype auto`` takes the 4-bit target for a GGUF whose layer matrices are mostly Q4_0 /
    Q4_1 / Q4_K (by weight count; Q4_K in the test below), int8 for other files and for anything
    that is not a GGUF."""
    from specdec import engine
    from specdec.models.gguf_blocks import ships_q4
    from specdec.models.linear import w8a8_available

    rng = np.random.default_rng(1)
    big, small = rng.standard_normal((64, 96)).astype(np.float32), rng.standard_normal((32, 64)).astype(np.float32)
    mostly_q4 = tmp_path / "q4.gguf"
    _write_gguf(mostly_q4, {"blk.0.ffn_up.weight": (big, "Q4_1"), "blk.0.attn_v.weight": (small, "F32"),
                            "token_embd.weight": (rng.standard_normal((256, 64)).astype(np.float32), "F32")})
    mostly_f32 = tmp_path / "f32.gguf"
    _write_gguf(mostly_f32, {"blk.0.ffn_up.weight": (big, "F32"), "blk.0.attn_v.weight": (small, "Q4_0")})
    (tmp_path / "junk.gguf").write_bytes(b"GGUF\x03\x00")  # truncated
    assert ships_q4(str(mostly_q4)) and not ships_q4(str(mostly_f32))
    assert not ships_q4(str(tmp_path / "junk.gguf")) and not ships_q4(str(tmp_path)) and not ships_q4("no-such-model")
    if w8a8_available():
        assert engine.target_dtype(engine.EngineConfig(target=str(mostly_q4))) == (torch.float32, "q4")
        assert engine.target_dtype(engine.EngineConfig(target=str(mostly_f32))) == (torch.float32, "int8")
        assert engine.target_dtype(engine.EngineConfig(target=str(mostly_q4), dtype="int8"))[1] == "int8"


# ----------------------------------------------------------------------------- whole models


@needs_q4
def test_the_same_4bit_target_with_and_without_the_kernel(tmp_path):
    """A process without the kernel library (``SPECDEC_KERNELS=0``: the ATen reference, ATen
    attention) decodes with bitwise the logits of one with the 4-bit kernel and ATen attention."""
    from specdec.models.linear import w8a8_available

    if not w8a8_available():
        pytest.skip("the 4-bit target's LM head needs fbgemm")
    folder = make_tiny(tmp_path / "tiny")

    off, _ = decode_in_child(folder, "q4", SPECDEC_KERNELS="0")
    on, _ = decode_in_child(folder, "q4", SPECDEC_ATTENTION="0")
    assert off["q4"] is False and on["q4"] is True
    assert on["logits"] == off["logits"] and on["sum"] == off["sum"]


def test_engine_and_cli_accept_q4():
    from specdec.engine import EngineConfig, target_dtype
    from specdec.errors import ConfigError
    from specdec.models.linear import w8a8_available

    if w8a8_available():
        assert target_dtype(EngineConfig(dtype="q4")) == (torch.float32, "q4")
    with pytest.raises(ConfigError, match="native"):
        target_dtype(EngineConfig(dtype="q4", backend="hf"))


def test_codes_past_the_top_of_a_block_saturate_at_15():
    w = torch.linspace(100.03, 100.04, 32).reshape(1, 32)  # m = float16(100.03) = 100.0: far below
    b = quantize_q4_1(w)
    assert float(b.m[0, 0]) == 100.0
    assert torch.equal(b.codes(), torch.full((1, 1, 32), 15, dtype=torch.uint8))


@needs_q4
def test_a_one_input_layers_gain_is_applied_without_the_kernel_too(monkeypatch):
    """The input gain applies whatever its length: a layer of a single input (gain of one element)
    gives bitwise the same on the ATen reference as on the kernel (3 rows, 40 outputs)."""
    g = torch.Generator().manual_seed(3)
    b = quantize_q4_1(torch.randn(40, 1, generator=g))
    gain, x = torch.tensor([3.0]), torch.randn(3, 1, generator=g)
    on = Q4Linear(b, gain=gain, in_features=1)(x)
    monkeypatch.setattr(kernels, "q4_available", lambda: False)
    off = Q4Linear(b, gain=gain, in_features=1)
    assert off.packed is None
    assert torch.equal(off(x), on)
    assert not torch.equal(Q4Linear(b, in_features=1)(x), on)  # the gain does change the product


@needs_q4
def test_a_saved_4bit_packing_is_refused_without_the_kernel(monkeypatch):
    """``Q4Linear.from_state`` needs the kernel that made the packing: without it, a ValueError."""
    lin = Q4Linear(quantize_q4_1(torch.randn(32, 64, generator=torch.Generator().manual_seed(2))))
    state = lin.state()
    monkeypatch.setattr(kernels, "q4_available", lambda: False)
    with pytest.raises(ValueError, match="needs the 4-bit kernel"):
        Q4Linear.from_state(state, 32, 64)


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_q4), False])
def test_a_layer_keeps_its_declared_input_count(monkeypatch, kernel):
    """80 inputs are stored as three blocks of 32 (96, zero-padded); the layer still declares 80."""
    if not kernel:
        monkeypatch.setattr(kernels, "q4_available", lambda: False)
    b = quantize_q4_1(torch.randn(40, 80, generator=torch.Generator().manual_seed(2)))
    assert b.shape == (40, 96)
    assert Q4Linear(b, in_features=80).in_features == 80
    assert Q4Linear(b).in_features == 96


@pytest.mark.parametrize("kernel", [pytest.param(True, marks=needs_q4), False])
def test_a_scaled_product_with_a_bias_applies_the_row_factors_first(monkeypatch, kernel):
    """``Q4Linear.scaled(x, r)`` with a bias is ``r * product + b`` (one fused step), 4 rows."""
    if not kernel:
        monkeypatch.setattr(kernels, "q4_available", lambda: False)
    g = torch.Generator().manual_seed(6)
    lin = Q4Linear(quantize_q4_1(torch.randn(40, 64, generator=g)), torch.randn(40, generator=g))
    x, r = torch.randn(4, 64, generator=g), torch.rand(4, 1, generator=g) + 2.0
    assert torch.equal(lin.scaled(x, r), torch.addcmul(lin.bias, lin.product(x), r))
    assert torch.equal(lin.scaled(x, None), lin.product(x) + lin.bias)


def test_taking_output_columns_takes_their_scales_and_minima_too():
    """``Q4Blocks.take(rows)``: codes, scales and minima of the chosen columns, in that order
    (a permutation, as the loaders apply to llama's q / k rows)."""
    g = torch.Generator().manual_seed(7)
    b = quantize_q4_1(torch.randn(40, 64, generator=g))
    perm = torch.randperm(40, generator=g)
    assert torch.equal(b.take(perm).dequantize(), b.dequantize()[perm])
    assert torch.equal(b.take(perm[:5]).dequantize(), b.dequantize()[perm[:5]])
