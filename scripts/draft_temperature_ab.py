#!/usr/bin/env python
"""Draft temperature factors paired in one process: acceptance and speed per factor.

    python scripts/draft_temperature_ab.py --factors 1,0.85 --temperatures 1 --repeats 2 --out benchmarks/NAME

Not a test and not part of CI.  The target and the draft model are loaded once; every factor is a
drafter over the same draft model that samples at factor x the temperature (as ``specdec generate
--draft-temperature-factor``).  For each prompt, temperature and repeat, plain decoding and every
factor run once, in an order rotated per prompt and reversed on odd repeats, one seed per prompt and
repeat shared by every arm; ``--method`` verifies above T = 0 (block, or coupled: the seeded
default).  Writes ``results.json`` and ``README.md``: geometric means of the per-run speed-ups over
the same prompt's plain run by category, tokens per target call and first-position acceptance, and
a timing-free figure with far less noise: the mean over positions of sum(min(p, q)) (a draft token's
acceptance under token verification) with each factor's q, teacher-forced on the plain runs' own
continuations.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import paired
import torch

from specdec.drafters.hybrid import split_lookup
from specdec.engine import Engine, EngineConfig, load_draft, model_drafter
from specdec.train.calibrate import calibrate


def main() -> int:
    ap = paired.parser(__doc__)
    ap.set_defaults(temperatures="1")
    ap.add_argument("--factors", default="1,0.85", help="draft temperature factors to compare (comma list)")
    ap.add_argument("--method", default="block", choices=["block", "token", "coupled"], help="the rule above T = 0")
    ap.add_argument("--gamma", default="auto", help="γ for every speculative arm (auto, or a fixed draft length)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    temps, prompts, _, plain = paired.setup(argparse.Namespace(**{**vars(args), "draft": "none"}))
    factors = args.factors.split(",")
    base = EngineConfig(target=args.target, draft=args.draft, dtype=args.dtype)
    draft = load_draft(base)  # one draft model shared by every arm
    lookup = split_lookup(args.draft)[1]
    engines = {}
    for f in factors:
        drafter, name = model_drafter(EngineConfig(draft=args.draft, draft_temperature_factor=f), draft, lookup=lookup)
        engines[f] = Engine(plain.target, drafter, name, draft)

    rows, overlaps = [], []
    for p, temp, rep, res in paired.rotated_runs({"plain": plain, **engines}, prompts, temps, args.repeats,
                                                    args.max_new_tokens, method=args.method,
                                                    gamma=int(args.gamma) if args.gamma.isdigit() else args.gamma):
        ref = res["plain"]
        if temp > 0:  # teacher-forced overlap on the target's own continuation, per factor
            ids = plain.encode(p.text, chat=p.chat)
            c = calibrate(plain.target.model, draft.model, [(torch.tensor(ids + ref.tokens), len(ids), 0)], [temp],
                          [float(f) for f in factors])
            overlaps.append({"prompt": p.id, "category": p.category, "temperature": temp, "repeat": rep,
                             "positions": c.positions[f"{temp:g}"], "mean_overlap": c.mean_overlap[f"{temp:g}"]})
        rows += [paired.run_row(p, temp, rep, res[f], ref, factor=f) for f in factors]

    gmean = paired.gmean
    lines = [f"{len(prompts)} prompts × {args.repeats} repeats, {args.max_new_tokens} tokens, {args.draft} over "
             f"{args.target} (dtype {args.dtype}), γ {args.gamma}, {args.method} verification above T = 0; every arm on every prompt "
             "right after or before the prompt's plain run, in one process. ×plain = geometric mean of the per-run "
             "ratios; tokens/call and first-position acceptance are means over runs.", "",
             "| T | factor | ×plain (all) | chat | code | tokens/call (all) | chat | code | first-position acceptance "
             "| overlap sum min(p, q) (all) | chat | code |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for temp in temps:
        for f in factors:
            rs = [r for r in rows if r["factor"] == f and r["temperature"] == temp]
            by = {c: [r for r in rs if r["category"] == c] for c in ("chat", "code")}
            acc = [r["first_acceptance"] for r in rs if r["first_acceptance"] is not None]
            tpc = {c: statistics.mean(r["tokens_per_call"] for r in v) for c, v in by.items()}
            fi = factors.index(f)

            def ov(cat: str | None) -> str:  # position-weighted mean overlap
                os_ = [o for o in overlaps if o["temperature"] == temp and cat in (None, o["category"])]
                n = sum(o["positions"] for o in os_)
                return f"{sum(o['mean_overlap'][fi] * o['positions'] for o in os_) / n:.4f}" if n else "–"

            lines.append(f"| {temp:g} | {f} | {gmean([r['speedup'] for r in rs]):.3f} "
                         f"| {gmean([r['speedup'] for r in by['chat']]):.3f} | {gmean([r['speedup'] for r in by['code']]):.3f} "
                         f"| {statistics.mean(r['tokens_per_call'] for r in rs):.3f} | {tpc['chat']:.3f} | {tpc['code']:.3f} "
                         f"| {statistics.mean(acc):.3f} | {ov(None)} | {ov('chat')} | {ov('code')} |")
    paired.write_report(args.out, f"Draft temperature factors paired in one process ({args.target} + {args.draft})",
                        {"factors": factors, "method": args.method, "rows": rows, "overlaps": overlaps}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
