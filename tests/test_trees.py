"""Token trees through the whole decoder, on exact toy models.

Law tests: N = 6,000 independent generations (seed = sample index) of 3 new tokens from the
4-token order-2 toy target of ``test_decoder.py`` (64 possible outputs), drafted as trees by a
perturbed toy draft, chi-square goodness of fit against the exact law, failing at p < 1e-4.
The negative control draws siblings without replacement but declares them independent (the
rule then uses the wrong residuals) and must fail the same test at the same N.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.drafters.tree_builder import TreeSpec
from specdec.errors import ConfigError
from specdec.gamma import FixedGamma, TreeBudget
from specdec.models.toy import ToyCache, ToyLM
from specdec.sampling import SamplingConfig
from specdec.tree import ancestor_mask, attention_schedule, check_parents, depths, is_chain, path, paths, with_root
from specdec.verify import get_rule
from stats import ALPHA, chi_square_pvalue, exact_law

N_SAMPLES = 6_000
N_NEW = 3
PROMPT = [1, 2]
TARGET = ToyLM(4, order=2, seed=0)
DRAFT = TARGET.perturbed(1.0, seed=1)
# siblings drawn from q at T > 0, the whole shape (no sibling stop, every level's best nodes expanded)
SAMPLED = TreeSpec(sample_branching=(2, 2, 1), sample_width=2, sibling_stop=0.0, sample_expand=0.0)

class StrictNoRepeat:
    """A toy grammar: no token twice in a row, the first generated token never 0; like a real
    grammar engine it cannot follow a history that breaks it (asking is an error)."""

    def allowed(self, generated, vocab_size):
        if any(a == b for a, b in zip(generated, generated[1:])) or generated[:1] == [0]:
            raise AssertionError(f"the constraint was asked to follow a forbidden history {generated}")
        mask = torch.ones(vocab_size, dtype=torch.bool)
        mask[generated[-1] if generated else 0] = False
        return mask


OPTIONS = {
    "constraint": SamplingConfig(temperature=1.0, constraint=StrictNoRepeat()),
    "temperature": SamplingConfig(temperature=0.7),
    "top_k": SamplingConfig(temperature=1.0, top_k=2),
    "top_p": SamplingConfig(temperature=1.0, top_p=0.75),
    "repetition_penalty": SamplingConfig(temperature=1.0, repetition_penalty=1.6),
    "freq_presence": SamplingConfig(temperature=1.0, frequency_penalty=0.4, presence_penalty=0.3),
}


def _samples(method: str, cfg: SamplingConfig, spec: TreeSpec | None, *, drafter=None, gamma=None, n: int = N_SAMPLES):
    """``spec`` None: chain drafts (no tree round expected)."""
    dec = SpeculativeDecoder(TARGET, drafter or ModelDrafter(DRAFT), get_rule(method), gamma=gamma or FixedGamma(6), tree=spec)
    out = []
    tree_rounds = 0
    for i in range(n):
        c = SamplingConfig(**{**cfg.__dict__, "seed": i, "max_new_tokens": N_NEW})
        res = dec.generate(PROMPT, c)
        out.append(tuple(res.tokens))
        tree_rounds += res.stats.tree_rounds
    assert (tree_rounds > 0) == (spec is not None)  # trees were really verified (an auto budget may skip some)
    return out


@pytest.mark.parametrize(
    ("method", "option", "spec"),
    [
        ("token", "temperature", SAMPLED),  # siblings drawn without replacement, q reported
        ("token", "repetition_penalty", SAMPLED),
        ("token", "top_p", replace(SAMPLED, siblings="iid")),  # siblings drawn independently
        ("token", "freq_presence", TreeSpec(shape="dynamic", width=2, sample=False)),  # top-k candidates, no q
        ("block", "top_k", SAMPLED),  # traversal verification
        # sampled trees whose sibling count stops once the drawn siblings cover enough of q (and
        # whose unlikely nodes get no children)
        ("token", "temperature", replace(SAMPLED, sibling_stop=0.5)),
        ("block", "top_p", replace(SAMPLED, sibling_stop=0.5, siblings="iid", sample_expand=0.3)),
        ("block", "temperature", TreeSpec(shape="static", sample=False)),
        ("coupled", "temperature", TreeSpec(shape="dynamic", width=2)),
        # deterministic trees with a probability floor (nodes left out, some rounds draft nothing)
        ("token", "repetition_penalty", TreeSpec(shape="dynamic", width=2, sample=False, min_prob=0.3)),
        ("coupled", "top_p", TreeSpec(shape="static", min_prob=0.3)),
        # structured output: each node's row masked along its own path; the draft's q ignores
        # the grammar, so some nodes are forbidden (and everything below them unreachable)
        ("token", "constraint", SAMPLED),
        ("block", "constraint", replace(SAMPLED, siblings="iid")),
        ("coupled", "constraint", TreeSpec(shape="dynamic", width=2)),
    ],
)
def test_tree_output_law_matches_target(method, option, spec):
    cfg = OPTIONS[option]
    assert chi_square_pvalue(_samples(method, cfg, spec), exact_law(TARGET, PROMPT, cfg, N_NEW)) > ALPHA


@pytest.mark.parametrize(("method", "spec"), [("token", SAMPLED), ("block", replace(SAMPLED, siblings="iid")),
                                             ("coupled", TreeSpec(shape="dynamic", width=2))])
def test_tree_output_law_with_a_draft_temperature_factor(method, spec):
    """Trees whose nodes are drawn from (or ranked by) q at 0.5 x T: still the target's law."""
    cfg = OPTIONS["temperature"]
    samples = _samples(method, cfg, spec, drafter=ModelDrafter(DRAFT, temperature_factor=0.5))
    assert chi_square_pvalue(samples, exact_law(TARGET, PROMPT, cfg, N_NEW)) > ALPHA


