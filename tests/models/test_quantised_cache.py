"""The quantised-layer cache: a later load of an int8 or 4-bit model reads its layers from disk
instead of the float weights (and a GGUF's blocks), and is the same model bit for bit; anything that could change the layers is in the
key; a damaged, foreign or mismatched entry is built again; the cache keeps few entries and
writes none onto a nearly full disk."""

from __future__ import annotations

import os
from collections import namedtuple

import numpy as np
import pytest
import torch

from specdec.models import quantised_cache
from specdec.models.linear import Q4Linear, W8A8Linear, mixed_available, q4_kernel_available, quantize_q4_1, vnni_available, w8a8_available
from specdec.models.native import NativeCausalLM
from tiny import make_tiny

pytestmark = pytest.mark.skipif(not (w8a8_available() and vnni_available() and q4_kernel_available()),
                                reason="needs fbgemm's int8 engine and the few-row int8 and 4-bit kernels")

IDS = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(8))
STEP = torch.tensor([17, 4, 933, 5])  # a 4-row pass after the prefill: the multi-row products too


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def folder(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp(request.param), model_type=request.param)


@pytest.fixture
def builds(tmp_path, monkeypatch):
    """The cache on, in a folder of this test's own; counts the loads that read the float weights."""
    monkeypatch.setenv("SPECDEC_QUANTISED_CACHE", str(tmp_path / "quantised"))
    import safetensors.torch

    count = [0]
    real = safetensors.torch.load_file

    def counted(*args, **kw):
        count[0] += 1
        return real(*args, **kw)

    monkeypatch.setattr(safetensors.torch, "load_file", counted)
    return count


def _load(folder, **kw):
    kw.setdefault("int8_kernel", "fbgemm")
    kw.setdefault("batch_invariant", True)
    kw.setdefault("quant", "int8")
    return NativeCausalLM.from_folder(folder, **kw)


def _entries(tmp_path):
    return sorted((tmp_path / "quantised").glob("*.safetensors"))


def _same(a: NativeCausalLM, b: NativeCausalLM) -> bool:
    """Every int8 layer's state, the embedding, and a prefill's and a 4-row pass's logits, bit for bit."""
    sa, sb = a.quantised_state(), b.quantised_state()
    if sa is None or sb is None or set(sa) != set(sb) or not all(torch.equal(sa[k], sb[k]) for k in sa):
        return False
    if not torch.equal(a.embed, b.embed) or a.int8_kernel != b.int8_kernel:
        return False
    ca, cb = a.new_cache(64), b.new_cache(64)
    return (torch.equal(a.forward(IDS, ca), b.forward(IDS, cb))
            and torch.equal(a.forward(STEP, ca), b.forward(STEP, cb)))


@pytest.mark.parametrize("quant", ["int8", "q4"])
@pytest.mark.parametrize("subset", [None, torch.arange(100, 20000)])
def test_a_second_load_reads_the_layers_and_is_the_same_model(folder, builds, subset, quant, tmp_path):
    first = _load(folder, vocab_subset=subset, quant=quant)
    assert builds[0] == 1 and len(_entries(tmp_path)) == 1
    second = _load(folder, vocab_subset=subset, quant=quant)
    assert builds[0] == 1  # the float weights were not read again
    assert _same(first, second)
    kinds = {type(getattr(layer, name)) for layer in second.layers for name in ("qkv", "out", "gate_up", "down")}
    assert kinds == {Q4Linear if quant == "q4" else W8A8Linear} and type(second.lm_head) is W8A8Linear
    os.environ["SPECDEC_QUANTISED_CACHE"] = "off"  # (restored by monkeypatch) the reference: a plain load
    assert _same(second, _load(folder, vocab_subset=subset, quant=quant)) and builds[0] == 2


