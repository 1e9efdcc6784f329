"""What the paired A/B scripts (``confidence_ab.py``, ``kernel_ab.py``) share: their common
options and the set-up (the prompts, the engine and a plain engine on the same loaded target)."""

from __future__ import annotations

import argparse

import torch

from specdec import defaults
from specdec.bench.workloads import BUILTIN, select
from specdec.engine import Engine, EngineConfig


def parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=defaults.DEFAULT_TARGET)
    ap.add_argument("--draft", default=defaults.DEFAULT_DRAFT)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, help="first N built-in prompts of each category")
    ap.add_argument("--dtype", default="auto", help="the target's precision (as specdec generate --dtype)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", required=True)
    return ap


def setup(args: argparse.Namespace) -> tuple[list[float], list, Engine, Engine]:
    """(temperatures, prompts, the speculative engine, plain decoding on the same target)."""
    torch.set_num_threads(args.threads)
    temps = [float(t) for t in args.temperatures.split(",")]
    prompts = select(list(BUILTIN), limit=args.limit)
    engine = Engine.build(EngineConfig(target=args.target, draft=args.draft, dtype=args.dtype))
    return temps, prompts, engine, Engine(engine.target, None, "none")
