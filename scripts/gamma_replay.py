#!/usr/bin/env python
"""Replay γ controllers over recorded drafts: the same rounds for every controller, in seconds.

    python scripts/gamma_replay.py record --out runs/gamma-replay.json
    python scripts/gamma_replay.py replay runs/gamma-replay.json --arms auto,1,2,3,w=2,w=10

Not a test and not part of CI.  Paired runs of real decoding (``scripts/controller_ab.py``) move
by several per cent from run to run on a shared 2-core machine; a controller change worth 1-3 %
needs many of them.  This replays the decoder's loop instead, with nothing left to chance but
what is drawn on purpose:

* ``record`` decodes each built-in prompt plainly with the target (greedy at T = 0, sampled with a
  seed per prompt at T > 0), then scores prompt + output teacher-forced with the draft model: at
  T = 0 whether the draft's arg-max is the target's token at each position (a chain drafted from
  there keeps its tokens while they are), at T > 0 the probability ``sum(min(p, q))`` that a token
  drafted there is accepted (q at the draft's temperature factor × T).  It also times the target's
  pass over 1-13 rows and real decoding rounds at fixed γ 1-4, whose drafting times give a line
  ``fixed + step · γ``, and the rule's time per round.
* ``replay`` runs the default drafter's loop over those records: prompt lookup first (its
  proposals are recomputed from the recorded context; its tokens are kept while they equal the
  recorded output, which at T > 0 is a sample of the target's law, so that is exact in
  distribution), its length from its own controller; otherwise the model drafts γ tokens, kept
  while the recorded agreement holds (T = 0) or while uniform draws fall below the acceptance
  probabilities (T > 0).  Each round's measured seconds are the recorded costs times a log-normal
  factor (``--noise``), as the controllers see timings; speed-ups are over plain decoding
  (one-row passes plus the rule), means over ``--seeds`` draws.

Arms: ``auto`` (this checkout's γ auto), ``N`` (fixed γ), ``w=X`` (γ auto with the acceptance
prior weighted as X drafted positions), ``rev=REV`` (γ auto of ``src/specdec/gamma.py`` at git
revision REV, lookup's controller too).  A replay is a model of decoding, not a measurement of it:
it leaves out what the costs do not say (the cache state a round leaves behind, preemption), so
a controller it prefers must still win a paired run.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from controller_ab import load_base

MAX_ROWS = 13  # target pass costs recorded for 1..MAX_ROWS rows (γ up to 12)


def record(args: argparse.Namespace) -> int:
    import paired

    from specdec.sampling import SamplingConfig
    from specdec.verify import get_rule

    temps, prompts, engine, plain = paired.setup(args)
    draft = engine.drafter.model.model  # the hybrid's model drafter's model
    ids_map = draft.vocab_ids
    target = engine.target.model
    factor = float(getattr(engine.drafter, "temperature_factor", 1.0))
    out: dict = {"target": args.target, "draft": args.draft, "max_new_tokens": args.max_new_tokens, "temperatures": {}}
    for temp in temps:
        rule = get_rule("greedy" if temp == 0 else "block")
        records = []
        for i, p in enumerate(prompts):
            ids = engine.encode(p.text, chat=p.chat)
            cfg = SamplingConfig(temperature=temp, max_new_tokens=args.max_new_tokens, seed=None if temp == 0 else i)
            y = plain.decoder(rule).generate(ids, cfg).tokens
            seq = torch.tensor(ids + y)
            n, start = len(y), len(ids) - 1  # rows start-1+j predict y[j]
            with torch.inference_mode():
                q_logits = draft.forward(seq, draft.new_cache(seq.numel()), compact=True)[start : start + n].float()  # [n, Vd]
                if temp == 0:
                    agree = (ids_map[q_logits.argmax(-1)] == torch.tensor(y)).tolist()
                    rec = {"match": [int(a) for a in agree]}
                else:
                    p_logits = target.forward(seq, target.new_cache(seq.numel()))[start : start + n].float()  # [n, V]
                    p_law = torch.softmax(p_logits / temp, -1)
                    q_law = torch.zeros_like(p_law)
                    q_law[:, ids_map] = torch.softmax(q_logits / (temp * factor), -1)
                    rec = {"accept": [round(float(b), 5) for b in torch.minimum(p_law, q_law).sum(-1)]}
            records.append({"id": p.id, "category": p.category, "prompt": ids, "output": y, **rec})
        # a drafting round's seconds by γ, from real rounds at fixed γ (the first four prompts of each category)
        by_gamma: dict[int, list[float]] = {}
        other, lookup = [], []
        for g in range(1, 5):
            for i, p in enumerate(prompts[:4] + prompts[-4:]):
                cfg = SamplingConfig(temperature=temp, max_new_tokens=args.max_new_tokens, seed=None if temp == 0 else i)
                r = engine.decoder(rule, gamma=g, tree="chain").generate(engine.encode(p.text, chat=p.chat), cfg)
                for rd in r.rounds:
                    if rd.free:
                        lookup.append(rd.draft_ms / 1e3)
                    elif rd.gamma == g:
                        by_gamma.setdefault(g, []).append(rd.draft_ms / 1e3)
                        other.append(rd.verify_ms / 1e3)
        gs = sorted(by_gamma)
        meds = [statistics.median(by_gamma[g]) for g in gs]
        step = statistics.covariance(gs, meds) / statistics.variance(gs)
        fixed = statistics.mean(meds) - step * statistics.mean(gs)
        out["temperatures"][f"{temp:g}"] = {"prompts": records, "draft_fixed_s": fixed, "draft_step_s": step,
                                            "other_s": statistics.median(other), "lookup_s": statistics.median(lookup)}
        print(f"T={temp:g}: drafting {fixed * 1e3:.3f} ms + {step * 1e3:.3f} ms a token, rule {statistics.median(other) * 1e3:.3f} ms")
    # the target's pass by rows, after the first prompt
    ids = torch.tensor(engine.encode(prompts[0].text, chat=prompts[0].chat))
    cache = target.new_cache(ids.numel() + MAX_ROWS + 1)
    target.forward(ids, cache, last_only=True)
    length = cache.length
    costs: dict[int, list[float]] = {}
    for _ in range(5):
        for n in range(1, MAX_ROWS + 1):
            for _ in range(6):
                cache.truncate(length)
                t0 = time.perf_counter()
                target.forward(ids[-n:], cache)
                costs.setdefault(n, []).append(time.perf_counter() - t0)
    out["target_s"] = {str(n): statistics.median(v) for n, v in costs.items()}
    print("target pass ms by rows:", {n: round(statistics.median(v) * 1e3, 3) for n, v in costs.items()})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out))
    return 0


class _Fixed:
    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def next_gamma(self) -> int:
        return self.gamma

    def update(self, **_: float) -> None:
        pass


def _controllers(arm: str):  # noqa: ANN202 - (model controller factory, lookup controller factory)
    from specdec import defaults
    from specdec.gamma import CostGamma

    def lookup(cls=CostGamma, **kw):  # noqa: ANN001, ANN202
        return lambda: cls(max_gamma=defaults.HYBRID_LOOKUP_MAX, start=defaults.HYBRID_LOOKUP_START, **kw)

    current = lookup(prior_weight=defaults.HYBRID_LOOKUP_PRIOR_WEIGHT)
    if arm == "auto":
        return CostGamma, current
    if arm.isdigit():
        return (lambda: _Fixed(int(arm))), current
    if arm.startswith("w="):
        return (lambda: CostGamma(prior_weight=float(arm[2:]))), current
    if arm.startswith("rev="):
        base = load_base(arm[4:])
        return base.CostGamma, lookup(base.CostGamma)
    raise SystemExit(f"not an arm: {arm!r} (auto, N, w=X or rev=REV)")


def _lookup_proposals(records: list[dict]) -> list[list[list[int]]]:
    """Prompt lookup's 12-token proposal at each position of each record (a function of the context)."""
    from specdec import defaults
    from specdec.drafters.ngram import NgramDrafter

    out = []
    for rec in records:
        lookup = NgramDrafter(min_ngram=defaults.HYBRID_NGRAM_MIN, max_ngram=defaults.HYBRID_NGRAM_MAX)
        lookup.prepare(torch.tensor(rec["prompt"]))
        out.append([lookup.propose(torch.tensor(rec["prompt"] + rec["output"][:i]), defaults.MAX_GAMMA, None).tokens.tolist()
                    for i in range(len(rec["output"]))])
    return out