def test_tree_output_law_with_ngram_trees_and_auto_budget():
    cfg = SamplingConfig(temperature=1.0, top_p=0.9, repetition_penalty=1.2)
    law = exact_law(TARGET, PROMPT, cfg, N_NEW)
    samples = _samples("token", cfg, TreeSpec(), drafter=NgramDrafter(min_ngram=1), gamma=TreeBudget(sizes=(2, 5), warmup=1, probe_every=2, max_probe_every=2))  # a probe every other round
    assert chi_square_pvalue(samples, law) > ALPHA


def test_tree_output_law_with_a_draft_that_ignores_the_grammar():
    """Sampled trees whose q ignores the grammar (so forbidden nodes and their subtrees reach the
    target): still the constrained target's law, n = 6,000."""
    cfg = OPTIONS["constraint"]
    samples = _samples("token", cfg, SAMPLED, drafter=_DraftIgnoresGrammar(DRAFT))
    assert chi_square_pvalue(samples, exact_law(TARGET, PROMPT, cfg, N_NEW)) > ALPHA


def test_negative_control_tree_rows_without_the_constraint_are_detected():
    """Sampled trees verified by a target that ignores the grammar: the output then follows the
    unconstrained law, and the χ² test against the constrained one must fail (the draft ignores
    the grammar too, so the target's rows are the only place it could act)."""
    from specdec.session import TargetSession

    cfg = OPTIONS["constraint"]
    law = exact_law(TARGET, PROMPT, cfg, N_NEW)
    dec = SpeculativeDecoder(TARGET, _DraftIgnoresGrammar(DRAFT), get_rule("token"), gamma=FixedGamma(6), tree=SAMPLED)
    out = []
    for i in range(N_SAMPLES // 4):
        c = SamplingConfig(**{**cfg.__dict__, "seed": i, "max_new_tokens": N_NEW})
        free = SamplingConfig(temperature=1.0, seed=i, max_new_tokens=N_NEW)
        out.append(tuple(dec.generate(PROMPT, c, verifier=TargetSession(TARGET, PROMPT, free, get_rule("token"), seed=i)).tokens))
    assert chi_square_pvalue(out, law) < ALPHA


class _DraftIgnoresGrammar(ModelDrafter):
    """Grows its trees as if there were no constraint (q, when reported, is the unconstrained one):
    nodes the grammar forbids, and subtrees below them, reach the target's rows."""

    def propose_tree(self, context, budget, sampler, *args, **kwargs):
        import copy

        free = copy.copy(sampler)
        free.cfg = replace(sampler.cfg, constraint=None)
        return super().propose_tree(context, budget, free, *args, **kwargs)


def test_greedy_constrained_trees_equal_plain_constrained_greedy():
    """Greedy trees under a grammar give plain constrained greedy output, whether the draft's
    candidates obey the grammar (they do: counted) or not (forbidden nodes and their subtrees
    are cut by the target's rows, never asked of the grammar)."""
    cfg = SamplingConfig(temperature=0.0, constraint=StrictNoRepeat(), logit_bias=((3, 0.5),), max_new_tokens=40)
    target = ToyLM(6, order=2, seed=3)
    draft = target.perturbed(0.3, seed=4)
    plain = SpeculativeDecoder(target, None, get_rule("greedy")).generate([1, 2], cfg).tokens
    assert all(a != b for a, b in zip(plain, plain[1:]))
    forbidden = {True: 0, False: 0}  # draft obeys the grammar -> nodes it forbids

    def counting(base):
        class Counting(base):
            def propose_tree(self, context, *args, **kwargs):
                d = super().propose_tree(context, *args, **kwargs)
                toks = d.tokens.tolist()
                for tok, par in zip(toks, d.parents.tolist()):
                    forbidden[base is ModelDrafter] += tok == (toks[par] if par >= 0 else int(context[-1]))
                return d
        return Counting(draft)

    for base in (ModelDrafter, _DraftIgnoresGrammar):
        for spec in (TreeSpec(min_prob=0.0), TreeSpec(shape="static")):
            res = SpeculativeDecoder(target, counting(base), get_rule("greedy"), gamma=FixedGamma(8), tree=spec).generate([1, 2], cfg)
            assert res.tokens == plain and res.stats.tree_rounds > 0
    assert forbidden[True] == 0 and forbidden[False] > 0


class _MislabelledSiblings(ModelDrafter):
    """Draws siblings without replacement but tells the verifier they are independent."""

    def propose_tree(self, *args, **kwargs):
        return replace(super().propose_tree(*args, **kwargs), siblings="iid")


def test_negative_control_mislabelled_sibling_mode_is_detected():
    cfg = OPTIONS["temperature"]
    samples = _samples("token", cfg, SAMPLED, drafter=_MislabelledSiblings(DRAFT))
    assert chi_square_pvalue(samples, exact_law(TARGET, PROMPT, cfg, N_NEW)) < ALPHA


class _ReducedDraft:
    """A toy draft over some of the target's tokens, giving compact rows (``[n, Vd]`` over
    ``vocab_ids``) when asked, as a native draft model with a reduced vocabulary does."""

    def __init__(self, model: ToyLM, ids: list[int]) -> None:
        self.model = model
        self.vocab_ids = torch.tensor(ids)
        self.vocab_size = model.vocab_size
        self.compact_rows = 0

    def new_cache(self, max_length: int | None = None) -> ToyCache:
        return self.model.new_cache(max_length)

    def _rows(self, logits: torch.Tensor, compact: bool) -> torch.Tensor:  # [n, V] -> [n, Vd] or [n, V]
        if compact:
            self.compact_rows += logits.shape[0]
            return logits[:, self.vocab_ids]
        out = torch.full_like(logits, float("-inf"))
        out[:, self.vocab_ids] = logits[:, self.vocab_ids]
        return out

    def forward(self, tokens, cache, *, last_only: bool = False, compact: bool = False):
        return self._rows(self.model.forward(tokens, cache, last_only=last_only), compact)

    def forward_tree(self, tokens, parents, cache, *, prefix=None, compact: bool = False):
        return self._rows(self.model.forward_tree(tokens, parents, cache, prefix=prefix), compact)


@pytest.mark.parametrize(
    ("method", "option", "spec"),
    [
        ("block", "temperature", None),  # a chain
        ("token", "top_p", SAMPLED),  # siblings without replacement
        ("block", "top_k", replace(SAMPLED, siblings="iid")),  # traversal verification
    ],
)
def test_drafts_drawn_from_compact_rows_keep_the_output_law(method, option, spec):
    """A draft over 3 of the 4 tokens draws from its compact rows at T > 0 and reports q over the
    whole vocabulary (zero for the token it cannot propose, which the target still produces
    through the residual): the output law is the target's (N = 6,000, as above)."""
    cfg = OPTIONS[option]
    draft = _ReducedDraft(DRAFT, [0, 1, 3])
    samples = _samples(method, cfg, spec, drafter=ModelDrafter(draft), gamma=FixedGamma(2 if spec is None else 6))
    assert draft.compact_rows > N_SAMPLES  # the rows were really drawn from as they are
    law = exact_law(TARGET, PROMPT, cfg, N_NEW)
    assert any(2 in s for s in law) and any(2 in s for s in samples)
    assert chi_square_pvalue(samples, law) > ALPHA


# ----------------------------------------------------------------------------- deterministic checks


def _plain(cfg: SamplingConfig, method: str, prompt, target):
    return SpeculativeDecoder(target, None, get_rule(method)).generate(prompt, cfg).tokens


@pytest.mark.parametrize("method", ["greedy", "token", "block", "coupled"])
@pytest.mark.parametrize("shape", ["static", "dynamic"])
def test_greedy_tree_decoding_equals_plain_greedy(method, shape):
    target = ToyLM(6, order=3, seed=7)
    draft = target.perturbed(0.8, seed=8)
    for penalty in (1.0, 1.5):
        cfg = SamplingConfig(temperature=0.0, repetition_penalty=penalty, max_new_tokens=30)
        for prompt in ([1], [2, 3, 4]):
            ref = _plain(cfg, "greedy", prompt, target)
            for n, floor in ((1, 0.0), (5, 0.0), (12, 0.0), (12, 0.3), (12, 0.9)):
                spec = TreeSpec(shape=shape, min_prob=floor)
                dec = SpeculativeDecoder(target, ModelDrafter(draft), get_rule(method), gamma=FixedGamma(n), tree=spec)
                res = dec.generate(prompt, cfg)
                assert res.tokens == ref
                assert res.stats.tree_rounds >= res.stats.target_calls - 1  # the last round may have room for no draft
                if floor == 0.9:  # few nodes reach it: many rounds verify an empty tree
                    assert res.stats.draft_tokens_proposed < res.stats.target_calls


def test_ngram_trees_keep_greedy_exact_and_beat_its_chain():
    target = ToyLM(6, order=3, seed=7)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=60)
    prompt = [1, 2, 3, 1, 2, 4, 1, 2, 5, 0]
    ref = _plain(cfg, "greedy", prompt, target)
    tree = SpeculativeDecoder(target, NgramDrafter(), get_rule("greedy"), gamma=FixedGamma(16), tree=TreeSpec()).generate(prompt, cfg)
    chain = SpeculativeDecoder(target, NgramDrafter(), get_rule("greedy"), gamma=FixedGamma(16)).generate(prompt, cfg)
    assert tree.tokens == chain.tokens == ref
    assert tree.stats.tokens_per_target_call > chain.stats.tokens_per_target_call


