"""How many draft tokens of an edge round are worth a row of a busy batched pass.

An edge session chooses its own γ, and under batching its round latency hardly depends on it
(its rows are a few among a hundred), so every client drafts long.  But once a batched pass is
compute-bound each row costs the same for everyone: with ``E`` tokens emitted from ``R`` rows in
a pass of time ``T(R)``, whose next row costs ``b = T'(R)``, one more row whose token is
accepted with probability ``p`` raises the server's tokens per second exactly when

    p > b E / T = m ρ,    ρ = E / R (tokens per row),  m = b / (T / R) (marginal / average row cost).

This is the rule vLLM applies coarsely when it switches speculation off past a batch size; here
it is applied per draft position.  The server knows everything in it: the cost curve ``T(R)``
from timing the model alone at start-up over 1 to 96 rows (:func:`calibrate`; ``b`` is its slope
at the mean rows per pass: on a 2-core CPU a row costs a few hundredths of a one-row pass at two
to four rows and a fifth at a hundred, and one straight line through both ends capped a single
user's drafts as if the server were busy); a least-squares line through the live passes instead
when that is not available (measured, the live fit under load is poor: the server's other
threads steal time from passes at random, which flattens the slope), the rows per pass ``R`` and ``ρ``
from the passes it ran and the tokens it emitted in a recent time window, and ``p_k`` = P(accepted
≥ k) per draft position from the rounds it verified (per wire mode).  The cap is the number of
leading positions with ``p_k > m ρ``, or with no estimate yet (never drafted: nothing says they
do not pay; counted as 0 they capped a server for good after its first rounds drafted one
token).  A position the cap cuts is drafted no more, so its estimate would never change: every
:data:`~specdec.defaults.DRAFT_CAP_PROBE_EVERY`-th cap of a wire that binds (its round wanted
more) allows one position more.

Truncating a draft is lossless for every rule: verifying the first ``k`` tokens of a draft is
verifying a ``k``-token draft, which the client could have sent itself (the choice of ``k``
depends only on the past).  The client commits what the answer holds, as after any rejection.
**The server's own drafting** (OpenAI requests) costs the server the draft model's passes as
well, so there one more position pays when

    p > (m T / R + T_d / D) E / (T + T_d),

with ``T_d`` the seconds of the draft model's passes and ``D`` the tokens it drafted in the same
window (the edge rule above is the case ``T_d = 0``).  ``T_d`` holds every row the drafting took,
not only one per drafted token: the prefill of a sequence's prompt, which the server's drafter
runs only when the sequence first drafts, and the catch-up over the tokens a sequence committed
while it was not drafting.  Counting a drafted token's own row alone (``T_d / R_d``), as a first
version did, let the cap turn drafting back on as soon as it paid per row; each time it did,
every sequence caught up on all it had missed, and on a busy 2-core server those catch-up rows
took ~13 % of the time.  Under heavy load this turns the server's own speculation down, to none
at all when even the first position does not pay — what vLLM's switch-off by batch size does,
but measured rather than set.  **Prompt lookup's drafts** (the default drafter's free half) cost
a target row and no draft pass: their positions get the edge rule's threshold ``m ρ``, from their
own acceptance (a wire of their own, :data:`LOOKUP_WIRE_SUFFIX`).

**One request with many choices** (a list of prompts, or ``n``) breaks the rule's assumption that
a sequence finishing sooner frees the server for other work: the choices run side by side, and
the request ends with the slowest of them.  A choice that speculates its way ahead of the others
shortens nothing, while its rejected draft rows make every pass it joins dearer (the 16 built-in
prompts in one request, prompt lookup alone: 2,400-2,600 rows in ~124 passes against 1,546 rows in
~137 passes without drafting).  Which choice ends last is not known (a choice stops at its end of
sequence), but one that has emitted more than the slowest running choice is less likely to: with
``k`` choices running it is taken to be the last with probability ``1/k``, so its tokens coming
sooner are worth ``1/k`` of what the threshold assumes and its threshold is ``k`` times as high
(:class:`RequestPace`; the slowest choices keep the plain threshold).  With two choices on a
lightly loaded pass that still drafts (rows cost little there); with sixteen on a busy one it
stops.  While some of the request's choices still wait for a slot, finishing early does start the
next one sooner, and every choice keeps the plain threshold.

It is applied only to the wire modes whose output does not depend on γ at all
(:data:`CAPPED_WIRES`: greedy, and coupled sampling, a function of the seed): with token or block
verification the *law* is unchanged but the sample a seed draws depends on how rounds consume the
randomness, and a user who fixed γ and a seed expects the same text back whatever the server's load.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import Any

from specdec import defaults


#: wire modes whose outputs are the same tokens whatever γ (so the cap never changes a result)
CAPPED_WIRES = ("greedy", "coupled")
#: each round's weight in the acceptance estimates shrinks by this factor with every later round
ROUND_DECAY = 1.0 - 1.0 / 512
#: the weights are brought back to 1 when a new round's would pass this
RESCALE_ABOVE = 1e100
#: a wire's free drafts (prompt lookup's, in the server's own drafting) are tracked as this wire
LOOKUP_WIRE_SUFFIX = "+lookup"


@dataclass(frozen=True)
class CapConfig:
    #: seconds of passes and emitted tokens the estimates look back over
    window_s: float = defaults.DRAFT_CAP_WINDOW_S
    #: passes needed in the window before any cap is given
    min_passes: int = defaults.DRAFT_CAP_MIN_PASSES
    #: rounds per wire mode needed before its acceptance is trusted
    min_rounds: int = defaults.DRAFT_CAP_MIN_ROUNDS
    #: longest draft position tracked (longer drafts are capped here once a cap is active)
    max_positions: int = defaults.MAX_GAMMA
    #: every this many binding caps of a wire allow one position more: a position the cap cuts is drafted
    #: no more, so without these probes its acceptance estimate could never recover
    probe_every: int = defaults.DRAFT_CAP_PROBE_EVERY


def cap_from(p_accept: list[float | None], threshold: float) -> int:
    """Number of leading positions whose acceptance probability exceeds ``threshold`` or is not
    known (None: never drafted, so nothing says it does not pay) (pure)."""
    k = 0
    while k < len(p_accept) and (p_accept[k] is None or p_accept[k] > threshold):
        k += 1
    return k


def row_costs(rows: list[int], seconds: list[float]) -> tuple[float, float] | None:
    """Least-squares ``(a, b)`` of ``seconds ≈ a + b · rows`` (pure); None if the rows never vary."""
    return fit_line(len(rows), sum(rows), sum(seconds), sum(r * r for r in rows), sum(r * s for r, s in zip(rows, seconds)))


def fit_line(n: int, rows: int, seconds: float, rows2: int, rows_s: float) -> tuple[float, float] | None:
    """:func:`row_costs` from the sums ``Σr, Σs, Σr², Σrs`` of ``n`` passes (integer rows: the
    spread ``n Σr² - (Σr)²`` is exact, zero when the rows never vary)."""
    spread = n * rows2 - rows * rows
    if n < 2 or spread <= 0:
        return None
    b = (n * rows_s - rows * seconds) / spread
    return (seconds - b * rows) / n, b


@dataclass(frozen=True)
class RowCosts:
    """Seconds of one pass by its rows, piecewise linear between measured row counts (rows
    increasing), extended past either end by the nearest piece's slope."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.rows) < 2 or len(self.rows) != len(self.seconds) or any(b <= a for a, b in zip(self.rows, self.rows[1:])):
            raise ValueError(f"row costs need two or more increasing row counts, got {self.rows}")

    @classmethod
    def line(cls, a: float, b: float) -> "RowCosts":
        """``a + b · rows``."""
        return cls((0, 1), (a, a + b))

    @classmethod
    def measured(cls, rows: tuple[int, ...], seconds: tuple[float, ...]) -> "RowCosts":
        """From timings, noisy at small row counts: a time below a smaller row count's is raised to it."""
        out, top = [], 0.0
        for sec in seconds:
            top = max(top, sec)
            out.append(top)
        return cls(tuple(rows), tuple(out))

    def _piece(self, r: float) -> int:
        """The index ``i`` of the piece [rows[i], rows[i + 1]] that holds ``r`` (the first or last beyond them)."""
        return min(max(bisect_right(self.rows, r) - 1, 0), len(self.rows) - 2)

    def slope(self, r: float) -> float:
        """What one more row costs at ``r`` rows (seconds)."""
        i = self._piece(r)
        return (self.seconds[i + 1] - self.seconds[i]) / (self.rows[i + 1] - self.rows[i])

    def at(self, r: float) -> float:
        """Seconds of a pass of ``r`` rows."""
        i = self._piece(r)
        return self.seconds[i] + (r - self.rows[i]) * self.slope(r)


