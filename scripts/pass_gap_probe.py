#!/usr/bin/env python
"""What other work between two target passes costs the second pass.

    python scripts/pass_gap_probe.py --out benchmarks/pass-gap-g

Not a test and not part of CI.  Times the target's one-row decoding pass (the default target,
as ``specdec generate`` loads it) right after another one-row pass (back to back), after an idle
gap of G milliseconds (the calling thread spins on the clock, touching no memory), and after one
or two one-row steps of the default draft model, the settings interleaved and their order
reversed every other repetition.  Only the target pass is timed.  If the pass after a gap is
slower, then sampling, drafting or any other work between passes costs more than its own time.
Writes ``README.md`` and ``results.json``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

import paired

from specdec.bench.workloads import BUILTIN


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--gaps", default="0.25,0.5,1,2,4", help="idle gaps in milliseconds")
    ap.add_argument("--reps", type=int, default=12, help="repetitions of every setting (default 12)")
    ap.add_argument("--passes", type=int, default=30, help="timed passes per setting and repetition (default 30)")
    args = ap.parse_args()
    _, _, engine, _ = paired.setup(args)
    target = paired.native_model(engine.target)
    draft = paired.native_model(engine.drafter.model) if engine.drafter is not None else None
    prompt = next(p for p in BUILTIN if p.category == "chat")
    ids = torch.tensor(engine.encode(prompt.text, chat=prompt.chat))
    t_cache, d_cache = target.new_cache(ids.numel() + 8), None
    target.forward(ids, t_cache)
    if draft is not None:
        d_cache = draft.new_cache(ids.numel() + 8)
        draft.forward(ids, d_cache)
    tok = torch.tensor([42])
    settings = ["back to back", *[f"idle {g} ms" for g in args.gaps.split(",")]]
    if draft is not None:
        settings += ["after 1 draft step", "after 2 draft steps"]

    def before(setting: str) -> None:
        if setting.startswith("idle"):
            gap = float(setting.split()[1]) / 1000
            t = time.perf_counter()
            while time.perf_counter() - t < gap:
                pass
        elif setting.startswith("after"):
            for _ in range(int(setting.split()[1])):
                draft.forward(tok, d_cache)
                d_cache.truncate(ids.numel())

    times: dict[str, list[float]] = {s: [] for s in settings}
    for rep in range(args.reps):
        for s in settings if rep % 2 == 0 else settings[::-1]:
            for _ in range(args.passes):
                before(s)
                t = time.perf_counter()
                target.forward(tok, t_cache)
                times[s].append(time.perf_counter() - t)
                t_cache.truncate(ids.numel())
    base = statistics.median(times["back to back"])
    lines = [f"The target's one-row pass ({args.target}, {args.dtype} dtype), {args.reps} × {args.passes} passes per "
             f"setting, interleaved. OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}.", "",
             "| before the pass | median ms | ×back to back |", "|---|---|---|"]
    for s in settings:
        m = statistics.median(times[s])
        lines.append(f"| {s} | {m * 1e3:.3f} | {m / base:.3f} |")
    paired.write_report(args.out, "The cost of a gap between target passes", {"times_s": times}, lines, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