def test_coupled_tree_equals_plain_seeded_sampling():
    target = ToyLM(8, order=2, seed=11)
    cfg = SamplingConfig(temperature=1.0, top_p=0.95, repetition_penalty=1.2, max_new_tokens=30)
    for seed in range(6):
        c = SamplingConfig(**{**cfg.__dict__, "seed": seed})
        ref = _plain(c, "coupled", [3, 1], target)
        for strength, spec in ((0.5, TreeSpec()), (3.0, TreeSpec(shape="static"))):
            dec = SpeculativeDecoder(target, ModelDrafter(target.perturbed(strength, seed=1)), get_rule("coupled"), gamma=FixedGamma(10), tree=spec)
            assert dec.generate([3, 1], c).tokens == ref


def _random_parents(m: int, gen: torch.Generator) -> torch.Tensor:
    return torch.tensor([int(torch.randint(-1, i, (1,), generator=gen)) for i in range(m)], dtype=torch.long)


def test_tree_layout_is_what_the_ancestor_relation_says():
    """The layout a tree pass builds from ``parents`` (positions, the attention kernel's per-node
    slot paths, the masked call's additive mask) against a brute force over the ancestor relation
    (walking parents), on 200 random trees and regions scored whole or in part (``prefix``)."""
    import math

    from specdec.models.native import _TreeLayout

    gen = torch.Generator().manual_seed(7)
    for _ in range(200):
        m = int(torch.randint(1, 20, (1,), generator=gen))
        n = int(torch.randint(1, m + 1, (1,), generator=gen))
        parents, s = _random_parents(m, gen), int(torch.randint(0, 30, (1,), generator=gen))
        par = parents.tolist()

        def walk(i: int) -> list[int]:  # region nodes from the root down to i
            return walk(par[i]) + [i] if i >= 0 else []

        want = [walk(i) for i in range(m - n, m)]
        assert ancestor_mask(parents).tolist() == [[j in walk(i) for j in range(m)] for i in range(m)]
        assert depths(parents).tolist() == [len(walk(i)) - 1 for i in range(m)]
        end, start = s + m, s + m - n
        for exact in (True, False):
            lay = _TreeLayout.build(parents, start, end, torch.float32, s if n < m else None, exact=exact)
            assert lay.positions.tolist() == [s + len(w) - 1 for w in want]
            if lay.paths is not None:
                width = max(len(w) for w in want)
                assert lay.paths.tolist() == [[s + k for k in w] + [-1] * (width - len(w)) for w in want]
            if lay.mask is not None:
                ref = [[0.0 if c < s or (c - s) in w else -math.inf for c in range(end)] for w in want]
                assert lay.mask.tolist() == ref