def calibrate(model: Any, *, rows: tuple[int, ...] = defaults.DRAFT_CAP_CALIBRATION_ROWS, per_sequence: int = 8,
              context: int = 64, reps: int = 3, budget_s: float = 0.5) -> RowCosts | None:
    """The seconds of one pass of ``model`` alone at each of ``rows`` (one sequence of up to
    ``per_sequence`` rows, several of ``per_sequence`` beyond), after a ``context``-token prefill,
    medians of ``reps``, fewer where they would take more than ``budget_s`` (at least one; a 1.5B
    model's 96-row pass takes ~2 s on two cores, and its three took a quarter of the server's start)
    (throwaway caches; call before the model serves anyone).  None for models
    other than the native backend's (their passes may not be ours to time)."""
    import copy
    import math
    import statistics

    import torch

    from specdec.models.native import NativeCausalLM

    if not isinstance(model, NativeCausalLM) or model.max_length <= per_sequence:
        return None
    context = min(context, model.max_length - per_sequence)  # a model of a short context: a shorter prefill
    gen = torch.Generator().manual_seed(0)
    first = model.new_cache(context + per_sequence + 64)
    model.forward(torch.randint(0, model.vocab_size, (context,), generator=gen), first, last_only=True)
    # the other sequences' contexts are copies: a pass costs the same whatever the context holds, and
    # prefilling each took most of the calibration (12 prefills, ~16 s of a 1.5B model's ~26 s start)
    caches = [first] + [copy.deepcopy(first) for _ in range(max(math.ceil(r / per_sequence) for r in rows) - 1)]

    def timed(r: int) -> float:
        n = math.ceil(r / per_sequence)
        sizes = [r // n + (i < r % n) for i in range(n)]  # r rows over n sequences
        items = [(torch.randint(0, model.vocab_size, (k,), generator=gen), c, False) for k, c in zip(sizes, caches)]
        times: list[float] = []
        while not times or (len(times) < reps and sum(times) < budget_s):  # a long pass is timed once or twice
            for c in caches[:n]:
                c.truncate(context)
            t = time.perf_counter()
            model.forward_batch(items)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    return RowCosts.measured(tuple(rows), tuple(timed(r) for r in rows))


class _Window:
    """Timed entries of a few numbers each, with their running sums: :meth:`DraftCap.estimate`
    runs once or twice per round of every sequence, under a lock, while the window holds thousands
    of passes; summing them each time took ~0.2 ms a call, a busy server's request threads paying
    it one after another.  Integer columns stay Python ints, so their sums are exact."""

    def __init__(self, width: int) -> None:
        self.entries: deque[tuple[float, tuple]] = deque()
        self.sums: list = [0] * width

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, now: float, *values) -> None:
        self.entries.append((now, values))
        for i, v in enumerate(values):
            self.sums[i] += v

    def trim(self, horizon: float) -> None:
        entries = self.entries
        while entries and entries[0][0] < horizon:
            for i, v in enumerate(entries.popleft()[1]):
                self.sums[i] -= v
        if not entries:  # float sums back to exact zeros
            self.sums = [0] * len(self.sums)


