"""A float16 key/value cache against a float32 one: decoding step time by context length, and how
far the float16 target's next-token laws move.

For each context length the target (as `generate` loads it: the batch-invariant 4-bit SmolLM2 by
default) scores the same random token ids (seed 0) into a float32 cache and into a float16 one
(`NativeCausalLM.set_kv_dtype`), untimed; then both are timed over ``--steps`` one-token decoding
steps and over as many 4-row verification passes (a chain of 3 drafted tokens and the bonus row,
rolled back after each), the two caches taking turns ``--repeats`` times (ABAB...), the median
per step kept.  Quality: one teacher-forced pass over the first ``--text-tokens`` tokens of
``--text`` with each cache, the mean KL divergence of the float16 target's law from the float32
one's and the share of positions whose arg-max agrees.

    python scripts/kv_dtype_probe.py --lengths 128,512,1024,2048,4096,6000 --out benchmarks/kv-float16-m
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--lengths", default="128,512,1024,2048,4096,6000", help="comma list of context lengths in tokens")
    ap.add_argument("--steps", type=int, default=32, help="timed decoding steps (and 4-row passes) per repeat")
    ap.add_argument("--repeats", type=int, default=5, help="turns each cache dtype takes per length")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", default="README.md", help="text for the quality check (teacher-forced)")
    ap.add_argument("--text-tokens", type=int, default=1000)
    ap.add_argument("--out", required=True, help="folder for results.json, README.md and steps.png")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]

    from specdec.engine import EngineConfig, target_dtype
    from specdec.models import registry

    dtype, quant = target_dtype(EngineConfig(target=args.target))
    loaded = registry.load(args.target, dtype=dtype, quant=quant)
    model = loaded.model
    kinds = {"float32": None, "float16": torch.float16}

    def cache_for(kind: str, n: int):
        model.set_kv_dtype(kinds[kind])
        try:
            return model.new_cache(n)
        finally:
            model.set_kv_dtype(None)

    rng = random.Random(0)
    rows = []
    with torch.inference_mode():
        model.forward(torch.arange(8) + 100, model.new_cache(16))  # warm-up
        for n in lengths:
            ids = torch.tensor([rng.randrange(100, 40_000) for _ in range(n)])
            feed = torch.tensor([rng.randrange(100, 40_000) for _ in range(args.steps + 4)])
            caches = {}
            for kind in kinds:
                c = cache_for(kind, n + args.steps + 8)
                model.forward(ids, c, last_only=True)
                caches[kind] = c
            step = {kind: [] for kind in kinds}
            chain = {kind: [] for kind in kinds}
            for r in range(args.repeats):
                for kind in (kinds if r % 2 == 0 else reversed(list(kinds))):
                    c = caches[kind]
                    t = time.perf_counter()
                    for i in range(args.steps):
                        model.forward(feed[i : i + 1], c, last_only=True)
                    step[kind].append((time.perf_counter() - t) / args.steps)
                    c.truncate(n)
                    t = time.perf_counter()
                    for i in range(args.steps):
                        model.forward(feed[i : i + 4], c)
                        c.truncate(n)
                    chain[kind].append((time.perf_counter() - t) / args.steps)
            row = {"context": n}
            for kind in kinds:
                row[f"{kind}_step_ms"] = 1e3 * statistics.median(step[kind])
                row[f"{kind}_pass4_ms"] = 1e3 * statistics.median(chain[kind])
                row[f"{kind}_cache_mb"] = caches[kind].bytes_per_position * n / 2**20
            row["step_speedup"] = row["float32_step_ms"] / row["float16_step_ms"]
            row["pass4_speedup"] = row["float32_pass4_ms"] / row["float16_pass4_ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        text_ids = torch.tensor(loaded.tokenizer.encode(Path(args.text).read_text())[: args.text_tokens])
        logp = {}
        for kind in kinds:
            c = cache_for(kind, text_ids.numel() + 8)
            logp[kind] = model.forward(text_ids, c).log_softmax(-1)  # [T, V]
    ref, half = logp["float32"], logp["float16"]
    kl = (ref.exp() * (ref - half)).sum(-1)  # [T]
    quality = {"tokens": int(text_ids.numel()), "text": args.text, "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
               "argmax_agreement": float((ref.argmax(-1) == half.argmax(-1)).float().mean())}
    print(json.dumps(quality), flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = (f"python scripts/kv_dtype_probe.py --lengths {args.lengths} --steps {args.steps} --repeats {args.repeats}"
               f" --threads {args.threads} --text {args.text} --text-tokens {args.text_tokens} --out {args.out}"
               + (f" --target {args.target}" if args.target != "smollm2-135m" else ""))
    meta = {"command": command, "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": args.threads, "target": args.target, "precision": quant or str(dtype), "rows": rows,
            "quality": quality}
    (out / "results.json").write_text(json.dumps(meta, indent=1) + "\n")
    lines = ["# A float16 key/value cache against a float32 one", "", f"Command: `{command}`", "",
             f"Target `{args.target}` ({quant or dtype}), {args.threads} threads. Median of {args.repeats} turns per cache,"
             f" each {args.steps} steps; a 4-row pass is a verification of 3 drafted tokens.", "",
             "| context | float32 step ms | float16 step ms | ×step | float32 4-row pass ms | float16 4-row pass ms | ×pass | cache MB float32 / float16 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['context']} | {r['float32_step_ms']:.2f} | {r['float16_step_ms']:.2f} | ×{r['step_speedup']:.2f} | "
                     f"{r['float32_pass4_ms']:.2f} | {r['float16_pass4_ms']:.2f} | ×{r['pass4_speedup']:.2f} | "
                     f"{r['float32_cache_mb']:.0f} / {r['float16_cache_mb']:.0f} |")
    lines += ["", f"Quality, teacher-forced over the first {quality['tokens']} tokens of `{args.text}`: mean KL divergence of"
              f" the float16-cache target's next-token law from the float32 one's {quality['kl_mean']:.4f} nats (max"
              f" {quality['kl_max']:.3f}); arg-max agreement {100 * quality['argmax_agreement']:.1f} %.", "",
              "![decoding step time by context](steps.png)"]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    xs = [r["context"] for r in rows]
    for kind, style, color in (("float32", "o-", "tab:blue"), ("float16", "s-", "tab:green")):
        ax.plot(xs, [r[f"{kind}_step_ms"] for r in rows], style, color=color, label=f"{kind} cache, one-token step")
        ax.plot(xs, [r[f"{kind}_pass4_ms"] for r in rows], style + "-", color=color, alpha=0.4,
                label=f"{kind} cache, 4-row pass")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms")
    ax.set_title(f"{args.target} ({quant or dtype}), {args.threads} threads")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "steps.png", dpi=110)


if __name__ == "__main__":
    main()
