#!/usr/bin/env python
"""A self-speculative view over the target's cache or over a cache of its own, paired in one process.

    python scripts/view_cache_ab.py --draft self-skip --temperatures 0,1 --repeats 2 --out benchmarks/NAME

Not a test and not part of CI.  One target is loaded once, with two drafters of the same kind
(``--draft``: ``self-skip``, ``swift``, ``layerskip:K``, ...) over it: ``borrowed`` (the default:
bound to the target's cache, the view takes the committed positions' keys and values of the
layers it runs from there) and ``own`` (the view's cache is its own: it prefills the prompt with
its own layers and catches up over every token committed while it was not drafting, as views with
a skip set did before; early exit is left bound in both arms, its keys being the target's bits
either way).  For each prompt, temperature and repeat, plain decoding and both arms run once, in
an order rotated per prompt and reversed on odd repeats (γ auto; greedy verification at T = 0,
block verification above it, one seed per prompt and repeat shared by every arm).  Writes
``results.json`` and ``README.md``: geometric means of the per-run speed-ups over the prompt's
plain run by category, time to first token, tokens per target call, drafted tokens per sequence,
the draft's time per drafted token and, at T = 0, whether every output equals plain greedy output.
"""

from __future__ import annotations

import sys

import paired

from specdec.drafters.self_spec import SelfSpecDrafter

ARMS = ("borrowed", "own")


def main() -> int:
    args, temps, prompts, plain, engines = paired.drafter_arms(__doc__, "self-skip", ARMS)
    own = engines["own"].drafter
    if not isinstance(own, SelfSpecDrafter):
        raise SystemExit(f"{args.draft} is not a self-speculative view (layerskip:K, self-skip, swift)")
    if not own.share:  # a view with a cache of its own: never bound to the target's
        own.bind_target = lambda model, cache: None  # type: ignore[method-assign]

    rows = paired.drafter_rows(plain, engines, prompts, temps, args.repeats, args.max_new_tokens)

    lines = [f"{len(prompts)} prompts × {args.repeats} repeats, {args.max_new_tokens} tokens, {args.draft} over one "
             f"{args.target} target (dtype {args.dtype}) drafting over the target's cache (`borrowed`) and over a cache "
             "of its own (`own`: the view prefills and catches up with its own layers), every arm on every prompt "
             "right after or before the prompt's plain run, in one process. ×plain = geometric mean of the per-run "
             "ratios; TTFT = median time to first token; draft ms = the draft's time per drafted token (its "
             "catch-ups included).", ""]
    lines += paired.arm_table(rows, temps, ["plain", *ARMS], extra=paired.DRAFTER_COLUMNS)
    paired.write_report(args.out, f"A self-speculative view over the target's cache or its own ({args.target} + {args.draft})",
                        {"rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
