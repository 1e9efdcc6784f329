"""γ controllers: how many tokens to draft next round.

* :class:`FixedGamma` — always the same γ.
* :class:`GuideGamma` — a simple dynamic rule: start 6, range [3, 12], +1 when
  accepted/γ >= 0.8, -1 when <= 0.4.
* :class:`CostGamma` — picks the γ that maximises expected tokens per second from measured
  per-position acceptance and measured draft / target / overhead costs (Leviathan et al. 2023,
  §3.3-3.4, generalised to a non-i.i.d. acceptance profile).  γ = 0 (no drafting) is a choice,
  so it backs off to plain decoding when drafting does not pay, and probes now and then to notice
  when it pays again; a probe that does not win doubles the interval to the next one, and one
  that shows a drafted token costing a whole plain round sets it to the longest.
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable, Protocol

from specdec import defaults


class GammaController(Protocol):
    def next_gamma(self) -> int: ...

    def update(self, *, gamma: int, accepted: int, draft_s: float, target_s: float, other_s: float) -> None: ...

    @property
    def name(self) -> str: ...


@dataclass
class FixedGamma:
    gamma: int

    @property
    def name(self) -> str:
        return f"fixed({self.gamma})"

    def next_gamma(self) -> int:
        return self.gamma

    def update(self, *, gamma: int, accepted: int, draft_s: float, target_s: float, other_s: float) -> None:
        pass


@dataclass
class GuideGamma:
    gamma: int = defaults.GUIDE_GAMMA_START
    low: int = defaults.GUIDE_GAMMA_MIN
    high: int = defaults.GUIDE_GAMMA_MAX
    up: float = defaults.GUIDE_GAMMA_UP
    down: float = defaults.GUIDE_GAMMA_DOWN

    @property
    def name(self) -> str:
        return "guide"

    def next_gamma(self) -> int:
        return self.gamma

    def update(self, *, gamma: int, accepted: int, draft_s: float, target_s: float, other_s: float) -> None:
        if gamma <= 0:
            return
        ratio = accepted / gamma
        if ratio >= self.up:
            self.gamma = min(self.gamma + 1, self.high)
        elif ratio <= self.down:
            self.gamma = max(self.gamma - 1, self.low)


@dataclass
class CappedGamma:
    """Another controller's γ, never above a ceiling set from outside (``cap()``; None = no ceiling),
    with every round also reported to ``observe(gamma, accepted)``.  A batching server uses it for
    its own drafting: past a load where a drafted token costs more than it brings, it drafts less
    (see :mod:`specdec.server.draft_cap`)."""

    inner: GammaController
    #: the ceiling for a round the inner controller wants the given number of tokens for
    cap: Callable[[int], int | None]
    observe: Callable[[int, int], None] | None = None
    #: the ceiling for free drafts (prompt lookup's: a row of the target's pass each, no draft
    #: model's), and where their rounds are reported; None = no ceiling / not reported
    free_cap: Callable[[], int | None] | None = None
    observe_free: Callable[[int, int], None] | None = None

    @property
    def name(self) -> str:
        return self.inner.name

    def next_gamma(self) -> int:
        g = self.inner.next_gamma()
        c = self.cap(g)
        return g if c is None else max(0, min(g, c))

    def free_limit(self) -> int | None:
        """The most free draft tokens worth a round now (None: no ceiling)."""
        return None if self.free_cap is None else self.free_cap()

    def update(self, *, gamma: int, accepted: int, draft_s: float, target_s: float, other_s: float) -> None:
        self.inner.update(gamma=gamma, accepted=accepted, draft_s=draft_s, target_s=target_s, other_s=other_s)
        if self.observe is not None:
            self.observe(gamma, accepted)

    def update_free(self, *, gamma: int, accepted: int, draft_s: float, target_s: float, other_s: float) -> None:
        """A free draft's round (the drafter's own controller learns from it; γ's does not)."""
        if self.observe_free is not None:
            self.observe_free(gamma, accepted)