def _replay(data: dict, target_s: dict[int, float], proposals: list, make_model, make_lookup,  # noqa: ANN001
            noise: float, seed: int) -> dict[str, float]:
    from specdec import defaults

    rng = random.Random(seed)

    def seen(t: float) -> float:
        return t * math.exp(rng.gauss(0.0, noise))

    fixed, step, other, lookup_s = data["draft_fixed_s"], data["draft_step_s"], data["other_s"], data["lookup_s"]
    spent: dict[str, float] = {}
    plain: dict[str, float] = {}
    for rec, props in zip(data["prompts"], proposals):
        y, n = rec["output"], len(rec["output"])
        model, lookup = make_model(), make_lookup()
        i, seconds = 0, 0.0
        while i < n:
            remaining = n - i
            limit = min(remaining - 1, defaults.MAX_GAMMA)
            g = min(model.next_gamma(), limit) if remaining > 1 else 0
            found = props[i][: max(1, min(lookup.next_gamma(), limit))] if limit > 0 else []
            if found:  # a lookup round: its tokens are kept while they are the recorded output
                kept = 0
                while kept < len(found) and found[kept] == y[i + kept]:
                    kept += 1
                d, t, o = seen(lookup_s), seen(target_s[len(found) + 1]), seen(other)
                lookup.update(gamma=len(found), accepted=kept, draft_s=d, target_s=t, other_s=o)
            else:
                kept = 0
                if "match" in rec:
                    while kept < g and rec["match"][i + kept]:
                        kept += 1
                else:
                    while kept < g and rng.random() < rec["accept"][i + kept]:
                        kept += 1
                d = seen(fixed + step * g) if g > 0 else seen(lookup_s)
                t, o = seen(target_s[g + 1]), seen(other)
                model.update(gamma=g, accepted=kept, draft_s=d, target_s=t, other_s=o)
                if hasattr(lookup, "observe_cost"):
                    lookup.observe_cost(g + 1, t)
            seconds += d + t + o
            i += kept + 1
        cat = rec["category"]
        spent[cat] = spent.get(cat, 0.0) + seconds
        plain[cat] = plain.get(cat, 0.0) + n * (target_s[1] + other)
    out = {cat: plain[cat] / spent[cat] for cat in spent}
    out["all"] = sum(plain.values()) / sum(spent.values())
    return out


