#!/usr/bin/env python
"""Where the time of speculative decoding goes on this machine, and the ceiling it implies.

    python scripts/profile_costs.py --out benchmarks/profile-smollm2

Not a test and not part of CI.  Three parts, written as ``README.md`` + ``profile.json``:

1. **Cost curves** — the target's forward pass over n = 1..13 new tokens after a 256-token
   context (what one verification pass of γ = n - 1 costs), and one draft step split into its
   transformer layers, LM head and sampling.  Medians of repeated calls.
2. **Instrumented generation** — speculative decoding of built-in prompts with the timers
   wrapped around the target forward, the draft forward, the draft sampler and the verification
   call; the rest of the wall time is the loop's own bookkeeping (the engine's overhead).
3. **Ceiling** — from the run's measured per-position acceptance P(accepted ≥ k) and the cost
   curves: the best speed-up over plain decoding any γ could give with zero overhead, and the
   same with a free drafter (draft cost 0) — the bound no engine work can pass with this pair.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec.bench.runner import machine_info
from specdec.bench.report import machine_line
from specdec.bench.workloads import BUILTIN, select
from specdec.drafters.base import DraftSampler
from specdec.engine import Engine, EngineConfig
from specdec.sampling import SamplingConfig


def median_ms(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def target_curve(model, reps: int) -> dict[int, float]:
    """Median ms of a forward pass over n = 1..13 new tokens after a 256-token context.

    The n values are interleaved within each repetition, so slow drift of a shared machine
    affects all of them alike instead of bending the curve."""
    ctx = torch.randint(0, model.vocab_size, (256,))
    cache = model.new_cache()
    model.forward(ctx, cache, last_only=True)
    base = cache.length
    sizes = range(1, 14)
    blocks = {n: torch.randint(0, model.vocab_size, (n,)) for n in sizes}
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(reps + 2):
        for n in sizes:
            cache.truncate(base)
            t = time.perf_counter()
            model.forward(blocks[n], cache)
            if rep >= 2:  # two warm-up rounds
                times[n].append(time.perf_counter() - t)
    return {n: statistics.median(v) * 1e3 for n, v in times.items()}


def cost_curves(engine: Engine, reps: int, fast_target=None) -> dict:
    target = engine.target.model
    out = {"target_forward_ms": target_curve(target, reps)}
    if fast_target is not None:
        out["target_forward_fast_attention_ms"] = target_curve(fast_target, reps)
    ctx = torch.randint(0, target.vocab_size, (256,))
    drafter = getattr(engine.drafter, "model", None)
    if drafter is not None:
        dcache = drafter.new_cache()
        drafter.forward(ctx, dcache, last_only=True)
        dbase = dcache.length
        one = torch.tensor([5])

        def step():
            dcache.truncate(dbase)
            return drafter.forward(one, dcache)

        out["draft_step_ms"] = median_ms(step, reps * 4)
        if hasattr(drafter, "hidden"):
            def hidden():
                dcache.truncate(dbase)
                return drafter.hidden(one, dcache)

            out["draft_layers_ms"] = median_ms(hidden, reps * 4)
            h = hidden()
            out["draft_head_ms"] = median_ms(lambda: drafter.lm_head(h).float(), reps * 4)
        logits = step()
        for name, cfg in (("T=0", SamplingConfig(temperature=0.0)), ("T=1", SamplingConfig(temperature=1.0))):
            sampler = DraftSampler(cfg, "multinomial", penalties=None, generator=torch.Generator().manual_seed(0))
            out[f"draft_sample_ms {name}"] = median_ms(lambda s=sampler: s(logits, 300), reps * 4)
    return out


class Timer:
    """Wraps a callable attribute and sums its wall time."""

    def __init__(self, obj, attr: str):
        self.total = 0.0
        self.calls = 0
        self.obj, self.attr = obj, attr
        self.orig = getattr(obj, attr)

        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return self.orig(*a, **k)
            finally:
                self.total += time.perf_counter() - t
                self.calls += 1

        setattr(obj, attr, wrapped)

    def restore(self) -> None:
        setattr(self.obj, self.attr, self.orig)


def instrumented(engine: Engine, prompts, temperature: float, gamma: int, max_new: int) -> dict:
    """Generate every prompt with timers around each stage; returns shares and acceptance."""
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=max_new, seed=0)
    target_fwd = Timer(engine.target.model, "forward")
    draft_fwd = Timer(engine.drafter.model, "forward")
    sampler = Timer(DraftSampler, "__call__")
    import specdec.session as session_mod
    verify = Timer(session_mod.TargetSession, "verify")
    target_prefill = Timer(session_mod.TargetSession, "__init__")  # the prompt's forward pass
    draft_prefill = Timer(type(engine.drafter), "prepare")
    wall = 0.0
    tokens = calls = 0
    reach: list[int] = []  # reach[k-1]: rounds with accepted >= k
    drafted: list[int] = []  # drafted[k-1]: rounds that drafted >= k tokens
    per_prompt: list[list[float]] = []  # each prompt's own P(accepted >= k)
    try:
        for p in prompts:
            t = time.perf_counter()
            # token verification at T > 0: its per-position acceptance does not depend on γ, so
            # the prefix sums below are exact for every shorter γ (block verification's would not
            # be); no confidence cut-off, so every round drafts γ tokens
            res = engine.generate(p.text, sampling, gamma=gamma, chat=p.chat,
                                  method="greedy" if temperature == 0 else "token", min_confidence=0.0)
            wall += time.perf_counter() - t
            tokens += res.result.stats.generated_tokens
            calls += res.result.stats.target_calls
            rounds = [r for r in res.result.rounds if r.gamma > 0]
            own = []
            for k in range(1, gamma + 1):
                tried = [r for r in rounds if r.gamma >= k]
                own.append(sum(r.accepted >= k for r in tried) / len(tried) if tried else 0.0)
            per_prompt.append(own)
            for r in res.result.rounds:
                for k in range(1, r.gamma + 1):
                    while len(drafted) < k:
                        drafted.append(0)
                        reach.append(0)
                    drafted[k - 1] += 1
                    reach[k - 1] += r.accepted >= k
    finally:
        for timer in (target_fwd, draft_fwd, sampler, verify, target_prefill, draft_prefill):
            timer.restore()
    # nesting: verify ⊃ target forward (verification); session init ⊃ target forward (prefill);
    # drafter.prepare ⊃ draft forward (prefill); the drafter's propose ⊃ draft forward + sampler
    prefill = target_prefill.total + draft_prefill.total
    target_verify_fwd = target_fwd.total - target_prefill.total
    draft_round_fwd = draft_fwd.total - draft_prefill.total
    verify_rule = verify.total - target_verify_fwd
    other = wall - verify.total - draft_round_fwd - sampler.total - prefill
    return {
        "prompts": [p.id for p in prompts], "temperature": temperature, "gamma": gamma,
        "wall_s": wall, "generated_tokens": tokens, "target_calls": calls,
        "tokens_per_call": tokens / max(calls, 1),
        "share": {
            "prefill (target + draft)": prefill / wall,
            "target forward": target_verify_fwd / wall,
            "draft forward": draft_round_fwd / wall,
            "draft sampling": sampler.total / wall,
            "verification rule + processing": verify_rule / wall,
            "loop bookkeeping (other)": other / wall,
        },
        "accept_at_least": [r / d for r, d in zip(reach, drafted)],
        "accept_at_least_per_prompt": per_prompt,
    }


def ceiling(accept_at_least: list[float], curves: dict, temperature: float, max_gamma: int = 12) -> dict:
    """Best zero-overhead speed-up over plain decoding, with the real draft cost and with a free one."""
    t1 = curves["target_forward_ms"][1]
    d = curves.get("draft_step_ms", 0.0) + curves.get(f"draft_sample_ms T={0 if temperature == 0 else 1}", 0.0)
    rows = []
    for g in range(1, min(max_gamma, len(accept_at_least), 12) + 1):
        e = 1.0 + sum(accept_at_least[:g])  # E[tokens per round] with a fixed γ = g (P(acc ≥ k), k ≤ g)
        verify_ms = curves["target_forward_ms"][g + 1]
        rows.append({
            "gamma": g, "tokens_per_round": e, "verify_ms": verify_ms,
            "speedup_ideal": e * t1 / (g * d + verify_ms),
            "speedup_free_draft": e * t1 / verify_ms,
        })
    return {
        "rows": rows,
        "best_ideal": max(rows, key=lambda r: r["speedup_ideal"]) if rows else None,
        "best_free_draft": max(rows, key=lambda r: r["speedup_free_draft"]) if rows else None,
    }


def write_markdown(result: dict, out: Path, command: str) -> None:
    c = result["curves"]
    lines = [
        "# Where the time goes: SmolLM2-135M target + draft",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine_line(result['machine'])}; {result['threads']} torch threads.",
        "",
        "## Cost curves (median ms)",
        "",
        "Target forward over n new tokens after a 256-token context (n = γ + 1 for a verification pass):",
        "",
        "| n | " + " | ".join(str(n) for n in c["target_forward_ms"]) + " |",
        "|---|" + "---|" * len(c["target_forward_ms"]),
        "| batch-invariant (default) ms | " + " | ".join(f"{v:.1f}" for v in c["target_forward_ms"].values()) + " |",
        "| ×(n=1) | " + " | ".join(f"{v / c['target_forward_ms'][1]:.2f}" for v in c["target_forward_ms"].values()) + " |",
    ]
    fast = c.get("target_forward_fast_attention_ms")
    if fast:
        lines += [
            "| `--fast-attention` ms | " + " | ".join(f"{v:.1f}" for v in fast.values()) + " |",
            "| ×(n=1) | " + " | ".join(f"{v / fast[1]:.2f}" for v in fast.values()) + " |",
        ]
    lines += [
        "",
        "One draft step: " + ", ".join(
            f"{k.replace('_ms', '').replace('_', ' ')} {v:.2f} ms" for k, v in c.items() if not k.startswith("target_forward")
        ) + ".",
        "",
        "## Instrumented generation (share of decoding wall time)",
        "",
        "| T | category | γ | prompts | tokens/call | prefill | target forward (verify) | draft forward | draft sampling | rule + processing | loop (other) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        s = run["share"]
        lines.append(
            f"| {run['temperature']:g} | {run['category']} | {run['gamma']} | {len(run['prompts'])} | {run['tokens_per_call']:.2f} | "
            + " | ".join(f"{100 * s[k]:.1f}%" for k in (
                "prefill (target + draft)", "target forward", "draft forward", "draft sampling", "verification rule + processing",
                "loop bookkeeping (other)"))
            + " |"
        )
    lines += [
        "",
        "## Ceiling from this run's acceptance and these costs",
        "",
        "The instrumented runs use greedy verification at T = 0 and token verification at T = 1 (whose "
        "per-position acceptance does not depend on γ), fixed γ, no confidence cut-off. Block "
        "verification adds up to ~10% more tokens per call at T = 1 (benchmarks/smollm2-block-vs-token).",
        "",
        "E[tokens/round] = 1 + Σ_{k≤γ} P(accepted ≥ k) (measured per position at the γ of the run); "
        "ideal = E · t(n=1) / (γ · draft step + t(n=γ+1)), no overhead at all; free draft = the same with "
        "draft step 0, a bound that no engine work on the drafter or the loop can pass.",
        "",
        "| T | category | γ of run | P(acc ≥ k), k = 1.. | best γ | ideal × | best γ (free draft) | free-draft × |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        ce = run["ceiling"]
        if not ce["rows"]:
            continue
        bi, bf = ce["best_ideal"], ce["best_free_draft"]
        lines.append(
            f"| {run['temperature']:g} | {run['category']} | {run['gamma']} | "
            + " ".join(f"{a:.2f}" for a in run["accept_at_least"])
            + f" | {bi['gamma']} | {bi['speedup_ideal']:.2f} | {bf['gamma']} | {bf['speedup_free_draft']:.2f} |"
        )
    lines += [
        "",
        "Each prompt with its own best fixed γ and its own acceptance profile (the bench reports medians "
        "of per-prompt ratios, so these medians are what its per-category medians compare with; a γ "
        "that also changes from round to round within a prompt can do somewhat better still):",
        "",
        "| T | category | per-prompt ideal × (best γ) | median ideal × | per-prompt free-draft × | median free-draft × |",
        "|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        best = run.get("per_prompt_best") or []
        if not best:
            continue
        lines.append(
            f"| {run['temperature']:g} | {run['category']} | "
            + ", ".join(f"{b['ideal']:.2f} ({b['gamma']})" for b in best)
            + f" | {statistics.median(b['ideal'] for b in best):.2f} | "
            + ", ".join(f"{b['free_draft']:.2f}" for b in best)
            + f" | {statistics.median(b['free_draft'] for b in best):.2f} |"
        )
    (out / "README.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder (README.md, profile.json)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--limit", type=int, default=4, help="built-in prompts per category (default 4)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=12, help="fixed γ of the instrumented runs (long, to measure deep positions)")
    ap.add_argument("--reps", type=int, default=30, help="repetitions per cost point")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("[profile] loading models", file=sys.stderr)
    # the draft model alone (the default drafter puts prompt lookup in front of it, whose free
    # rounds would blur the model's per-position acceptance and cost)
    from specdec.drafters.hybrid import split_lookup

    cfg = EngineConfig(draft=split_lookup(EngineConfig().draft)[0])
    engine = Engine.build(cfg)
    print("[profile] cost curves", file=sys.stderr)
    from specdec.engine import target_dtype
    from specdec.models.registry import load

    dtype, quant = target_dtype(cfg)  # the same weights as the target, without batch invariance
    fast = load(cfg.target, dtype=dtype, quant=quant, batch_invariant=False).model if engine.target.backend == "native" else None
    curves = cost_curves(engine, args.reps, fast)
    del fast
    runs = []
    for temperature in (0.0, 1.0):
        for category in ("code", "chat"):
            prompts = select(BUILTIN, categories=[category], limit=args.limit)
            print(f"[profile] T={temperature:g} {category}: {len(prompts)} prompts, γ={args.gamma}", file=sys.stderr)
            run = instrumented(engine, prompts, temperature, args.gamma, args.max_new_tokens)
            run["category"] = category
            run["ceiling"] = ceiling(run["accept_at_least"], curves, temperature)
            # each prompt with its own best γ (what a per-prompt adaptive γ could at most reach)
            own = [ceiling(a, curves, temperature) for a in run["accept_at_least_per_prompt"]]
            run["per_prompt_best"] = [
                {"ideal": c["best_ideal"]["speedup_ideal"], "gamma": c["best_ideal"]["gamma"],
                 "free_draft": c["best_free_draft"]["speedup_free_draft"]}
                for c in own if c["rows"]
            ]
            runs.append(run)
    result = {"machine": machine_info(), "threads": torch.get_num_threads(), "curves": curves, "runs": runs}
    (out / "profile.json").write_text(json.dumps(result, indent=1))
    command = "python scripts/profile_costs.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    write_markdown(result, out, command)
    print(f"[profile] wrote {out / 'README.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
