#!/usr/bin/env python
"""Load test of ``specdec serve``: many concurrent edge sessions for a while (not part of CI).

    python scripts/loadtest.py --out loadtest-run --sessions 32 --duration 120
    python scripts/loadtest.py --out serve-load --sessions 32 --openai-streams 16 --duration 120 --compare-serialised

Starts a server (``--draft none``: the verify API needs no drafter) and runs ``--sessions`` edge
sessions at once, each a thread of this process with its own connection, looping over distinct
prompts until ``--duration`` seconds have passed.  Every verdict is checked against the edge's own
context by the client (a verdict that does not continue the edge's draft and committed tokens is a
``RemoteError``, counted as an error).  Even-numbered sessions decode greedily, odd ones sample at
``--temperature`` over the coupled wire with their own seeds; both are exact, so after the load
phase a sample of the outputs (``--check``) is compared token for token with a local target-only
run of the same prompt and seed: a token from another session would show up as a mismatch.  The
server's resident memory is sampled every ``--rss-interval`` seconds.

``--openai-streams N`` adds N threads streaming ``/v1/completions`` from the same server (served
with ``--server-draft``; even streams greedy, odd ones seeded ``coupled`` sampling, so both are
checkable token for token): time to first token and inter-token latency come from the SSE chunks.
``--compare-serialised`` runs the same load twice, against the batching server and against one
started with ``--no-batching`` (one forward pass at a time, the server before batching), and
reports both and the throughput ratio.

``--ray --replicas N`` serves the same load from ``specdec serve --ray`` (N verifier replicas on a
local Ray Serve instance behind one gateway), and ``--kill-replica-after S`` kills one replica's
process S seconds into the load: the edge sessions that lived on it are re-created on another
replica by the client (counted as re-created sessions), a stream cut by the kill is issued again
by this script (counted as a restarted stream), and the run passes only when no generation failed
and the checked outputs are still identical to the target alone.

Writes ``summary.json``, ``README.md`` (with the exact command), ``rss.csv`` and ``metrics.txt``
(the server's Prometheus text at the end) under ``--out`` (one sub-folder per server with
``--compare-serialised``).  Exit status 1 when any generation failed or any checked output differed.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
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
    """Up to ``n`` completed generations, spread over the sessions (each one's first, then second, ...),
    plus every one whose session was re-created (lost with its server or replica)."""
    ok = sorted((g for g in gens if g.error is None), key=lambda g: (g.index, g.session))
    disturbed = [g for g in ok if g.session_recreates]  # a lost session re-created mid-generation: always checked
    return disturbed + [g for g in ok if not g.session_recreates][: max(0, n - len(disturbed))]


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
        f"Target `{c['target']}` ({c.get('precision') or 'precision not reported'}) served by `specdec serve --draft "
        f"{summary.get('server_draft', 'none')}` ({c['server_threads']} torch thread(s)); "
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


@dataclass
class Stream:
    """One OpenAI streaming completion."""

    stream: int
    index: int
    prompt_id: str
    temperature: float
    seed: int
    started_s: float
    wall_s: float = 0.0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between consecutive text chunks
    text: str = ""
    tokens: int = 0
    error: str | None = None
    restarts: int = 0  # --ray: issued again after its replica died mid-stream


def _stream_loop(j: int, args: argparse.Namespace, ctx: dict[str, Any], deadline: float, t0: float,
                 out: list[Stream], lock: threading.Lock) -> None:
    """One OpenAI client: streaming completions until the deadline (even: greedy, odd: seeded coupled)."""
    import httpx

    k = 0
    headers = {"Authorization": f"Bearer {ctx['api_key']}"}
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0), headers=headers) as client:
        while time.perf_counter() < deadline:
            pid, text, _ = session_prompt(1000 + j, k, ctx["bases"])
            temp, seed = (0.0, 0) if j % 2 == 0 else (args.temperature, 7_000_001 * (j + 1) + k)
            started = time.perf_counter()
            st = Stream(j, k, pid, temp, seed, started - t0)
            body = {"prompt": text, "max_tokens": args.max_new_tokens, "temperature": temp, "seed": seed,
                    "stream": True, "stream_options": {"include_usage": True}}
            if temp > 0:
                body["method"] = "coupled"
            try:
                _stream_once(client, ctx, body, st, started, args)
                ctx["stream_inputs"][(j, k)] = text
            except Exception as exc:  # noqa: BLE001 - counted
                st.error = f"{type(exc).__name__}: {exc}"
                if args.verbose:
                    traceback.print_exc()
                time.sleep(0.5)
            st.wall_s = time.perf_counter() - started
            with lock:
                out.append(st)
            k += 1


#: transport errors of a stream whose replica died mid-answer (--ray: the stream is issued again)
_CUT = ("RemoteProtocolError", "ReadError", "IncompleteStream")


def _stream_once(client: Any, ctx: dict[str, Any], body: dict[str, Any], st: Stream, started: float,
                 args: argparse.Namespace) -> None:
    """One streaming completion into ``st``; with --ray a stream cut by a dying replica starts over."""
    while True:
        try:
            st.text, st.gaps_s, st.ttft_s, st.tokens = "", [], None, 0
            _stream_read(client, ctx, body, st, started)
            return
        except Exception as exc:  # noqa: BLE001 - re-raised unless it is a cut stream under --ray
            if not (args.ray and type(exc).__name__ in _CUT and st.restarts < 2):
                raise
            st.restarts += 1


def _stream_read(client: Any, ctx: dict[str, Any], body: dict[str, Any], st: Stream, started: float) -> None:
    """Read one stream into ``st`` (raises on an error event or a stream cut before ``[DONE]``)."""
    last = None
    done = False
    with client.stream("POST", ctx["url"] + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:200]}")
        for line in r.iter_lines():
            if line == "data: [DONE]":
                done = True
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                st.tokens = chunk["usage"]["completion_tokens"]
            piece = "".join(c.get("text", "") for c in chunk.get("choices", []))
            if piece:
                now = time.perf_counter()
                if last is None:
                    st.ttft_s = now - started
                else:
                    st.gaps_s.append(now - last)
                last = now
                st.text += piece
    if not done:
        raise IncompleteStream("the stream ended without [DONE]")


class IncompleteStream(Exception):
    """A stream that ended before its ``[DONE]`` event."""


def summarize_streams(streams: list[Stream], duration_s: float) -> dict[str, Any]:
    ok = [s for s in streams if s.error is None]
    gaps = [g for s in ok for g in s.gaps_s]
    tokens = sum(s.tokens for s in ok)
    return {
        "completed": len(ok),
        "failed": len(streams) - len(ok),
        "tokens": tokens,
        "tokens_per_s": tokens / duration_s if duration_s > 0 else None,
        "ttft_p50_s": _quantile([s.ttft_s for s in ok if s.ttft_s is not None], 0.5),
        "ttft_p95_s": _quantile([s.ttft_s for s in ok if s.ttft_s is not None], 0.95),
        "inter_token_p50_s": _quantile(gaps, 0.5),
        "inter_token_p95_s": _quantile(gaps, 0.95),
        "error_messages": [f"stream {s.stream} #{s.index}: {s.error}" for s in streams if s.error][:MAX_ERROR_MESSAGES],
    }


def _check_streams(args: argparse.Namespace, streams: list[Stream], inputs: dict, engine: Any) -> dict[str, Any]:
    """Re-generate a sample of the streamed texts with the target alone; compare the text."""
    from specdec.sampling import SamplingConfig

    ok = sorted((s for s in streams if s.error is None), key=lambda s: (s.index, s.stream))
    restarted = [s for s in ok if s.restarts]  # issued again after a replica died: always checked
    chosen = restarted + [s for s in ok if not s.restarts][: max(0, args.check - len(restarted))]
    mismatches = []
    for s in chosen:
        cfg = SamplingConfig(temperature=s.temperature, seed=s.seed, max_new_tokens=args.max_new_tokens)
        ids = list(engine.target.tokenizer.encode(inputs[(s.stream, s.index)], add_special_tokens=False))
        ref = engine.generate(ids, cfg, method="greedy" if s.temperature == 0 else "coupled")
        if ref.text != s.text:
            mismatches.append({"stream": s.stream, "index": s.index, "prompt_id": s.prompt_id})
    return {"checked": len(chosen), "matched": len(chosen) - len(mismatches), "mismatches": mismatches}


def _check(args: argparse.Namespace, gens: list[Generation], inputs: dict, engine: Any) -> dict[str, Any]:
    """Re-generate a sample of the outputs with the target alone, here; compare token for token."""
    from specdec.sampling import SamplingConfig

    chosen = pick_for_check(gens, args.check)
    if not chosen:
        return {"checked": 0, "matched": 0, "mismatches": [], "mismatches_count": 0}
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
    p.add_argument("--openai-streams", type=int, default=0, help="concurrent OpenAI streaming completions (default 0)")
    p.add_argument("--server-draft", default=None,
                   help="the server's drafter for the OpenAI endpoints (default: --draft, or 'none' with --draft ngram)")
    p.add_argument("--int8-kernel", default="auto", choices=["auto", "fbgemm", "onednn", "mixed"],
                   help="the (batching) server's int8 kernel (`specdec serve --int8-kernel`; default auto)")
    p.add_argument("--serialised-int8-kernel", default="auto", choices=["auto", "fbgemm", "onednn", "mixed"],
                   help="the --no-batching server's int8 kernel with --compare-serialised (default auto)")
    p.add_argument("--no-prefix-cache", action="store_true", help="serve with `--prefix-cache-mib 0` (prefix caching off)")
    p.add_argument("--compare-serialised", action="store_true",
                   help="run the load against the batching server and against a --no-batching one")
    p.add_argument("--ray", action="store_true", help="serve with `specdec serve --ray` (verifier replicas on Ray Serve)")
    p.add_argument("--replicas", type=int, default=2, help="verifier replicas with --ray (default 2)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica with --ray (default 1)")
    p.add_argument("--kill-replica-after", type=float, default=None, metavar="S",
                   help="--ray: kill one replica's process S seconds into the load (default: none)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failed generations")
    args = p.parse_args(argv)
    if args.kill_replica_after is not None and not (args.ray and 0 < args.kill_replica_after < args.duration):
        p.error("--kill-replica-after needs --ray and a time within --duration")
    if args.ray and args.compare_serialised:
        p.error("--ray and --compare-serialised do not go together")
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


def target_of(precision: str | None) -> tuple[str, str]:
    """(dtype, int8 kernel) of a server's /health precision: "int8 (onednn)" -> ("int8", "onednn"),
    "q4 (fbgemm)" -> ("q4", "fbgemm"), "float32" -> ("float32", "auto"); ("auto", "auto") if unknown."""
    if not precision:
        return "auto", "auto"
    dtype, _, rest = precision.partition(" (")
    return dtype, rest[:-1] if rest.endswith(")") else "auto"


def _wait_ready(url: str, server: Any, timeout_s: float = 600.0) -> dict[str, Any]:
    """Wait for the server's /health; returns its answer."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.failure():
            raise SystemExit(server.failure())
        try:
            r = httpx.get(url + "/health", timeout=2.0)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise SystemExit(f"the server did not answer /health within {timeout_s:.0f} s")


def run_phase(args: argparse.Namespace, ctx: dict[str, Any], *, batching: bool) -> dict[str, Any]:
    """Start a server, run the edge sessions and OpenAI streams against it until the deadline, stop it."""
    import httpx

    from specdec.bench.network import CloudServer, Emulation, Link

    server_draft = args.server_draft or ("none" if args.draft == "ngram" else args.draft)
    server = CloudServer(args.target, server_draft if args.openai_streams else "none", threads=args.server_threads,
                         emulation=Emulation("proxy", "load test"))
    if not batching:
        server.argv.append("--no-batching")
    kernel = args.int8_kernel if batching else args.serialised_int8_kernel
    server.argv += ["--int8-kernel", kernel]
    if args.no_prefix_cache:
        server.argv += ["--prefix-cache-mib", "0"]
    if args.ray:
        server.argv += ["--ray", "--replicas", str(args.replicas), "--replica-cpus", str(args.replica_cpus)]
    server.start()
    killer: ReplicaKiller | None = None
    link = None
    gens: list[Generation] = []
    streams: list[Stream] = []
    ctx.update(inputs={}, stream_inputs={})
    try:
        health = _wait_ready(server.url, server)
        link = Link(server, args.rtt_ms).start() if args.rtt_ms > 0 else None
        ctx.update(url=link.url if link else server.url, api_key=server.api_key)
        sampler = RssSampler(server.proc.pid, args.rss_interval)
        sampler.start()
        lock = threading.Lock()
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        threads = [threading.Thread(target=_session_loop, args=(i, args, ctx, deadline, t0, gens, lock), daemon=True)
                   for i in range(args.sessions)]
        threads += [threading.Thread(target=_stream_loop, args=(j, args, ctx, deadline, t0, streams, lock), daemon=True)
                    for j in range(args.openai_streams)]
        print(f"[loadtest] {'batching' if batching else 'serialised'} server: {args.sessions} sessions +"
              f" {args.openai_streams} OpenAI streams for {args.duration:g} s against {ctx['url']}", file=sys.stderr, flush=True)
        if args.kill_replica_after is not None:
            killer = ReplicaKiller(server, t0 + args.kill_replica_after, t0, deadline - 1.0)
            killer.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if killer is not None:
            killer.join()
        load_wall = time.perf_counter() - t0
        sampler.stop_event.set()
        sampler.join()
        metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=10).text
    finally:
        if link is not None:
            link.stop()
        server.stop()
    return {"batching": batching, "server_draft": server_draft if args.openai_streams else "none", "load_wall_s": load_wall,
            "precision": health.get("precision"),
            "gens": gens, "streams": streams, "rss": sampler.samples, "metrics": metrics,
            "inputs": dict(ctx["inputs"]), "stream_inputs": dict(ctx["stream_inputs"]),
            "kill": killer.report if killer is not None else None}