def test_tree_helpers():
    parents = torch.tensor([-1, -1, 0, 0, 2, 1])
    check_parents(parents, 6)
    assert depths(parents).tolist() == [0, 0, 1, 1, 2, 1]
    assert path(parents, 4) == [0, 2, 4] and paths(parents)[5] == [1, 5]
    assert ancestor_mask(parents)[4].tolist() == [True, False, True, False, True, False]
    assert with_root(parents).tolist() == [-1, 0, 0, 1, 1, 3, 2]
    assert is_chain(torch.tensor([-1, 0, 1])) and not is_chain(parents)
    for bad in ([-1, 1], [-2, 0], [0]):
        with pytest.raises(ConfigError):
            check_parents(torch.tensor(bad), len(bad))


def test_toy_tree_scoring_equals_path_scoring_and_compaction():
    m = ToyLM(5, order=3, seed=3)
    cache = m.new_cache()
    m.forward(torch.tensor([1, 2]), cache)
    toks, parents = torch.tensor([3, 4, 0, 1]), torch.tensor([-1, 0, 0, 2])
    out = m.forward_tree(toks, parents, cache)
    for j, p in enumerate(paths(parents)):
        assert torch.equal(out[j], m.logits_for([1, 2] + [int(toks[i]) for i in p]))
    # grown over two calls: the second call's nodes see only their own ancestors
    cache2 = m.new_cache()
    m.forward(torch.tensor([1, 2]), cache2)
    m.forward_tree(toks[:2], parents[:2], cache2)
    assert torch.equal(m.forward_tree(toks[2:], parents, cache2, prefix=2), out[2:])
    cache.compact(torch.tensor([2, 4, 5]), 2)
    assert isinstance(cache, ToyCache) and cache.tokens == [1, 2, 3, 0, 1]


