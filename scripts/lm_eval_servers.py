#!/usr/bin/env python
"""lm-evaluation-harness against ``specdec serve``: one multiple-choice task, several server settings.

    LM_EVAL=PATH/TO/lm_eval python scripts/lm_eval_servers.py \\
        --arm 'native-f32=--dtype float32' --arm 'hf-f32=--backend hf --dtype float32' --arm 'q4=' \\
        --out benchmarks/NAME

Not a test and not part of CI.  lm-evaluation-harness is not one of specdec's dependencies: install
it in a virtual environment of its own (``pip install 'lm_eval[api]' transformers``) and give its
``lm_eval`` executable as ``LM_EVAL`` (default: ``lm_eval`` on the PATH).  For each arm this starts
``specdec serve`` from this checkout with the arm's extra arguments (default models), runs ``lm_eval --model local-completions`` on the task in
``--task-dir`` (token ids in, ``echo`` with ``logprobs``: the prompt's log-likelihoods), and stops
the server.  The report gives each arm's accuracy and wall time, and, against the first arm, the
largest difference in any choice's log-likelihood and how many questions changed their pick.
Writes ``README.md`` and ``results.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paired  # noqa: E402
from openai_choices_ab import _serve  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = "src/specdec/data/smollm2-135m-draft"  # SmolLM2's tokenizer (the draft shares the target's)


def _run_arm(lm_eval: str, serve_args: list[str], task_dir: str, task: str, threads: int, out: Path) -> dict:
    proc, url = _serve(ROOT / "src", threads, serve_args)
    try:
        model_args = ",".join([
            "model=smollm2-135m", f"base_url={url}/v1/completions", f"tokenizer={TOKENIZER}",
            "tokenizer_backend=huggingface", "tokenized_requests=True", "num_concurrent=1", "max_retries=1",
        ])
        env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
        started = time.perf_counter()
        subprocess.run([lm_eval, "--model", "local-completions", "--model_args", model_args, "--tasks", task,
                        "--include_path", task_dir, "--output_path", str(out), "--log_samples"],
                       cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wall = time.perf_counter() - started
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"][task]
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
    samples.sort(key=lambda s: s["doc_id"])
    return {
        "acc": results["acc,none"], "acc_norm": results["acc_norm,none"], "wall_s": wall,
        "loglik": [[float(r[0]) for r in s["filtered_resps"]] for s in samples],
        "target": [int(s["target"]) for s in samples],
    }


def _version(lm_eval: str) -> str:
    bin_dir = Path(lm_eval).parent if os.sep in lm_eval else None
    python = str(bin_dir / "python") if bin_dir is not None else "python"
    found = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('lm_eval'))"],
                           capture_output=True, text=True)
    return found.stdout.strip() or "(version unknown)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arm", action="append", required=True, metavar="NAME=ARGS",
                    help="a server setting: a name, '=', and more `specdec serve` arguments (may be empty)")
    ap.add_argument("--task-dir", default="benchmarks/lm-eval-smollm2", help="folder with the task's YAML and data")
    ap.add_argument("--task", default="specdec_mc40")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    arms = [tuple(a.split("=", 1)) for a in args.arm]
    if any(len(a) != 2 or not a[0] for a in arms):
        ap.error("each --arm is NAME=ARGS")
    lm_eval = os.environ.get("LM_EVAL", "lm_eval")
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in arms:
            print(f"[lm_eval_servers] {name}: specdec serve {extra}", file=sys.stderr)
            runs[name] = _run_arm(lm_eval, shlex.split(extra), args.task_dir, args.task, args.threads, Path(tmp) / name)
    first = arms[0][0]
    ref = runs[first]
    rows = []
    for name, extra in arms:
        r = runs[name]
        diff = max(abs(a - b) for qa, qb in zip(r["loglik"], ref["loglik"]) for a, b in zip(qa, qb))
        picks = sum(max(range(len(qa)), key=qa.__getitem__) != max(range(len(qb)), key=qb.__getitem__)
                    for qa, qb in zip(r["loglik"], ref["loglik"]))
        rows.append({"arm": name, "serve_args": extra, "acc": r["acc"], "acc_norm": r["acc_norm"], "wall_s": r["wall_s"],
                     "max_loglik_diff_vs_first": diff, "picks_changed_vs_first": picks, "questions": len(r["loglik"])})
    body = [
        f"Task `{args.task}` ({args.task_dir}): {len(ref['loglik'])} multiple-choice questions written for this"
        " benchmark; lm-evaluation-harness's `local-completions` model (lm_eval"
        f" {_version(lm_eval)}, in a virtual environment of its own, given as LM_EVAL) sends each choice as"
        " token ids with `echo`, `logprobs` 1 and `max_tokens` 1 and sums the choice's log-probabilities."
        " Each arm is a fresh `specdec serve` on the default models with the arguments shown.", "",
        f"| arm | `specdec serve` arguments | acc | acc_norm | wall s | max log-likelihood difference vs {first} |"
        f" picks changed vs {first} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        body.append(f"| {r['arm']} | `{r['serve_args'] or '(defaults)'}` | {r['acc']:.3f} | {r['acc_norm']:.3f} |"
                    f" {r['wall_s']:.1f} | {r['max_loglik_diff_vs_first']:.2e} | {r['picks_changed_vs_first']}/{r['questions']} |")
    paired.write_report(args.out, "lm-evaluation-harness against specdec serve",
                        {"task": args.task, "arms": rows, "loglik": {name: runs[name]["loglik"] for name, _ in arms}}, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
