"""The int8 target path and the TorchScript layer loop.

* ``W8A8Linear`` is batch-invariant for every row count (its exactness argument: per-row
  quantisation pinned to a fixed range, exact integer accumulation), and close to float;
* the TorchScript loop computes bitwise what the Python loop computes, for every linear kind;
* a whole int8 model scores a block bitwise as it scores the tokens one by one.
"""

from __future__ import annotations

import io

import pytest
import torch

import specdec.models.linear as linear_mod
from specdec.errors import ConfigError
from specdec.models import kernels, quantize
from specdec.models.linear import (W8A8Linear, W8A8OneDNNLinear, _has_vnni, int8_kernel, mixed_available, mixed_pays,
                                   onednn_int8_available, tensor_bytes, vnni_available, w8a8_available)
from specdec.models.native import NativeCausalLM
from specdec.models.quantize import RangeRecorder, calibration_ids, smoothing
from specdec.models.scripted import compiled_layers
from tiny import make_tiny, on_python_loop, tiny_native

needs_w8a8 = pytest.mark.skipif(not w8a8_available(), reason="this torch build has no fbgemm int8 engine")
needs_onednn = pytest.mark.skipif(not (onednn_int8_available() and _has_vnni()),
                                  reason="oneDNN's int8 linear needs this torch build's qlinear and a CPU with VNNI")
needs_mixed = pytest.mark.skipif(not mixed_available(), reason="the mixed int8 kernel needs fbgemm, oneDNN int8 and VNNI")


def _mixed_linear(weight, bias=None, *, smooth=None) -> W8A8Linear:
    """fbgemm for one row, oneDNN from two rows (the real thresholds are far above a test matrix's)."""
    lin = W8A8Linear(weight, bias, smooth=smooth, wide=True)
    lin.wide_rows = 2
    return lin


#: the int8 linear layers, one per kernel
INT8_LINEARS = [
    pytest.param(W8A8Linear, marks=needs_w8a8, id="fbgemm"),
    pytest.param(W8A8OneDNNLinear, marks=needs_onednn, id="onednn"),
    pytest.param(_mixed_linear, marks=needs_mixed, id="mixed"),
]


@pytest.fixture(autouse=True)
def _mixed_from_two_rows(monkeypatch):
    """Tiny models' matrices are far below the size at which the mixed kernel switches to oneDNN:
    make every matrix switch at two rows, so that a model's one-row and multi-row passes run on
    different kernels and every bitwise test below compares the two."""
    monkeypatch.setattr(linear_mod, "WIDE_WEIGHTS", 0)
    monkeypatch.setattr(linear_mod, "WIDE_MIN_ROWS", 2)


@needs_mixed
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_smooth", [False, True])
def test_mixed_kernel_is_bitwise_fbgemm_for_every_row_count(with_bias, with_smooth):
    """The oneDNN side of the mixed kernel computes bitwise what fbgemm computes, row for row
    (same int8 weights, same activation quantisation, same float epilogue): 1-64 rows of inputs
    with outlier channels and very different row magnitudes."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(384, 160, generator=g) * 0.05
    w[3] *= 20  # one output channel with a much larger scale
    bias = torch.randn(384, generator=g) if with_bias else None
    x = torch.randn(64, 160, generator=g) * (torch.rand(64, 1, generator=g) * 10 + 0.01)
    x[:, 11] *= 40
    smooth = smoothing(x.abs().amax(0), w) if with_smooth else None
    fb = W8A8Linear(w, bias, smooth=smooth)
    mixed = _mixed_linear(w, bias, smooth=smooth)
    for n in (1, 2, 3, 5, 8, 16, 17, 33, 64):
        want = fb(x[:n])
        assert torch.equal(mixed(x[:n]), want), n
        assert torch.equal(mixed.scaled(x[:n], x[:n, :1].abs() + 0.5), fb.scaled(x[:n], x[:n, :1].abs() + 0.5)), n


@needs_mixed
def test_fbgemm_is_packed_only_where_some_row_count_runs_on_it(monkeypatch):
    """A matrix whose rows all go to the VNNI kernel (up to VNNI_ROWS) or the wide one (from
    wide_rows <= VNNI_ROWS + 1: an LM head on an AMX CPU) never packs fbgemm's weight, whatever the
    row count, and its products are bitwise fbgemm's; every other matrix packs it when built, so no
    packing ever lands inside a timed pass; asked for, the packing is made once."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 64, generator=g) * 0.05
    x = torch.randn(40, 64, generator=g)
    fb = W8A8Linear(w)
    assert fb._packed is not None and fb._qw is None and not fb.fbgemm_unused
    head = W8A8Linear(w, wide=True)  # the fixture makes every matrix switch to oneDNN at two rows
    assert head.fbgemm_unused and head._packed is None
    for n in range(1, 41):
        assert torch.equal(head(x[:n]), fb(x[:n])), n
    assert head._packed is None
    monkeypatch.setattr(linear_mod, "WIDE_MIN_ROWS", linear_mod.VNNI_ROWS + 2)  # rows 17: fbgemm
    late = W8A8Linear(w, wide=True)
    assert not late.fbgemm_unused and late._packed is not None
    assert torch.equal(late(x[:17]), fb(x[:17]))
    packed = head.packed
    assert packed is not None and head.packed is packed and head._qw is None
    assert torch.equal(head(x), fb(x))


def test_onednn_is_refused_without_vnni(monkeypatch):
    """Without VNNI oneDNN's u8 x s8 pair sums saturate: the kernel is refused, fbgemm stays."""
    monkeypatch.setattr(linear_mod, "onednn_int8_available", lambda: True)
    monkeypatch.setattr(linear_mod, "cpu_has", lambda *flags: False)
    with pytest.raises(ConfigError, match="VNNI"):
        int8_kernel("onednn")
    monkeypatch.setattr(linear_mod, "cpu_has", lambda *flags: "avx512_vnni" in flags)
    assert int8_kernel("onednn") == "onednn"


@needs_mixed
def test_mixed_kernel_thresholds_and_choice(monkeypatch):
    from specdec.models.linear import int8_kernel, wide_rows

    monkeypatch.setattr(linear_mod, "WIDE_WEIGHTS", 7_000_000)
    monkeypatch.setattr(linear_mod, "WIDE_MIN_ROWS", 3)
    assert wide_rows(49152, 576) == 3 and wide_rows(17920, 1536) == 3  # large matrices: from the minimum
    assert wide_rows(3072, 576) == 5 and wide_rows(576, 576) == 23  # small ones: later, or never in a verify pass
    monkeypatch.delenv("SPECDEC_INT8_KERNEL", raising=False)
    monkeypatch.setattr(linear_mod, "cpu_has", lambda *flags: True)
    assert int8_kernel("auto") == "mixed"  # AMX: flat multi-row cost on oneDNN, fbgemm for one row
    monkeypatch.setattr(linear_mod, "cpu_has", lambda *flags: "amx_int8" not in flags)  # VNNI, no AMX
    assert int8_kernel("auto") == "fbgemm"
    assert int8_kernel("mixed") == "mixed"
    monkeypatch.setattr(linear_mod, "mixed_available", lambda: False)
    with pytest.raises(ConfigError, match="mixed"):
        int8_kernel("mixed")


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny_folder(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp(request.param), model_type=request.param)


@pytest.mark.parametrize("linear", INT8_LINEARS)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_smooth", [False, True])
def test_w8a8_rows_are_batch_invariant_and_close(linear, with_bias, with_smooth):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 96, generator=g) * 0.05
    bias = torch.randn(300, generator=g) if with_bias else None
    x = torch.randn(64, 96, generator=g)
    x[:, 7] *= 30  # an outlier channel, as LLM activations have
    smooth = smoothing(x.abs().amax(0), w) if with_smooth else None
    lin = linear(w, bias, smooth=smooth)
    rows = torch.cat([lin(x[i : i + 1]) for i in range(64)])
    for n in (2, 3, 5, 9, 16, 17, 33, 64):
        assert torch.equal(lin(x[:n]), rows[:n]), n
    scale = torch.rand(64, 1, generator=g) + 0.5
    assert torch.equal(lin.scaled(x[:5], scale[:5]), torch.cat([lin.scaled(x[i : i + 1], scale[i : i + 1]) for i in range(5)]))
    ref = x @ w.T + (0 if bias is None else bias)
    err = (rows - ref).norm() / ref.norm()
    assert 0 < err < (0.02 if with_smooth else 0.05)


