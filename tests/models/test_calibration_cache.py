"""The calibration cache: a later load reads the ranges an earlier one measured, and gives the
same quantised model, bit for bit, without the calibration pass; anything that could change the
ranges is part of the key; a damaged entry is measured again."""

from __future__ import annotations

import os

import pytest
import torch

from specdec.models import calibration_cache, kernels
from specdec.models.native import NativeCausalLM, _LayerByLayer
from specdec.models.linear import w8a8_available
from tiny import make_tiny

pytestmark = pytest.mark.skipif(not w8a8_available(), reason="this torch build has no fbgemm int8 engine")

IDS = torch.randint(0, 1000, (30,), generator=torch.Generator().manual_seed(8))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("llama"), model_type="llama")


@pytest.fixture
def passes(tmp_path, monkeypatch):
    """The cache on, in a folder of this test's own; counts the calibration passes that run."""
    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", str(tmp_path / "calibration"))
    count = [0]
    real = _LayerByLayer.begin_pass

    def counted(self, ids):
        count[0] += 1
        return real(self, ids)

    monkeypatch.setattr(_LayerByLayer, "begin_pass", counted)
    return count


def _load(folder, quant="int8", **kw):
    return NativeCausalLM.from_folder(folder, quant=quant, batch_invariant=True, int8_kernel="fbgemm", **kw)


def _same(a: NativeCausalLM, b: NativeCausalLM) -> bool:
    smooth = [(x.inv_smooth, y.inv_smooth) for x, y in zip([a.lm_head, *(l.qkv for l in a.layers)],
                                                           [b.lm_head, *(l.qkv for l in b.layers)])
              if getattr(x, "inv_smooth", None) is not None]
    return all(torch.equal(x, y) for x, y in smooth) and torch.equal(a.forward(IDS, a.new_cache(64)), b.forward(IDS, b.new_cache(64)))


@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_a_second_load_reads_the_ranges_and_is_the_same_model(folder, passes, quant, tmp_path):
    first = _load(folder, quant)
    assert passes[0] == 1 and len(list((tmp_path / "calibration").glob("*.pt"))) == 1
    second = _load(folder, quant)
    assert passes[0] == 1  # no second pass
    assert _same(first, second)
    os.environ["SPECDEC_CALIBRATION_CACHE"] = "off"  # (restored by monkeypatch) the reference: a plain load
    assert _same(second, _load(folder, quant)) and passes[0] == 2


def test_what_could_change_the_ranges_is_in_the_key(folder, passes, monkeypatch):
    _load(folder)
    _load(folder, "q4")  # another quantisation
    _load(folder, vocab_subset=torch.arange(0, 40000))  # another head
    assert passes[0] == 3
    monkeypatch.setenv("SPECDEC_SOME_SETTING", "1")  # any specdec setting
    _load(folder)
    assert passes[0] == 4
    monkeypatch.delenv("SPECDEC_SOME_SETTING")
    _load(folder)
    assert passes[0] == 4  # back to the first key
    monkeypatch.setenv("SPECDEC_HUGE_PAGES", "0")  # which pages the built weights sit on: the same ranges
    _load(folder)
    assert passes[0] == 4
    monkeypatch.delenv("SPECDEC_HUGE_PAGES")
    weights = next(folder.glob("*.safetensors"))
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the weight file rewritten
    _load(folder)
    assert passes[0] == 5


def test_a_damaged_or_foreign_entry_is_measured_again(folder, passes, tmp_path):
    reference = _load(folder)
    (entry,) = (tmp_path / "calibration").glob("*.pt")
    entry.write_bytes(b"not a torch file")
    assert _same(_load(folder), reference) and passes[0] == 2
    ranges = torch.load(entry, weights_only=True)  # rewritten whole
    ranges["lm_head"] = ranges["lm_head"][:-1]  # a range of the wrong shape
    torch.save(ranges, entry)
    assert _same(_load(folder), reference) and passes[0] == 3
    ranges = torch.load(entry, weights_only=True)
    del ranges["layers.0.qkv"]  # a recorder missing
    torch.save(ranges, entry)
    assert _same(_load(folder), reference) and passes[0] == 4


