#!/usr/bin/env python
"""Multi-turn chat with and without the prefix cache that ``specdec generate --interactive`` uses.

    python scripts/chat_prefix_ab.py --turns 8 --repeats 3 --out benchmarks/NAME

Not a test and not part of CI.  One process, the default models loaded once.  A conversation of
``--turns`` user messages (fixed texts, greedy replies of ``--max-new-tokens``) is played the way
the interactive chat plays it: every turn re-encodes the whole conversation with the chat template
and decodes it from an empty cache.  The two arms — ``Engine.with_prefix_cache()`` per conversation
(fresh prefix caches in front of the target's prefills and, where it is batch-invariant, the
draft's; they keep each finished turn, reply included, for the next one), or none — alternate,
``--repeats`` conversations each.  Per turn: prompt tokens, target tokens whose keys/values were
copied, time to first token and wall time.  Replies
must be identical in both arms.  Writes ``README.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import paired
import torch

from specdec.engine import Engine, EngineConfig
from specdec.sampling import SamplingConfig

MESSAGES = (
    "Tell me about the history of the bicycle.",
    "Who made the first pedal-driven one?",
    "How did tyres change riding?",
    "What about gears?",
    "Which country rides the most today?",
    "Why is that?",
    "Give me three tips for a first long ride.",
    "Summarise our conversation in two sentences.",
    "What should I read next on this?",
    "Thanks! One last fact, please.",
)


def conversation(engine: Engine, cached: bool, turns: int, tokens: int) -> list[dict]:
    if cached:
        engine = engine.with_prefix_cache()
        model = engine.target.model
    history: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
    rows = []
    for turn in range(turns):
        history.append({"role": "user", "content": MESSAGES[turn % len(MESSAGES)]})
        before = model.prefix_cache.reused_tokens if cached else 0
        out = engine.generate(engine.encode_messages(history), SamplingConfig(temperature=0.0, max_new_tokens=tokens))
        history.append({"role": "assistant", "content": out.text})
        rows.append({"turn": turn + 1, "prompt_tokens": out.stats.prompt_tokens, "text": out.text,
                     "reused": (model.prefix_cache.reused_tokens - before) if cached else 0,
                     "ttft_s": out.stats.ttft_s, "wall_s": out.stats.wall_s})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine.build(EngineConfig())
    conversation(engine, True, 2, 8)  # warm-up
    runs = []
    for rep in range(args.repeats):
        for cached in ((True, False) if rep % 2 == 0 else (False, True)):
            for row in conversation(engine, cached, args.turns, args.max_new_tokens):
                runs.append({"repeat": rep, "arm": "prefix cache" if cached else "none", **row})
    same = all(a["text"] == b["text"] for a in runs if a["arm"] == "prefix cache"
               for b in runs if b["arm"] == "none" and b["repeat"] == a["repeat"] and b["turn"] == a["turn"])
    lines = [f"{args.repeats} conversations per arm, alternating, {args.turns} turns, greedy replies of at most "
             f"{args.max_new_tokens} tokens, the default models (target + draft with prompt lookup), "
             f"{args.threads} threads. Medians over the conversations; TTFT = time to first token (prefill, "
             "first round). The cache arm is `Engine.with_prefix_cache()`: the target's prefix cache and, "
             "where the draft is batch-invariant, the draft's; 'reused' counts the target's copied tokens.", "",
             "| turn | prompt tokens | reused | TTFT none ms | TTFT cache ms | wall none s | wall cache s |",
             "|---|---|---|---|---|---|---|"]
    for turn in range(1, args.turns + 1):
        def med(arm: str, key: str) -> float:
            return statistics.median(r[key] for r in runs if r["arm"] == arm and r["turn"] == turn)
        lines.append(f"| {turn} | {med('none', 'prompt_tokens'):.0f} | {med('prefix cache', 'reused'):.0f} "
                     f"| {1000 * med('none', 'ttft_s'):.0f} | {1000 * med('prefix cache', 'ttft_s'):.0f} "
                     f"| {med('none', 'wall_s'):.2f} | {med('prefix cache', 'wall_s'):.2f} |")
    total = {arm: statistics.median(sum(r["ttft_s"] for r in runs if r["arm"] == arm and r["repeat"] == rep)
                                    for rep in range(args.repeats)) for arm in ("none", "prefix cache")}
    lines += ["", f"Sum of TTFTs over a conversation (median): {total['none']:.2f} s without, "
              f"{total['prefix cache']:.2f} s with the prefix cache. Replies identical in both arms: "
              f"{'yes' if same else 'NO'}."]
    paired.write_report(args.out, "Interactive chat: the prefix cache in front of the target's prefills",
                        {"runs": runs, "same_replies": same}, lines)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
