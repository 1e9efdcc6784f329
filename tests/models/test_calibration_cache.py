"""The calibration cache: a later load reads the ranges an earlier one measured, and gives the
same quantised model, bit for bit, without the calibration pass; anything that could change the
ranges is part of the key; a damaged entry is measured again."""

from __future__ import annotations

import os

import pytest
import torch

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
    from specdec.models import calibration_cache

    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration_cache, "KEEP", 3)
    for i in range(5):
        calibration_cache.save(f"entry{i}", {"lm_head": torch.full((4,), float(i))})
        os.utime(tmp_path / f"entry{i}.pt", ns=(i * 10**9, i * 10**9))  # written in this order
    calibration_cache.save("entry5", {"lm_head": torch.zeros(4)})
    assert sorted(p.stem for p in tmp_path.glob("*.pt")) == ["entry3", "entry4", "entry5"]
    assert torch.equal(calibration_cache.load("entry4", {"lm_head": (4,)})["lm_head"], torch.full((4,), 4.0))
