"""Token trees on the real SmolLM2-135M weights: tree attention is bitwise sequential decoding."""

from __future__ import annotations

import pytest
import torch

from specdec.text import encode_prompt
from specdec.tree import paths

PROMPT = "Explain what a hash table is in two sentences."
#: pending token + 9 nodes: three root candidates, branches of depth up to 4
PARENTS = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 4, 7, 5])


def _tree_tokens(ids: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 49152, (PARENTS.numel(),), generator=gen)


def test_tree_scoring_is_bitwise_sequential(smollm2):
    target, _ = smollm2
    m = target.model
    ids = torch.tensor(encode_prompt(target.tokenizer, PROMPT, chat=True))
    toks = _tree_tokens(ids.tolist())
    toks[0] = ids[-1]
    cache = m.new_cache(256)
    m.forward(ids[:-1], cache)
    start = cache.length
    tree = m.forward_tree(toks, PARENTS, cache)  # [n, V]
    assert cache.length == start + toks.numel()
    ref = m.new_cache(256)
    m.forward(ids[:-1], ref)
    for j, p in enumerate(paths(PARENTS)):
        ref.truncate(start)
        seq = torch.cat([m.forward(toks[i : i + 1], ref) for i in p])  # path token by token
        assert torch.equal(tree[j], seq[-1]), f"node {j}"
    # keep one path: the cache then continues exactly like sequential decoding of that path
    keep = torch.tensor(paths(PARENTS)[8]) + start
    cache.compact(keep, start)
    nxt = torch.tensor([5])
    ref.truncate(start)
    m.forward(toks[keep - start], ref)
    assert torch.equal(m.forward(nxt, cache), m.forward(nxt, ref))


def test_fast_tree_attention_matches_within_float_tolerance(smollm2):
    """Without batch invariance (one masked attention call) the logits agree to float error."""
    target, _ = smollm2
    m = target.model
    ids = torch.tensor(encode_prompt(target.tokenizer, PROMPT, chat=True))
    toks = _tree_tokens(ids.tolist())
    toks[0] = ids[-1]
    m.batch_invariant = False
    try:
        cache = m.new_cache(256)
        m.forward(ids[:-1], cache)
        fast = m.forward_tree(toks, PARENTS, cache)
    finally:
        m.batch_invariant = True
    cache = m.new_cache(256)
    m.forward(ids[:-1], cache)
    exact = m.forward_tree(toks, PARENTS, cache)
    assert torch.allclose(fast, exact, atol=1e-3, rtol=1e-4)


def test_greedy_tree_decoding_equals_plain_greedy(smollm2):
    """Trees grown by the draft model (dynamic and static) and by the n-gram index give plain
    greedy output token for token, and the dynamic tree beats the chain in tokens per call."""
    from specdec.decoder import SpeculativeDecoder
    from specdec.drafters import ModelDrafter, NgramDrafter
    from specdec.drafters.tree_builder import TreeSpec
    from specdec.gamma import FixedGamma, TreeBudget
    from specdec.sampling import SamplingConfig
    from specdec.verify import get_rule

    target, draft = smollm2
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=48)
    prompts = [("import os\n\ndef list_python_files(root):\n", False), (PROMPT, True)]

    def run(drafter, gamma, tree, ids):
        dec = SpeculativeDecoder(target.model, drafter, get_rule("greedy"), gamma=gamma, tree=tree, eos_ids=target.eos_ids)
        return dec.generate(ids, cfg)

    for text, chat in prompts:
        ids = encode_prompt(target.tokenizer, text, chat=chat)
        plain = run(None, None, None, ids).tokens
        chain = run(ModelDrafter(draft.model), FixedGamma(4), None, ids)
        tree = run(ModelDrafter(draft.model), FixedGamma(16), TreeSpec(min_prob=0.0), ids)  # the best 16, always
        floor = run(ModelDrafter(draft.model), FixedGamma(16), TreeSpec(), ids)  # only nodes above the default floor
        assert chain.tokens == plain and tree.tokens == plain and floor.tokens == plain
        assert tree.stats.tree_rounds > 0
        assert tree.stats.tokens_per_target_call > chain.stats.tokens_per_target_call
        assert floor.stats.draft_tokens_proposed < tree.stats.draft_tokens_proposed
        assert run(ModelDrafter(draft.model), TreeBudget(), TreeSpec(shape="static"), ids).tokens == plain
        assert run(NgramDrafter(), FixedGamma(12), TreeSpec(), ids).tokens == plain


