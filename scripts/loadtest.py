#!/usr/bin/env python
"""Load test of ``specdec serve``: many concurrent edge sessions for a while (not part of CI).

    python scripts/loadtest.py --out loadtest-run --sessions 32 --duration 120

Starts a server (``--draft none``: the verify API needs no drafter) and runs ``--sessions`` edge
sessions at once, each a thread of this process with its own connection, looping over distinct
prompts until ``--duration`` seconds have passed.  Every verdict is checked against the edge's own
context by the client (a verdict that does not continue the edge's draft and committed tokens is a
``RemoteError``, counted as an error).  Even-numbered sessions decode greedily, odd ones sample at
``--temperature`` over the coupled wire with their own seeds; both are exact, so after the load
phase a sample of the outputs (``--check``) is compared token for token with a local target-only
run of the same prompt and seed: a token from another session would show up as a mismatch.  The
server's resident memory is sampled every ``--rss-interval`` seconds.

Writes ``summary.json``, ``README.md`` (with the exact command), ``rss.csv`` and ``metrics.txt``
(the server's Prometheus text at the end) under ``--out``.  Exit status 1 when any generation
failed or any checked output differed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: at most this many error messages are kept verbatim in the summary
MAX_ERROR_MESSAGES = 10


@dataclass
class Generation:
    """One finished (or failed) generation of one session."""

    session: int
    index: int  # the session's k-th generation
    prompt_id: str
    wire: str
    temperature: float
    seed: int
    started_s: float  # since the load phase began
    wall_s: float
    tokens: list[int] = field(default_factory=list)
    verify_calls: int = 0
    retries: int = 0
    session_recreates: int = 0
    error: str | None = None


# ----------------------------------------------------------------------------- pure helpers


def session_prompt(session: int, index: int, bases: list[tuple[str, str, bool]]) -> tuple[str, str, bool]:
    """A prompt no other (session, index) uses: (id, text, chat)."""
    pid, text, chat = bases[(session + index) % len(bases)]
    tag = f"request {session}-{index}"
    if chat:
        return f"{pid}#{tag}", f"({tag}) {text}", True
    return f"{pid}#{tag}", f"# {tag}\n{text}", False


def session_sampling(session: int, index: int, temperature: float) -> tuple[str, float, int]:
    """(wire, temperature, seed): greedy for even sessions, coupled sampling for odd ones."""
    if session % 2 == 0:
        return "greedy", 0.0, 0
    return "coupled", temperature, 1_000_003 * session + index


def rss_trend(samples: list[tuple[float, int]]) -> dict[str, Any]:
    """Min / max / first / last RSS (MiB) and the least-squares slope (MiB per minute) of (seconds, bytes) samples.

    ``second_half_slope`` fits only the samples after the midpoint (past start-up growth)."""
    if not samples:
        return {"samples": 0}
    mib = [(t, b / 2**20) for t, b in samples]

    def slope(points: list[tuple[float, float]]) -> float | None:
        if len(points) < 2:
            return None
        mt = statistics.fmean(t for t, _ in points)
        mv = statistics.fmean(v for _, v in points)
        den = sum((t - mt) ** 2 for t, _ in points)
        return 60.0 * sum((t - mt) * (v - mv) for t, v in points) / den if den else None

    mid = (mib[0][0] + mib[-1][0]) / 2
    return {
        "samples": len(mib),
        "min_mib": min(v for _, v in mib),
        "max_mib": max(v for _, v in mib),
        "first_mib": mib[0][1],
        "last_mib": mib[-1][1],
        "slope_mib_per_min": slope(mib),
        "second_half_slope_mib_per_min": slope([p for p in mib if p[0] >= mid]),
    }


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(gens: list[Generation], duration_s: float, sessions: int) -> dict[str, Any]:
    """Counts, tokens, throughput (over ``duration_s``, the load phase's wall time), latency and errors."""
    ok = [g for g in gens if g.error is None]
    failed = [g for g in gens if g.error is not None]
    kinds: dict[str, int] = {}
    for g in failed:
        kind = g.error.split(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    per_session = [sum(1 for g in ok if g.session == s) for s in range(sessions)]
    tokens = sum(len(g.tokens) for g in ok)
    return {
        "generations_completed": len(ok),
        "generations_failed": len(failed),
        "sessions_with_a_completed_generation": sum(1 for n in per_session if n),
        "completed_per_session_min": min(per_session) if per_session else 0,
        "completed_per_session_max": max(per_session) if per_session else 0,
        "tokens": tokens,
        "tokens_per_s": tokens / duration_s if duration_s > 0 else None,
        "verify_calls": sum(g.verify_calls for g in ok),
        "retries": sum(g.retries for g in gens),
        "session_recreates": sum(g.session_recreates for g in gens),
        "latency_p50_s": _quantile([g.wall_s for g in ok], 0.5),
        "latency_p95_s": _quantile([g.wall_s for g in ok], 0.95),
        "errors_by_kind": kinds,
        "error_messages": [f"session {g.session} #{g.index}: {g.error}" for g in failed[:MAX_ERROR_MESSAGES]],
    }


def pick_for_check(gens: list[Generation], n: int) -> list[Generation]:
    """Up to ``n`` completed generations, spread over the sessions (each one's first, then second, ...)."""
    ok = sorted((g for g in gens if g.error is None), key=lambda g: (g.index, g.session))
    return ok[:n]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def markdown(summary: dict[str, Any]) -> str:
    c, s, r, chk = summary["config"], summary["load"], summary["server_rss"], summary["check"]

    def f(x: Any, nd: int = 1) -> str:
        return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))

    lines = [
        "# specdec server load test", "",
        f"Command: `{summary['command']}`", "",
        f"Result: **{'PASS' if summary['passed'] else 'FAIL'}** — {s['generations_failed']} failed generations, "
        f"{chk['mismatches_count']} of {chk['checked']} checked outputs differ from the local reference.", "",
        f"Target `{c['target']}` served by `specdec serve --draft none` ({c['server_threads']} torch thread(s)); "
        f"{c['sessions']} concurrent edge sessions in one process (draft `{c['draft']}`, {c['edge_threads']} torch "
        f"thread(s)) for {c['duration_s']:g} s, {c['max_new_tokens']} new tokens per generation, even sessions "
        f"greedy, odd sessions coupled sampling at T = {c['temperature']:g}; emulated RTT {c['rtt_ms']:g} ms.", "",
        "| load phase | |", "|---|---|",
        f"| generations completed | {s['generations_completed']} |",
        f"| generations failed | {s['generations_failed']} {s['errors_by_kind'] or ''} |",
        f"| sessions with ≥ 1 completed generation | {s['sessions_with_a_completed_generation']} / {c['sessions']} |",
        f"| completed per session (min – max) | {s['completed_per_session_min']} – {s['completed_per_session_max']} |",
        f"| tokens generated | {s['tokens']} ({f(s['tokens_per_s'])} tok/s over all sessions) |",
        f"| verify calls | {s['verify_calls']} |",
        f"| retries / re-created sessions | {s['retries']} / {s['session_recreates']} |",
        f"| generation latency p50 / p95 s | {f(s['latency_p50_s'], 2)} / {f(s['latency_p95_s'], 2)} |",
        f"| wall time of the load phase s | {f(summary['load_wall_s'])} |", "",
        "| server RSS (MiB) | |", "|---|---|",
        f"| samples | {r.get('samples', 0)} every {c['rss_interval_s']:g} s |",
        f"| min / max | {f(r.get('min_mib'))} / {f(r.get('max_mib'))} |",
        f"| first / last | {f(r.get('first_mib'))} / {f(r.get('last_mib'))} |",
        f"| trend (least squares), whole run / second half | {f(r.get('slope_mib_per_min'), 2)} / "
        f"{f(r.get('second_half_slope_mib_per_min'), 2)} MiB/min |", "",
        f"Reference check: {chk['checked']} outputs (spread over the sessions) re-generated locally by the target "
        f"alone with the same prompt, wire rule and seed: {chk['matched']} identical token for token.",
    ]
    if chk["mismatches"]:
        lines += ["", "| session | # | prompt | first differing token |", "|---|---|---|---|"]
        lines += [f"| {m['session']} | {m['index']} | {m['prompt_id']} | {m['first_difference']} |" for m in chk["mismatches"]]
    if s["error_messages"]:
        lines += ["", "Errors (first ones):", ""] + [f"- {m}" for m in s["error_messages"]]
    lines += ["", "Files: `summary.json` (everything above and every generation), `rss.csv`, `metrics.txt` "
              "(the server's Prometheus metrics at the end of the load phase)."]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- the run


