"""``specdec cache`` (``specdec.caches``): the folders a part's setting names, what a part counts,
what clearing removes (its own files only, never anything a link points at), sizes as printed."""

from __future__ import annotations

import os

import pytest

from specdec import caches


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("SPECDEC_CACHE", str(root))
    monkeypatch.delenv("SPECDEC_CALIBRATION_CACHE", raising=False)
    monkeypatch.delenv("SPECDEC_QUANTISED_CACHE", raising=False)
    return root


def _part(name: str) -> caches.Part:
    return next(p for p in caches.parts() if p.name == name)


@pytest.mark.parametrize("value", ["OFF", " off ", "False", "0"])
def test_a_parts_setting_turns_it_off_whatever_its_case_or_spaces(cache_root, monkeypatch, value):
    monkeypatch.setenv("SPECDEC_QUANTISED_CACHE", value)
    assert caches.quantised_dir() is None and _part("quantised").folder is None


def test_a_parts_own_folder_may_start_with_a_tilde(cache_root, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", "~/ranges")
    assert caches.calibration_dir() == tmp_path / "home" / "ranges"


@pytest.mark.parametrize("name, own, other", [("calibration", "a.pt", "notes.txt"), ("quantised", "l.safetensors", "readme.md")])
def test_clearing_a_part_leaves_files_that_are_not_its_own(cache_root, name, own, other):
    """A user may point a part's setting at a folder that holds other files: only the part's own
    entries (ranges ``*.pt``, packed layers ``*.safetensors``) and temporaries are its."""
    folder = cache_root / name
    folder.mkdir(parents=True)
    (folder / own).write_bytes(b"x" * 40)
    (folder / other).write_bytes(b"x" * 11)
    assert caches.usage(_part(name)) == (1, 40)
    assert caches.clear(_part(name)) == 40
    assert sorted(p.name for p in folder.iterdir()) == [other]


def test_an_entrys_nested_files_are_counted_and_cleared(cache_root):
    nested = cache_root / "models" / "m" / "sub"
    nested.mkdir(parents=True)
    (nested / "w.bin").write_bytes(b"x" * 300)
    (cache_root / "models" / "m" / "config.json").write_bytes(b"x" * 24)
    assert caches.usage(_part("models")) == (1, 324)
    assert caches.clear(_part("models")) == 324 and not (cache_root / "models" / "m").exists()


def test_clearing_never_follows_a_link_out_of_the_cache(cache_root, tmp_path):
    """A link in a part's folder to a folder or file elsewhere: clearing removes the link alone,
    never what it points at; a linked file inside an entry is not counted as the cache's bytes."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"x" * 1000)
    (cache_root / "models" / "m").mkdir(parents=True)
    (cache_root / "models" / "m" / "w.bin").symlink_to(outside / "keep.bin")
    assert caches.usage(_part("models")) == (1, 0)
    (cache_root / "models" / "linked").symlink_to(outside, target_is_directory=True)
    caches.clear(_part("models"))
    assert (outside / "keep.bin").read_bytes() == b"x" * 1000
    assert not os.path.lexists(cache_root / "models" / "linked") and not (cache_root / "models" / "m").exists()


def test_sizes_read_in_the_next_unit_from_1024_on():
    assert [caches.human(n) for n in (0, 1023, 1024, 1536, 2**20, 3 * 2**30, 5 * 2**40)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "1.0 MiB", "3.0 GiB", "5120.0 GiB"]


def test_a_linked_entry_counts_no_bytes_and_clearing_it_frees_none(cache_root, tmp_path):
    """An entry that is a link to a folder or a file elsewhere is one entry of 0 bytes: clearing
    removes the link and says it freed nothing (it used to count, and report as freed, the bytes
    the link points at)."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big.bin").write_bytes(b"x" * 1000)
    (cache_root / "models").mkdir(parents=True)
    (cache_root / "models" / "linked").symlink_to(outside, target_is_directory=True)
    (cache_root / "models" / "file").symlink_to(outside / "big.bin")
    assert caches.usage(_part("models")) == (2, 0)
    assert caches.clear(_part("models")) == 0
    assert (outside / "big.bin").stat().st_size == 1000 and not list((cache_root / "models").iterdir())


def test_an_empty_part_setting_turns_it_off(cache_root, monkeypatch):
    """``SPECDEC_QUANTISED_CACHE=`` (set, but empty) is one of the values that turn a part off."""
    monkeypatch.setenv("SPECDEC_QUANTISED_CACHE", "")
    assert caches.quantised_dir() is None and _part("quantised").folder is None


def test_an_empty_cache_root_setting_means_the_default_root(monkeypatch, tmp_path):
    """``SPECDEC_CACHE=`` (empty) falls back to ``~/.cache/specdec``, never the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECDEC_CACHE", "")
    assert caches.root() == tmp_path / "home" / ".cache" / "specdec"


def test_a_turned_off_part_counts_nothing_and_clears_nothing(cache_root, monkeypatch):
    """A part turned off (no folder) is listed with no entries; clearing it frees nothing."""
    monkeypatch.setenv("SPECDEC_CALIBRATION_CACHE", "off")
    part = _part("calibration")
    assert part.folder is None
    assert caches.usage(part) == (0, 0) and caches.clear(part) == 0


def test_clearing_removes_a_parts_leftover_temporary_files_too(cache_root):
    """The calibration and quantised parts own their ``*.tmp`` files (an interrupted write)."""
    for name, own in (("calibration", "a.pt"), ("quantised", "l.safetensors")):
        folder = cache_root / name
        folder.mkdir(parents=True)
        (folder / own).write_bytes(b"x" * 10)
        (folder / "half.tmp").write_bytes(b"x" * 5)
        assert caches.usage(_part(name)) == (2, 15), name
        assert caches.clear(_part(name)) == 15 and not list(folder.iterdir()), name