@pytest.mark.skipif(not mixed_available(), reason="the mixed int8 kernel needs VNNI and oneDNN's int8 linear")
def test_the_mixed_kernels_wide_packing_is_rebuilt_from_the_saved_layers(folder, builds):
    first = _load(folder, int8_kernel="mixed")
    second = _load(folder, int8_kernel="mixed")
    assert builds[0] == 1 and second.int8_kernel == "mixed"
    assert all(lin.wide is not None for lin in [second.lm_head, *(l.qkv for l in second.layers)])
    ca, cb = first.new_cache(96), second.new_cache(96)  # the prompt (30) and 40 rows
    rows = torch.randint(0, 1000, (40,))  # enough rows for the wide kernel on every matrix
    assert torch.equal(first.forward(IDS, ca), second.forward(IDS, cb))
    assert torch.equal(first.forward(rows, ca), second.forward(rows, cb))


def test_what_could_change_the_layers_is_in_the_key(folder, builds, tmp_path, monkeypatch):
    monkeypatch.setattr(quantised_cache, "KEEP", 8)  # every entry this test writes stays
    _load(folder)
    _load(folder, batch_invariant=False)  # another option
    _load(folder, vocab_subset=torch.arange(0, 40000))  # another head
    _load(folder, quant="q4")  # another quantisation
    assert builds[0] == 4 and len(_entries(tmp_path)) == 4
    monkeypatch.setenv("SPECDEC_SOME_SETTING", "1")  # any specdec setting
    _load(folder)
    assert builds[0] == 5
    monkeypatch.delenv("SPECDEC_SOME_SETTING")
    _load(folder)
    assert builds[0] == 5  # back to the first key
    weights = next(folder.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the weight file rewritten
    _load(folder)
    assert builds[0] == 6


def _rewrite(entry, change):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(entry), framework="pt") as f:
        meta = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys()}
    new_meta = change(state, meta)
    save_file(state, str(entry), metadata=new_meta if isinstance(new_meta, dict) else meta)


@pytest.mark.parametrize("damage", ["bytes", "format", "missing", "dtype", "size", "unknown", "q4 size", "q4 missing"])
def test_a_damaged_or_foreign_entry_is_built_again(folder, builds, tmp_path, damage):
    quant = "q4" if damage.startswith("q4") else "int8"
    reference = _load(folder, quant=quant)
    (entry,) = _entries(tmp_path)
    if damage == "bytes":
        entry.write_bytes(entry.read_bytes()[:1000])  # truncated
    elif damage == "format":
        _rewrite(entry, lambda s, m: {"format": "specdec-w8a8-0"})
    elif damage == "missing":
        _rewrite(entry, lambda s, m: s.pop("layers.1.down.scales"))
    elif damage == "dtype":
        _rewrite(entry, lambda s, m: s.update({"lm_head.scales": s["lm_head.scales"].float()}))
    elif damage == "size":
        _rewrite(entry, lambda s, m: s.update({"layers.0.qkv.col": s["layers.0.qkv.col"][:-1].clone()}))
    elif damage == "unknown":
        _rewrite(entry, lambda s, m: s.update({"layers.0.qkv.extra": torch.zeros(3)}))
    elif damage == "q4 size":
        _rewrite(entry, lambda s, m: s.update({"layers.1.qkv.q4_gain": s["layers.1.qkv.q4_gain"][:-1].clone()}))
    else:
        _rewrite(entry, lambda s, m: s.pop("layers.0.down.q4_packed"))  # then the layer reads as an int8 one
    again = _load(folder, quant=quant)
    assert builds[0] == 2 and _same(again, reference)
    assert _same(_load(folder, quant=quant), reference) and builds[0] == 2  # rewritten whole: read again