class ReplicaKiller(threading.Thread):
    """--ray: at ``when`` (perf_counter), SIGKILL one verifier replica process of the server (a crash).

    The replicas are Ray worker processes below the server process, titled
    ``ray::ServeReplica:<app>:Verifier``; only descendants of the server we started are considered."""

    TITLE = "ray::ServeReplica:specdec:Verifier"

    def __init__(self, server: Any, when: float, t0: float, end: float) -> None:
        super().__init__(daemon=True, name="replica-killer")
        self.server, self.when, self.t0, self.end = server, when, t0, end
        self.report: dict[str, Any] = {}

    def replicas(self) -> list[int]:
        children: dict[int, list[int]] = {}
        titles: dict[int, str] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                titles[int(entry.name)] = (entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
        found, todo = [], [self.server.proc.pid]
        while todo:
            for child in children.get(todo.pop(), []):
                todo.append(child)
                if titles.get(child, "").startswith(self.TITLE):
                    found.append(child)
        return sorted(found)

    def run(self) -> None:
        try:
            time.sleep(max(0.0, self.when - time.perf_counter()))
            before = self.replicas()
            if not before:
                raise RuntimeError("no verifier replica process found below the server")
            os.kill(before[0], signal.SIGKILL)
            self.report = {"victim_pid": before[0], "at_s": time.perf_counter() - self.t0, "replicas_before": len(before)}
            print(f"[loadtest] killed replica process {before[0]} at {self.report['at_s']:.1f} s", file=sys.stderr, flush=True)
            time.sleep(max(0.0, self.end - time.perf_counter()))
            self.report["replicas_at_end"] = len(self.replicas())
        except Exception as exc:  # noqa: BLE001 - reported in the summary (and the run fails)
            self.report = {"error": f"{type(exc).__name__}: {exc}"}


def phase_summary(args: argparse.Namespace, phase: dict[str, Any], engine: Any, command: str) -> dict[str, Any]:
    gens, streams, wall = phase["gens"], phase["streams"], phase["load_wall_s"]
    check = _check(args, gens, phase["inputs"], engine)
    load = summarize(gens, wall, args.sessions)
    openai = summarize_streams(streams, wall)
    scheck = _check_streams(args, streams, phase["stream_inputs"], engine) if streams else {"checked": 0, "matched": 0, "mismatches": []}
    total = load["tokens"] + openai["tokens"]
    return {
        "command": command,
        "server": "batching" if phase["batching"] else "serialised (--no-batching)",
        "server_draft": phase["server_draft"],
        "config": {"target": args.target, "draft": args.draft, "server_draft": phase["server_draft"], "sessions": args.sessions,
                   "openai_streams": args.openai_streams, "duration_s": args.duration,
                   "max_new_tokens": args.max_new_tokens, "gamma": args.gamma, "temperature": args.temperature,
                   "rtt_ms": args.rtt_ms, "server_threads": args.server_threads, "edge_threads": args.edge_threads,
                   "rss_interval_s": args.rss_interval, "check": args.check, "precision": phase.get("precision")},
        "load_wall_s": wall, "load": load, "openai": openai, "openai_check": scheck,
        "aggregate_tokens_per_s": total / wall if wall > 0 else None,
        "server_rss": rss_trend(phase["rss"]), "check": check,
        "ray": ({"replicas": args.replicas, "replica_cpus": args.replica_cpus, "kill": phase["kill"],
                 "session_recreates": load["session_recreates"],
                 "stream_restarts": sum(x.restarts for x in streams)} if args.ray else None),
        "passed": (load["generations_failed"] == 0 and openai["failed"] == 0 and check["mismatches_count"] == 0
                   and not scheck["mismatches"] and load["generations_completed"] + openai["completed"] > 0
                   and (phase["kill"] is None or "victim_pid" in phase["kill"])),
        "generations": [asdict(g) for g in gens],
        "streams": [asdict(x) for x in streams],
    }


def openai_markdown(summary: dict[str, Any]) -> str:
    o, chk = summary["openai"], summary["openai_check"]

    def f(x: Any, nd: int = 3) -> str:
        return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))

    return "\n".join([
        "", f"Server: **{summary['server']}**; aggregate {f(summary['aggregate_tokens_per_s'], 1)} tok/s "
        "(edge sessions + OpenAI streams).", "",
        "| OpenAI streams | |", "|---|---|",
        f"| completed / failed | {o['completed']} / {o['failed']} |",
        f"| tokens | {o['tokens']} ({f(o['tokens_per_s'], 1)} tok/s) |",
        f"| TTFT p50 / p95 s | {f(o['ttft_p50_s'])} / {f(o['ttft_p95_s'])} |",
        f"| inter-token p50 / p95 s | {f(o['inter_token_p50_s'])} / {f(o['inter_token_p95_s'])} |",
        f"| checked against the target alone | {chk['matched']} / {chk['checked']} identical |",
    ] + ([""] + [f"- {m}" for m in o["error_messages"]] if o["error_messages"] else [])) + "\n"


