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
from types import SimpleNamespace

import pytest
import torch

import specdec.drafters.heads as dh
from specdec.decoder import SpeculativeDecoder
from specdec.drafters.base import Draft, DraftSampler
from specdec.drafters.heads import EagleDrafter, drafter_for
from specdec.drafters.tree_builder import TreeSpec
from specdec.errors import ConfigError
from specdec.gamma import FixedGamma
from specdec.heads.modules import HeadConfig, check_vocab_map, rope_tables, save_head, ttt_mask
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


def _tree_rows(drafter, context, spec, budget, monkeypatch):
    """Every node ``propose_tree`` expanded: (its token path from the root, its logits row)."""
    seen = []
    real = dh.build_tree

    def spy(root, expand, spec_, sampler, **kw):
        def recording(nodes, tokens, parents):
            out = expand(nodes, tokens, parents)
            for j, v in enumerate(nodes):
                path, u = [], v
                while u >= 0:
                    path.append(tokens[u])
                    u = parents[u]
                seen.append((path[::-1], out[j].clone()))
            return out

        return real(root, recording, spec_, sampler, **kw)

    monkeypatch.setattr(dh, "build_tree", spy)
    greedy = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
    drafter.propose_tree(context, budget, greedy, spec, max_depth=4)
    monkeypatch.setattr(dh, "build_tree", real)
    return seen


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "medusa"])
def test_tree_nodes_see_what_a_chain_along_their_path_sees(native, kind, monkeypatch):
    """EAGLE-2 trees run each level's nodes in one pass with tree attention; a node's logits must be
    those of a chain drafted along its path (same rotary positions, the whole committed context
    visible, its ancestors and nothing else).  Medusa's static tree: a depth-d node's children come
    from head d + 1, as the chain's token d + 1 does.  Greedy output equality cannot see a wrong
    position, mask or head (the drafter is only a proposal), and the whole-sequence test covers
    chains only."""
    seq = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(2))
    p = 7
    drafter = drafter_for(_head(kind, native), native.embed)
    feats = _teacher(native, seq, taps=drafter.feature_taps)  # the rows the verifier hands this drafter
    drafter.prepare(seq[: p + 1])
    drafter.add_features(feats[:p])
    context = seq[: p + 1]
    seen = _tree_rows(drafter, context, TreeSpec(width=3, depth=4, min_prob=0.0), 12, monkeypatch)
    assert len({len(path) for path, _ in seen}) >= 2 and len(seen) >= 4  # two levels, siblings
    for path, row in seen:
        forced = Forced(path + [0])
        drafter.propose(context, len(path) + 1, forced)
        torch.testing.assert_close(forced.rows[len(path)], row, rtol=1e-4, atol=1e-4)  # a pass of other rows: not bitwise


def test_medusa_drafts_from_the_newest_committed_feature(native):
    """Medusa's heads read the final hidden state of the *newest* committed position (the last row
    of the newest feature chunk); the drafts' rows are the module on that row.  Greedy equality
    cannot see a stale row."""
    seq = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(2))
    feats = _teacher(native, seq, taps=())  # Medusa reads the final hidden state only: no tap
    p = 7
    drafter = drafter_for(_head("medusa", native), native.embed)
    assert drafter.feature_taps == ()
    drafter.prepare(seq[: p + 1])
    drafter.add_features(feats[:4])
    drafter.add_features(feats[4:p])  # two chunks: the newest row is the last of the second
    forced = Forced([0, 0, 0])
    drafter.propose(seq[: p + 1], 3, forced)
    with torch.no_grad():
        want = drafter.head(feats[p - 1, -1][None])[:, 0]  # [K, Vd]
    assert len(forced.rows) == 3
    for k, got in enumerate(forced.rows):
        torch.testing.assert_close(got[drafter.d2t], want[k], rtol=1e-5, atol=1e-5)


