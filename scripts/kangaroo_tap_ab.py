#!/usr/bin/env python
"""Kangaroo with and without the feature tap, paired in one process.

    python scripts/kangaroo_tap_ab.py --temperatures 0,1 --repeats 2 --out benchmarks/NAME

Not a test and not part of CI.  One target is loaded once, with two Kangaroo drafters over it:
``tap`` (the default: the verifier hands the drafter the residual stream after the target's first
K layers at every committed position, so the view copies the prompt's and plain rounds' shallow
keys/values from the target's cache and computes only its adapter's) and ``own`` (the same
drafter with the tap off: it prefills its K layers over the prompt and re-runs them over every
token committed while it was not drafting, as before the tap).  For each prompt, temperature
and repeat, plain decoding and both arms run once, in an order rotated per prompt and reversed
on odd repeats (γ auto; greedy verification at T = 0, block verification above it, one seed per
prompt and repeat shared by every arm).  Writes ``results.json`` and ``README.md``: geometric
means of the per-run speed-ups over the prompt's plain run by category, time to first token,
tokens per target call, drafted tokens per sequence and, at T = 0, whether every output equals
plain greedy output.
"""

from __future__ import annotations

import sys

import paired

ARMS = ("tap", "own")


def main() -> int:
    args, temps, prompts, plain, engines = paired.drafter_arms(__doc__, "kangaroo", ARMS)
    if engines["tap"].drafter.feature_taps is None:  # type: ignore[union-attr]
        raise SystemExit(f"{args.draft} declares no feature tap here (not a Kangaroo drafter over a batch-invariant target)")
    engines["own"].drafter.feature_taps = None  # type: ignore[union-attr]

    rows = paired.drafter_rows(plain, engines, prompts, temps, args.repeats, args.max_new_tokens)

    lines = [f"{len(prompts)} prompts × {args.repeats} repeats, {args.max_new_tokens} tokens, {args.draft} over one "
             f"{args.target} target (dtype {args.dtype}) with the feature tap (`tap`) and without it (`own`: the view "
             "prefills and catches up with its own layers), every arm on every prompt right after or before the "
             "prompt's plain run, in one process. ×plain = geometric mean of the per-run ratios; TTFT = median time to "
             "first token; draft ms = the draft's time per drafted token (its catch-ups included).", ""]
    lines += paired.arm_table(rows, temps, ["plain", *ARMS], extra=paired.DRAFTER_COLUMNS)
    paired.write_report(args.out, f"Kangaroo with and without the feature tap ({args.target} + {args.draft})",
                        {"rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
