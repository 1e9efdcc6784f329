#!/usr/bin/env python
"""Draft-model precisions paired in one process: speed, acceptance and draft cost per dtype.

    python scripts/draft_dtype_ab.py --dtypes w8a8,q4 --temperatures 0,1 --out benchmarks/NAME

Not a test and not part of CI.  One target is loaded once; for each ``--dtypes`` entry (as
``specdec generate --draft-dtype``) the draft model is loaded in that precision over it.  For each
prompt, temperature and repeat, plain decoding and every dtype run once, in an order rotated per
prompt and reversed on odd repeats; each run's speed-up is over the plain run of the same prompt,
temperature and repeat (greedy verification at T = 0, block verification above it, one seed per
prompt and repeat shared by every arm).  Writes ``results.json`` and ``README.md``: geometric
means of the per-run ratios by category, tokens per target call, first-position acceptance, the
draft's time per drafted token and, at T = 0, whether every output equals plain greedy output.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace

import paired

from specdec.engine import Engine, EngineConfig, draft_precision


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--dtypes", default="w8a8,q4", help="draft dtypes to compare (comma list)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    temps, prompts, _, plain = paired.setup(argparse.Namespace(**{**vars(args), "draft": "none"}))
    base = EngineConfig(target=args.target, draft=args.draft, dtype=args.dtype)
    dtypes = args.dtypes.split(",")
    engines = {dt: Engine.attach(plain.target, replace(base, draft_dtype=dt)) for dt in dtypes}
    precision = {dt: draft_precision(replace(base, draft_dtype=dt)) for dt in dtypes}

    rows = []
    for p, temp, rep, res in paired.rotated_runs({"plain": plain, **engines}, prompts, temps, args.repeats,
                                                    args.max_new_tokens):
        ref = res["plain"]
        rows += [paired.run_row(p, temp, rep, res[a], ref, dtype=a) for a in dtypes]

    gmean = paired.gmean

    lines = [f"{len(prompts)} prompts × {args.repeats} repeats, {args.max_new_tokens} tokens, the draft {args.draft} in "
             f"each precision over one {args.target} target (dtype {args.dtype}), every arm on every prompt right after "
             "or before the prompt's plain run, in one process. ×plain = geometric mean of the per-run ratios; "
             "draft ms = the draft's time per drafted token.", "",
             "| T | draft dtype (runs as) | ×plain (all) | chat | code | tokens/call | first-position acceptance "
             "| draft ms / token | greedy = plain |", "|---|---|---|---|---|---|---|---|---|"]
    for temp in temps:
        for a in dtypes:
            rs = [r for r in rows if r["dtype"] == a and r["temperature"] == temp]
            by = {c: gmean([r["speedup"] for r in rs if r["category"] == c]) for c in ("chat", "code")}
            acc = [r["first_acceptance"] for r in rs if r["first_acceptance"] is not None]
            same = f"{sum(r['same'] for r in rs)}/{len(rs)}" if temp == 0 else "n/a (T > 0)"
            lines.append(f"| {temp:g} | {a} ({precision[a]}) | {gmean([r['speedup'] for r in rs]):.3f} | {by['chat']:.3f} "
                         f"| {by['code']:.3f} | {statistics.mean(r['tokens_per_call'] for r in rs):.2f} "
                         f"| {statistics.mean(acc):.3f} | {statistics.median(r['draft_ms_per_token'] for r in rs):.3f} | {same} |")
    paired.write_report(args.out, f"Draft precisions paired in one process ({args.target} + {args.draft})",
                        {"dtypes": dtypes, "precision": precision, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
