#!/usr/bin/env python
"""A server's own speculation, one request at a time: γ auto continuing from request to request
or fresh per request, the draft cap on its measured cost curve, on a straight line or off, against
plain decoding, paired in one server process.

    python scripts/served_gamma_ab.py --draft layerskip:24 --repeats 3 --out benchmarks/NAME
    python scripts/served_gamma_ab.py --draft ngram --arms plain,kept,line,nocap --repeats 3 --out benchmarks/NAME
    python scripts/served_gamma_ab.py --draft smollm2-135m-draft+lookup --arms plain,kept,tree-auto,tree-8 --out benchmarks/NAME

Not a test and not part of CI.  Builds the serving app in process (batching on, as ``specdec
serve`` runs it) and sends every built-in prompt, as token ids, to ``/v1/completions`` through
an in-process HTTP client, once per arm: ``plain`` with the server's drafter switched off,
``fresh`` with a new γ memory for the request (what every request got before the server kept
one: a fresh controller), ``kept`` with one memory that lives through the whole run (what the
server does now), ``line`` as ``kept`` with the draft cap's cost curve replaced by the straight
line through its one-row and 96-row points (what the cap used before it had a curve), ``nocap``
as ``kept`` with the draft cap off, ``tree-auto`` / ``tree-N`` as ``kept`` with the request's
``tree`` field set (token trees: a node budget from the tree's own controller, or N nodes; neither
the γ memory nor the cap applies to tree rounds).  Each continuing arm has a memory of its own (each request
continues from the arm's last one); the arms share the cap's estimates.  Arms alternate in an
order rotated per prompt and reversed on odd repeats, one seed per prompt and repeat shared by
every arm.  Timed: the request, client side.  Writes
``results.json`` and ``README.md`` (geometric means of the per-request ratios over plain, by
category; draft tokens proposed per request; at T = 0 whether the text equals plain's).
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import paired

from specdec.gamma import GammaMemory
from specdec.server.draft_cap import RowCosts
from specdec.sampling import SamplingConfig

ARMS = ("plain", "fresh", "kept", "line", "nocap", "tree-auto", "tree-N")


def _tree(arm: str) -> str | int | None:
    """The request's ``tree`` field of a ``tree-auto`` / ``tree-N`` arm (None: a chain arm)."""
    if not arm.startswith("tree-"):
        return None
    shape = arm[len("tree-"):]
    return "auto" if shape == "auto" else int(shape)


def _known(arm: str) -> bool:
    return arm in ARMS[1:5] or arm == "tree-auto" or (arm.startswith("tree-") and arm[5:].isdigit() and int(arm[5:]) > 0)


@dataclass(frozen=True)
class _Served:
    """One request's outcome, as the client sees it."""

    text: str
    wall_s: float
    completion_tokens: int
    proposed: int
    tokens_per_call: float
    tree_rounds: int


