import pytest
import torch

from specdec.kv_cache import GROW_STEP, KVCache


def test_reserve_truncate_bounds():
    c = KVCache(2, 1, 4, 10)
    assert c.reserve(6) == 0 and c.length == 6
    c.truncate(2)
    assert c.length == 2 and c.peak_length == 6
    assert c.reserve(3) == 2
    with pytest.raises(ValueError):
        c.truncate(7)
    with pytest.raises(ValueError):
        c.reserve(6)
    assert c.capacity == 64  # whole blocks of 64 positions, of which max_length = 10 are usable
    assert c.nbytes == 2 * 2 * 1 * 64 * 4 * 4
    assert c.used_bytes() == 2 * 2 * 1 * 6 * 4 * 4


def test_truncate_is_o1_no_copy():
    c = KVCache(1, 1, 2, 8)
    c.reserve(8)
    ptr = c.k.data_ptr()
    c.truncate(3)
    assert c.k.data_ptr() == ptr and c.length == 3


def test_compact_keeps_a_path():
    c = KVCache(1, 1, 1, 8)
    c.reserve(6)
    c.k[0, 0, :6, 0] = torch.arange(6.0)
    c.compact(torch.tensor([3, 5]), start=2)
    assert c.length == 4 and c.k[0, 0, :4, 0].tolist() == [0.0, 1.0, 3.0, 5.0]


@pytest.mark.parametrize("made_inside", [False, True])
def test_a_cache_grown_or_made_under_inference_mode_takes_writes_outside_it(made_inside):
    """The server's caches start short and grow inside a pass run under inference mode; a tree
    round then compacts them outside it.  With the grown buffers as inference tensors that write
    failed ("Inplace update to inference tensor outside InferenceMode"), found by a streamed tree
    request under load (tests/server/test_differential.py)."""
    if made_inside:
        with torch.inference_mode():
            c = KVCache(1, 1, 1, 512, initial_length=64)
    else:
        c = KVCache(1, 1, 1, 512, initial_length=64)
    with torch.inference_mode():
        c.reserve(100)  # grows past the first 64 positions
        c.k[0, 0, :100, 0] = torch.arange(100.0)
    assert c.capacity >= 100
    c.compact(torch.tensor([70, 99]), start=60)
    assert c.length == 62 and c.k[0, 0, 58:62, 0].tolist() == [58.0, 59.0, 70.0, 99.0]
    c.reserve(1)
    c.k[0, 0, 62, 0] = 1.0  # an ordinary write outside inference mode, as a drafter's catch-up makes


def test_compact_keeps_a_path_of_keys_and_values_in_every_layer():
    c = KVCache(2, 2, 3, 16)
    c.reserve(9)
    g = torch.Generator().manual_seed(0)
    c.k[:, :, :9] = torch.randn(2, 2, 9, 3, generator=g)
    c.v[:, :, :9] = torch.randn(2, 2, 9, 3, generator=g)
    k, v = c.k.clone(), c.v.clone()
    keep = torch.tensor([4, 6, 8])  # a root-to-leaf path of a tree region starting at slot 3
    c.compact(keep, start=3)
    assert c.length == 6
    assert torch.equal(c.k[:, :, :3], k[:, :, :3]) and torch.equal(c.v[:, :, :3], v[:, :, :3])
    assert torch.equal(c.k[:, :, 3:6], k[:, :, keep]) and torch.equal(c.v[:, :, 3:6], v[:, :, keep])


def test_cache_length_is_the_asked_positions_within_the_limit_and_refuses_none():
    from specdec.kv_cache import cache_length
    assert cache_length(None, 256) == 256
    assert cache_length(1, 256) == 1
    assert cache_length(300, 256) == 256
    for bad in (0, -5):  # 0 used to read as "not given" and made a cache for the whole context
        with pytest.raises(ValueError, match="at least one position"):
            cache_length(bad, 256)


def test_models_and_views_size_their_caches_through_cache_length():
    from specdec.drafters.self_spec import LayerPlan, LayerView
    from tests.tiny import tiny_native
    model = tiny_native(max_length=256)
    view = LayerView(model, LayerPlan.early_exit(model.cfg.n_layers, 1))
    for make in (model.new_cache, view.new_cache):
        assert make(7).max_length == 7
        assert make(None).max_length == 256
        with pytest.raises(ValueError, match="at least one position"):
            make(0)


def test_an_initial_length_below_one_still_allocates_one_block():
    assert KVCache(1, 1, 1, 500, initial_length=0).capacity == GROW_STEP


def test_a_reservation_that_exactly_fills_the_buffer_does_not_grow_it():
    c = KVCache(1, 1, 1, 512, initial_length=64)
    assert c.growth_bytes(64) == 0
    ptr = c.k.data_ptr()
    c.reserve(64)
    assert c.capacity == 64 and c.k.data_ptr() == ptr  # no reallocation, no copy


def test_growth_is_by_at_least_half_and_never_past_the_maximum():
    c = KVCache(1, 1, 1, 4096, initial_length=256)
    c.reserve(257)
    assert c.capacity == 384  # 256 + 128 (amortised O(1)), not just the 257 asked for rounded up
    capped = KVCache(1, 1, 1, 300, initial_length=256)
    capped.reserve(257)
    assert capped.capacity == 320  # 384 would pass max_length's whole blocks


