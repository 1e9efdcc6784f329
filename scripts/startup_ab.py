#!/usr/bin/env python
"""Start-up time: fresh ``specdec`` processes at another commit against this checkout's.

    python scripts/startup_ab.py --base 455ebd5 --processes 6 --out benchmarks/NAME

Not a test and not part of CI.  A command line tool is felt by its wall time from the shell, so
each measurement is one fresh process, timed from outside (``time.perf_counter`` around
``subprocess.run``), the arms alternating so that the machine's drift falls on both alike.  The
base commit's ``src`` is exported with ``git archive`` into a temporary folder and put first on
``PYTHONPATH``; the compiled kernels are shared (the same sources hash to the same build).  Per
arm and command (with the median of each process's peak anonymous and file-backed resident memory,
read from ``/proc`` every 20 ms):

* ``help`` — ``specdec --help``;
* ``generate`` — ``specdec generate PROMPT --max-new-tokens N --json`` on the default models
  (target and draft as shipped, greedy): load, encode, decode, print (``--chat``: the prompt in
  the chat template, as the demo runs it).  Its token ids must be the same in both arms.

With ``--llamacpp`` (llama-cpp-python installed), a third arm: a fresh process that imports
llama_cpp, loads the same GGUF file and greedily generates N tokens from the same prompt — what
a user of llama.cpp's Python binding waits for.  Writes ``README.md`` and ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

import paired

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a haiku about the sea."

_LLAMACPP = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=int(sys.argv[3]), verbose=False)
out = llm(sys.argv[2], max_tokens=int(sys.argv[4]), temperature=0.0)
print(len(out["choices"][0]["text"]))
"""


def _export(rev: str, into: Path) -> Path:
    """``rev``'s ``src`` folder, extracted under ``into``."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def _memory(pid: int) -> tuple[int, int]:
    """The process's resident anonymous and file-backed memory now, in kB (0, 0 once it is gone)."""
    anon = file = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1])
                elif line.startswith("RssFile:"):
                    file = int(line.split()[1])
    except OSError:
        pass
    return anon, file


