#!/usr/bin/env python
"""A GGUF's Q6_K matrices as shipped against re-quantised to 4 bits, paired in one process: the
same 4-bit target loaded twice (``q6``: the file's Q6_K blocks through the kernel's 6-bit columns,
the default; ``requant``: those matrices quantised to Q4_1 blocks, as before), plain decoding of
every built-in prompt on both, the arms' order rotated per prompt.

    python scripts/q6_ab.py --target qwen2.5-coder-1.5b --limit 2 --max-new-tokens 64 --out benchmarks/NAME
    python scripts/q6_ab.py --target qwen2.5-coder-1.5b --products --out benchmarks/NAME   # one Q6_K matrix's product, by rows

``--products``: the model's first Q6_K layer matrix (Qwen2.5-Coder-1.5B: a down projection, 8,960
inputs, 1,536 outputs) as shipped against its Q4_1 re-quantisation, products of 1-6 rows timed
alternately (median of ``--reps``).  With ``--copies N`` each arm holds N copies of its matrix in
memory of their own and each product takes the next: past the L3 cache's size every product
streams its weights from memory, as a decoding step's products do (one copy stays in L3 between
products).

Not a test and not part of CI.  The saved quantised layers are not read (either arm would find the
other's: the cache's key does not name the block reading), so both arms build from the file.  The
two arms are different targets: their greedy outputs may differ; how far each is from the float32
model is what ``scripts/quant_quality.py`` measures.
"""

from __future__ import annotations

import os

os.environ["SPECDEC_QUANTISED_CACHE"] = "0"

import paired  # noqa: E402

from specdec.engine import Engine, EngineConfig  # noqa: E402
from specdec.models import gguf_blocks  # noqa: E402


def products(args) -> int:  # noqa: ANN001 - parsed options
    import statistics
    import time

    import torch

    from specdec.models.linear import Q4Linear, Q6Blocks, quantize_q4_1
    from specdec.models.registry import gguf_file

    torch.set_num_threads(args.threads)
    blocks = gguf_blocks.read_q4_blocks(gguf_file(args.target), 1, 1, q6=True)
    found = next(((n, b) for n, b in blocks.items() if isinstance(b, Q6Blocks) and n.startswith("model.layers.")), None)
    if found is None:
        raise SystemExit(f"{args.target}'s GGUF has no Q6_K layer matrix")
    name, b6 = found
    requant = quantize_q4_1(b6.dequantize())
    arms = {"q6": [Q4Linear(None, blocks6=b6) for _ in range(args.copies)],
            "requant": [Q4Linear(requant) for _ in range(args.copies)]}
    k = b6.shape[1]
    rows_out = []
    for rows in (1, 2, 3, 4, 6):
        x = torch.randn(rows, k)
        times: dict[str, list[float]] = {a: [] for a in arms}
        for rep in range(args.reps):
            for a in (list(arms) if rep % 2 == 0 else list(arms)[::-1]):
                layer = arms[a][rep % args.copies]
                t0 = time.perf_counter()
                layer.product(x)
                times[a].append((time.perf_counter() - t0) * 1e3)
        med = {a: statistics.median(t) for a, t in times.items()}
        rows_out.append({"rows": rows, **{f"{a}_ms": v for a, v in med.items()}, "ratio": med["q6"] / med["requant"]})
    held = f"{args.copies} copies per arm, each product on the next" if args.copies > 1 else "one copy per arm"
    body = [f"`{name}` ({b6.shape[0]} x {k}), {held}; median of {args.reps} products per arm and row count, alternated:", "",
            "| rows | Q6_K as shipped (ms) | re-quantised Q4_1 (ms) | ratio |", "|---|---|---|---|",
            *(f"| {r['rows']} | {r['q6_ms']:.3f} | {r['requant_ms']:.3f} | {r['ratio']:.3f} |" for r in rows_out)]
    paired.write_report(args.out, f"One Q6_K matrix's product: {args.target}",
                        {"matrix": name, "copies": args.copies, "rows": rows_out}, body)
    print("\n".join(body))
    return 0


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--products", action="store_true", help="time one Q6_K matrix's products instead of decoding")
    ap.add_argument("--reps", type=int, default=200, help="--products: timed products per arm and row count")
    ap.add_argument("--copies", type=int, default=1,
                    help="--products: copies of the matrix per arm, taken in turn (enough to exceed the L3 cache: the"
                         " products then read their weights from memory)")
    args = ap.parse_args()
    if args.products:
        return products(args)
    args.draft = "none"
    temps, prompts, q6, _ = paired.setup(args)
    read = gguf_blocks.read_q4_blocks
    gguf_blocks.read_q4_blocks = lambda path, heads, kv_heads, q6=False: read(path, heads, kv_heads)
    try:
        requant = Engine.build(EngineConfig(target=args.target, draft="none", dtype=args.dtype))
    finally:
        gguf_blocks.read_q4_blocks = read
    layers = paired.native_model(q6.target).layers
    shipped = sum(int(lin.packed6.numel() > 0) for layer in layers for lin in (layer.qkv, layer.out, layer.gate_up, layer.down))
    rows = []
    for p, temp, rep, res in paired.rotated_runs({"requant": requant, "q6": q6}, prompts, temps, args.repeats,
                                                  args.max_new_tokens):
        for arm, r in res.items():
            rows.append({**paired.run_row(p, temp, rep, r, res["requant"]), "arm": arm})
    body = [f"Layers holding Q6_K columns as shipped in the `q6` arm: {shipped}.", "",
            "Speed of the `q6` arm over the `requant` arm (plain decoding, per-prompt geometric means):", "",
            *paired.arm_table(rows, temps, ["requant", "q6"], [
                ("tok/s q6", lambda rs: f"{sum(r['tok_s'] for r in rs) / len(rs):.2f}"),
                ("tok/s requant", lambda rs: f"{sum(r['plain_tok_s'] for r in rs) / len(rs):.2f}")],
                same="same greedy tokens")]
    paired.write_report(args.out, f"Q6_K as shipped against re-quantised: {args.target}", {"rows": rows}, body)
    print("\n".join(body))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
