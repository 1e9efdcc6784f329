"""Model weights moved onto transparent huge pages (``specdec.models.hugepages``): the move keeps
every tensor's bits, shape, strides and sharing, and a moved model scores exactly as before.
Whether the kernel really backs the mapping with 2 MiB pages is not asserted (it may not, under
memory fragmentation or where transparent huge pages are off); where the platform has no
``MADV_HUGEPAGE`` the moving tests skip."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from specdec.models import hugepages
from specdec.models.native import NativeCausalLM
from tiny import make_tiny


@pytest.fixture
def on(monkeypatch):
    """Huge pages asked for whatever the machine's setting (the move itself is what is tested)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE on this platform")
    monkeypatch.setattr(hugepages, "available", lambda: True)


class _Holder:
    __slots__ = ("a", "b")


def _everything(obj):
    return True


def _inside(t: torch.Tensor, arena: hugepages.Arena) -> bool:
    lo = arena.buffer.data_ptr()
    return lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= lo + arena.buffer.numel()


def test_tensors_of_follows_attributes_slots_and_containers_of_the_objects_it_may_enter():
    x, y, z, w = (torch.zeros(3) for _ in range(4))
    holder = _Holder()
    holder.a, holder.b = [x, {"k": (y,)}], None
    module = torch.nn.Linear(2, 2)
    root = {"h": holder, "m": module, "again": x}
    found = {id(t) for t in hugepages.tensors_of(root, _everything)}
    assert found == {id(x), id(y), id(module.weight), id(module.bias)}
    # the default enters specdec's objects and torch modules only: not a test's own class
    found = {id(t) for t in hugepages.tensors_of(root)}
    assert found == {id(x), id(module.weight), id(module.bias)}
    assert sorted(id(t) for t in hugepages.tensors_of([z, w, z])) == sorted([id(z), id(w)])  # each once


def test_views_of_one_storage_stay_views_of_one_copy(on):
    """Tensors viewing one storage (offsets, a transpose) view one copy after the move, with the
    same values, sizes and strides; a write through one is seen through the others; small storages
    and tensors that require grad stay where they were."""
    base = torch.arange(200_000, dtype=torch.float32)
    part, row, t = base[10:20], base.view(200, 1000)[5], base.view(1000, 200).t()
    small, trained = torch.ones(8), torch.zeros(100_000, requires_grad=True)
    holder = _Holder()
    holder.a, holder.b = [base, part, row, t, small], {"w": trained}
    before = {name: x.clone() for name, x in (("base", base), ("part", part), ("row", row), ("t", t))}
    shapes = [(x.size(), x.stride(), x.storage_offset() - base.storage_offset()) for x in (base, part, row, t)]
    small_ptr, trained_ptr = small.data_ptr(), trained.data_ptr()
    arena = hugepages.adopt(holder, enter=_everything)
    assert arena is not None and arena.storages == 1 and arena.tensors == 4 and arena.moved_bytes == base.numel() * 4
    for name, x in (("base", base), ("part", part), ("row", row), ("t", t)):
        assert _inside(x, arena) and torch.equal(x, before[name])
    assert [(x.size(), x.stride(), x.storage_offset() - base.storage_offset()) for x in (base, part, row, t)] == shapes
    assert len({x.untyped_storage().data_ptr() for x in (base, part, row, t)}) == 1
    assert small.data_ptr() == small_ptr and trained.data_ptr() == trained_ptr
    assert base.data_ptr() % hugepages.HUGE_PAGE == 0  # the first storage starts on a huge page boundary
    base[12] = -1.0
    assert part[2] == -1.0 and t[12, 0] == -1.0
    gc.collect()  # the old buffer is gone; the copy lives as long as its tensors
    del arena
    holder.a = None
    gc.collect()
    assert part[2] == -1.0 and float(row.sum()) == float(sum(range(5000, 6000)))


@pytest.mark.parametrize("quant", [None, "q4"])
def test_a_moved_model_scores_bit_for_bit_as_before(on, tmp_path, quant):
    from specdec.models import kernels

    if quant == "q4" and not kernels.q4_available():
        pytest.skip("the 4-bit layers need the kernel library")
    folder = make_tiny(tmp_path, model_type="llama", hidden=128, layers=3)
    model = NativeCausalLM.from_folder(folder, batch_invariant=True, quant=quant)
    ids = torch.randint(0, 49152, (23,), generator=torch.Generator().manual_seed(0))

    def score():
        cache = model.new_cache(64)
        full = model.forward(ids[:20], cache)
        return full, torch.cat([model.forward(ids[i : i + 1], cache) for i in range(20, 23)])

    want = score()
    arena = hugepages.adopt(model, min_bytes=1)
    assert arena is not None and model._huge_pages is arena and arena.moved_bytes > 0
    gc.collect()
    got = score()
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    moved = [t for t in hugepages.tensors_of(model) if _inside(t, arena)]
    assert len(moved) == arena.tensors and any(t is model.embed for t in moved)
    # a second call finds nothing left to move (the arena's own buffer included)
    assert hugepages.adopt(model, min_bytes=1) is None and torch.equal(score()[1], want[1])


