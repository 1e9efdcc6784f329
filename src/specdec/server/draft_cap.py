"""How many draft tokens of an edge round are worth a row of a busy batched pass.

An edge session chooses its own γ, and under batching its round latency hardly depends on it
(its rows are a few among a hundred), so every client drafts long.  But once a batched pass is
compute-bound each row costs the same for everyone: with ``E`` tokens emitted from ``R`` rows in
a pass of time ``T = a + b R``, one more row whose token is accepted with probability ``p``
raises the server's tokens per second exactly when

    p > b E / T = m ρ,    ρ = E / R (tokens per row),  m = b / (T / R) (marginal / average row cost).

This is the rule vLLM applies coarsely when it switches speculation off past a batch size; here
it is applied per draft position.  The server knows everything in it: ``a`` and ``b`` from timing
the model alone at start-up (:func:`calibrate`; a least-squares fit of the live passes instead when
that is not available — measured, the live fit under load is poor: the server's other threads
steal time from passes at random, which flattens the slope), the rows per pass ``R`` and ``ρ``
from the passes it ran and the tokens it emitted in a recent time window, and ``p_k`` = P(accepted
≥ k) per draft position from the rounds it verified (per wire mode).  The cap is the number of
leading positions with ``p_k > m ρ``.

Truncating a draft is lossless for every rule: verifying the first ``k`` tokens of a draft is
verifying a ``k``-token draft, which the client could have sent itself (the choice of ``k``
depends only on the past).  The client commits what the answer holds, as after any rejection.
**The server's own drafting** (OpenAI requests) costs the server a draft row per drafted token
as well, so there one more position pays when

    p > (m T / R + T_d / R_d) E / (T + T_d),

with ``T_d`` the seconds of the draft model's passes and ``R_d`` their rows in the same window
(the edge rule above is the case ``T_d = 0``).  Under heavy load this turns the server's own
speculation down, to none at all when even the first position does not pay — what vLLM's
switch-off by batch size does, but measured rather than set.

It is applied only to the wire modes whose output does not depend on γ at all
(:data:`CAPPED_WIRES`: greedy, and coupled sampling, a function of the seed): with token or block
verification the *law* is unchanged but the sample a seed draws depends on how rounds consume the
randomness, and a user who fixed γ and a seed expects the same text back whatever the server's load.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from specdec import defaults


#: wire modes whose outputs are the same tokens whatever γ (so the cap never changes a result)
CAPPED_WIRES = ("greedy", "coupled")


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


def cap_from(p_accept: list[float], threshold: float) -> int:
    """Number of leading positions whose acceptance probability exceeds ``threshold`` (pure)."""
    k = 0
    while k < len(p_accept) and p_accept[k] > threshold:
        k += 1
    return k


def row_costs(rows: list[int], seconds: list[float]) -> tuple[float, float] | None:
    """Least-squares ``(a, b)`` of ``seconds ≈ a + b · rows`` (pure); None if the rows never vary."""
    n = len(rows)
    if n < 2:
        return None
    mr = sum(rows) / n
    ms = sum(seconds) / n
    var = sum((r - mr) ** 2 for r in rows)
    if var <= 0:
        return None
    b = sum((r - mr) * (s - ms) for r, s in zip(rows, seconds)) / var
    return ms - b * mr, b


def calibrate(model: Any, *, rows: int = 96, sequences: int = 12, context: int = 64, reps: int = 3) -> tuple[float, float] | None:
    """``(a, b)`` seconds of one pass ``≈ a + b · rows`` for ``model`` alone: one 1-row sequence vs
    ``sequences`` sequences of ``rows / sequences`` rows each, after a ``context``-token prefill,
    medians of ``reps`` (throwaway caches; call before the model serves anyone).  None for models
    other than the native backend's (their passes may not be ours to time)."""
    import statistics

    import torch

    from specdec.models.native import NativeCausalLM

    if not isinstance(model, NativeCausalLM):
        return None
    gen = torch.Generator().manual_seed(0)

    def caches(n: int) -> list[Any]:
        out = []
        for _ in range(n):
            cache = model.new_cache(context + rows + 64)
            model.forward(torch.randint(0, model.vocab_size, (context,), generator=gen), cache, last_only=True)
            out.append(cache)
        return out

    def timed(cs: list[Any], per: int) -> float:
        items = [(torch.randint(0, model.vocab_size, (per,), generator=gen), c, False) for c in cs]
        times = []
        for _ in range(reps):
            for c in cs:
                c.truncate(context)
            t = time.perf_counter()
            model.forward_batch(items)
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    per = max(rows // sequences, 1)
    small, big = timed(caches(1), 1), timed(caches(sequences), per)
    b = max((big - small) / (per * sequences - 1), 0.0)
    return max(small - b, 0.0), b


class DraftCap:
    """The server's running estimates and the cap they give (thread-safe)."""

    def __init__(self, config: CapConfig | None = None, clock=time.monotonic,
                 costs: tuple[float, float] | None = None) -> None:
        """``costs``: ``(a, b)`` from :func:`calibrate` (else fitted on the live passes)."""
        self.config = config or CapConfig()
        self._costs = costs
        self._clock = clock
        self._lock = threading.Lock()
        self._passes: deque[tuple[float, int, float]] = deque()  # (time, rows, seconds)
        self._draft_passes: deque[tuple[float, int, float]] = deque()  # the server's draft model: (time, rows, seconds)
        self._draft_row_s: float | None = None  # seconds per draft row, kept when the window holds none
        self._emitted: deque[tuple[float, int]] = deque()  # (time, tokens)
        self._rounds: dict[str, int] = {}
        self._proposed: dict[str, list[float]] = {}
        self._accepted: dict[str, list[float]] = {}

    def _trim(self, now: float) -> None:
        horizon = now - self.config.window_s
        while self._passes and self._passes[0][0] < horizon:
            self._passes.popleft()
        while self._emitted and self._emitted[0][0] < horizon:
            self._emitted.popleft()
        while self._draft_passes and self._draft_passes[0][0] < horizon:
            self._draft_passes.popleft()

    def observe_pass(self, rows: int, seconds: float) -> None:
        with self._lock:
            now = self._clock()
            self._passes.append((now, rows, seconds))
            self._trim(now)

    def observe_draft_pass(self, rows: int, seconds: float) -> None:
        """One pass of the server's own draft model (drafting for OpenAI requests)."""
        with self._lock:
            now = self._clock()
            self._draft_passes.append((now, rows, seconds))
            self._trim(now)

    def observe_tokens(self, tokens: int) -> None:
        """Tokens emitted by anything the target's passes served (edge rounds, OpenAI requests)."""
        with self._lock:
            self._emitted.append((self._clock(), tokens))

    def observe_round(self, wire: str, gamma: int, accepted: int) -> None:
        """One verified chain round: ``gamma`` drafted, the first ``accepted`` of them kept."""
        n = self.config.max_positions
        with self._lock:
            prop = self._proposed.setdefault(wire, [0.0] * n)
            acc = self._accepted.setdefault(wire, [0.0] * n)
            decay = 1.0 - 1.0 / 512  # forget slowly: acceptance drifts with the prompts in flight
            for k in range(n):
                prop[k] *= decay
                acc[k] *= decay
            for k in range(min(gamma, n)):
                prop[k] += 1.0
                acc[k] += 1.0 if k < accepted else 0.0
            self._rounds[wire] = self._rounds.get(wire, 0) + 1

    def estimate(self, wire: str, *, server_drafted: bool = False) -> tuple[float, list[float]] | None:
        """``(threshold, [p_1, p_2, ...])`` for ``wire``, or None while there is too little to go on.

        The threshold is ``m·ρ`` for drafts that arrive drafted (edges), and ``(m T/R + T_d/R_d)
        E/(T + T_d)`` for drafts the server drafts itself (``server_drafted``)."""
        with self._lock:
            self._trim(self._clock())
            if len(self._passes) < self.config.min_passes or self._rounds.get(wire, 0) < self.config.min_rounds:
                return None
            fit = self._costs or row_costs([r for _, r, _ in self._passes], [s for _, _, s in self._passes])
            rows = sum(r for _, r, _ in self._passes)
            len_passes = len(self._passes)
            seconds = sum(s for _, _, s in self._passes)
            tokens = sum(t for _, t in self._emitted)
            draft_rows = sum(r for _, r, _ in self._draft_passes)
            draft_s = sum(s for _, _, s in self._draft_passes)
            if draft_rows:
                self._draft_row_s = draft_s / draft_rows
            draft_row_s = self._draft_row_s
            prop, acc = self._proposed[wire], self._accepted[wire]
            p = [a / q if q > 1e-12 else 0.0 for a, q in zip(acc, prop)]  # decay keeps the ratio
        if fit is None or rows == 0 or seconds <= 0 or tokens == 0:
            return None
        a, b = fit
        mean_rows = rows / len_passes
        m = min(max(b * mean_rows / (a + b * mean_rows), 0.0), 1.0)  # b / (seconds per row of an average pass)
        if not server_drafted:
            return m * tokens / rows, p
        if draft_row_s is None:
            return None
        return (m * seconds / rows + draft_row_s) * tokens / (seconds + draft_s), p

    def cap(self, wire: str, *, server_drafted: bool = False) -> int | None:
        """Draft tokens worth verifying (or, ``server_drafted``, drafting) for a round of ``wire`` now (None: no cap)."""
        est = self.estimate(wire, server_drafted=server_drafted)
        if est is None:
            return None
        threshold, p = est
        return cap_from(p, threshold)