def test_a_head_layer_cache_that_grows_computes_what_a_large_one_does():
    """``LayerCache`` starts at 256 rows and grows on demand (keys/values copied over, rotary tables
    extended); the tests' sequences never pass 256 rows, so growth is exercised here on a cache of
    2 rows: one row at a time through ``run_layer``, bitwise the outputs of a cache that never grows.
    ``truncate`` only shortens."""
    from specdec.heads.runtime import LayerCache, run_layer

    head = random_head("eagle1", hidden=16, vocab=32, draft_vocab=8, seed=1)
    cfg = head.cfg
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(0))
    outs = {}
    for capacity in (2, 256):
        cache = LayerCache(cfg, capacity=capacity)
        with torch.no_grad():
            rows = [run_layer(head.layer, cfg, x[:3], x[:3], torch.arange(3), cache)]
            rows += [run_layer(head.layer, cfg, x[t : t + 1], x[t : t + 1], torch.tensor([t]), cache) for t in range(3, 9)]
        outs[capacity] = torch.cat(rows)
        assert cache.length == 9
        cache.truncate(20)
        assert cache.length == 9
        cache.truncate(5)
        assert cache.length == 5
    assert torch.equal(outs[2], outs[256])


def test_a_head_for_another_vocabulary_size_is_refused(native):
    """A head records its target's vocabulary size; on a target of another size it is refused even
    when its draft ids happen to fit (its embeddings' rows would be another token's)."""

    head = _head("eagle1", native)
    head.cfg = replace(head.cfg, target_vocab=native.vocab_size + 16)
    with pytest.raises(ConfigError, match=f"vocabulary of {native.vocab_size + 16} tokens"):
        drafter_for(head, native.embed)


def test_spawn_keeps_the_drafters_name(native):
    """The server spawns one drafter per request; the spawned one keeps the name the drafter was
    built with (``--draft`` label in stats and logs), not the head kind."""
    for kind in ("eagle3", "medusa", "mtp"):
        drafter = drafter_for(_head(kind, native), native.embed, name="my-head")
        fresh = drafter.spawn()
        assert type(fresh) is type(drafter) and fresh.name == "my-head" and fresh.head is drafter.head


def test_a_tap_after_the_last_layer_is_allowed_and_one_past_it_refused(native, tmp_path):
    """Taps count layers: ``k`` is the residual stream after ``k`` layers, so ``0 .. n_layers`` are
    all real streams (``n_layers``: after the last layer, before the final norm); only taps past
    that are refused."""

    n = native.cfg.n_layers
    for taps, ok in (((0, n), True), ((0, n + 1), False)):
        folder = tmp_path / f"h{taps[-1]}"
        save_head(random_head("eagle3", hidden=native.cfg.hidden_size, vocab=native.vocab_size, draft_vocab=20, taps=taps),
                  folder, dtype=torch.float32)
        if ok:
            drafter, _ = dh.build(folder, native)
            assert drafter.feature_taps == taps
        else:
            with pytest.raises(ConfigError, match="reads the target's layers"):
                dh.build(folder, native)


def test_received_feature_rows_land_where_the_head_reads_them():
    """``input_rows`` asks the target only for the taps a head reads; ``stored_layout`` puts each
    received row back at its stored index (other rows zero).  The whole-sequence test builds its
    reference through ``stored_layout`` itself, so a layout that copied the wrong received row
    would pass it; pinned here on a head reading tap 5 and the final state but not tap 3."""
    from specdec.heads.runtime import input_rows, stored_layout

    cfg = HeadConfig(kind="eagle3", hidden_size=4, n_heads=1, n_kv_heads=1, head_dim=4, intermediate_size=8,
                     target_vocab=10, draft_vocab=5, taps=(3, 5), inputs=(1, 2))
    taps, source = input_rows(cfg)
    assert taps == (5,) and source == [0, 1]  # received rows: (tap 5, final)
    received = torch.arange(2 * 2 * 4, dtype=torch.float32).view(2, 2, 4)  # [n, R', D]
    out = stored_layout(cfg, received, source)  # [1, n, 3, D]: (tap 3, tap 5, final)
    assert torch.equal(out[0, :, 0], torch.zeros(2, 4))
    assert torch.equal(out[0, :, 1], received[:, 0]) and torch.equal(out[0, :, 2], received[:, 1])
    dup = HeadConfig(**{**cfg.__dict__, "taps": (5, 5), "inputs": (0, 1, 2)})  # one layer tapped twice
    assert input_rows(dup) == ((5,), [0, 0, 1])