@needs_w8a8
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_smooth", [False, True])
def test_selected_outputs_of_an_int8_layer_are_bitwise_its_columns(with_bias, with_smooth):
    """``select_outputs`` (a reduced vocabulary's cut of an int8 LM head): any columns, in any
    order, a count that fills no whole packing group, give bitwise the whole layer's columns for
    1-40 rows, on the few-row kernel and (rows it does not take) on fbgemm; the copy holds only
    the chosen columns' bytes."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(333, 96, generator=g) * 0.05
    w[5] *= 25  # a column with a much larger scale
    bias = torch.randn(333, generator=g) if with_bias else None
    x = torch.randn(40, 96, generator=g) * (torch.rand(40, 1, generator=g) * 5 + 0.1)
    smooth = smoothing(x.abs().amax(0), w) if with_smooth else None
    whole = W8A8Linear(w, bias, smooth=smooth)
    if whole.vnni is None:
        assert whole.select_outputs(torch.arange(3)) is None
        pytest.skip("no few-row int8 kernel here: its packing is what is cut")
    ids = torch.randperm(333, generator=g)[:77]  # 77 columns: the last group part-filled
    ids[:3] = torch.tensor([332, 5, 0])
    cut = whole.select_outputs(ids)
    assert cut is not None and cut.out_features == 77 and cut.vnni is not None
    group = whole.vnni[0].shape[2]
    assert cut.vnni[0].shape[0] == -(-77 // group)
    for n in (1, 2, 3, 5, 16, 17, 40):
        assert torch.equal(cut(x[:n]), whole(x[:n])[:, ids]), n
    assert torch.equal(cut.scaled(x[:4], x[:4, :1].abs() + 0.5), whole.scaled(x[:4], x[:4, :1].abs() + 0.5)[:, ids])
    assert torch.equal(cut._unpacked().int_repr(), whole._unpacked().int_repr()[ids])  # the int8 weights themselves
    assert cut.nbytes < whole.nbytes * 0.3


@pytest.mark.parametrize("linear", INT8_LINEARS)
def test_smoothing_reduces_error_on_outlier_channels(linear):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 128, generator=g) * 0.05
    x = torch.randn(32, 128, generator=g)
    x[:, :4] *= 50
    ref = x @ w.T
    plain = (linear(w)(x) - ref).norm() / ref.norm()
    smooth = (linear(w, smooth=smoothing(x.abs().amax(0), w))(x) - ref).norm() / ref.norm()
    assert smooth < 0.7 * plain


KINDS = {
    "float32-invariant": dict(batch_invariant=True),
    "float32-fast": dict(batch_invariant=False),
    "bfloat16-fast": dict(dtype=torch.bfloat16, batch_invariant=False),
    "int8": dict(batch_invariant=True, quant="int8", int8_kernel="fbgemm"),
    "int8-onednn": dict(batch_invariant=True, quant="int8", int8_kernel="onednn"),
    "int8-mixed": dict(batch_invariant=True, quant="int8", int8_kernel="mixed"),
    "q4": dict(batch_invariant=True, quant="q4", int8_kernel="fbgemm"),
}


def _python_loop(model, run):
    """``run()`` with the model's TorchScript loop switched off: the Python reference."""
    saved, model.scripted = model.scripted, None
    try:
        return run()
    finally:
        model.scripted = saved


def _scripted_model(folder, kind: str) -> NativeCausalLM:
    """The tiny model of ``kind`` with its TorchScript loop (the test is skipped where either is missing)."""
    if not _available(kind):
        pytest.skip("no int8 kernel of this kind in this torch build")
    model = NativeCausalLM.from_folder(folder, **KINDS[kind])
    if model.scripted is None:
        pytest.skip("TorchScript is not available in this torch build")
    return model


def _available(kind: str) -> bool:
    if kind == "int8":
        return w8a8_available()
    if kind == "int8-onednn":
        return onednn_int8_available() and _has_vnni()
    if kind == "int8-mixed":
        return mixed_available()
    if kind == "q4":  # its LM head is the int8 target's
        return w8a8_available()
    return True


@pytest.mark.parametrize("kind", list(KINDS))
def test_scripted_loop_is_bitwise_the_python_loop(tiny_folder, kind):
    model = _scripted_model(tiny_folder, kind)
    ids = torch.randint(0, 1000, (24,), generator=torch.Generator().manual_seed(3))

    def run() -> torch.Tensor:
        cache = model.new_cache(64)
        outs = [model.forward(ids[:16], cache)]
        outs += [model.forward(ids[i : i + 1], cache) for i in range(16, 20)]
        outs.append(model.forward(ids[20:], cache))  # a 4-token block (per-row attention if invariant)
        return torch.cat(outs)

    scripted = run()
    python = _python_loop(model, run)
    assert torch.equal(scripted, python)


@pytest.mark.parametrize("kind", list(KINDS))
def test_scripted_batched_pass_is_bitwise_the_python_one_and_the_solo_passes(tiny_folder, kind):
    """``forward_batch`` (a batching server's ragged pass: 1-, 4- and 17-row sequences at different
    cache lengths) from TorchScript equals its Python loop — logits and caches — and, for
    batch-invariant targets, each sequence's solo pass."""
    model = _scripted_model(tiny_folder, kind)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 1000, (n,), generator=g) for n in (5, 63, 30)]
    blocks = [torch.randint(0, 1000, (n,), generator=g) for n in (1, 4, 17)]

    def run(batched: bool) -> tuple[list[torch.Tensor], list]:
        caches = [model.new_cache(128) for _ in prompts]
        for p, c in zip(prompts, caches):
            model.forward(p, c)
        if batched:
            outs = model.forward_batch([(b, c, i == 0) for i, (b, c) in enumerate(zip(blocks, caches))])
        else:
            outs = [model.forward(b, c, last_only=i == 0) for i, (b, c) in enumerate(zip(blocks, caches))]
        return outs, caches

    scripted, s_caches = run(True)
    python, p_caches = _python_loop(model, lambda: run(True))
    assert all(torch.equal(a, b) for a, b in zip(scripted, python))
    for a, b in zip(s_caches, p_caches):
        assert torch.equal(a.k[:, :, : a.length], b.k[:, :, : b.length]) and torch.equal(a.v[:, :, : a.length], b.v[:, :, : b.length])
    if model.batch_invariant:
        solo, _ = run(False)
        assert all(torch.equal(a, b) for a, b in zip(scripted, solo))


@pytest.mark.parametrize("kind", list(KINDS))
def test_scripted_layer_subsets_are_bitwise_the_python_loop(tiny_folder, kind):
    """``run_layers`` (a self-speculative draft's early exit / skipped sub-layers, each step
    writing its keys/values to its own cache slot) from TorchScript equals the Python loop."""
    model = NativeCausalLM.from_folder(tiny_folder, **KINDS[kind]) if _available(kind) else None
    if model is None or model.scripted is None:
        pytest.skip("no fbgemm / TorchScript in this torch build")
    assert model.cfg.n_layers == 2
    plans = (  # (steps, cache slot per step): every on/off combination once
        ([(0, True, False), (1, False, True)], [0, 0]),
        ([(0, False, True), (1, True, True)], [0, 0]),
        ([(0, True, True)], [0]),  # an early exit
    )
    ids = torch.randint(0, 1000, (20,), generator=torch.Generator().manual_seed(5))

    def run() -> torch.Tensor:
        outs = []
        for steps, slots in plans:
            cache = model.new_cache(64)
            for a, b in ((0, 12), (12, 13), (13, 14), (14, 20)):  # a prefill, single steps, a block
                start = cache.reserve(b - a)
                outs.append(model.run_layers(model.embed_tokens(ids[a:b]), cache, steps, start=start, slots=slots).flatten())
            outs += [cache.k[0, :, :20].flatten(), cache.v[0, :, :20].flatten()]
        return torch.cat(outs)

    scripted = run()
    python = _python_loop(model, run)
    assert torch.equal(scripted, python)


