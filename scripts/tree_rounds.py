#!/usr/bin/env python
"""Where a tree round's time goes, next to the chain's: a per-round profile of speculative decoding.

    python scripts/tree_rounds.py --arms chain,4,8,auto --temperatures 0,1 --out benchmarks/NAME

Not a test and not part of CI.  For every temperature, prompt and arm (``chain`` = chain γ auto,
``N`` = a tree of at most N nodes, ``auto`` = tree auto, either optionally followed by ``~S``
(sampled trees stop drawing siblings once the drawn ones leave less than S of q uncovered) and
``^E`` (sampled trees expand only nodes of cumulative draft probability at least E); greedy
verification at T = 0, block above it, one seed per prompt shared by every arm, arm order
rotated per prompt) the decoder's own round records are collected: nodes drafted, tokens
emitted, draft time, the target pass and the rule with its bookkeeping.  Plain decoding of the same prompt gives the cost of one token without
speculation.  The report sets each arm's round against the chain's: how many tokens a round of
that cost would have to emit to match the chain's milliseconds per token, against what it emits.
Writes ``results.json`` and ``README.md``.
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace

from tqdm import tqdm

import paired

from specdec import defaults
from specdec.sampling import SamplingConfig
from specdec.verify import get_rule

_FIELDS = ("gamma", "emitted", "draft_ms", "target_ms", "verify_ms")


def _sums(rounds) -> dict[str, float]:  # noqa: ANN001 - RoundStats of one run -> its totals
    """A run's round count, tree rounds and per-field totals (means are taken over all runs' rounds)."""
    out: dict[str, float] = {"rounds": len(rounds), "tree_rounds": sum(r.tree for r in rounds)}
    out.update({k: float(sum(getattr(r, k) for r in rounds)) for k in _FIELDS})
    return out


def _arm_tree(arm: str) -> tuple[str | int, float, float]:
    """An arm -> (tree, sibling stop, sampled expansion floor)."""
    m = re.fullmatch(r"(chain|auto|\d+)(?:~([0-9.]+))?(?:\^([0-9.]+))?", arm)
    if m is None or m.group(1) == "0":
        raise SystemExit(f"not an arm: {arm!r} (chain, auto or a node count N, then optionally ~S and ^E)")
    stop = defaults.TREE_SIBLING_STOP if m.group(2) is None else float(m.group(2))
    expand = defaults.TREE_SAMPLE_EXPAND if m.group(3) is None else float(m.group(3))
    return (m.group(1) if not m.group(1).isdigit() else int(m.group(1))), stop, expand


def _decoder(engine, rule, arm: tuple[str | int, float, float]):  # noqa: ANN001, ANN202 - Engine, Rule -> decoder
    dec = engine.decoder(rule, tree=arm[0])
    if dec.tree is not None:
        dec.tree = replace(dec.tree, sibling_stop=arm[1], sample_expand=arm[2])
    return dec


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--arms", default="chain,4,8,auto")
    args = ap.parse_args()
    arms = args.arms.split(",")
    trees = {a: _arm_tree(a) for a in arms}
    if "chain" not in arms:
        raise SystemExit("the arms must include chain (the reference)")
    temps, prompts, engine, plain = paired.setup(args)
    warm = SamplingConfig(temperature=0.0, max_new_tokens=16)
    enc0 = engine.encode(prompts[0].text, chat=prompts[0].chat)
    for a in arms:
        _decoder(engine, get_rule("greedy"), trees[a]).generate(enc0, warm)
    runs = []
    for temp in temps:
        rule = get_rule("greedy" if temp == 0 else "block")
        for i, p in enumerate(tqdm(prompts, desc=f"T = {temp:g}")):
            cfg = SamplingConfig(temperature=temp, max_new_tokens=args.max_new_tokens, seed=None if temp == 0 else i)
            ids = engine.encode(p.text, chat=p.chat)
            res = plain.decoder(rule).generate(ids, cfg)
            runs.append({"T": temp, "prompt": p.id, "category": p.category, "arm": "plain",
                         "tokens": len(res.tokens), "seconds": len(res.tokens) / res.stats.tokens_per_s})
            for a in arms[i % len(arms):] + arms[: i % len(arms)]:
                res = _decoder(engine, rule, trees[a]).generate(ids, cfg)
                runs.append({"T": temp, "prompt": p.id, "category": p.category, "arm": a, "tokens": len(res.tokens),
                             "seconds": len(res.tokens) / res.stats.tokens_per_s, **_sums(res.rounds)})
    lines = [f"{len(prompts)} prompts, {args.max_new_tokens} tokens, greedy verification at T = 0 and block above it; "
             "every arm on every prompt in one process. Means per round over all rounds of all prompts. "
             "*Needed* = tokens a round of this cost must emit to match the chain's ms per token; "
             "tok/s = tokens over decoding time, all prompts together.", "",
             "| T | arm | rounds | tree rounds | nodes | tokens | draft ms | target pass ms | rule + bookkeeping ms "
             "| round ms | ms / token | needed | tok/s | ×plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for temp in temps:
        rs = [r for r in runs if r["T"] == temp]
        plain_rate = sum(r["tokens"] for r in rs if r["arm"] == "plain") / sum(r["seconds"] for r in rs if r["arm"] == "plain")
        summary = {}
        for a in arms:
            mine = [r for r in rs if r["arm"] == a]
            n = sum(r["rounds"] for r in mine)
            mean = {k: sum(r[k] for r in mine) / n for k in (*_FIELDS, "tree_rounds")}
            round_ms = mean["draft_ms"] + mean["target_ms"] + mean["verify_ms"]
            rate = sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine)
            summary[a] = (n, mean, round_ms, rate)
        chain_ms_per_token = summary["chain"][2] / summary["chain"][1]["emitted"]
        for a in arms:
            n, mean, round_ms, rate = summary[a]
            lines.append(f"| {temp:g} | {a} | {n} | {mean['tree_rounds']:.0%} | {mean['gamma']:.2f} | {mean['emitted']:.2f} "
                         f"| {mean['draft_ms']:.2f} | {mean['target_ms']:.2f} | {mean['verify_ms']:.2f} | {round_ms:.2f} "
                         f"| {round_ms / mean['emitted']:.2f} | {round_ms / chain_ms_per_token:.2f} | {rate:.1f} "
                         f"| {rate / plain_rate:.2f} |")
        lines.append(f"| {temp:g} | plain | – | – | – | 1 | – | – | – | – | {1000 / plain_rate:.2f} | – | {plain_rate:.1f} | 1.00 |")
    paired.write_report(args.out, f"Where a round's time goes: chain vs trees ({args.target} + {args.draft})",
                        {"runs": runs}, lines, indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
