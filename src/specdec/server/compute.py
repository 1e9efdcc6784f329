"""One thread for all of a server's model passes, and no OpenMP team anywhere else.

torch's CPU build parallelises an operation over an OpenMP team that belongs to the thread calling
it: every thread that runs a parallel operation keeps a team of its own for as long as it lives.
GNU libgomp (the runtime torch ships) counts the threads of all teams, and once they outnumber
the CPUs it cuts the spin-wait between parallel regions from ~300,000 iterations to ~100: each of
the hundreds of regions in a forward pass then pays a futex sleep and a wake-up.  A server whose
two schedulers, request threads and loading thread each ran parallel work held several teams on a
two-core machine and decoded a single user's request at about half the speed of a bare process.

So the server keeps the count at what one thread needs:

* :data:`COMPUTE` is the process's compute thread.  The models are loaded on it; every pass of
  the batching schedulers runs on it (the target's and the draft's take turns, in the order they
  were asked for), and so do the passes a scheduler runs outside its batches (token trees) and the
  lock-serialised passes of ``--no-batching``.  It is the only thread with an OpenMP team.
* :func:`one_openmp_thread` makes the calling thread run its torch operations without a team.
  Request threads (sampling, verification, cache bookkeeping: small operations) call it before
  their first, through the served model wrappers and the request executor's initialiser.
* ``specdec serve`` loads the models on the compute thread, so its main thread, which then runs
  only the event loop, never starts a team either.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable

import torch

_local = threading.local()


def _omp_set_num_threads() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch loaded, or None where there is none."""
    path = None
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                name = line.rsplit(None, 1)[-1]
                if any(lib in name for lib in ("libgomp", "libiomp", "libomp")):
                    path = name
                    break
    except OSError:
        pass
    try:
        return ctypes.CDLL(path).omp_set_num_threads  # path None: the symbols already loaded
    except (OSError, AttributeError):
        return None


def one_openmp_thread() -> None:
    """Run the calling thread's torch operations without an OpenMP team (once per thread; other
    threads keep their thread counts).  Not on the compute thread, and not on the main thread: that
    is the caller's (a script's or a test's), and a server's runs only its event loop."""
    if getattr(_local, "single", False) or getattr(_local, "compute", False):
        return
    if threading.current_thread() is threading.main_thread():
        return
    _local.single = True
    torch.get_num_threads()  # ATen sets a thread's count on its first use: let that happen now, not over ours
    setter = _omp_set_num_threads()
    if setter is not None:
        setter(1)


def _holding(lock: Any, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    with lock:
        return fn(*args, **kw)


class ComputeThread:
    """A daemon thread that runs submitted calls one at a time, first come first served."""

    def __init__(self, name: str = "specdec-compute") -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def on_it(self) -> bool:
        """Whether the caller is this compute thread."""
        return self._thread is not None and threading.current_thread() is self._thread

    def post(self, fn: Callable[[], None]) -> None:
        """Queue ``fn()`` (it must not raise: nobody waits for it)."""
        if self._thread is None or not self._thread.is_alive():
            with self._start_lock:
                if self._thread is None or not self._thread.is_alive():
                    self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                    self._thread.start()
        self._queue.put(fn)

    def pending(self) -> bool:
        """Whether calls are queued (not counting the one running)."""
        return not self._queue.empty()

    def run(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` on the compute thread (directly when called from it); its result, or
        its exception raised here."""
        if self.on_it():
            return fn(*args, **kw)
        done: Future[Any] = Future()

        def call() -> None:
            try:
                done.set_result(fn(*args, **kw))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)

        self.post(call)
        return done.result()

    def run_locked(self, lock: Any, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """:meth:`run` of ``fn(*args, **kw)`` holding ``lock`` (a model's pass lock) around the call."""
        return self.run(_holding, lock, fn, *args, **kw)

    def _loop(self) -> None:
        _local.compute = True
        while True:
            fn = self._queue.get()
            try:
                fn()
            except Exception:  # noqa: BLE001 - a posted call's own bug must not stop everyone's passes
                import traceback

                traceback.print_exc()


#: the process's compute thread (see the module's docstring)
COMPUTE = ComputeThread()