def test_tree_drafts_need_tree_attention():
    class NoTrees(ToyLM):
        forward_tree = None  # type: ignore[assignment]

    target = NoTrees(4, order=2, seed=0)
    from specdec.drafters.base import Draft
    from specdec.session import TargetSession

    sess = TargetSession(target, [1, 2], SamplingConfig(temperature=0.0), get_rule("greedy"), seed=0)
    with pytest.raises(ConfigError, match="tree attention"):
        sess.verify(Draft(tokens=torch.tensor([1, 2]), probs=None, parents=torch.tensor([-1, -1])))


def test_model_drafter_keeps_its_cache_on_the_accepted_path():
    """After every tree round the draft cache holds exactly a prefix of the committed context."""

    class Checked(ModelDrafter):
        def propose_tree(self, context, *args, **kwargs):
            if self.cache is not None:
                assert self.cache.tokens == context[: self.cache.length].tolist()
            return super().propose_tree(context, *args, **kwargs)

    target = ToyLM(6, order=3, seed=7)
    for temperature, method in ((0.0, "greedy"), (1.0, "token")):
        dec = SpeculativeDecoder(target, Checked(target.perturbed(0.8, seed=8)), get_rule(method), gamma=FixedGamma(10), tree=TreeSpec())
        res = dec.generate([1, 2, 3], SamplingConfig(temperature=temperature, seed=3, max_new_tokens=60))
        assert res.stats.tokens_per_target_call > 2.0


@pytest.mark.parametrize("parents, n", [
    ([-1, -1, -1, 0, 1, 0, 3, 4, 6], 9),  # a whole tree, node order not depth-first
    ([-1, 0, 1, 2], 4),  # a chain: nothing to move
    ([-1, -1, 0, 1, 0, 2, 3, 4], 5),  # a tree grown over two calls: the last 5 nodes are scored
])
def test_attention_schedule_lays_out_each_path_with_few_writes(parents, n):
    """Replaying the schedule's writes on the region (slot k starts with node k) leaves each
    visited node's root path in slots 0..depth; every scored node is visited once, depth-first;
    a whole tree needs at most one write per node (its own key), a chain none."""
    par = torch.tensor(parents)
    m = par.numel()
    steps = attention_schedule(par, n)
    assert sorted(j for j, _, _ in steps) == list(range(n))
    slots = list(range(m))
    visited = []
    for j, length, writes in steps:
        for k, v in writes:
            slots[k] = v
        node = m - n + j
        assert slots[:length] == paths(par)[node]
        visited.append(paths(par)[node])
    assert visited == sorted(visited)  # lexicographic order of paths = depth-first pre-order
    total = sum(len(w) for _, _, w in steps)
    if n == m:
        assert all(len(w) <= 1 for _, _, w in steps)
    if is_chain(par):
        assert total == 0


