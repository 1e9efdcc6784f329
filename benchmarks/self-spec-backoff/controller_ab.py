"""Interleaved A/B of the γ controller: plain decoding, the previous controller and the current one,
one after the other for every prompt, seed and temperature, in one process (so the machine's drift
over minutes cancels; the two controllers swap places from seed to seed).  Usage, from the repository root:

    git show 3695948:src/specdec/gamma.py | sed 's/defaults.COST_GAMMA_START/4/' > benchmarks/self-spec-backoff/gamma_old.py
    python benchmarks/self-spec-backoff/controller_ab.py DRAFT [TEMPERATURES] [REPEATS] [TARGET DTYPE PROMPTS TOKENS]

(the old module is the controller before this change, with its start value of 4 written in).
Prints, per temperature and prompt category, the median and the geometric mean over prompts ×
seeds of each controller's tokens per second relative to plain decoding's (same prompt and seed,
run right before), and the drafted tokens per sequence.
"""

import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gamma_old  # noqa: E402

from specdec.bench.workloads import BUILTIN  # noqa: E402
from specdec.engine import Engine, EngineConfig  # noqa: E402
from specdec.gamma import CostGamma  # noqa: E402
from specdec.sampling import SamplingConfig  # noqa: E402

torch.set_num_threads(2)
draft = sys.argv[1]
temps = [float(t) for t in (sys.argv[2] if len(sys.argv) > 2 else "0,1").split(",")]
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 2
target, dtype, per_category, max_new = (sys.argv[4:8] if len(sys.argv) > 7 else ("smollm2-135m", "auto", "8", "128"))
prompts = [p for cat in ("code", "chat") for p in [b for b in BUILTIN if b.category == cat][: int(per_category)]]
plain = Engine.build(EngineConfig(target=target, dtype=dtype, draft="none"))
spec = Engine.attach(plain.target, EngineConfig(target=target, dtype=dtype, draft=draft))
arms = (("plain", plain, lambda: "auto"), ("old", spec, gamma_old.CostGamma), ("new", spec, CostGamma))
res: dict = {}
for temp in temps:
    for rep in range(repeats):
        for p in prompts:
            ids = plain.encode(p.text, chat=p.chat)
            cfg = SamplingConfig(temperature=temp, max_new_tokens=int(max_new), seed=rep)
            # plain first (each controller's reference), then the two controllers, their order
            # alternating from seed to seed so that neither always runs last
            for name, eng, make in arms if rep % 2 == 0 else (arms[0], arms[2], arms[1]):
                t0 = time.perf_counter()
                out = eng.generate(ids, cfg, gamma=make())
                dt = time.perf_counter() - t0
                res.setdefault((temp, p.category, name), []).append(
                    (len(out.token_ids) / dt, out.result.stats.draft_tokens_proposed))
print(f"target {target} ({dtype}), draft {draft}, {repeats} seeds x {len(prompts)} prompts, {max_new} tokens")
for temp in temps:
    for cat in ("chat", "code", "all"):
        cats = ("chat", "code") if cat == "all" else (cat,)
        row = {name: [x for c in cats for x in res[(temp, c, name)]] for name, _, _ in arms}
        ratios = {n: [a[0] / b[0] for a, b in zip(row[n], row["plain"])] for n in ("old", "new")}
        med = {n: st.median(r) for n, r in ratios.items()}
        geo = {n: st.geometric_mean(r) for n, r in ratios.items()}
        drafted = {n: st.mean(a[1] for a in row[n]) for n in ("old", "new")}
        print(f"T={temp:g} {cat:4s}  x plain (median / geometric mean): old {med['old']:.3f} / {geo['old']:.3f}  "
              f"new {med['new']:.3f} / {geo['new']:.3f}   drafted tokens per sequence: old {drafted['old']:.1f}  "
              f"new {drafted['new']:.1f}")
