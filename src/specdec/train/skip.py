"""Offline search of a layer-skipping draft (Zhang et al. 2024, *Draft & Verify*, §3.2).

Draft & Verify picks which attention / MLP sub-layers the draft skips by Bayesian optimisation on
calibration prompts.  This is a simpler, cheaper search with the same objective:

1. **Calibration data**: each calibration prompt plus the target's own greedy continuation.
2. **Acceptance, timing-free**: a candidate plan is scored teacher-forced over those sequences,
   each row over the target's keys and values at earlier positions and its own at its position,
   as the view drafts (its cache holds the target's at committed positions), in one pass.  At temperature 0 a chain draft's
   token at a position is accepted exactly when the draft's arg-max equals the target's there
   (given the previous tokens were accepted, the draft sees the true context), so the agreement
   rate is the first position's acceptance α₀.  At temperature 1 the probability that token verification accepts a draft
   token is ``Σ_v min(p(v), q(v))``; its mean is α₁.
3. **Cost, measured once**: the time of one decoding step through the whole target, and the
   share of it spent in attention and MLP sub-layers (the layers of these models are identical),
   give the draft's cost ratio ``c(plan)``; verifying γ+1 positions costs ``v(γ)`` steps.
4. **Objective**: the expected speed-up of Leviathan et al. 2023 (Thm 3.8 with a measured
   verification cost), ``max_γ (1 − α^{γ+1}) / ((1 − α)(γ c + v(γ)))``, averaged over T = 0 and
   T = 1.
5. **Greedy search**: every sub-layer is scored alone (how much skipping it costs in
   acceptance) — or, much cheaper, ranked by its block influence in one pass (Men et al. 2024,
   *ShortGPT*) — then skipped in that order, one more at a time (a growing prefix: the
   objective often dips before it rises, since each skip alone saves little), keeping the best
   prefix and stopping ``patience`` additions after it; a final pass tries un-skipping each
   sub-layer of the best one.
6. **Local search** (``polish`` passes, optionally from a given set): each pass toggles every
   sub-layer in turn (skip it, or run it again) and keeps a toggle whenever the objective rises,
   until a pass changes nothing.  The growing prefix of step 5 stops at the first long dip, which
   a set searched under other scores (another dtype, another LM head) may sit beyond.

Everything but the one-off cost measurement is deterministic, so a search is reproducible.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from specdec.bench.theory import best_chain_speedup
from specdec.drafters.self_spec import LayerPlan, LayerView, param_shares

#: calibration prompts (deliberately not the benchmark's prompts): code and chat, alternating
CALIBRATION: tuple[tuple[str, bool], ...] = (
    ('def fibonacci(n):\n    """Return the n-th Fibonacci number, iteratively."""\n', False),
    ("What is the difference between a list and a tuple in Python?", True),
    ("import json\n\n\ndef load_config(path, defaults=None):\n    \"\"\"Read a JSON config file and merge it over `defaults`.\"\"\"\n", False),
    ("Write a haiku about autumn rain.", True),
    ("class Stack:\n    \"\"\"A last-in first-out stack backed by a list.\"\"\"\n\n    def __init__(self):\n", False),
    ("Describe three ways to reduce food waste at home.", True),
    ("def is_palindrome(text):\n    \"\"\"True if `text` reads the same backwards, ignoring case and spaces.\"\"\"\n", False),
    ("Why is the sky blue? Answer briefly.", True),
)

#: verification costs, in target decoding steps, for γ = 1..MAX (a straight line through the
#: measured v(4); recomputed when the search measures)
MAX_GAMMA = 8


@dataclass(frozen=True)
class CostModel:
    """Per-step costs relative to one target decoding step (fractions, not seconds)."""

    attn: float  # one attention sub-layer
    mlp: float  # one MLP sub-layer
    fixed: float  # embedding + final norm + LM head + per-step overhead
    verify_slope: float = 0.12  # v(γ) = 1 + slope · γ

    def draft_cost(self, plan: LayerPlan) -> float:
        steps = plan.steps
        return self.fixed + sum(self.attn * a + self.mlp * m for _, a, m in steps)

    def to_json(self) -> dict[str, float]:
        return {"attn": self.attn, "mlp": self.mlp, "fixed": self.fixed, "verify_slope": self.verify_slope}

    @classmethod
    def from_params(cls, cfg: Any, *, verify_slope: float = 0.12, head_share: float = 1.0) -> "CostModel":
        """Timing-free costs: each part's share of the weights a decoding step reads (decoding a
        small model on a CPU is memory-bound), for a machine too busy to time (``--cost params``);
        ``head_share``: the share of the LM head's rows the draft computes (a reduced vocabulary's)."""
        attn, mlp, head = param_shares(cfg, head_share=head_share)
        return cls(attn=attn, mlp=mlp, fixed=head, verify_slope=verify_slope)


def expected_speedup(alpha: float, c: float, cost: CostModel, *, floor: bool = True) -> tuple[float, int]:
    """``max_γ E[tokens per round] / (γ c + v(γ))`` and its γ (i.i.d. acceptance α).

    ``floor``: γ = 0 (no drafting, ×1) is a choice too.  Without it the best γ >= 1 is returned
    even when it loses (< 1): the search climbs on that, since from a nearly full draft (cost
    close to a target step) every small change would otherwise score the same ×1."""
    return best_chain_speedup(alpha, c, verify_slope=cost.verify_slope, max_gamma=MAX_GAMMA, floor=floor)


@dataclass(frozen=True)
class Calibration:
    """Teacher-forcing data: sequences and the target's outputs at their continuation positions."""

    sequences: tuple[Tensor, ...]  # each [L] int64 (prompt + target continuation)
    starts: tuple[int, ...]  # first scored position (the last prompt token) per sequence
    target_argmax: tuple[Tensor, ...]  # each [L - start] int64
    target_probs: tuple[Tensor, ...]  # each [L - start, V] float32 at temperature 1
    #: the target's keys and values over each sequence, each [layers, Hkv, L, d]: a view drafts over them
    keys: tuple[Tensor, ...] = ()
    values: tuple[Tensor, ...] = ()


