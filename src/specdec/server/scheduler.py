"""Continuous batching: one loop runs the pending forward passes of every request as one ragged batch.

Every piece of model work the server does — an edge session's verification round, a prompt's
prefill, an OpenAI request's speculative rounds — is a forward pass ``(tokens, cache)`` of one
sequence.  Requests run in their own worker threads exactly as they would alone (sampling,
penalties, seeds and verification rules stay per request); only the forward pass is handed to the
:class:`Scheduler`, whose single loop collects what is pending, cuts it to a token budget and runs
it through the model in one pass (iteration-level scheduling, Orca: Yu et al., OSDI 2022):

* **ragged batch**: the rows of all sequences go through the linear layers together (one read of
  the weights for everyone); each sequence attends to its own cache.  With the native backend the
  logits of each sequence are bitwise what it gets alone (``NativeCausalLM.forward_batch``), so
  batching never changes an output.  Models without ``forward_batch`` run the items one by one;
* **token budget and chunked prefill**: at most ``max_tokens`` rows per pass; a forward longer than
  ``chunk`` rows (a long prompt) is cut into chunks run over several passes, so a 2,048-token
  prefill shares each pass with everyone's verification rounds instead of stalling them;
* **first come, first served**: the queue is FIFO; an item partly run keeps its place;
* **gathering**: the sequences a pass finished come back one request thread at a time (each
  samples, checks its stops and resubmits under the GIL), so the first to come back would start
  the next pass alone and many sequences would settle into small passes that take turns.  Before a
  pass the loop waits for the sequences the last pass finished to join those queued meanwhile,
  while they keep arriving (``gather_gap`` at most since the last arrival), never longer in all
  than the last pass took and never while another model's pass waits on the compute thread;
* **admission**: at most ``max_queue`` forwards wait; past that :meth:`Scheduler.forward` raises
  :class:`Overloaded` (the HTTP layer answers 503 with Retry-After), never an unbounded backlog;
* **cancellation**: a forward whose request was cancelled (:meth:`Scheduler.bind_cancel`) is
  dropped at the next pass boundary;
* **one compute thread**: the passes run on the process's compute thread
  (:mod:`specdec.server.compute`), shared by every scheduler: a model's next pass is queued there
  behind whatever other model's pass was asked for first, and no second thread ever holds an
  OpenMP team of its own (which would slow every pass down, see that module).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import Tensor

from specdec import defaults
from specdec.errors import ConfigError
from specdec.server.compute import COMPUTE, ComputeThread, one_openmp_thread
from specdec.server.served import ServedModel, compact_kw


class Overloaded(Exception):
    """The scheduler's queue is full."""


class Cancelled(Exception):
    """The request that submitted this forward pass went away."""


@dataclass(frozen=True)
class SchedulerConfig:
    #: rows (tokens) per pass, all sequences together
    max_tokens: int = defaults.SCHEDULER_MAX_TOKENS
    #: a forward longer than this is run in chunks of this many rows (prefill chunking)
    chunk: int = defaults.SCHEDULER_PREFILL_CHUNK
    #: forwards waiting at most; more raise Overloaded
    max_queue: int = defaults.SCHEDULER_MAX_QUEUE
    #: gathering (see the module): seconds without an arrival after which a pass starts; 0 = never wait
    gather_gap: float = defaults.SCHEDULER_GATHER_GAP_S

    def __post_init__(self) -> None:
        for what, value in (("the tokens per pass", self.max_tokens), ("the prefill chunk", self.chunk),
                            ("the queue length", self.max_queue)):
            if value < 1:
                raise ConfigError(f"{what} must be >= 1, got {value}")
        if not self.gather_gap >= 0:
            raise ConfigError(f"the gathering gap must be >= 0 ms, got {self.gather_gap * 1e3:g} ms")
        if self.chunk > self.max_tokens:
            raise ConfigError(f"the prefill chunk ({self.chunk}) cannot exceed the tokens per pass ({self.max_tokens})")


