#!/usr/bin/env python
"""What calling the fused layer loop costs before it computes anything, at another commit and in
this checkout, paired in one process.

    python scripts/fused_call_overhead.py --base bccc7be~1 --out benchmarks/fused-call-overhead

Not a test and not part of CI.  The base commit's kernels are built as a second library
(``library_ab.build_base``).  Both arms call ``fused_layers`` with the default target's weights and
a plan of one step that runs neither attention nor the MLP, so the time is the call itself: the
arguments crossing into C++ (the weights as the arm takes them: a list of tensors before
``FusedWeights``, one object after) and the checks.  Arms alternate call by call, reversed every
other repetition.  Writes ``README.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import paired
from library_ab import _Ops, build_base
from specdec.engine import Engine, EngineConfig
from specdec.models import kernels


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit whose kernels are the base arm")
    ap.add_argument("--calls", type=int, default=2000, help="calls per arm and repetition (default 2000)")
    ap.add_argument("--reps", type=int, default=10, help="repetitions (default 10)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--out", required=True, help="output folder (README.md, results.json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.build(EngineConfig(target="smollm2-135m", draft="none"))
    model = paired.native_model(engine.target)
    if not kernels.load() or model.scripted is None or model.scripted.fused is None:
        print("error: no fused layer loop here (the kernels did not build)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        torch.ops.load_library(str(build_base(args.base, Path(tmp))))
    ops = {"base": _Ops(torch.ops.specdec_base, "specdec_base", convert=True),
           "this": _Ops(torch.ops.specdec, "specdec", convert=False)}
    cfg, weights = model.cfg, model.scripted.fused
    cache = model.new_cache(8)
    x = torch.randn(1, cfg.hidden_size)
    cos, sin = torch.ones(1, 1, cfg.head_dim), torch.zeros(1, 1, cfg.head_dim)
    eps = torch.tensor([1e-5])
    plan = [0, 0, 0, 0]  # layer 0, attention off, MLP off, cache slot 0: nothing computed
    calls = {a: (lambda op=op: op.fused_layers(x, cos, sin, cache.k, cache.v, 0, cfg.n_heads, cfg.n_kv_heads,
                                               cfg.head_dim, eps, weights, plan, False, -1, None))
             for a, op in ops.items()}
    for call in calls.values():
        for _ in range(200):
            call()
    us: dict[str, list[float]] = {a: [] for a in calls}
    for rep in range(args.reps):
        for a in (list(calls) if rep % 2 == 0 else list(reversed(calls))):
            call = calls[a]
            t = time.perf_counter()
            for _ in range(args.calls):
                call()
            us[a].append((time.perf_counter() - t) / args.calls * 1e6)
    n_tensors = len(weights.parts()[1])
    res = {a: {"median_us": statistics.median(v), "best_us": min(v)} for a, v in us.items()}
    body = [f"Base: kernels of `{args.base}` (the weights passed as {n_tensors} tensors); this: the checkout's "
            f"(one `FusedWeights` object). Target `smollm2-135m`, {args.reps} repetitions of {args.calls} calls per arm, "
            "alternating. Microseconds per call that computes nothing.", "",
            "| arm | median µs | best µs |", "|---|---|---|"]
    body += [f"| {a} | {r['median_us']:.1f} | {r['best_us']:.1f} |" for a, r in res.items()]
    paired.write_report(args.out, "Calling the fused layer loop: the call's own cost", {"results": res, "us": us}, body)
    print(f"[fused_call_overhead] base {res['base']['median_us']:.1f} us, this {res['this']['median_us']:.1f} us", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