def replay(args: argparse.Namespace) -> int:
    recorded = json.loads(Path(args.data).read_text())
    target_s = {int(n): s for n, s in recorded["target_s"].items()}
    print(f"{recorded['target']} + {recorded['draft']}, {args.seeds} draws per arm, timing noise σ = {args.noise:g}")
    print("| T | arm | ×plain (all) | chat | code |")
    print("|---|---|---|---|---|")
    for temp, data in recorded["temperatures"].items():
        proposals = _lookup_proposals(data["prompts"])
        for arm in args.arms.split(","):
            make_model, make_lookup = _controllers(arm)
            runs = [_replay(data, target_s, proposals, make_model, make_lookup, args.noise, s) for s in range(args.seeds)]
            mean = {k: statistics.mean(r[k] for r in runs) for k in runs[0]}
            print(f"| {temp} | {arm} | {mean['all']:.3f} | {mean.get('chat', float('nan')):.3f} | {mean.get('code', float('nan')):.3f} |",
                  flush=True)
    return 0


def main() -> int:
    import paired

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="decode, score and time the built-in prompts")
    paired.add_options(rec)
    rec.add_argument("--out", required=True, help="the record (JSON)")
    rep = sub.add_parser("replay", help="replay controllers over a record")
    rep.add_argument("data")
    rep.add_argument("--arms", default="auto,1,2,3")
    rep.add_argument("--noise", type=float, default=0.1, help="σ of the log-normal factor on each measured time")
    rep.add_argument("--seeds", type=int, default=8)
    args = ap.parse_args()
    return record(args) if args.command == "record" else replay(args)


if __name__ == "__main__":
    sys.exit(main())