def test_growth_bytes_forecasts_the_added_bytes_up_to_the_last_position():
    c = KVCache(1, 1, 1, 128, initial_length=64)
    bpp = c.bytes_per_position
    assert c.growth_bytes(65) == 64 * bpp  # what grows: 64 -> 128, not the whole new buffer
    assert c.growth_bytes(128) == 64 * bpp  # filling the context to its last position still grows
    assert c.growth_bytes(129) == 0  # past max_length: reserve refuses it, nothing grows


def test_truncating_to_a_negative_length_is_refused():
    c = KVCache(1, 1, 1, 8)
    c.reserve(4)
    with pytest.raises(ValueError):
        c.truncate(-1)
    assert c.length == 4


def test_growing_keeps_the_values_too():
    c = KVCache(1, 1, 1, 512, initial_length=64)
    c.reserve(64)
    c.k[0, 0, :64, 0] = torch.arange(64.0)
    c.v[0, 0, :64, 0] = -torch.arange(64.0)
    c.reserve(10)  # grows
    assert c.capacity > 64
    assert torch.equal(c.k[0, 0, :64, 0], torch.arange(64.0)) and torch.equal(c.v[0, 0, :64, 0], -torch.arange(64.0))


def test_a_reservation_past_one_and_a_half_times_the_buffer_grows_to_hold_it():
    """Growth is by at least half *or to what is asked*, whichever is more: a prefill of 500
    positions into a 64-position buffer must get >= 500 positions (and keep them writable)."""
    c = KVCache(1, 1, 1, 4096, initial_length=64)
    assert c.reserve(500) == 0
    assert c.capacity == 512
    c.k[0, 0, :500, 0] = torch.arange(500.0)  # every reserved position is in the buffer
    assert c.growth_bytes(12) == 0 and c.growth_bytes(13) > 0


def test_an_initial_length_past_the_maximum_allocates_only_the_maximums_blocks():
    """initial_length is clamped to max_length: asking for 1000 initial positions of a 100-position
    cache allocates 2 blocks (128 positions), not 1024."""
    c = KVCache(1, 1, 1, 100, initial_length=1000)
    assert c.capacity == 2 * GROW_STEP
    assert c.nbytes == 2 * 2 * GROW_STEP * 4


def test_used_bytes_of_zero_positions_is_zero_not_the_peak():
    """used_bytes(length) with an explicit 0 is the bytes of 0 positions; only None means the peak."""
    c = KVCache(1, 1, 2, 16)
    c.reserve(5)
    assert c.used_bytes(0) == 0
    assert c.used_bytes() == 5 * c.bytes_per_position and c.used_bytes(3) == 3 * c.bytes_per_position


def test_growth_bytes_counts_from_the_current_length():
    """growth_bytes(n) forecasts a reservation of n *more* positions on top of those held: with 60
    of 64 held, 5 more grow the buffer, and 69 more pass max_length (nothing grows: it is refused)."""
    c = KVCache(1, 1, 1, 128, initial_length=64)
    c.reserve(60)
    bpp = c.bytes_per_position
    assert c.growth_bytes(4) == 0
    assert c.growth_bytes(5) == 64 * bpp
    assert c.growth_bytes(69) == 0


def test_a_cache_made_under_inference_mode_and_never_grown_compacts_outside_it():
    """A cache created inside inference mode whose buffers never grew (inference tensors) must
    still take a tree round's compaction made outside inference mode."""
    with torch.inference_mode():
        c = KVCache(1, 1, 1, 64)
        c.reserve(6)
        c.k[0, 0, :6, 0] = torch.arange(6.0)
    c.compact(torch.tensor([3, 5]), start=2)
    assert c.length == 4 and c.k[0, 0, :4, 0].tolist() == [0.0, 1.0, 3.0, 5.0]


def test_growing_a_half_precision_cache_keeps_its_dtype_and_byte_counts():
    """A float16 cache stays float16 when it grows, and its byte figures use 2-byte elements."""
    c = KVCache(2, 1, 4, 512, initial_length=64, dtype=torch.float16)
    assert c.bytes_per_position == 2 * 2 * 1 * 4 * 2
    c.reserve(100)  # grows
    assert c.k.dtype == torch.float16 and c.v.dtype == torch.float16
    assert c.nbytes == 2 * 2 * 1 * c.capacity * 4 * 2 and c.used_bytes() == 100 * c.bytes_per_position


def test_one_position_at_a_time_past_a_full_buffer_grows_it():
    """Plain decoding reserves one position per step: the step that crosses the buffer's end must
    grow it, so every reserved position has room in ``k`` and ``v`` (capacity >= length)."""
    c = KVCache(1, 1, 2, 4 * GROW_STEP, initial_length=GROW_STEP)
    for _ in range(GROW_STEP + 1):
        start = c.reserve(1)
        assert c.capacity >= c.length
        c.k[:, :, start] = 1.0  # the reserved position can be written
    assert c.length == GROW_STEP + 1 and c.capacity > GROW_STEP
