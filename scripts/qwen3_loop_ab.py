#!/usr/bin/env python
"""Qwen3's layers on the compiled loops against the Python loop, paired in one process: one native
model of Qwen3-0.6B's shape (random weights: a pass's time does not depend on their values), its
decoding steps and chain passes timed with the compiled loop (the fused C++ call for a 4-bit
target, TorchScript otherwise) and with the Python loop, alternately, on the same cache.  Every
pass's logits are checked equal between the two (the loops are bitwise one another).

    python scripts/qwen3_loop_ab.py --dtype q4 --out benchmarks/NAME

Not a test and not part of CI.  The model folder is made once under ``--work`` (2.4 GB of float32
weights for the default shape) and reused.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("SPECDEC_QUANTISED_CACHE", "0")

import torch  # noqa: E402

#: Qwen3-0.6B's shape (config.json of the released model)
SHAPE = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
             rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True)


def make_model(folder: Path, layers: int) -> Path:
    """A random Qwen3 of :data:`SHAPE` (``layers`` of them) saved in ``folder`` unless it is there."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(**{**SHAPE, "num_hidden_layers": layers})
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="q4", choices=["q4", "int8", "float32"])
    ap.add_argument("--layers", type=int, default=SHAPE["num_hidden_layers"])
    ap.add_argument("--prefix", type=int, default=128, help="cached tokens before each timed pass")
    ap.add_argument("--rows", default="1,4", help="comma list of rows per pass (1: a decoding step)")
    ap.add_argument("--reps", type=int, default=40, help="timed passes per arm and row count")
    ap.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "specdec-qwen3-shape"),
                    help="where the random model is kept (default: the system's temporary folder)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from specdec.models.native import NativeCausalLM

    folder = make_model(Path(args.work) / f"layers{args.layers}", args.layers)
    quant = None if args.dtype == "float32" else args.dtype
    t0 = time.perf_counter()
    model = NativeCausalLM.from_folder(folder, batch_invariant=True, quant=quant)
    load_s = time.perf_counter() - t0
    if model.scripted is None:
        print("no compiled loop here (TorchScript missing)", file=sys.stderr)
        return 1
    compiled = model.scripted
    kind = "fused C++ loop" if compiled.fused is not None else "TorchScript loop"
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, SHAPE["vocab_size"], (args.prefix,), generator=gen)
    cache = model.new_cache(args.prefix + 64)
    model.forward(prompt, cache)
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    for rows in rows_list:
        tokens = torch.randint(0, SHAPE["vocab_size"], (rows,), generator=gen)
        times: dict[str, list[float]] = {"compiled": [], "python": []}
        ref: dict[str, torch.Tensor] = {}
        for rep in range(args.reps + 2):  # two warm-up passes per arm
            for arm in (("compiled", "python") if rep % 2 == 0 else ("python", "compiled")):
                model.scripted = compiled if arm == "compiled" else None
                cache.truncate(args.prefix)
                t = time.perf_counter()
                logits = model.forward(tokens, cache)
                dt = time.perf_counter() - t
                if rep >= 2:
                    times[arm].append(dt)
                ref.setdefault(arm, logits)
        model.scripted = compiled
        equal = torch.equal(ref["compiled"], ref["python"])
        med = {arm: statistics.median(v) * 1000 for arm, v in times.items()}
        results.append({"rows": rows, "compiled_ms": round(med["compiled"], 3), "python_ms": round(med["python"], 3),
                        "python_over_compiled": round(med["python"] / med["compiled"], 3), "logits_equal": equal})
        print(results[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python scripts/qwen3_loop_ab.py " + " ".join(sys.argv[1:]), "dtype": args.dtype, "layers": args.layers,
            "shape": {**SHAPE, "num_hidden_layers": args.layers}, "compiled": kind, "prefix": args.prefix, "reps": args.reps,
            "load_s": round(load_s, 1), "threads": torch.get_num_threads(), "results": results}
    (out / "results.json").write_text(json.dumps(meta, indent=2) + "\n")
    lines = [f"# Qwen3 ({args.layers} layers of Qwen3-0.6B's shape, random weights, {args.dtype}): compiled loop vs Python loop",
             "", f"`{meta['command']}`", "", f"Compiled arm: the {kind}. Median of {args.reps} passes per arm after "
             f"{args.prefix} cached tokens, arms alternating; logits compared bit for bit.", "",
             "| rows | compiled ms | Python ms | Python / compiled | logits equal |", "|---|---|---|---|---|"]
    lines += [f"| {r['rows']} | {r['compiled_ms']} | {r['python_ms']} | {r['python_over_compiled']} | {r['logits_equal']} |"
              for r in results]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["logits_equal"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