def build_calibration(target: Any, prompts: Sequence[Sequence[int]], *, new_tokens: int) -> Calibration:
    """Greedy-continue each prompt with the target and record its outputs along the way."""
    from specdec.decoder import SpeculativeDecoder
    from specdec.sampling import SamplingConfig
    from specdec.verify import get_rule

    plain = SpeculativeDecoder(target, None, get_rule("greedy"))
    seqs, starts, amax, probs, keys, values = [], [], [], [], [], []
    for ids in prompts:
        out = plain.generate(list(ids), SamplingConfig(temperature=0.0, max_new_tokens=new_tokens)).tokens
        seq = torch.tensor(list(ids) + out, dtype=torch.long)  # [L]
        cache = target.new_cache(seq.numel())
        logits = target.forward(seq, cache)[len(ids) - 1 : -1]  # [n, V]
        seqs.append(seq)
        starts.append(len(ids) - 1)
        amax.append(logits.argmax(-1))
        probs.append(torch.softmax(logits, -1))
        keys.append(cache.k[:, :, : seq.numel()].clone())  # [layers, Hkv, L, d]
        values.append(cache.v[:, :, : seq.numel()].clone())
    return Calibration(tuple(seqs), tuple(starts), tuple(amax), tuple(probs), tuple(keys), tuple(values))


def view_logits(target: Any, plan: LayerPlan, seq: Tensor, start: int, keys: Tensor, values: Tensor,
                reduced: Any = None) -> Tensor:
    """The draft's logits at positions ``start .. L-2`` of ``seq`` [L] as it drafts them: each row
    over the target's ``keys`` / ``values`` [layers, Hkv, L, d] at earlier positions (the view's
    cache holds the target's at committed positions: :meth:`SelfSpecDrafter.bind_target`) and
    its own at the row's position — all rows in one pass (``run_layers(as_drafted=True)``);
    ``reduced``: the head it drafts through (a reduced vocabulary's, -inf elsewhere), else the
    target's.  [L - 1 - start, V]."""
    n = seq.numel()
    cache = target.new_cache(n)
    cache.reserve(n)
    cache.k[:, :, :n] = keys
    cache.v[:, :, :n] = values
    with torch.inference_mode():
        x = target.run_layers(target.embed_tokens(seq[start : n - 1]), cache, plan.steps, start=start, as_drafted=True)
        return target.head(x) if reduced is None else reduced.logits(x)  # [n - 1 - start, V]


