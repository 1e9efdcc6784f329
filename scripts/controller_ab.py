#!/usr/bin/env python
"""γ auto against another revision's γ auto (and fixed γs), paired in one process.

    python scripts/controller_ab.py --arms plain,auto,1,2,3 --repeats 3 --out benchmarks/NAME
    python scripts/controller_ab.py --base REV --arms plain,base,auto --repeats 3 --out benchmarks/NAME

Not a test and not part of CI.  ``base`` runs the cost controllers of ``src/specdec/gamma.py``
as committed at ``--base`` (loaded from git as a module of its own: the model drafter's γ and
prompt lookup's length both come from it; only with ``--base``), ``auto`` this checkout's, a number a fixed γ for the
model's drafts (prompt lookup's length stays this checkout's γ auto), ``plain`` plain decoding,
``fresh`` this checkout's γ auto with a new controller for every sequence (``auto`` is what
``Engine.decoder`` hands out: the successor of the engine's last controller, see
``CostGamma.successor``).
Chains only (``--tree chain``).  For each repeat, temperature and prompt every arm runs once, in
an order rotated per prompt and reversed on odd repeats, with one seed per prompt and repeat
shared by every arm (greedy verification at T = 0, block verification above it); each run's
speed-up is over the plain run of the same prompt, repeat and temperature.  Writes
``results.json`` and ``README.md`` (geometric means of the per-run ratios by category, tokens per
call, mean γ, and at T = 0 whether the output equals plain greedy output).
"""

from __future__ import annotations

import importlib.util
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import paired

import specdec.drafters.hybrid as hybrid
from specdec.gamma import CostGamma
from specdec.sampling import SamplingConfig
from specdec.verify import get_rule


def load_base(rev: str):  # noqa: ANN201 - a module
    """``src/specdec/gamma.py`` as committed at ``rev``, imported under a name of its own."""
    root = Path(__file__).resolve().parent.parent
    text = subprocess.run(["git", "-C", str(root), "show", f"{rev}:src/specdec/gamma.py"], check=True,
                          capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "base_gamma.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("base_gamma", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["base_gamma"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@contextmanager
def lookup_controller(cls):  # noqa: ANN001, ANN201
    """Prompt lookup's length controller (made per sequence in the hybrid drafter) from ``cls``."""
    saved = hybrid.CostGamma
    hybrid.CostGamma = cls
    try:
        yield
    finally:
        hybrid.CostGamma = saved


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--base", help="the git revision whose gamma.py the 'base' arm runs")
    ap.add_argument("--arms", default="plain,base,auto")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    arms = args.arms.split(",")
    if arms[0] != "plain" or any(a not in ("base", "auto", "fresh") and not a.isdigit() for a in arms[1:]):
        raise SystemExit("arms: plain first, then base, auto, fresh and / or fixed γs (numbers)")
    if "base" in arms and not args.base:
        raise SystemExit("the 'base' arm needs --base REV")
    base = load_base(args.base) if "base" in arms else None
    temps, prompts, engine, plain = paired.setup(args)

    def generate(arm: str):  # noqa: ANN202 - a call decoding ids with a sampling config
        def run(ids: list[int], cfg: SamplingConfig):  # noqa: ANN202
            rule = get_rule("greedy" if cfg.greedy else "block")
            if arm == "plain":
                return plain.decoder(rule).generate(ids, cfg)
            if arm == "base":
                with lookup_controller(base.CostGamma):
                    return engine.decoder(rule, gamma=base.CostGamma(), tree="chain").generate(ids, cfg)
            if arm == "fresh":  # this checkout's controller, new for every sequence (nothing carried over)
                return engine.decoder(rule, gamma=CostGamma(), tree="chain").generate(ids, cfg)
            return engine.decoder(rule, gamma=arm if arm == "auto" else int(arm), tree="chain").generate(ids, cfg)
        return run

    rows = []
    for p, temp, rep, res in paired.rotated({a: generate(a) for a in arms}, lambda p: engine.encode(p.text, chat=p.chat),
                                            prompts, temps, args.repeats, args.max_new_tokens):
        for a in arms:
            rows.append(paired.run_row(p, temp, rep, res[a], res["plain"], arm=a, mean_gamma=res[a].stats.mean_gamma))

    lines = [f"{len(prompts)} prompts × {args.repeats} repeats, {args.max_new_tokens} tokens, chains, every arm on every "
             f"prompt in one process (order rotated per prompt, reversed on odd repeats). "
             + (f"`base`: γ auto as committed at `{args.base}`; " if base is not None else "")
             + "`auto`: this checkout's γ auto (each sequence's controller the successor of the engine's last one);"
             " `fresh`: the same controller new for every sequence; a number: that fixed γ for the draft model. ×plain = geometric mean of the "
             "per-run ratios over plain decoding of the same prompt and repeat.", "",
             *paired.arm_table(rows, temps, arms, [
                 ("tokens/call", lambda rs: f"{statistics.mean(r['tokens_per_call'] for r in rs):.2f}"),
                 ("mean γ", lambda rs: f"{statistics.mean(r['mean_gamma'] for r in rs):.2f}")])]
    title = f"γ auto against `{args.base}`'s" if base is not None else "γ auto against fixed γs"
    paired.write_report(args.out, f"{title}, paired ({args.target} + {args.draft})",
                        {"base": args.base, "rows": rows}, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