def test_off_when_asked_or_where_the_kernel_says_never(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    monkeypatch.setattr(hugepages, "_SETTING", setting)
    assert hugepages.thp_setting() is None  # unreadable
    setting.write_text("always [madvise] never\n")
    assert hugepages.thp_setting() == "madvise"
    monkeypatch.setenv("SPECDEC_HUGE_PAGES", "0")
    assert not hugepages.available() and hugepages.adopt([torch.zeros(1 << 20)]) is None
    monkeypatch.setenv("SPECDEC_HUGE_PAGES", "1")
    assert hugepages.available() == hasattr(mmap, "MADV_HUGEPAGE")
    setting.write_text("always madvise [never]\n")
    assert hugepages.thp_setting() == "never" and not hugepages.available()
    x = torch.zeros(1 << 20)
    ptr = x.data_ptr()
    assert hugepages.adopt([x]) is None and x.data_ptr() == ptr


def test_loading_moves_the_layers_and_head_but_not_the_embedding(on, tmp_path):
    """What ``registry.load`` does (``adopt_model``): the layer weights and the head move, the
    embedding table (a row a token) stays; the scores stay the same bits."""
    from specdec.models import registry

    folder = make_tiny(tmp_path, model_type="llama", hidden=128, layers=2)
    model = registry.load(str(folder)).model
    arena = model._huge_pages
    assert arena is not None and not _inside(model.embed, arena)
    assert all(_inside(t, arena) for t in hugepages.tensors_of(model.lm_head) if t.untyped_storage().nbytes() >= hugepages.MIN_BYTES)
    ids = torch.randint(0, 49152, (9,), generator=torch.Generator().manual_seed(1))
    moved = model.forward(ids, model.new_cache(16))
    plain = NativeCausalLM.from_folder(folder, batch_invariant=True)  # as the loader builds it, nothing moved
    assert not hasattr(plain, "_huge_pages")
    assert torch.equal(moved, plain.forward(ids, plain.new_cache(16)))


def test_tensors_without_a_storage_of_their_own_are_left_alone(on):
    """oneDNN's packed weights (opaque layout: no storage to read, the float32 Linear's packing),
    quantised and sparse tensors are not moved; the dense ones beside them are."""
    dense = torch.randn(300, 300)
    others = [torch.quantize_per_tensor(torch.randn(300, 300), 0.1, 0, torch.qint8), torch.randn(300, 300).to_sparse()]
    if torch.backends.mkldnn.is_available():
        others.append(torch.randn(300, 300).to_mkldnn())
    holder = _Holder()
    holder.a, holder.b = others, dense
    assert [id(t) for t in hugepages.tensors_of(holder, _everything)] == [id(dense)]
    arena = hugepages.adopt(holder, enter=_everything)
    assert arena is not None and arena.tensors == 1 and _inside(dense, arena)


@pytest.mark.parametrize("word", ["0", "false", "no", "off", " off ", "OFF", "False", "No", " Off "])
def test_every_spelling_of_off_turns_it_off(word, monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("[always] madvise never\n")
    monkeypatch.setattr(hugepages, "_SETTING", setting)
    monkeypatch.setenv("SPECDEC_HUGE_PAGES", word)
    assert not hugepages.available()


def test_the_kernels_always_setting_allows_it(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("[always] madvise never\n")
    monkeypatch.setattr(hugepages, "_SETTING", setting)
    monkeypatch.delenv("SPECDEC_HUGE_PAGES", raising=False)
    assert hugepages.thp_setting() == "always"
    assert hugepages.available() == hasattr(mmap, "MADV_HUGEPAGE")


def test_a_storage_of_exactly_the_threshold_moves_and_one_byte_less_stays(on):
    at = torch.ones(1024, dtype=torch.uint8)
    below = torch.ones(1023, dtype=torch.uint8)
    arena = hugepages.adopt([at, below], min_bytes=1024, enter=_everything)
    assert arena is not None and arena.tensors == 1 and arena.moved_bytes == 1024
    lo = arena.buffer.data_ptr()
    assert lo <= at.data_ptr() < lo + arena.buffer.numel()
    assert not lo <= below.data_ptr() < lo + arena.buffer.numel()


def test_many_small_storages_each_get_a_page_aligned_place(on):
    """A thousand storages of a few bytes (more than the mapping's spare 2 MiB would hold at a
    page each): every copy starts on a page, the first on a 2 MiB boundary, values kept."""
    ts = [torch.full((3,), float(i)) for i in range(1000)]
    arena = hugepages.adopt(ts, min_bytes=1, enter=_everything)
    assert arena is not None and arena.storages == 1000 and arena.tensors == 1000
    ptrs = sorted(t.data_ptr() for t in ts)
    assert ptrs[0] % hugepages.HUGE_PAGE == 0
    assert all(p % hugepages.ALIGN == 0 for p in ptrs)
    assert all(torch.equal(t, torch.full((3,), float(i))) for i, t in enumerate(ts))


def test_the_arena_counts_storages_and_tensors_apart(on):
    base = torch.zeros(100_000)
    views = [base[:10], base[10:20], base.view(1000, 100)]
    other = torch.ones(100_000)
    arena = hugepages.adopt([views, other], enter=_everything)
    assert arena is not None and arena.storages == 2 and arena.tensors == 4
    assert arena.moved_bytes == 2 * 100_000 * 4


def test_huge_bytes_reads_kilobytes(monkeypatch, tmp_path):
    rollup = tmp_path / "smaps_rollup"
    rollup.write_text("Rss:    10000 kB\nAnonHugePages:     4096 kB\n")
    real = hugepages.Path
    monkeypatch.setattr(hugepages, "Path", lambda p: rollup if p == "/proc/self/smaps_rollup" else real(p))
    assert hugepages.huge_bytes() == 4096 * 1024


def test_a_parameter_and_its_detached_view_keep_sharing_their_memory(on):
    """A storage that a tensor requiring grad views stays where it is, with every other tensor
    viewing it, in either order (a model being trained keeps its parameters' memory shared)."""
    for order in ("grad first", "grad last"):
        p = torch.nn.Parameter(torch.randn(100_000))
        d = p.detach()
        moved = torch.ones(100_000)
        holders = [p, d, moved] if order == "grad first" else [d, moved, p]
        arena = hugepages.adopt(holders, enter=_everything)
        assert arena is not None and arena.storages == 1 and _inside(moved, arena), order
        assert d.data_ptr() == p.data_ptr() and not _inside(d, arena), order


def test_a_second_adopt_of_the_same_tensors_moves_nothing(on):
    """The tensors already in an arena stay there: adopting them again gives None, same pointers."""
    ts = [torch.ones(100_000), torch.zeros(50_000)]
    arena = hugepages.adopt(ts, enter=_everything)
    assert arena is not None and all(_inside(t, arena) for t in ts)
    ptrs = [t.data_ptr() for t in ts]
    assert hugepages.adopt(ts, enter=_everything) is None
    assert [t.data_ptr() for t in ts] == ptrs


class _WithTable:
    TABLE = torch.ones(100_000)  # the class's, shared by every instance

    def __init__(self) -> None:
        self.w = torch.ones(100_000)


def test_a_class_held_as_a_value_is_not_entered():
    """Classes are not entered (an object holding a class, e.g. a factory, does not hand over the
    class's own tensors): only what objects hold themselves."""
    obj = _WithTable()
    obj.factory = _WithTable
    assert [id(t) for t in hugepages.tensors_of(obj, _everything)] == [id(obj.w)]


def test_nothing_large_enough_gives_no_arena(on):
    assert hugepages.adopt([torch.ones(8), torch.ones(16)], enter=_everything) is None


def test_the_arena_kept_on_a_model_is_not_one_of_its_tensors(on):
    """``adopt`` keeps the arena on the model (``_huge_pages``); walking the model afterwards
    finds the model's own tensors, not the arena's whole-mapping buffer."""
    module = torch.nn.Linear(300, 300).requires_grad_(False)  # inference weights: moved
    arena = hugepages.adopt(module)
    assert arena is not None and module._huge_pages is arena
    assert {id(t) for t in hugepages.tensors_of(module)} == {id(module.weight), id(module.bias)}


def test_tensors_in_a_set_or_frozenset_are_reached():
    """``tensors_of`` walks sets and frozensets as it walks lists and tuples."""
    a, b = torch.zeros(3), torch.ones(3)
    found = list(hugepages.tensors_of({"s": {a}, "f": frozenset([b])}))
    assert any(t is a for t in found) and any(t is b for t in found)


def test_an_unreadable_setting_is_not_available(monkeypatch, tmp_path):
    """Where the kernel's THP setting cannot be read (no THP support), nothing is moved even with
    SPECDEC_HUGE_PAGES on: only ``always`` and ``madvise`` allow it."""
    monkeypatch.setattr(hugepages, "_SETTING", tmp_path / "missing")
    monkeypatch.setenv("SPECDEC_HUGE_PAGES", "1")
    assert hugepages.thp_setting() is None
    assert hugepages.available() is False


def test_a_setting_path_that_is_not_a_readable_file_is_none(monkeypatch, tmp_path):
    """Any OSError reading the setting (here: a directory) means "cannot be read", not a crash."""
    monkeypatch.setattr(hugepages, "_SETTING", tmp_path)
    assert hugepages.thp_setting() is None
    assert hugepages.available() is False or not hasattr(mmap, "MADV_HUGEPAGE")


def test_huge_bytes_of_a_malformed_rollup_is_none(monkeypatch, tmp_path):
    """A rollup whose AnonHugePages line is not a number gives None, never a ValueError."""
    rollup = tmp_path / "smaps_rollup"
    rollup.write_text("Rss:    10000 kB\nAnonHugePages:     lots kB\n")
    real = hugepages.Path
    monkeypatch.setattr(hugepages, "Path", lambda p: rollup if p == "/proc/self/smaps_rollup" else real(p))
    assert hugepages.huge_bytes() is None
