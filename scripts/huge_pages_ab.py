#!/usr/bin/env python
"""The model's weights on 2 MiB pages against 4 KiB pages, end to end, paired in one process.

    python scripts/huge_pages_ab.py --repeats 2 --out benchmarks/NAME

Not a test and not part of CI.  Loads the target and the drafter with ``SPECDEC_HUGE_PAGES=0``
(their weights on the allocator's 4 KiB pages), then moves their layers and heads onto huge pages
(``specdec.models.hugepages.adopt_model``, what loading does by default) while keeping the old buffers,
so that each arm can point every tensor at its own copy: four arms — plain and speculative
decoding, each on 4 KiB and on 2 MiB pages — run on every prompt in one process, in an order
rotated per prompt and reversed on odd repeats.  The copies hold the same bits, so each pair of
arms must emit the same tokens (counted).  Writes ``results.json`` and ``README.md``: tokens per
second per arm, the geometric mean of the per-run ratio huge / small pages, by category.
"""

from __future__ import annotations

import os
import statistics
import sys

os.environ["SPECDEC_HUGE_PAGES"] = "0"  # load on small pages; the script moves them itself

import paired  # noqa: E402

from specdec.models import hugepages  # noqa: E402


class _Pages:
    """Every large tensor of the loaded models, switchable between its 4 KiB and 2 MiB copy."""

    def __init__(self, *roots) -> None:  # noqa: ANN002 - models and drafters
        tensors = {id(t): t for r in roots for t in hugepages.tensors_of(r)}
        self.small = {k: (t.untyped_storage(), t.storage_offset()) for k, t in tensors.items()}
        os.environ["SPECDEC_HUGE_PAGES"] = "1"
        self.arenas = [hugepages.adopt_model(r) for r in roots]
        if not any(self.arenas):
            raise SystemExit("no huge pages here (MADV_HUGEPAGE missing, or transparent huge pages are 'never')")
        self.huge = {k: (t.untyped_storage(), t.storage_offset()) for k, t in tensors.items()}
        self.tensors = tensors
        self.moved = sum(a.moved_bytes for a in self.arenas if a)

    def use(self, huge: bool) -> None:
        import torch

        with torch.inference_mode():
            for k, t in self.tensors.items():
                st, off = (self.huge if huge else self.small)[k]
                if t.untyped_storage().data_ptr() != st.data_ptr():
                    t.set_(st, off, t.size(), t.stride())


class _Arm:
    def __init__(self, engine, pages: _Pages, huge: bool) -> None:  # noqa: ANN001 - an Engine
        self.engine, self.pages, self.huge = engine, pages, huge

    def encode(self, *a, **k):  # noqa: ANN002, ANN003, ANN201
        return self.engine.encode(*a, **k)

    def decoder(self, *a, **k):  # noqa: ANN002, ANN003, ANN201
        dec, arm = self.engine.decoder(*a, **k), self

        class _Run:
            def generate(self, *ga, **gk):  # noqa: ANN002, ANN003, ANN201
                arm.pages.use(arm.huge)  # outside the timed generation
                return dec.generate(*ga, **gk)

        return _Run()


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--method", default="block", choices=["block", "token", "coupled"], help="the rule above T = 0")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    temps, prompts, engine, plain = paired.setup(args)
    pages = _Pages(paired.native_model(engine.target), paired.native_model(engine.drafter))
    print(f"moved {pages.moved / 2**20:.0f} MiB; AnonHugePages {(hugepages.huge_bytes() or 0) / 2**20:.0f} MiB")
    arms = {"plain-4k": _Arm(plain, pages, False), "plain-2m": _Arm(plain, pages, True),
            "spec-4k": _Arm(engine, pages, False), "spec-2m": _Arm(engine, pages, True)}
    rows = []
    for p, temp, rep, res in paired.rotated_runs(arms, prompts, temps, args.repeats, args.max_new_tokens, method=args.method):
        for kind in ("plain", "spec"):
            s, h = res[f"{kind}-4k"], res[f"{kind}-2m"]
            rows.append({"prompt": p.id, "category": p.category, "temperature": temp, "repeat": rep, "kind": kind,
                         "small_tok_s": s.stats.tokens_per_s, "huge_tok_s": h.stats.tokens_per_s,
                         "ratio": h.stats.tokens_per_s / s.stats.tokens_per_s, "same": s.tokens == h.tokens,
                         "plain_small_tok_s": res["plain-4k"].stats.tokens_per_s})
    lines = [f"{len(prompts)} prompts × {args.repeats} repeats, {args.max_new_tokens} tokens, {args.draft} over "
             f"{args.target} (dtype {args.dtype}), γ auto, {args.method} verification above T = 0; all four arms on every "
             f"prompt in one process; {pages.moved / 2**20:.0f} MiB of weights moved. Ratios are geometric means of "
             "per-run ratios; at T > 0 the speculative arms may differ in tokens (γ auto's draft lengths come from "
             "measured times), plain ones may not.", "",
             "| T | decoding | category | 4 KiB pages tok/s | 2 MiB pages tok/s | 2 MiB / 4 KiB | ×plain (4 KiB) | ×plain (2 MiB) "
             "| same tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for temp, kind, cat, rs in paired.groups(rows, temps):
        lines.append(
            f"| {temp:g} | {kind} | {cat} | {statistics.mean(r['small_tok_s'] for r in rs):.1f} | "
            f"{statistics.mean(r['huge_tok_s'] for r in rs):.1f} | ×{paired.gmean([r['ratio'] for r in rs]):.3f} | "
            f"×{paired.gmean([r['small_tok_s'] / r['plain_small_tok_s'] for r in rs]):.3f} | "
            f"×{paired.gmean([r['huge_tok_s'] / r['plain_small_tok_s'] for r in rs]):.3f} | "
            f"{sum(r['same'] for r in rs)}/{len(rs)} |")
    paired.write_report(args.out, "Weights on 2 MiB pages against 4 KiB pages, end to end", {"rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
