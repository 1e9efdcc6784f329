#!/usr/bin/env python
"""Where the target's next token sits in the draft's ranking: what a token tree can gain.

    python scripts/draft_ranks.py --out benchmarks/NAME

Not a test and not part of CI.  The target continues each built-in benchmark prompt greedily
(``--new-tokens``); the draft then scores every position of that continuation teacher-forced, in
one pass.  Per category: how often the target's token is the draft's first, second, third-fourth
or a later choice; and where the first choice is wrong, how often the second is right and what
draft probability it has — a root sibling enters a floored greedy tree only when that probability
reaches the floor (``--floor``), so the last columns say how many first-choice misses a floored
tree could still rescue at the root.  Writes ``ranks.json`` and ``README.md``.
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

import paired

from specdec import defaults
from specdec.sampling import SamplingConfig
from specdec.verify import get_rule


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--floor", type=float, default=defaults.TREE_MIN_PROB)
    args = ap.parse_args()
    _, prompts, engine, plain = paired.setup(args)
    draft = engine.drafter  # the hybrid default wraps a ModelDrafter, which wraps the model
    while draft is not None and not hasattr(draft, "forward"):
        draft = getattr(draft, "model", None)
    if draft is None:
        raise SystemExit(f"{args.draft!r} has no draft model to rank with")
    stats: dict[str, dict[str, float]] = {}
    for p in tqdm(prompts, desc="prompts"):
        ids = engine.encode(p.text, chat=p.chat)
        out = plain.decoder(get_rule("greedy")).generate(ids, SamplingConfig(temperature=0.0, max_new_tokens=args.new_tokens))
        seq = torch.tensor(ids + out.tokens)
        with torch.inference_mode():
            logits = draft.forward(seq[:-1], draft.new_cache(seq.numel() + 8))  # [L-1, V]: row i predicts seq[i+1]
        rows = logits[len(ids) - 1 :].float()  # the continuation's positions
        target = seq[len(ids) :]  # [n]
        q = torch.softmax(rows, -1)  # [n, V]
        top2 = q.topk(2, dim=-1)
        q_t = q.gather(1, target.view(-1, 1)).squeeze(1)
        rank = (q > q_t.unsqueeze(1)).sum(1) + 1  # [n]
        miss = rank > 1
        second_right = top2.indices[:, 1] == target
        in_tree = top2.values[:, 1] >= args.floor  # the second choice enters a floored tree's root
        s = stats.setdefault(p.category, {k: 0.0 for k in ("n", "r1", "r2", "r34", "rest", "miss", "q2_sum", "q2_right_sum",
                                                          "in_tree", "in_tree_right")})
        s["n"] += target.numel()
        s["r1"] += int((rank == 1).sum())
        s["r2"] += int((rank == 2).sum())
        s["r34"] += int(((rank >= 3) & (rank <= 4)).sum())
        s["rest"] += int((rank > 4).sum())
        s["miss"] += int(miss.sum())
        s["q2_sum"] += float(top2.values[miss, 1].sum())
        s["q2_right_sum"] += float(top2.values[miss & second_right, 1].sum())
        s["in_tree"] += int((miss & in_tree).sum())
        s["in_tree_right"] += int((miss & in_tree & second_right).sum())
    lines = [f"{len(prompts)} prompts continued greedily by the target for {args.new_tokens} tokens, every position "
             f"scored teacher-forced by the draft. Shares of positions; *2nd right* is among first-choice misses; "
             f"*reaches floor* = the second choice's draft probability ≥ {args.floor:g} (it would enter a floored tree "
             f"at the root).", "",
             "| category | positions | 1st | 2nd | 3rd-4th | later | misses: 2nd right | mean q of 2nd | "
             "2nd reaches floor | ... and is right |", "|---|---|---|---|---|---|---|---|---|---|"]
    for cat, s in sorted(stats.items()):
        n, miss = s["n"], max(s["miss"], 1.0)
        lines.append(f"| {cat} | {int(n)} | {s['r1'] / n:.2f} | {s['r2'] / n:.2f} | {s['r34'] / n:.2f} | {s['rest'] / n:.2f} "
                     f"| {s['r2'] / miss:.2f} | {s['q2_sum'] / miss:.2f} | {s['in_tree'] / miss:.2f} "
                     f"| {s['in_tree_right'] / max(s['in_tree'], 1.0):.2f} |")
    paired.write_report(args.out, f"Where the target's token sits in the draft's ranking ({args.target} + {args.draft})",
                        {"floor": args.floor, "stats": stats}, lines, data_name="ranks.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
