#!/usr/bin/env python
"""Structured output (JSON schemas, a regex, a choice list) with and without speculation, paired in one process.

    python scripts/structured_ab.py --out benchmarks/NAME [--temperatures 0,1] [--repeats 2]

Not a test and not part of CI.  Each task is a chat prompt and the grammar its answer must obey
(built by ``specdec.grammar`` as ``generate --json-schema`` / ``--regex`` / ``--choice`` builds
it); every arm decodes every task once per repeat and temperature, in an order rotated per task
and reversed on odd repeats, with one seed per task and repeat shared by the arms (none at T = 0).
Arms: plain decoding, the default drafter as a chain (γ auto) and as trees (``--tree auto``).
Each generation gets a fresh grammar matcher; every output is checked against its grammar's
intent (parsed as JSON, matched, or one of the choices) and, at T = 0, against plain decoding's
tokens.  Writes ``README.md`` and ``results.json``.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace

import torch
from tqdm import tqdm

import paired
from specdec import defaults
from specdec.engine import Engine, EngineConfig
from specdec.grammar import GrammarConstraint, choice_lark, grammar_for
from specdec.sampling import SamplingConfig
from specdec.verify import get_rule

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
RECIPE = {"type": "object", "properties": {"title": {"type": "string"},
                                           "ingredients": {"type": "array", "items": {"type": "string"}},
                                           "minutes": {"type": "integer"}},
          "required": ["title", "ingredients", "minutes"], "additionalProperties": False}
EVENT = {"type": "object", "properties": {"event": {"type": "string"}, "year": {"type": "integer"},
                                          "place": {"type": "string"}, "important": {"type": "boolean"}},
         "required": ["event", "year", "place", "important"], "additionalProperties": False}
BOOKS = {"type": "object", "properties": {"books": {"type": "array", "items": {
    "type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"}},
    "required": ["title", "author"], "additionalProperties": False}}}, "required": ["books"], "additionalProperties": False}

#: (id, chat prompt, grammar kind, grammar spec)
TASKS = [
    ("person", "Describe a fictional person as JSON with name, age and city.", "json_schema", PERSON),
    ("recipe", "Give a simple pancake recipe as JSON: title, ingredients, minutes.", "json_schema", RECIPE),
    ("event", "Describe the first Moon landing as JSON: event, year, place, important.", "json_schema", EVENT),
    ("books", "List three classic novels and their authors as JSON.", "json_schema", BOOKS),
    ("object", "Describe the planet Mars as a JSON object.", "json_object", None),
    ("date", "When did the Berlin Wall fall? Answer as YYYY-MM-DD.", "regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"),
    ("sentiment", "Review: 'The soup was cold and the waiter was rude.' Is this review positive, negative or neutral?",
     "lark", choice_lark(["positive", "negative", "neutral"])),
]


def obeys(kind: str, spec: object, text: str) -> bool:
    if kind in ("json_schema", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return isinstance(value, dict) and (kind == "json_object" or set(value) == set(spec["required"]))  # type: ignore[index]
    if kind == "regex":
        return re.fullmatch(str(spec), text) is not None
    return text in ("positive", "negative", "neutral")


def main() -> int:
    ap = paired.parser(__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.set_defaults(max_new_tokens=96)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    temps = [float(t) for t in args.temperatures.split(",")]
    engine = Engine.build(EngineConfig(target=args.target, draft=args.draft, dtype=args.dtype))
    plain = Engine(engine.target, None, "none")
    tok, vocab = engine.target.tokenizer, engine.target.model.vocab_size
    grammars = {t[0]: grammar_for(t[2], t[3]) for t in TASKS}
    arms = {"plain": (plain, None), "chain": (engine, None), "tree-auto": (engine, "auto")}

    def run(arm: str, task: tuple, cfg: SamplingConfig):  # noqa: ANN202 - a TextResult
        eng, tree = arms[arm]
        cfg = replace(cfg, constraint=GrammarConstraint(tok, grammars[task[0]], vocab))
        method = "greedy" if cfg.greedy else "block"
        return eng.generate(task[1], cfg, chat=True, method=method, tree=tree or defaults.DEFAULT_TREE)

    names = list(arms)
    run(names[0], TASKS[0], SamplingConfig(temperature=0.0, max_new_tokens=8))  # warm-up
    for a in names[1:]:
        run(a, TASKS[0], SamplingConfig(temperature=0.0, max_new_tokens=8))
    rows: list[dict] = []
    for rep in range(args.repeats):
        for temp in temps:
            for i, task in enumerate(tqdm(TASKS, desc=f"T = {temp:g}, repeat {rep + 1}/{args.repeats}", file=sys.stderr)):
                cfg = SamplingConfig(temperature=temp, max_new_tokens=args.max_new_tokens,
                                     seed=None if temp == 0 else 1000 * rep + i)
                order = names[i % len(names):] + names[: i % len(names)]
                outs = {a: run(a, task, cfg) for a in (order if rep % 2 == 0 else order[::-1])}
                ref = outs["plain"]
                for a, out in outs.items():
                    s = out.stats
                    rows.append({"task": task[0], "kind": task[2], "temperature": temp, "repeat": rep, "arm": a,
                                 "tokens": len(out.token_ids), "tok_s": s.tokens_per_s,
                                 "speedup": s.tokens_per_s / ref.stats.tokens_per_s,
                                 "tokens_per_call": s.tokens_per_target_call, "obeys": obeys(task[2], task[3], out.text),
                                 "cut": len(out.token_ids) >= args.max_new_tokens,
                                 "same": out.token_ids == ref.token_ids, "text": out.text})
    body = ["Each arm decodes every task's chat prompt under its grammar (a fresh matcher per generation);",
            "×plain is the geometric mean of per-run speed ratios against the same task's paired plain run.", "",
            "An output cut at the token limit is an unfinished JSON value; the finished ones are checked",
            "(parsed as JSON with the schema's keys, matched by the regex, or one of the choices).", "",
            "| T | arm | ×plain | tok/s | tokens per call | finished outputs valid | cut at the limit | same tokens as plain |",
            "|---|---|---|---|---|---|---|---|"]
    for temp in temps:
        for a in names:
            rs = [r for r in rows if r["arm"] == a and r["temperature"] == temp]
            same = f"{sum(r['same'] for r in rs)}/{len(rs)}" if temp == 0 else "n/a"
            body.append(f"| {temp:g} | {a} | {paired.gmean([r['speedup'] for r in rs]):.3f} | "
                        f"{sum(r['tokens'] for r in rs) / sum(r['tokens'] / r['tok_s'] for r in rs):.1f} | "
                        f"{sum(r['tokens_per_call'] for r in rs) / len(rs):.2f} | "
                        f"{sum(r['obeys'] for r in rs if not r['cut'])}/{sum(not r['cut'] for r in rs)} | "
                        f"{sum(r['cut'] for r in rs)}/{len(rs)} | {same} |")
    body += ["", "Per task (×plain of the chain arm, T = 0 / the other temperatures):", "",
             "| task | kind | " + " | ".join(f"T = {t:g}" for t in temps) + " |", "|---|---|" + "---|" * len(temps)]
    for task in TASKS:
        cells = [paired.gmean([r["speedup"] for r in rows if r["task"] == task[0] and r["arm"] == "chain" and r["temperature"] == t])
                 for t in temps]
        body.append(f"| {task[0]} | {task[2]} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    paired.write_report(args.out, "Structured output with and without speculation", {"rows": rows}, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