class DraftCap:
    """The server's running estimates and the cap they give (thread-safe)."""

    def __init__(self, config: CapConfig | None = None, clock=time.monotonic,
                 costs: "RowCosts | tuple[float, float] | None" = None) -> None:
        """``costs``: the cost curve from :func:`calibrate`, or ``(a, b)`` of a line ``a + b · rows``
        (else a line fitted on the live passes)."""
        self.config = config or CapConfig()
        self._costs = RowCosts.line(*costs) if isinstance(costs, tuple) else costs
        self._clock = clock
        self._lock = threading.Lock()
        self._passes = _Window(4)  # the target's: rows, seconds, rows², rows·seconds
        self._draft_passes = _Window(1)  # the server's draft model's: seconds
        self._drafted = _Window(1)  # tokens the server's draft model drafted
        self._draft_token_s: float | None = None  # draft seconds per drafted token, kept when the window holds none
        self._emitted = _Window(1)  # tokens
        self._rounds: dict[str, int] = {}
        self._proposed: dict[str, list[float]] = {}
        self._accepted: dict[str, list[float]] = {}
        self._weight: dict[str, float] = {}  # the next round's weight per wire (see observe_round)
        self._asked: dict[str, int] = {}  # caps given per wire (every probe_every-th one is a probe)

    def _trim(self, now: float) -> None:
        horizon = now - self.config.window_s
        for window in (self._passes, self._emitted, self._draft_passes, self._drafted):
            window.trim(horizon)

    def observe_pass(self, rows: int, seconds: float) -> None:
        with self._lock:
            now = self._clock()
            self._passes.add(now, rows, seconds, rows * rows, rows * seconds)
            self._trim(now)

    def observe_draft_pass(self, rows: int, seconds: float) -> None:
        """One pass of the server's own draft model (drafting for OpenAI requests)."""
        with self._lock:
            now = self._clock()
            self._draft_passes.add(now, seconds)
            self._trim(now)

    def observe_tokens(self, tokens: int) -> None:
        """Tokens emitted by anything the target's passes served (edge rounds, OpenAI requests)."""
        with self._lock:
            self._emitted.add(self._clock(), tokens)

    def observe_drafted(self, tokens: int) -> None:
        """Tokens the server's draft model drafted in a round that teaches no chain estimate (a
        token tree's nodes): their draft passes are in ``T_d``, so they count in ``D`` too."""
        if tokens <= 0:
            return
        with self._lock:
            self._add_drafted(tokens)

    def _add_drafted(self, tokens: int) -> None:  # under the lock
        now = self._clock()
        self._drafted.add(now, tokens)
        self._trim(now)

    def observe_round(self, wire: str, gamma: int, accepted: int, *, server_drafted: bool = False) -> None:
        """One verified chain round: ``gamma`` drafted, the first ``accepted`` of them kept
        (``server_drafted``: by the server's own draft model, whose passes it cost)."""
        if gamma <= 0:  # nothing drafted: nothing learnt (and no time spent under the lock)
            return
        n = self.config.max_positions
        with self._lock:
            if server_drafted:
                self._add_drafted(gamma)
            prop = self._proposed.setdefault(wire, [0.0] * n)
            acc = self._accepted.setdefault(wire, [0.0] * n)
            # forget slowly (acceptance drifts with the prompts in flight): every earlier round's
            # weight shrinks by ROUND_DECAY a round; done by growing the new round's weight instead
            # (the ratios acc / prop are all the estimates read), rescaled before it overflows
            w = self._weight.get(wire, 1.0) / ROUND_DECAY
            if w > RESCALE_ABOVE:
                for k in range(n):
                    prop[k] /= w
                    acc[k] /= w
                w = 1.0
            self._weight[wire] = w
            for k in range(min(gamma, n)):
                prop[k] += w
                if k < accepted:
                    acc[k] += w
            self._rounds[wire] = self._rounds.get(wire, 0) + 1

    def estimate(self, wire: str, *, server_drafted: bool = False) -> tuple[float, list[float]] | None:
        """``(threshold, [p_1, p_2, ...])`` for ``wire``, or None while there is too little to go on.

        The threshold is ``m·ρ`` for drafts that arrive drafted (edges) or cost no draft pass
        (prompt lookup), and ``(m T/R + T_d/D) E/(T + T_d)`` for drafts the server's draft model
        drafts (``server_drafted``)."""
        with self._lock:
            self._trim(self._clock())
            if len(self._passes) < self.config.min_passes or self._rounds.get(wire, 0) < self.config.min_rounds:
                return None
            len_passes = len(self._passes)
            rows, seconds, rows2, rows_s = self._passes.sums
            fit = self._costs
            if fit is None:
                line = fit_line(len_passes, rows, seconds, rows2, rows_s)
                fit = RowCosts.line(*line) if line is not None else None
            (tokens,), (draft_s,), (drafted,) = self._emitted.sums, self._draft_passes.sums, self._drafted.sums
            if drafted and len(self._draft_passes):  # (no draft pass seen: its cost is unknown)
                self._draft_token_s = draft_s / drafted
            draft_token_s = self._draft_token_s
            prop, acc = self._proposed[wire], self._accepted[wire]
            p = [a / q if q > 0 else None for a, q in zip(acc, prop)]
        if fit is None or rows == 0 or seconds <= 0 or tokens == 0:
            return None
        mean_rows = rows / len_passes
        whole = fit.at(mean_rows)  # an average pass's seconds
        m = min(max(fit.slope(mean_rows) * mean_rows / whole, 0.0), 1.0) if whole > 0 else 0.0  # b / (seconds per row)
        if not server_drafted:
            return m * tokens / rows, p
        if draft_token_s is None:
            return None
        return (m * seconds / rows + draft_token_s) * tokens / (seconds + draft_s), p

    def cap(self, wire: str, *, server_drafted: bool = False, value: float = 1.0, wanted: int | None = None) -> int | None:
        """Draft tokens worth verifying (or, ``server_drafted``, drafting) for a round of ``wire`` now
        (None: no cap); ``value`` (0, 1]: what a token emitted sooner is worth to this sequence against
        the steady load the threshold assumes (:meth:`RequestPace.value`): the threshold is divided by it.
        ``wanted``: the tokens the round would draft uncapped, where known; a cap that does not bind
        (``wanted`` within it) is not counted towards the next probe, so probes land on rounds that
        would draft past the cut."""
        est = self.estimate(wire, server_drafted=server_drafted)
        if est is None:
            return None
        threshold, p = est
        k = cap_from(p, threshold / value)
        if wanted is not None and wanted <= k:
            return k
        with self._lock:
            asked = self._asked[wire] = self._asked.get(wire, 0) + 1
        if asked % self.config.probe_every == 0:  # a probe: the first capped position's estimate
            return min(k + 1, self.config.max_positions)  # would otherwise never change again
        return k


