"""Every option at once: random combinations of drafter, draft shape, γ policy, rule and sampling
options through the whole decoder, on exact toy models.

Each option has its own law test elsewhere; bugs hide where options meet (a drafter whose drafts
leave a grammar, a floor under a filter under a tree, penalties with lookahead ...).  Hypothesis
draws ``N_EXAMPLES`` combinations (derandomized, so CI runs the same ones every time) and each
must keep the invariants that need no statistics:

* no exception (a combination the engine refuses must be refused by plain decoding too);
* greedy (T = 0) output equals plain greedy output with the same options, and so do the
  target's reported log-probabilities;
* coupled verification with a seed equals plain seeded sampling with the coupled rule, token for
  token (the drafter never changes the tokens);
* under sampling, every emitted token has positive probability under the target's processed law
  given the history (top-k / top-p / min-p, the grammar, the token filter and the min_tokens
  floor computed here from ``process_logits`` independently of the decoder), the length is
  within ``max_new_tokens`` and the output ends at its first stop token.

Of the 1,500 drawn runs 1,252 drafted, 800 verified token trees, 1,012 accepted draft tokens and
659 rejected some (counted once when this test was written).  A penalty that counted only the
previous draft token instead of all earlier ones (a one-line break of ``_apply_penalties``) failed it.

These are not law tests: a rule that is biased but keeps the support passes them (the chi-square
tests in ``test_decoder.py`` and ``test_trees.py`` catch those).  They catch crashes, tokens the
law forbids, and greedy / coupled drift under combinations no single test lists.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.decoder import SpeculativeDecoder
from specdec.drafters.tree_builder import TreeSpec
from specdec.errors import ConfigError
from specdec.gamma import CostGamma, FixedGamma, TreeBudget
from specdec.models.toy import ToyLM
from specdec.sampling import PenaltyState, SamplingConfig, floor_stops, process_logits
from specdec.session import TargetSession
from specdec.token_filter import TokenFilter
from specdec.verify import get_rule
from toy_drafters import toy_drafter

#: combinations drawn (each decodes up to 24 tokens two or three times on 6-token toy models)
N_EXAMPLES = 1500
VOCAB = 6
EOS = frozenset({5})
TARGET = ToyLM(VOCAB, order=3, seed=7)
DRAFTS = {"close": TARGET.perturbed(0.6, seed=8), "far": TARGET.perturbed(3.0, seed=9), "same": TARGET}


class StrictNoRepeat:
    """A toy grammar: no token twice in a row.  Like a real grammar engine it cannot follow a
    history that breaks it: asking is an error."""

    def allowed(self, generated, vocab_size):
        if any(a == b for a, b in zip(generated, generated[1:])):
            raise AssertionError(f"the constraint was asked to follow a forbidden history {generated}")
        mask = torch.ones(vocab_size, dtype=torch.bool)
        if generated:
            mask[generated[-1]] = False
        return mask


def _drafter(kind: str):
    return toy_drafter(kind, DRAFTS)


_trees = st.sampled_from([
    None,
    TreeSpec(),
    TreeSpec(shape="static", branching=(2, 2, 1), min_prob=0.0),
    TreeSpec(shape="dynamic", width=2, sample=False),
    TreeSpec(sample_branching=(3, 2, 1), sample_width=2, sibling_stop=0.0, sample_expand=0.0),
    TreeSpec(siblings="iid", sibling_stop=0.5, sample_expand=0.1),
])


@st.composite
def combinations(draw):
    temperature = draw(st.sampled_from([0.0, 0.0, 0.7, 1.0, 1.3]))
    method = draw(st.sampled_from(["greedy", "token", "block", "coupled"] if temperature == 0 else ["token", "block", "coupled"]))
    opts: dict = {"temperature": temperature, "max_new_tokens": draw(st.integers(1, 24)), "seed": draw(st.integers(0, 10**6))}
    if temperature > 0:
        opts["top_k"] = draw(st.sampled_from([None, None, 1, 2, 4]))
        opts["top_p"] = draw(st.sampled_from([None, None, 0.5, 0.9]))
        opts["min_p"] = draw(st.sampled_from([None, None, 0.2]))
    if draw(st.booleans()):
        opts["repetition_penalty"] = draw(st.sampled_from([0.8, 1.3, 2.0]))
        opts["frequency_penalty"] = draw(st.sampled_from([0.0, 0.5, -0.4]))
        opts["presence_penalty"] = draw(st.sampled_from([0.0, 0.7]))
    if draw(st.booleans()):
        ids = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3, unique=True))
        opts["logit_bias"] = tuple(sorted((t, draw(st.sampled_from([-100.0, -2.0, 1.5, 5.0]))) for t in ids))
    opts["min_tokens"] = min(opts["max_new_tokens"], draw(st.sampled_from([0, 0, 3, 24])))
    opts["stop_token_ids"] = draw(st.sampled_from([(), (), (2,), (0, 3)]))
    constraint = draw(st.sampled_from(["none", "none", "grammar", "filter", "filter+grammar"]))
    if constraint != "none":
        grammar = StrictNoRepeat() if "grammar" in constraint else None
        if "filter" in constraint:
            allowed = draw(st.sampled_from([None, (0, 1, 2, 5), (1, 3)]))
            banned = draw(st.sampled_from([(), ((4,),), ((1, 2),), ((2, 2, 2), (0,))]))
            opts["constraint"] = TokenFilter(VOCAB, allowed_ids=allowed, banned=banned, inner=grammar)
        else:
            opts["constraint"] = grammar
    drafter = draw(st.sampled_from(["close", "far", "same", "sharp", "ngram", "hybrid", "lookahead"]))
    tree = draw(_trees)
    gamma = draw(st.sampled_from(["fixed", "auto", "budget"] if tree is not None else ["fixed", "auto"]))
    return {
        "cfg": SamplingConfig(**opts),
        "method": method,
        "drafter": drafter,
        "tree": tree,
        "gamma": gamma,
        "gamma_n": draw(st.integers(1, 6)),
        "prompt": draw(st.lists(st.integers(0, VOCAB - 2), min_size=1, max_size=10)),
        "logprobs": draw(st.sampled_from([None, 0, 2])),
        "min_confidence": draw(st.sampled_from([0.0, 0.0, 0.3])),
    }


def _gamma(c):
    if c["gamma"] == "budget":
        return TreeBudget()
    return CostGamma() if c["gamma"] == "auto" else FixedGamma(c["gamma_n"])


def _run(decoder: SpeculativeDecoder, c: dict):
    """Tokens, and the target's log-probabilities when asked for, of one generation."""
    cfg = c["cfg"]
    if c["logprobs"] is None:
        return decoder.generate(c["prompt"], cfg).tokens, None
    floored = floor_stops(cfg, decoder.stop_ids(cfg))  # a verifier made here must see the floor
    session = TargetSession(TARGET, c["prompt"], floored, decoder.rule, seed=cfg.seed, logprobs=c["logprobs"])
    tokens = decoder.generate(c["prompt"], floored, verifier=session).tokens
    return tokens, session.emitted_logprobs[: len(tokens)]  # a round may score past the end: cut as callers do


