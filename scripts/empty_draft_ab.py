#!/usr/bin/env python
"""A round with nothing drafted: the rules' short path against their general path, in one process.

    python scripts/empty_draft_ab.py --out benchmarks/empty-draft-round

Not a test and not part of CI.  Times token and block verification of an empty draft over one
49,152-word row: the short path (``token_verify`` / ``block_verify`` as they are) and the general
path they took before (plan, uniforms for no positions, then a draw from ``p_0``), alternating the
arms per repetition; checks both draw the same token from the same generator state.  Writes
``README.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import paired

from specdec.verify import _finish, _next_token, block_plan, block_verify, token_plan, token_verify


def _general(plan_fn):  # noqa: ANN001, ANN202 - the rule's plan -> the general path for an empty draft
    def run(draft, q, p, *, generator):  # noqa: ANN001, ANN202
        plan = plan_fn(draft, q, p)
        torch.rand(plan.stop.numel(), generator=generator, dtype=torch.float64)  # none for γ = 0
        return _finish(draft, 0, _next_token(plan, 0, p, generator), plan.alpha)
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300, help="timed calls per arm and repetition (default 300)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    p = torch.softmax(torch.randn(1, 49_152, generator=torch.Generator().manual_seed(0)) * 3, -1)
    empty = torch.empty(0, dtype=torch.long)
    arms = {"token, short": token_verify, "token, general": _general(token_plan),
            "block, short": block_verify, "block, general": _general(block_plan)}
    for seed in range(50):
        drawn = {name: int(fn(empty, None, p, generator=torch.Generator().manual_seed(seed)).tokens[0]) for name, fn in arms.items()}
        if len(set(drawn.values())) != 1:
            raise SystemExit(f"the arms drew different tokens for seed {seed}: {drawn}")
    times: dict[str, list[float]] = {name: [] for name in arms}
    g = torch.Generator().manual_seed(1)
    for rep in range(args.reps):
        for name in arms if rep % 2 == 0 else list(arms)[::-1]:
            fn = arms[name]
            for _ in range(20):
                fn(empty, None, p, generator=g)
            for _ in range(args.calls):
                t = time.perf_counter()
                fn(empty, None, p, generator=g)
                times[name].append(time.perf_counter() - t)
    lines = [f"One 49,152-word row, {args.reps} × {args.calls} calls per arm, alternating; the same token for the "
             "same generator state in every arm (50 seeds).", "", "| rule, path | median ms |", "|---|---|"]
    lines += [f"| {name} | {statistics.median(ts) * 1e3:.3f} |" for name, ts in times.items()]
    paired.write_report(args.out, "A round with nothing drafted: short path vs general path", {"times_s": times}, lines,
                        indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
