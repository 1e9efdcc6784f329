"""What the paired A/B and profile scripts share: their common
options, the set-up (the prompts, the engine and a plain engine on the same loaded target) and
the report they write (the data, and a README quoting the command and the machine)."""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from specdec import defaults
from specdec.bench.workloads import BUILTIN, select
from specdec.engine import Engine, EngineConfig
from specdec.sampling import SamplingConfig
from specdec.verify import get_rule


def add_options(ap: argparse.ArgumentParser) -> None:
    """The options :func:`setup` reads: target, draft, temperatures, tokens, prompts, precision, threads."""
    ap.add_argument("--target", default=defaults.DEFAULT_TARGET)
    ap.add_argument("--draft", default=defaults.DEFAULT_DRAFT)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, help="first N built-in prompts of each category")
    ap.add_argument("--dtype", default="auto", help="the target's precision (as specdec generate --dtype)")
    ap.add_argument("--threads", type=int, default=2)


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(ap)
    ap.add_argument("--out", required=True)
    return ap


def setup(args: argparse.Namespace) -> tuple[list[float], list, Engine, Engine]:
    """(temperatures, prompts, the speculative engine, plain decoding on the same target)."""
    torch.set_num_threads(args.threads)
    temps = [float(t) for t in args.temperatures.split(",")]
    prompts = select(list(BUILTIN), limit=args.limit)
    engine = Engine.build(EngineConfig(target=args.target, draft=args.draft, dtype=args.dtype))
    return temps, prompts, engine, Engine(engine.target, None, "none")


def drafter_arms(doc: str, draft: str, arms: tuple[str, ...]) -> tuple[argparse.Namespace, list[float], list, Engine, dict[str, Engine]]:
    """The drafter A/B scripts' start: their options (``--draft`` defaulting to ``draft``, and
    ``--repeats``), then the plain engine and one engine per arm attached to its target, each with
    its own drafter of that kind: ``(args, temperatures, prompts, plain, engines)``."""
    ap = parser(doc)
    ap.set_defaults(draft=draft)
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    temps, prompts, _, plain = setup(argparse.Namespace(**{**vars(args), "draft": "none"}))
    cfg = EngineConfig(target=args.target, draft=args.draft, dtype=args.dtype)
    return args, temps, prompts, plain, {a: Engine.attach(plain.target, cfg) for a in arms}


def rotated(generate: dict[str, Callable[[list[int], SamplingConfig], object]], encode: Callable[[object], list[int]],
            prompts: list, temps: list[float], repeats: int, max_new_tokens: int) -> Iterator[tuple[object, float, int, dict]]:
    """The paired A/B loop the scripts share, over ``generate`` (arm -> a call decoding token ids
    with a sampling config, the reference arm first): one short warm-up call per arm, then for each
    repeat, temperature and prompt every arm once, in an order rotated per prompt and reversed on
    odd repeats, one seed per prompt and repeat shared by every arm (none at T = 0); yields
    ``(prompt, temperature, repeat, {arm: generation result})``."""
    arms = list(generate)
    warm = SamplingConfig(temperature=0.0, max_new_tokens=16)
    enc0 = encode(prompts[0])
    for a in arms:
        generate[a](enc0, warm)
    for rep in range(repeats):
        for temp in temps:
            for i, p in enumerate(tqdm(prompts, desc=f"T = {temp:g}, repeat {rep + 1}/{repeats}")):
                cfg = SamplingConfig(temperature=temp, max_new_tokens=max_new_tokens,
                                     seed=None if temp == 0 else 1000 * rep + i)
                ids = encode(p)
                order = arms[i % len(arms):] + arms[: i % len(arms)]
                yield p, temp, rep, {a: generate[a](ids, cfg) for a in (order if rep % 2 == 0 else order[::-1])}


def rotated_runs(engines: dict[str, Engine], prompts: list, temps: list[float], repeats: int,
                 max_new_tokens: int, method: str = "block",
                 gamma: str | int = "auto") -> Iterator[tuple[object, float, int, dict]]:
    """:func:`rotated` over ``engines`` (arm -> engine, the plain one first): greedy verification
    at T = 0, ``method`` above it, ``gamma`` as ``--gamma``."""
    def run(engine: Engine) -> Callable[[list[int], SamplingConfig], object]:
        return lambda ids, cfg: engine.decoder(get_rule("greedy" if cfg.greedy else method), gamma).generate(ids, cfg)

    first = engines[next(iter(engines))]
    yield from rotated({a: run(e) for a, e in engines.items()}, lambda p: first.encode(p.text, chat=p.chat),
                       prompts, temps, repeats, max_new_tokens)


def run_row(prompt, temp: float, rep: int, result, ref, **extra) -> dict:  # noqa: ANN001 - bench prompt, results
    """One arm's run as a report row, against ``ref`` (the same prompt's plain run): the fields the
    drafter scripts share, then ``extra``."""
    s = result.stats
    return {"prompt": prompt.id, "category": prompt.category, "temperature": temp, "repeat": rep,
            "tok_s": s.tokens_per_s, "plain_tok_s": ref.stats.tokens_per_s, "speedup": s.tokens_per_s / ref.stats.tokens_per_s,
            "tokens_per_call": s.tokens_per_target_call,
            "draft_ms_per_token": 1e3 * s.draft_s / max(s.draft_tokens_proposed, 1),
            "first_acceptance": s.acceptance_per_position[0] if s.acceptance_per_position else None,
            "same": result.tokens == ref.tokens, **extra}