def test_the_heads_rotary_embedding_is_the_llama_convention():
    """Head layers rotate (q, k) pairs as Llama does: ``x * cos + rotate_half(x) * sin`` with
    ``rotate_half(x) = [-x2, x1]``, i.e. the pair (a, b) at angle w becomes
    (a cos w - b sin w, b cos w + a sin w).  Training and drafting share the helpers, and the format
    test's one row sits at position 0 (no rotation), so a flipped sign passed every test while
    changing what a trained or shared (vLLM / SGLang) head computes."""
    from specdec.heads.modules import _rotate, rope_tables

    positions = torch.tensor([0, 1, 5])
    cos, sin = rope_tables(positions, 2, 10000.0)  # head_dim 2: one pair, angle = position
    x = torch.tensor([0.3, 0.7]).expand(1, 1, 3, 2)  # [B, h, T, d]
    got = _rotate(x, cos, sin)[0, 0]
    w = positions.float()
    want = torch.stack([0.3 * w.cos() - 0.7 * w.sin(), 0.7 * w.cos() + 0.3 * w.sin()], dim=-1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    cos4, _ = rope_tables(positions, 4, 10000.0)  # pair i turns at theta ** (-2 i / head_dim)
    torch.testing.assert_close(cos4[:, 1], (w * 10000.0 ** -0.5).cos(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cos4[:, 3], cos4[:, 1])  # halves share the angles (rotate_half layout)


def test_the_head_modules_compute_the_papers_formulas():
    """Training and drafting share the modules' small formulas, so the drafts-equal-training tests
    cannot see a change made to both; each is written out here from its parameters (the module
    docstring's definitions): MTP ``proj([rms(h); rms(e)])`` and ``lm_head(norm(h))``; Medusa
    ``lm_head(f + silu(W f + b))``; EAGLE-1 ``fc([e; f])``; EAGLE-3 ``fc([rms(h_a); rms(h_b); ...])``."""
    from specdec.heads.modules import rms

    g = torch.Generator().manual_seed(0)
    h, e = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    norm = lambda x, m: rms(x, m.eps) * m.weight  # noqa: E731
    with torch.no_grad():
        mtp = random_head("mtp", hidden=16, vocab=32, draft_vocab=8, seed=1)
        mtp.norm.weight.copy_(1 + torch.randn(16, generator=g))
        x = torch.cat([rms(h), rms(e)], -1) @ mtp.proj[1].weight.T
        attn_in, resid = mtp.module_input(1, h, e)
        torch.testing.assert_close(resid, x)
        torch.testing.assert_close(attn_in, norm(x, mtp.input_norms[1]))
        torch.testing.assert_close(mtp.logits(h), norm(h, mtp.norm) @ mtp.lm_head.weight.T)
        medusa = random_head("medusa", hidden=16, vocab=32, draft_vocab=8, seed=1)
        blk = medusa.blocks[2]
        want = (h + torch.nn.functional.silu(h @ blk.weight.T + blk.bias)) @ medusa.lm_head.weight.T
        torch.testing.assert_close(medusa(h)[2], want)
        eagle1 = random_head("eagle1", hidden=16, vocab=32, draft_vocab=8, seed=1)
        x = torch.cat([e, h], -1) @ eagle1.fc.weight.T
        attn_in, resid = eagle1.layer_input(h, e)
        torch.testing.assert_close(resid, x)
        torch.testing.assert_close(attn_in, norm(x, eagle1.input_norm))
        eagle3 = random_head("eagle3", hidden=16, vocab=32, draft_vocab=8, taps=(1, 2), seed=1)
        rows = torch.randn(1, 3, 3, 16, generator=g)  # [B, T, (taps..., final), D]
        want = torch.cat([rms(rows[0, :, i]) for i in eagle3.cfg.inputs], -1) @ eagle3.fc.weight.T
        torch.testing.assert_close(eagle3.fuse(rows)[0], want)


@pytest.mark.parametrize("kind", ["mtp", "eagle1", "eagle3"])
def test_drafts_do_not_depend_on_how_the_features_arrive(native, kind):
    """Each verification pass hands over as many feature rows as it committed (often 2: one accepted
    token and the bonus).  MTP keeps every module's output at every committed row, so a catch-up
    chunk must be causal whatever its size; EAGLE's later chunks' rows must sit at their absolute
    positions (rotary).  The drafts after chunks of 3, 2 and 2 rows equal those after one chunk of 7.
    (The whole-sequence test's chunks are 4 and 3 rows.)"""
    seq = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(2))
    feats = _teacher(native, seq, taps=() if kind == "mtp" else (1,))
    p = 7
    rows = {}
    for chunks in ((7,), (3, 2, 2)):
        drafter = drafter_for(_head(kind, native), native.embed)
        drafter.prepare(seq[: p + 1])
        start = 0
        for n in chunks:
            drafter.add_features(feats[start : start + n])
            start += n
            forced = Forced([int(x) for x in seq[start + 1 : start + 4]])
            drafter.propose(seq[: start + 1], 3, forced)
            drafter.commit(None)
        rows[chunks] = torch.stack(forced.rows)
    torch.testing.assert_close(rows[(3, 2, 2)], rows[(7,)], rtol=1e-4, atol=1e-4)  # other chunk shapes: not bitwise


def test_the_parameter_free_rms_uses_eps_1e_6():
    """``rms`` (EAGLE-3's per-tap norm, MTP's input norms) is ``x / sqrt(mean(x^2) + 1e-6)``: trained
    heads were fitted with that eps, and the formula test builds its reference from ``rms`` itself,
    so a changed default passed it.  Rows of magnitude 1e-3 make eps visible (1e-5 gives 0.30, not 0.71)."""
    from specdec.heads.modules import rms

    x = torch.full((2, 4), 1e-3)
    torch.testing.assert_close(rms(x), torch.full((2, 4), 1e-3 / (1e-6 + 1e-6) ** 0.5), rtol=1e-5, atol=0)
    eagle3 = random_head("eagle3", hidden=4, vocab=16, draft_vocab=8, taps=(1,), seed=1)
    rows = torch.full((1, 1, 2, 4), 1e-3)  # [B, T, (tap, final), D]
    want = torch.full((8,), 1e-3 / (2e-6) ** 0.5) @ eagle3.fc.weight.T
    torch.testing.assert_close(eagle3.fuse(rows)[0, 0], want, rtol=1e-5, atol=1e-6)


def test_a_freshly_built_head_starts_as_the_targets_own_prediction():
    """Training starts from "the target's feature passes through" (module docstring of ``Eagle`` /
    ``Medusa``): EAGLE's ``fc`` picks the last (highest) input row, its layer's residual branches
    (``attn.o``, ``mlp.down``) start at zero, and every Medusa block starts as the identity (zero
    weight and bias).  Every other test loads random weights over these, so the start went unpinned."""
    from specdec.heads.modules import HeadConfig, build, rms

    cfg = HeadConfig(kind="eagle3", hidden_size=8, n_heads=2, n_kv_heads=1, head_dim=4, intermediate_size=16,
                     target_vocab=16, draft_vocab=8, inputs=(0, 1, 2), taps=(1, 2, 3), depth=1)
    eagle = build(cfg)
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(1, 3, 4, 8, generator=g)  # [B, T, (taps..., final), D]
    with torch.no_grad():
        torch.testing.assert_close(eagle.fuse(rows), rms(rows[:, :, 2]))  # the highest input, normalised
        resid = torch.randn(1, 3, 8, generator=g)
        attn = eagle.layer.attn.o(torch.randn(1, 3, 8, generator=g))
        assert torch.equal(attn, torch.zeros_like(attn))
        assert torch.equal(eagle.layer.finish(resid, attn), resid)
    medusa = build(HeadConfig(kind="medusa", hidden_size=8, n_heads=2, n_kv_heads=1, head_dim=4, intermediate_size=16,
                              target_vocab=16, draft_vocab=8, depth=3))
    f = torch.randn(5, 8, generator=g)
    with torch.no_grad():
        want = medusa.lm_head(f)
        for k in range(3):
            torch.testing.assert_close(medusa(f)[k], want)


def test_our_format_round_trips_the_config_and_the_weight_dtype(tmp_path):
    """``save_head`` writes weights in ``dtype`` (float16 by default) and ``d2t`` as int64; ``load_head``
    gives back a config equal to the saved one (``inputs`` / ``taps`` as tuples: a list compares
    unequal to the tuple the head was built with)."""
    from safetensors.torch import load_file

    from specdec.heads.modules import load_head, save_head

    head = random_head("mtp", hidden=16, vocab=32, draft_vocab=8, taps=(1, 2), seed=1)
    save_head(head, tmp_path / "m")
    w = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert {v.dtype for k, v in w.items() if k != "d2t"} == {torch.float16} and w["d2t"].dtype == torch.int64
    back = load_head(tmp_path / "m")
    assert back.cfg == head.cfg and isinstance(back.cfg.inputs, tuple) and isinstance(back.cfg.taps, tuple)
    assert torch.equal(back.d2t, head.d2t)


def test_our_format_refuses_a_floating_point_draft_vocabulary(tmp_path):
    """``d2t`` holds integer token ids; a file whose ``d2t`` is floats (even whole-valued) is damaged and
    refused with a one-line ConfigError rather than cast into the integer buffer."""
    from safetensors.torch import load_file, save_file

    from specdec.heads.modules import load_head, save_head

    save_head(random_head("medusa", hidden=16, vocab=32, draft_vocab=8), tmp_path / "m", dtype=torch.float32)
    w = load_file(str(tmp_path / "m" / "model.safetensors"))
    save_file(w | {"d2t": w["d2t"].float()}, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ConfigError, match="integer token ids"):
        load_head(tmp_path / "m")


def test_eagle1_scores_its_output_through_the_target_rows_without_a_norm():
    """EAGLE-1's output ``o`` regresses the target's (already normalised) feature, so its draft logits
    are ``lm_head(o)`` with no final norm (EAGLE-3 normalises first); lossless decoding hides a
    changed draft law, so it is pinned here from the parameters."""
    eagle1 = random_head("eagle1", hidden=16, vocab=32, draft_vocab=8, seed=1)
    o = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)) * 3
    with torch.no_grad():
        eagle1.norm.weight.copy_(torch.linspace(0.5, 2.0, 16))  # a norm, were it applied, would show
        torch.testing.assert_close(eagle1.logits(o), o @ eagle1.lm_head.weight.T)


