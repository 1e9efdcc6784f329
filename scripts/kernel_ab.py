#!/usr/bin/env python
"""The compiled kernels, paired: plain and speculative decoding with ATen attention + fbgemm,
with the few-row int8 kernel, and with the int8 and attention kernels, every variant on every
prompt in one process, interleaved.

    python scripts/kernel_ab.py --temperatures 0,1 --out benchmarks/NAME
    python scripts/kernel_ab.py --passes --out benchmarks/NAME     # the cost of an n-row pass
    python scripts/kernel_ab.py --fused --out benchmarks/NAME      # the 4-bit target's fused layer loop
    python scripts/kernel_ab.py --head --out benchmarks/NAME       # the default models' int8 LM heads

Not a test and not part of CI.  For each prompt and temperature every variant runs plain then
speculative decoding (variants rotated per prompt so that none always runs first); speed-ups are
over the ``aten`` variant's plain run of the same prompt.  The int8 kernel is bitwise fbgemm, so
``aten`` and ``int8`` produce the same tokens; the attention kernel has its own rounding, so
``int8+attention`` is a (very slightly) different target whose greedy speculative output is
checked against its own plain output.  With ``--head`` the models are the defaults (a 4-bit target
and draft with int8 LM heads) and the variants are their heads on fbgemm or on the few-row kernel
(which has an AVX2 build too), the attention kernel on in both.  Writes ``results.json`` and ``README.md``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

import paired

from specdec.bench.report import machine_line
from specdec.bench.runner import machine_info
from specdec.engine import Engine, EngineConfig, parse_gamma
from specdec.models import kernels
from specdec.models import linear as linear_mod
from specdec.sampling import SamplingConfig
from specdec.verify import get_rule

#: variant -> (largest product on the int8 kernel's VNNI build, on its AVX2 build, attention kernel on)
ALL = linear_mod.ALL_ROWS
VARIANTS = {"aten": (0, 0, False), "int8": (linear_mod.VNNI_ROWS, ALL, False),
            "int8+attention": (linear_mod.VNNI_ROWS, ALL, True)}
#: --fused: the 4-bit target's layer loop from TorchScript, or as one compiled call (bitwise the same)
FUSED_VARIANTS = {"scripted": False, "fused": True}
#: --head: the W8A8 products (the default models' LM heads) on fbgemm, or on the few-row kernel
HEAD_VARIANTS = {"fbgemm": (0, 0, True), "kernel": (linear_mod.VNNI_ROWS, ALL, True)}
#: --avx2-three: on the AVX2 build, also the kernel for at most three rows and fbgemm beyond (its limit
#: before products of more rows ran a 16-column group at a time)
AVX2_THREE = ("kernel<=3", (linear_mod.VNNI_ROWS, 3, True))
_variants: dict = dict(VARIANTS)  # what use() switches between: VARIANTS, or HEAD_VARIANTS with --head
_fused: dict = {}  # the q4 target's ScriptedLayers and its fused weights (--fused)


def use(variant: str) -> None:
    if variant in FUSED_VARIANTS:
        _fused["layers"].fused = _fused["weights"] if FUSED_VARIANTS[variant] else None
        return
    vnni_rows, avx2_rows, attention = _variants[variant]
    linear_mod.VNNI_ROWS = vnni_rows
    linear_mod.AVX2_ROWS = avx2_rows
    kernels.set_attention_kernel(attention)


def last_variant() -> str:
    return list(FUSED_VARIANTS if _fused else _variants)[-1]


def hold_fused(target) -> None:
    """--fused: remember the q4 target's fused weights, so :func:`use` can switch them off and on."""
    layers = target.scripted
    if layers is None or layers.fused is None:
        raise SystemExit("kernel_ab --fused: the target does not run the fused 4-bit loop here (--dtype q4, kernels built)")
    _fused.update(layers=layers, weights=layers.fused)


PASS_ROWS = (1, 2, 3, 4, 5, 9, 17)


