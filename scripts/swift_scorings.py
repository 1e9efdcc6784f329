#!/usr/bin/env python
"""SWIFT's skip-set scorings under their time budget, against SWIFT without one and plain decoding.

    python scripts/swift_scorings.py --target qwen2.5-coder-1.5b --max-new-tokens 512 --limit 2 --out benchmarks/NAME

Not a test and not part of CI.  Three arms on the same loaded target, every prompt decoded by each
in turn (the order rotated from prompt to prompt): plain decoding, ``swift`` with its default
scoring budget (``--budget``, a share of the decoding time its drafter has seen) and ``swift``
with none.  Each SWIFT drafter lives through all the prompts, as in a long-lived engine, and
after every prompt the report gives its scorings and switches so far and the time they took
against the decoding time it has seen.  Writes ``README.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import time

import paired

from specdec import defaults
from specdec.engine import Engine, EngineConfig
from specdec.sampling import SamplingConfig


def main() -> int:
    ap = paired.parser(__doc__)
    ap.set_defaults(draft="swift", temperatures="0")
    ap.add_argument("--budget", type=float, default=defaults.SWIFT_SCORING_BUDGET,
                    help=f"the budgeted arm's share (default {defaults.SWIFT_SCORING_BUDGET})")
    args = ap.parse_args()
    temps, prompts, plain, _ = paired.setup(argparse.Namespace(**{**vars(args), "draft": "none"}))
    cfg = EngineConfig(target=args.target, draft=args.draft, dtype=args.dtype)
    arms: dict[str, Engine] = {"plain": plain, "budget": Engine.attach(plain.target, cfg),
                               "none": Engine.attach(plain.target, cfg)}
    arms["budget"].drafter.budget = args.budget
    arms["none"].drafter.budget = None
    rows, names = [], list(arms)
    for i, (temperature, prompt) in enumerate((t, p) for t in temps for p in prompts):
        order = names[i % len(names):] + names[: i % len(names)]
        for name in order:
            sampling = SamplingConfig(temperature=temperature, max_new_tokens=args.max_new_tokens, seed=i)
            start = time.perf_counter()
            out = arms[name].generate(prompt.text, sampling, chat=prompt.chat)
            wall = time.perf_counter() - start
            d = arms[name].drafter
            rows.append({"prompt": prompt.id, "temperature": temperature, "arm": name, "tokens": len(out.token_ids),
                         "wall_s": wall, "scorings": getattr(d, "scorings", 0), "switches": getattr(d, "switches", 0),
                         "scoring_s": getattr(d, "scoring_s", 0.0), "seen_s": getattr(d, "seen_s", 0.0)})
            print(rows[-1], flush=True)
    lines = [f"Target `{args.target}`, `{args.draft}` with a scoring budget of {args.budget} of the decoding time seen "
             f"(`budget`) and with none (`none`), plain decoding beside them; {len(prompts)} prompts × T {args.temperatures}, "
             f"{args.max_new_tokens} tokens, each drafter kept from prompt to prompt. Cumulative columns are the "
             "drafter's totals after that prompt.", "",
             "| prompt | T | arm | tokens | tok/s | ×plain | scorings | switches | scoring s | seen s | share |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    base = {(r["prompt"], r["temperature"]): r["tokens"] / r["wall_s"] for r in rows if r["arm"] == "plain"}
    for r in rows:
        speed = r["tokens"] / r["wall_s"]
        share = r["scoring_s"] / r["seen_s"] if r["seen_s"] else 0.0
        lines.append(f"| {r['prompt']} | {r['temperature']:g} | {r['arm']} | {r['tokens']} | {speed:.1f} | "
                     f"{speed / base[(r['prompt'], r['temperature'])]:.2f} | {r['scorings']} | {r['switches']} | "
                     f"{r['scoring_s']:.2f} | {r['seen_s']:.1f} | {share:.3f} |")
    total = {a: sum(r["tokens"] for r in rows if r["arm"] == a) / sum(r["wall_s"] for r in rows if r["arm"] == a) for a in names}
    lines += ["", "All prompts: " + ", ".join(f"{a} {v:.1f} tok/s (×{v / total['plain']:.2f})" for a, v in total.items()) + "."]
    paired.write_report(args.out, "SWIFT's scorings under a time budget", {"rows": rows}, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
