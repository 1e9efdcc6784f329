#!/usr/bin/env python
"""One OpenAI completions request with many prompts: a server at another commit against this checkout's.

    python scripts/openai_choices_ab.py --base REV --repeats 3 [--launches K] [--stream] --out benchmarks/NAME

Not a test and not part of CI.  Two ``specdec serve`` processes on the default models, one from
this checkout and one from ``--base`` (its ``src`` exported with ``git archive`` and put first on
``PYTHONPATH``), both up at once; the same request — ``prompt`` a list of the 16 built-in
benchmark prompts' texts, ``max_tokens`` each — goes to each in turn, the order alternating per
repeat, at T = 0 and at T = 1 with a seed (``--prompts N``: the first N only; ``--base-args`` /
``--this-args``: more ``specdec serve`` arguments for one server, e.g. the same commit on both
sides with a setting changed on one).  Per arm: the request's wall time and completion
tokens per second (``--stream``: the request streamed, its time to the first text piece of any
choice too).  The choices' texts must be the same in both arms.  Writes ``README.md`` and
``results.json``.
"""

from __future__ import annotations

import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import paired
from startup_ab import _export

from specdec.bench.workloads import BUILTIN

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(src: Path, threads: int, extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server from {src} exited: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become ready")


def _request(url: str, body: dict, stream: bool) -> tuple[list[str], int, float, tuple[float, float] | None]:
    """(choice texts, completion tokens, wall time, and when streamed: times to the first text
    piece of any choice and, averaged over the choices, to each one's first piece)."""
    import json

    t0 = time.perf_counter()
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        wall = time.perf_counter() - t0
        r.raise_for_status()
        out = r.json()
        return [c["text"] for c in out["choices"]], out["usage"]["completion_tokens"], wall, None
    texts: dict[int, str] = {}
    firsts: dict[int, float] = {}
    usage: dict = {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                if c.get("text"):
                    firsts.setdefault(c["index"], time.perf_counter() - t0)
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
    wall = time.perf_counter() - t0
    first = (min(firsts.values()), sum(firsts.values()) / len(firsts))
    return [texts.get(i, "") for i in range(len(body["prompt"]))], usage["completion_tokens"], wall, first


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--launches", type=int, default=1,
                    help="start both servers afresh this many times (the first to start alternating), --repeats each:"
                         " two servers of the same commit differ by up to ~7 %% from launch to launch on a 2-core machine")
    ap.add_argument("--stream", action="store_true", help="stream the request (server-sent events)")
    ap.add_argument("--base-args", default="", help="more `specdec serve` arguments for the base's server, e.g. '--draft none'")
    ap.add_argument("--this-args", default="", help="more `specdec serve` arguments for this checkout's server")
    ap.add_argument("--prompts", type=int, default=len(BUILTIN), help=f"the first N built-in prompts (default all {len(BUILTIN)})")
    ap.set_defaults(max_new_tokens=64)
    args = ap.parse_args()
    prompts = [p.text for p in BUILTIN][: args.prompts]
    temps = [float(t) for t in args.temperatures.split(",")]
    rows, texts = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        arms = {"base": _export(args.base, Path(tmp)), "this": ROOT / "src"}
        extra = {"base": shlex.split(args.base_args), "this": shlex.split(args.this_args)}
        for launch in range(args.launches):
            names = list(arms) if launch % 2 == 0 else list(arms)[::-1]  # which server starts first
            servers: dict[str, tuple[subprocess.Popen, str]] = {}
            try:
                for name in names:  # inside the try: a server that fails to start stops the other
                    servers[name] = _serve(arms[name], args.threads, extra[name])
                for url in (u for _, u in servers.values()):  # warm-up
                    httpx.post(url + "/v1/completions", json={"prompt": prompts[:2], "max_tokens": 8, "temperature": 0}, timeout=600)
                for rep in range(args.repeats):
                    for temp in temps:
                        body = {"prompt": prompts, "max_tokens": args.max_new_tokens, "temperature": temp}
                        if temp > 0:
                            body["seed"] = 7
                        order = ["base", "this"] if rep % 2 == 0 else ["this", "base"]
                        for name in order:
                            got, tokens, wall, first = _request(servers[name][1], body, args.stream)
                            texts.setdefault((temp, name), got)
                            rows.append({"arm": name, "temperature": temp, "launch": launch, "repeat": rep, "wall_s": wall,
                                         "tokens": tokens, "tok_s": tokens / wall, "first_text_s": first})
                            print(f"launch {launch} T = {temp:g} {name}: {tokens} tokens in {wall:.2f} s", file=sys.stderr, flush=True)
            finally:
                for proc, _ in servers.values():
                    proc.terminate()
                    proc.wait(timeout=30)
    same = all(texts[(t, "base")] == texts[(t, "this")] for t in temps)
    streamed = " streamed," if args.stream else ""
    flags = "".join(f" The {name}'s server ran with `{a}`." for name, a in (("base", args.base_args), ("this", args.this_args)) if a)
    lines = [f"One{streamed} `/v1/completions` request whose `prompt` is the list of the first {len(prompts)} built-in prompts, `max_tokens` "
             f"{args.max_new_tokens}, default models and server settings (batching on), {args.threads} threads per "
             f"server, {args.launches} launch{'es' if args.launches > 1 else ''} of both servers × {args.repeats} repeats"
             f" alternating; medians.{flags}", "",
             "| T | arm | wall s | tok/s |" + (" first text, any choice s | first text, mean over choices s |" if args.stream else ""),
             "|---|---|---|---|" + ("---|---|" if args.stream else "")]
    for temp in temps:
        for name in ("base", "this"):
            sel = [r for r in rows if r["temperature"] == temp and r["arm"] == name]
            first = (f" {statistics.median(r['first_text_s'][0] for r in sel):.3f} | "
                     f"{statistics.median(r['first_text_s'][1] for r in sel):.3f} |") if args.stream else ""
            lines.append(f"| {temp:g} | {name} ({args.base if name == 'base' else 'this checkout'}) "
                         f"| {statistics.median(r['wall_s'] for r in sel):.2f} | {statistics.median(r['tok_s'] for r in sel):.1f} |{first}")
    lines += ["", "Paired: this / base for each request pair (same launch and repeat).", "",
              "| T | median ratio | this faster | per launch (median ratio) |", "|---|---|---|---|"]
    for temp in temps:
        ratios: dict[int, list[float]] = {}
        for r in rows:
            if r["temperature"] == temp and r["arm"] == "this":
                base = next(b for b in rows if b["temperature"] == temp and b["arm"] == "base"
                            and b["launch"] == r["launch"] and b["repeat"] == r["repeat"])
                ratios.setdefault(r["launch"], []).append(r["tok_s"] / base["tok_s"])
        every = [x for v in ratios.values() for x in v]
        per = ", ".join(f"{statistics.median(v):.3f}" for v in ratios.values())
        lines.append(f"| {temp:g} | ×{statistics.median(every):.3f} | {sum(x > 1 for x in every)}/{len(every)} | {per} |")
    lines += ["", f"The same choice texts from both servers: {'yes' if same else 'NO'}."]
    paired.write_report(args.out, "A request with many prompts: choices side by side on spare slots",
                        {"rows": rows, "same_texts": same}, lines)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