def passes(args: argparse.Namespace, context: int = 120, repeats: int = 12) -> int:
    """Median ms of a target pass of n rows after a ``context``-token prefill, per variant, the
    variants interleaved within every repetition (a drifting machine slows them alike)."""
    import time

    target = Engine.build(EngineConfig(target=args.target, draft="none", dtype=args.dtype)).target.model
    if args.fused:
        hold_fused(target)
    variants = list(FUSED_VARIANTS if args.fused else _variants)
    ids = torch.randint(0, 1000, (context,), generator=torch.Generator().manual_seed(0))
    times: dict[str, dict[int, list[float]]] = {name: {r: [] for r in PASS_ROWS} for name in variants}
    for _ in tqdm(range(repeats), desc="passes"):
        for name in variants:
            use(name)
            cache = target.new_cache(context + 64)
            target.forward(ids, cache)
            for r in PASS_ROWS:
                x = torch.randint(0, 1000, (r,))
                target.forward(x, cache)  # untimed: the first pass after another shape (a prefill) is slower
                cache.truncate(context)
                t0 = time.perf_counter()
                target.forward(x, cache)
                times[name][r].append((time.perf_counter() - t0) * 1e3)
                cache.truncate(context)
    use(last_variant())
    med = {name: {r: statistics.median(v) for r, v in rows.items()} for name, rows in times.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/kernel_ab.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    (out / "passes.json").write_text(json.dumps({"command": command, "machine": machine_info(), "context": context,
                                                 "median_ms": med}, indent=1))
    lines = [f"# Target passes of n rows ({args.target}, {context}-token context)", "", f"Command: `{command}`", "",
             f"Machine: {machine_line(machine_info())}.", "",
             f"Median ms of {repeats} passes per row count (each timed right after an untimed pass of the same "
             "size), the variants interleaved in one process.", "",
             "| variant | " + " | ".join(f"{r} rows" for r in PASS_ROWS) + " |", "|---|" + "---|" * len(PASS_ROWS)]
    for name in variants:
        lines.append(f"| {name} | " + " | ".join(f"{med[name][r]:.2f}" for r in PASS_ROWS) + " |")
    (out / "passes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--passes", action="store_true",
                    help="only time target passes of 1-17 rows after a 120-token context (passes.json, passes.md)")
    ap.add_argument("--fused", action="store_true",
                    help="compare the 4-bit target's layer loop from TorchScript ('scripted') with the fused compiled "
                    "loop ('fused'); implies --dtype q4")
    ap.add_argument("--head", action="store_true",
                    help="the default models (4-bit layers, int8 LM heads), their heads on fbgemm ('fbgemm') or on "
                    "the few-row kernel ('kernel'); implies --dtype auto")
    ap.add_argument("--avx2-three", action="store_true",
                    help="with the kernel's AVX2 build: add a variant 'kernel<=3' (the kernel for at most three rows, "
                    "fbgemm beyond), placed before 'kernel'")
    ap.add_argument("--gamma", default="auto",
                    help="the speculative runs' draft length: auto (default) or an integer, which holds every variant's "
                    "rounds equal (γ auto follows each variant's measured pass costs)")
    ap.set_defaults(dtype="int8")  # the variants differ in the int8 product; q4 layers run none of them
    args = ap.parse_args()
    if args.fused:
        args.dtype = "q4"
    if args.head:
        args.dtype = "auto"
        _variants.clear()
        _variants.update(HEAD_VARIANTS)
    if args.avx2_three and kernels.q8_zero() == 64:
        last = list(_variants)[-1]
        kept = _variants.pop(last)
        _variants[AVX2_THREE[0]] = AVX2_THREE[1]
        _variants[last] = kept
    if not (linear_mod.vnni_available() and kernels.attention_kernel()) or (not args.head and not kernels.q8_available()):
        print("kernel_ab: the kernels do not run here (no compiler, no 512-bit VNNI (AVX2 is enough for --head), "
              "or switched off)", file=sys.stderr)
        return 2
    if args.passes:
        torch.set_num_threads(args.threads)
        return passes(args)
    temps, prompts, engine, plain = paired.setup(args)
    gamma = parse_gamma(args.gamma)
    if args.fused:
        hold_fused(engine.target.model)
    names = list(FUSED_VARIANTS if args.fused else _variants)
    base = names[0]
    rows = []
    for t in temps:
        rule = get_rule("greedy" if t == 0 else "block")
        warm = SamplingConfig(temperature=t, seed=0, max_new_tokens=16)
        enc0 = engine.encode(prompts[0].text, chat=prompts[0].chat)
        for name in names:
            use(name)
            plain.decoder(rule).generate(enc0, warm)
            engine.decoder(rule, gamma).generate(enc0, warm)
        for i, p in enumerate(tqdm(prompts, desc=f"T={t:g}")):
            ids = engine.encode(p.text, chat=p.chat)
            cfg = SamplingConfig(temperature=t, seed=0, max_new_tokens=args.max_new_tokens)
            for name in names[i % len(names):] + names[: i % len(names)]:
                use(name)
                for mode, eng in (("plain", plain), ("speculative", engine)):
                    res = (eng.decoder(rule, gamma) if mode == "speculative" else eng.decoder(rule)).generate(ids, cfg)
                    rows.append({"prompt": p.id, "category": p.category, "T": t, "variant": name, "mode": mode,
                                 "tok_s": res.stats.tokens_per_s, "tokens_per_call": res.stats.tokens_per_target_call,
                                 "tokens": res.tokens})
    use(last_variant())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python scripts/kernel_ab.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    (out / "results.json").write_text(json.dumps({"command": command, "machine": machine_info(), "rows": rows}, indent=1))

    def get(t: float, name: str, mode: str, pid: str) -> dict:
        return next(r for r in rows if r["T"] == t and r["variant"] == name and r["mode"] == mode and r["prompt"] == pid)

    lines = [f"# The compiled kernels, paired ({args.target} + {args.draft})", "", f"Command: `{command}`", "",
             f"Machine: {machine_line(machine_info())}.", "",
             f"{len(prompts)} prompts, {args.max_new_tokens} tokens, γ {gamma}; every variant (plain, then speculative) on "
             "every prompt in one process, the variants' order rotated per prompt. "
             f"×{base} plain = median over prompts of the per-prompt tok/s ratio to the `{base}` variant's plain run.", "",
             f"| T | variant | mode | tok/s (median) | ×{base} plain (all) | chat | code | tokens/call | greedy = own plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for t in temps:
        ids = sorted({r["prompt"] for r in rows if r["T"] == t})
        cats = {r["prompt"]: r["category"] for r in rows}
        for name in names:
            for mode in ("plain", "speculative"):
                rs = [get(t, name, mode, pid) for pid in ids]
                ratio = {pid: get(t, name, mode, pid)["tok_s"] / get(t, base, "plain", pid)["tok_s"] for pid in ids}
                by = {c: statistics.median(v for pid, v in ratio.items() if cats[pid] == c) for c in sorted(set(cats.values()))}
                same = "–"
                if t == 0 and mode == "speculative":
                    same = f"{sum(get(t, name, 'speculative', pid)['tokens'] == get(t, name, 'plain', pid)['tokens'] for pid in ids)}/{len(ids)}"
                lines.append(f"| {t:g} | {name} | {mode} | {statistics.median(r['tok_s'] for r in rs):.1f} "
                             f"| {statistics.median(ratio.values()):.3f} | {by.get('chat', float('nan')):.3f} "
                             f"| {by.get('code', float('nan')):.3f} | {statistics.mean(r['tokens_per_call'] for r in rs):.2f} | {same} |")
    pids = sorted({r["prompt"] for r in rows})
    runs = [(t, m) for t in temps for m in ("plain", "speculative") if m == "plain" or t == 0]
    same = ", ".join(f"`{name}` {sum(get(t, base, m, pid)['tokens'] == get(t, name, m, pid)['tokens'] for t, m in runs for pid in pids)}"
                     for name in names[1:])
    why = "the fused loop is bitwise the TorchScript one" if args.fused else "the int8 kernel is bitwise fbgemm"
    lines += ["", f"Runs with the same tokens as `{base}`'s, of {len(runs) * len(pids)} plain and greedy runs: {same} "
              f"({why}). Speculative runs at T > 0 are not compared: γ auto follows "
              "measured timings, and a different draft length consumes the seeded random stream differently (the "
              "output law is the same, the sampled tokens differ)."]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