def drafter_rows(plain: Engine, engines: dict[str, Engine], prompts: list, temps: list[float], repeats: int,
                 max_new_tokens: int) -> list[dict]:
    """Every arm of ``engines`` and ``plain`` on every prompt, temperature and repeat
    (:func:`rotated_runs`), each arm's run a :func:`run_row` against the prompt's plain run, with its
    time to first token (``ttft_ms``, ``plain_ttft_ms``) and drafted tokens (``drafted``): the rows
    :data:`DRAFTER_COLUMNS` reads."""
    rows = []
    for p, temp, rep, res in rotated_runs({"plain": plain, **engines}, prompts, temps, repeats, max_new_tokens):
        ref = res["plain"]
        for a in engines:
            s = res[a].stats
            rows.append(run_row(p, temp, rep, res[a], ref, arm=a, ttft_ms=1e3 * s.ttft_s,
                                plain_ttft_ms=1e3 * ref.stats.ttft_s, drafted=s.draft_tokens_proposed))
    return rows


def groups(rows: list[dict], temps: list[float], kinds: tuple[str, ...] = ("plain", "spec")) -> Iterator[tuple[float, str, str, list[dict]]]:
    """``(temperature, kind, category, rows)`` for each temperature, kind and category ("all",
    "chat", "code") that has rows: the table rows of the two-kind A/B scripts' reports."""
    for temp in temps:
        for kind in kinds:
            for cat in ("all", "chat", "code"):
                rs = [r for r in rows if r["temperature"] == temp and r["kind"] == kind and cat in ("all", r["category"])]
                if rs:
                    yield temp, kind, cat, rs


def arm_table(rows: list[dict], temps: list[float], arms: list[str],
              extra: list[tuple[str, Callable[[list[dict]], str]]], same: str = "greedy = plain") -> list[str]:
    """A Markdown table of paired runs: per temperature and arm (``arms[0]``, the reference, left
    out) the geometric means of the rows' ``speedup`` overall and by category, the ``extra``
    columns (a header and the text it shows for the arm's rows), and at T = 0 how many rows were
    the ``same`` as the reference's."""
    heads = [h for h, _ in extra]
    lines = ["| T | arm | ×plain (all) | chat | code | " + " | ".join(heads + [same]) + " |",
             "|" + "---|" * (5 + len(heads)) + "---|"]
    for temp in temps:
        for a in arms[1:]:
            rs = [r for r in rows if r["arm"] == a and r["temperature"] == temp]
            by = [gmean([r["speedup"] for r in rs if r["category"] == c]) for c in ("chat", "code")]
            equal = f"{sum(r['same'] for r in rs)}/{len(rs)}" if temp == 0 else "n/a"
            cells = [f"{temp:g}", a, f"{gmean([r['speedup'] for r in rs]):.3f}", f"{by[0]:.3f}", f"{by[1]:.3f}",
                     *(fn(rs) for _, fn in extra), equal]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


#: :func:`arm_table`'s ``extra`` columns for drafter A/Bs whose rows carry ``ttft_ms``,
#: ``plain_ttft_ms`` and ``drafted`` (besides :func:`run_row`'s fields)
DRAFTER_COLUMNS: list[tuple[str, Callable[[list[dict]], str]]] = [
    ("TTFT ms (plain)", lambda rs: f"{statistics.median(r['ttft_ms'] for r in rs):.1f} "
                                   f"({statistics.median(r['plain_ttft_ms'] for r in rs):.1f})"),
    ("tokens/call", lambda rs: f"{statistics.mean(r['tokens_per_call'] for r in rs):.2f}"),
    ("drafted / sequence", lambda rs: f"{statistics.mean(r['drafted'] for r in rs):.1f}"),
    ("draft ms / token", lambda rs: f"{statistics.median(r['draft_ms_per_token'] for r in rs):.2f}"),
]


def gmean(xs: list[float]) -> float:
    """Geometric mean; NaN for no values."""
    return statistics.geometric_mean(xs) if xs else float("nan")


def native_model(obj):  # noqa: ANN001, ANN201 - a drafter, a loaded model or the model itself
    """The :class:`~specdec.models.native.NativeCausalLM` behind a drafter or a loaded model
    (``.model`` followed down to the object with ``forward_batch``)."""
    while not hasattr(obj, "forward_batch"):
        obj = obj.model
    return obj


def command() -> str:
    """The command line that ran this script, as a report quotes it."""
    return f"python scripts/{Path(sys.argv[0]).name} " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def write_report(out: str | Path, title: str, data: dict, body: list[str], *, data_name: str = "results.json",
                 indent: int | None = 1) -> None:
    """Write ``data_name`` (the command, the machine, then ``data``) and ``README.md`` (the title,
    the command, the machine line, then ``body``) under ``out``, and print the README."""
    from specdec.bench.report import machine_line
    from specdec.bench.runner import machine_info

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cmd, machine = command(), machine_info()
    (out / data_name).write_text(json.dumps({"command": cmd, "machine": machine, **data}, indent=indent))
    lines = [f"# {title}", "", f"Command: `{cmd}`", "", f"Machine: {machine_line(machine)}.", "", *body]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