def test_a_head_layer_cache_grows_past_twice_its_capacity_in_one_step():
    """``LayerCache.reserve(n)`` makes room for ``n`` rows even when that is more than double the current
    capacity (a long prompt's catch-up chunk arriving at a fresh cache), and keeps the rows it had."""
    from specdec.heads.runtime import LayerCache

    cfg = HeadConfig(kind="eagle3", hidden_size=8, n_heads=2, n_kv_heads=1, head_dim=4, intermediate_size=16,
                     target_vocab=16, draft_vocab=8, inputs=(0,), taps=(1,), depth=1)
    cache = LayerCache(cfg, capacity=2)
    assert cache.reserve(1) == 0
    cache.k[:, 0] = 7.0
    assert cache.reserve(10) == 1 and cache.length == 11
    assert cache.k.shape[1] >= 11 and cache.v.shape[1] >= 11
    assert torch.equal(cache.k[:, 0], torch.full((1, 4), 7.0))


def test_a_head_layer_caches_bytes_count_its_keys_and_values():
    """``LayerCache.nbytes`` (what memory accounting reads) counts both the key and the value tensors."""
    from specdec.heads.runtime import LayerCache

    cfg = HeadConfig(kind="mtp", hidden_size=8, n_heads=2, n_kv_heads=1, head_dim=4, intermediate_size=16,
                     target_vocab=16, draft_vocab=8, depth=1)
    cache = LayerCache(cfg, capacity=5)
    assert cache.nbytes == cache.k.numel() * cache.k.element_size() + cache.v.numel() * cache.v.element_size() == 160


