#!/usr/bin/env python
"""Would a datastore of the target's own answers draft well?  A timing-free probe (REST's idea).

    specdec train data --no-features --temperatures 0 --sequences 600 --out DATA
    python scripts/datastore_probe.py --data DATA --out benchmarks/NAME

Not a test and not part of CI.  The target continues each built-in benchmark prompt greedily; at
every position of that continuation the probe asks three sources for the next token:

* the datastore: the longest suffix of the context (``--max-ngram`` down to ``--min-ngram``
  tokens) that occurs in the target's answers of ``DATA`` (none of the benchmark's prompts), and
  the token that most often followed it there;
* prompt lookup over the context itself (what the default drafter already does);
* the draft model's arg-max, teacher-forced.

Per category it reports how often each source has a guess and how often that guess is the
target's token, how often the datastore is right where the draft model is wrong, and the tokens a
round a datastore-only chain drafter of γ tokens would emit at T = 0 (rounds simulated on the
continuation: the draft chain follows the datastore's own guesses).  ``--sizes`` repeats it on
the first part of the data to show how agreement grows with the datastore.
"""

from __future__ import annotations

import sys
from collections import Counter, defaultdict

import torch
from tqdm import tqdm

import paired

from specdec.sampling import SamplingConfig
from specdec.train.data import load_shards
from specdec.verify import get_rule


class Store:
    """n-gram -> next-token counts over a list of token sequences (n = min..max)."""

    def __init__(self, seqs: list[list[int]], min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.table: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        for s in seqs:
            for k in range(1, len(s)):
                for n in range(min_n, max_n + 1):
                    if k >= n:
                        self.table[tuple(s[k - n : k])][s[k]] += 1

    def guess(self, ctx: list[int]) -> tuple[int | None, int, float]:
        """(token, matched n, share of the continuation's count) for the longest matching suffix."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ctx) < n:
                continue
            c = self.table.get(tuple(ctx[-n:]))
            if c:
                tok, cnt = c.most_common(1)[0]
                return tok, n, cnt / sum(c.values())
        return None, 0, 0.0


def lookup(ctx: list[int], min_n: int = 1, max_n: int = 3) -> int | None:
    """Prompt lookup: what followed the last earlier occurrence of the longest suffix."""
    for n in range(max_n, min_n - 1, -1):
        if len(ctx) <= n:
            continue
        gram = ctx[-n:]
        for k in range(len(ctx) - 1, n - 1, -1):
            if ctx[k - n : k] == gram:
                return ctx[k]
    return None


def chain_rounds(store: Store, ids: list[int], out: list[int], gamma: int) -> tuple[int, int]:
    """(rounds, tokens) of a datastore chain drafter at T = 0 over the target's continuation."""
    t, rounds = 0, 0
    while t < len(out):
        ctx = ids + out[:t]
        draft: list[int] = []
        for _ in range(gamma):
            tok, _, _ = store.guess(ctx + draft)
            if tok is None:
                break
            draft.append(tok)
        a = 0
        while a < len(draft) and t + a < len(out) and draft[a] == out[t + a]:
            a += 1
        t += a + 1
        rounds += 1
    return rounds, len(out)


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--data", required=True, help="folder written by `specdec train data`")
    ap.add_argument("--min-ngram", type=int, default=2)
    ap.add_argument("--max-ngram", type=int, default=6)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--sizes", default="0.25,0.5,1", help="shares of the data's sequences to index")
    args = ap.parse_args()
    _, prompts, engine, plain = paired.setup(args)
    shard = load_shards(__import__("pathlib").Path(args.data))
    seqs = [t.tolist() for t in shard.tokens]
    reply_tokens = sum(len(s) - p for s, p in zip(seqs, shard.prompt_len))
    draft = engine.drafter
    while draft is not None and not hasattr(draft, "forward"):
        draft = getattr(draft, "model", None)
    cases = []  # (category, ids, out, draft argmax per position)
    for p in tqdm(prompts, desc="target continuations"):
        ids = engine.encode(p.text, chat=p.chat)
        out = plain.decoder(get_rule("greedy")).generate(ids, SamplingConfig(temperature=0.0, max_new_tokens=args.max_new_tokens)).tokens
        seq = torch.tensor(ids + out)
        with torch.inference_mode():
            logits = draft.forward(seq[:-1], draft.new_cache(seq.numel() + 8))  # [L-1, V]
        cases.append((p.category, ids, out, logits[len(ids) - 1 :].argmax(-1).tolist()))
    sizes = [float(s) for s in args.sizes.split(",")]
    results = {}
    lines = [f"Datastore: the target's answers in `{args.data}` ({len(seqs)} sequences, {reply_tokens} reply tokens), "
             f"n-grams of {args.min_ngram}-{args.max_ngram} tokens; {len(prompts)} benchmark prompts continued greedily "
             f"for {args.max_new_tokens} tokens. Shares of positions; *right* = the guess is the target's token.", "",
             "| sequences | category | store has a guess | store right | draft right | lookup right | "
             "store right where draft wrong | either right | store chain γ=%d tokens/round |" % args.gamma,
             "|---|---|---|---|---|---|---|---|---|"]
    for share in sizes:
        n_seq = max(1, round(len(seqs) * share))
        store = Store(seqs[:n_seq], args.min_ngram, args.max_ngram)
        stats: dict[str, dict[str, float]] = {}
        for cat, ids, out, dmax in cases:
            s = stats.setdefault(cat, defaultdict(float))
            for t, tok in enumerate(out):
                ctx = ids + out[:t]
                g, n, _ = store.guess(ctx)
                lk = lookup(ctx)
                s["n"] += 1
                s["has"] += g is not None
                s["store"] += g == tok
                s["draft"] += dmax[t] == tok
                s["lookup"] += lk == tok
                s["rescue"] += (g == tok) and dmax[t] != tok
                s["either"] += (g == tok) or dmax[t] == tok
            r, k = chain_rounds(store, ids, out, args.gamma)
            s["rounds"] += r
            s["tokens"] += k
        results[share] = {c: dict(v) for c, v in stats.items()}
        for cat, s in sorted(stats.items()):
            n = s["n"]
            lines.append(f"| {n_seq} | {cat} | {s['has'] / n:.2f} | {s['store'] / n:.2f} | {s['draft'] / n:.2f} | "
                         f"{s['lookup'] / n:.2f} | {s['rescue'] / n:.2f} | {s['either'] / n:.2f} | "
                         f"{s['tokens'] / s['rounds']:.2f} |")
    paired.write_report(args.out, f"A datastore of the target's answers as a drafter ({args.target})",
                        {"data": args.data, "sequences": len(seqs), "reply_tokens": reply_tokens,
                         "min_ngram": args.min_ngram, "max_ngram": args.max_ngram, "results": results}, lines,
                        data_name="probe.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