@pytest.mark.parametrize("quant,kernel", [pytest.param("int8", "fbgemm", marks=needs_w8a8),
                                          pytest.param("int8", "onednn", marks=needs_onednn),
                                          pytest.param("int8", "mixed", marks=needs_mixed),
                                          pytest.param("q4", "fbgemm", marks=needs_w8a8)])  # q4: the LM head's kernel
def test_quantized_model_block_equals_token_by_token_and_is_close_to_float(tiny_folder, quant, kernel):
    q = NativeCausalLM.from_folder(tiny_folder, quant=quant, batch_invariant=True, int8_kernel=kernel)
    assert q.int8_kernel == kernel
    if quant == "q4":
        from specdec.models.linear import Q4Linear

        assert all(isinstance(getattr(layer, n), Q4Linear) for layer in q.layers for n in ("qkv", "out", "gate_up", "down"))
    f = NativeCausalLM.from_folder(tiny_folder, batch_invariant=True)
    ids = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(4))
    a = q.new_cache(64)
    q.forward(ids[:21], a)
    block = q.forward(ids[21:], a)
    b = q.new_cache(64)
    q.forward(ids[:21], b)
    assert torch.equal(block, torch.cat([q.forward(ids[i : i + 1], b) for i in range(21, 30)]))
    ref = f.forward(ids, f.new_cache(64))
    full = q.forward(ids, q.new_cache(64))
    assert not torch.equal(full, ref)
    p, r = torch.softmax(full, -1), torch.softmax(ref, -1)
    assert (p - r).abs().sum(-1).max() < (0.2 if quant == "int8" else 0.3)  # total variation per position
    if kernel == "mixed":  # the same quantised target as fbgemm's, bit for bit, whichever kernel ran a pass
        fb = NativeCausalLM.from_folder(tiny_folder, quant="int8", batch_invariant=True, int8_kernel="fbgemm")
        assert torch.equal(full, fb.forward(ids, fb.new_cache(64)))
        assert any(lin.wide is not None for lin in (q.lm_head, q.layers[0].qkv))


def _stored_ranges(folder) -> dict[str, torch.Tensor]:
    (entry,) = list(folder.glob("*.pt"))  # the calibration cache's one entry
    return torch.load(entry, weights_only=True)


@needs_w8a8
def test_layer_by_layer_calibration_records_a_whole_float_pass(tiny_folder, tmp_path, monkeypatch):
    """An int8 model is built one layer at a time, each layer's ranges measured and the layer
    quantised before the next is made: the ranges are bit for bit those a whole forward pass
    over the float model records (every linear's input and the LM head's), and the model is the
    one those ranges give — its LM head too, quantised a block of rows at a time with the final
    norm's weight (signed here, not the tiny model's ones) folded into each block.  The float
    reference runs the same dense products: a non-invariant model whose tiny matrices stay unpacked."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    shutil.copytree(tiny_folder, folder)
    st = load_file(folder / "model.safetensors")
    d = st["model.norm.weight"].numel()
    st["model.norm.weight"] = torch.randn(d, generator=torch.Generator().manual_seed(3))  # signed gains
    save_file(st, folder / "model.safetensors", metadata={"format": "pt"})
    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", str(tmp_path / "ranges"))
    q = NativeCausalLM.from_folder(folder, quant="int8", int8_kernel="fbgemm")
    measured = _stored_ranges(tmp_path / "ranges")
    f = NativeCausalLM.from_folder(folder)
    f.scripted = None  # the Python loop, which calls the recorders
    for layer in f.layers:
        for name in ("qkv", "out", "gate_up", "down"):
            assert getattr(layer, name).weight is not None  # dense, as the calibration's float layers
            setattr(layer, name, RangeRecorder(getattr(layer, name)))
    ids = calibration_ids(folder)[: f.max_length]
    head_input = f.hidden(ids, f.new_cache(ids.numel()))  # [n, D]
    reference = {f"layers.{i}.{n}": getattr(layer, n).absmax for i, layer in enumerate(f.layers)
                 for n in ("qkv", "out", "gate_up", "down")}
    reference["lm_head"] = head_input.abs().amax(0)
    assert set(measured) == set(reference) and len(reference) == 4 * len(f.layers) + 1
    for k in reference:
        assert torch.equal(measured[k], reference[k]), k
    for i, layer in enumerate(f.layers):  # each layer was quantised with its measured ranges
        for n in ("qkv", "out", "gate_up", "down"):
            smooth = smoothing(reference[f"layers.{i}.{n}"], getattr(layer, n).inner.weight)
            assert torch.equal(getattr(q.layers[i], n).inv_smooth, (1.0 / smooth.float()).contiguous()), (i, n)
    head_w = st["model.embed_tokens.weight"] * st["model.norm.weight"]  # [V, D] the tied head, norm folded in
    head = W8A8Linear(head_w, smooth=smoothing(reference["lm_head"], head_w))
    assert torch.equal(q.lm_head.inv_smooth, head.inv_smooth)
    x = torch.randn(5, d, generator=torch.Generator().manual_seed(4))
    assert torch.equal(q.lm_head(x), head(x))
    assert q.scripted is not None or not compiled_layers()  # the compiled loop is made once the layers are settled


@needs_w8a8
def test_a_4bit_models_head_is_calibrated_on_its_4bit_layers(tiny_folder, tmp_path, monkeypatch):
    """A q4 model's layers are 4-bit from the start; only the LM head is calibrated, on what
    the built model's own forward pass hands it."""
    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", str(tmp_path))
    q = NativeCausalLM.from_folder(tiny_folder, quant="q4", int8_kernel="fbgemm")
    measured = _stored_ranges(tmp_path)
    ids = calibration_ids(tiny_folder)[: q.max_length]
    assert set(measured) == {"lm_head"}
    assert torch.equal(measured["lm_head"], q.hidden(ids, q.new_cache(ids.numel())).abs().amax(0))


@needs_w8a8
@pytest.mark.parametrize("with_smooth", [False, True])
def test_the_int8_weights_are_what_the_written_out_recipe_gives(with_smooth):
    """W8A8Linear's int8 weights, scales and zero-point terms against the recipe written out with
    plain tensor ops (smooth, append two zero columns, per-row max |w| / 127, quantise), so that
    faster ways of building them (in-place padding, one-pass min/max, int32 sums) change no bit."""
    import warnings

    g = torch.Generator().manual_seed(6)
    w = torch.randn(300, 70, generator=g)
    w[5] = 0.0  # an all-zero row
    w[7, 3] = -40.0  # a row whose max |w| is a negative entry
    smooth = torch.rand(70, generator=g) + 0.2 if with_smooth else None
    lin = W8A8Linear(w, smooth=smooth)
    ref = torch.cat([w * smooth if smooth is not None else w, torch.zeros(300, 2)], dim=1)
    scales = (ref.abs().amax(dim=1).clamp_min(1e-12) / 127.0).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qw = torch.quantize_per_channel(ref, scales, torch.zeros(300, dtype=torch.long), axis=0, dtype=torch.qint8)
        got, _ = torch.ops.quantized.linear_unpack(lin.packed)
    assert torch.equal(got.int_repr(), qw.int_repr()) and torch.equal(got.q_per_channel_scales(), scales)
    if lin.vnni is not None:  # fbgemm's activations: 8-bit (step 2/255, zero 128) with VNNI, else 7-bit (2/127, 64)
        q = qw.int_repr()[:, :70]
        zero, step = (128, 2.0 / 255.0) if not lin._reduce_range else (64, 2.0 / 127.0)
        assert torch.equal(lin.vnni[1], (zero * q.to(torch.int32).sum(1)).to(torch.int32))
        assert torch.equal(lin.vnni[2], (torch.tensor(step, dtype=torch.float32) * scales.float()))


