"""Target-aware drafters on the real SmolLM2-135M weights, with randomly initialised heads of the
real shapes (EAGLE-3 on taps 2 / 15 / 27, a 2,048-token draft vocabulary): greedy speculative
output equals plain greedy output token for token, chains and trees, and the features handed to
the drafter are bitwise a teacher-forced pass over the committed sequence."""

from __future__ import annotations

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters.heads import drafter_for
from specdec.drafters.tree_builder import TreeSpec
from specdec.gamma import FixedGamma
from specdec.sampling import SamplingConfig
from specdec.text import encode_prompt
from specdec.verify import get_rule
from tiny import random_head

pytestmark = pytest.mark.slow

PROMPT = "Explain what a hash table is in two sentences."
N_NEW = 20


def _head(kind: str, target):
    cfg = target.model.cfg
    return random_head(kind, hidden=cfg.hidden_size, vocab=cfg.vocab_size, draft_vocab=2048, taps=(2, 15, 27),
                       heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, inter=256, depth=3,
                       scale=0.02)


@pytest.fixture(scope="module")
def setup(smollm2):
    target, _ = smollm2
    ids = encode_prompt(target.tokenizer, PROMPT, chat=True)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=N_NEW)
    plain = SpeculativeDecoder(target.model, None, get_rule("greedy")).generate(ids, cfg).tokens
    return target, ids, cfg, plain


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "medusa", "mtp"])
def test_greedy_with_heads_equals_plain_greedy(setup, kind):
    target, ids, cfg, plain = setup
    drafter = drafter_for(_head(kind, target), target.model.embed)
    # random heads are flat: no node would reach the default probability floor of a tree
    for tree in ([None, TreeSpec(min_prob=0.0)] if kind != "mtp" else [None]):
        dec = SpeculativeDecoder(target.model, drafter, get_rule("greedy"), gamma=FixedGamma(6 if tree else 3), tree=tree)
        out = dec.generate(ids, cfg)
        assert out.tokens == plain, (kind, tree)
        assert out.stats.draft_tokens_proposed > 0 and (out.stats.tree_rounds > 0) == (tree is not None)


def test_features_reach_the_drafter_as_a_teacher_forced_pass(setup):
    target, ids, cfg, plain = setup
    m = target.model
    drafter = drafter_for(_head("eagle3", target), m.embed)
    chunks = []
    add = drafter.add_features
    drafter.add_features = lambda f: (chunks.append(f), add(f))
    out = SpeculativeDecoder(m, drafter, get_rule("greedy"), gamma=FixedGamma(6), tree=TreeSpec()).generate(ids, cfg)
    seq = torch.tensor(ids + out.tokens)
    taps = {k: torch.empty(0) for k in (2, 15, 27)}
    final = m.hidden(seq[:-1], m.new_cache(256), taps=taps)
    want = torch.stack([taps[2], taps[15], taps[27], final], dim=1)
    assert torch.equal(torch.cat(chunks), want)


@pytest.fixture(scope="module")
def int8_target():
    from specdec.models.linear import w8a8_available
    from specdec.models.registry import load

    if not w8a8_available():
        pytest.skip("this torch build has no fbgemm int8 engine")
    return load("smollm2-135m", quant="int8", batch_invariant=True)


def test_int8_target_heads_greedy_equals_plain_and_features_are_bitwise(int8_target):
    """The default target: int8, TorchScript layer loop (the taps are recorded inside it)."""
    m = int8_target.model
    ids = encode_prompt(int8_target.tokenizer, PROMPT, chat=True)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=16)
    plain = SpeculativeDecoder(m, None, get_rule("greedy")).generate(ids, cfg).tokens
    drafter = drafter_for(_head("eagle3", int8_target), m.embed)
    chunks = []
    add = drafter.add_features
    drafter.add_features = lambda f: (chunks.append(f), add(f))
    out = SpeculativeDecoder(m, drafter, get_rule("greedy"), gamma=FixedGamma(3)).generate(ids, cfg)
    assert out.tokens == plain
    seq = torch.tensor(ids + out.tokens)
    taps = {k: torch.empty(0) for k in (2, 15, 27)}
    final = m.hidden(seq[:-1], m.new_cache(256), taps=taps)
    assert torch.equal(torch.cat(chunks), torch.stack([taps[2], taps[15], taps[27], final], dim=1))


