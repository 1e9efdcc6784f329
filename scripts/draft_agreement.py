"""Teacher-forced agreement of draft models with the target on the benchmark's own prompts.

The target (read from its GGUF, float32) continues each built-in benchmark prompt: once greedily
and ``--samples`` times at T = 1, ``--new-tokens`` tokens each.  Every draft is then scored at
every generated position against the target's law there: arg-max agreement (a draft token's
T = 0 acceptance) and ``sum min(p, q)`` (its T = 1 acceptance).  Unlike a ``specdec bench`` run
this measures the drafts alone, with no γ controller, no rounds and no timing, so small
differences between drafts show; it does not say what they are worth in tokens/s.

    python scripts/draft_agreement.py --drafts smollm2-135m-draft,path/to/draft --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafts", required=True, help="comma list of draft models (registry names or folders)")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--samples", type=int, default=3, help="T = 1 continuations per prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True, help="folder for agreement.json and agreement.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from specdec.bench.workloads import BUILTIN
    from specdec.models.registry import gguf_file, load, resolve
    from specdec.text import encode_prompt
    from specdec.train import online as on

    target = load(args.target, batch_invariant=False)
    shape = on.Shape.from_hf(json.loads((target.folder / "config.json").read_text()))
    wt = on.read_gguf_llama(gguf_file(args.target), shape)
    prompts = [encode_prompt(target.tokenizer, p.text, chat=p.chat) for p in BUILTIN]
    data = []
    for temp, reps in ((0.0, 1), (1.0, args.samples)):
        gen = torch.Generator().manual_seed(0)
        for _ in range(reps):
            outs = on.generate(shape, wt, prompts, [temp] * len(prompts), args.new_tokens, tuple(target.eos_ids), gen)
            data += [on.Sequence(p + r, len(p), f"{b.category} T={temp:g}", temp) for p, r, b in zip(prompts, outs, BUILTIN)]
        print(f"target continuations at T={temp:g}: {reps} x {len(prompts)}", file=sys.stderr)
    students = []
    for ref in args.drafts.split(","):
        folder = resolve(ref).folder
        if folder is None:
            raise SystemExit(f"{ref}: not a local model folder")
        sh, w, cfg = on.load_folder(Path(folder))  # a fed draft (`train online --fed`) is scored per draft step
        students.append(on.Student(ref, sh, w, fed=int((cfg.get("specdec_fed") or {}).get("steps", 0))))
    res = on.held_out(shape, wt, students, data, list(range(len(data))), 4096, False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "agreement.json").write_text(json.dumps({"command": "python scripts/draft_agreement.py " + " ".join(sys.argv[1:]),
                                                    "results": res}, indent=1) + "\n")
    first = next(iter(res.values()))
    kinds = sorted(k for k in first if k != "all")
    lines = ["| draft | " + " | ".join(kinds) + " | all |", "|---|" + "---|" * (len(kinds) + 1)]
    for name, r in res.items():  # a fed draft's rows are <name>-step<k>
        lines.append(f"| {name} | " + " | ".join(f"{r[k]['greedy']:.3f} / {r[k]['t1']:.3f}" for k in kinds + ["all"]) + " |")
    positions = ", ".join(f"{k}: {first[k]['positions']}" for k in kinds)
    text = ("Teacher-forced on the target's continuations of the benchmark prompts: arg-max agreement / "
            f"sum min(p, q) per position (positions: {positions}).\n\n" + "\n".join(lines) + "\n")
    (out / "agreement.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