def test_calibration_needs_a_tokenizer(tmp_path):
    assert calibration_ids(tmp_path) is None


def test_unknown_quantisation_is_a_config_error(tiny_folder):
    with pytest.raises(ConfigError, match="int8"):
        NativeCausalLM.from_folder(tiny_folder, quant="int3")


def test_engine_target_dtype():
    from specdec.engine import EngineConfig, target_dtype

    assert target_dtype(EngineConfig(dtype="float32")) == (torch.float32, None)
    if w8a8_available():
        assert target_dtype(EngineConfig(dtype="int8")) == (torch.float32, "int8")
    with pytest.raises(ConfigError, match="native"):
        target_dtype(EngineConfig(dtype="int8", backend="hf"))
    with pytest.raises(ConfigError, match="dtype"):
        target_dtype(EngineConfig(dtype="int3"))


#: a tree of 9 nodes (three root candidates, branches up to depth 4), node order not depth-first
TREE_PARENTS = torch.tensor([-1, -1, -1, 0, 1, 0, 3, 4, 6])


@pytest.mark.parametrize("kind", list(KINDS))
def test_scripted_tree_pass_is_bitwise_the_python_tree_pass(tiny_folder, kind):
    """Tree attention from TorchScript (exact per-node attention, or the fast mode's one masked
    call) gives bitwise the Python loop's logits, for a whole tree and for a tree grown over two
    calls (``prefix``); with batch invariance each node's row is its path scored token by token."""
    from specdec.tree import paths

    model = _scripted_model(tiny_folder, kind)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 1000, (12,), generator=g)
    toks = torch.randint(0, 1000, (TREE_PARENTS.numel(),), generator=g)

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = model.new_cache(64)
        model.forward(ids, cache)
        whole = model.forward_tree(toks, TREE_PARENTS, cache)
        keys = cache.k[:, :, : cache.length].clone()
        grown = model.new_cache(64)
        model.forward(ids, grown)
        first = model.forward_tree(toks[:4], TREE_PARENTS[:4], grown)
        rest = model.forward_tree(toks[4:], TREE_PARENTS, grown, prefix=ids.numel())
        return whole, torch.cat([first, rest]), keys

    scripted = run()
    python = _python_loop(model, run)
    for a, b in zip(scripted, python):
        assert torch.equal(a, b)
    if not model.batch_invariant:
        return
    assert torch.equal(scripted[0], scripted[1])
    assert torch.equal(scripted[2][:, :, ids.numel() :], python[2][:, :, ids.numel() :])  # node order restored
    ref = model.new_cache(64)
    model.forward(ids, ref)
    for j, p in enumerate(paths(TREE_PARENTS)):
        ref.truncate(ids.numel())
        seq = torch.cat([model.forward(toks[i : i + 1], ref) for i in p])
        assert torch.equal(scripted[0][j], seq[-1]), f"node {j}"


@pytest.mark.parametrize("kernel", [pytest.param("fbgemm", marks=needs_w8a8), pytest.param("onednn", marks=needs_onednn)])
def test_a_server_reports_its_targets_precision_and_kernel(tiny_folder, kernel):
    """/health says how the served target computes, so an edge can load the same target locally."""
    from fastapi.testclient import TestClient

    from specdec.server import ServerSettings, create_app

    q = NativeCausalLM.from_folder(tiny_folder, quant="int8", batch_invariant=True, int8_kernel=kernel)
    f = NativeCausalLM.from_folder(tiny_folder, batch_invariant=True)
    for model, expected in ((q, f"int8 ({kernel})"), (f, "float32")):
        client = TestClient(create_app(model, settings=ServerSettings()), base_url="http://localhost")
        assert client.get("/health").json()["precision"] == expected


def test_serve_and_generate_pass_the_int8_kernel_to_the_engine(monkeypatch):
    """`specdec serve|generate --int8-kernel K` load the target with kernel K (the engine is stubbed out)."""
    import argparse

    from specdec.cli import build_parser
    from specdec.engine import Engine
    from specdec.server import command

    seen = {}

    class Stop(Exception):
        pass

    def fake_build(cfg, **kw):
        seen["kernel"] = cfg.int8_kernel
        raise Stop

    monkeypatch.setattr(Engine, "build", staticmethod(fake_build))
    args = build_parser().parse_args(["serve", "--int8-kernel", "onednn", "--draft", "none"])
    assert isinstance(args, argparse.Namespace)
    with pytest.raises(Stop):
        command.build_app(args, command.settings_from_args(args))
    assert seen.pop("kernel") == "onednn"
    from specdec.cli import main

    with pytest.raises(Stop):  # `specdec generate` loads the same target when asked (e.g. to check a server's output)
        main(["generate", "-p", "hi", "--int8-kernel", "onednn", "--draft", "none"])
    assert seen.pop("kernel") == "onednn"