def ray_markdown(summary: dict[str, Any]) -> str:
    r = summary.get("ray")
    if not r:
        return ""
    kill = r["kill"] or {}
    what = (f"the process of one of {kill['replicas_before']} replicas (pid {kill['victim_pid']}) killed at {kill['at_s']:.1f} s"
            f" ({kill.get('replicas_at_end', '?')} replica processes running at the end)" if "victim_pid" in kill
            else f"kill failed: {kill['error']}" if "error" in kill else "no replica killed")
    return "\n".join([
        "", f"Ray Serve: {r['replicas']} verifier replicas ({r['replica_cpus']:g} CPU each) behind one gateway; {what}.",
        "", "| after the kill | |", "|---|---|",
        f"| edge sessions re-created on another replica | {r['session_recreates']} |",
        f"| OpenAI streams issued again (cut by the kill) | {r['stream_restarts']} |",
        f"| generations lost (failed) | {summary['load']['generations_failed'] + summary['openai']['failed']} |",
        "", "Server RSS above is the gateway-side driver process only (the replicas are Ray worker processes).",
    ]) + "\n"


def write_phase(out: Path, summary: dict[str, Any], phase: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (out / "README.md").write_text(markdown(summary) + openai_markdown(summary) + ray_markdown(summary))
    (out / "rss.csv").write_text("seconds,rss_bytes\n" + "".join(f"{t:.2f},{b}\n" for t, b in phase["rss"]))
    (out / "metrics.txt").write_text(phase["metrics"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(args.edge_threads)
    import torch

    from specdec.engine import Engine, EngineConfig

    torch.set_num_threads(args.edge_threads)
    ctx = _edge_context(args)
    phases = [run_phase(args, ctx, batching=True)]
    if args.compare_serialised:
        phases.append(run_phase(args, ctx, batching=False))
    n = sum(len(p["gens"]) + len(p["streams"]) for p in phases)
    print(f"[loadtest] {n} generations; checking a sample against the local target", file=sys.stderr, flush=True)
    engines: dict[tuple[str, str], Any] = {}  # the reference target, loaded as each server ran it
    summaries = []
    for p in phases:
        dtype, kernel = target_of(p["precision"])
        if (dtype, kernel) not in engines:
            engines[dtype, kernel] = Engine.build(EngineConfig(target=args.target, draft="none", dtype=dtype,
                                                                int8_kernel=kernel))
        summaries.append(phase_summary(args, p, engines[dtype, kernel], command))
    if len(phases) == 1:
        write_phase(out, summaries[0], phases[0])
    else:
        for name, summary, phase in zip(("batching", "serialised"), summaries, phases):
            write_phase(out / name, summary, phase)
        a, b = (x["aggregate_tokens_per_s"] or 0.0 for x in summaries)
        ratio = a / b if b else None
        comparison = {"command": command, "batching_tokens_per_s": a, "serialised_tokens_per_s": b, "ratio": ratio,
                      "passed": all(x["passed"] for x in summaries)}
        (out / "summary.json").write_text(json.dumps(comparison, indent=1))
        (out / "README.md").write_text(
            f"# Batching vs serialised server\n\nCommand: `{command}`\n\n| server | aggregate tok/s | OpenAI TTFT p50 / p95 s "
            "| inter-token p50 / p95 s | failed |\n|---|---|---|---|---|\n" + "".join(
                f"| {x['server']} | {x['aggregate_tokens_per_s'] or 0:.1f} | {x['openai']['ttft_p50_s'] or 0:.3f} / "
                f"{x['openai']['ttft_p95_s'] or 0:.3f} | {x['openai']['inter_token_p50_s'] or 0:.3f} / "
                f"{x['openai']['inter_token_p95_s'] or 0:.3f} | {x['load']['generations_failed'] + x['openai']['failed']} |\n"
                for x in summaries)
            + (f"\nThroughput ratio (batching / serialised): **{ratio:.2f}×**\n" if ratio else "")
            + "\nDetails per server: `batching/README.md`, `serialised/README.md`.\n")
    passed = all(x["passed"] for x in summaries)
    print(f"[loadtest] {'PASS' if passed else 'FAIL'}: wrote {out}/README.md and summary.json", file=sys.stderr)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
