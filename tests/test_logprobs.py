"""Reported log-probabilities are the target's processed law at each emitted position.

They must not depend on the drafter or γ (the draft's q is never reported), and must equal the
log of :func:`process_logits` applied to the target's logits for the emitted history (at
temperature 0: the log-softmax of the biased, penalised logits).
"""

from __future__ import annotations

import math

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters import ModelDrafter
from specdec.drafters.tree_builder import TreeSpec
from specdec.gamma import FixedGamma
from specdec.models.toy import ToyLM
from specdec.sampling import PenaltyState, SamplingConfig, process_logits
from specdec.session import TargetSession
from specdec.verify import get_rule

TARGET = ToyLM(8, order=2, seed=4)
DRAFT = TARGET.perturbed(1.0, seed=9)
PROMPT = [1, 2, 3]


def _run(cfg: SamplingConfig, method: str, drafter, gamma: int, top: int, tree: TreeSpec | None = None):
    session = TargetSession(TARGET, PROMPT, cfg, get_rule(method), seed=int(cfg.seed), logprobs=top)
    dec = SpeculativeDecoder(TARGET, drafter, get_rule(method), gamma=FixedGamma(gamma), tree=tree)
    res = dec.generate(PROMPT, cfg, verifier=session)
    if tree is not None:  # the rounds really were trees, and some kept a node off the first branch
        assert all(r.tree for r in res.rounds if r.gamma) and any(r.gamma > r.accepted + 1 for r in res.rounds)
    return res.tokens, session.emitted_logprobs[: len(res.tokens)]


def _oracle(cfg: SamplingConfig, tokens: list[int]) -> list[torch.Tensor]:
    out = []
    for i in range(len(tokens)):
        history = PROMPT + tokens[:i]
        state = PenaltyState.start(torch.tensor(PROMPT), TARGET.vocab_size) if cfg.has_penalties else None
        if state is not None and i:
            state.append(torch.tensor(tokens[:i]))
        logits = TARGET.logits_for(history).unsqueeze(0)
        if cfg.greedy:
            from specdec.sampling import penalised_logits

            out.append(torch.log_softmax(penalised_logits(logits, cfg, state).double(), -1)[0])
        else:
            out.append(process_logits(logits, cfg, state)[0].double().log())
    return out


CASES = [
    (SamplingConfig(temperature=0.8, top_k=5, repetition_penalty=1.3, logit_bias=((3, 1.0),), seed=2, max_new_tokens=20), "coupled"),
    (SamplingConfig(temperature=1.0, top_p=0.8, seed=3, max_new_tokens=20), "block"),
    (SamplingConfig(temperature=0.0, presence_penalty=0.5, max_new_tokens=20, seed=0), "greedy"),
]


@pytest.mark.parametrize("cfg,method", CASES)
@pytest.mark.parametrize("tree", [None, TreeSpec(min_prob=0.0), TreeSpec(shape="static", sample_expand=0.0)],
                         ids=["chain", "dynamic-tree", "static-tree"])
def test_logprobs_are_the_targets_and_independent_of_the_draft(cfg, method, tree):
    """Trees report each kept node's row with its own path as history (penalties included)."""
    tokens, lps = _run(cfg, method, ModelDrafter(DRAFT), 6 if tree is not None else 3, top=3, tree=tree)
    oracle = _oracle(cfg, tokens)
    assert len(lps) == len(tokens) == 20
    for tok, (lp, top), law in zip(tokens, lps, oracle):
        assert lp == pytest.approx(float(law[tok]), abs=1e-9) and math.isfinite(lp)
        best = law.topk(3)
        assert [i for i, _ in top] == best.indices.tolist()
        assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-9)
    if method != "block":  # coupled / greedy: same tokens without a drafter, so the same numbers
        plain_tokens, plain_lps = _run(cfg, method, None, 1, top=3)
        assert plain_tokens == tokens
        assert [lp for lp, _ in plain_lps] == pytest.approx([lp for lp, _ in lps], abs=1e-12)


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_a_scored_prompt_is_the_targets_own_law_at_each_position(chunk):
    """``score_prompt`` (``echo`` with ``logprobs``): token i >= 1 of an 11-token prompt against
    the exact log-softmax of the target's logits after tokens 0 .. i-1, whatever the pieces the
    pass is cut into, with its rank among the vocabulary's tokens; the first token has no entry,
    and a one-token prompt none at all."""
    from specdec.session import score_prompt

    prompt = [1, 2, 3, 0, 5, 7, 7, 2, 6, 4, 1]
    scored = score_prompt(TARGET, prompt, 2, chunk=chunk)
    assert len(scored) == len(prompt) - 1
    for i, (lp, top, rank) in enumerate(scored, start=1):
        law = torch.log_softmax(TARGET.logits_for(prompt[:i]).double(), -1)
        assert lp == pytest.approx(float(law[prompt[i]]), abs=1e-12)
        assert rank == 1 + law.argsort(descending=True).tolist().index(prompt[i])
        best = law.topk(2)
        assert [t for t, _ in top] == best.indices.tolist()
        assert [v for _, v in top] == pytest.approx(best.values.tolist(), abs=1e-12)
    assert score_prompt(TARGET, [4], 2) == []
