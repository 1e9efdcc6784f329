#!/usr/bin/env python
"""The draft model behind the server's wrappers: compact draft rows against whole rows, paired.

    python scripts/served_draft_ab.py --out benchmarks/NAME

Not a test and not part of CI.  The server runs its draft model behind a wrapper (the batching
scheduler, or a lock with ``--no-batching``).  For every built-in prompt and temperature this
drafts ``--gamma`` tokens after the prompt, as a speculative round does, with the draft model
bare, behind the lock and behind the scheduler; each of those once on the draft vocabulary's
compact rows and once with the rows scattered into the whole vocabulary (as the wrappers did
before they passed compact rows through), the arms alternating in a rotated order,
``--repeats`` times.  Reported: the median milliseconds per drafted token of each arm (prefill
excluded), and whether each arm drafted the first host's compact arm's tokens (the same seed at
T > 0).
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

import torch
from tqdm import tqdm

import paired

from specdec.drafters.base import DraftSampler
from specdec.drafters.model import ModelDrafter
from specdec.sampling import SamplingConfig
from specdec.server.scheduler import BatchedModel, Scheduler
from specdec.server.sessions import SerializedModel


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hosts", default="bare,lock,scheduler",
                    help="comma list of bare, lock, scheduler (lock and scheduler run their passes on the server's "
                         "compute thread: its OpenMP team next to the main thread's slows every arm down, so measure "
                         "bare in a run of its own; scripts/served_threads.py lays a process out as the server does)")
    args = ap.parse_args()
    temps, prompts, engine, _ = paired.setup(args)
    model = paired.native_model(engine.drafter)
    if model.vocab_ids is None:
        raise SystemExit("this draft model has no reduced vocabulary: there are no compact rows to compare")
    make = {"bare": lambda: model, "lock": lambda: SerializedModel(model, threading.Lock()),
            "scheduler": lambda: BatchedModel(model, Scheduler(model, name="draft"))}
    names = args.hosts.split(",")
    if not names or any(h not in make for h in names):
        raise SystemExit(f"--hosts: a comma list of {', '.join(make)}")
    hosts = {h: make[h]() for h in names}
    arms = [(h, c) for h in hosts for c in (True, False)]
    rows = []
    for temp in temps:
        for rep in range(args.repeats):
            for i, p in enumerate(tqdm(prompts, desc=f"T = {temp:g}, repeat {rep + 1}/{args.repeats}")):
                ctx = torch.tensor(engine.encode(p.text, chat=p.chat))
                order = arms[(i + rep) % len(arms):] + arms[: (i + rep) % len(arms)]
                tokens = {}
                for host, compact in order:
                    d = ModelDrafter(hosts[host])
                    d.prepare(ctx)  # the prefill (all but the prompt's last token), not timed
                    sampler = DraftSampler(SamplingConfig(temperature=temp), "argmax" if temp == 0 else "multinomial",
                                           penalties=None, generator=torch.Generator().manual_seed(1000 * rep + i))
                    if not compact:
                        sampler = _Whole(sampler)
                    start = time.perf_counter()
                    out = d.propose(ctx, args.gamma, sampler)
                    seconds = time.perf_counter() - start
                    tokens[(host, compact)] = out.tokens.tolist()
                    rows.append({"T": temp, "prompt": p.id, "repeat": rep, "host": host, "compact": compact,
                                 "drafted": out.tokens.numel(), "ms_per_token": 1000 * seconds / max(out.tokens.numel(), 1)})
                for r in rows[-len(arms):]:
                    r["same"] = tokens[(r["host"], r["compact"])] == tokens[(names[0], True)]
    lines = [f"{len(prompts)} prompts × {args.repeats} repeats, γ = {args.gamma} drafted after each prompt (prefill not "
             "timed), arms alternating in a rotated order. Median ms per drafted token; *same* = the arm drafted the "
             f"{names[0]} compact arm's tokens (same seed).", "",
             "| T | host | compact rows | whole rows | compact ÷ whole | same tokens |", "|---|---|---|---|---|---|"]
    for temp in temps:
        for host in hosts:
            med = {c: statistics.median(r["ms_per_token"] for r in rows if r["T"] == temp and r["host"] == host
                                        and r["compact"] == c) for c in (True, False)}
            same = [r["same"] for r in rows if r["T"] == temp and r["host"] == host]
            lines.append(f"| {temp:g} | {host} | {med[True]:.3f} | {med[False]:.3f} | {med[True] / med[False]:.2f} "
                         f"| {sum(same)}/{len(same)} |")
    paired.write_report(args.out, f"The server's draft wrappers: compact draft rows vs whole rows ({args.draft})",
                        {"gamma": args.gamma, "rows": rows}, lines)
    return 0


class _Whole:
    """A draft sampler that asks for whole-vocabulary rows (as the wrappers forced before)."""

    def __init__(self, sampler: DraftSampler) -> None:
        self._s = sampler

    compact = False

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._s, name)

    def __call__(self, *a, **kw):  # noqa: ANN002, ANN003, ANN204
        return self._s(*a, **kw)


if __name__ == "__main__":
    sys.exit(main())
