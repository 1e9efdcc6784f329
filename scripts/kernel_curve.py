#!/usr/bin/env python
"""What a forward pass of n rows costs on each int8 kernel (fbgemm, oneDNN, mixed), and that the
mixed kernel is the fbgemm target bit for bit.

    python scripts/kernel_curve.py --target smollm2-135m --out benchmarks/int8-kernel-curves/smollm2-135m

Not a test and not part of CI.  One process loads the target once per kernel, fills each cache
with the same 200-token context, then times passes of 1, 2, 3, 4, 5, 9, 17 and 33 new tokens
(what a verification pass of γ = n - 1, or a tree of n - 1 nodes, scores), interleaving the
kernels within every repetition so that a drifting machine slows them alike.  Writes
``README.md`` (the table and the command) and ``curve.json``.
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

from specdec.bench.report import machine_line
from specdec.bench.runner import machine_info
from specdec.engine import Engine, EngineConfig

ROWS = (1, 2, 3, 4, 5, 9, 17, 33)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m", help="registry name of the target (default smollm2-135m)")
    ap.add_argument("--kernels", default="fbgemm,onednn,mixed", help="comma list of int8 kernels (default all three)")
    ap.add_argument("--reps", type=int, default=15, help="timed passes per kernel and row count (default 15)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--out", required=True, help="output folder (README.md, curve.json)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    # int8 targets: the default SmolLM2 target is q4, whose layers none of these kernels run
    models = {k: Engine.build(EngineConfig(target=args.target, draft="none", dtype="int8", int8_kernel=k)).target.model
              for k in kernels}
    vocab = next(iter(models.values())).vocab_size
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (200,), generator=g)
    caches = {}
    for k, m in models.items():
        caches[k] = m.new_cache(512)
        m.forward(context, caches[k], last_only=True)
    curve: dict[str, dict[int, float]] = {k: {} for k in models}
    same_as_fbgemm: dict[str, bool] = {}
    for n in ROWS:
        block = torch.randint(0, vocab, (n,), generator=g)
        times: dict[str, list[float]] = {k: [] for k in models}
        logits = {}
        for k, m in models.items():  # a warm-up pass each, and the logits to compare
            caches[k].truncate(context.numel())
            logits[k] = m.forward(block, caches[k])
        if "fbgemm" in logits:
            for k in logits:
                same_as_fbgemm[k] = same_as_fbgemm.get(k, True) and torch.equal(logits[k], logits["fbgemm"])
        for _ in range(args.reps):
            for k, m in models.items():
                caches[k].truncate(context.numel())
                t = time.perf_counter()
                m.forward(block, caches[k])
                times[k].append(time.perf_counter() - t)
        for k in models:
            curve[k][n] = statistics.median(times[k]) * 1e3
        print(f"{n:3d} rows: " + "  ".join(f"{k} {curve[k][n]:.1f} ms" for k in models), file=sys.stderr, flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/kernel_curve.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    machine = machine_info()
    (out / "curve.json").write_text(json.dumps({"command": command, "target": args.target, "machine": machine,
                                                "ms": curve, "bitwise_fbgemm": same_as_fbgemm}, indent=2) + "\n")
    lines = [f"# int8 kernels: cost of an n-row pass ({args.target})", "", f"Command: `{command}`", "",
             f"Machine: {machine_line(machine)}.", "",
             f"Median ms of a forward pass of n new tokens after a 200-token context, {args.reps} passes per cell, "
             "the kernels interleaved in one process.", "",
             "| rows | " + " | ".join(models) + " |", "|---|" + "---|" * len(models)]
    for n in ROWS:
        lines.append(f"| {n} | " + " | ".join(f"{curve[k][n]:.1f}" for k in models) + " |")
    if same_as_fbgemm:
        lines += ["", "Logits bitwise equal to fbgemm's at every row count: "
                  + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in same_as_fbgemm.items() if k != "fbgemm")
                  + " (mixed is fbgemm's target by construction; oneDNN alone quantises activations with another"
                  " step, so it is a slightly different int8 target, exact relative to itself)."]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
