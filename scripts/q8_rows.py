#!/usr/bin/env python
"""How many rows the few-row int8 kernel should take, per matrix shape: a W8A8 product of n rows on
the kernel against the same product on fbgemm, interleaved in one process.

    python scripts/q8_rows.py --out benchmarks/NAME
    python scripts/q8_rows.py --shapes 49152x576,16384x256 --rows 1-12 --out benchmarks/NAME

Not a test and not part of CI.  Each shape is an ``out x in`` matrix of random weights built as a
:class:`~specdec.models.linear.W8A8Linear` (smoothing off); each timed call is one ``layer(x)``
through the layer's own dispatch, with ``linear.AVX2_ROWS`` / ``linear.VNNI_ROWS`` set so the call
takes the kernel (``kernel``) or fbgemm (``fbgemm``); both give bitwise the same result (checked
here too).  Between calls a 64 MB buffer is written so that the weights come from memory, as they do
inside a real pass (the large heads would otherwise sit in a 32 MB L3 and read 25-35 % faster).
Writes ``results.json`` and ``README.md`` (median microseconds per call, and kernel / fbgemm).
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
from tqdm import tqdm

from specdec.bench.report import machine_line
from specdec.bench.runner import machine_info
from specdec.models import kernels
from specdec.models import linear as linear_mod

#: the default models' int8 matrices (SmolLM2-135M's LM head, the draft's reduced head) and the int8
#: SmolLM2 / Qwen2.5-Coder-1.5B layers' shapes (out x in)
DEFAULT_SHAPES = "49152x576,16384x256,960x576,3072x576,576x1536,2048x1536,17920x1536,1536x8960"


def parse_rows(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def use(variant: str) -> None:
    rows = 0 if variant == "fbgemm" else linear_mod.ALL_ROWS
    linear_mod.AVX2_ROWS = rows
    linear_mod.VNNI_ROWS = rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of OUTxIN (default: %(default)s)")
    ap.add_argument("--rows", default="1-10,12,16", help="row counts, e.g. 1-10,16 (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=15, help="timed calls per shape, rows and variant (default 15)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not linear_mod.vnni_available():
        print("q8_rows: the few-row int8 kernel does not run on this CPU", file=sys.stderr)
        return 2
    rows = parse_rows(args.rows)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    flush = torch.empty(16 << 20)  # 64 MB, written between calls
    gen = torch.Generator().manual_seed(0)
    results = []
    for out_f, in_f in tqdm(shapes, desc="shapes"):
        layer = linear_mod.W8A8Linear(torch.randn(out_f, in_f, generator=gen) * 0.05,
                                      torch.randn(out_f, generator=gen) * 0.01)
        layer.packed  # noqa: B018 - fbgemm's weight made before any timing
        for n in rows:
            x = torch.randn(n, in_f, generator=gen)
            times: dict[str, list[float]] = {"kernel": [], "fbgemm": []}
            outs = {}
            for rep in range(args.repeats + 2):
                for variant in (("kernel", "fbgemm") if rep % 2 == 0 else ("fbgemm", "kernel")):
                    use(variant)
                    flush.fill_(float(rep))
                    t0 = time.perf_counter()
                    y = layer(x)
                    dt = time.perf_counter() - t0
                    if rep >= 2:  # the first two rounds warm up
                        times[variant].append(dt * 1e6)
                    outs[variant] = y
            same = bool(torch.equal(outs["kernel"], outs["fbgemm"]))
            k, f = statistics.median(times["kernel"]), statistics.median(times["fbgemm"])
            results.append({"out": out_f, "in": in_f, "rows": n, "kernel_us": k, "fbgemm_us": f,
                            "ratio": k / f, "bitwise_equal": same})
    info = machine_info()
    info["threads"] = args.threads
    info["q8_zero"] = kernels.q8_zero()
    command = "python scripts/q8_rows.py " + shlex.join(sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"command": command, "machine": info, "results": results}, indent=1))
    lines = [f"# The few-row int8 kernel against fbgemm, per shape and row count", "",
             f"`{command}`", "", machine_line(info), "",
             f"Median us per call over {args.repeats} calls each, interleaved, 64 MB written between calls; "
             "ratio = kernel / fbgemm (below 1: the kernel is faster). Every pair bitwise equal: "
             f"{all(r['bitwise_equal'] for r in results)}.", ""]
    lines += ["| out x in | " + " | ".join(str(n) for n in rows) + " |", "|---|" + "---|" * len(rows)]
    for out_f, in_f in shapes:
        cells = [r for r in results if r["out"] == out_f and r["in"] == in_f]
        lines.append(f"| {out_f} x {in_f} | " + " | ".join(f"{r['ratio']:.2f}" for r in cells) + " |")
    lines += ["", "Microseconds (kernel / fbgemm):", "",
              "| out x in | " + " | ".join(str(n) for n in rows) + " |", "|---|" + "---|" * len(rows)]
    for out_f, in_f in shapes:
        cells = [r for r in results if r["out"] == out_f and r["in"] == in_f]
        lines.append(f"| {out_f} x {in_f} | " + " | ".join(f"{r['kernel_us']:.0f} / {r['fbgemm_us']:.0f}" for r in cells) + " |")
    (args.out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