CFG = HeadConfig(kind="eagle3", hidden_size=8, n_heads=2, n_kv_heads=1, head_dim=4, intermediate_size=16,
                 target_vocab=10, draft_vocab=3, inputs=(0,), taps=(1,))


def test_a_boolean_size_is_refused():
    """``True`` is an int in Python, but not a size: a config field of ``True`` is a ConfigError."""
    with pytest.raises(ConfigError, match="depth must be a whole number"):
        replace(CFG, depth=True)


def test_heads_that_are_not_a_multiple_of_the_kv_heads_are_refused():
    """Grouped-query attention needs n_heads a multiple of n_kv_heads (3 query heads over 2 kv heads
    cannot be grouped)."""
    with pytest.raises(ConfigError, match="multiple of n_kv_heads"):
        replace(CFG, n_heads=3, n_kv_heads=2)
    replace(CFG, n_heads=4, n_kv_heads=2)  # a multiple: fine


def test_the_draft_vocabulary_must_lie_below_the_target_vocabulary():
    """Token ids run 0 .. vocab - 1: an id equal to the vocabulary size is refused (the largest
    allowed id, vocab - 1, is fine)."""
    check_vocab_map(torch.tensor([0, 4, 9]), 3, 10)
    with pytest.raises(ConfigError, match="strictly increasing token ids in 0..9"):
        check_vocab_map(torch.tensor([0, 4, 10]), 3, 10)