@dataclass(eq=False)
class _Item:
    tokens: Tensor  # [n] int64
    cache: Any
    last_only: bool
    cancelled: threading.Event
    compact: bool = False  # rows over a reduced draft vocabulary as they are
    taps: tuple[int, ...] | None = None  # a feature drafter's sequence: its features too (forward_features)
    done: threading.Event = field(default_factory=threading.Event)
    offset: int = 0  # rows already run
    parts: list[Tensor] = field(default_factory=list)  # logits of the chunks run so far
    features: list[Tensor] = field(default_factory=list)  # with taps: every chunk's [rows, taps + 1, D]
    error: BaseException | None = None

    @property
    def left(self) -> int:
        return self.tokens.numel() - self.offset


@dataclass(frozen=True)
class PassStats:
    """What one pass ran (for metrics)."""

    sequences: int
    tokens: int
    queued: int
    seconds: float


class Scheduler:
    """The batching loop in front of one model; its passes run on ``compute`` (default: the
    process's compute thread, :data:`specdec.server.compute.COMPUTE`)."""

    def __init__(self, model: Any, config: SchedulerConfig | None = None, *,
                 on_pass: Callable[[PassStats], None] | None = None, name: str = "target",
                 lock: Any | None = None, compute: ComputeThread | None = None) -> None:
        self.model = model
        #: held during every pass of this model: the batching loop's and :meth:`alone`'s (a model
        #: object runs one forward at a time: its layers reuse staging buffers).  ``lock``: share
        #: one with other users of the same model object (the server's forward lock)
        self.pass_lock = lock if lock is not None else threading.Lock()
        self.config = config or SchedulerConfig()
        self.on_pass = on_pass or (lambda stats: None)
        self.name = name
        self._queue: deque[_Item] = deque()
        self._mutex = threading.Lock()
        self._arrived = threading.Condition(self._mutex)  # notified when a forward joins the queue
        self._last_arrival = 0.0  # perf_counter() of the latest forward queued
        self._returning = 0  # the last pass's finished sequences (they may come back) + those queued meanwhile
        self._last_pass_s = 0.0  # the last pass's own time
        self.compute = compute if compute is not None else COMPUTE
        self._posted = False  # a pass of this scheduler is queued on the compute thread
        self._local = threading.local()
        self.batched = hasattr(model, "forward_batch")
        self.metrics: SchedulerMetrics | None = None  # set by the server (Prometheus figures)

    # ------------------------------------------------------------------ submitting

    def __len__(self) -> int:
        """Forwards waiting or running."""
        return len(self._queue)

    def bind_cancel(self, event: threading.Event | None) -> None:
        """Make ``event`` the calling thread's cancellation flag (one per request; ``None`` unbinds).

        Forwards this thread submits while the flag is set are dropped and raise :class:`Cancelled`.
        """
        self._local.cancelled = event

    def _cancel_event(self) -> threading.Event:
        event = getattr(self._local, "cancelled", None)
        return event if event is not None else threading.Event()

    def forward(self, tokens: Tensor, cache: Any, *, last_only: bool = False, compact: bool = False,
                taps: tuple[int, ...] | None = None) -> Any:
        """Run one sequence's forward pass in the next batch; blocks until its logits are ready
        (tokens: [n] -> [n|1, V], or [n|1, Vd] with ``compact``: a reduced draft vocabulary's rows).
        With ``taps`` (a target-aware drafter's verifier): ``(logits, features [n, len(taps) + 1, D])``
        as the model's ``forward_features`` returns them."""
        tokens = tokens.reshape(-1)
        if self.compute.on_it():  # a pass asking for a pass: run it here (waiting would never end)
            if taps is not None:
                return self.alone(self.model.forward_features, tokens, cache, taps, last_only=last_only)
            return self.alone(self.model.forward, tokens, cache, last_only=last_only, **compact_kw(compact))
        item = _Item(tokens=tokens, cache=cache, last_only=last_only, cancelled=self._cancel_event(), compact=compact,
                     taps=taps)
        with self._mutex:
            if len(self._queue) >= self.config.max_queue:
                if self.metrics is not None:
                    self.metrics.rejected.labels(self.name).inc()
                raise Overloaded(f"the {self.name} model's queue is full ({self.config.max_queue} forward passes waiting)")
            self._queue.append(item)
            self._last_arrival = time.perf_counter()
            self._post()
            self._arrived.notify()
        item.done.wait()
        if item.error is not None:
            raise item.error
        logits = item.parts[0] if len(item.parts) == 1 else torch.cat(item.parts)
        if taps is None:
            return logits
        return logits, item.features[0] if len(item.features) == 1 else torch.cat(item.features)

    def alone(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` (a pass of this model the batching loop does not run, e.g. a token
        tree's) on the compute thread, between two of the loop's passes, never during one."""
        return self.compute.run_locked(self.pass_lock, fn, *args, **kw)

    def _post(self) -> None:
        """Queue this scheduler's next pass on the compute thread, unless one is queued (under _mutex)."""
        if not self._posted:
            self._posted = True
            self.compute.post(self._pass)

    # ------------------------------------------------------------------ the loop

    def _take(self) -> tuple[list[tuple[_Item, int]], int]:
        """Pick the next batch under the token budget (FIFO; long items contribute one chunk)."""
        budget = self.config.max_tokens
        batch: list[tuple[_Item, int]] = []
        for item in list(self._queue):
            if item.cancelled.is_set():
                self._queue.remove(item)
                item.error = Cancelled("the request was cancelled")
                item.done.set()
                continue
            if budget <= 0:  # nothing more fits; look on for cancelled forwards to drop
                continue
            take = min(item.left, self.config.chunk, budget)
            batch.append((item, take))
            budget -= take
        return batch, len(self._queue)

    def _gather(self) -> None:
        """Wait (under _mutex) for the sequences the last pass finished, while they keep coming."""
        gap = self.config.gather_gap
        if gap <= 0:
            return
        started = time.perf_counter()
        deadline = started + self._last_pass_s
        while len(self._queue) < self._returning and not self.compute.pending():
            now = time.perf_counter()
            until = min(deadline, max(self._last_arrival, started) + gap)
            if now >= until:
                return
            self._arrived.wait(min(until - now, gap))  # wakes on an arrival; looks at other work at least every gap

    def _pass(self) -> None:
        """One pass over what is pending now (on the compute thread), once the sequences the last
        pass finished are back or stop arriving; the next one is queued behind the other work asked
        for meanwhile."""
        with self._mutex:
            self._gather()
            batch, queued = self._take()
            if not batch:
                self._posted = False
                return
        try:
            with self.pass_lock:  # the pass's own time, not a wait for the lock
                started = time.perf_counter()
                self._run(batch)
                seconds = time.perf_counter() - started
            self._last_pass_s = seconds
            self.on_pass(PassStats(sequences=len(batch), tokens=sum(t for _, t in batch), queued=queued, seconds=seconds))
        finally:
            with self._mutex:
                finished = 0
                for item, _ in batch:
                    if item.error is not None or item.left == 0:
                        self._queue.remove(item)
                        item.done.set()
                        finished += item.error is None
                # what the next pass can hold: these sequences once back, and what queued meanwhile
                self._returning = finished + len(self._queue)
                self._posted = False
                if self._queue:
                    self._post()

    def _run(self, batch: list[tuple[_Item, int]]) -> None:
        work = []
        for item, take in batch:
            # every chunk of a last_only forward asks for its last row only (the final one is kept)
            work.append((item.tokens[item.offset : item.offset + take], item.cache, item.last_only))
        compact = [item.compact for item, _ in batch]
        taps = [item.taps for item, _ in batch]
        kw = [compact_kw(c) for c in compact]

        def solo(item: _Item, t: Tensor, c: Any, last: bool, k: dict[str, bool]) -> Any:
            if item.taps is not None:
                return self.model.forward_features(t, c, item.taps, last_only=last)
            return self.model.forward(t, c, last_only=last, **k)

        try:
            if self.batched and len(work) > 1:
                # only what some item asks for: models without reduced vocabularies or features need
                # not take the arguments
                asked: dict[str, Any] = {}
                if any(compact):
                    asked["compact"] = compact
                if any(t is not None for t in taps):
                    asked["taps"] = taps
                outs = self.model.forward_batch(work, **asked)
            else:
                outs = [solo(item, t, c, last, k) for (item, _), (t, c, last), k in zip(batch, work, kw)]
        except Exception:  # noqa: BLE001 - isolate the failing item: rerun them one by one
            outs = None
        if outs is None:
            outs = []
            for (item, _), (t, c, last), k in zip(batch, work, kw):
                try:
                    outs.append(solo(item, t, c, last, k))
                except Exception as exc:  # noqa: BLE001 - handed to the waiting request
                    item.error = exc
                    outs.append(None)
        for (item, take), out, (_, _, last) in zip(batch, outs, work):
            if item.error is not None:
                continue
            item.offset += take
            if item.taps is not None:  # features of every row, logits as asked
                out, feats = out
                item.features.append(feats)
            if item.last_only:
                if item.left == 0:
                    item.parts = [out]
            else:
                item.parts.append(out)


class BatchedModel(ServedModel):
    """A :class:`LanguageModel` whose forward passes go through a :class:`Scheduler`."""

    def __init__(self, model: Any, scheduler: Scheduler, *, initial_length: int | None = None,
                 prefix_cache: Any | None = None) -> None:
        super().__init__(model, initial_length=initial_length, prefix_cache=prefix_cache)
        self.scheduler = scheduler

    def _forward(self, tokens: Tensor, cache: Any, *, last_only: bool = False, compact: bool = False) -> Tensor:  # tokens: [n]
        return self.scheduler.forward(tokens, cache, last_only=last_only, compact=compact)

    def _alone(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Between the scheduler's batches (a token tree's pass: an edge's tree round)."""
        return self.scheduler.alone(fn, *args, **kw)

    def forward_features(self, tokens: Tensor, cache: Any, taps: Any, *, last_only: bool = False,
                         parents: Tensor | None = None, prefix: int | None = None) -> tuple[Tensor, Tensor]:
        """A target-aware drafter's verification pass (tokens: [n] -> (logits [n|1, V], features
        [n, len(taps) + 1, D])): a chain's in the next batch with everyone else's rows, a tree's
        alone between batches (as every tree pass)."""
        fn = self._features_fn()
        one_openmp_thread()
        if parents is not None:
            return self._alone(fn, tokens, cache, taps, last_only=last_only, parents=parents, prefix=prefix)
        return self.scheduler.forward(tokens.reshape(-1), cache, last_only=last_only, taps=tuple(taps))


class SchedulerMetrics:
    """Operator figures of the batching loop, registered on the server's Prometheus registry."""

    _SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
    _TOKEN_BUCKETS = (1, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 1024)

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        r = registry
        self.queue = Gauge("specdec_scheduler_queue_length", "Forward passes waiting or running", ["model"], registry=r)
        self.passes = Counter("specdec_scheduler_passes", "Batched forward passes run", ["model"], registry=r)
        self.batch_size = Histogram("specdec_scheduler_batch_size", "Sequences per forward pass", ["model"],
                                    buckets=self._SIZE_BUCKETS, registry=r)
        self.tokens = Histogram("specdec_scheduler_tokens_per_pass", "Rows (tokens) per forward pass", ["model"],
                                buckets=self._TOKEN_BUCKETS, registry=r)
        self.pass_seconds = Histogram("specdec_scheduler_pass_seconds", "Time of one forward pass", ["model"],
                                      buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0), registry=r)
        self.rejected = Counter("specdec_scheduler_rejected", "Forward passes refused because the queue was full",
                                  ["model"], registry=r)

    def observer(self, name: str) -> Callable[[PassStats], None]:
        def observe(stats: PassStats) -> None:
            self.passes.labels(name).inc()
            self.batch_size.labels(name).observe(stats.sequences)
            self.tokens.labels(name).observe(stats.tokens)
            self.pass_seconds.labels(name).observe(stats.seconds)
            self.queue.labels(name).set(stats.queued)

        return observe