def test_off_writes_nothing(folder, passes, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", "off")
    _load(folder)
    _load(folder)
    assert passes[0] == 2 and not (tmp_path / "calibration").exists()


def test_only_the_most_recent_entries_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration_cache, "KEEP", 3)
    for i in range(5):
        calibration_cache.save(f"entry{i}", {"lm_head": torch.full((4,), float(i))})
        os.utime(tmp_path / f"entry{i}.pt", ns=(i * 10**9, i * 10**9))  # written in this order
    calibration_cache.save("entry5", {"lm_head": torch.zeros(4)})
    assert sorted(p.stem for p in tmp_path.glob("*.pt")) == ["entry3", "entry4", "entry5"]
    assert torch.equal(calibration_cache.load("entry4", {"lm_head": (4,)})["lm_head"], torch.full((4,), 4.0))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("change", ["threads", "torch", "attention", "library"])
def test_the_process_that_would_run_the_pass_is_in_the_digest(change, monkeypatch):
    """The thread count, torch's version, the attention kernel and the compiled library's build
    each change the digest of the same parts."""
    parts = {"model": "m"}
    monkeypatch.setattr(kernels, "load", lambda: True)
    monkeypatch.setattr(kernels, "library", lambda: "build-a")
    before = calibration_cache.digest(parts)
    if change == "threads":
        threads = torch.get_num_threads() + 7
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    elif change == "torch":
        monkeypatch.setattr(torch, "__version__", torch.__version__ + "+other")
    elif change == "attention":
        monkeypatch.setattr(kernels, "attention_kernel", lambda: "some-other-attention")
    else:
        monkeypatch.setattr(kernels, "library", lambda: "build-b")
    assert calibration_cache.digest(parts) != before
    assert calibration_cache.digest({"model": "n"}) != calibration_cache.digest(parts)


def test_the_code_digest_covers_every_source_below_the_package_and_its_name(tmp_path, monkeypatch):
    """A source in a subpackage, and a source's name (the same bytes under another name), are in
    the code digest."""
    package = tmp_path / "pkg"
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text("top = 1\n")
    (package / "models" / "deep.py").write_text("x = 1\n")
    monkeypatch.setattr(calibration_cache, "__file__", str(package / "models" / "calibration_cache.py"))
    calibration_cache._code_digest.cache_clear()
    try:
        first = calibration_cache._code_digest()
        calibration_cache._code_digest.cache_clear()
        (package / "models" / "deep.py").write_text("x = 2\n")
        edited = calibration_cache._code_digest()
        calibration_cache._code_digest.cache_clear()
        (package / "models" / "deep.py").rename(package / "models" / "other.py")
        renamed = calibration_cache._code_digest()
    finally:
        calibration_cache._code_digest.cache_clear()
    assert len({first, edited, renamed}) == 3


def test_a_weight_file_of_another_size_with_the_same_time_is_another_identity(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 10)
    st = weights.stat()
    before = calibration_cache.file_identity([weights])
    weights.write_bytes(b"a" * 11)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # the same modification time
    assert calibration_cache.file_identity([weights]) != before


def test_the_key_is_none_when_the_cache_is_off(monkeypatch):
    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", "off")
    assert calibration_cache.key({"model": "m"}) is None


def test_an_entry_with_another_dtype_or_an_extra_recorder_is_not_used(cache):
    calibration_cache.save("double", {"lm_head": torch.ones(4, dtype=torch.float64)})
    assert calibration_cache.load("double", {"lm_head": (4,)}) is None
    calibration_cache.save("extra", {"lm_head": torch.ones(4), "layers.9.qkv": torch.ones(4)})
    assert calibration_cache.load("extra", {"lm_head": (4,)}) is None
    calibration_cache.save("exact", {"lm_head": torch.ones(4)})
    assert torch.equal(calibration_cache.load("exact", {"lm_head": (4,)})["lm_head"], torch.ones(4))


