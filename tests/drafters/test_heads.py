"""Target-aware drafters (EAGLE-1/3, Medusa, MTP) and the feature seam.

* the features a drafter receives are bitwise a teacher-forced ``hidden(taps)`` pass over the
  committed sequence (chains and trees), and the TorchScript loop records the same taps;
* the drafters compute what the modules compute on a whole sequence (training's view);
* greedy speculative decoding equals plain greedy decoding for every kind, chain and tree;
* law tests: N = 2,000 generations (seed = index) of 3 tokens from the 4-token order-2 toy target
  (64 outputs), random heads over a 3-token draft vocabulary (so one token always has q = 0),
  chi-square against the exact law at p < 1e-4; the negative control reports q with the token
  outside the draft vocabulary given mass (a wrong scatter) and must fail the same test, already
  at N = 1,000 (it gives p ~ 1e-21 there).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters.base import Draft
from specdec.drafters.heads import EagleDrafter, drafter_for
from specdec.drafters.tree_builder import TreeSpec
from specdec.gamma import FixedGamma
from specdec.heads.modules import rope_tables, ttt_mask
from specdec.heads.runtime import stored_layout
from specdec.models.toy import ToyLM
from specdec.sampling import SamplingConfig
from specdec.verify import get_rule
from stats import ALPHA, chi_square_pvalue, exact_law
from tiny import on_python_loop, random_head, tiny_native
from toy_drafters import Forced

KINDS = ("eagle1", "eagle3", "medusa", "mtp")
TREE_KINDS = ("eagle1", "eagle3", "medusa")


@pytest.fixture(scope="module")
def native():
    return tiny_native()


def _head(kind: str, model, seed: int = 0):
    d = model.cfg.hidden_size if hasattr(model, "cfg") else model.hidden_size
    return random_head(kind, hidden=d, vocab=model.vocab_size, draft_vocab=min(40, model.vocab_size - 1), taps=(1,),
                       seed=seed)


class Recording:
    """Wraps a drafter and keeps every feature chunk it receives."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.feature_taps = inner.feature_taps
        self.supports_trees = inner.supports_trees
        self.chunks: list[torch.Tensor] = []

    def add_features(self, f):
        self.chunks.append(f)
        self.inner.add_features(f)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("tree", [False, True])
def test_features_are_a_teacher_forced_hidden_pass(native, tree):
    drafter = Recording(drafter_for(_head("eagle3", native), native.embed))
    prompt = torch.tensor([3, 1, 4, 1, 5, 9])
    spec = TreeSpec() if tree else None
    dec = SpeculativeDecoder(native, drafter, get_rule("greedy"), gamma=FixedGamma(6 if tree else 3), tree=spec)
    out = dec.generate(prompt, SamplingConfig(temperature=0.0, max_new_tokens=20))
    assert out.stats.tree_rounds > 0 if tree else True
    got = torch.cat(drafter.chunks)  # [P, 2, D]
    seq = torch.cat([prompt, torch.tensor(out.tokens)])
    assert got.shape[0] == seq.numel() - 1  # every committed position but the newest
    taps = {1: torch.empty(0)}
    final = native.hidden(seq[:-1], native.new_cache(64), taps=taps)
    assert torch.equal(got[:, 0], taps[1]) and torch.equal(got[:, 1], final)


def test_scripted_loop_records_the_python_loops_taps(native):
    if native.scripted is None:
        pytest.skip("TorchScript is not available in this torch build")
    ids = torch.randint(0, 64, (9,), generator=torch.Generator().manual_seed(5))

    def run():
        cache = native.new_cache(32)
        found = {0: torch.empty(0), 1: torch.empty(0), 2: torch.empty(0)}
        outs = [native.hidden(ids[:5], cache, taps=found)]
        taps = [torch.stack([found[k] for k in (0, 1, 2)])]
        for i in range(5, 9):
            found = {0: torch.empty(0), 1: torch.empty(0), 2: torch.empty(0)}
            outs.append(native.hidden(ids[i : i + 1], cache, taps=found))
            taps.append(torch.stack([found[k] for k in (0, 1, 2)]))
        return torch.cat(outs), torch.cat(taps, dim=1)

    scripted, python = run(), on_python_loop(native, run)
    assert torch.equal(scripted[0], python[0]) and torch.equal(scripted[1], python[1])
    plain = native.forward(ids, native.new_cache(32))
    logits, feats = native.forward_features(ids, native.new_cache(32), (1,))
    assert torch.equal(plain, logits) and torch.equal(feats[:, 0], python[1][1])


def _teacher(native, seq, taps=(1,)):
    found = {k: torch.empty(0) for k in taps}
    final = native.hidden(seq, native.new_cache(64), taps=found)
    return torch.stack([found[k] for k in taps] + [final], dim=1)  # [T, R, D]