def _plain(c: dict, method: str):
    return _run(SpeculativeDecoder(TARGET, None, get_rule(method), eos_ids=EOS), c)


def _positive_under_target_law(c: dict, tokens: list[int]) -> None:
    """Each emitted token has positive probability under the processed target law (computed here)."""
    cfg = floor_stops(c["cfg"], EOS | frozenset(c["cfg"].stop_token_ids))
    prompt = c["prompt"]
    state = PenaltyState.start(torch.tensor(prompt), VOCAB) if cfg.needs_state else None
    for i, tok in enumerate(tokens):
        seq = prompt + tokens[:i]
        if state is not None and i:
            state.append(torch.tensor(tokens[i - 1:i]))
        probs = process_logits(TARGET.logits_for(seq).unsqueeze(0), cfg, state)[0]
        assert probs[tok] > 0, (i, tok, probs.tolist(), tokens)


@settings(max_examples=N_EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(c=combinations())
def test_every_combination_keeps_the_invariants(c):
    cfg = c["cfg"]
    spec = SpeculativeDecoder(TARGET, _drafter(c["drafter"]), get_rule(c["method"]), gamma=_gamma(c), eos_ids=EOS,
                              tree=c["tree"], min_confidence=c["min_confidence"])
    plain_method = "greedy" if cfg.greedy else ("coupled" if c["method"] == "coupled" else "block")
    try:
        ref, ref_lp = _plain(c, plain_method)
    except ConfigError:  # refused plainly: speculation must refuse it too
        with pytest.raises(ConfigError):
            _run(spec, c)
        return
    tokens, lp = _run(spec, c)
    stops = EOS | frozenset(cfg.stop_token_ids)
    assert len(tokens) <= cfg.max_new_tokens
    assert all(t not in stops for t in tokens[:-1]), tokens
    _positive_under_target_law(c, tokens)  # greedy: each token is the processed law's arg-max
    if cfg.greedy or c["method"] == "coupled":
        assert tokens == ref, (tokens, ref)
        if lp is not None:
            assert lp == ref_lp
    elif lp is not None:
        assert len(lp) == len(tokens) and all(v > float("-inf") for v, _ in lp)
