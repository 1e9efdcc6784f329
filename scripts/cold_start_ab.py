#!/usr/bin/env python
"""A fresh process's first requests with TorchScript's graph optimiser on and off.

    python scripts/cold_start_ab.py --out benchmarks/cold-start-jit

Not a test and not part of CI.  Each arm runs in its own fresh process (the optimiser's cost is
paid once per process, so it cannot be paired inside one), the arms alternating, ``--processes``
of each: load the default engine (the target and the default drafter, as ``specdec generate``
does), then generate ``--calls`` answers to different built-in prompts at T = 0 and record each
call's time to first token and wall time.  The first calls are where the optimiser's work lands;
later calls show the steady state.  Greedy output must be the same in both arms.  Writes
``README.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import paired

_CHILD = "SPECDEC_COLD_START_CHILD"


def child(optimise: bool, calls: int, tokens: int, threads: int) -> None:
    """One fresh process: load, then ``calls`` greedy answers; prints one JSON line."""
    import torch

    import specdec.models.scripted as scripted
    from specdec.bench.workloads import BUILTIN
    from specdec.engine import Engine, EngineConfig
    from specdec.sampling import SamplingConfig
    from specdec.verify import get_rule

    torch.set_num_threads(threads)
    scripted.JIT_OPTIMIZE = optimise
    t0 = time.perf_counter()
    engine = Engine.build(EngineConfig())
    load = time.perf_counter() - t0
    prompts = [p for cat in ("chat", "code") for p in BUILTIN if p.category == cat][:calls]
    rows = []
    for p in prompts:
        ids = engine.encode(p.text, chat=p.chat)
        t = time.perf_counter()
        res = engine.decoder(get_rule("greedy")).generate(ids, SamplingConfig(temperature=0.0, max_new_tokens=tokens))
        rows.append({"prompt": p.id, "wall_s": time.perf_counter() - t, "ttft_s": res.stats.ttft_s, "tokens": res.tokens})
    print(json.dumps({"optimise": optimise, "load_s": load, "calls": rows}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=3, help="fresh processes per arm (default 3)")
    ap.add_argument("--calls", type=int, default=6, help="answers per process (default 6)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = []
    for i in range(args.processes):
        for optimise in ((True, False) if i % 2 == 0 else (False, True)):
            env = dict(os.environ, **{_CHILD: "1" if optimise else "0"})
            out = subprocess.run([sys.executable, __file__, "--out", args.out, "--calls", str(args.calls), "--tokens",
                                  str(args.tokens), "--threads", str(args.threads)],
                                 env=env, capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"process {len(runs)}: optimiser {'on' if optimise else 'off'}", file=sys.stderr)
    same = all(a["tokens"] == b["tokens"] for r in runs for s in runs for a, b in zip(r["calls"], s["calls"]))
    lines = [f"{args.processes} fresh processes per arm, alternating; each loads the default engine and answers "
             f"{args.calls} built-in prompts (chat first, then code), greedy, {args.tokens} tokens. Medians over "
             "processes, milliseconds.", "",
             "| call | TTFT, optimiser on | TTFT, off | wall, on | wall, off |", "|---|---|---|---|---|"]
    for c in range(args.calls):
        med = {(o, k): statistics.median(r["calls"][c][k] for r in runs if r["optimise"] == o) * 1e3
               for o in (True, False) for k in ("ttft_s", "wall_s")}
        lines.append(f"| {c + 1} | {med[(True, 'ttft_s')]:.0f} | {med[(False, 'ttft_s')]:.0f} | {med[(True, 'wall_s')]:.0f} "
                     f"| {med[(False, 'wall_s')]:.0f} |")
    load = {o: statistics.median(r["load_s"] for r in runs if r["optimise"] == o) for o in (True, False)}
    lines += ["", f"Load: {load[True]:.2f} s (on) / {load[False]:.2f} s (off). Greedy output identical in every "
              f"process and arm: {'yes' if same else 'NO'}."]
    paired.write_report(args.out, "Cold start: TorchScript's graph optimiser on and off (smollm2-135m + default drafter)",
                        {"runs": runs}, lines, indent=None)
    return 0 if same else 1


if __name__ == "__main__":
    if os.environ.get(_CHILD) is not None:
        a = argparse.ArgumentParser()
        a.add_argument("--out")
        a.add_argument("--calls", type=int)
        a.add_argument("--tokens", type=int)
        a.add_argument("--threads", type=int)
        ns = a.parse_args()
        child(os.environ[_CHILD] == "1", ns.calls, ns.tokens, ns.threads)
        sys.exit(0)
    sys.exit(main())
