"""``release_free_memory``: it really calls malloc_trim(0), says True whenever it could call it (whatever
malloc_trim answers), and says False (no exception) where the C library has no malloc_trim."""

from __future__ import annotations

import ctypes

import pytest

from specdec.server import memory


@pytest.fixture
def fresh_lookup():
    memory._malloc_trim.cache_clear()
    yield
    memory._malloc_trim.cache_clear()


@pytest.mark.parametrize("answer", [0, 1])
def test_it_calls_malloc_trim_with_zero_and_says_true_whatever_it_answers(monkeypatch, answer):
    """malloc_trim returns 1 when it released memory and 0 when there was none to release: either
    way the call was made (once, with pad 0) and the function says True."""
    calls = []
    monkeypatch.setattr(memory, "_malloc_trim", lambda: (lambda pad: calls.append(pad) or answer))
    assert memory.release_free_memory() is True
    assert calls == [0]


def test_a_c_library_without_malloc_trim_is_false_not_an_error(monkeypatch, fresh_lookup):
    class NoTrim:  # musl, macOS: the library loads but has no malloc_trim (AttributeError)
        def __init__(self, name):
            pass

    monkeypatch.setattr(ctypes, "CDLL", NoTrim)
    assert memory.release_free_memory() is False


def test_a_c_library_that_cannot_be_loaded_is_false_not_an_error(monkeypatch, fresh_lookup):
    def refuse(name):
        raise TypeError("no library name")

    monkeypatch.setattr(ctypes, "CDLL", refuse)
    assert memory.release_free_memory() is False


def test_a_c_library_that_dlopen_refuses_is_false_not_an_error(monkeypatch, fresh_lookup):
    def refuse(name):
        raise OSError("cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", refuse)
    assert memory.release_free_memory() is False
