#!/usr/bin/env python
"""Seeded sampling's compiled Gumbel-max draw at another commit against this checkout's, paired in one process.

    python scripts/gumbel_ab.py --base REV --out benchmarks/NAME

Not a test and not part of CI.  The base commit's kernels are compiled as a second library
(``specdec_base``, as ``library_ab.py`` does) and loaded beside this checkout's; only
``gumbel_argmax`` differs between the arms here, so the model's passes run on this checkout's
library in both.  Two measurements, the arms alternating:

* **rows** — ``gumbel_argmax`` alone on softmax rows of the draft's reduced vocabulary and the
  target's full one (float32), ``--reps`` calls per arm, the drawn ids compared;
* **decoding** — the built-in prompts at T = 1 with a seed: plain seeded sampling, and speculative
  decoding with coupled verification (the seeded default) and γ auto; per prompt each arm once,
  their order alternating, the sampling module's draw switched to the arm's library.  The tokens
  must be the same in both arms (the draw is the same function of the same row).

Writes ``README.md`` and ``results.json``.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import library_ab
import paired
from specdec import sampling
from specdec.models import kernels
from specdec.sampling import SamplingConfig
from specdec.verify import get_rule


def main() -> int:
    ap = paired.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git commit whose kernels are the baseline")
    ap.add_argument("--reps", type=int, default=400, help="gumbel_argmax calls per arm and row size (default 400)")
    ap.set_defaults(temperatures="1")
    args = ap.parse_args()
    temps, prompts, engine, plain = paired.setup(args)
    if not kernels.load():
        print("error: this checkout's kernels did not build here", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        torch.ops.load_library(str(library_ab.build_base(args.base, Path(tmp))))
    ns = {"base": torch.ops.specdec_base, "this": torch.ops.specdec}
    mods = {"base": library_ab._Torch(ns["base"]), "this": torch}
    g = torch.Generator().manual_seed(0)
    rows: dict[int, dict] = {}
    same = True
    for vocab in (16384, 49152):
        p = torch.softmax(torch.randn(vocab, generator=g) * 3, -1)
        drawn: dict[str, list[int]] = {"base": [], "this": []}

        def draw(a: str) -> None:
            for key in range(args.reps):
                drawn[a].append(int(ns[a].gumbel_argmax(p, key)))

        times = {a: [] for a in ns}
        for rep in range(6):
            for a in (("base", "this") if rep % 2 == 0 else ("this", "base")):
                t = time.perf_counter()
                draw(a)
                times[a].append((time.perf_counter() - t) / args.reps * 1e6)
        same = same and drawn["base"] == drawn["this"]
        rows[vocab] = {a: statistics.median(v) for a, v in times.items()}
        print(f"[gumbel_ab] {vocab} ids: {rows[vocab]['base']:.0f} -> {rows[vocab]['this']:.0f} µs", file=sys.stderr)
    runs = []
    try:
        for temp in temps:
            for i, pr in enumerate(prompts):
                ids = engine.encode(pr.text, chat=pr.chat)
                cfg = SamplingConfig(temperature=temp, max_new_tokens=args.max_new_tokens, seed=i)
                tokens = {}
                for a in (("base", "this") if i % 2 == 0 else ("this", "base")):
                    sampling.torch = mods[a]
                    for kind, eng in (("plain", plain), ("coupled", engine)):  # coupled: the seeded default, plain too
                        res = eng.decoder(get_rule("coupled"), "auto").generate(ids, cfg)
                        tokens[(a, kind)] = res.tokens
                        runs.append({"T": temp, "prompt": pr.id, "category": pr.category, "arm": a, "kind": kind,
                                     "tokens": len(res.tokens), "tokens_per_s": res.stats.tokens_per_s})
                    sampling.torch = torch
                same = same and all(tokens[("base", k)] == tokens[("this", k)] for k in ("plain", "coupled"))
                same = same and tokens[("this", "plain")] == tokens[("this", "coupled")]  # coupled = plain seeded sampling
    finally:
        sampling.torch = torch
    body = [f"Base: kernels of `{args.base}`; this: the checkout's (only `gumbel_argmax` differs between the arms). "
            f"Same draws and tokens in both arms, and coupled = plain seeded sampling: {'yes' if same else 'NO'}.", "",
            "## `gumbel_argmax` per row (float32 softmax rows, median of 6 × " f"{args.reps} calls)", "",
            "| ids per row | base µs | this µs | this / base |", "|---|---|---|---|"]
    for vocab, r in rows.items():
        body.append(f"| {vocab} | {r['base']:.0f} | {r['this']:.0f} | {r['this'] / r['base']:.3f} |")
    body += ["", f"## Decoding: {len(prompts)} prompts × {args.max_new_tokens} tokens, seeded (seed = prompt index)", "",
             "Plain seeded sampling and speculative decoding, both with coupled verification (the rule a seed "
             "selects by default; without a draft it is Gumbel-max sampling). Speculative over plain is the median "
             "per prompt of the two in the same arm.", "",
             "| T | decoding | category | base tok/s | this tok/s | this / base (median per prompt) | ×plain, base | ×plain, this |",
             "|---|---|---|---|---|---|---|---|"]
    for temp in temps:
        for kind in ("plain", "coupled"):
            for cat in ("all", *sorted({r["category"] for r in runs})):
                sel = [r for r in runs if r["T"] == temp and r["kind"] == kind and cat in ("all", r["category"])]
                by = {a: {r["prompt"]: r["tokens_per_s"] for r in sel if r["arm"] == a} for a in ns}
                ratio = statistics.median(by["this"][k] / by["base"][k] for k in by["this"])
                ref = [r for r in runs if r["T"] == temp and r["kind"] == "plain" and cat in ("all", r["category"])]
                over = {a: statistics.median(by[a][r["prompt"]] / r["tokens_per_s"] for r in ref if r["arm"] == a) for a in ns}
                body.append(f"| {temp:g} | {kind} | {cat} | {statistics.median(by['base'].values()):.1f} | "
                            f"{statistics.median(by['this'].values()):.1f} | {ratio:.3f} | {over['base']:.3f} | {over['this']:.3f} |")
    paired.write_report(args.out, "Seeded sampling's Gumbel-max draw at another commit against this checkout's",
                        {"base": args.base, "same": same, "rows": rows, "runs": runs}, body)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