def test_a_t2d_mask_must_mark_exactly_the_d2t_ids():
    """The shared format's ``t2d`` must mark the d2t ids and no others, over exactly the target
    vocabulary: extra marks, the right count at the wrong ids and a wrong length are refused."""
    d2t = torch.tensor([1, 4, 7])
    good = torch.zeros(10, dtype=torch.bool)
    good[d2t] = True
    check_vocab_map(d2t, 3, 10, good)
    extra = good.clone()
    extra[0] = True
    with pytest.raises(ConfigError, match="does not mark exactly"):
        check_vocab_map(d2t, 3, 10, extra)
    moved = torch.zeros(10, dtype=torch.bool)
    moved[torch.tensor([1, 4, 8])] = True  # three marks, one of them at the wrong id
    with pytest.raises(ConfigError, match="does not mark exactly"):
        check_vocab_map(d2t, 3, 10, moved)
    longer = torch.cat([good, torch.zeros(2, dtype=torch.bool)])  # the right ids, over 12 tokens
    with pytest.raises(ConfigError, match="0/1 mask over the 10 target ids"):
        check_vocab_map(d2t, 3, 10, longer)


def test_a_tensor_the_config_has_no_place_for_is_a_one_line_config_error():
    """``load_state`` names the first extra tensor in a ConfigError (by its name in the file),
    rather than torch's multi-line RuntimeError from ``load_state_dict``."""
    from specdec.heads.modules import Medusa, load_state

    head = Medusa(replace(CFG, kind="medusa", inputs=(-1,), depth=1))
    state = dict(head.state_dict()) | {"blocks.7.weight": torch.zeros(8, 8)}
    with pytest.raises(ConfigError, match="no place for: theirs.blocks.7"):
        load_state(head, state, {"blocks.7.weight": "theirs.blocks.7"})


def test_input_rows_asks_for_each_tap_once_and_reads_the_final_state_by_a_negative_index():
    """``input_rows``: the taps a head names twice are asked of the target once (the rows are
    shared), and ``-1`` names the final hidden state, which is not a tap."""
    from specdec.heads.runtime import input_rows

    cfg = replace(CFG, taps=(2, 5), inputs=(0, 0, 2))
    assert input_rows(cfg) == ((2,), [0, 0, 1])
    assert input_rows(replace(CFG, taps=(2, 5), inputs=(-1,))) == ((), [0])


def test_mtp_drafts_as_many_tokens_as_its_modules_have_rows_for_on_a_short_context(native):
    """With one committed feature (P = 1) module 1 still has a row (row 0 reads draft token 0), so
    a γ-3 MTP draft proposes 2 tokens; module 2 would need row -1 and stops the chain."""
    seq = torch.tensor([5, 9, 3, 7])
    drafter = drafter_for(_head("mtp", native), native.embed)
    assert drafter.depth >= 3
    drafter.prepare(seq[:2])
    drafter.add_features(_teacher(native, seq[:1], taps=()))
    forced = Forced([1, 2, 3])
    draft = drafter.propose(seq[:2], 3, forced)
    assert draft.tokens.tolist() == [1, 2] and len(forced.rows) == 2


