"""Write a JSONL prompt file of long prompts for `specdec bench --prompts`, cut from this
repository's own text: the time to the first token and prompt lookup's share both grow with a
prompt's length, which the built-in prompts (~40 tokens each) never show.

* ``code/<file>-<n>``: a Python module of the package cut at a line boundary after ~n tokens of the
  target's tokenizer, as a plain completion (the model goes on writing the module);
* ``chat/<section>-<n>``: "Summarise ..." over a section of NOTES.md cut the same way, through the
  chat template.

    python scripts/long_prompts.py --out benchmarks/long-prompts-m/prompts.jsonl
    python scripts/long_prompts.py --lengths 3000 5500 --code src/specdec/verify.py src/specdec/session.py \
        --sections "Token trees" "Quantised targets: the int8 path and the per-op overhead" \
        --out benchmarks/long-context-m/prompts.jsonl

The file is committed with the runs that use it, so a later change to the sources does not change
what those runs measured.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODE = ["src/specdec/verify.py", "src/specdec/tree.py", "src/specdec/server/scheduler.py", "src/specdec/session.py"]
NOTES_SECTIONS = ["Design cuts", "Where the speed-up stops, and why", "Tree verification rules",
                  "Serving many users: batching and hardening"]
LENGTHS = [400, 800, 1200, 1600]


def cut(text: str, tokenizer, n: int) -> str:
    """The longest run of whole lines of ``text`` that is at most ``n`` tokens."""
    out: list[str] = []
    for line in text.splitlines(keepends=True):
        if len(tokenizer.encode("".join(out) + line)) > n:
            break
        out.append(line)
    return "".join(out)


def section(notes: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", notes, re.S | re.M)
    if m is None:
        raise SystemExit(f"NOTES.md has no section {title!r}")
    return m.group(1).strip() + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSONL file to write")
    ap.add_argument("--target", default="smollm2-135m", help="whose tokenizer counts the tokens")
    ap.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="tokens of each prompt, in turn")
    ap.add_argument("--code", nargs="+", default=CODE, help="source files cut into the code prompts, one per length")
    ap.add_argument("--sections", nargs="+", default=NOTES_SECTIONS,
                    help="NOTES.md sections summarised in the chat prompts, one per length")
    args = ap.parse_args()
    if len(args.code) != len(args.lengths) or len(args.sections) != len(args.lengths):
        ap.error("give one --code file and one --sections title per length")
    from specdec.models.registry import load_tokenizer, resolve

    tok = load_tokenizer(resolve(args.target).folder)
    notes = (ROOT / "NOTES.md").read_text()
    rows = []
    for path, n in zip(args.code, args.lengths):
        text = cut((ROOT / path).read_text(), tok, n)
        rows.append({"id": f"code/{Path(path).stem}-{n}", "category": "code", "chat": False, "prompt": text})
    for title, n in zip(args.sections, args.lengths):
        head = "Summarise these engineering notes in five bullet points.\n\n"
        text = head + cut(section(notes, title), tok, n - len(tok.encode(head)))
        slug = re.sub(r"[^a-z]+", "-", title.lower()).strip("-")[:24]
        rows.append({"id": f"chat/{slug}-{n}", "category": "chat", "chat": True, "prompt": text})
    for r, n in zip(rows, args.lengths * 2):
        if len(tok.encode(r["prompt"])) < 0.9 * n:
            raise SystemExit(f"{r['id']}: its text is too short for {n} tokens")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for r in rows:
        print(f"{r['id']}: {len(tok.encode(r['prompt']))} tokens")


if __name__ == "__main__":
    main()