def test_eagle_and_mtp_drafts_are_the_modules_on_the_whole_sequence(native):
    """Training's view (whole sequences, training-time-test masks) gives the drafts' logits."""
    seq = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(2))
    feats = _teacher(native, seq)
    emb = native.embed[seq].float()
    p = 7  # the drafter has committed seq[: p + 1], features of positions 0 .. p-1
    # EAGLE: step 0 on rows 0..T-2, step 1 reads step 0's output one row back
    eagle = drafter_for(_head("eagle3", native), native.embed)
    assert eagle.feature_taps == (1,)
    head = eagle.head
    with torch.no_grad():
        g = head.fuse(stored_layout(head.cfg, feats, eagle._source))[:, :-1]  # [1, T', D]
        tp = g.shape[1]
        cos, sin = rope_tables(torch.arange(tp), head.cfg.head_dim, head.cfg.rope_theta)
        keys, values, outs = [], [], []
        for s in range(2):
            a, r = head.layer_input(g, emb[None, 1:])
            q, k, v = head.layer.attn.project(a, cos, sin)
            keys.append(k)
            values.append(v)
            o = head.layer.finish(r, head.layer.attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), ttt_mask(tp, s)))
            outs.append(o)
            g = torch.cat([torch.zeros_like(o[:, :1]), o[:, :-1]], dim=1)
    eagle.prepare(seq[: p + 1])
    eagle.add_features(feats[:p])
    forced = Forced([int(seq[p + 1]), int(seq[p + 2])])
    eagle.propose(seq[: p + 1], 2, forced)
    ref = [head.logits(outs[0][0, p - 1]), head.logits(outs[1][0, p])]
    for got, want in zip(forced.rows, ref):
        torch.testing.assert_close(got[eagle.d2t], want, rtol=1e-5, atol=1e-5)
    # MTP: module k at row t reads module k-1's output at row t and token t + k + 1
    mtp = drafter_for(_head("mtp", native), native.embed)
    head = mtp.head
    assert mtp.feature_taps == ()  # MTP reads the final hidden state only: no tap is computed
    feats = _teacher(native, seq, taps=())
    with torch.no_grad():
        h = feats[None, :, -1]
        ref = []
        for k in range(3):
            n = seq.numel() - k - 1
            cos, sin = rope_tables(torch.arange(n), head.cfg.head_dim, head.cfg.rope_theta)
            a, r = head.module_input(k, h[:, :n], emb[None, k + 1 : k + 1 + n])
            q, kk, v = head.layers[k].attn.project(a, cos, sin)
            h = head.layers[k].finish(r, head.layers[k].attn.attend(q, kk, v, ttt_mask(n, 0)))
            ref.append(head.logits(h[0, p - 1]))
    mtp.prepare(seq[: p + 1])
    mtp.add_features(feats[:4])  # in two chunks, with a draft round in between
    mtp.propose(seq[:5], 3, Forced([0, 0, 0]))
    mtp.commit(None)
    mtp.add_features(feats[4:p])
    forced = Forced([int(x) for x in seq[p + 1 : p + 4]])
    mtp.propose(seq[: p + 1], 3, forced)
    for got, want in zip(forced.rows, ref):
        torch.testing.assert_close(got[mtp.d2t], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_plain_greedy(native, kind):
    prompt = torch.tensor([7, 3, 3, 8])
    for cfg in (SamplingConfig(temperature=0.0, max_new_tokens=24),
                SamplingConfig(temperature=0.0, max_new_tokens=24, repetition_penalty=1.3)):
        plain = SpeculativeDecoder(native, None, get_rule("greedy")).generate(prompt, cfg).tokens
        drafter = drafter_for(_head(kind, native), native.embed)
        for tree in ([None, TreeSpec()] if kind in TREE_KINDS else [None]):
            dec = SpeculativeDecoder(native, drafter, get_rule("greedy"), gamma=FixedGamma(8 if tree else 3), tree=tree)
            out = dec.generate(prompt, cfg)
            assert out.tokens == plain, (kind, tree)
            assert out.stats.draft_tokens_proposed > 0
            assert (out.stats.tree_rounds > 0) == (tree is not None)


def test_a_one_token_prompt_drafts_from_the_second_round(native):
    drafter = drafter_for(_head("eagle1", native), native.embed)
    out = SpeculativeDecoder(native, drafter, get_rule("greedy"), gamma=FixedGamma(3)).generate(
        [5], SamplingConfig(temperature=0.0, max_new_tokens=10))
    plain = SpeculativeDecoder(native, None, get_rule("greedy")).generate([5], SamplingConfig(temperature=0.0, max_new_tokens=10))
    assert out.tokens == plain.tokens and out.stats.draft_tokens_proposed > 0


# ----------------------------------------------------------------------------- output laws

N_SAMPLES = 2_000
N_NEW = 3
PROMPT = [1, 2]
TARGET = ToyLM(4, order=2, seed=0)
SAMPLED = TreeSpec(sample_branching=(2, 2, 1), sample_width=2)


def _toy_drafter(kind: str, scale: float | None = None):
    head = random_head(kind, hidden=TARGET.hidden_size, vocab=4, draft_vocab=3, taps=(1,), seed=3,
                       scale=scale or (0.2 if kind == "eagle1" else 0.6))  # EAGLE-1 logits are unnormalised
    return drafter_for(head, TARGET.embed)


def _samples(drafter, method: str, cfg: SamplingConfig, spec=None, n: int = N_SAMPLES):
    dec = SpeculativeDecoder(TARGET, drafter, get_rule(method), gamma=FixedGamma(5 if spec else 3), tree=spec)
    out = []
    for i in range(n):
        c = replace(cfg, seed=i, max_new_tokens=N_NEW)
        out.append(tuple(dec.generate(PROMPT, c).tokens))
    return out


@pytest.mark.parametrize(
    ("kind", "method", "cfg", "spec"),
    [
        ("eagle1", "token", SamplingConfig(temperature=1.0, top_p=0.8, repetition_penalty=1.5), None),
        ("eagle3", "token", SamplingConfig(temperature=0.8), SAMPLED),
        ("medusa", "block", SamplingConfig(temperature=1.0, frequency_penalty=0.4, presence_penalty=0.3), None),
        ("mtp", "block", SamplingConfig(temperature=1.0, top_k=3), None),
    ],
)
def test_output_law_matches_target(kind, method, cfg, spec):
    samples = _samples(_toy_drafter(kind), method, cfg, spec)
    assert chi_square_pvalue(samples, exact_law(TARGET, PROMPT, cfg, N_NEW)) > ALPHA


class _WrongScatter(EagleDrafter):
    """Samples inside the draft vocabulary but reports q with mass on the token outside it."""

    def propose(self, context, gamma, sampler):
        draft = super().propose(context, gamma, sampler)
        if draft.probs is None:
            return draft
        rows = draft.probs.clone()
        outside = [t for t in range(self.vocab) if t not in set(self.d2t.tolist())]
        rows[:, outside] = 0.3
        return Draft(tokens=draft.tokens, probs=rows / rows.sum(-1, keepdim=True))


def test_negative_control_wrong_scatter_is_detected():
    good = _toy_drafter("eagle3")
    bad = _WrongScatter(good.head, TARGET.embed)
    cfg = SamplingConfig(temperature=1.0)
    assert chi_square_pvalue(_samples(bad, "token", cfg, n=1_000), exact_law(TARGET, PROMPT, cfg, N_NEW)) < ALPHA


def test_coupled_equals_plain_seeded_sampling(native):
    prompt = torch.tensor([2, 9, 4])
    cfg = SamplingConfig(temperature=1.0, top_p=0.9, seed=11, max_new_tokens=20)
    plain = SpeculativeDecoder(native, None, get_rule("coupled")).generate(prompt, cfg).tokens
    for kind in KINDS:
        out = SpeculativeDecoder(native, drafter_for(_head(kind, native), native.embed), get_rule("coupled"),
                                 gamma=FixedGamma(3)).generate(prompt, cfg)
        assert out.tokens == plain, kind


def test_q_is_zero_outside_the_draft_vocabulary():
    drafter = _toy_drafter("medusa")
    dec = SpeculativeDecoder(TARGET, drafter, get_rule("token"), gamma=FixedGamma(3))
    seen = []
    orig = drafter.propose

    def spy(context, gamma, sampler):
        d = orig(context, gamma, sampler)
        seen.append(d)
        return d

    drafter.propose = spy
    dec.generate(PROMPT, SamplingConfig(temperature=1.0, seed=1, max_new_tokens=8))
    outside = [t for t in range(4) if t not in set(drafter.d2t.tolist())]
    probs = torch.cat([d.probs for d in seen if d.probs is not None])
    assert probs.shape[1] == 4 and float(probs[:, outside].abs().sum()) == 0.0
    assert torch.allclose(probs.sum(-1), torch.ones(probs.shape[0], dtype=probs.dtype))


class _Only:
    """A constraint allowing the given tokens only."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def allowed(self, generated, vocab_size):
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.tokens] = True
        return mask


@pytest.mark.parametrize("method", ["token", "block", "coupled"])
def test_a_constraint_outside_the_draft_vocabulary_stops_the_draft(method):
    drafter = _toy_drafter("eagle1")
    outside = [t for t in range(4) if t not in set(drafter.d2t.tolist())]
    cfg = SamplingConfig(temperature=1.0, seed=5, max_new_tokens=6, constraint=_Only(outside))
    out = SpeculativeDecoder(TARGET, drafter, get_rule(method), gamma=FixedGamma(3)).generate(PROMPT, cfg)
    assert out.tokens == outside * 6
    if method != "coupled":  # q is undefined (no allowed token in the draft vocabulary): no draft at all
        assert out.stats.draft_tokens_proposed == 0
