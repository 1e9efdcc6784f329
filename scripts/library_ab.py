#!/usr/bin/env python
"""The compiled kernels at another commit against this checkout's, paired in one process.

    python scripts/library_ab.py --base 7ab318b --out benchmarks/NAME

Not a test and not part of CI.  On a machine whose speed drifts by tens of per cent between
runs, two builds compared in two processes minutes apart say little; this loads both into one
process and alternates them call by call.  The base commit's ``csrc`` sources are compiled as a
second library whose operator namespace (and C++ namespace) is ``specdec_base`` instead of
``specdec``, with the same flags and target CPU as this checkout's build.  Then, with the default
target (the packed weights are shared: both builds must read the same packed layout):

* **passes** — the target's forward pass over n new tokens after a ``--context``-token prompt,
  the fused layer loop on one library or the other (the loop is one operator call, so it uses
  its own library's products and attention);
* **products** — the target's 120 4-bit layer products for n rows, called directly;
* **attention** — one layer's exact attention (SmolLM2's head layout) for n rows over the context;
* **batched passes** (``--sequences``) — a batching server's pass (``forward_batch``): S sequences
  of one new token each, each after its own prompt of about ``--context`` tokens.

With ``--model draft`` the model is the default draft instead (its own precision: W8A8 layers on
an x86 machine with VNNI), its LM head on the arm's library too, and the products are its
int8 ones (``q8_linear``).

Each repetition runs both arms in alternating order; the report gives best and median per arm
and the median of the per-repetition ratio (this / base).  Outputs of the two arms are compared
bitwise (the kernels promise the same bits).  Writes ``README.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import torch

import paired
from specdec import defaults
from specdec.engine import Engine, EngineConfig
import specdec.models.linear as linear_mod
from specdec.models import kernels, scripted


def build_base(commit: str, work: Path) -> Path:
    """Compile the kernels of ``commit`` as the ``specdec_base`` library; returns the .so path."""
    repo = Path(__file__).resolve().parent.parent
    blob = subprocess.run(["git", "-C", str(repo), "archive", commit, "src/specdec/models/csrc"],
                          check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(work, filter="data")
    csrc = work / "src" / "specdec" / "models" / "csrc"
    for f in csrc.iterdir():
        text = f.read_text()
        text = re.sub(r"TORCH_LIBRARY(_FRAGMENT|_IMPL)?\(specdec,", r"TORCH_LIBRARY\1(specdec_base,", text)
        text = re.sub(r"\bnamespace specdec\b", "namespace specdec_base", text)
        text = text.replace("specdec::", "specdec_base::").replace("torch.classes.specdec.", "torch.classes.specdec_base.")
        f.write_text(text)
    from torch.utils import cpp_extension

    names = [p.name for p in kernels._SOURCES if (csrc / p.name).is_file()]
    lib = work / "base.so"
    cmd = [kernels._compiler() or "c++", *kernels._FLAGS, kernels._march(),
           *(f"-I{p}" for p in cpp_extension.include_paths()), f"-I{sysconfig.get_paths()['include']}",
           *(str(csrc / n) for n in names), "-o", str(lib),
           *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-ltorch"]
    print(f"[library_ab] compiling {commit}'s kernels ...", file=sys.stderr)
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return lib


class _Ops:
    """One library's operators, called as this checkout calls them, at the same Python cost in both
    arms: each operator is looked up once and kept as an attribute, and the fused loops go through
    the same small wrapper in both.  For the base, the loops' weights (this checkout's
    ``torch.classes.specdec.FusedWeights``) become what the base takes, its own class of that name
    or, before it had one, the three lists; for this checkout they pass as they are.  (Until the
    arms were made alike, the base's calls went through ``__getattr__`` every time and the base's
    ``torch`` through a wrapper that looked every name up again: the same code read 2-8 % faster as
    "this" in products and attention.)"""

    def __init__(self, ns, name: str, *, convert: bool) -> None:
        self.ns, self.made, self.convert = ns, {}, convert
        try:
            takes_class = "FusedWeights" in str(ns.fused_layers.default._schema)
        except (AttributeError, RuntimeError):  # a base from before the fused loop
            takes_class = False
        self.cls = getattr(torch.classes, name).FusedWeights if takes_class else None

    def _weights(self, w):
        """What this library takes for ``w``, made once (the timed calls pay no conversion)."""
        if id(w) not in self.made:  # the entry keeps w alive, so its id stays its own
            self.made[id(w)] = (w, (w,) if not self.convert else w.parts() if self.cls is None else (self.cls(*w.parts()),))
        return self.made[id(w)][1]

    def __getattr__(self, name):  # first use of an operator only: it is kept as an attribute
        op = getattr(self.ns, name)
        if name in ("fused_layers", "fused_layers_batch"):
            at = 10 if name == "fused_layers" else 11  # the weights' position in the call
            weights = self._weights

            def call(*args, **kwargs):
                return op(*args[:at], *weights(args[at]), *args[at + 1:], **kwargs)
            setattr(self, name, call)
            return call
        setattr(self, name, op)
        return op


class _Namespaces:
    """``torch.ops`` with ``specdec`` replaced by one arm's operators; every other namespace is
    torch's (``quantized``: the LM head on fbgemm from 17 rows)."""

    def __init__(self, ops: _Ops) -> None:
        self.specdec = ops

    def __getattr__(self, name):
        value = getattr(torch.ops, name)
        setattr(self, name, value)
        return value


