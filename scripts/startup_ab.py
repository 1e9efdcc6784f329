#!/usr/bin/env python
"""Start-up time: fresh ``specdec`` processes at another commit against this checkout's.

    python scripts/startup_ab.py --base 455ebd5 --processes 6 --out benchmarks/NAME

Not a test and not part of CI.  A command line tool is felt by its wall time from the shell, so
each measurement is one fresh process, timed from outside (``time.perf_counter`` around
``subprocess.run``), the arms alternating so that the machine's drift falls on both alike.  The
base commit's ``src`` is exported with ``git archive`` into a temporary folder and put first on
``PYTHONPATH``; the compiled kernels are shared (the same sources hash to the same build).  Per
arm and command:

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


def _timed(argv: list[str], src: Path | None, threads: int) -> tuple[float, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    if src is not None:
        env["PYTHONPATH"] = str(src) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    t = time.perf_counter()
    out = subprocess.run(argv, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:4])} ... failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return seconds, out.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit to compare with (its src is exported)")
    ap.add_argument("--processes", type=int, default=6, help="fresh processes per arm and command")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llamacpp", action="store_true", help="add llama-cpp-python's cold start on the same GGUF")
    ap.add_argument("--chat", action="store_true", help="generate with --chat (the prompt in the chat template, as the demo does)")
    ap.add_argument("--target", help="generate with this target instead of the default (e.g. qwen2.5-coder-1.5b)")
    ap.add_argument("--draft", help="generate with this drafter instead of the default (e.g. none)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.llamacpp and args.target:
        ap.error("--llamacpp times llama.cpp on the default target's GGUF; leave --target out with it")
    py = sys.executable
    cli = [py, "-m", "specdec.cli"]
    models = [*(["--target", args.target] if args.target else []), *(["--draft", args.draft] if args.draft else [])]
    gen = [*cli, "generate", PROMPT, "--max-new-tokens", str(args.max_new_tokens), "--json", *(["--chat"] if args.chat else []),
           *models]
    gguf = ""
    if args.llamacpp:
        from specdec.models.registry import gguf_file

        gguf = str(gguf_file("smollm2-135m"))
    with tempfile.TemporaryDirectory() as tmp:
        arms: dict[str, Path | None] = {"base": _export(args.base, Path(tmp)), "this": ROOT / "src"}
        runs: list[dict] = []
        tokens: dict[str, list[int]] = {}
        for arm in arms:  # untimed: an arm whose kernel sources differ compiles its own build once
            _timed(gen, arms[arm], args.threads)
        for i in tqdm(range(args.processes), desc="processes"):
            order = list(arms) if i % 2 == 0 else list(arms)[::-1]
            for arm in order:
                s, _ = _timed([*cli, "--help"], arms[arm], args.threads)
                runs.append({"arm": arm, "command": "help", "seconds": s})
                s, out = _timed(gen, arms[arm], args.threads)
                ids = json.loads(out)["token_ids"]
                if tokens.setdefault(arm, ids) != ids:
                    raise SystemExit(f"{arm}: greedy tokens differ between processes")
                runs.append({"arm": arm, "command": "generate", "seconds": s})
            if args.llamacpp:
                s, _ = _timed([py, "-c", _LLAMACPP, gguf, PROMPT, str(args.threads), str(args.max_new_tokens)],
                              None, args.threads)
                runs.append({"arm": "llama.cpp", "command": "generate", "seconds": s})
    same = tokens["base"] == tokens["this"]
    lines = [f"{args.processes} fresh processes per arm and command, alternating; wall time from the parent "
             f"(seconds), {args.threads} threads (`OMP_NUM_THREADS`). `generate` = `specdec generate \"{PROMPT}\" "
             f"--max-new-tokens {args.max_new_tokens} --json{' --chat' if args.chat else ''}{' ' + ' '.join(models) if models else ''}` "
             f"({'these models' if models else 'the default models'}, one untimed process per arm first); "
             "`help` = `specdec --help`.", "",
             "| command | arm | median s | min s | max s |", "|---|---|---|---|---|"]
    for command in ("help", "generate"):
        for arm in (*arms, *(["llama.cpp"] if args.llamacpp and command == "generate" else [])):
            xs = [r["seconds"] for r in runs if r["arm"] == arm and r["command"] == command]
            label = {"base": f"base ({args.base})", "this": "this checkout"}.get(arm, "llama-cpp-python, same GGUF")
            lines.append(f"| {command} | {label} | {statistics.median(xs):.2f} | {min(xs):.2f} | {max(xs):.2f} |")
    lines += ["", f"Greedy tokens the same in both arms: {'yes' if same else 'NO'} ({len(tokens['this'])} tokens)."]
    paired.write_report(args.out, "Start-up time of a fresh specdec process", {"runs": runs, "same_tokens": same}, lines)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
