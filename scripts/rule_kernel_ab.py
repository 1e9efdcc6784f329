#!/usr/bin/env python
"""The compiled rules at T > 0 against their torch ops, end to end, paired in one process.

    python scripts/rule_kernel_ab.py --temperatures 1 --repeats 2 --out benchmarks/NAME
    python scripts/rule_kernel_ab.py --draft smollm2-135m-draft --gamma 2 --out benchmarks/NAME
    python scripts/rule_kernel_ab.py --method coupled --out benchmarks/NAME
    python scripts/rule_kernel_ab.py --temperatures 0 --out benchmarks/NAME

Not a test and not part of CI.  Four arms on the same loaded target and drafter: plain decoding
and speculative decoding (γ auto, ``--method`` verification), each with the compiled draw and
chain rules (``csrc/rules.cpp``: what runs once a model has loaded the kernels) and with the torch
ops (``kernels.loaded`` switched off for that arm's run, as the rules see it; the model's own
kernels are unaffected).  For each prompt, temperature and repeat every arm runs once, in an order
rotated per prompt and reversed on odd repeats, with one seed per prompt and repeat.  Plain
decoding draws the same tokens on both paths (the draw is bitwise the same: counted).  Speculative
runs under γ auto do not: γ auto picks draft lengths from measured times, and with block or token verification
another draft length consumes the seed's random numbers differently (the law is the same; the
rules' own equality is what ``tests/test_verify.py`` checks).  With ``--method coupled`` (seeded
sampling's rule) the switch is the compiled Gumbel-max draw alone (``csrc/keyed.cpp``'s
``gumbel_argmax``; the keyed uniforms stay compiled in both arms, as they were before it), plain
decoding is plain seeded sampling, and every arm must emit the same tokens: the seed fixes them
whatever γ auto picks.  At T = 0 the switch is the compiled arg-max alone (``argmax_rows``, what
greedy verification, greedy drafts and Lookahead's node arg-maxes call), and every arm emits plain
greedy decoding's tokens.  Writes ``results.json`` and
``README.md``: tokens per second per arm, the geometric mean of the per-run ratio compiled /
torch, by category.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import paired

from specdec import sampling
from specdec.models import kernels


def _no_compiled_gumbel(probs, seed, position):  # noqa: ANN001, ANN202, ARG001 - sampling._gumbel_compiled's signature
    return None


class _Arm:
    """An engine whose runs see ``kernels.loaded`` as ``compiled`` says (the rules' switch), or,
    with ``gumbel_only``, only the compiled Gumbel-max draw switched off when not ``compiled``."""

    def __init__(self, engine, compiled: bool, gumbel_only: bool = False) -> None:  # noqa: ANN001 - an Engine
        self.engine, self.compiled, self.gumbel_only = engine, compiled, gumbel_only

    def encode(self, *a, **k):  # noqa: ANN002, ANN003, ANN201
        return self.engine.encode(*a, **k)

    def decoder(self, *a, **k):  # noqa: ANN002, ANN003, ANN201
        dec = self.engine.decoder(*a, **k)
        arm = self

        class _Run:
            def generate(self, *ga, **gk):  # noqa: ANN002, ANN003, ANN201
                real, real_gumbel = kernels.loaded, sampling._gumbel_compiled
                if not arm.compiled:
                    if arm.gumbel_only:
                        sampling._gumbel_compiled = _no_compiled_gumbel
                    else:
                        kernels.loaded = lambda: False
                try:
                    return dec.generate(*ga, **gk)
                finally:
                    kernels.loaded, sampling._gumbel_compiled = real, real_gumbel

        return _Run()


def main() -> int:
    ap = paired.parser(__doc__)
    ap.set_defaults(temperatures="1")
    ap.add_argument("--method", default="block", choices=["block", "token", "coupled"],
                    help="the rule above T = 0 (coupled: switch the compiled Gumbel-max draw alone)")
    ap.add_argument("--gamma", default="auto", help="γ of the speculative arms: auto, or a fixed draft length "
                    "(with a drafter whose lengths do not depend on timing, e.g. the draft model alone, both arms "
                    "then draw the same tokens and compare the same work)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    temps, prompts, engine, plain = paired.setup(args)
    if not kernels.loaded():
        raise SystemExit("the kernels did not load here: nothing to compare")
    only = args.method == "coupled"
    arms = {"plain-torch": _Arm(plain, False, only), "plain-compiled": _Arm(plain, True, only),
            "spec-torch": _Arm(engine, False, only), "spec-compiled": _Arm(engine, True, only)}
    rows = []
    for p, temp, rep, res in paired.rotated_runs(arms, prompts, temps, args.repeats, args.max_new_tokens,
                                                    method=args.method,
                                                    gamma=int(args.gamma) if args.gamma.isdigit() else args.gamma):
        for kind in ("plain", "spec"):
            t, c = res[f"{kind}-torch"], res[f"{kind}-compiled"]
            rows.append({"prompt": p.id, "category": p.category, "temperature": temp, "repeat": rep, "kind": kind,
                         "torch_tok_s": t.stats.tokens_per_s, "compiled_tok_s": c.stats.tokens_per_s,
                         "ratio": c.stats.tokens_per_s / t.stats.tokens_per_s, "same": t.tokens == c.tokens,
                         "same_as_plain": t.tokens == c.tokens == res["plain-compiled"].tokens,
                         "tokens_per_call": c.stats.tokens_per_target_call,
                         "plain_torch_tok_s": res["plain-torch"].stats.tokens_per_s})
    lines = [f"{len(prompts)} prompts × {args.repeats} repeats, {args.max_new_tokens} tokens, {args.draft} over "
             f"{args.target} (dtype {args.dtype}), γ {args.gamma}, {args.method} verification; all four arms on every prompt "
             "in one process. Ratios are geometric means of per-run ratios.", "",
             "| T | decoding | category | torch tok/s | compiled tok/s | compiled / torch | ×plain (torch rules) "
             "| ×plain (compiled rules) | same tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for temp, kind, cat, rs in paired.groups(rows, temps):
        sp_t = paired.gmean([r["torch_tok_s"] / r["plain_torch_tok_s"] for r in rs])
        sp_c = paired.gmean([r["compiled_tok_s"] / r["plain_torch_tok_s"] for r in rs])
        lines.append(f"| {temp:g} | {kind} | {cat} | {statistics.mean(r['torch_tok_s'] for r in rs):.1f} | "
                     f"{statistics.mean(r['compiled_tok_s'] for r in rs):.1f} | "
                     f"×{paired.gmean([r['ratio'] for r in rs]):.3f} | ×{sp_t:.3f} | ×{sp_c:.3f} | "
                     f"{sum(r['same'] for r in rs)}/{len(rs)} |")
    if only:
        same = [r["same_as_plain"] for r in rows if r["kind"] == "spec"]
        lines += ["", f"Speculative runs (both arms) equal to plain seeded sampling, token for token: {sum(same)}/{len(same)}."]
    title = ("The compiled Gumbel-max draw against the torch ops, end to end" if only
             else "Compiled chain rules and draws against the torch ops, end to end")
    paired.write_report(args.out, title, {"rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
