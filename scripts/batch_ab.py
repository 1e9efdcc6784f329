#!/usr/bin/env python
"""Many prompts: batch generation (continuous batching, no drafter) against one prompt at a time.

    python scripts/batch_ab.py --copies 3 --batches 1,4,8,16,32 --out benchmarks/NAME

Not a test and not part of CI.  The 16 built-in benchmark prompts, ``--copies`` times over (at
T > 0 each copy samples with its own seed), ``--max-new-tokens`` each.  Arms, all on one loaded
target: the default speculative decoding (draft + prompt lookup, γ auto), one prompt after the
other, as ``specdec generate`` runs them; plain decoding one prompt after the other; and
``Engine.generate_batch`` with each batch size of ``--batches``.  First, the cost of one batched
step at each size.  Per arm and temperature: the whole job's wall time (models loaded before), generated tokens and tokens per second.  Prompt i
samples with seed 1000 + i everywhere, so every arm must give the same tokens for every prompt
(greedy at T = 0, coupled / plain seeded sampling at T = 1): checked and reported.  Writes
``README.md`` and ``results.json``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import paired
import torch

from specdec import defaults
from specdec.bench.workloads import BUILTIN
from specdec.engine import Engine, EngineConfig
from specdec.sampling import SamplingConfig


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--copies", type=int, default=3, help="the 16 prompts this many times over")
    ap.add_argument("--batches", default="1,4,8,16,32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    temps = [float(t) for t in args.temperatures.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    speculative = Engine.build(EngineConfig(target=args.target, draft=args.draft, dtype=args.dtype))
    plain = Engine(speculative.target, None, "none")
    prompts = [p for _ in range(args.copies) for p in BUILTIN]
    ids = [plain.encode(p.text, chat=p.chat) for p in prompts]
    warm = SamplingConfig(temperature=0.0, max_new_tokens=8)
    speculative.generate(ids[0], warm)
    plain.generate_batch(ids[:4], warm, batch=4)

    # the cost of one batched step: every sequence past a shared prompt, one new token each
    model = paired.native_model(plain.target)
    step_rows = []
    for b in sorted({1, *batches}):
        caches = [model.new_cache(512) for _ in range(b)]
        model.forward_batch([(torch.tensor(ids[0]), c, True) for c in caches])
        feed = [torch.tensor([ids[0][-1]]) for _ in range(b)]
        for _ in range(3):
            model.forward_batch([(f, c, True) for f, c in zip(feed, caches)])
        t0 = time.perf_counter()
        for _ in range(30):
            model.forward_batch([(f, c, True) for f, c in zip(feed, caches)])
        ms = (time.perf_counter() - t0) / 30 * 1e3
        step_rows.append({"rows": b, "step_ms": ms, "tok_s": b / ms * 1e3})
        print(f"a step of {b} rows: {ms:.2f} ms", file=sys.stderr, flush=True)

    rows, same = [], True
    for temp in temps:
        cfg = SamplingConfig(temperature=temp, max_new_tokens=args.max_new_tokens, seed=None if temp == 0 else 1000)
        arms: dict[str, list[list[int]]] = {}

        def one_by_one(engine: Engine) -> list[list[int]]:
            return [engine.generate(x, replace(cfg, seed=None if cfg.seed is None else cfg.seed + i)).token_ids
                    for i, x in enumerate(ids)]

        jobs = [("speculative, one at a time", lambda: one_by_one(speculative)),
                ("plain, one at a time", lambda: one_by_one(plain))]
        jobs += [(f"batch {b}", lambda b=b: [r.token_ids for r in plain.generate_batch(ids, cfg, batch=b)]) for b in batches]
        for name, job in jobs:
            t0 = time.perf_counter()
            tokens = job()
            wall = time.perf_counter() - t0
            arms[name] = tokens
            n = sum(len(t) for t in tokens)
            rows.append({"temperature": temp, "arm": name, "prompts": len(ids), "tokens": n, "wall_s": wall, "tok_s": n / wall})
            print(f"T = {temp:g} {name}: {n} tokens in {wall:.1f} s = {n / wall:.1f} tok/s", file=sys.stderr, flush=True)
        ref = arms["plain, one at a time"]
        agree = {name: sum(a == b for a, b in zip(toks, ref)) for name, toks in arms.items()}
        same = same and all(v == len(ids) for v in agree.values())
        for r in rows:
            if r["temperature"] == temp:
                r["same_as_plain"] = agree[r["arm"]]

    base = {t: next(r["tok_s"] for r in rows if r["temperature"] == t and r["arm"] == "speculative, one at a time") for t in temps}
    lines = [f"{len(ids)} prompts (the 16 built-in ones x {args.copies}), {args.max_new_tokens} new tokens each, "
             f"{args.threads} threads, target {args.target} ({speculative.target.model.quant or 'float'}); the speculative arm "
             f"uses the default drafter ({speculative.drafter_name}, γ auto). Wall time of the whole job, models "
             "loaded before; prompt i samples with seed 1000 + i in every arm.", "",
             "| T | arm | tokens | wall s | tok/s | × speculative one at a time | same tokens as plain |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['temperature']:g} | {r['arm']} | {r['tokens']} | {r['wall_s']:.1f} | {r['tok_s']:.1f} "
                     f"| ×{r['tok_s'] / base[r['temperature']]:.2f} | {r['same_as_plain']}/{r['prompts']} |")
    lines += ["", f"Every arm gave the same tokens for every prompt: {'yes' if same else 'NO'}. "
              f"`specdec generate --prompts-file` runs the batch arm (default --batch {defaults.BATCH_SEQUENCES}).", "",
              "One batched step (`forward_batch`, each sequence one new token after the first prompt, mean of 30):", "",
              "| sequences | ms per step | tok/s |", "|---|---|---|"]
    lines += [f"| {r['rows']} | {r['step_ms']:.2f} | {r['tok_s']:.0f} |" for r in step_rows]
    paired.write_report(args.out, "Many prompts: continuous batching against one prompt at a time",
                        {"rows": rows, "same_tokens": same, "steps": step_rows}, lines)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