@needs_mixed
def test_auto_takes_the_mixed_kernel_only_for_models_whose_matrices_switch_early(tiny_folder, monkeypatch):
    """`auto` on an AMX CPU: mixed when the layer matrices' weight-weighted median switch row is at
    most WIDE_AUTO_ROWS (Qwen2.5-Coder-1.5B-sized layers), fbgemm for small ones (SmolLM2's);
    asking for mixed by name always gives mixed."""
    monkeypatch.setattr(linear_mod, "WIDE_WEIGHTS", 7_000_000)
    monkeypatch.setattr(linear_mod, "WIDE_MIN_ROWS", 3)
    assert not mixed_pays([(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30)  # SmolLM2-135M
    assert mixed_pays([(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)] * 28)  # Qwen2.5-Coder-1.5B
    assert not mixed_pays([])
    monkeypatch.setattr(linear_mod, "cpu_has", lambda *flags: True)
    monkeypatch.delenv("SPECDEC_INT8_KERNEL", raising=False)
    tiny = NativeCausalLM.from_folder(tiny_folder, quant="int8", batch_invariant=True)  # tiny matrices
    assert tiny.int8_kernel == "fbgemm" and tiny.layers[0].qkv.wide is None
    named = NativeCausalLM.from_folder(tiny_folder, quant="int8", batch_invariant=True, int8_kernel="mixed")
    assert named.int8_kernel == "mixed" and named.layers[0].qkv.wide is not None
    monkeypatch.setattr(linear_mod, "WIDE_WEIGHTS", 0)  # every matrix switches at the minimum: it pays
    assert NativeCausalLM.from_folder(tiny_folder, quant="int8", batch_invariant=True).int8_kernel == "mixed"


def test_compiled_loops_run_without_torchscripts_graph_optimiser(tiny_folder, monkeypatch):
    """The compiled loops are called with TorchScript's graph optimiser off (its profiling executor
    spent ~250 ms on each of a function's first specialisations, in the first requests' time to
    first token, for no steady-state gain): a spy in place of each loop sees the flag off."""
    import specdec.models.scripted as scripted_mod

    model = _scripted_model(tiny_folder, "float32-fast")  # the scripted loop, not the fused kernel
    seen: list[bool] = []

    def spy(fn):  # noqa: ANN001, ANN202
        def call(*args):  # noqa: ANN002, ANN202
            seen.append(torch._C._get_graph_executor_optimize())
            return fn(*args)
        return call

    monkeypatch.setattr(model.scripted, "fn", spy(model.scripted.fn))
    batch_fn = scripted_mod.compiled_batch_layers()
    if batch_fn is not None:
        monkeypatch.setattr(scripted_mod, "compiled_batch_layers", lambda: spy(batch_fn))
    ids = torch.randint(0, 1000, (12,), generator=torch.Generator().manual_seed(4))
    cache = model.new_cache(64)
    model.forward(ids[:8], cache)
    model.forward(ids[8:9], cache)
    other = model.new_cache(64)
    model.forward_batch([(ids[:3], other, False), (ids[9:12], cache, True)])
    assert len(seen) == (3 if batch_fn is not None else 2) and not any(seen), seen
    assert torch._C._get_graph_executor_optimize()  # the caller's setting is left as it was


def test_quantised_tensors_print_no_deprecation_warning():
    """torch 2.13 warns once per process that quantised tensors are deprecated; specdec spends that
    warning silently when its linear module is imported, so a user's ``specdec generate`` output is
    not interrupted by it.  A fresh interpreter with every warning shown quantises an int8 layer and
    a tensor by hand after the import: nothing about deprecation may reach stderr."""
    import subprocess
    import sys

    code = (
        "import torch, specdec.models.linear as L\n"
        "W = torch.randn(16, 32)\n"
        "lin = L.W8A8Linear(W) if L.w8a8_available() else None\n"
        "torch.quantize_per_channel(W, torch.ones(16, dtype=torch.double), torch.zeros(16, dtype=torch.long), 0, torch.qint8)\n"
        "torch.quantize_per_tensor(W, 0.1, 0, torch.quint8)\n"
    )
    done = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "deprecated" not in done.stderr, done.stderr


@needs_w8a8
def test_a_staging_buffer_grown_under_inference_mode_is_written_outside_it(monkeypatch):
    """The row-staging buffer grows on demand; grown by a pass under ``torch.inference_mode`` it
    was an inference tensor, and the next pass of that size or less outside that mode failed
    ("Inplace update to inference tensor"): seen with a target shared by two drafters, one
    verifying a 65-row draft in inference mode, the other's cache-sharing head call not. Rows past
    the few-row kernel take the staging path (the kernel's AVX2 build takes every row count, so
    here it is told to stop at 16); the product must not depend on the mode."""
    monkeypatch.setattr(linear_mod, "AVX2_ROWS", 16)
    monkeypatch.setattr(linear_mod, "VNNI_ROWS", 16)
    torch.manual_seed(0)
    lin = W8A8Linear(torch.randn(64, 32))
    n = 16 + 40
    x = torch.randn(n, 32)
    with torch.inference_mode():
        grown = lin(x)
    for m in (n, n - 1):  # the view it made, and a new view of the grown buffer
        assert torch.equal(lin(x[:m]), grown[:m])


class _Linear:
    """A float linear layer as the calibration pass wraps it (``__call__`` and ``scaled``)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight, self.bias = weight, None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()

    def scaled(self, x: torch.Tensor, row_scale: torch.Tensor) -> torch.Tensor:
        return (x * row_scale) @ self.weight.t()


def test_the_range_recorder_keeps_each_channels_largest_magnitude_over_every_pass():
    """Per input channel the largest |x| over every call (a negative input counts by its size; a
    later, smaller pass does not lower it); ``scaled`` records the rows as the layer sees them
    (times their scale); the wrapped layer's product is returned unchanged."""
    w = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    rec = RangeRecorder(_Linear(w))
    x1 = torch.tensor([[-5.0, 1.0, 0.5], [2.0, -0.25, 0.0]])
    assert torch.equal(rec(x1), x1 @ w.t())
    assert torch.equal(rec.absmax, torch.tensor([5.0, 1.0, 0.5]))
    rec(torch.tensor([[1.0, -3.0, 0.25]]))
    assert torch.equal(rec.absmax, torch.tensor([5.0, 3.0, 0.5]))
    out = rec.scaled(torch.tensor([[0.5, 0.5, -0.5]]), torch.tensor([[4.0]]))
    assert torch.equal(out, torch.tensor([[2.0, 2.0, -2.0]]) @ w.t())
    assert torch.equal(rec.absmax, torch.tensor([5.0, 3.0, 2.0]))


def test_smoothing_is_smoothquants_formula_for_any_strength():
    """``s_j = max|X_j|^a / max|W_j|^(1-a)``, clamped to [0.01, 100]: at a = 0.5 the two exponents
    coincide, so another strength is what tells them apart."""
    absmax = torch.tensor([16.0, 1.0, 4.0])
    weight = torch.tensor([[1.0, -2.0, 0.5], [-4.0, 1.0, 0.25]])  # column max |w|: 4, 2, 0.5
    for alpha in (0.25, 0.5, 0.75):
        want = absmax.pow(alpha) / torch.tensor([4.0, 2.0, 0.5]).pow(1 - alpha)
        assert torch.allclose(smoothing(absmax, weight, alpha), want, rtol=1e-6), alpha
    assert smoothing(None, weight) is None


def test_the_calibration_source_digest_covers_the_calibration_text(tmp_path, monkeypatch):
    """The calibration cache's key changes with the text the ranges are measured on: an edited
    CALIBRATION_TEXT must not read back ranges measured on the old one."""
    import shutil

    from specdec.models.registry import DATA_DIR

    shutil.copy(DATA_DIR / "smollm2-135m-draft" / "tokenizer.json", tmp_path / "tokenizer.json")
    before = quantize.calibration_source(tmp_path)
    assert before is not None and quantize.calibration_source(tmp_path) == before
    monkeypatch.setattr(quantize, "CALIBRATION_TEXT", quantize.CALIBRATION_TEXT + "One more line.\n")
    assert quantize.calibration_source(tmp_path) != before
    assert quantize.calibration_source(tmp_path / "nowhere") is None


needs_kernel = pytest.mark.skipif(not (w8a8_available() and vnni_available()),
                                  reason="needs fbgemm and the few-row int8 kernel")


@pytest.fixture
def thresholds(monkeypatch):
    monkeypatch.setattr(linear_mod, "WIDE_WEIGHTS", 7_000_000)
    monkeypatch.setattr(linear_mod, "WIDE_MIN_ROWS", 3)
    monkeypatch.setattr(linear_mod, "WIDE_AUTO_ROWS", 4)


def test_mixed_pays_at_a_median_of_exactly_the_auto_rows(thresholds):
    assert linear_mod.wide_rows(3000, 1000) == 4
    assert mixed_pays([(3000, 1000)])
    assert not mixed_pays([(1750, 1000)])  # switches at 5 rows


def test_mixed_pays_takes_the_first_matrix_that_reaches_half_the_weights(thresholds):
    """Half the weights switch at 3 rows, half at 5: the weighted median is the lower one."""
    assert mixed_pays([(1750, 1000), (3500, 1000), (1750, 1000)])


def test_the_setting_overrides_auto_and_unknown_kernels_are_refused(monkeypatch):
    monkeypatch.setattr(linear_mod, "onednn_int8_available", lambda: True)
    monkeypatch.setattr(linear_mod, "cpu_has", lambda *flags: "avx512_vnni" in flags)
    monkeypatch.setenv("SPECDEC_INT8_KERNEL", "onednn")
    assert int8_kernel("auto") == "onednn"
    assert int8_kernel("fbgemm") == "fbgemm"  # a choice by name is not overridden
    monkeypatch.setenv("SPECDEC_INT8_KERNEL", "fastest")
    with pytest.raises(ConfigError, match="unknown int8 kernel 'fastest'"):
        int8_kernel("auto")
    monkeypatch.delenv("SPECDEC_INT8_KERNEL")
    with pytest.raises(ConfigError, match="unknown int8 kernel"):
        int8_kernel("int4")


def test_7bit_activations_name_the_avx2_build_and_8bit_the_vnni_one(monkeypatch):
    monkeypatch.setattr(kernels, "q8_zero", lambda: 64)
    assert vnni_available(True) and not vnni_available(False)
    monkeypatch.setattr(kernels, "q8_zero", lambda: 128)
    assert vnni_available(False) and not vnni_available(True)


@needs_kernel
def test_a_cut_of_an_int8_head_keeps_its_columns_scales_and_fbgemms_products(monkeypatch):
    g = torch.Generator().manual_seed(11)
    w = torch.randn(333, 96, generator=g) * 0.05
    w[5] *= 25
    x = torch.randn(6, 96, generator=g)
    whole = W8A8Linear(w, torch.randn(333, generator=g))
    ids = torch.tensor([332, 5, 0, 17, 200])
    cut = whole.select_outputs(ids)
    assert torch.equal(cut.state()["scales"], whole.state()["scales"][ids])
    monkeypatch.setattr(linear_mod, "AVX2_ROWS", 0)  # every row count on fbgemm
    monkeypatch.setattr(linear_mod, "VNNI_ROWS", 0)
    assert torch.equal(cut(x), whole(x)[:, ids])


@needs_kernel
def test_the_byte_count_includes_fbgemms_packing_with_its_pinned_columns(monkeypatch):
    monkeypatch.setattr(linear_mod, "AVX2_ROWS", 3)  # some row counts on fbgemm: packed when built
    monkeypatch.setattr(linear_mod, "VNNI_ROWS", 3)
    lin = W8A8Linear(torch.randn(70, 52, generator=torch.Generator().manual_seed(2)))
    assert lin._packed is not None
    assert lin.nbytes == tensor_bytes(*lin.vnni, lin._scales) + 70 * (52 + 2)


@pytest.mark.skipif(not w8a8_available(), reason="this torch build has no fbgemm int8 engine")
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_a_scaled_product_applies_its_row_factors_before_the_bias(rows):
    """``W8A8Linear.scaled(x, r)`` is ``r * (x @ W.T) + b`` (to rounding), not the plain product."""
    g = torch.Generator().manual_seed(9)
    w, bias = torch.randn(70, 52, generator=g) * 0.05, torch.randn(70, generator=g)
    lin = W8A8Linear(w, bias, smooth=torch.rand(52, generator=g) + 0.5)
    x, r = torch.randn(rows, 52, generator=g), torch.rand(rows, 1, generator=g) + 2.0
    assert torch.allclose(lin.scaled(x, r), r * (lin(x) - bias) + bias, rtol=1e-5, atol=1e-5)


def test_a_silent_channel_and_a_zero_weight_column_are_floored_at_1e_5():
    """An input channel never seen (range 0) and a weight column of zeros both count as 1e-5,
    so neither gives 0 or infinity before the clamp."""
    weight = torch.tensor([[1e-4, 0.0, 1.0], [-1e-4, 0.0, 1.0]])  # column max |w|: 1e-4, 0, 1
    absmax = torch.tensor([0.0, 1e-4, 1.0])
    want = torch.tensor([(1e-5 / 1e-4) ** 0.5, (1e-4 / 1e-5) ** 0.5, 1.0])
    assert torch.allclose(smoothing(absmax, weight, 0.5), want, rtol=1e-5)


def test_factors_are_clamped_to_one_hundredth_and_one_hundred():
    weight = torch.tensor([[1e-4, 1e4, 1.0]])
    absmax = torch.tensor([1e6, 1e-4, 1.0])  # unclamped: 1e5, 1e-4, 1
    assert torch.equal(smoothing(absmax, weight, 0.5), torch.tensor([100.0, 0.01, 1.0]))


def test_a_negative_column_gain_counts_by_its_size():
    """``weight * column_gain`` for a gain of either sign: its column maxima are |w| times |g|."""
    absmax = torch.tensor([16.0, 1.0, 4.0])
    weight = torch.tensor([[1.0, -2.0, 0.5], [-4.0, 1.0, 0.25]])
    gain = torch.tensor([-0.5, 2.0, -4.0])
    want = smoothing(absmax, weight * gain, 0.5)
    assert torch.equal(smoothing(absmax, weight, 0.5, column_gain=gain), want)
    assert torch.equal(smoothing(absmax, weight, 0.5, column_gain=gain.abs()), want)


def test_the_default_strength_is_smoothquants_one_half():
    absmax = torch.tensor([16.0, 1.0, 4.0])
    weight = torch.tensor([[1.0, -2.0, 0.5], [-4.0, 1.0, 0.25]])
    assert torch.equal(smoothing(absmax, weight), smoothing(absmax, weight, 0.5))


def test_the_calibration_source_digest_covers_the_tokenizers_version(tmp_path, monkeypatch):
    """Another ``tokenizers`` release may split the text differently: the digest changes with it."""
    import importlib.metadata as md
    import shutil

    from specdec.models.registry import DATA_DIR

    shutil.copy(DATA_DIR / "smollm2-135m-draft" / "tokenizer.json", tmp_path / "tokenizer.json")
    before = quantize.calibration_source(tmp_path)
    real = md.version
    monkeypatch.setattr(md, "version", lambda name: real(name) + ".post1" if name == "tokenizers" else real(name))
    assert quantize.calibration_source(tmp_path) != before


def test_column_absmax_of_a_weight_that_is_not_float32_is_its_exact_column_maximum():
    """The compiled shortcut is for float32 weights; any other dtype gets the plain maximum."""
    from specdec.models.quantize import column_absmax

    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        w = (torch.randn(5, 7, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
        got = column_absmax(w)
        assert got.dtype == dtype and torch.equal(got, w.abs().amax(0)), dtype


needs_int8_kernel = pytest.mark.skipif(not (kernels.load() and vnni_available()), reason="needs the few-row int8 kernel")

CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx2 {extra} lm\n"


def _fake_cpuinfo(monkeypatch, extra: str) -> None:
    """/proc/cpuinfo as cpu_has reads it, with flags ``extra`` after the common ones."""
    monkeypatch.setattr(linear_mod, "open", lambda *a, **k: io.StringIO(CPUINFO.format(extra=extra)), raising=False)


def test_cpu_has_is_true_when_any_of_the_flags_is_listed(monkeypatch):
    _fake_cpuinfo(monkeypatch, "avx_vnni")
    assert linear_mod.cpu_has("avx512_vnni", "avx_vnni")
    assert linear_mod.cpu_has("avx_vnni")
    assert not linear_mod.cpu_has("avx512_vnni", "amx_int8")
    assert not linear_mod.cpu_has("vnni")  # a whole flag, not the tail of one


def test_256_bit_vnni_counts_as_vnni(monkeypatch):
    """A CPU with AVX-VNNI but no AVX512-VNNI has 8-bit fbgemm activations (no reduce_range)."""
    _fake_cpuinfo(monkeypatch, "avx_vnni")
    assert linear_mod._has_vnni()
    _fake_cpuinfo(monkeypatch, "avx512_vnni")
    assert linear_mod._has_vnni()
    _fake_cpuinfo(monkeypatch, "avx512f")
    assert not linear_mod._has_vnni()


def _weight(seed: int = 6) -> torch.Tensor:
    """70 x 52 weights whose largest magnitude is negative in some rows, positive in others."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(70, 52, generator=g) * 0.05
    w[::3, 0] = -1.0  # row max |w| is a negative weight
    w[1::3, 1] = 1.0
    return w


def _no_kernel(monkeypatch) -> None:
    monkeypatch.setattr(linear_mod, "vnni_available", lambda reduce_range=None: False)


@needs_w8a8
@needs_int8_kernel
def test_without_the_kernel_a_layer_quantises_its_weights_as_the_kernel_does(monkeypatch):
    """Where the few-row kernel does not run, the ATen path quantises each output row with scale
    max|w| / 127 (negative maxima included): the same int8 weights and scales as the kernel's
    packing, and so bitwise the same products (1-9 rows, with and without smoothing)."""
    w = _weight()
    g = torch.Generator().manual_seed(1)
    smooth = torch.rand(52, generator=g) + 0.5
    x = torch.randn(9, 52, generator=g)
    for sm in (None, smooth):
        on = W8A8Linear(w, smooth=sm)
        with monkeypatch.context() as m:
            _no_kernel(m)
            off = W8A8Linear(w, smooth=sm)
        assert off.vnni is None
        assert torch.equal(off._scales, on._scales)
        qw, _ = torch.ops.quantized.linear_unpack(off.packed)
        assert torch.equal(qw.int_repr(), on._unpacked().int_repr())
        for n in (1, 4, 9):
            assert torch.equal(off(x[:n]), on(x[:n])), n


@needs_w8a8
def test_the_wide_kernel_is_refused_without_vnni(monkeypatch):
    """``wide=True`` (oneDNN's int8 linear for many rows) needs 8-bit activations: on a CPU
    without VNNI the layer refuses it with a ValueError naming VNNI."""
    monkeypatch.setattr(linear_mod, "_has_vnni", lambda: False)
    with pytest.raises(ValueError, match="VNNI"):
        W8A8Linear(_weight(), wide=True)


@needs_w8a8
def test_a_head_made_block_by_block_without_the_kernel_keeps_its_smoothing(monkeypatch):
    """``scaled_rows`` where the kernel does not run falls back to ``W8A8Linear(rows * gain,
    smooth=smooth)``: the smoothing is kept (same products, 1-5 rows)."""
    g = torch.Generator().manual_seed(2)
    rows, gain = torch.randn(70, 52, generator=g), torch.rand(52, generator=g) + 0.5
    smooth = torch.rand(52, generator=g) * 4 + 0.1
    x = torch.randn(5, 52, generator=g)
    x[:, 3] *= 30
    _no_kernel(monkeypatch)
    got = W8A8Linear.scaled_rows(rows, gain, smooth=smooth)
    want = W8A8Linear(rows * gain, smooth=smooth)
    assert got.inv_smooth is not None and torch.equal(got.inv_smooth, want.inv_smooth)
    for n in (1, 5):
        assert torch.equal(got(x[:n]), want(x[:n])), n


def _on_fbgemm(monkeypatch) -> None:
    """Every row count on fbgemm's dynamic linear (neither build of the few-row kernel takes any)."""
    monkeypatch.setattr(linear_mod, "AVX2_ROWS", 0)
    monkeypatch.setattr(linear_mod, "VNNI_ROWS", 0)


@needs_w8a8
def test_fbgemm_products_are_batch_invariant_for_rows_of_either_sign():
    """On fbgemm (the path every row count takes where the kernel is absent), each row is pinned to
    exactly [-1, 1] by the staging buffer's +1 / -1 columns: a row whose values are all positive
    (or all negative) gives bitwise the same result alone as beside rows of the other sign, and
    (where the kernel runs) bitwise what the kernel gives.  12 rows of 52 inputs."""
    w = _weight()
    g = torch.Generator().manual_seed(3)
    x = torch.rand(12, 52, generator=g) + 0.05  # all positive rows
    x[1::2] *= -3  # all negative rows
    lin = W8A8Linear(w)
    kernel = lin(x) if lin.vnni is not None else None
    with pytest.MonkeyPatch.context() as m:
        _on_fbgemm(m)
        alone = torch.cat([lin(x[i : i + 1]) for i in range(12)])
        assert torch.equal(lin(x), alone)
        assert torch.equal(lin(x[1:4]), alone[1:4])
    if kernel is not None:
        assert torch.equal(kernel, alone)


@needs_w8a8
def test_fbgemm_products_apply_the_smoothing(monkeypatch):
    """A smoothed layer on fbgemm divides its inputs by the smoothing factors (the weights were
    multiplied by them): close to x @ W.T and bitwise the kernel's product where the kernel runs."""
    g = torch.Generator().manual_seed(8)
    w = torch.randn(70, 52, generator=g) * 0.05
    smooth = torch.rand(52, generator=g) * 3 + 0.5
    x = torch.randn(6, 52, generator=g)
    lin = W8A8Linear(w, smooth=smooth)
    kernel = lin(x) if lin.vnni is not None else None
    _on_fbgemm(monkeypatch)
    got = lin(x)
    ref = x @ w.T
    assert (got - ref).norm() / ref.norm() < 0.05
    if kernel is not None:
        assert torch.equal(got, kernel)


@needs_int8_kernel
def test_fbgemm_is_unused_and_unpacked_where_the_avx2_kernel_takes_every_row_count():
    """The AVX2 build of the few-row kernel takes every row count (AVX2_ROWS = ALL_ROWS): fbgemm's
    weight is never packed when the layer is built, and the byte count holds no copy of it."""
    if kernels.q8_zero() != 64:
        pytest.skip("the AVX2 build of the int8 kernel is not the one here")
    lin = W8A8Linear(_weight())
    assert lin.fbgemm_unused and lin._packed is None
    assert lin.nbytes == linear_mod.tensor_bytes(*lin.vnni, lin._scales)


@needs_int8_kernel
def test_fbgemm_unused_follows_the_row_settings(monkeypatch):
    """``fbgemm_unused``, read off the layer's settings: 7-bit activations (AVX2 build) need
    AVX2_ROWS >= ALL_ROWS; 8-bit ones (VNNI build) need a wide packing taking over at or below
    VNNI_ROWS + 1 rows."""
    lin = W8A8Linear(_weight())
    lin._reduce_range = True
    assert lin.fbgemm_unused
    monkeypatch.setattr(linear_mod, "AVX2_ROWS", linear_mod.ALL_ROWS - 1)
    assert not lin.fbgemm_unused
    lin._reduce_range = False
    lin.wide = [torch.empty(0)]  # any wide packing: only its presence and wide_rows count here
    lin.wide_rows = linear_mod.VNNI_ROWS + 1
    assert lin.fbgemm_unused
    lin.wide_rows = linear_mod.VNNI_ROWS + 2
    assert not lin.fbgemm_unused
    lin.wide = None
    lin.wide_rows = 2
    assert not lin.fbgemm_unused


@needs_int8_kernel
def test_a_wide_packing_is_counted_as_its_int8_weights():
    """``nbytes`` counts oneDNN's wide packing as out x in int8 weights (no pinned columns)."""
    lin = W8A8Linear(_weight())
    base = lin.nbytes
    lin.wide = [torch.empty(0)]
    assert lin.nbytes == base + 70 * 52


def test_no_matrices_never_pay_for_the_mixed_kernel():
    assert linear_mod.mixed_pays([]) is False


@pytest.fixture
def amx_machine(monkeypatch):
    """A machine as ``int8_kernel`` sees it: fbgemm and oneDNN's int8 linear, VNNI, and AMX (the
    test may take AMX away); ``SPECDEC_INT8_KERNEL`` unset."""
    monkeypatch.delenv("SPECDEC_INT8_KERNEL", raising=False)
    monkeypatch.setattr(linear_mod, "w8a8_available", lambda: True)
    monkeypatch.setattr(linear_mod, "onednn_int8_available", lambda: True)
    monkeypatch.setattr(linear_mod, "mixed_available", lambda: True)
    monkeypatch.setattr(linear_mod, "cpu_has", lambda *flags: True)
    return monkeypatch


def test_auto_takes_the_mixed_kernel_only_with_amx(amx_machine):
    assert int8_kernel("auto") == "mixed"
    amx_machine.setattr(linear_mod, "cpu_has", lambda *flags: "amx_int8" not in flags)
    assert int8_kernel("auto") == "fbgemm"


def test_auto_without_shapes_takes_mixed_and_with_shapes_asks_mixed_pays(amx_machine, thresholds):
    """``shapes=None`` (not known): mixed on AMX; known shapes: only where their median switch row
    is at most WIDE_AUTO_ROWS (a 576 x 576 matrix switches far later), with the shipped thresholds
    rather than this file's two-row switch."""
    assert int8_kernel("auto", None) == "mixed"
    assert int8_kernel("auto", [(49152, 576)]) == "mixed"
    assert int8_kernel("auto", [(576, 576)]) == "fbgemm"


def test_auto_without_fbgemm_takes_onednn_and_without_either_names_fbgemm(monkeypatch):
    monkeypatch.delenv("SPECDEC_INT8_KERNEL", raising=False)
    monkeypatch.setattr(linear_mod, "mixed_available", lambda: False)
    monkeypatch.setattr(linear_mod, "w8a8_available", lambda: False)
    monkeypatch.setattr(linear_mod, "onednn_int8_available", lambda: True)
    assert int8_kernel("auto") == "onednn"
    monkeypatch.setattr(linear_mod, "onednn_int8_available", lambda: False)
    assert int8_kernel("auto") == "fbgemm"  # nothing runs int8: fbgemm's name, refused where it is used


def test_mixed_by_name_is_refused_where_it_cannot_run(monkeypatch):
    """``mixed`` needs fbgemm *and* oneDNN's int8 linear *and* VNNI: with fbgemm alone it is refused."""
    monkeypatch.setattr(linear_mod, "w8a8_available", lambda: True)
    monkeypatch.setattr(linear_mod, "mixed_available", lambda: False)
    with pytest.raises(ConfigError, match="mixed int8 kernel needs"):
        int8_kernel("mixed")


def test_onednn_by_name_is_refused_without_onednns_int8_linear(monkeypatch):
    monkeypatch.setattr(linear_mod, "onednn_int8_available", lambda: False)
    monkeypatch.setattr(linear_mod, "cpu_has", lambda *flags: True)
    with pytest.raises(ConfigError, match="qlinear"):
        int8_kernel("onednn")


def test_mixed_is_unavailable_without_vnni(monkeypatch):
    monkeypatch.setattr(linear_mod, "w8a8_available", lambda: True)
    monkeypatch.setattr(linear_mod, "onednn_int8_available", lambda: True)
    monkeypatch.setattr(linear_mod, "_has_vnni", lambda: False)
    assert not linear_mod.mixed_available()
    monkeypatch.setattr(linear_mod, "_has_vnni", lambda: True)
    assert linear_mod.mixed_available()


@needs_int8_kernel
def test_a_saved_int8_packing_is_refused_without_the_kernel(monkeypatch):
    """``W8A8Linear.from_state`` needs the few-row kernel (its packing is that kernel's): else a ValueError."""
    state = W8A8Linear(_weight()).state()
    _no_kernel(monkeypatch)
    with pytest.raises(ValueError, match="few-row int8 kernel"):
        W8A8Linear.from_state(state, 52)


@needs_int8_kernel
def test_the_state_keeps_the_float64_weight_scales():
    lin = W8A8Linear(_weight())
    scales = lin.state()["scales"]
    assert scales.dtype == torch.float64 and torch.equal(scales, lin._scales)


@needs_int8_kernel
def test_the_byte_count_includes_the_smoothing_factors():
    w = _weight()
    smooth = torch.rand(52, generator=torch.Generator().manual_seed(1)) + 0.5
    assert W8A8Linear(w, smooth=smooth).nbytes == W8A8Linear(w).nbytes + 52 * 4


@needs_w8a8
def test_a_layer_without_the_kernels_packing_has_no_cut(monkeypatch):
    """``select_outputs`` of a layer whose weights live only in fbgemm's packing: None."""
    _no_kernel(monkeypatch)
    lin = W8A8Linear(_weight())
    assert lin.vnni is None and lin.select_outputs(torch.tensor([0, 3])) is None


@needs_w8a8
@needs_int8_kernel
def test_fbgemm_from_the_kernels_packing_with_inputs_not_a_multiple_of_four(monkeypatch):
    """fbgemm's weight rebuilt from the kernel's packing (whose inputs are padded to a multiple of
    4) keeps exactly the layer's 37 inputs: the products are bitwise the kernel's, 1-6 rows."""
    g = torch.Generator().manual_seed(12)
    w = torch.randn(50, 37, generator=g) * 0.05
    x = torch.randn(6, 37, generator=g)
    lin = W8A8Linear(w)
    want = lin(x)
    _on_fbgemm(monkeypatch)
    assert torch.equal(lin(x), want)


@pytest.fixture(scope="module")
def model():
    m = tiny_native()  # 2 layers, float32, batch-invariant: the TorchScript loop (no fused call)
    if m.scripted is None:
        pytest.skip("TorchScript is not available in this torch build")
    return m


@pytest.mark.parametrize("taps", [(2, 1), (2, 0, 1), (1, 2)], ids=["descending", "mixed", "ascending"])
def test_feature_taps_in_any_order_are_each_the_stream_after_their_layer_count(model, taps):
    """forward_features with taps in any order (a drafter may list the last layer first): each
    feature is the residual stream after its own layer count, bitwise the Python loop's -- the
    compiled loop returns its taps in layer order, so they must be matched back by count -- and
    the last layer's output (tap 2 = n_layers) is among them."""
    ids = torch.arange(5, 17)

    def run():
        cache = model.new_cache(64)
        model.forward(ids[:8], cache)
        return model.forward_features(ids[8:], cache, taps)

    logits, feats = run()
    want_logits, want_feats = on_python_loop(model, run)
    assert feats.shape == (4, len(taps) + 1, model.cfg.hidden_size)
    assert torch.equal(logits, want_logits) and torch.equal(feats, want_feats)
    by_count = dict(zip(taps, feats.unbind(1)))
    assert not torch.equal(by_count[1], by_count[2])


def test_int8_passes_after_the_row_settings_change_use_fbgemm_weights_for_the_new_settings(tmp_path, monkeypatch):
    """The TorchScript loop's fbgemm weights follow the few-row setting (``linear.few_rows``, read
    per call): a pass made under one setting, then a pass under a lower one (more rows now go to
    fbgemm), gives bitwise the Python loop's logits -- the weights are (re)packed for the new
    setting, not kept from the first pass -- and the staging buffers grow to the 30 rows of the
    pass (more than the 16 they start with)."""
    if not linear_mod.w8a8_available():
        pytest.skip("no fbgemm in this torch build")
    m = NativeCausalLM.from_folder(make_tiny(tmp_path / "m", layers=2), quant="int8", batch_invariant=True,
                                   int8_kernel="fbgemm")
    if m.scripted is None:
        pytest.skip("TorchScript is not available in this torch build")
    ids = torch.arange(3, 40)
    cache = m.new_cache(64)
    m.forward(ids[:8], cache)
    m.forward_features(ids[8:10], cache, (m.cfg.n_layers,))  # a tap at the last layer: the TorchScript loop
    lowered = max(1, min(linear_mod.few_rows(m.scripted.reduce_range), 16) // 2)
    monkeypatch.setattr(linear_mod, "AVX2_ROWS", lowered)
    monkeypatch.setattr(linear_mod, "VNNI_ROWS", lowered)

    def run():
        c = m.new_cache(64)
        return m.forward(ids[:30], c)

    assert torch.equal(run(), on_python_loop(m, run))


def test_without_the_attention_kernel_a_4_bit_model_stays_off_the_fused_call(tmp_path, monkeypatch):
    """The fused layer call computes attention on the kernel; with the attention kernel off
    (``SPECDEC_ATTENTION=0``) a 4-bit model's passes must not take it: every pass (a prefill, a
    step, a block) is bitwise the Python loop's, which then attends with ATen ops."""
    if not (kernels.q4_available() and linear_mod.w8a8_available()):
        pytest.skip("the 4-bit target needs the kernel library and fbgemm")
    monkeypatch.setattr(kernels, "attention_kernel", lambda: False)
    m = NativeCausalLM.from_folder(make_tiny(tmp_path / "m", layers=2), quant="q4", batch_invariant=True,
                                   int8_kernel="fbgemm")
    if m.scripted is None or m.scripted.fused is None:
        pytest.skip("TorchScript or the fused loop is not available here")
    ids = torch.arange(3, 40)

    def run():
        c = m.new_cache(64)
        return torch.cat([m.forward(ids[:20], c), m.forward(ids[20:21], c), m.forward(ids[21:25], c)])

    assert torch.equal(run(), on_python_loop(m, run))


def test_the_calibration_source_digest_covers_the_tokenizer_file(tmp_path):
    """Two folders whose tokenizer.json differ (one byte) give different digests; equal files give
    equal digests."""
    for name, text in (("a", '{"x": 1}'), ("b", '{"x": 2}'), ("c", '{"x": 1}')):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(text)
    a, b, c = (quantize.calibration_source(tmp_path / n) for n in "abc")
    assert a == c and a != b