class RssSampler(threading.Thread):
    """Samples a process's VmRSS every ``interval`` seconds until stopped."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True, name="rss-sampler")
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self.stop_event = threading.Event()
        self.start_time = time.perf_counter()

    def run(self) -> None:
        while not self.stop_event.is_set():
            rss = _vm_rss(self.pid)
            if rss is not None:
                self.samples.append((time.perf_counter() - self.start_time, rss))
            self.stop_event.wait(self.interval)


def _vm_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _session_loop(i: int, args: argparse.Namespace, ctx: dict[str, Any], deadline: float, t0: float,
                  out: list[Generation], lock: threading.Lock) -> None:
    """One edge session: generate until the deadline, recording every generation."""
    import httpx

    from specdec.drafters import ModelDrafter, NgramDrafter
    from specdec.remote.client import RemoteConfig
    from specdec.remote.edge import generate_remote
    from specdec.sampling import SamplingConfig
    from specdec.text import encode_prompt

    k = 0
    with httpx.Client(timeout=httpx.Timeout(120.0, connect=10.0)) as client:
        while time.perf_counter() < deadline:
            pid, text, chat = session_prompt(i, k, ctx["bases"])
            wire, temp, seed = session_sampling(i, k, args.temperature)
            started = time.perf_counter()
            gen = Generation(i, k, pid, wire, temp, seed, started - t0, 0.0)
            try:
                ids = encode_prompt(ctx["tokenizer"], text, chat=chat)
                drafter = ModelDrafter(ctx["draft_model"]) if ctx["draft_model"] is not None else NgramDrafter()
                res = generate_remote(
                    ids, SamplingConfig(temperature=temp, seed=seed, max_new_tokens=args.max_new_tokens),
                    RemoteConfig(url=ctx["url"], api_key=ctx["api_key"], wire=wire, timeout_s=120.0),
                    drafter=drafter, gamma=args.gamma, eos_ids=ctx["eos_ids"], client=client,
                )
                gen.tokens = list(res.token_ids)
                gen.verify_calls = res.remote["verify_calls"]
                gen.retries = res.remote["retries"]
                gen.session_recreates = res.remote["session_recreates"]
                ctx["inputs"][(i, k)] = ids
            except Exception as exc:  # noqa: BLE001 - every failure is counted, the session goes on
                gen.error = f"{type(exc).__name__}: {exc}"
                if args.verbose:
                    traceback.print_exc()
                time.sleep(0.5)
            gen.wall_s = time.perf_counter() - started
            with lock:
                out.append(gen)
            k += 1


def _check(args: argparse.Namespace, gens: list[Generation], inputs: dict) -> dict[str, Any]:
    """Re-generate a sample of the outputs with the target alone, here; compare token for token."""
    from specdec.engine import Engine, EngineConfig
    from specdec.sampling import SamplingConfig

    chosen = pick_for_check(gens, args.check)
    if not chosen:
        return {"checked": 0, "matched": 0, "mismatches": [], "mismatches_count": 0}
    engine = Engine.build(EngineConfig(target=args.target, draft="none"))
    mismatches = []
    for g in chosen:
        cfg = SamplingConfig(temperature=g.temperature, seed=g.seed, max_new_tokens=args.max_new_tokens)
        ref = engine.generate(inputs[(g.session, g.index)], cfg, method="greedy" if g.wire == "greedy" else "coupled")
        diff = first_difference(g.tokens, ref.token_ids)
        if diff is not None:
            mismatches.append({"session": g.session, "index": g.index, "prompt_id": g.prompt_id, "first_difference": diff})
    return {"checked": len(chosen), "matched": len(chosen) - len(mismatches), "mismatches": mismatches,
            "mismatches_count": len(mismatches)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for summary.json, README.md, rss.csv, metrics.txt")
    p.add_argument("--sessions", type=int, default=32, help="concurrent edge sessions (default 32)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load (default 120)")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="smollm2-135m-draft", help="the edges' draft model, or 'ngram' (puts nearly all work on the server)")
    p.add_argument("--tokenizer", default="smollm2-135m-draft", help="tokenizer source when --draft ngram")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--gamma", default="4", help="draft length (default 4; 'auto' also works)")
    p.add_argument("--temperature", type=float, default=0.8, help="temperature of the odd (coupled) sessions")
    p.add_argument("--check", type=int, default=16, help="outputs to re-generate locally and compare (default 16)")
    p.add_argument("--rtt-ms", type=float, default=0.0, help="emulated RTT through the delay proxy (default 0: direct)")
    p.add_argument("--server-threads", type=int, default=1, help="torch threads of the server (default 1)")
    p.add_argument("--edge-threads", type=int, default=1, help="torch threads of this (edge) process (default 1)")
    p.add_argument("--rss-interval", type=float, default=1.0, help="seconds between server RSS samples (default 1)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failed generations")
    args = p.parse_args(argv)
    if args.sessions < 1 or args.duration <= 0 or args.max_new_tokens < 1 or args.check < 0 or args.rss_interval <= 0:
        p.error("--sessions, --duration, --max-new-tokens and --rss-interval must be positive, --check >= 0")
    args.gamma = int(args.gamma) if args.gamma.isdigit() else args.gamma
    return args


def _edge_context(args: argparse.Namespace) -> dict[str, Any]:
    """Tokenizer, draft model (shared by the sessions, one forward at a time), EOS ids, prompts."""
    from transformers import AutoTokenizer

    from specdec.bench.workloads import BUILTIN
    from specdec.engine import EngineConfig, load_draft
    from specdec.models.registry import resolve
    from specdec.server.sessions import serialized

    if args.draft == "ngram":
        tokenizer = AutoTokenizer.from_pretrained(str(resolve(args.tokenizer).folder))
        draft_model, eos = None, frozenset({tokenizer.eos_token_id} - {None})
    else:
        draft = load_draft(EngineConfig(draft=args.draft))
        tokenizer, eos = draft.tokenizer, draft.eos_ids
        draft_model = serialized(draft.model, threading.Lock())
    bases = [(p.id, p.text, p.chat) for p in BUILTIN]
    return {"tokenizer": tokenizer, "draft_model": draft_model, "eos_ids": eos, "bases": bases, "inputs": {}}


def _wait_ready(url: str, server: Any, timeout_s: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.failure():
            raise SystemExit(server.failure())
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"the server did not answer /health within {timeout_s:.0f} s")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(args.edge_threads)
    import httpx
    import torch

    from specdec.bench.network import CloudServer, Emulation, Link

    torch.set_num_threads(args.edge_threads)
    ctx = _edge_context(args)
    server = CloudServer(args.target, "none", threads=args.server_threads, emulation=Emulation("proxy", "load test"))
    server.start()
    link = None
    try:
        _wait_ready(server.url, server)
        link = Link(server, args.rtt_ms).start() if args.rtt_ms > 0 else None
        ctx.update(url=link.url if link else server.url, api_key=server.api_key)
        sampler = RssSampler(server.proc.pid, args.rss_interval)
        sampler.start()
        gens: list[Generation] = []
        lock = threading.Lock()
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        threads = [threading.Thread(target=_session_loop, args=(i, args, ctx, deadline, t0, gens, lock), daemon=True)
                   for i in range(args.sessions)]
        print(f"[loadtest] {args.sessions} sessions for {args.duration:g} s against {ctx['url']}", file=sys.stderr, flush=True)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        load_wall = time.perf_counter() - t0
        sampler.stop_event.set()
        sampler.join()
        metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=10).text
    finally:
        if link is not None:
            link.stop()
        server.stop()
    print(f"[loadtest] {len(gens)} generations; checking {min(args.check, len(gens))} against the local target", file=sys.stderr, flush=True)
    check = _check(args, gens, ctx["inputs"])
    load = summarize(gens, load_wall, args.sessions)
    summary = {
        "command": command,
        "config": {"target": args.target, "draft": args.draft, "sessions": args.sessions, "duration_s": args.duration,
                   "max_new_tokens": args.max_new_tokens, "gamma": args.gamma, "temperature": args.temperature,
                   "rtt_ms": args.rtt_ms, "server_threads": args.server_threads, "edge_threads": args.edge_threads,
                   "rss_interval_s": args.rss_interval, "check": args.check},
        "load_wall_s": load_wall, "load": load, "server_rss": rss_trend(sampler.samples), "check": check,
        "passed": load["generations_failed"] == 0 and check["mismatches_count"] == 0 and load["generations_completed"] > 0,
        "generations": [asdict(g) for g in gens],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "README.md").write_text(markdown(summary))
    (out / "rss.csv").write_text("seconds,rss_bytes\n" + "".join(f"{t:.2f},{b}\n" for t, b in sampler.samples))
    (out / "metrics.txt").write_text(metrics)
    print(f"[loadtest] {'PASS' if summary['passed'] else 'FAIL'}: wrote {out}/README.md and summary.json", file=sys.stderr)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