def test_a_write_that_fails_half_way_leaves_no_temporary_file(cache, monkeypatch):
    real = torch.save

    def half(obj, f, *args, **kwargs):
        real(obj, f, *args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", half)
    calibration_cache.save("entry", {"lm_head": torch.ones(4)})
    assert list(cache.iterdir()) == []


@pytest.mark.parametrize("name", ["SPECDEC_HUGE_PAGES", "SPECDEC_CACHE", "SPECDEC_API_KEY"])
def test_a_setting_that_cannot_change_the_pass_is_not_in_the_digest(name, monkeypatch):
    monkeypatch.delenv(name, raising=False)
    before = calibration_cache.digest({"model": "m"})
    monkeypatch.setenv(name, "0")
    assert calibration_cache.digest({"model": "m"}) == before


def test_a_setting_that_could_change_the_pass_is_in_the_digest(monkeypatch):
    monkeypatch.delenv("SPECDEC_SOMETHING_NEW", raising=False)
    before = calibration_cache.digest({"model": "m"})
    monkeypatch.setenv("SPECDEC_SOMETHING_NEW", "1")
    assert calibration_cache.digest({"model": "m"}) != before


def test_a_weight_file_named_relative_or_absolute_is_one_identity(tmp_path, monkeypatch):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"a" * 10)
    monkeypatch.chdir(tmp_path)
    assert calibration_cache.file_identity([weights]) == calibration_cache.file_identity([weights.name])


def test_an_entry_missing_a_recorder_is_not_used(cache):
    calibration_cache.save("fewer", {"lm_head": torch.ones(4)})
    assert calibration_cache.load("fewer", {"lm_head": (4,), "layers.0.qkv": (4,)}) is None


def test_a_range_of_another_shape_is_not_used(cache):
    calibration_cache.save("wide", {"lm_head": torch.ones(5)})
    assert calibration_cache.load("wide", {"lm_head": (4,)}) is None
    calibration_cache.save("square", {"lm_head": torch.ones(2, 2)})
    assert calibration_cache.load("square", {"lm_head": (4,)}) is None


def test_a_range_that_views_a_larger_tensor_is_stored_alone(cache):
    """``save`` stores each range by value: a view of a large tensor does not write its whole storage."""
    big = torch.ones(1_000_000)
    calibration_cache.save("view", {"lm_head": big[:4]})
    assert os.path.getsize(cache / "view.pt") < 100_000
    assert torch.equal(calibration_cache.load("view", {"lm_head": (4,)})["lm_head"], torch.ones(4))


CALLED: list[str] = []


def _record(what: str) -> str:
    CALLED.append(what)
    return what


class _Runs:
    """Unpickling this calls :func:`_record`: what a hostile entry in the cache folder could do."""

    def __reduce__(self):
        return (_record, ("unpickled",))


def test_an_entry_is_read_without_running_its_pickled_code(cache):
    """Entries are read with ``weights_only``: a pickle that calls code is refused, not run."""
    CALLED.clear()
    torch.save({"lm_head": _Runs()}, cache / "hostile.pt")
    assert calibration_cache.load("hostile", {"lm_head": (4,)}) is None
    assert CALLED == []


@pytest.mark.parametrize("name", ["SPECDEC_CALIBRATION_CACHE", "SPECDEC_QUANTISED_CACHE"])
def test_where_the_caches_live_is_not_in_the_digest(name, monkeypatch, tmp_path):
    """Moving either cache's folder cannot change a pass's numbers: the same parts, the same digest."""
    monkeypatch.setenv(name, str(tmp_path / "a"))
    before = calibration_cache.digest({"model": "m"})
    monkeypatch.setenv(name, str(tmp_path / "b"))
    assert calibration_cache.digest({"model": "m"}) == before


def test_the_oldest_written_entry_goes_first_whatever_its_name(tmp_path, monkeypatch):
    """KEEP = 2: entries named in the opposite order to their write times; the oldest written
    ("z") is the one removed."""
    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration_cache, "KEEP", 2)
    for i, name in enumerate(["z", "y"]):
        calibration_cache.save(name, {"lm_head": torch.ones(4)})
        os.utime(tmp_path / f"{name}.pt", ns=(i * 10**9, i * 10**9))
    calibration_cache.save("a", {"lm_head": torch.ones(4)})  # written now: the newest
    assert sorted(p.stem for p in tmp_path.glob("*.pt")) == ["a", "y"]


def test_parts_that_json_cannot_write_are_digested_by_their_text():
    """A caller's parts may hold values JSON has no form for (a Path, a dtype): they are digested
    by their text, not refused, and different values give different digests."""
    from pathlib import Path

    a = calibration_cache.digest({"model": Path("a"), "dtype": torch.float32})
    assert a == calibration_cache.digest({"model": Path("a"), "dtype": torch.float32})
    assert a != calibration_cache.digest({"model": Path("b"), "dtype": torch.float32})
    assert a != calibration_cache.digest({"model": Path("a"), "dtype": torch.bfloat16})