def test_off_writes_nothing(folder, builds, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_QUANTISED_CACHE", "off")
    _load(folder)
    _load(folder)
    assert builds[0] == 2 and not (tmp_path / "quantised").exists()


def test_only_the_most_recently_used_entries_are_kept_and_a_full_disk_gets_none(tmp_path, monkeypatch):
    """Eviction goes by last use: an entry read since is kept over one written after it."""
    monkeypatch.setenv("SPECDEC_QUANTISED_CACHE", str(tmp_path))
    monkeypatch.setattr(quantised_cache, "KEEP", 2)
    state = {"lm_head.packed": torch.zeros(1, 2, 4, 4, dtype=torch.int8), "lm_head.comp": torch.zeros(4, dtype=torch.int32),
             "lm_head.col": torch.ones(4), "lm_head.scales": torch.ones(4, dtype=torch.float64)}  # a 4 x 8 int8 layer
    for i in range(3):
        assert quantised_cache.save(f"entry{i}", state)
        os.utime(tmp_path / f"entry{i}.safetensors", ns=(i * 10**9, i * 10**9))  # written in this order
    assert quantised_cache.save("entry3", state)
    assert sorted(p.stem for p in tmp_path.glob("*.safetensors")) == ["entry2", "entry3"]
    os.utime(tmp_path / "entry3.safetensors", ns=(10 * 10**9, 10 * 10**9))  # written after entry2 ...
    assert quantised_cache.load("entry2", {"lm_head": (4, 8)}) is not None  # ... which is used after it
    assert quantised_cache.save("entry4", state)
    assert sorted(p.stem for p in tmp_path.glob("*.safetensors")) == ["entry2", "entry4"]
    monkeypatch.setattr(quantised_cache, "FREE_MARGIN", 1 << 62)  # more than any disk has free
    assert not quantised_cache.save("entry4", state)
    assert sorted(p.stem for p in tmp_path.glob("*")) == ["entry2", "entry4"]  # no temporary file left


def test_a_layer_rebuilt_from_its_state_is_the_layer(tmp_path):
    """W8A8Linear.state / from_state alone, with bias and smoothing, over 1-40 rows."""
    g = torch.Generator().manual_seed(3)
    w, b, smooth = torch.randn(70, 52, generator=g), torch.randn(70, generator=g), torch.rand(52, generator=g) + 0.5
    lin = W8A8Linear(w, b, smooth=smooth)
    again = W8A8Linear.from_state({k: v.clone() for k, v in lin.state().items()}, 52)
    for n in (1, 3, 5, 16, 40):
        x = torch.randn(n, 52, generator=g)
        assert torch.equal(lin(x), again(x))
    assert torch.equal(lin._unpacked().int_repr(), again._unpacked().int_repr())


def test_a_4bit_layer_rebuilt_from_its_state_is_the_layer():
    """Q4Linear.state / from_state alone, with gain, column factors and bias, over 1-40 rows."""
    g = torch.Generator().manual_seed(4)
    w, b = torch.randn(70, 80, generator=g), torch.randn(70, generator=g)
    lin = Q4Linear(quantize_q4_1(w), b, gain=torch.rand(80, generator=g) + 0.5, col=torch.rand(70, generator=g), in_features=80)
    again = Q4Linear.from_state({k: v.clone() for k, v in lin.state().items()}, 70, 80)
    for n in (1, 3, 5, 16, 40):
        x = torch.randn(n, 80, generator=g)
        assert torch.equal(lin(x), again(x))


def test_the_real_draft_in_int8_from_the_cache_is_the_draft(builds, tmp_path):
    """The shipped draft's real weights (w8a8, as ``--draft-dtype w8a8`` loads them)."""
    from specdec.models.registry import resolve

    folder = resolve("smollm2-135m-draft").folder
    first = _load(folder, int8_kernel="auto")
    second = _load(folder, int8_kernel="auto")
    assert builds[0] == 1 and _same(first, second)


def test_the_real_4bit_target_from_the_cache_is_the_target(builds, tmp_path):
    """The default target as it loads by default: the GGUF's 4-bit blocks as shipped, the int8 head;
    a second load reads neither the GGUF nor the float weights."""
    import specdec.models.gguf_blocks as gguf_blocks
    from specdec.models.registry import load

    reads = []
    real = gguf_blocks.read_q4_blocks
    gguf_blocks.read_q4_blocks = lambda *a, **k: reads.append(a) or real(*a, **k)
    try:
        first = load("smollm2-135m", quant="q4").model
        second = load("smollm2-135m", quant="q4").model
    finally:
        gguf_blocks.read_q4_blocks = real
    assert builds[0] == 1 and len(reads) == 1 and _same(first, second)


def test_an_entry_that_cannot_be_written_never_fails_the_load(folder, builds, tmp_path, monkeypatch):
    """The writer's own error (not only a full or read-only disk): the model loads, nothing is left."""
    import safetensors.torch

    def broken(*args, **kwargs):
        raise ValueError("the writer failed")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    model = _load(folder)
    assert model.quantised_state() is not None and not _entries(tmp_path)
    assert not list((tmp_path / "quantised").glob("*.tmp"))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_QUANTISED_CACHE", str(tmp_path))
    return tmp_path


def _int8(out=4, k=8, *, packed=None, smooth=None):
    """An int8 layer's fields (4 x 8 unless told: one group of 4 columns, two steps of 4 inputs)."""
    state = {"packed": torch.zeros(1, 2, 4, 4, dtype=torch.int8) if packed is None else packed,
             "comp": torch.zeros(out, dtype=torch.int32), "col": torch.ones(out),
             "scales": torch.ones(out, dtype=torch.float64)}
    if smooth is not None:
        state["inv_smooth"] = torch.ones(smooth)
    return state


def _q4(blocks=2, *, gain=0, col=0, packed=None):
    """A 4-bit layer's fields for 32 outputs (one group) and 64 inputs (two blocks)."""
    return {"q4_packed": torch.zeros(1, blocks, 640, dtype=torch.uint8) if packed is None else packed,
            "q4_gain": torch.ones(gain), "q4_col": torch.ones(col)}


def _roundtrip(layers: dict[str, dict], shapes: dict[str, tuple[int, int]]):
    state = {f"{name}.{field}": t for name, fields in layers.items() for field, t in fields.items()}
    assert quantised_cache.save("entry", state)
    return quantised_cache.load("entry", shapes)


def test_an_entry_with_a_layer_more_than_asked_for_is_not_used(cache):
    assert _roundtrip({"lm_head": _int8()}, {"lm_head": (4, 8)}) is not None
    assert _roundtrip({"lm_head": _int8(), "layers.0.qkv": _int8()}, {"lm_head": (4, 8)}) is None


@pytest.mark.parametrize("case", ["last dimension", "too few columns", "too few inputs"])
def test_an_int8_packing_that_does_not_cover_its_layer_is_not_used(cache, case):
    if case == "last dimension":
        layer, shape = _int8(packed=torch.zeros(1, 4, 4, 2, dtype=torch.int8)), (4, 8)
    elif case == "too few columns":
        layer, shape = _int8(out=8), (8, 8)  # one group of 4 columns for 8 outputs
    else:
        layer, shape = _int8(), (4, 12)  # two steps of 4 inputs for 12
    assert _roundtrip({"lm_head": layer}, {"lm_head": shape}) is None


def test_a_field_of_no_kind_is_not_used_even_with_the_layers_size(cache):
    layer = _int8()
    layer["extra"] = torch.zeros(4)  # as many as the outputs, float32 as the column factors
    assert _roundtrip({"lm_head": layer}, {"lm_head": (4, 8)}) is None


def test_smoothing_is_sized_by_the_inputs(cache):
    assert _roundtrip({"lm_head": _int8(smooth=8)}, {"lm_head": (4, 8)}) is not None
    assert _roundtrip({"lm_head": _int8(smooth=4)}, {"lm_head": (4, 8)}) is None


def test_a_4bit_layer_fits_with_its_blocks_gain_and_column_factors(cache):
    """Gain and column factors empty or sized by inputs and outputs; exactly the blocks of 32
    inputs the layer has; an empty packing only where Q6_K columns follow."""
    shapes = {"layers.0.down": (32, 64)}
    for fields in (_q4(), _q4(gain=64), _q4(col=32), _q4(gain=64, col=32)):
        assert _roundtrip({"layers.0.down": fields}, shapes) is not None
    for fields in (_q4(gain=32), _q4(col=64), _q4(blocks=3), _q4(blocks=1),
                   _q4(packed=torch.empty(0, dtype=torch.uint8))):
        assert _roundtrip({"layers.0.down": fields}, shapes) is None


def test_a_write_that_fails_half_way_leaves_no_temporary_file(cache, monkeypatch):
    import safetensors.torch

    real = safetensors.torch.save_file

    def half(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", half)
    assert not quantised_cache.save("entry", {f"lm_head.{k}": v for k, v in _int8().items()})
    assert list(cache.iterdir()) == []


def test_the_free_space_check_counts_bytes(cache, monkeypatch):
    """An entry whose bytes (not elements) would eat into the margin is not written."""
    state = {"lm_head.scales": torch.ones(1000, dtype=torch.float64)}  # 8,000 bytes
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(quantised_cache.shutil, "disk_usage",
                        lambda _: usage(1 << 40, 0, quantised_cache.FREE_MARGIN + 4000))
    assert not quantised_cache.save("entry", state)
    monkeypatch.setattr(quantised_cache.shutil, "disk_usage",
                        lambda _: usage(1 << 40, 0, quantised_cache.FREE_MARGIN + 9000))
    assert quantised_cache.save("entry", state)


def test_nothing_is_read_when_the_cache_is_off(monkeypatch):
    monkeypatch.setenv("SPECDEC_QUANTISED_CACHE", "off")
    assert quantised_cache.load("entry", {"lm_head": (4, 8)}) is None


@pytest.mark.parametrize("shape", [(70, 0, 64), (0, 40, 256), (64, 40, 256), (32, 7, 768)])
def test_a_4bit_packing_is_used_only_for_the_outputs_and_byte_width_it_was_made_for(cache, shape):
    """A real layer's packings (4-bit columns alone with a padded last group, Q6_K alone, both)
    fit its own shape; the same bytes for 32 outputs more or fewer, or cut to fewer bytes a
    block, are not used."""
    from specdec.models.linear import Q4Linear, Q6Blocks, quantize_q4_1
    from tests.models.test_q6 import _blocks, _q6_k_raw

    n4, n6, k = shape
    g = torch.Generator().manual_seed(k)
    b4 = quantize_q4_1(torch.randn(n4, k, generator=g)) if n4 else None
    b6: Q6Blocks | None = _blocks(_q6_k_raw(np.random.default_rng(k), n6, k)) if n6 else None
    fields = {f: t.clone() for f, t in Q4Linear(b4, blocks6=b6).state().items()}
    out = n4 + n6
    assert _roundtrip({"lm_head": fields}, {"lm_head": (out, k)}) is not None
    for wrong in (out + 32, out - 32):
        assert _roundtrip({"lm_head": fields}, {"lm_head": (wrong, k)}) is None, wrong
    for field in ("q4_packed", "q6_packed"):
        if fields.get(field, torch.empty(0)).numel():
            cut = {**fields, field: fields[field][..., :-64].contiguous()}
            assert _roundtrip({"lm_head": cut}, {"lm_head": (out, k)}) is None, field


def test_a_q6_packing_of_whole_groups_is_used_only_for_its_outputs(cache):
    """32 Q6_K columns are exactly one group: that packing fits 32 outputs, not 64 (nor 0)."""
    from tests.models.test_q6 import _blocks, _q6_k_raw

    b6 = _blocks(_q6_k_raw(np.random.default_rng(3), 32, 256))
    fields = {f: t.clone() for f, t in Q4Linear(None, blocks6=b6).state().items()}
    assert _roundtrip({"lm_head": fields}, {"lm_head": (32, 256)}) is not None
    assert _roundtrip({"lm_head": fields}, {"lm_head": (64, 256)}) is None


def test_an_entry_missing_a_layer_is_not_used(cache):
    """Every layer the model expects must be in the entry: one layer fewer is a miss."""
    shapes = {"lm_head": (4, 8), "layers.0.qkv": (4, 8)}
    assert _roundtrip({"lm_head": _int8(), "layers.0.qkv": _int8()}, shapes) is not None
    assert _roundtrip({"lm_head": _int8()}, shapes) is None


@pytest.mark.parametrize("field", ["comp", "col", "scales", "packed"])
def test_an_int8_layer_missing_a_required_field_is_not_used(cache, field):
    layer = _int8()
    del layer[field]
    assert _roundtrip({"lm_head": layer}, {"lm_head": (4, 8)}) is None


@pytest.mark.parametrize("field, dtype", [("scales", torch.float32), ("comp", torch.int64), ("col", torch.float64)])
def test_a_field_of_another_dtype_is_not_used(cache, field, dtype):
    layer = _int8()
    layer[field] = layer[field].to(dtype)
    assert _roundtrip({"lm_head": layer}, {"lm_head": (4, 8)}) is None


@pytest.mark.parametrize("case", ["q4_gain", "q4_col", "inv_smooth", "col"])
def test_a_vector_field_of_the_right_size_but_two_dimensions_is_not_used(cache, case):
    """Gain, column factors and smoothing are vectors: the same number of elements as a
    [n, 1] matrix is not the layer's state."""
    if case == "q4_gain":
        layers, shapes = {"l": {**_q4(), "q4_gain": torch.ones(64, 1)}}, {"l": (32, 64)}
    elif case == "q4_col":
        layers, shapes = {"l": {**_q4(), "q4_col": torch.ones(32, 1)}}, {"l": (32, 64)}
    elif case == "inv_smooth":
        layers, shapes = {"l": {**_int8(), "inv_smooth": torch.ones(8, 1)}}, {"l": (4, 8)}
    else:
        layers, shapes = {"l": {**_int8(), "col": torch.ones(4, 1)}}, {"l": (4, 8)}
    assert _roundtrip(layers, shapes) is None


def test_a_write_that_leaves_exactly_the_margin_is_made(cache, monkeypatch):
    """None is written where the disk would be left with *less than* FREE_MARGIN bytes: exactly
    the margin left is fine."""
    state = {"lm_head.scales": torch.ones(1000, dtype=torch.float64)}  # 8,000 bytes
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(quantised_cache.shutil, "disk_usage",
                        lambda _: usage(1 << 40, 0, quantised_cache.FREE_MARGIN + 8000))
    assert quantised_cache.save("entry", state)


def test_a_state_of_strided_views_is_written_and_read_back(cache):
    """A layer's state may hold views (a transposed or sliced tensor): they are stored by value."""
    packed = torch.arange(2 * 4 * 4 * 4 * 2, dtype=torch.int8).reshape(4, 2, 4, 4, 2)[..., 0].permute(1, 0, 2, 3)
    assert not packed.is_contiguous()
    layer = {**_int8(), "packed": packed[:1]}
    got = _roundtrip({"lm_head": layer}, {"lm_head": (4, 8)})
    assert got is not None and torch.equal(got["lm_head.packed"], packed[:1])


def test_a_file_without_the_format_in_its_metadata_is_not_used(cache):
    """Only an entry that says it is of FORMAT is read: a safetensors file with the right layers
    but no metadata (another writer's) is a miss."""
    from safetensors.torch import save_file

    save_file({f"lm_head.{k}": v for k, v in _int8().items()}, str(cache / "entry.safetensors"))
    assert quantised_cache.load("entry", {"lm_head": (4, 8)}) is None


def test_an_int8_bias_is_sized_by_the_outputs(cache):
    """4 outputs, 8 inputs: a bias of 4 is the layer's, one of 8 is not."""
    for bias, fits in ((torch.zeros(4), True), (torch.zeros(8), False)):
        assert (_roundtrip({"lm_head": {**_int8(), "bias": bias}}, {"lm_head": (4, 8)}) is not None) == fits, bias.numel()


def test_a_write_failing_with_any_error_is_a_quiet_miss(cache, monkeypatch):
    """save_file raising something other than an OSError (safetensors' own errors are not) returns
    False and leaves no temporary file: a cache must never fail a model's load."""
    import safetensors.torch

    def boom(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half")
        raise RuntimeError("serialisation failed")

    monkeypatch.setattr(safetensors.torch, "save_file", boom)
    assert quantised_cache.save("entry", {f"lm_head.{k}": v for k, v in _int8().items()}) is False
    assert list(cache.iterdir()) == []