def _timed(argv: list[str], src: Path | None, threads: int, extra_env: dict[str, str]) -> tuple[float, str, dict]:
    """Wall seconds, stdout, and the peaks of the process's anonymous and file-backed resident
    memory (GB, read from /proc every 20 ms: a peak shorter than that can be missed)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **extra_env)
    if src is not None:
        env["PYTHONPATH"] = str(src) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    peak = [0, 0]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t = time.perf_counter()
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, text=True)
        while True:
            peak = [max(a, b) for a, b in zip(peak, _memory(proc.pid))]
            try:  # returns within milliseconds of the exit (a plain sleep would add up to 20 ms to the time)
                proc.wait(timeout=0.02)
                break
            except subprocess.TimeoutExpired:
                pass
        seconds = time.perf_counter() - t
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} ... failed ({proc.returncode}):\n{stderr[-2000:]}")
    return seconds, stdout, {"anon_gb": peak[0] / 1e6, "file_gb": peak[1] / 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare with (its src is exported)")
    ap.add_argument("--processes", type=int, default=6, help="fresh processes per arm and command")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp", action="store_true", help="add llama-cpp-python's cold start on the target's GGUF")
    ap.add_argument("--chat", action="store_true", help="generate with --chat (the prompt in the chat template, as the demo does)")
    ap.add_argument("--target", help="generate with this target instead of the default (e.g. qwen2.5-coder-1.5b)")
    ap.add_argument("--draft", help="generate with this drafter instead of the default (e.g. none)")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="set this in both arms' environment (repeatable), e.g. SPECDEC_QUANTISED_CACHE=off")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if any("=" not in kv for kv in args.env):
        ap.error("--env takes KEY=VALUE")
    extra_env = dict(kv.split("=", 1) for kv in args.env)
    py = sys.executable
    cli = [py, "-m", "specdec.cli"]
    models = [*(["--target", args.target] if args.target else []), *(["--draft", args.draft] if args.draft else [])]
    gen = [*cli, "generate", PROMPT, "--max-new-tokens", str(args.max_new_tokens), "--json", *(["--chat"] if args.chat else []),
           *models]
    gguf = ""
    if args.llamacpp:
        from specdec.models.registry import gguf_file

        try:  # the target's own GGUF file (a target shipped as a folder has none)
            gguf = str(gguf_file(args.target or "smollm2-135m"))
        except Exception as exc:  # noqa: BLE001 - reported as a usage error
            ap.error(f"--llamacpp needs a target made from a GGUF file ({exc})")
    with tempfile.TemporaryDirectory() as tmp:
        arms: dict[str, Path | None] = {"base": _export(args.base, Path(tmp)), "this": ROOT / "src"}
        runs: list[dict] = []
        tokens: dict[str, list[int]] = {}
        for arm in arms:  # untimed: an arm whose kernel sources differ compiles its own build once
            _timed(gen, arms[arm], args.threads, extra_env)
        for i in tqdm(range(args.processes), desc="processes"):
            order = list(arms) if i % 2 == 0 else list(arms)[::-1]
            for arm in order:
                s, _, memory = _timed([*cli, "--help"], arms[arm], args.threads, extra_env)
                runs.append({"arm": arm, "command": "help", "seconds": s, **memory})
                s, out, memory = _timed(gen, arms[arm], args.threads, extra_env)
                ids = json.loads(out)["token_ids"]
                if tokens.setdefault(arm, ids) != ids:
                    raise SystemExit(f"{arm}: greedy tokens differ between processes")
                runs.append({"arm": arm, "command": "generate", "seconds": s, **memory})
            if args.llamacpp:
                s, _, memory = _timed([py, "-c", _LLAMACPP, gguf, PROMPT, str(args.threads), str(args.max_new_tokens)],
                                      None, args.threads, {})
                runs.append({"arm": "llama.cpp", "command": "generate", "seconds": s, **memory})
    same = tokens["base"] == tokens["this"]
    lines = [f"{args.processes} fresh processes per arm and command, alternating; wall time from the parent "
             f"(seconds), {args.threads} threads (`OMP_NUM_THREADS`). `generate` = `specdec generate \"{PROMPT}\" "
             f"--max-new-tokens {args.max_new_tokens} --json{' --chat' if args.chat else ''}{' ' + ' '.join(models) if models else ''}` "
             f"({'these models' if models else 'the default models'}, one untimed process per arm first); "
             "`help` = `specdec --help`."
             + (f" Both arms ran with {', '.join(f'`{kv}`' for kv in args.env)}." if args.env else ""),
             "", "| command | arm | median s | min s | max s | peak anonymous GB | peak file-backed GB |",
             "|---|---|---|---|---|---|---|"]
    for command in ("help", "generate"):
        for arm in (*arms, *(["llama.cpp"] if args.llamacpp and command == "generate" else [])):
            xs = [r["seconds"] for r in runs if r["arm"] == arm and r["command"] == command]
            label = {"base": f"base ({args.base})", "this": "this checkout"}.get(arm, "llama-cpp-python, same GGUF")
            rows = [r for r in runs if r["arm"] == arm and r["command"] == command]
            anon, file = (statistics.median(r[k] for r in rows) for k in ("anon_gb", "file_gb"))
            lines.append(f"| {command} | {label} | {statistics.median(xs):.2f} | {min(xs):.2f} | {max(xs):.2f} | {anon:.2f} | {file:.2f} |")
    lines += ["", f"Greedy tokens the same in both arms: {'yes' if same else 'NO'} ({len(tokens['this'])} tokens)."]
    paired.write_report(args.out, "Start-up time of a fresh specdec process", {"runs": runs, "same_tokens": same, "env": extra_env}, lines)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