@pytest.mark.parametrize("name", sorted(__import__("specdec.drafters.heads", fromlist=["HEADS"]).HEADS))
def test_registry_heads_greedy_equals_plain_or_say_not_shipped(setup, name):
    """Every head the package names: a shipped one (trained weights in the package) drafts on the
    real target with greedy output equal to plain greedy output, chain and tree; one that is not
    shipped is a one-line error, never a silent fallback."""
    from specdec.drafters.heads import build, resolve_head
    from specdec.errors import ConfigError

    target, ids, cfg, plain = setup
    try:
        folder = resolve_head(name)
    except ConfigError as exc:
        assert "not available" in str(exc)
        return
    drafter, label = build(folder, target.model, label=name)
    assert label == name
    trees = [None] if drafter.head.cfg.kind == "mtp" else [None, TreeSpec()]
    proposed = 0
    for tree in trees:
        out = SpeculativeDecoder(target.model, drafter, get_rule("greedy"), gamma=FixedGamma(6 if tree else 4),
                                 tree=tree).generate(ids, cfg)
        assert out.tokens == plain, (name, tree)
        proposed += out.stats.draft_tokens_accepted
    assert proposed > 0  # a trained head agrees with the target somewhere in 2 x 20 tokens


def test_q4_fused_loop_records_the_taps_bitwise(q4_target):
    """The 4-bit target's compiled layer loop (``csrc/layers.cpp``) serves a feature drafter's pass
    too, one call per stretch between taps: every tap (embeddings included) and the final state
    are bitwise what the TorchScript loop records, over two chunks of one cache."""
    m = q4_target.model
    if m.scripted is None or m.scripted.fused is None:
        pytest.skip("no compiled layer loop in this build")
    toks = torch.tensor([1, 504, 3300, 288, 3400, 30, 17, 28, 101, 55, 999, 12])
    assert m.scripted._fuses(m.embed[toks[:6]].float())  # the rows below take the compiled loop

    def features():
        cache, out = m.new_cache(64), []
        for a, b in ((0, 6), (6, 12)):
            taps = {k: torch.empty(0) for k in (0, 2, 15, 27)}
            h = m.hidden(toks[a:b], cache, taps=taps)
            out.append(torch.stack([taps[0], taps[2], taps[15], taps[27], h], dim=1))
        return torch.cat(out)

    fused = features()
    m.scripted._fuses = lambda x: False  # the TorchScript loop
    try:
        scripted = features()
    finally:
        del m.scripted._fuses
    assert torch.equal(fused, scripted)


def test_q4_batched_pass_hands_each_feature_sequence_its_own_features(q4_target):
    """A batching server's pass on the real 4-bit weights (``forward_batch`` with ``taps``: an
    EAGLE-3 head's sequences beside a plain one, in the compiled loop's one call): each feature
    sequence's logits and features (taps 2 / 15 / 27 and the final state) are bitwise its
    ``forward_features`` alone; the plain one's logits bitwise its ``forward``."""
    m = q4_target.model
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 49152, (n,), generator=g) for n in (30, 9, 14)]
    blocks = [torch.randint(0, 49152, (n,), generator=g) for n in (4, 1, 3)]
    taps = [(2, 15, 27), None, (2, 15, 27)]

    def caches():
        out = [m.new_cache(128) for _ in prompts]
        for p, c in zip(prompts, out):
            m.forward(p, c, last_only=True)
        return out

    alone = [m.forward(b, c) if t is None else m.forward_features(b, c, t) for b, c, t in zip(blocks, caches(), taps)]
    got = m.forward_batch([(b, c, False) for b, c in zip(blocks, caches())], taps=taps)
    assert torch.equal(got[1], alone[1])
    for i in (0, 2):
        assert torch.equal(got[i][0], alone[i][0]) and torch.equal(got[i][1], alone[i][1]), i
