"""What the server's model wrappers (``ServedModel`` via ``SerializedModel``) pass on to the model
they wrap: cache sizes, every keyword of a pass, the tree pass and the feature pass, all under the
forward lock.  A recording stand-in model shows exactly what arrived."""

from __future__ import annotations

import threading

import pytest
import torch

from specdec.errors import ConfigError
from specdec.server.served import compact_kw
from specdec.server.sessions import SerializedModel, serialized


class _Recorder:
    """A model that notes every call (name, args, kwargs) and whether the lock was held then."""

    vocab_size = 6
    max_length = 64

    def __init__(self, lock: threading.Lock) -> None:
        self.calls: list[tuple] = []
        self.lock = lock

    def new_cache(self, max_length=None, *, initial_length=None):
        self.calls.append(("new_cache", max_length, initial_length))
        return object()

    def forward(self, tokens, cache, *, last_only=False, **kw):
        self.calls.append(("forward", last_only, kw, self.lock.locked()))
        return torch.zeros(1, self.vocab_size)

    def forward_tree(self, tokens, parents, cache, *, prefix=None, **kw):
        self.calls.append(("tree", prefix, kw, self.lock.locked()))
        return torch.zeros(tokens.numel(), self.vocab_size)

    def forward_features(self, tokens, cache, taps, **kw):
        self.calls.append(("features", taps, kw, self.lock.locked()))
        return torch.zeros(1, self.vocab_size), torch.zeros(1, 2)


def _served(**kw):
    lock = threading.Lock()
    inner = _Recorder(lock)
    return SerializedModel(inner, lock, **kw), inner


def test_a_callers_initial_length_wins_over_the_wrappers():
    """new_cache(initial_length=n) starts the cache at the caller's n (a draft model's own size),
    else at the wrapper's; a wrapper without one sizes the cache for max_length at once."""
    served, inner = _served(initial_length=32)
    served.new_cache(64, initial_length=7)
    served.new_cache(64)
    plain, plain_inner = _served()
    plain.new_cache(64)
    assert inner.calls == [("new_cache", 64, 7), ("new_cache", 64, 32)]
    assert plain_inner.calls == [("new_cache", 64, None)]


def test_a_model_whose_caches_do_not_grow_is_never_asked_for_an_initial_length():
    class Fixed(_Recorder):
        def new_cache(self, max_length=None):
            self.calls.append(("new_cache", max_length))
            return object()

    lock = threading.Lock()
    inner = Fixed(lock)
    SerializedModel(inner, lock, initial_length=32).new_cache(64, initial_length=7)
    assert inner.calls == [("new_cache", 64)]


def test_forward_passes_last_only_and_compact_on_under_the_lock():
    served, inner = _served()
    served.forward(torch.tensor([1, 2]), object(), last_only=True, compact=True)
    served.forward(torch.tensor([1]), object())
    assert inner.calls == [("forward", True, {"compact": True}, True), ("forward", False, {}, True)]


def test_the_tree_pass_passes_prefix_and_compact_on_under_the_lock():
    served, inner = _served()
    served.forward_tree(torch.tensor([1, 2]), torch.tensor([-1, 0]), object(), prefix=5, compact=True)
    served.forward_tree(torch.tensor([1]), torch.tensor([-1]), object())
    assert inner.calls == [("tree", 5, {"compact": True}, True), ("tree", None, {}, True)]


def test_a_model_without_a_tree_pass_has_no_forward_tree_attribute():
    """hasattr(served, "forward_tree") is False where the wrapped model has none: drafters keep to chains."""
    class NoTree:
        vocab_size, max_length = 6, 64

        def new_cache(self, max_length=None):
            return object()

    assert not hasattr(SerializedModel(NoTree()), "forward_tree")


def test_the_feature_pass_runs_under_the_lock_and_a_backend_without_it_is_a_config_error():
    served, inner = _served()
    served.forward_features(torch.tensor([1]), object(), (1, 2), last_only=True)
    assert inner.calls == [("features", (1, 2), {"last_only": True}, True)]

    class NoFeatures:
        vocab_size, max_length = 6, 64

        def new_cache(self, max_length=None):
            return object()

    with pytest.raises(ConfigError, match="hidden states"):
        SerializedModel(NoFeatures()).forward_features(torch.tensor([1]), object(), (1,))


