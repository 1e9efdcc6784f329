#!/usr/bin/env python
"""What a target-aware drafter's feature taps add to a verification pass, paired in one process.

    python scripts/tap_pass_ab.py --taps 15 5,25 --rows 1,3 --out benchmarks/NAME

Not a test and not part of CI.  On the default target (q4, the fused layer loop) after a chat
prompt, three arms alternate per repeat: ``plain`` (``forward``: one fused call), ``one call``
(``forward_features``: the fused call copies the residual stream after each tapped layer count
as it goes) and ``per stretch`` (the way taps ran before: one fused call per stretch between taps,
each returning the stretch's residual stream).  Each arm runs ``--steps`` passes of ``--rows``
rows on a fresh cache, and the median per-pass time is taken; the report gives the mean of those
medians over ``--repeats`` and checks that the two tapped arms return the same bits.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import paired

from specdec.engine import Engine, EngineConfig


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--taps", nargs="+", default=["15", "5,25"], help="tap sets, each a comma list of layer counts")
    ap.add_argument("--rows", default="1,3", help="rows per pass (comma list)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.build(EngineConfig(target=args.target, draft="none", dtype=args.dtype))
    model = engine.target.model
    sc = model.scripted
    if sc is None or sc.fused is None:
        raise SystemExit("this target has no fused layer loop here (a q4 or int8 target on the compiled kernels)")
    cfg = model.cfg
    prompt = torch.tensor(engine.encode("Write a short poem about the sea and the wind.", chat=True))

    def per_stretch(tokens: torch.Tensor, cache, taps: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous way: one fused call per stretch between taps (as ``forward_features`` returns)."""
        n = tokens.numel()
        start = cache.reserve(n)
        x = model.embed.index_select(0, tokens)
        cos, sin = model._cos[start : start + n].unsqueeze(1), model._sin[start : start + n].unsqueeze(1)
        found = {}
        bounds = sorted({0, cfg.n_layers, *taps})
        for a, b in zip(bounds, bounds[1:]):
            x = torch.ops.specdec.fused_layers(
                x, cos, sin, cache.k, cache.v, start, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, model._eps, sc.fused,
                [v for li in range(a, b) for v in (li, 1, 1, li)], b == cfg.n_layers, -1, None)
            if b in taps:
                found[b] = x
        return model._logits(x), torch.stack([found[k] for k in taps] + [x], dim=1)

    def arm(name: str, taps: tuple[int, ...], rows: int) -> tuple[float, tuple[torch.Tensor, ...]]:
        cache = model.new_cache(prompt.numel() + rows * args.steps + 8)
        model.forward(prompt, cache, last_only=True)
        tokens = torch.arange(100, 100 + rows)
        times, out = [], ()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            if name == "plain":
                out = (model.forward(tokens, cache),)
            elif name == "one call":
                out = model.forward_features(tokens, cache, taps)
            else:
                out = per_stretch(tokens, cache, taps)
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times), out

    arms = ["plain", "one call", "per stretch"]
    data, lines = [], ["| taps | rows | plain ms | one call ms | per stretch ms | one call − plain | per stretch − plain | same bits |",
                       "|---|---|---|---|---|---|---|---|"]
    for spec in args.taps:
        taps = tuple(int(k) for k in spec.split(","))
        for rows in (int(r) for r in args.rows.split(",")):
            ms: dict[str, list[float]] = {a: [] for a in arms}
            same = True
            for rep in range(args.repeats):
                outs = {}
                for a in arms if rep % 2 == 0 else arms[::-1]:
                    t, outs[a] = arm(a, taps, rows)
                    ms[a].append(t)
                same &= all(torch.equal(x, y) for x, y in zip(outs["one call"], outs["per stretch"]))
            mean = {a: statistics.mean(v) for a, v in ms.items()}
            data.append({"taps": list(taps), "rows": rows, "ms": ms, "same": same})
            lines.append(f"| {spec} | {rows} | {mean['plain']:.3f} | {mean['one call']:.3f} | {mean['per stretch']:.3f} "
                         f"| {mean['one call'] - mean['plain']:+.3f} | {mean['per stretch'] - mean['plain']:+.3f} | {same} |")
    body = [f"Target {args.target} (dtype {args.dtype}), {args.threads} threads; per cell the mean over {args.repeats} "
            f"repeats (arms alternating) of the median of {args.steps} passes.", "", *lines]
    paired.write_report(args.out, "Feature taps in a verification pass: one fused call against one per stretch", {"cells": data}, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
