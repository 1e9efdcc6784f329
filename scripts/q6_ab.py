#!/usr/bin/env python
"""A GGUF's Q6_K matrices as shipped against re-quantised to 4 bits, paired in one process: the
same 4-bit target loaded twice (``q6``: the file's Q6_K blocks through the kernel's 6-bit columns,
the default; ``requant``: those matrices quantised to Q4_1 blocks, as before), plain decoding of
every built-in prompt on both, the arms' order rotated per prompt.

    python scripts/q6_ab.py --target qwen2.5-coder-1.5b --limit 2 --max-new-tokens 64 --out benchmarks/NAME

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


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
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