def acceptance(target: Any, plan: LayerPlan, data: Calibration, reduced: Any = None) -> tuple[float, float]:
    """(α₀, α₁) of the draft ``plan`` on ``data`` (see the module docstring), the view drafting
    over the target's keys and values as it does when generating (:func:`view_logits`)."""
    agree = overlap = 0.0
    count = 0
    for seq, start, amax, p, k, v in zip(data.sequences, data.starts, data.target_argmax, data.target_probs,
                                         data.keys, data.values):
        logits = view_logits(target, plan, seq, start, k, v, reduced)  # [n, V]
        agree += float((logits.argmax(-1) == amax).sum())
        overlap += float(torch.minimum(torch.softmax(logits, -1), p).sum())
        count += amax.numel()
    return agree / count, overlap / count


def measure_costs(target: Any, *, repeats: int = 30, context: int = 64, reduced: Any = None) -> CostModel:
    """Time one decoding step with every sub-layer, with no attention and with no MLP (median of
    ``repeats``), and a 5-position verification pass, all at a ``context``-token position;
    ``reduced``: the views draft through this head (a reduced vocabulary's), so their fixed cost
    is timed with it: a view running every sub-layer against the target's step."""
    n = target.cfg.n_layers
    context = max(1, min(context, target.max_length // 2))
    prefix = (torch.arange(context) % 1000 + 100) % target.vocab_size

    def step_time(plan: LayerPlan | None, width: int = 1) -> float:
        model = target if plan is None else LayerView(target, plan, reduced=reduced)
        cache = model.new_cache(context + 16)
        model.forward(prefix, cache)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.forward(prefix[:width], cache)
            times.append(time.perf_counter() - t0)
            cache.truncate(context)
        return sorted(times)[len(times) // 2]

    full = step_time(None)
    every = frozenset(range(n))
    whole = full if reduced is None else step_time(LayerPlan.skipping(n, set(), set()))  # through the draft's head
    no_attn = step_time(LayerPlan.skipping(n, every, set()))
    no_mlp = step_time(LayerPlan.skipping(n, set(), every))
    v4 = step_time(None, width=5)
    attn = max(whole - no_attn, 0.0) / full / n
    mlp = max(whole - no_mlp, 0.0) / full / n
    fixed = max(whole / full - n * (attn + mlp), 0.02)
    return CostModel(attn=attn, mlp=mlp, fixed=fixed, verify_slope=max((v4 / full - 1.0) / 4, 0.0))


@dataclass(frozen=True)
class SearchResult:
    plan: LayerPlan
    alpha0: float
    alpha1: float
    draft_cost: float
    speedup0: float
    speedup1: float
    gamma0: int
    gamma1: int
    evaluations: int
    cost: CostModel

    @property
    def objective(self) -> float:
        return 0.5 * (self.speedup0 + self.speedup1)

    def to_json(self) -> dict[str, Any]:
        return {
            "plan": self.plan.to_json(),
            "expected": {"alpha_t0": round(self.alpha0, 4), "alpha_t1": round(self.alpha1, 4),
                         "draft_cost": round(self.draft_cost, 4), "speedup_t0": round(self.speedup0, 3),
                         "speedup_t1": round(self.speedup1, 3), "gamma_t0": self.gamma0, "gamma_t1": self.gamma1},
            "cost_model": {k: round(v, 5) for k, v in self.cost.to_json().items()},
            "evaluations": self.evaluations,
        }


def score(target: Any, plan: LayerPlan, data: Calibration, cost: CostModel, evaluations: int = 0,
          reduced: Any = None) -> SearchResult:
    a0, a1 = acceptance(target, plan, data, reduced)
    c = cost.draft_cost(plan)
    s0, g0 = expected_speedup(a0, c, cost, floor=False)
    s1, g1 = expected_speedup(a1, c, cost, floor=False)
    return SearchResult(plan, a0, a1, c, s0, s1, g0, g1, evaluations, cost)


def influence(target: Any, data: Calibration) -> dict[str, float]:
    """Each sub-layer's *block influence* (Men et al. 2024, *ShortGPT*, §3.1), in one full pass:
    the mean over positions of ``1 − cos(x_in, x_out)`` between the residual stream entering and
    leaving it.  A cheap stand-in for scoring every sub-layer alone (``rank="influence"``)."""
    n = target.cfg.n_layers
    sums = {f"{kind}{i}": 0.0 for kind in ("attn", "mlp") for i in range(n)}
    count = 0
    with torch.inference_mode():
        for seq in data.sequences:
            cache = target.new_cache(seq.numel())
            cache.reserve(seq.numel())
            x = target.embed_tokens(seq)  # [L, D]
            for i in range(n):
                for kind, step in (("attn", (i, True, False)), ("mlp", (i, False, True))):
                    y = target.run_layers(x, cache, (step,), start=0)
                    sums[f"{kind}{i}"] += float((1.0 - torch.cosine_similarity(x, y, dim=-1)).sum())
                    x = y
            count += seq.numel()
    return {k: v / count for k, v in sums.items()}


def greedy_search(
    target: Any,
    data: Calibration,
    cost: CostModel,
    *,
    max_steps: int | None = None,
    patience: int = 8,
    progress: Callable[[str, SearchResult], None] | None = None,
    state: dict | None = None,
    rank: str = "alone",
    reduced: Any = None,
) -> SearchResult:
    """Importance-ordered greedy inclusion, then one removal pass (see the module docstring).
    ``reduced``: the head the view drafts through (a reduced vocabulary's), else the target's.

    ``rank="alone"`` orders sub-layers by the acceptance each costs when skipped alone (one
    evaluation each); ``rank="influence"`` by their block influence (:func:`influence`, one pass)
    per unit of draft cost that skipping them saves.
    ``state`` (a dict, e.g. loaded from a checkpoint) holds the per-sub-layer scores already
    computed and is updated in place, so an interrupted search resumes where it stopped.
    """
    n = target.cfg.n_layers
    state = state if state is not None else {}
    evaluations = 0
    base = score(target, LayerPlan.skipping(n, set(), set()), data, cost, 0, reduced)
    candidates = [("attn", i) for i in range(n)] + [("mlp", i) for i in range(n)]
    if rank == "influence":
        if "influence" not in state:
            state["influence"] = influence(target, data)
        importance = state["influence"]
        share = {"attn": max(cost.attn, 1e-9), "mlp": max(cost.mlp, 1e-9)}  # influence per unit of cost saved
        order = sorted(candidates, key=lambda c: (importance[f"{c[0]}{c[1]}"] / share[c[0]], c[0], c[1]))
    elif rank == "alone":
        singles: dict[str, float] = state.setdefault("singles", {})
        for kind, i in candidates:  # 1. each sub-layer alone
            key = f"{kind}{i}"
            if key not in singles:
                plan = LayerPlan.skipping(n, {i} if kind == "attn" else set(), {i} if kind == "mlp" else set())
                res = score(target, plan, data, cost, evaluations + 1, reduced)
                singles[key] = 0.5 * (res.alpha0 + res.alpha1)
                evaluations += 1
                if progress:
                    progress(f"alone {key}", res)
        order = singles_order(state, n)
        assert order is not None
    else:
        raise ValueError(f"rank must be 'alone' or 'influence', got {rank!r}")
    best = base
    grow_attn: set[int] = set()
    grow_mlp: set[int] = set()
    misses = 0
    for step, (kind, i) in enumerate(order):  # 2. a growing prefix of that order; keep the best one
        if (max_steps is not None and step >= max_steps) or misses >= patience:
            break
        (grow_attn if kind == "attn" else grow_mlp).add(i)
        res = score(target, LayerPlan.skipping(n, grow_attn, grow_mlp), data, cost, evaluations, reduced)
        evaluations += 1
        if res.objective > best.objective:
            best, misses = res, 0
        else:
            misses += 1
        if progress:
            progress(f"add {kind}{i}", best)
    attn, mlp = set(best.plan.skip_attn), set(best.plan.skip_mlp)
    for kind, i in [("attn", i) for i in sorted(attn)] + [("mlp", i) for i in sorted(mlp)]:  # 3. removal pass
        if max_steps is not None:
            break
        trial_attn, trial_mlp = set(attn), set(mlp)
        (trial_attn if kind == "attn" else trial_mlp).discard(i)
        res = score(target, LayerPlan.skipping(n, trial_attn, trial_mlp), data, cost, evaluations, reduced)
        evaluations += 1
        if res.objective > best.objective:
            best, attn, mlp = res, trial_attn, trial_mlp
        if progress:
            progress(f"drop {kind}{i}", best)
    return SearchResult(best.plan, best.alpha0, best.alpha1, best.draft_cost, best.speedup0, best.speedup1,
                        best.gamma0, best.gamma1, evaluations, cost)


def singles_order(state: dict, n: int) -> list[tuple[str, int]] | None:
    """The sub-layers ``("attn" | "mlp", layer)`` from the most harmless skipped alone to the most
    harmful, where ``state`` holds every one's score (a ``rank="alone"`` search), else None."""
    singles = state.get("singles") or {}
    candidates = [("attn", i) for i in range(n)] + [("mlp", i) for i in range(n)]
    if any(f"{kind}{i}" not in singles for kind, i in candidates):
        return None
    return sorted(candidates, key=lambda c: (-singles[f"{c[0]}{c[1]}"], c[0], c[1]))


def local_search(
    target: Any,
    data: Calibration,
    cost: CostModel,
    start: LayerPlan,
    *,
    passes: int = 3,
    order: Sequence[tuple[str, int]] | None = None,
    progress: Callable[[str, SearchResult], None] | None = None,
    reduced: Any = None,
) -> SearchResult:
    """First-improvement hill climbing from ``start`` (step 6 of the module docstring): up to
    ``passes`` passes over the sub-layers (``order``: ``("attn" | "mlp", layer)`` pairs, default
    attention then MLP by layer), each toggled in turn and kept where the objective rises; stops
    after a pass that changes nothing."""
    n = target.cfg.n_layers
    order = list(order) if order is not None else [("attn", i) for i in range(n)] + [("mlp", i) for i in range(n)]
    best = score(target, start, data, cost, 1, reduced)
    evaluations = 1
    for _ in range(passes):
        changed = False
        for kind, i in order:
            attn, mlp = set(best.plan.skip_attn), set(best.plan.skip_mlp)
            group = attn if kind == "attn" else mlp
            group.symmetric_difference_update({i})
            evaluations += 1
            res = score(target, LayerPlan.skipping(n, attn, mlp), data, cost, evaluations, reduced)
            if res.objective > best.objective:
                best, changed = res, True
            if progress:
                progress(f"toggle {kind}{i}", best)
        if not changed:
            break
    return SearchResult(best.plan, best.alpha0, best.alpha1, best.draft_cost, best.speedup0, best.speedup1,
                        best.gamma0, best.gamma1, evaluations, cost)


def write_result(result: SearchResult, path: str | Path, *, target: str, prompts: int, new_tokens: int,
                 rank: str = "alone", cost_source: str = "measure", command: str | None = None,
                 draft_vocab: int | str = "full") -> None:
    obj = {"target": target, "method": "greedy skip-set search (Draft & Verify objective)",
           "calibration": {"prompts": prompts, "new_tokens": new_tokens}, "rank": rank, "cost_source": cost_source,
           "draft_vocab": draft_vocab,
           **({"command": command} if command else {}), **result.to_json()}
    Path(path).write_text(json.dumps(obj, indent=1) + "\n")