class _Positions(Forced):
    def __init__(self, tokens):
        super().__init__(tokens)
        self.positions = []

    def __call__(self, logits, position):
        self.positions.append(position)
        return super().__call__(logits, position)


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "mtp"])
def test_each_draft_token_is_sampled_at_its_own_absolute_position(native, kind):
    """The sampler is told each draft token's absolute position (the coupled rule's Gumbel noise and
    the penalties' state follow it): L, L+1, L+2 for a context of L tokens.  Output equality cannot
    see a wrong position (the drafter is only a proposal)."""
    seq = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(2))
    drafter = drafter_for(_head(kind, native), native.embed)
    drafter.prepare(seq[:8])
    drafter.add_features(_teacher(native, seq[:7], taps=drafter.feature_taps))
    sampler = _Positions([1, 2, 3])
    drafter.propose(seq[:8], 3, sampler)
    assert sampler.positions == [8, 9, 10]


def test_medusa_trees_are_static_whatever_shape_the_spec_asks_for(native):
    """Medusa's heads do not see the draft tokens, so its tree is always the static sparse tree
    (``branching`` children per node): a spec asking for a dynamic (EAGLE-2) tree gives the same
    tree as one asking for a static tree."""

    seq = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(2))
    drafts = []
    for shape in ("dynamic", "static"):
        drafter = drafter_for(_head("medusa", native), native.embed)
        drafter.prepare(seq[:8])
        drafter.add_features(_teacher(native, seq[:7], taps=()))
        greedy = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
        spec = TreeSpec(shape=shape, width=2, branching=(4, 1), min_prob=0.0)  # dynamic: 2 children, static: 4 at the root
        drafts.append(drafter.propose_tree(seq[:8], 12, greedy, spec, max_depth=4))
    assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist()
    assert drafts[0].parents.tolist() == drafts[1].parents.tolist()
    assert drafts[1].parents.tolist().count(-1) == 4  # the static tree's root children


def test_a_medusa_tree_is_no_deeper_than_its_heads(native):
    """A Medusa tree's depth d comes from head d: a spec and a max_depth deeper than the heads give
    a tree of as many levels as there are heads (no error)."""

    seq = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(2))
    drafter = drafter_for(_head("medusa", native), native.embed)
    k = len(drafter.head(torch.zeros(1, native.cfg.hidden_size)))  # heads
    drafter.prepare(seq[:8])
    drafter.add_features(_teacher(native, seq[:7], taps=()))
    greedy = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
    draft = drafter.propose_tree(seq[:8], 64, greedy, TreeSpec(shape="static", depth=k + 3, width=2, min_prob=0.0),
                                 max_depth=k + 3)
    parents, depth = draft.parents.tolist(), []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    assert max(depth) + 1 == k


SEQ = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "medusa", "mtp"])
def test_a_new_sequence_drafts_nothing_before_its_first_features(native, kind):
    """``prepare`` starts a new sequence: until its first features arrive the drafter drafts
    nothing — never from the previous sequence's last feature."""
    drafter = drafter_for(_head(kind, native), native.embed)
    drafter.prepare(SEQ[:8])
    drafter.add_features(_teacher(native, SEQ[:7], taps=drafter.feature_taps))
    assert drafter.propose(SEQ[:8], 2, Forced([1, 2])).tokens.numel() == 2
    drafter.commit(None)
    drafter.prepare(SEQ[8:10])
    assert drafter.propose(SEQ[8:10], 2, Forced([1, 2])).tokens.numel() == 0


@pytest.mark.parametrize("kind", ["eagle1", "eagle3", "medusa", "mtp"])
def test_a_round_without_new_features_drafts_again_from_the_committed_ones(native, kind):
    """A round whose verification handed no new feature (say a round rejected by a constraint)
    still drafts, from the features already committed: the same draft as the round before."""
    drafter = drafter_for(_head(kind, native), native.embed)
    drafter.prepare(SEQ[:8])
    drafter.add_features(_teacher(native, SEQ[:7], taps=drafter.feature_taps))
    first = Forced([1, 2, 3])
    drafter.propose(SEQ[:8], 3, first)
    drafter.commit(None)
    again = Forced([1, 2, 3])
    assert drafter.propose(SEQ[:8], 3, again).tokens.numel() > 0
    assert len(again.rows) == len(first.rows)
    for a, b in zip(again.rows, first.rows):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_a_heads_extra_bytes_are_its_parameters_bytes(native):
    """``extra_bytes`` (memory accounting): the head's parameters in bytes — a float32 head 4 bytes
    each, a bfloat16 copy 2."""
    head = _head("eagle3", native)
    numel = sum(p.numel() for p in head.parameters())
    assert drafter_for(head, native.embed).extra_bytes() == 4 * numel
    assert drafter_for(head.to(torch.bfloat16), native.embed).extra_bytes() == 2 * numel