class _Torch:
    """``torch`` with ``torch.ops.specdec`` replaced by one arm's operators (for scripted.py and
    linear.py); every other name is torch's, looked up once."""

    def __init__(self, ops: _Ops) -> None:
        self.ops = _Namespaces(ops)

    def __getattr__(self, name):
        value = getattr(torch, name)
        setattr(self, name, value)
        return value


def alternate(arms: dict, call, reps: int) -> dict:
    times = {a: [] for a in arms}
    for rep in range(reps):
        for a in (list(arms) if rep % 2 == 0 else list(reversed(arms))):
            t = time.perf_counter()
            call(a)
            times[a].append((time.perf_counter() - t) * 1e3)
    base, this = times["base"], times["this"]
    return {"base_best_ms": min(base), "base_median_ms": statistics.median(base), "this_best_ms": min(this),
            "this_median_ms": statistics.median(this),
            "paired_ratio": statistics.median(b / a for a, b in zip(base, this))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git commit whose kernels are the baseline")
    ap.add_argument("--target", default="smollm2-135m", help="registry name of the target (default smollm2-135m)")
    ap.add_argument("--model", choices=["target", "draft"], default="target",
                    help="time the target or its default draft model (default target)")
    ap.add_argument("--rows", default="1,2,3,4,5,7,9", help="row counts (default 1,2,3,4,5,7,9)")
    ap.add_argument("--context", type=int, default=200, help="tokens before the new rows (default 200)")
    ap.add_argument("--sequences", default="",
                    help="sequence counts of batched passes, e.g. 2,4,8,16 (default: none)")
    ap.add_argument("--reps", type=int, default=24, help="paired repetitions per row count (default 24)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--out", required=True, help="output folder (README.md, results.json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(x) for x in args.rows.split(",") if x.strip()]
    engine = Engine.build(EngineConfig(target=args.target, draft=defaults.DEFAULT_DRAFT if args.model == "draft" else "none"))
    model = paired.native_model(engine.drafter) if args.model == "draft" else engine.target.model
    if not kernels.load():
        print("error: this checkout's kernels did not build here", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        torch.ops.load_library(str(build_base(args.base, Path(tmp))))
    ns = {"base": _Ops(torch.ops.specdec_base, "specdec_base", convert=True),
          "this": _Ops(torch.ops.specdec, "specdec", convert=False)}
    torches = {a: _Torch(ops) for a, ops in ns.items()}
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, model.vocab_size, (args.context,), generator=g)
    cache = model.new_cache(args.context + max(rows) + 8)
    model.forward(context, cache, last_only=True)
    lins = [getattr(layer, name) for layer in model.layers for name in ("qkv", "out", "gate_up", "down")]
    cfg = model.cfg
    k = torch.randn(cfg.n_kv_heads, args.context + max(rows), cfg.head_dim, generator=g)
    v = torch.randn(cfg.n_kv_heads, args.context + max(rows), cfg.head_dim, generator=g)
    results: dict[str, dict[int, dict]] = {"passes": {}, "products": {}, "attention": {}, "batched": {}}
    same = True
    try:
        for n in rows:
            tokens = torch.randint(0, model.vocab_size, (n,), generator=g)
            out = {}

            def one_pass(a: str) -> None:
                scripted.torch = linear_mod.torch = torches[a]
                cache.truncate(args.context)
                out[a] = model.forward(tokens, cache)

            results["passes"][n] = alternate(ns, one_pass, args.reps)
            same = same and torch.equal(out["base"], out["this"])
            xs = {lin.in_features: torch.randn(n, lin.in_features, generator=g) for lin in lins}

            def products(a: str) -> None:
                for lin in lins:
                    if getattr(lin, "vnni", None) is not None:  # W8A8 on the few-row kernel
                        out[a] = ns[a].q8_linear(xs[lin.in_features], lin.inv_smooth, *lin.vnni)[0]
                    else:  # 4-bit
                        out[a] = ns[a].q4_linear(xs[lin.in_features], lin.gain, lin.packed, lin.out_features, lin.col)

            results["products"][n] = alternate(ns, products, args.reps)
            same = same and torch.equal(out["base"], out["this"])
            q = torch.randn(n, cfg.n_heads, cfg.head_dim, generator=g) * 0.3

            def attention(a: str) -> None:
                for _ in range(cfg.n_layers):
                    out[a] = ns[a].attend(q, k, v, args.context, None)

            results["attention"][n] = alternate(ns, attention, args.reps)
            same = same and torch.equal(out["base"], out["this"])
            print(f"[library_ab] rows {n}: pass x{results['passes'][n]['paired_ratio']:.3f}", file=sys.stderr)
        seqs = [int(x) for x in args.sequences.split(",") if x.strip()]
        lengths = [args.context + 7 * i for i in range(max(seqs, default=0))]  # prompts of different lengths
        caches = []
        for length in lengths:
            c = model.new_cache(length + 8)
            model.forward(torch.randint(0, model.vocab_size, (length,), generator=g), c, last_only=True)
            caches.append(c)
        for s in seqs:
            items = [(torch.randint(0, model.vocab_size, (1,), generator=g), caches[i], True) for i in range(s)]
            out = {}

            def batched(a: str) -> None:
                scripted.torch = linear_mod.torch = torches[a]
                for c, length in zip(caches, lengths):
                    c.truncate(length)
                out[a] = torch.cat(model.forward_batch(items))

            results["batched"][s] = alternate(ns, batched, args.reps)
            same = same and torch.equal(out["base"], out["this"])
            print(f"[library_ab] {s} sequences: batched pass x{results['batched'][s]['paired_ratio']:.3f}", file=sys.stderr)
    finally:
        scripted.torch = linear_mod.torch = torch
    body = [
        f"Base: kernels of `{args.base}`; this: the checkout's. Target `{args.target}`"
        f"{' (timed: its default draft model)' if args.model == 'draft' else ''}, {args.context}-token "
        f"context, {args.reps} repetitions per row count, both arms alternated in each, {args.threads} threads. "
        "Times in ms; ratio = median over repetitions of this / base (below 1: this is faster). "
        f"Outputs of the two arms bitwise equal: {'yes' if same else 'NO'}.", "",
    ]
    for part, what in (("passes", "Forward pass over n new tokens (the fused layer loop and the LM head)"),
                       ("products", f"The {'draft' if args.model == 'draft' else 'target'}'s {len(lins)} layer products, n rows"),
                       ("attention", f"Attention over {args.context} keys, n rows, all {cfg.n_layers} layers"),
                       ("batched", f"Batched pass (forward_batch): n sequences of one new token, sequence i after its own "
                                   f"prompt of {args.context} + 7 i tokens")):
        if not results[part]:
            continue
        unit = "sequences" if part == "batched" else "rows"
        body += [f"## {what}", "", f"| {unit} | base best / median | this best / median | ratio |", "|---|---|---|---|"]
        for n, r in results[part].items():
            body.append(f"| {n} | {r['base_best_ms']:.2f} / {r['base_median_ms']:.2f} | "
                        f"{r['this_best_ms']:.2f} / {r['this_median_ms']:.2f} | {r['paired_ratio']:.3f} |")
        body.append("")
    paired.write_report(args.out, "Kernels at another commit against this checkout's, paired in one process",
                               {"base": args.base, "target": args.target, "model": args.model, "context": args.context, "reps": args.reps,
                                "threads": args.threads, "same_bits": same, **results}, body)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