def test_compact_is_asked_only_when_wanted():
    """compact_kw(False) is no keyword at all: models without a reduced vocabulary need not take it."""
    assert compact_kw(False) == {} and compact_kw(True) == {"compact": True}


def test_serialized_never_wraps_twice():
    served, _ = _served()
    assert serialized(served) is served


def test_a_prefix_cache_needs_a_batch_invariant_model():
    with pytest.raises(ValueError, match="batch-invariant"):
        _served(prefix_cache=object())


def test_keep_sequence_hands_the_rows_to_the_prefix_cache():
    class Keeper:
        min_tokens = 1 << 30

        def __init__(self):
            self.kept = []

        def keep(self, tokens, cache):
            self.kept.append((tokens, cache))

    lock = threading.Lock()
    inner = _Recorder(lock)
    inner.batch_invariant = True
    keeper = Keeper()
    served = SerializedModel(inner, lock, prefix_cache=keeper)
    cache = object()
    served.keep_sequence("ids", cache)
    assert keeper.kept == [("ids", cache)]


@pytest.mark.parametrize("error", [TypeError, ValueError])
def test_a_new_cache_whose_signature_cannot_be_read_is_called_without_initial_length(error):
    """A model whose new_cache has no readable signature (a C callable: inspect.signature raises
    ValueError for a builtin without one, TypeError for other unreadable ones) is taken as one whose
    caches do not grow: it is never passed initial_length, which it may not accept."""
    class CNewCache:
        @property
        def __signature__(self):  # as inspect.signature fails on some builtins (ValueError) or others
            raise error("no signature found")

        def __init__(self):
            self.calls = []

        def __call__(self, max_length=None):
            self.calls.append(max_length)
            return object()

    class Model:
        vocab_size, max_length = 6, 64

        def __init__(self):
            self.new_cache = CNewCache()

    inner = Model()
    SerializedModel(inner, initial_length=32).new_cache(64)
    assert inner.new_cache.calls == [64]


def test_a_request_thread_that_only_makes_a_cache_runs_one_openmp_thread(two_threads):
    """new_cache on a request thread sets that thread to one OpenMP thread (its own operations run
    without an OpenMP team), before any pass."""
    served, _ = _served(initial_length=8)
    seen = []

    def job():
        served.new_cache(64)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=job)
    t.start()
    t.join()
    assert seen == [1]



def test_a_model_without_a_reduced_vocabulary_has_vocab_ids_none():
    """vocab_ids is None (not an AttributeError) for a wrapped model without a reduced vocabulary:
    drafters test ``model.vocab_ids is not None``."""
    from specdec.models.toy import ToyLM

    assert SerializedModel(ToyLM(6, order=1, seed=0)).vocab_ids is None


class _Keeper:
    min_tokens = 1 << 30

    def keep(self, tokens, cache):
        pass


def _threads_after(job) -> int:
    """The OpenMP thread count of a fresh thread right after ``job()`` ran on it."""
    seen = []

    def run():
        job()
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return seen[0]


@pytest.mark.parametrize("call", ["forward", "forward_tree", "keep_sequence"])
def test_each_pass_alone_sets_its_request_thread_to_one_openmp_thread(two_threads, call):
    """A request thread whose first call into the wrapper is a pass (its cache made elsewhere), or
    the end of a sequence (a DELETE's or the TTL sweeper's thread), runs with one OpenMP thread."""
    lock = threading.Lock()
    inner = _Recorder(lock)
    inner.batch_invariant = True
    served = SerializedModel(inner, lock, prefix_cache=_Keeper())
    jobs = {"forward": lambda: served.forward(torch.tensor([1, 2]), object()),
            "forward_tree": lambda: served.forward_tree(torch.tensor([1]), torch.tensor([-1]), object()),
            "keep_sequence": lambda: served.keep_sequence(torch.tensor([1]), object())}
    assert _threads_after(jobs[call]) == 1
