"""Time to score a prompt: specdec's target against llama.cpp on the same GGUF, by prompt length.

Each length scores the same random token ids (seed 0) into an empty cache, the best of
``--repeats`` runs: specdec's model ``forward`` (the batch-invariant target, as `generate` loads
it; a prompt longer than ``PROMPT_PASS_CHUNK`` rows goes in passes of that many, bitwise one
pass's rows) and llama-cpp-python's ``eval`` (flash attention on, ``n_batch`` = the length,
``n_ubatch`` 512, the same threads). Also timed: specdec's exact attention alone over the same
rows in the same pieces, summed over the layers, so its share of the pass shows; and, with
``--one-pass``, specdec's pass over the whole prompt at once, as it ran before the pieces.

    python scripts/prefill_probe.py --lengths 400,800,1600,3200,6000 --one-pass --out benchmarks/prefill-pieces-m
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--lengths", default="64,400,800,1600", help="comma list of prompt lengths in tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-llamacpp", action="store_true", help="leave llama.cpp out")
    ap.add_argument("--one-pass", action="store_true", help="also time specdec's pass over the whole prompt at once")
    ap.add_argument("--out", required=True, help="folder for results.json and README.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]

    from specdec import defaults
    from specdec.engine import EngineConfig, target_dtype
    from specdec.models import kernels, registry

    dtype, quant = target_dtype(EngineConfig(target=args.target))
    target = registry.load(args.target, dtype=dtype, quant=quant).model
    cfg = target.cfg
    llm = None
    if not args.no_llamacpp:
        from llama_cpp import Llama

        llm = Llama(model_path=str(registry.gguf_file(args.target)), n_ctx=max(lengths) + 8, n_threads=args.threads,
                    n_threads_batch=args.threads, n_batch=max(lengths), n_ubatch=512, flash_attn=True, verbose=False)
    rng = random.Random(0)
    rows = []
    for n in lengths:
        ids = [rng.randrange(100, 40_000) for _ in range(n)]
        tokens = torch.tensor(ids)
        with torch.inference_mode():
            target.forward(tokens[:8], target.new_cache(16), last_only=True)  # warm-up
            ours = best_of(lambda: target.forward(tokens, target.new_cache(n + 8), last_only=True), args.repeats)
            whole = None
            if args.one_pass:
                piece, defaults.PROMPT_PASS_CHUNK = defaults.PROMPT_PASS_CHUNK, n
                try:
                    whole = best_of(lambda: target.forward(tokens, target.new_cache(n + 8), last_only=True), args.repeats)
                finally:
                    defaults.PROMPT_PASS_CHUNK = piece
            attn = None  # (the compiled exact attention is what the pass runs where it is built)
            if kernels.attention_kernel():
                q = torch.randn(n, cfg.n_heads, cfg.head_dim)  # [n, H, d]
                k = torch.randn(cfg.n_kv_heads, n, cfg.head_dim)  # [Hkv, n, d]
                v = torch.randn(cfg.n_kv_heads, n, cfg.head_dim)
                step = defaults.PROMPT_PASS_CHUNK
                attn = cfg.n_layers * best_of(lambda: [torch.ops.specdec.attend(q[a : a + step], k, v, a, None)
                                                       for a in range(0, n, step)], args.repeats)
        row = {"tokens": n, "specdec_s": ours, "specdec_tok_s": n / ours, "one_pass_s": whole,
               "pieces_of": defaults.PROMPT_PASS_CHUNK, "attention_s": attn,
               "attention_share": attn / ours if attn is not None else None}
        if llm is not None:
            def run_llama() -> None:
                llm.reset()
                llm.eval(ids)

            theirs = best_of(run_llama, args.repeats)
            row.update(llamacpp_s=theirs, llamacpp_tok_s=n / theirs, ratio=theirs / ours)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/prefill_probe.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("no_llamacpp", "one_pass") and v is not None
    ) + (" --no-llamacpp" if args.no_llamacpp else "") + (" --one-pass" if args.one_pass else "")
    meta = {"command": command, "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
            "threads": args.threads, "target": args.target, "rows": rows}
    (out / "results.json").write_text(json.dumps(meta, indent=1) + "\n")
    lines = ["# Prompt scoring time by length", "", f"Command: `{command}`", "",
             f"specdec's pass runs a prompt in pieces of {defaults.PROMPT_PASS_CHUNK} rows; \"one pass\" is the "
             "whole prompt at once, as before the pieces.", "",
             "| tokens | specdec s | specdec tok/s | one pass s | of which attention | llama.cpp s | llama.cpp tok/s | ×llama.cpp |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lc = (f"{r['llamacpp_s']:.3f} | {r['llamacpp_tok_s']:.0f} | ×{r['ratio']:.2f}" if "llamacpp_s" in r else "– | – | –")
        share = f"{100 * r['attention_share']:.0f} %" if r["attention_share"] is not None else "–"
        whole = f"{r['one_pass_s']:.3f}" if r["one_pass_s"] is not None else "–"
        lines.append(f"| {r['tokens']} | {r['specdec_s']:.3f} | {r['specdec_tok_s']:.0f} | {whole} | {share} | {lc} |")
    (out / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
