#!/usr/bin/env python
"""Drafting, paired in one process: tree floors, sampled trees' sibling stop and compact draft rows.

    python scripts/tree_floor_ab.py --arms plain,chain:full,chain,8:full@0,8 --repeats 2 --out benchmarks/NAME

Not a test and not part of CI.  An arm is ``chain``, ``auto`` (tree auto) or a node count N,
then optionally ``:full`` (the draft's rows scattered into the whole vocabulary before ranking
and arg-max or drawing, as before compact rows existed), ``@P`` (the tree's minimum cumulative
draft probability), ``~S`` (sampled trees at T > 0: no further sibling once the drawn ones leave
less than S of q uncovered) and ``^E`` (sampled trees expand only nodes of cumulative draft
probability at least E), each the default where left out; ``plain`` is plain decoding.  One
temperature per run (``--temperatures``, default 0): greedy verification at T = 0, block
verification above it, with one seed per prompt and repeat shared by every arm (sampled trees
at T > 0 ignore the floor).

For each prompt and repeat every arm runs once, in an order rotated per prompt and reversed on
odd repeats; each run's speed-up is over the plain run of the same prompt and repeat.  Writes
``results.json`` and ``README.md`` (geometric means of the per-run ratios, by category; tokens
per call; at T = 0 whether the output equals plain greedy output).
"""

from __future__ import annotations

import re
import statistics
import sys
from dataclasses import replace

from tqdm import tqdm

import paired

from specdec import defaults
from specdec.drafters.base import DraftSampler
from specdec.sampling import SamplingConfig
from specdec.verify import get_rule


class _Arm:
    def __init__(self, name: str, engine, plain) -> None:  # noqa: ANN001
        m = re.fullmatch(r"(plain|chain|auto|\d+)(:full)?(?:@([0-9.]+))?(?:~([0-9.]+))?(?:\^([0-9.]+))?", name)
        if m is None:
            raise SystemExit(f"not an arm: {name!r} (plain, chain, auto or N, then :full, @P, ~S and / or ^E)")
        self.name, self.kind, self.full = name, m.group(1), m.group(2) is not None
        self.floor = defaults.TREE_MIN_PROB if m.group(3) is None else float(m.group(3))
        self.stop = defaults.TREE_SIBLING_STOP if m.group(4) is None else float(m.group(4))
        self.expand = defaults.TREE_SAMPLE_EXPAND if m.group(5) is None else float(m.group(5))
        self.engine, self.plain = engine, plain

    def generate(self, ids: list[int], cfg: SamplingConfig):  # noqa: ANN201
        rule = get_rule("greedy" if cfg.greedy else "block")
        if self.kind == "plain":
            return self.plain.decoder(rule).generate(ids, cfg)
        dec = self.engine.decoder(rule, tree=self.kind if self.kind in ("chain", "auto") else int(self.kind))
        if dec.tree is not None:
            dec.tree = replace(dec.tree, min_prob=self.floor, sibling_stop=self.stop, sample_expand=self.expand)
        compact = DraftSampler.compact
        if self.full:
            DraftSampler.compact = property(lambda s: False)  # type: ignore[method-assign, assignment]
        try:
            return dec.generate(ids, cfg)
        finally:
            DraftSampler.compact = compact  # type: ignore[method-assign]


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--arms", default="plain,chain:full,chain,8:full@0,8")
    ap.add_argument("--repeats", type=int, default=2)
    ap.set_defaults(temperatures="0")
    args = ap.parse_args()
    temps, prompts, engine, plain = paired.setup(args)
    if len(temps) != 1:
        raise SystemExit("one temperature per run (--temperatures 0 or, e.g., --temperatures 1)")
    temp = temps[0]
    arms = [_Arm(a, engine, plain) for a in args.arms.split(",")]
    if arms[0].kind != "plain":
        raise SystemExit("the first arm must be plain (the reference of every ratio)")
    warm = SamplingConfig(temperature=0.0, max_new_tokens=16)
    enc0 = engine.encode(prompts[0].text, chat=prompts[0].chat)
    for a in arms:
        a.generate(enc0, warm)
    rows = []
    for rep in range(args.repeats):
        for i, p in enumerate(tqdm(prompts, desc=f"repeat {rep + 1}/{args.repeats}")):
            # T > 0: every arm of a prompt and repeat draws with the same seed
            cfg = SamplingConfig(temperature=temp, max_new_tokens=args.max_new_tokens, seed=None if temp == 0 else 1000 * rep + i)
            ids = engine.encode(p.text, chat=p.chat)
            order = arms[i % len(arms):] + arms[: i % len(arms)]
            res = {a.name: a.generate(ids, cfg) for a in (order if rep % 2 == 0 else order[::-1])}
            ref = res[arms[0].name]
            for a in arms:
                r = res[a.name]
                rows.append({"prompt": p.id, "category": p.category, "repeat": rep, "arm": a.name,
                             "tok_s": r.stats.tokens_per_s, "tokens_per_call": r.stats.tokens_per_target_call,
                             "speedup": r.stats.tokens_per_s / ref.stats.tokens_per_s, "same": r.tokens == ref.tokens})
    def gmean(xs: list[float]) -> float:
        return statistics.geometric_mean(xs) if xs else float("nan")

    rule = "greedy" if temp == 0 else "block"
    lines = [f"{len(prompts)} prompts × {args.repeats} repeats, {args.max_new_tokens} tokens, T = {temp:g}, every arm on every "
             f"prompt right after or before the prompt's plain run, in one process. ×plain = geometric mean of the "
             f"per-run ratios. Default floor: {defaults.TREE_MIN_PROB:g}; sampled trees' default sibling stop "
             f"{defaults.TREE_SIBLING_STOP:g} and expansion floor {defaults.TREE_SAMPLE_EXPAND:g}.", "",
             "| arm | ×plain (all) | chat | code | tokens/call | greedy = plain |", "|---|---|---|---|---|---|"]
    same = (lambda rs: f"{sum(r['same'] for r in rs)}/{len(rs)}") if temp == 0 else (lambda rs: "n/a (T > 0)")
    for a in arms[1:]:
        rs = [r for r in rows if r["arm"] == a.name]
        by = {c: gmean([r["speedup"] for r in rs if r["category"] == c]) for c in ("chat", "code")}
        lines.append(f"| {a.name} | {gmean([r['speedup'] for r in rs]):.3f} | {by['chat']:.3f} | {by['code']:.3f} "
                     f"| {statistics.mean(r['tokens_per_call'] for r in rs):.2f} | {same(rs)} |")
    paired.write_report(args.out, f"Drafting paired at T = {temp:g} ({rule}): tree floor, sibling stop and compact draft rows "
                        f"({args.target} + {args.draft})",
                        {"temperature": temp, "default_floor": defaults.TREE_MIN_PROB,
                         "default_sibling_stop": defaults.TREE_SIBLING_STOP,
                         "default_sample_expand": defaults.TREE_SAMPLE_EXPAND, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