@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_scripted_tree_pass_is_bitwise_python_and_path_by_path(quant, request):
    """The TorchScript tree pass (depth-first, keys laid out in place) gives bitwise the Python
    tree pass's logits and each node's path scored token by token, and leaves the tree's keys
    in node order in the cache, on the int8 and the 4-bit target.  (The float32 target's
    scripted tree pass is checked against path-by-path scoring by
    ``test_tree_scoring_is_bitwise_sequential``.)"""
    target = request.getfixturevalue(f"{quant}_target")
    m = target.model
    assert m.scripted is not None and m.batch_invariant
    ids = torch.tensor(encode_prompt(target.tokenizer, PROMPT, chat=True))
    toks = _tree_tokens(ids.tolist())
    toks[0] = ids[-1]

    def tree_pass() -> tuple[torch.Tensor, torch.Tensor]:
        cache = m.new_cache(256)
        m.forward(ids[:-1], cache)
        out = m.forward_tree(toks, PARENTS, cache)
        return out, cache.k[:, :, : cache.length].clone()

    scripted, keys = tree_pass()
    saved, m.scripted = m.scripted, None
    try:
        python, python_keys = tree_pass()
    finally:
        m.scripted = saved
    assert torch.equal(scripted, python) and torch.equal(keys, python_keys)
    ref = m.new_cache(256)
    m.forward(ids[:-1], ref)
    start = ref.length
    for j, p in enumerate(paths(PARENTS)):
        ref.truncate(start)
        seq = torch.cat([m.forward(toks[i : i + 1], ref) for i in p])
        assert torch.equal(scripted[j], seq[-1]), f"node {j}"


def test_tree_logprobs_are_plain_decodings_bit_for_bit(q4_target, smollm2):
    """On the real 4-bit target a greedy tree run reports exactly the log-probabilities plain
    decoding reports: each kept node's row is bitwise its path's sequential row."""
    from specdec.decoder import SpeculativeDecoder
    from specdec.drafters import ModelDrafter
    from specdec.drafters.tree_builder import TreeSpec
    from specdec.gamma import FixedGamma
    from specdec.sampling import SamplingConfig
    from specdec.session import TargetSession
    from specdec.verify import get_rule

    _, draft = smollm2
    m = q4_target.model
    ids = encode_prompt(q4_target.tokenizer, PROMPT, chat=True)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=32, repetition_penalty=1.1)

    def run(drafter, tree):
        session = TargetSession(m, ids, cfg, get_rule("greedy"), seed=0, logprobs=2)
        dec = SpeculativeDecoder(m, drafter, get_rule("greedy"), gamma=FixedGamma(8 if tree else 1), tree=tree)
        res = dec.generate(ids, cfg, verifier=session)
        return res, session.emitted_logprobs[: len(res.tokens)]

    plain, plain_lp = run(None, None)
    tree, tree_lp = run(ModelDrafter(draft.model), TreeSpec(min_prob=0.0))
    assert tree.stats.tree_rounds > 0 and tree.tokens == plain.tokens
    assert tree_lp == plain_lp  # floats compared exactly, top-2 ids and values included


def test_structured_output_with_trees_on_the_real_weights(q4_target, smollm2):
    """A JSON schema through llguidance with token trees: greedy trees give plain constrained
    greedy output, and sampled trees (token verification) give JSON that matches the schema."""
    import json

    pytest.importorskip("llguidance")
    from specdec.decoder import SpeculativeDecoder
    from specdec.drafters import ModelDrafter
    from specdec.drafters.tree_builder import TreeSpec
    from specdec.gamma import FixedGamma
    from specdec.grammar import GrammarConstraint, grammar_for
    from specdec.sampling import SamplingConfig
    from specdec.verify import get_rule

    _, draft = smollm2
    m, tok = q4_target.model, q4_target.tokenizer
    schema = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["color", "count"], "additionalProperties": False}
    ids = encode_prompt(tok, "Describe a ball as JSON.", chat=True)

    def run(method, drafter, tree, temperature, seed=0):
        cfg = SamplingConfig(temperature=temperature, seed=seed, max_new_tokens=40,
                             constraint=GrammarConstraint(tok, grammar_for("json_schema", schema), m.vocab_size))
        dec = SpeculativeDecoder(m, drafter, get_rule(method), gamma=FixedGamma(8 if tree else 1), tree=tree,
                                 eos_ids=q4_target.eos_ids)
        return dec.generate(ids, cfg)

    plain = run("greedy", None, None, 0.0)
    tree = run("greedy", ModelDrafter(draft.model), TreeSpec(min_prob=0.0), 0.0)
    assert tree.tokens == plain.tokens and tree.stats.tree_rounds > 0
    for seed in (1, 2):
        out = run("token", ModelDrafter(draft.model), TreeSpec(), 1.0, seed=seed)
        assert out.stats.tree_rounds > 0
        value = json.loads(tok.decode([t for t in out.tokens if t not in q4_target.eos_ids]))
        assert set(value) == {"color", "count"} and value["color"] in ("red", "green", "blue")