# ----------------------------------------------------------------------------- the end of the target's context


@pytest.mark.parametrize("kind", ["model", "lookahead", "eagle3"])
@pytest.mark.parametrize("prompt_len", [20, 42])
def test_trees_run_to_the_end_of_the_targets_context_as_plain_decoding_does(kind, prompt_len):
    """A 16-node tree needs 16 rows of the target's cache, and a model draft feeds up to 16 x 4 of
    its nodes through its own: near the end of a 48-position context both used to overflow (a
    "KV cache full" traceback, or "the sequence would exceed its context") where plain decoding
    simply stops at the context's end. Each round's tree now takes at most the rows the context
    has left, and a draft model expands no more nodes than its cache holds; the output is plain
    decoding's, greedy and seeded coupled at T = 1."""
    from tiny import random_head, tiny_native

    from specdec.drafters.heads import drafter_for
    from specdec.drafters.lookahead import LookaheadDrafter

    ctx = 48
    target = tiny_native(max_length=ctx)
    prompt = [(7 * i) % 60 + 1 for i in range(prompt_len)]
    spec = TreeSpec(min_prob=0.0)
    for rule, temperature in (("greedy", 0.0), ("coupled", 1.0)):
        cfg = SamplingConfig(temperature=temperature, max_new_tokens=40, seed=5)
        plain = SpeculativeDecoder(target, None, get_rule(rule)).generate(prompt, cfg)
        assert len(plain.tokens) == ctx - prompt_len  # the context's end (its last position too), not max_new_tokens, stops it
        if kind == "model":
            drafter = ModelDrafter(tiny_native(max_length=ctx, seed=1))
        elif kind == "lookahead":
            drafter = LookaheadDrafter(window=3, ngram=3, candidates=2)
        else:
            head = random_head("eagle3", hidden=target.cfg.hidden_size, vocab=target.vocab_size, draft_vocab=40, taps=(1,))
            drafter = drafter_for(head, target.embed)
        out = SpeculativeDecoder(target, drafter, get_rule(rule), gamma=FixedGamma(16), tree=spec).generate(prompt, cfg)
        assert out.tokens == plain.tokens, (kind, rule)
        assert out.stats.tree_rounds > 0
        context = prompt_len
        for r in out.rounds:  # each tree within the rows the context had left
            assert r.gamma <= ctx - context, (context, r.gamma)
            context += r.emitted
        if kind == "model":
            assert drafter.cache is not None and drafter.cache.length <= ctx


def test_check_parents_refuses_a_count_that_is_not_one_per_token():
    """One parent per draft token: too few or too many is a ConfigError saying so; an empty tree
    of zero tokens is fine; a parent below -1 is refused."""
    check_parents(torch.tensor([], dtype=torch.long), 0)
    for parents, n in (([-1, 0], 3), ([-1, 0, 1], 2), ([-1], 0)):
        with pytest.raises(ConfigError, match="one parent per draft token"):
            check_parents(torch.tensor(parents), n)
    with pytest.raises(ConfigError, match="-1"):
        check_parents(torch.tensor([-1, -2]), 2)


def test_with_root_and_is_chain_on_edge_trees():
    """A child of node 0 hangs below node 1 once the pending token is node 0; a chain is only the
    exact chain (a tree whose first edge looks like one is not)."""
    assert with_root(torch.tensor([-1, 0, 0, 1])).tolist() == [-1, 0, 1, 1, 2]
    assert is_chain(torch.tensor([], dtype=torch.long)) and is_chain(torch.tensor([-1]))
    assert not is_chain(torch.tensor([-1, 0, 0])) and not is_chain(torch.tensor([-1, -1]))


def test_check_parents_refuses_a_parents_tensor_that_is_not_one_dimensional():
    """Two valid-looking parents laid out as a [1, 2] matrix are not one parent per token."""
    with pytest.raises(ConfigError, match="one parent per draft token"):
        check_parents(torch.tensor([[-1, 0]]), 2)


def test_depths_are_int64_like_the_parents():
    """``depths`` returns [N] int64 for int64 parents (positions are built from it)."""
    out = depths(torch.tensor([-1, 0, 1, -1], dtype=torch.long))
    assert out.dtype == torch.long and out.tolist() == [0, 1, 2, 0]