class ObservedGamma:
    """Another controller (a tree's node budget), every round it learns from also reported to
    ``observe(gamma, accepted)``; the rest of its surface (a budget's ``tree_round``) is its own.
    A batching server counts its tree rounds' drafted tokens with it (see
    :mod:`specdec.server.draft_cap`)."""

    def __init__(self, inner: GammaController, observe: Callable[[int, int], None]) -> None:
        self.inner = inner
        self.observe = observe

    def __getattr__(self, name: str):  # noqa: ANN204 - whatever the inner controller has
        if name in ("inner", "observe"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def next_gamma(self) -> int:
        return self.inner.next_gamma()

    def update(self, *, gamma: int, accepted: int, draft_s: float, target_s: float, other_s: float) -> None:
        self.inner.update(gamma=gamma, accepted=accepted, draft_s=draft_s, target_s=target_s, other_s=other_s)
        self.observe(gamma, accepted)


def expected_tokens(accept_at_least: list[float], gamma: int) -> float:
    """E[tokens per round] = 1 + sum_{k<=γ} P(accepted >= k)."""
    return 1.0 + sum(accept_at_least[:gamma])


def best_gamma(
    accept_at_least: list[float],  # P(accepted >= k | γ >= k), k = 1..max
    draft_step_s: float,
    target_s: list[float],  # cost of one target call scoring n = 1..max+1 tokens (index n-1)
    overhead_s: float,
) -> tuple[int, list[float]]:
    """The γ in [0, max] maximising E[tokens] / E[seconds] per round, and the rate of each γ."""
    rates = []
    for g in range(len(accept_at_least) + 1):
        seconds = g * draft_step_s + target_s[g] + overhead_s
        rates.append(expected_tokens(accept_at_least, g) / max(seconds, 1e-9))
    return max(range(len(rates)), key=rates.__getitem__), rates


@dataclass
class CostGamma:
    """Cost-based γ from decayed running estimates (decay keeps it adaptive within a prompt).

    Acceptance is tracked per draft position as a conditional rate
    ``c_k = P(accepted >= k | accepted >= k-1, drafted >= k)``, shrunk towards the pooled rate
    over all positions, so positions never tried yet inherit the observed rate instead of a
    fixed prior: with high acceptance the controller grows γ, with low acceptance it shrinks it.
    """

    max_gamma: int = defaults.COST_GAMMA_MAX
    start: int = defaults.COST_GAMMA_START
    decay: float = defaults.COST_GAMMA_DECAY
    probe_every: int = defaults.COST_GAMMA_PROBE_EVERY
    probe_gamma: int = defaults.COST_GAMMA_PROBE
    max_probe_every: int = defaults.COST_GAMMA_PROBE_MAX
    prior_accept: float = defaults.COST_GAMMA_PRIOR_ACCEPT
    prior_weight: float = defaults.COST_GAMMA_PRIOR_WEIGHT
    outlier: float = defaults.COST_GAMMA_OUTLIER
    extra_target_s: float = 0.0  # e.g. a network round trip, known before measuring
    _hits: list[float] = field(default_factory=list)
    _tries: list[float] = field(default_factory=list)
    _draft_s: float | None = None
    _draft_min: float | None = None  # the cheapest drafted token measured (see successor)
    _target_s: dict[int, float] = field(default_factory=dict)
    _other_s: float = 0.0
    _since_draft: int = 0
    _interval: int = 0  # rounds between probes now (probe_every, doubled by each probe that loses)
    _probing: bool = False
    _gamma: int = -1
    last_rates: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not (self.max_gamma >= 1 and 0 <= self.start <= self.max_gamma and 1 <= self.probe_gamma <= self.max_gamma):
            raise ValueError("γ controller: max_gamma >= 1, 0 <= start <= max_gamma and 1 <= probe_gamma <= max_gamma")
        if not (1 <= self.probe_every <= self.max_probe_every and 0.0 < self.decay <= 1.0 and self.outlier > 1.0):
            raise ValueError("γ controller: 1 <= probe_every <= max_probe_every, 0 < decay <= 1 and outlier > 1")
        self._hits = [0.0] * self.max_gamma
        self._tries = [0.0] * self.max_gamma
        self._gamma = self.start
        self._interval = self.probe_every

    @property
    def name(self) -> str:
        return "auto"

    def accept_profile(self) -> list[float]:
        """Estimated P(accepted >= k), k = 1..max."""
        w = self.prior_weight
        pooled = (sum(self._hits) + w * self.prior_accept) / (sum(self._tries) + w)
        out, prob = [], 1.0
        for h, t in zip(self._hits, self._tries):
            prob *= (h + w * pooled) / (t + w)
            out.append(prob)
        return out

    def _effective(self) -> dict[int, float]:
        """The measured pass costs, each never above a larger pass's: more rows never cost less, so
        a smaller size reading dearer is a stale or disturbed estimate (the one-row cost is not
        measured again while the controller drafts, and one slow pass had made plain decoding
        look dearer than a drafted round, which then kept drafting at a loss)."""
        eff: dict[int, float] = {}
        low = math.inf
        for size in sorted(self._target_s, reverse=True):
            low = min(low, self._target_s[size])
            eff[size] = low
        return eff

    @staticmethod
    def _interpolated(eff: dict[int, float], sizes: list[int], n: int) -> float:
        """The cost of a pass over ``n`` positions from the (monotone) measured ones, ``sizes`` sorted."""
        if n in eff:
            return eff[n]
        # linear between the two nearest measured sizes; outside them, along the line through
        # the two nearest (a pass never costs less than half the cheapest one measured, never
        # less than a smaller one and never more than a larger one): before any γ = 0 round the
        # one-row cost must not read as the two-row cost, or drafting one token looks cheaper
        # than it is; nor above it: two noisy larger sizes (a 3-row pass read cheaper than a
        # 2-row one) extrapolated to a one-row pass dearer than both, so plain decoding looked
        # dearer than drafting (seen in a chat sequence at T = 1: 8.3 ms against 7.8 and 7.3)
        at = bisect_left(sizes, n)  # sizes[:at] < n < sizes[at:]
        if 0 < at < len(sizes):
            a, b = sizes[at - 1], sizes[at]
        elif len(sizes) >= 2:
            a, b = (sizes[0], sizes[1]) if at == 0 else (sizes[-2], sizes[-1])
        else:
            return eff[sizes[0]]
        t = eff[a] + (eff[b] - eff[a]) * (n - a) / (b - a)
        t = max(t, eff[sizes[at - 1]] if at > 0 else 0.5 * eff[sizes[0]])
        return min(t, eff[sizes[at]]) if at < len(sizes) else t

    def _target_cost(self, n: int) -> float:
        eff = self._effective()
        return self._interpolated(eff, sorted(eff), n)

    def _costs(self) -> list[float]:
        """The cost of a verification pass over 1 .. max_gamma + 1 positions (γ = 0 .. max)."""
        eff = self._effective()
        sizes = sorted(eff)
        return [self._interpolated(eff, sizes, k + 1) for k in range(self.max_gamma + 1)]

    def next_gamma(self) -> int:
        return self._gamma

    def _probe_due(self) -> bool:
        """Count one more round without drafting; True when it completes the interval, and the
        next round is then a probe."""
        self._since_draft += 1
        if self._since_draft < self._interval:
            return False
        self._since_draft = 0
        self._probing = True
        return True

    def successor(self) -> "CostGamma":
        """A controller for the next sequence of the same drafter and target.  Where this one ended
        backed off and its measured costs (a drafted token, the verification cost curve, the rest
        of a round: they belong to the drafter and the machine, not to the prompt) say drafting
        would lose even at an acceptance of :data:`~specdec.defaults.COST_GAMMA_CARRY_ACCEPT` at
        every position, the next one starts backed off too, at this one's probe interval, with
        those costs and this one's acceptance evidence at :data:`~specdec.defaults.COST_GAMMA_CARRY`
        of its weight: a drafter that does not pay is not re-tried from γ = 1 and probed from 8
        rounds on at every new prompt.  Any other drafter starts afresh: one that stopped paying on
        one prompt (chat) may pay on the next (code), and costs carried from sequence to sequence
        would never be re-measured at sizes the controller stops playing (seen: a carried
        controller held the default drafter at mean γ 1.8 against 2.6).  The test takes the
        cheapest drafted token measured, not the running estimate: probes after plain rounds read
        dearer (the draft catches up on what it missed), and a server's cheap default drafter,
        judged on them after a chat prompt, started the next request backed off."""
        nxt = CostGamma(max_gamma=self.max_gamma, start=self.start, decay=self.decay, probe_every=self.probe_every,
                        probe_gamma=self.probe_gamma, max_probe_every=self.max_probe_every,
                        prior_accept=self.prior_accept, prior_weight=self.prior_weight, outlier=self.outlier,
                        extra_target_s=self.extra_target_s)
        if self._draft_s is None or (self._gamma > 0 and not self._probing):  # nothing measured, or still drafting
            return nxt
        costs = self._costs()
        hoped = [defaults.COST_GAMMA_CARRY_ACCEPT ** (k + 1) for k in range(self.max_gamma)]
        assert self._draft_min is not None  # measured whenever _draft_s is
        if best_gamma(hoped, self._draft_min, costs, self._other_s)[0] > 0:  # it could pay on another prompt
            return nxt
        carry = defaults.COST_GAMMA_CARRY
        nxt._hits = [h * carry for h in self._hits]
        nxt._tries = [t * carry for t in self._tries]
        nxt._draft_s = self._draft_s
        nxt._draft_min = self._draft_min
        nxt._target_s = dict(self._target_s)
        nxt._other_s = self._other_s
        # backed off; a probe the last round scheduled (the sequence ended before it ran) is the
        # next sequence's first round, not read as "still drafting" and started afresh
        nxt._gamma = self._gamma if self._probing else 0
        nxt._probing = self._probing
        nxt._interval = max(self._interval, self.probe_every)
        nxt._since_draft = self._since_draft  # the probe schedule runs on across sequences: with a
        # fresh count, sequences shorter than the interval would never probe, and costs carried
        # from one bad reading would never be measured again
        return nxt

    def start_idle(self) -> None:
        """Begin backed off, with the longest probe interval: for a drafter known before any
        measurement to cost a whole target step per drafted token (a self-speculative view that
        runs every layer of the target), which :meth:`hopeless` would only learn by drafting."""
        self._gamma = 0
        self._interval = self.max_probe_every
        self._since_draft = 0

    def hopeless(self, step_s: float) -> bool:
        """Whether drafting cannot pay whatever the acceptance: even a draft that is always
        accepted is no faster than plain decoding at any γ, with a drafted token's cost the lower
        of the running estimate and ``step_s``, the round just measured (so one slow first call
        does not decide it), and the measured verification cost curve.  That holds whenever a
        drafted token costs a plain round (one-row pass + overhead), since a pass over more rows
        never costs less than a pass over one; and also for a token somewhat cheaper than that,
        when the extra rows of a pass cost the difference (seen: early exit after 24 of 30
        layers, a token at 0.95 of a plain round, probed every 8, 16, 32, 64 rounds before)."""
        if self._draft_s is None:
            return False
        costs = self._costs()
        choice, _ = best_gamma([1.0] * self.max_gamma, min(step_s, self._draft_s), costs, self._other_s)
        return choice == 0

    def observe_cost(self, n: int, target_s: float) -> None:
        """A verification pass over ``n`` positions took ``target_s`` (whatever drafted it)."""
        t = target_s + self.extra_target_s
        old = self._target_s.get(n)
        if old is None or t * self.outlier < old:
            # a first reading, or one far below the estimate: a pass is never much faster than it
            # is, so the estimate was a disturbed pass's (a first round stalled at 300 ms against
            # ~15 ms had set the two-row cost; each probe took off only 30 % of the excess while
            # probes thinned out to one in 128 rounds, and γ auto drafted one token a prompt for
            # seven prompts)
            self._target_s[n] = t
        else:
            self._target_s[n] = 0.7 * old + 0.3 * min(t, self.outlier * old)

    def update(self, *, gamma: int, accepted: int, draft_s: float, target_s: float, other_s: float) -> None:
        d = self.decay
        for k in range(gamma):  # position k+1 was reached iff accepted >= k
            if accepted < k:
                break
            self._tries[k] = self._tries[k] * d + 1.0
            self._hits[k] = self._hits[k] * d + (1.0 if accepted >= k + 1 else 0.0)
        step = None
        if gamma > 0:
            step = draft_s / gamma
            # a cheaper step is taken at once (a first call or a preempted round only ever reads
            # slower than the drafter is), a dearer one is smoothed in
            old = self._draft_s
            self._draft_s = step if old is None or step < old else 0.7 * old + 0.3 * step
            self._draft_min = step if self._draft_min is None else min(self._draft_min, step)
        self.observe_cost(gamma + 1, target_s)
        self._other_s = 0.7 * self._other_s + 0.3 * other_s
        if self._draft_s is None:  # nothing measured about drafting yet: keep the start value
            if self._gamma == 0 and self._probe_due():  # started idle (:meth:`start_idle`)
                self._gamma = self.probe_gamma
            return
        costs = self._costs()
        choice, self.last_rates = best_gamma(self.accept_profile(), self._draft_s, costs, self._other_s)
        if self._probing:  # the round just measured was a probe: did drafting win it back?
            if choice > 0:
                self._interval = self.probe_every
            elif step is not None and self.hopeless(step):
                self._interval = self.max_probe_every
            else:
                self._interval = min(2 * self._interval, self.max_probe_every)
            self._probing = False
        if choice > 0:
            self._since_draft = 0
        elif self._probe_due():
            # a cheap probe keeps the acceptance and draft-cost estimates alive; where drafting
            # keeps losing (a draft step as dear as a target step), probes thin out geometrically
            choice = self.probe_gamma
        # grow at most twofold per round: positions never tried are extrapolated, not measured
        tried = max((k + 1 for k in range(self.max_gamma) if self._tries[k] > 0), default=0)
        self._gamma = min(choice, max(2 * tried, 1))


class GammaMemory:
    """The γ auto controller of the last sequence per key (a verification rule's name; a server adds
    ``+constrained`` for constrained output): the next
    sequence gets its :meth:`CostGamma.successor`.  An engine keeps one for the sequences it
    decodes one after another; a server keeps one for all its requests, which run side by side,
    so a controller is kept only when its sequence has ended (never read while it still learns).
    Thread-safe."""

    def __init__(self) -> None:
        self._last: dict[str, CostGamma] = {}
        self._lock = threading.Lock()

    def next(self, key: str) -> CostGamma:
        """A controller for a new sequence: the successor of the last kept for ``key``, else a fresh one."""
        with self._lock:
            last = self._last.get(key)
        return last.successor() if last is not None else CostGamma()

    def keep(self, key: str, controller: CostGamma) -> None:
        with self._lock:
            self._last[key] = controller


@dataclass
class TreeBudget:
    """Node budget per round for token trees, falling back to a chain (or to no drafting).

    Each choice ("arm") is a tree of ``sizes[i]`` nodes, or the chain (arm 0), whose γ the cost
    controller :class:`CostGamma` picks (γ = 0 there is plain decoding).  The rate of every arm,
    tokens per second of a whole round, is a decayed ratio of measured tokens (accepted + 1) to
    measured seconds (draft + verification + overhead): it carries the verification cost curve
    (a tree of N nodes costs a target pass over N + 1 positions) and the acceptance the tree
    achieved.  Only the draft's shape changes with the arm, so every choice is lossless.

    The chain is the reference: it is played first (``warmup`` rounds), and a tree is played
    only while its rate beats the chain's by ``margin``.  Every ``interval`` rounds the
    controller probes one arm next to the best one (the smallest tree when the chain is best;
    the chain, the next larger and the next smaller tree in turn when a tree is best), so a
    larger tree is tried only after the smaller one has beaten the chain.  A probe that does not
    win doubles the interval (up to ``max_probe_every``), a winning one resets it: where trees do
    not pay, the probes' cost shrinks geometrically.
    """

    sizes: tuple[int, ...] = defaults.TREE_BUDGETS
    decay: float = defaults.COST_GAMMA_DECAY
    probe_every: int = defaults.TREE_PROBE_EVERY
    max_probe_every: int = defaults.TREE_PROBE_MAX
    margin: float = defaults.TREE_MARGIN
    warmup: int = defaults.TREE_CHAIN_WARMUP
    #: a round's seconds count at most this many times the arm's mean round (decayed), so one
    #: round slowed down by another process does not sink the arm's rate for many rounds
    outlier: float = defaults.TREE_OUTLIER
    chain: CostGamma = field(default_factory=CostGamma)
    _tokens: dict[int, float] = field(default_factory=dict)  # arm -> decayed tokens (arm 0 = chain)
    _seconds: dict[int, float] = field(default_factory=dict)
    _weight: dict[int, float] = field(default_factory=dict)  # arm -> decayed number of rounds
    _played: dict[int, int] = field(default_factory=dict)  # arm -> rounds played
    _arm: int = 0
    _best: int = 0
    _probing: bool = False
    _interval: int = 0
    _since_probe: int = 0
    _probes: int = 0

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError("tree budgets must be positive")
        if self.margin < 1.0 or self.probe_every < 1 or self.max_probe_every < self.probe_every or self.outlier <= 1.0:
            raise ValueError("tree controller: margin >= 1, outlier > 1 and 1 <= probe_every <= max_probe_every")
        self._interval = self.probe_every

    @property
    def name(self) -> str:
        return "tree-auto"

    @property
    def arms(self) -> list[int]:
        return [0, *sorted(set(self.sizes))]

    @property
    def tree_round(self) -> bool:
        """Whether the next round drafts a tree (else a chain of ``next_gamma()`` tokens)."""
        return self._arm > 0

    def next_gamma(self) -> int:
        return self._arm if self._arm > 0 else self.chain.next_gamma()

    def rate(self, arm: int) -> float | None:
        s = self._seconds.get(arm)
        return self._tokens[arm] / s if s else None

    def best_arm(self) -> int:
        """The chain unless a measured tree beats its rate by ``margin``; then the fastest tree."""
        chain = self.rate(0) or 0.0
        trees = [(r, a) for a in self.arms[1:] if (r := self.rate(a)) is not None and r > self.margin * chain]
        return max(trees)[1] if trees else 0

    def _probe_target(self) -> int:
        arms, best = self.arms, self._best
        if best == 0:
            return arms[1]
        i = arms.index(best)
        near = [0] + [arms[j] for j in (i + 1, i - 1) if 0 < j < len(arms)]
        return near[self._probes % len(near)]

    def update(self, *, gamma: int, accepted: int, draft_s: float, target_s: float, other_s: float) -> None:
        arm = self._arm
        if arm == 0:
            self.chain.update(gamma=gamma, accepted=accepted, draft_s=draft_s, target_s=target_s, other_s=other_s)
        d = self.decay
        seconds = draft_s + target_s + other_s
        if self._played.get(arm, 0) >= 2:  # a preempted round must not sink an arm for many rounds
            seconds = min(seconds, self.outlier * self._seconds[arm] / self._weight[arm])
        self._tokens[arm] = self._tokens.get(arm, 0.0) * d + accepted + 1
        self._seconds[arm] = self._seconds.get(arm, 0.0) * d + seconds
        self._weight[arm] = self._weight.get(arm, 0.0) * d + 1.0
        self._played[arm] = self._played.get(arm, 0) + 1
        best = self.best_arm()
        if self._probing:  # the probed arm has one more measurement: did it win?
            self._probing = False
            self._probes += 1
            won = best == arm and arm != self._best
            self._interval = self.probe_every if won else min(2 * self._interval, self.max_probe_every)
        self._best = best
        self._since_probe += 1
        if self._played.get(0, 0) >= self.warmup and self._since_probe >= self._interval:
            self._since_probe = 0
            self._probing = True
            self._arm = self._probe_target()
        else:
            self._arm = best
