#!/usr/bin/env python
"""γ auto across a server's requests: each request's controller continuing from the last one's
against a fresh controller per request, and plain decoding, paired in one server process.

    python scripts/served_gamma_ab.py --draft layerskip:24 --repeats 3 --out benchmarks/NAME

Not a test and not part of CI.  Builds the serving app in process (batching on, as ``specdec
serve`` runs it) and sends every built-in prompt, as token ids, to ``/v1/completions`` through
an in-process HTTP client, once per arm: ``plain`` with the server's drafter switched off,
``fresh`` with a new γ memory for the request (what every request got before the server kept
one: a fresh controller), ``kept`` with one memory that lives through the whole run (what the
server does now).  Arms alternate in an order rotated per prompt and reversed on odd repeats,
one seed per prompt and repeat shared by every arm.  Timed: the request, client side.  Writes
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
from specdec.sampling import SamplingConfig

ARMS = ("plain", "fresh", "kept")


@dataclass(frozen=True)
class _Served:
    """One request's outcome (``tokens`` for :func:`paired.rotated`'s callers: the text's)."""

    text: str
    wall_s: float
    completion_tokens: int
    proposed: int
    tokens_per_call: float


def main() -> int:
    ap = paired.parser(__doc__)
    ap.set_defaults(draft="layerskip:24")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch
    from fastapi.testclient import TestClient

    from specdec.bench.workloads import BUILTIN, select
    from specdec.engine import encode_prompt

    torch.set_num_threads(args.threads)
    temps = [float(t) for t in args.temperatures.split(",")]
    prompts = select(list(BUILTIN), limit=args.limit)
    app = _app(args)
    ctx = app.state.ctx
    factory, kept = ctx.drafter_factory, GammaMemory()
    client = TestClient(app, base_url="http://localhost")

    def generate(arm: str):  # noqa: ANN202 - a call decoding ids with a sampling config
        def run(ids: list[int], cfg: SamplingConfig) -> _Served:
            ctx.drafter_factory = None if arm == "plain" else factory
            ctx.gamma_memory = kept if arm == "kept" else GammaMemory()
            body = {"prompt": ids, "max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "gamma": "auto"}
            if cfg.seed is not None:
                body["seed"] = cfg.seed
            t0 = time.perf_counter()
            r = client.post("/v1/completions", json=body)
            wall = time.perf_counter() - t0
            if r.status_code != 200:
                raise SystemExit(f"the server answered {r.status_code}: {r.text}")
            out = r.json()
            return _Served(out["choices"][0]["text"], wall, out["usage"]["completion_tokens"],
                           out["specdec"]["draft_tokens_proposed"], out["specdec"]["tokens_per_target_call"])
        return run

    tok = ctx.tokenizer
    rows = []
    for p, temp, rep, res in paired.rotated({a: generate(a) for a in ARMS},
                                            lambda p: encode_prompt(tok, p.text, chat=p.chat),
                                            prompts, temps, args.repeats, args.max_new_tokens):
        ref = res["plain"]
        for a in ARMS:
            s = res[a]
            rows.append({"prompt": p.id, "category": p.category, "temperature": temp, "repeat": rep, "arm": a,
                         "tok_s": s.completion_tokens / s.wall_s, "speedup": (s.completion_tokens / s.wall_s)
                         / (ref.completion_tokens / ref.wall_s), "proposed": s.proposed,
                         "tokens_per_call": s.tokens_per_call, "same": s.text == ref.text})

    lines = [f"{len(prompts)} prompts × {args.repeats} repeats, {args.max_new_tokens} tokens, `/v1/completions` of an "
             f"in-process server (batching on) with `{args.draft}`, one request at a time, every arm on every prompt "
             "(order rotated per prompt, reversed on odd repeats). `fresh`: a new γ controller for every request; "
             "`kept`: each request's controller the successor of the last ended one's. ×plain = geometric mean of the "
             "per-request ratios (tokens over the request's wall time, client side) over plain decoding of the same "
             "prompt and repeat.", "",
             "| T | arm | ×plain (all) | chat | code | draft tokens / request | tokens/call | text = plain |",
             "|---|---|---|---|---|---|---|---|"]
    for temp in temps:
        for a in ARMS[1:]:
            rs = [r for r in rows if r["arm"] == a and r["temperature"] == temp]
            by = {c: paired.gmean([r["speedup"] for r in rs if r["category"] == c]) for c in ("chat", "code")}
            same = f"{sum(r['same'] for r in rs)}/{len(rs)}" if temp == 0 else "n/a"
            lines.append(f"| {temp:g} | {a} | {paired.gmean([r['speedup'] for r in rs]):.3f} | {by['chat']:.3f} "
                         f"| {by['code']:.3f} | {statistics.mean(r['proposed'] for r in rs):.1f} "
                         f"| {statistics.mean(r['tokens_per_call'] for r in rs):.2f} | {same} |")
    paired.write_report(args.out, f"γ auto across a server's requests, paired ({args.target} + {args.draft})",
                        {"rows": rows}, lines)
    return 0


def _app(args):  # noqa: ANN001, ANN202 - argparse namespace, the FastAPI app
    """The app ``specdec serve --target T --draft D --dtype X`` builds (default settings otherwise)."""
    import argparse

    from specdec.server.command import build_app

    ns = argparse.Namespace(target=args.target, draft=args.draft, backend="auto", dtype=args.dtype, draft_dtype="auto",
                            draft_vocab="auto", draft_temperature_factor="auto", int8_kernel="auto")
    return build_app(ns, {})


if __name__ == "__main__":
    sys.exit(main())