def main() -> int:
    ap = paired.parser(__doc__)
    ap.set_defaults(draft="layerskip:24")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arms", default="plain,fresh,kept", help=f"plain first, then any of {', '.join(ARMS[1:])} (N a node count)")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if arms[0] != "plain" or len(arms) < 2 or not all(_known(a) for a in arms[1:]):
        raise SystemExit(f"--arms: plain first, then any of {', '.join(ARMS[1:])} (N a node count)")

    import torch
    from fastapi.testclient import TestClient

    from specdec.bench.workloads import BUILTIN, select
    from specdec.engine import encode_prompt

    torch.set_num_threads(args.threads)
    temps = [float(t) for t in args.temperatures.split(",")]
    prompts = select(list(BUILTIN), limit=args.limit)
    app = _app(args)
    ctx = app.state.ctx
    factory, cap = ctx.drafter_factory, ctx.draft_cap
    kept = {a: GammaMemory() for a in arms}  # each continuing arm continues its own requests' controllers
    curve = cap._costs if cap is not None else None
    line = None
    if curve is not None:  # the line through the curve's ends, as the cap's calibration was before
        b = (curve.seconds[-1] - curve.seconds[0]) / (curve.rows[-1] - curve.rows[0])
        line = RowCosts.line(curve.seconds[0] - b * curve.rows[0], b)
    if any(a in ("line", "nocap") for a in arms) and curve is None:
        raise SystemExit("the line and nocap arms need the batching server's calibrated draft cap")
    client = TestClient(app, base_url="http://localhost")

    def generate(arm: str):  # noqa: ANN202 - a call decoding ids with a sampling config
        def run(ids: list[int], cfg: SamplingConfig) -> _Served:
            ctx.drafter_factory = None if arm == "plain" else factory
            ctx.gamma_memory = GammaMemory() if arm == "fresh" else kept[arm]
            ctx.draft_cap = None if arm == "nocap" else cap
            if cap is not None:
                cap._costs = line if arm == "line" else curve
            body = {"prompt": ids, "max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "gamma": "auto"}
            if _tree(arm) is not None:
                body["tree"] = _tree(arm)
            if cfg.seed is not None:
                body["seed"] = cfg.seed
            t0 = time.perf_counter()
            r = client.post("/v1/completions", json=body)
            wall = time.perf_counter() - t0
            if r.status_code != 200:
                raise SystemExit(f"the server answered {r.status_code}: {r.text}")
            out = r.json()
            return _Served(out["choices"][0]["text"], wall, out["usage"]["completion_tokens"],
                           out["specdec"]["draft_tokens_proposed"], out["specdec"]["tokens_per_target_call"],
                           out["specdec"]["tree_rounds"])
        return run

    tok = ctx.tokenizer
    rows = []
    for p, temp, rep, res in paired.rotated({a: generate(a) for a in arms},
                                            lambda p: encode_prompt(tok, p.text, chat=p.chat),
                                            prompts, temps, args.repeats, args.max_new_tokens):
        ref = res["plain"]
        for a in arms:
            s = res[a]
            rows.append({"prompt": p.id, "category": p.category, "temperature": temp, "repeat": rep, "arm": a,
                         "tok_s": s.completion_tokens / s.wall_s, "speedup": (s.completion_tokens / s.wall_s)
                         / (ref.completion_tokens / ref.wall_s), "proposed": s.proposed,
                         "tokens_per_call": s.tokens_per_call, "tree_rounds": s.tree_rounds, "same": s.text == ref.text})

    lines = [f"{len(prompts)} prompts × {args.repeats} repeats, {args.max_new_tokens} tokens, `/v1/completions` of an "
             f"in-process server (batching on) with `{args.draft}`, one request at a time, every arm on every prompt "
             "(order rotated per prompt, reversed on odd repeats). `fresh`: a new γ controller for every request; "
             "`kept`: each request's controller the successor of the arm's last ended one's; `line`: `kept` with the draft "
             "cap's cost curve replaced by the line through its ends; `nocap`: `kept` without the draft cap; `tree-auto` / "
             "`tree-N`: `kept` with the request's `tree` field (auto, or N nodes). "
             + (f"The cap's curve: {_curve(curve)}. " if curve is not None else "") + "×plain = geometric mean of the "
             "per-request ratios (tokens over the request's wall time, client side) over plain decoding of the same "
             "prompt and repeat.", "",
             *paired.arm_table(rows, temps, arms, [
                 ("draft tokens / request", lambda rs: f"{statistics.mean(r['proposed'] for r in rs):.1f}"),
                 ("tokens/call", lambda rs: f"{statistics.mean(r['tokens_per_call'] for r in rs):.2f}"),
                 ("tree rounds / request", lambda rs: f"{statistics.mean(r['tree_rounds'] for r in rs):.1f}")],
                 same="text = plain")]
    paired.write_report(args.out, f"A server's own speculation, one request at a time, paired ({args.target} + {args.draft})",
                        {"arms": arms, "curve": None if curve is None else {"rows": curve.rows, "seconds": curve.seconds},
                         "rows": rows}, lines)
    return 0


def _curve(curve) -> str:  # noqa: ANN001 - RowCosts
    """The cost curve as 'rows: ms' pairs."""
    return ", ".join(f"{r} rows {1e3 * s:.2f} ms" for r, s in zip(curve.rows, curve.seconds))


def _app(args):  # noqa: ANN001, ANN202 - argparse namespace, the FastAPI app
    """The app ``specdec serve --target T --draft D --dtype X`` builds (default settings otherwise)."""
    import argparse

    from specdec.server.command import build_app

    ns = argparse.Namespace(target=args.target, draft=args.draft, backend="auto", dtype=args.dtype, draft_dtype="auto",
                            draft_vocab="auto", draft_temperature_factor="auto", int8_kernel="auto")
    return build_app(ns, {})


if __name__ == "__main__":
    sys.exit(main())
