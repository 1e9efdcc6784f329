#!/usr/bin/env python
"""Speculative decoding behind the server's batching wrappers vs bare, in one process: what a
second thread's OpenMP team costs on a small CPU.

    python scripts/served_threads.py --out benchmarks/NAME
    OMP_WAIT_POLICY=active python scripts/served_threads.py --out benchmarks/NAME

Not a test and not part of CI.  The process is laid out as ``specdec serve`` lays out a server
(see ``specdec.server.compute``): the models are loaded on the compute thread, and that is the
only thread with an OpenMP team.  Every built-in prompt (``--limit``) is generated once with the
target and the draft bare on the compute thread; then ``--rounds`` times, alternating, bare again
and with both models behind the batching server's wrappers, driven from a request thread (it
samples and verifies on one OpenMP thread, both models' passes run on the compute thread), as a
served request is.  Greedy, γ auto, the default drafter's model (no lookup).  Reported: tokens/s
over all prompts for each block, and whether every output equals the first block's (it must: the
wrappers never change a token).  Until the server had its compute thread, each scheduler ran its passes on
a thread of its own and the first block here was run on the main thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
from tqdm import tqdm

import paired

from specdec.decoder import SpeculativeDecoder
from specdec.drafters.model import ModelDrafter
from specdec.gamma import CostGamma
from specdec.sampling import SamplingConfig
from specdec.server.compute import COMPUTE, one_openmp_thread
from specdec.server.scheduler import BatchedModel, Scheduler
from specdec.verify import get_rule


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--rounds", type=int, default=2)
    ap.set_defaults(temperatures="0")
    args = ap.parse_args()
    _, prompts, engine, _ = COMPUTE.run(paired.setup, args)
    draft, target = paired.native_model(engine.drafter), paired.native_model(engine.target)
    served = (BatchedModel(target, Scheduler(target, name="target")), BatchedModel(draft, Scheduler(draft, name="draft")))
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=args.max_new_tokens)
    encoded = [engine.encode(p.text, chat=p.chat) for p in prompts]

    def block(name: str, models) -> dict:  # noqa: ANN001
        tokens, seconds, outs = 0, 0.0, []
        for ids in tqdm(encoded, desc=name):
            dec = SpeculativeDecoder(models[0], ModelDrafter(models[1]), get_rule("greedy"), gamma=CostGamma())
            start = time.perf_counter()
            res = dec.generate(ids, cfg)
            seconds += time.perf_counter() - start
            tokens += len(res.tokens)
            outs.append(res.tokens)
        return {"block": name, "tok_s": tokens / seconds, "outputs": outs}

    def request_thread(name: str) -> dict:  # a served request: its own thread, no OpenMP team
        out: list[dict] = []

        def run() -> None:
            one_openmp_thread()
            out.append(block(name, served))

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return out[0]

    blocks = [COMPUTE.run(block, "bare, on the compute thread", (target, draft))]
    for r in range(args.rounds):
        blocks.append(request_thread(f"behind the wrappers, from a request thread ({r + 1})"))
        blocks.append(COMPUTE.run(block, f"bare ({r + 1})", (target, draft)))
    ref = blocks[0]["outputs"]
    policy = os.environ.get("OMP_WAIT_POLICY", "unset")
    lines = [f"{len(prompts)} prompts, {args.max_new_tokens} tokens, greedy, γ auto, the draft model alone "
             f"(no prompt lookup); OMP_WAIT_POLICY {policy}; torch threads {torch.get_num_threads()}.", "",
             "| block | tok/s | outputs = first block |", "|---|---|---|"]
    for b in blocks:
        lines.append(f"| {b['block']} | {b['tok_s']:.1f} | {sum(o == r for o, r in zip(b['outputs'], ref))}/{len(ref)} |")
    paired.write_report(args.out, "Speculative decoding behind the server's batching wrappers vs bare, one process",
                        {"omp_wait_policy": policy, "blocks": [{k: v for k, v in b.items() if k != "outputs"} for b in blocks]},
                        lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