class RequestPace:
    """Tokens emitted by each running choice of one request, and what a choice ahead of the slowest
    one gains from drafting (thread-safe; see the module docstring).  A choice counts from :meth:`start` to
    :meth:`finish`; while :attr:`waiting` choices have not started, nobody is held back."""

    def __init__(self, waiting: int = 0) -> None:
        self._lock = threading.Lock()
        self._tokens: dict[int, int] = {}
        self.waiting = waiting

    def start(self, choice: int) -> None:
        with self._lock:
            self._tokens[choice] = 0
            self.waiting = max(self.waiting - 1, 0)

    def add(self, choice: int, tokens: int) -> None:
        with self._lock:
            if choice in self._tokens:
                self._tokens[choice] += tokens

    def finish(self, choice: int) -> None:
        with self._lock:
            self._tokens.pop(choice, None)

    def value(self, choice: int) -> float:
        """What ``choice``'s tokens coming sooner are worth (the module docstring): ``1 / k`` with ``k``
        choices running when it has emitted more than the slowest of them, else 1 (also while
        choices wait to start, or when it runs alone)."""
        with self._lock:
            mine = self._tokens.get(choice)
            running = len(self._tokens)
            if mine is None or self.waiting > 0 or running < 2 or mine <= min(self._tokens.values()):
                return 1.0
            return 1.0 / running