def _saved(native, tmp_path, kind="medusa"):
    folder = tmp_path / kind
    save_head(_head(kind, native), folder, dtype=torch.float32)
    return folder


def test_a_built_head_takes_the_label_asked_for(native, tmp_path):
    """``build(..., label=...)``: the drafter's name (stats, logs) is the label when one is given,
    else the folder's name."""
    folder = _saved(native, tmp_path)
    assert dh.build(folder, native, label="my-head")[1] == "my-head"
    assert dh.build(folder, native, label="my-head")[0].name == "my-head"
    assert dh.build(folder, native)[1] == "medusa"


def test_a_target_that_hides_its_hidden_states_is_refused(native, tmp_path):
    """A target with embeddings but no ``forward_features`` (its hidden states out of reach)
    cannot feed a head: a one-line ConfigError, not a drafter that never gets a feature."""
    folder = _saved(native, tmp_path)
    with pytest.raises(ConfigError, match="exposes its hidden states"):
        dh.build(folder, SimpleNamespace(embed=native.embed, forward_features=None))


def test_a_registry_head_name_is_read_whatever_its_case_and_spacing(native, tmp_path, monkeypatch):
    """A registry name resolves to its lower-case folder under the heads' data folder, given in
    any case and with spaces around it (as typed after ``--draft``)."""

    monkeypatch.setattr(dh, "heads_dir", lambda: tmp_path)
    name = "smollm2-135m-mtp"
    assert name in dh.HEADS
    with pytest.raises(ConfigError, match=f"^{name} is not available"):
        dh.resolve_head(" SmolLM2-135M-MTP ")
    save_head(_head("mtp", native), tmp_path / name, dtype=torch.float32)
    assert dh.resolve_head(" SmolLM2-135M-MTP ") == tmp_path / name


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_an_eagle_chain_of_gamma_tokens_runs_gamma_minus_one_layer_steps(native, kind):
    """Drafting γ tokens after the catch-up costs γ - 1 passes of the head's layer (draft token j
    is read off the output after token j - 1): no pass after the last token, whose output nothing
    reads."""
    drafter = drafter_for(_head(kind, native), native.embed)
    drafter.prepare(SEQ[:8])
    drafter.add_features(_teacher(native, SEQ[:7], taps=drafter.feature_taps))
    drafter._catch_up(SEQ[:8])  # the committed rows, before counting
    steps = []
    real = drafter._step
    drafter._step = lambda *a, **k: steps.append(1) or real(*a, **k)  # type: ignore[method-assign]
    assert drafter.propose(SEQ[:8], 3, Forced([1, 2, 3])).tokens.numel() == 3
    assert len(steps) == 2


def test_a_head_layers_rotary_tables_grow_past_twice_their_length_in_one_call():
    """``LayerCache.rope`` asked for a position more than twice past its tables (a tree's deep node,
    a long catch-up) extends them far enough, with the same values ``rope_tables`` gives."""
    from specdec.heads.runtime import LayerCache

    cfg = HeadConfig(kind="mtp", hidden_size=8, n_heads=2, n_kv_heads=1, head_dim=4, intermediate_size=16,
                     target_vocab=16, draft_vocab=8, depth=1)
    cache = LayerCache(cfg, capacity=2)
    cos, sin = cache.rope(torch.tensor([0, 9]))
    want_cos, want_sin = rope_tables(torch.arange(10), 4, cfg.rope_theta)
    assert torch.equal(cos, want_cos[[0, 9]]) and torch.equal(sin, want_sin[[0, 9]])
