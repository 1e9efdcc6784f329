#!/usr/bin/env python
"""Confidence-gated drafts, paired: plain decoding and speculative decoding at several
``--min-confidence`` values, every variant on every prompt in one process, interleaved.

    python scripts/confidence_ab.py --values 0,0.3,0.5,0.7 --temperatures 0 --out benchmarks/NAME

Not a test and not part of CI.  For each prompt and temperature the order is: plain, then each
value (rotated per prompt so that no value always runs first); each speculative run's speed-up is
over the plain run of the same prompt taken seconds before.  Writes ``results.json`` and
``README.md`` (medians over prompts, by category; tokens per call; greedy output = plain).
"""

from __future__ import annotations

import statistics
import sys

from tqdm import tqdm

import paired

from specdec.sampling import SamplingConfig
from specdec.verify import get_rule


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--values", default="0,0.5", help="comma list of --min-confidence values")
    args = ap.parse_args()
    values = [float(v) for v in args.values.split(",")]
    temps, prompts, engine, plain = paired.setup(args)
    rows = []
    for t in temps:
        rule = get_rule("greedy" if t == 0 else "block")
        warm = SamplingConfig(temperature=t, seed=0, max_new_tokens=16)
        enc0 = engine.encode(prompts[0].text, chat=prompts[0].chat)
        for v in values:
            engine.decoder(rule, min_confidence=v).generate(enc0, warm)
        for i, p in enumerate(tqdm(prompts, desc=f"T={t:g}")):
            ids = engine.encode(p.text, chat=p.chat)
            cfg = SamplingConfig(temperature=t, seed=0, max_new_tokens=args.max_new_tokens)
            ref = plain.decoder(rule).generate(ids, cfg)
            rows.append({"prompt": p.id, "category": p.category, "T": t, "variant": "plain",
                         "tok_s": ref.stats.tokens_per_s, "tokens_per_call": 1.0, "tokens": ref.tokens})
            for v in values[i % len(values):] + values[: i % len(values)]:
                res = engine.decoder(rule, min_confidence=v).generate(ids, cfg)
                rows.append({"prompt": p.id, "category": p.category, "T": t, "variant": v,
                             "tok_s": res.stats.tokens_per_s, "tokens_per_call": res.stats.tokens_per_target_call,
                             "mean_gamma": res.stats.mean_gamma, "tokens": res.tokens,
                             "speedup": res.stats.tokens_per_s / ref.stats.tokens_per_s})
    lines = [f"{len(prompts)} prompts, {args.max_new_tokens} tokens, γ auto; every value on every prompt right after the "
             "prompt's plain run, in one process. ×plain = median over prompts of the per-prompt ratio.", "",
             "| T | --min-confidence | ×plain (all) | chat | code | tokens/call | mean γ | greedy = plain |",
             "|---|---|---|---|---|---|---|---|"]
    for t in temps:
        plain_tokens = {r["prompt"]: r["tokens"] for r in rows if r["T"] == t and r["variant"] == "plain"}
        for v in values:
            rs = [r for r in rows if r["T"] == t and r["variant"] == v]
            by = {c: statistics.median(r["speedup"] for r in rs if r["category"] == c) for c in sorted({r["category"] for r in rs})}
            same = sum(r["tokens"] == plain_tokens[r["prompt"]] for r in rs) if t == 0 else None
            lines.append(f"| {t:g} | {v:g} | {statistics.median(r['speedup'] for r in rs):.3f} | {by.get('chat', float('nan')):.3f} "
                         f"| {by.get('code', float('nan')):.3f} | {statistics.mean(r['tokens_per_call'] for r in rs):.2f} "
                         f"| {statistics.mean(r['mean_gamma'] for r in rs):.2f} | {'–' if same is None else f'{same}/{len(rs)}'} |")
    paired.write_report(args.out, f"Confidence-gated drafts, paired ({args.target} + {args.draft})", {"rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
