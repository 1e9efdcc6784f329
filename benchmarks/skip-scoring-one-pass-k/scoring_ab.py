"""How long `specdec train skip` takes to score one skip set, row at a time against one pass.

Both score a set as the view drafts it (each row over the target's keys and values at earlier
positions and its own at its position); the row-at-a-time way is the one `view_logits` used
before `run_layers(as_drafted=True)`, reproduced here.  Same calibration data (the built-in
calibration prompts, the target's greedy continuations), same sets, alternating arms.

    python benchmarks/skip-scoring-one-pass-k/scoring_ab.py --target qwen2.5-coder-1.5b \
        --out benchmarks/skip-scoring-one-pass-k
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from specdec.drafters.self_spec import LayerPlan, LayerView, shipped_plan
from specdec.models.registry import load
from specdec.text import encode_prompt
from specdec.train import skip


def rows_one_at_a_time(target, plan, seq, start, keys, values):  # the scoring before: one view step per row
    view = LayerView(target, plan)
    layers = torch.tensor(plan.attention_layers, dtype=torch.long)
    n = seq.numel()
    cache = view.new_cache(n)
    cache.reserve(n)
    a = layers.numel()
    if a:
        cache.k[:a, :, :n] = keys.index_select(0, layers)
        cache.v[:a, :, :n] = values.index_select(0, layers)
    rows = []
    for t in range(start, n - 1):
        cache.truncate(t)
        rows.append(view.forward(seq[t : t + 1], cache))
        if a:
            cache.k[:a, :, t] = keys[layers, :, t]
            cache.v[:a, :, t] = values[layers, :, t]
    return torch.cat(rows)


def score(fn, target, plan, data):
    agree = overlap = 0.0
    count = 0
    t0 = time.perf_counter()
    for seq, start, amax, p, k, v in zip(data.sequences, data.starts, data.target_argmax, data.target_probs,
                                         data.keys, data.values):
        logits = fn(target, plan, seq, start, k, v)
        agree += float((logits.argmax(-1) == amax).sum())
        overlap += float(torch.minimum(torch.softmax(logits, -1), p).sum())
        count += amax.numel()
    return time.perf_counter() - t0, agree / count, overlap / count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    target = load(args.target, batch_invariant=False)  # as `specdec train skip` loads it
    model = target.model
    n = model.cfg.n_layers
    ids = [encode_prompt(target.tokenizer, text, chat=chat) for text, chat in skip.CALIBRATION[: args.prompts]]
    data = skip.build_calibration(model, ids, new_tokens=args.new_tokens)
    plans = {"nothing skipped": LayerPlan.skipping(n, set(), set()),
             "attention of the upper half skipped": LayerPlan.skipping(n, set(range(n // 2, n)), set()),
             "early exit at 3/4": LayerPlan.early_exit(n, 3 * n // 4)}
    shipped = shipped_plan(args.target)
    if shipped is not None:
        plans["shipped set"] = shipped
    rows = []
    for name, plan in plans.items():
        times = {"row at a time": [], "one pass": []}
        alphas = {}
        for r in range(args.repeats):
            arms = [("row at a time", rows_one_at_a_time), ("one pass", skip.view_logits)]
            for label, fn in (arms if r % 2 == 0 else arms[::-1]):
                t, a0, a1 = score(fn, model, plan, data)
                times[label].append(t)
                alphas[label] = (a0, a1)
        row = {"plan": name, **{f"{k} s": statistics.median(v) for k, v in times.items()},
               **{f"{k} alpha": [round(x, 4) for x in v] for k, v in alphas.items()}}
        row["speed-up"] = row["row at a time s"] / row["one pass s"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_scored = sum(a.numel() for a in data.target_argmax)
    (out / "results.json").write_text(json.dumps({"target": args.target, "prompts": args.prompts,
                                                  "new_tokens": args.new_tokens, "rows_scored": rows_scored,
                                                  "repeats": args.repeats, "cpu": platform.processor() or platform.machine(),
                                                  "rows": rows}, indent=1) + "\n")
    lines = ["| set | row at a time (s) | one pass (s) | speed-up | α₀ / α₁ row at a time | α₀ / α₁ one pass |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['plan']} | {r['row at a time s']:.2f} | {r['one pass s']:.2f} | ×{r['speed-up']:.1f} | "
                     f"{r['row at a time alpha'][0]:.4f} / {r['row at a time alpha'][1]:.4f} | "
                     f"{r['one pass alpha'][0]:.4f} / {r['one pass alpha'][1]:.4f} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
