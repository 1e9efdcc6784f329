#!/usr/bin/env python
"""Seeded sampling's keyed noise: the compiled pass against the torch ops, in one process.

    python scripts/keyed_noise_ab.py --out benchmarks/keyed-noise

Not a test and not part of CI.  Times ``keyed_uniform`` and ``gumbel_sample`` over the whole
49,152-word vocabulary with the compiled kernel and with the torch ops (``kernels.loaded``
switched off), alternating the two arms per repetition; checks the bits are equal.  Writes
``README.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import paired

from specdec.models import kernels
from specdec.sampling import gumbel_sample, keyed_uniform


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300, help="timed calls per arm and repetition (default 300)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not kernels.load():
        raise SystemExit("the kernels did not build here")
    vocab = 49_152
    p = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(0)), -1)
    real = kernels.loaded
    arms = {"compiled": real, "torch": lambda: False}
    ms: dict[str, dict[str, list[float]]] = {a: {"keyed_uniform": [], "gumbel_sample": []} for a in arms}
    same = True
    for rep in range(args.reps):
        for arm in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
            kernels.loaded = arms[arm]
            for name, fn in (("keyed_uniform", lambda i: keyed_uniform(1, i, None, vocab)),
                             ("gumbel_sample", lambda i: gumbel_sample(p, 1, i))):
                ts = []
                for i in range(args.calls):
                    t = time.perf_counter()
                    fn(i)
                    ts.append(time.perf_counter() - t)
                ms[arm][name].append(statistics.median(ts) * 1e3)
        kernels.loaded = real
        a = keyed_uniform(5, rep, None, vocab)
        kernels.loaded = arms["torch"]
        same &= torch.equal(a, keyed_uniform(5, rep, None, vocab))
        kernels.loaded = real
    lines = [f"{args.reps} repetitions, arms alternated, median of {args.calls} calls each; ms per call over "
             f"{vocab} token ids. Bits equal: {'yes' if same else 'NO'}.", "",
             "| call | torch ops | compiled |", "|---|---|---|"]
    for name in ("keyed_uniform", "gumbel_sample"):
        lines.append(f"| {name} | {' / '.join(f'{v:.3f}' for v in ms['torch'][name])} | "
                     f"{' / '.join(f'{v:.3f}' for v in ms['compiled'][name])} |")
    paired.write_report(args.out, "Keyed noise for seeded sampling: compiled vs torch ops", {"ms": ms, "same_bits": same}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
