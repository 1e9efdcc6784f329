import torch

from specdec.drafters import ModelDrafter
from specdec.drafters.base import DraftSampler
from specdec.drafters.tree_builder import TreeSpec
from specdec.models.toy import ToyLM
from specdec.sampling import PenaltyState, SamplingConfig, process_logits
from specdec.verify import Verdict


def test_reports_the_distribution_it_sampled_from_and_rolls_back():
    model = ToyLM(5, order=2, seed=3)
    d = ModelDrafter(model)
    ctx = torch.tensor([1, 2, 3])
    d.prepare(ctx)
    cfg = SamplingConfig(temperature=0.9, repetition_penalty=1.3)
    state = PenaltyState.start(ctx, 5)
    sampler = DraftSampler(cfg, "multinomial", penalties=state, generator=torch.Generator().manual_seed(0))
    draft = d.propose(ctx, 4, sampler)
    assert draft.tokens.shape == (4,) and draft.probs.shape == (4, 5)
    hist = ctx.tolist()
    ref_state = PenaltyState.start(ctx, 5)
    for i, tok in enumerate(draft.tokens.tolist()):
        q = process_logits(model.logits_for(hist).unsqueeze(0), cfg, ref_state)[0]
        assert torch.allclose(draft.probs[i], q)
        hist.append(tok)
        ref_state.append(torch.tensor([tok]))
    assert d.cache.length == 3 + 3  # the last draft token is sampled, never fed
    d.commit(Verdict(1, torch.tensor([int(draft.tokens[0]), 4])))
    assert d.cache.length == 4
    assert d.cache.tokens == ctx.tolist() + [int(draft.tokens[0])]
    # the original penalty state was not touched by drafting
    assert int(state.counts.sum()) == 0


def test_gumbel_mode_reports_no_probs():
    model = ToyLM(5, seed=1)
    d = ModelDrafter(model)
    ctx = torch.tensor([0])
    d.prepare(ctx)
    sampler = DraftSampler(SamplingConfig(temperature=1.0), "gumbel", penalties=None, generator=None, noise_seed=3)
    draft = d.propose(ctx, 3, sampler)
    assert draft.probs is None and draft.tokens.numel() == 3


def test_a_lazy_prefill_feeds_the_prompt_with_the_first_draft():
    """``lazy_prefill``: preparing runs no pass; the first round that drafts feeds the whole context
    and draws what an eagerly prefilled drafter draws, q included (a sequence a busy server never
    lets draft never pays for the draft's prefill)."""
    model = ToyLM(7, order=2, seed=5)
    ctx = torch.tensor([1, 4, 2, 6, 3])
    drafts = []
    for lazy in (False, True):
        d = ModelDrafter(model, lazy_prefill=lazy)
        d.prepare(ctx)
        assert d.cache.length == (0 if lazy else ctx.numel() - 1)
        assert d.propose(ctx, 0, DraftSampler(SamplingConfig(), "argmax", penalties=None, generator=None)).tokens.numel() == 0
        assert d.cache.length == (0 if lazy else ctx.numel() - 1)  # an undrafted round feeds nothing either
        sampler = DraftSampler(SamplingConfig(temperature=1.0), "multinomial", penalties=None,
                               generator=torch.Generator().manual_seed(3))
        drafts.append(d.propose(ctx, 3, sampler))
        assert d.cache.length == ctx.numel() + 2 and d.cache.tokens[: ctx.numel()] == ctx.tolist()
    assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist()
    assert torch.equal(drafts[0].probs, drafts[1].probs)
    assert ModelDrafter(model, lazy_prefill=True).with_model(model).lazy_prefill


def test_a_long_backlog_is_fed_in_a_pass_of_its_own_and_timed_apart():
    """A draft cache DRAFT_CATCH_UP_SPLIT or more tokens behind (a lazy prefill, or rounds without
    drafting) catches up in a pass of its own, whose seconds the round reports as ``catch_up_s``;
    the draft is what one pass over the backlog draws.  Drafting every round (a backlog of one or
    two tokens) runs one pass and reports none; nor does a round that drafts nothing."""

    calls = []

    class Counted(ToyLM):
        def forward(self, tokens, cache, *, last_only=False, **kw):
            calls.append(tokens.numel())
            return super().forward(tokens, cache, last_only=last_only, **kw)

    model = Counted(7, order=2, seed=5)
    n = defaults.DRAFT_CATCH_UP_SPLIT + 5
    ctx = torch.tensor([(3 * i) % 7 for i in range(n)])
    cfg = SamplingConfig(temperature=1.0)
    drafts = []
    for lazy in (True, False):
        d = ModelDrafter(model, lazy_prefill=lazy)
        d.prepare(ctx)
        calls.clear()
        assert d.propose(ctx, 0, DraftSampler(cfg, "multinomial", penalties=None, generator=None)).tokens.numel() == 0
        assert d.catch_up_s == 0.0 and calls == []
        drafts.append(d.propose(ctx, 3, DraftSampler(cfg, "multinomial", penalties=None, generator=torch.Generator().manual_seed(3))))
        if lazy:
            assert calls[:2] == [n - 1, 1] and d.catch_up_s > 0.0
        else:
            assert calls[0] == 1 and d.catch_up_s == 0.0
    assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist() and torch.equal(drafts[0].probs, drafts[1].probs)
    d.commit(Verdict(3, torch.tensor(drafts[1].tokens.tolist() + [2])))  # all kept, one token more
    longer = torch.cat([ctx, drafts[1].tokens, torch.tensor([2])])
    calls.clear()
    d.propose(longer, 2, DraftSampler(cfg, "multinomial", penalties=None, generator=torch.Generator().manual_seed(4)))
    assert calls[0] == 2 and d.catch_up_s == 0.0  # the last draft and the bonus token: one pass


# ----------------------------------------------------------------------------- a reduced draft vocabulary


import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from specdec.decoder import SpeculativeDecoder  # noqa: E402
from specdec.gamma import FixedGamma  # noqa: E402
from specdec.models.native import NativeCausalLM  # noqa: E402
from specdec.verify import get_rule  # noqa: E402
from specdec import defaults


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny random Llama as the target and the same weights as a draft over 2,000 of its
    49,152 tokens (the target's own greedy choices are mostly among them: it is its own draft)."""
    from tiny import make_tiny

    folder = make_tiny(tmp_path_factory.mktemp("subset") / "m", seed=4)
    target = NativeCausalLM.from_folder(folder, batch_invariant=True)
    prompt = [1, 504, 3300, 288, 3400]
    cache = target.new_cache(64)
    greedy = SpeculativeDecoder(target, None, get_rule("greedy")).generate(prompt, SamplingConfig(temperature=0.0, max_new_tokens=24)).tokens
    ids = torch.tensor(sorted(set(greedy) | set(range(2000))))
    draft = NativeCausalLM.from_folder(folder, vocab_subset=ids)
    del cache
    return folder, target, draft, ids, prompt, greedy


def test_a_reduced_vocabulary_draft_scores_its_tokens_only(tiny_pair):
    _, target, draft, ids, prompt, _ = tiny_pair
    full = target.forward(torch.tensor(prompt), target.new_cache(64))  # [n, V]
    sub = draft.forward(torch.tensor(prompt), draft.new_cache(64))
    outside = torch.ones(full.shape[1], dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(sub[:, outside]).all()) and bool(torch.isfinite(sub[:, ids]).all())
    assert torch.allclose(sub[:, ids], full[:, ids], atol=1e-5, rtol=1e-5)


class _Strict:
    """A constraint allowing the given tokens only, which fails if a token it forbids is ever fed
    to it (as a grammar matcher does: a draft must never propose such a token)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def allowed(self, generated, vocab_size):
        bad = [t for t in generated if t not in self.tokens]
        assert not bad, f"the constraint was fed forbidden tokens {bad}"
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.tokens] = True
        return mask


def test_a_reduced_vocabulary_draft_keeps_greedy_output_exact(tiny_pair):
    _, target, draft, _, prompt, greedy = tiny_pair
    out = SpeculativeDecoder(target, ModelDrafter(draft), get_rule("greedy"), gamma=FixedGamma(3)).generate(
        prompt, SamplingConfig(temperature=0.0, max_new_tokens=24))
    assert out.tokens == greedy and out.stats.draft_tokens_accepted > 0


def _forced_full(monkeypatch):
    """Make every sampler scatter reduced-vocabulary rows into the whole vocabulary."""
    monkeypatch.setattr(DraftSampler, "compact", property(lambda self: False))


def _spy_compact(monkeypatch) -> list[bool]:
    """Record, for every draft-model pass from now on, whether it was asked for compact rows."""
    asked: list[bool] = []
    for name in ("forward", "forward_tree"):
        orig = getattr(NativeCausalLM, name)

        def spy(self, *a, _orig=orig, **kw):
            asked.append(kw.get("compact", False))
            return _orig(self, *a, **kw)

        monkeypatch.setattr(NativeCausalLM, name, spy)
    return asked


@pytest.mark.parametrize("mode", ["argmax", "gumbel"])
@pytest.mark.parametrize("tree", [False, True])
def test_compact_draft_rows_propose_what_scattered_rows_propose(tiny_pair, monkeypatch, tree, mode):
    """Greedy drafting, and seeded drafting by keyed Gumbel noise, over a reduced vocabulary read
    the LM head's rows as they are (no scatter into 49,152 columns): the same chain / tree as the
    scattered rows, and the draft model was really asked for compact rows."""

    _, _, draft, ids, prompt, _ = tiny_pair
    asked = _spy_compact(monkeypatch)
    cfg = SamplingConfig(temperature=0.0 if mode == "argmax" else 1.0)

    def propose() -> tuple[list[int], list[int] | None]:
        d = ModelDrafter(draft)
        ctx = torch.tensor(prompt)
        d.prepare(ctx)
        sampler = DraftSampler(cfg, mode, penalties=None, generator=None, noise_seed=11)
        out = d.propose_tree(ctx, 8, sampler, TreeSpec(min_prob=0.0), max_depth=4) if tree else d.propose(ctx, 5, sampler)
        return out.tokens.tolist(), None if out.parents is None else out.parents.tolist()

    compact = propose()
    assert asked and all(asked[1:])  # the prefill of prepare() is the only full-row call
    asked.clear()
    with monkeypatch.context() as m:
        _forced_full(m)
        scattered = propose()
    assert not any(asked)
    assert compact == scattered and len(compact[0]) >= 5
    assert set(compact[0]) <= set(ids.tolist())


@pytest.mark.parametrize("tree", [False, True])
def test_drafting_from_q_reads_compact_rows_and_reports_q_over_the_whole_vocabulary(tiny_pair, monkeypatch, tree):
    """At T = 1 the reduced-vocabulary draft is asked for compact rows too; each drafted token
    comes with a q over the whole vocabulary that is zero outside the draft's ids, sums to one
    and gives the token a positive probability (the output law itself: ``tests/test_trees.py``)."""

    _, _, draft, ids, prompt, _ = tiny_pair
    asked = _spy_compact(monkeypatch)
    d = ModelDrafter(draft)
    ctx = torch.tensor(prompt)
    d.prepare(ctx)
    asked.clear()
    sampler = DraftSampler(SamplingConfig(temperature=1.0), "multinomial", penalties=None,
                           generator=torch.Generator().manual_seed(0))
    full = TreeSpec(sibling_stop=0.0, sample_expand=0.0)  # the whole sampled shape
    out = d.propose_tree(ctx, 8, sampler, full, max_depth=4) if tree else d.propose(ctx, 5, sampler)
    assert asked and all(asked)
    n = out.tokens.numel()
    assert n >= (5 if not tree else 4) and out.probs is not None and out.probs.shape == (n, draft.vocab_size)
    outside = torch.ones(draft.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert bool((out.probs[:, outside] == 0).all())
    assert torch.allclose(out.probs.sum(-1), torch.ones(n), atol=1e-5)
    assert bool((out.probs[torch.arange(n), out.tokens] > 0).all())


def test_compact_rows_only_where_no_other_token_counts():
    """Penalties, a logit bias and a constraint read (or change) logits outside the draft's
    vocabulary and a sparse wire q truncates the whole row: those rounds keep whole rows, and a
    compact row is refused there.  Keyed Gumbel noise keys each column by its target id, so it
    reads compact rows."""
    def sampler(mode=None, **kw):
        mode = mode or ("multinomial" if kw.get("temperature", 0.0) > 0 else "argmax")
        extra = {k: kw.pop(k) for k in ("q_top_k", "want_probs") if k in kw}
        return DraftSampler(SamplingConfig(**kw), mode, penalties=PenaltyState.start(torch.tensor([1]), 8),
                            generator=torch.Generator().manual_seed(0), **extra)

    assert sampler(temperature=0.0).compact and sampler(temperature=1.0).compact
    assert sampler(temperature=0.7, top_p=0.9, top_k=3, min_p=0.05).compact  # truncation sees only zeros outside
    assert sampler("gumbel", temperature=1.0).compact and sampler("gumbel", temperature=0.7, top_p=0.9).compact
    assert not sampler("gumbel", temperature=1.0, presence_penalty=0.5).compact
    for mode, kw in ((None, {"temperature": 0.0, "repetition_penalty": 1.2}),
                     (None, {"temperature": 1.0, "presence_penalty": 0.5}),
                     (None, {"temperature": 0.0, "logit_bias": ((3, 5.0),)}),
                     (None, {"temperature": 1.0, "logit_bias": ((3, 5.0),)}),
                     (None, {"temperature": 0.0, "constraint": _Strict([1, 2])}),
                     ("gumbel", {"temperature": 1.0, "logit_bias": ((3, 5.0),)}),
                     (None, {"temperature": 1.0, "q_top_k": 2}),
                     (None, {"temperature": 1.0, "want_probs": False})):
        s = sampler(mode, **kw)
        assert not s.compact, (mode, kw)
        with pytest.raises(ValueError, match="compact"):
            s(torch.zeros(1, 4), 0, torch.tensor([0, 2, 5, 7]), 8)
    s = sampler(temperature=0.0)
    assert s(torch.tensor([[0.0, 3.0, 1.0, 3.0]]), 0, torch.tensor([0, 2, 5, 7]))[0] == 2  # first maximum, as argmax


def test_a_seeded_draft_from_a_compact_row_is_the_scattered_rows_draft():
    """Drafting by keyed Gumbel noise (coupled verification) from a row over a reduced vocabulary
    gives the token the same row scattered into the whole vocabulary gives, position by position
    (200 positions, ids spread over a vocabulary of 5,000), and the confidence stop reads the
    drawn token's own q."""
    g = torch.Generator().manual_seed(2)
    vocab = 5_000
    ids = torch.randperm(vocab, generator=g)[:300].sort().values
    cfg = SamplingConfig(temperature=0.9, top_p=0.95)
    compact = DraftSampler(cfg, "gumbel", penalties=None, generator=None, noise_seed=21, min_confidence=0.05)
    whole = DraftSampler(cfg, "gumbel", penalties=None, generator=None, noise_seed=21, min_confidence=0.05)
    stops = 0
    for position in range(200):
        row = torch.randn(1, ids.numel(), generator=g) * 3
        full = torch.full((1, vocab), -math.inf)
        full[0, ids] = row[0]
        token, q = compact(row, position, ids, vocab)
        assert q is None and (token, compact.stop_requested) == (whole(full, position)[0], whole.stop_requested), position
        stops += compact.stop_requested
    assert 0 < stops < 200
    with pytest.raises(ValueError, match="vocabulary's size"):
        compact(row, 0, ids)


def test_a_draw_from_a_compact_row_reports_its_q_over_the_whole_vocabulary():
    """At T > 0 a compact row is drawn from as it is: the token is the drawn column's target id,
    the reported q is exactly the processed compact row scattered into the whole vocabulary (zero
    elsewhere), and the draws follow it (N = 20,000 draws, chi-square at p < 1e-4; the drawn
    column reported as the token fails it)."""
    from stats import ALPHA

    ids = torch.tensor([0, 2, 5, 7])
    row = torch.tensor([[0.3, 1.5, -0.4, 0.9]])
    cfg = SamplingConfig(temperature=0.8, top_p=0.95)
    s = DraftSampler(cfg, "multinomial", penalties=None, generator=torch.Generator().manual_seed(3))
    want = torch.zeros(8)
    want[ids] = process_logits(row, cfg)[0]
    counts = torch.zeros(8)
    for _ in range(20_000):
        token, q = s(row, 0, ids, 8)
        assert torch.equal(q, want)
        counts[token] += 1
    assert counts[want == 0].sum() == 0
    expected = want * counts.sum()
    cells = want > 0
    stat = float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())
    from scipy.stats import chi2
    assert chi2.sf(stat, int(cells.sum()) - 1) > ALPHA
    with pytest.raises(ValueError, match="vocabulary's size"):
        s(row, 0, ids)


@pytest.mark.parametrize("method,temperature,seed", [("greedy", 0.0, None), ("token", 1.0, None), ("block", 1.0, None),
                                                      ("coupled", 1.0, 4)])
def test_a_constraint_outside_a_reduced_vocabulary_stops_the_draft(tiny_pair, method, temperature, seed):
    """A constraint allowing only tokens outside the draft's vocabulary leaves nothing the draft
    may propose (every score -inf): the draft stops — in every sampling mode, argmax and Gumbel
    included — instead of handing NaN to the rule or a forbidden token to the constraint (a real
    grammar rejects it; found by the OpenAI server's structured-output test)."""
    _, target, draft, ids, prompt, _ = tiny_pair
    allowed = [40000, 40001, 40002]  # none of them in the draft's vocabulary
    assert not set(allowed) & set(ids.tolist())
    cfg = SamplingConfig(temperature=temperature, seed=seed, max_new_tokens=8, constraint=_Strict(allowed))
    out = SpeculativeDecoder(target, ModelDrafter(draft), get_rule(method), gamma=FixedGamma(3)).generate(prompt, cfg)
    assert len(out.tokens) == 8 and set(out.tokens) <= set(allowed)
    assert out.stats.draft_tokens_proposed == 0


def test_the_engine_reads_a_draft_folder_s_vocabulary(tiny_pair, tmp_path: Path):
    from specdec.engine import EngineConfig, draft_vocabulary
    from specdec.errors import ConfigError

    folder, *_ = tiny_pair
    assert draft_vocabulary(EngineConfig(), str(folder)) is None  # no file: the whole vocabulary
    (folder / "draft_vocab.json").write_text(json.dumps({"ids": [0, 2, 7]}))
    try:
        assert draft_vocabulary(EngineConfig(), str(folder)).tolist() == [0, 2, 7]
        assert draft_vocabulary(EngineConfig(draft_vocab="full"), str(folder)) is None
        with pytest.raises(ConfigError, match="auto or full"):
            draft_vocabulary(EngineConfig(draft_vocab="half"), str(folder))
        (folder / "draft_vocab.json").write_text(json.dumps({"ids": [7, 2]}))
        with pytest.raises(ConfigError, match="sorted"):
            draft_vocabulary(EngineConfig(), str(folder))
        with pytest.raises(ConfigError, match="must lie in"):
            NativeCausalLM.from_folder(folder, vocab_subset=torch.tensor([3, 49152]))
        (folder / "draft_vocab.json").write_text("{")
        with pytest.raises(ConfigError, match="not a draft vocabulary"):
            draft_vocabulary(EngineConfig(), str(folder))
    finally:
        (folder / "draft_vocab.json").unlink()


def test_a_batched_pass_gives_each_item_compact_or_whole_rows_as_asked(tiny_pair):
    """``forward_batch(items, compact)``: each item's logits are bitwise what ``forward`` gives it
    alone, over the draft vocabulary where asked and scattered into the whole one elsewhere
    (a batch-invariant draft: its rows do not depend on the pass)."""
    folder, _, _, ids, prompt, _ = tiny_pair
    draft = NativeCausalLM.from_folder(folder, vocab_subset=ids, batch_invariant=True)
    blocks = [torch.tensor(prompt), torch.tensor(prompt[:3]), torch.tensor(prompt[1:])]
    want = [True, False, True]
    alone = [draft.forward(b, draft.new_cache(64), last_only=i == 1, compact=c) for i, (b, c) in enumerate(zip(blocks, want))]
    caches = [draft.new_cache(64) for _ in blocks]
    batched = draft.forward_batch([(b, c, i == 1) for i, (b, c) in enumerate(zip(blocks, caches))], want)
    for a, b, c in zip(alone, batched, want):
        assert b.shape[-1] == (ids.numel() if c else draft.vocab_size)
        assert torch.equal(a, b)
    whole = draft.forward_batch([(b, draft.new_cache(64), i == 1) for i, b in enumerate(blocks)])
    assert all(w.shape[-1] == draft.vocab_size for w in whole)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("wrapper", ["serialized", "batched"])
def test_the_servers_model_wrappers_pass_compact_rows_through(tiny_pair, monkeypatch, wrapper, temperature):
    """A draft model served behind the server's lock or its batching scheduler drafts on compact
    rows like the bare model: the same chains and trees, q over the whole vocabulary, and the
    model was asked for compact rows."""
    import threading

    from specdec.server.scheduler import BatchedModel, Scheduler
    from specdec.server.sessions import SerializedModel

    _, _, draft, ids, prompt, _ = tiny_pair
    served = (SerializedModel(draft, threading.Lock()) if wrapper == "serialized"
              else BatchedModel(draft, Scheduler(draft, name="draft")))
    assert torch.equal(served.vocab_ids, ids)
    asked = _spy_compact(monkeypatch)

    def propose(model, tree: bool):
        d = ModelDrafter(model)
        ctx = torch.tensor(prompt)
        d.prepare(ctx)
        mode = "argmax" if temperature == 0 else "multinomial"
        sampler = DraftSampler(SamplingConfig(temperature=temperature), mode, penalties=None,
                               generator=torch.Generator().manual_seed(5))
        spec = TreeSpec(min_prob=0.0, sibling_stop=0.0, sample_expand=0.0)
        out = d.propose_tree(ctx, 8, sampler, spec, max_depth=4) if tree else d.propose(ctx, 5, sampler)
        return out

    for tree in (False, True):
        bare = propose(draft, tree)
        asked.clear()
        wrapped = propose(served, tree)
        assert asked and all(asked[1:])  # the prefill of prepare() is the only full-row call
        assert torch.equal(bare.tokens, wrapped.tokens) and bare.tokens.numel() >= 4
        assert (bare.parents is None) == (wrapped.parents is None)
        if bare.parents is not None:
            assert torch.equal(bare.parents, wrapped.parents)
        if temperature > 0:
            assert wrapped.probs.shape[-1] == draft.vocab_size and torch.equal(bare.probs, wrapped.probs)


def test_the_batching_scheduler_runs_compact_and_whole_row_items_in_one_pass(tiny_pair, monkeypatch):
    """Two forwards queued together (the compute thread busy until both wait) run as one batched
    pass; each gets its rows as asked, bitwise what it gets alone."""
    import threading

    from specdec.server.compute import ComputeThread
    from specdec.server.scheduler import Scheduler

    folder, _, _, ids, prompt, _ = tiny_pair
    draft = NativeCausalLM.from_folder(folder, vocab_subset=ids, batch_invariant=True)
    calls: list[list[bool] | None] = []
    orig = NativeCausalLM.forward_batch
    monkeypatch.setattr(NativeCausalLM, "forward_batch", lambda self, items, compact=None: calls.append(compact) or orig(self, items, compact))
    compute, gate = ComputeThread(name="test-compute"), threading.Event()
    compute.post(gate.wait)  # busy until both forwards wait
    sched = Scheduler(draft, name="draft", compute=compute)
    blocks = [torch.tensor(prompt), torch.tensor(prompt[1:])]
    want = [True, False]
    out: list[torch.Tensor | None] = [None, None]

    def run(i: int) -> None:
        out[i] = sched.forward(blocks[i], draft.new_cache(64), compact=want[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for i, t in enumerate(threads):  # one at a time, so the queue's order is known (it was a race)
        t.start()
        while len(sched) < i + 1:
            threading.Event().wait(0.01)
    gate.set()
    for t in threads:
        t.join(timeout=30)
    assert calls == [want]  # one batched pass with both items, in queue order
    for i in range(2):
        assert torch.equal(out[i], draft.forward(blocks[i], draft.new_cache(64), compact=want[i]))


# ----------------------------------------------------------------------------- a draft temperature factor


def test_a_temperature_factor_draws_from_and_reports_the_sharper_q():
    from dataclasses import replace

    from specdec.drafters.base import draft_config

    model = ToyLM(5, order=2, seed=3)
    ctx = torch.tensor([1, 2, 3])
    cfg = SamplingConfig(temperature=0.9, top_p=0.95, repetition_penalty=1.3)
    drafts = {}
    for factor in (1.0, 0.5):
        d = ModelDrafter(model, temperature_factor=factor)
        d.prepare(ctx)
        state = PenaltyState.start(ctx, 5)
        sampler = DraftSampler(draft_config(cfg, factor), "multinomial", penalties=state,
                               generator=torch.Generator().manual_seed(0))
        drafts[factor] = draft = d.propose(ctx, 3, sampler)
        hist, ref_state = ctx.tolist(), PenaltyState.start(ctx, 5)
        for i, tok in enumerate(draft.tokens.tolist()):
            q = process_logits(model.logits_for(hist).unsqueeze(0), replace(cfg, temperature=0.9 * factor), ref_state)[0]
            assert torch.allclose(draft.probs[i], q)
            hist.append(tok)
            ref_state.append(torch.tensor([tok]))
    # sharper: the first position's most likely token gets more mass
    top = int(drafts[1.0].probs[0].argmax())
    assert float(drafts[0.5].probs[0, top]) > float(drafts[1.0].probs[0, top])


def test_the_draft_config_keeps_greedy_and_the_temperature_range():

    from specdec.drafters.base import check_temperature_factor, draft_config
    from specdec.errors import ConfigError

    greedy = SamplingConfig(temperature=0.0)
    assert draft_config(greedy, 0.5) is greedy
    assert draft_config(SamplingConfig(temperature=0.8), 0.5).temperature == 0.4
    assert draft_config(SamplingConfig(temperature=0.002), 0.1).temperature == defaults.MIN_TEMPERATURE
    assert draft_config(SamplingConfig(temperature=5000.0), 50.0).temperature == defaults.MAX_TEMPERATURE
    for bad in (0.0, -1.0, float("nan"), float("inf"), 101.0):
        with pytest.raises(ConfigError):
            check_temperature_factor(bad)


def test_compact_draws_compiled_and_torch_give_the_same_token_and_q(monkeypatch):
    """Once a model has loaded the kernels, a draw from a compact draft row (reduced vocabulary,
    T > 0) and its scatter into the whole vocabulary are one compiled call: on 600 random rows
    (3 to 24,576 draft ids out of 49,152; temperatures 1 and 0.85) it returns the torch path's
    token and q bit for bit, and leaves the generator where the torch path leaves it."""

    from specdec.models import kernels

    if not kernels.load():
        pytest.skip("the kernels did not build here")
    import specdec.drafters.base as base_mod

    used = []
    real = base_mod._draws_compiled
    monkeypatch.setattr(base_mod, "_draws_compiled", lambda *a: used.append(real(*a)) or used[-1])
    vocab, g = 49_152, torch.Generator().manual_seed(9)
    for case in range(600):
        m = (3, 100, 4_096, 24_576)[case % 4]
        ids = torch.randperm(vocab, generator=g)[:m].sort().values
        logits = torch.randn(1, m, generator=g) * (1.0, 4.0)[case % 2]
        cfg = SamplingConfig(temperature=(1.0, 0.85)[case % 3 % 2])
        out = []
        for compiled in (True, False):
            with monkeypatch.context() as mp:
                if not compiled:
                    mp.setattr(kernels, "loaded", lambda: False)
                gen = torch.Generator().manual_seed(case)
                sampler = DraftSampler(cfg, "multinomial", penalties=None, generator=gen)
                token, q = sampler(logits, 10, ids, vocab)
                out.append((token, q, torch.rand(2, generator=gen, dtype=torch.float64)))
        (t1, q1, r1), (t2, q2, r2) = out
        assert t1 == t2 and torch.equal(q1, q2) and torch.equal(r1, r2), case
        assert q1.shape == (vocab,) and float(q1[t1]) > 0
    assert used.count(True) == 600  # every compiled-arm draw took the compiled call


def test_a_registry_model_s_shipped_vocabulary_is_found_when_its_folder_has_none(tiny_pair, tmp_path: Path, monkeypatch):
    """A model the registry converts on setup (the Qwen pair's 0.5B draft) has no vocabulary file in
    its folder; the package ships one under ``data/draft_vocab/NAME``. The folder's own file wins."""
    from types import SimpleNamespace

    from specdec import engine
    from specdec.models import registry

    folder, *_ = tiny_pair
    shipped = tmp_path / "shipped"
    (shipped / "m").mkdir(parents=True)
    (shipped / "m" / "draft_vocab.json").write_text(json.dumps({"ids": [1, 5]}))
    monkeypatch.setattr(engine, "SHIPPED_DRAFT_VOCABS", shipped)
    monkeypatch.setattr(registry, "resolve", lambda ref: registry.ResolvedModel("m", folder, spec=SimpleNamespace(name="m")))
    assert engine.draft_vocabulary(engine.EngineConfig(), "m").tolist() == [1, 5]
    assert engine.draft_vocabulary(engine.EngineConfig(draft_vocab="full"), "m") is None
    (folder / "draft_vocab.json").write_text(json.dumps({"ids": [0, 2, 7]}))
    try:
        assert engine.draft_vocabulary(engine.EngineConfig(), "m").tolist() == [0, 2, 7]
    finally:
        (folder / "draft_vocab.json").unlink()
    monkeypatch.setattr(registry, "resolve", lambda ref: registry.ResolvedModel("x", folder, spec=None))
    assert engine.draft_vocabulary(engine.EngineConfig(), "x") is None  # a plain folder: nothing shipped for it


def test_the_shipped_draft_vocabularies_are_well_formed():
    """Each shipped file names a registry model and holds sorted, distinct ids inside that model's
    vocabulary, its end-of-sequence ids among them (checked without the model installed)."""
    from specdec.engine import SHIPPED_DRAFT_VOCABS
    from specdec.models.registry import REGISTRY

    files = sorted(SHIPPED_DRAFT_VOCABS.glob("*/draft_vocab.json"))
    assert files, "no shipped draft vocabulary"
    for f in files:
        assert f.parent.name in REGISTRY
        data = json.loads(f.read_text())
        ids = torch.tensor(data["ids"])
        assert ids.numel() == data["size"] and bool((ids[1:] > ids[:-1]).all()) and int(ids[0]) >= 0
        assert int(ids[-1]) < data["vocab"]
        assert 0.9 < data["share_of_reply_tokens"] <= 1.0


def test_the_vocabulary_script_ranks_reply_tokens_before_text_tokens(tiny_pair, tmp_path: Path):
    """``scripts/draft_vocab.py --data D --texts T``: every token of the target's replies in D (not
    the prompts) is kept before the most frequent tokens of the texts fill the remaining places."""
    import subprocess
    import sys

    from specdec.models.registry import load_tokenizer
    from specdec.train.data import Shard

    folder, *_ = tiny_pair
    tok = load_tokenizer(folder)
    data = tmp_path / "data"
    data.mkdir()
    prompt = [9000, 9001, 9002]  # never counted: prompt tokens
    Shard(tokens=[torch.tensor(prompt + [7000, 7000, 7001], dtype=torch.int32)], prompt_len=[3], temperature=[0.0],
          kind=["chat"]).save(data / "shard-00000.pt")
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.py").write_text("def hello():\n    return hello\n" * 20 + "rare_word_xyz\n")
    out = tmp_path / "out"
    root = Path(__file__).resolve().parents[2]

    def run(*args: str) -> dict:
        subprocess.run([sys.executable, str(root / "scripts" / "draft_vocab.py"), *args, "--eos", "2", "--out", str(out)],
                       check=True, capture_output=True, text=True)
        return json.loads((out / "draft_vocab.json").read_text())

    text_ids = tok.encode((texts / "a.py").read_text(), add_special_tokens=False)
    common = max(set(text_ids), key=text_ids.count)
    got = run("--data", str(data), "--texts", str(texts), "--tokenizer", str(folder), "--size", "4")
    assert got["ids"] == sorted({2, 7000, 7001, common}) and got["reply_tokens_counted"] == 3
    assert got["share_of_reply_tokens"] == 1.0 and "--data data --texts" in got["command"]
    got = run("--texts", str(texts), "--tokenizer", str(folder), "--size", "3")
    assert common in got["ids"] and 7000 not in got["ids"] and len(got["ids"]) == 3


def test_the_vocabulary_script_reads_tagged_texts_and_balances_its_sources(tiny_pair, tmp_path: Path):
    """``--tagged``: Brown-corpus tokens (``word/tag``) count as their words; ``--balance``: each
    source weighs alike whatever its size, so a small prose source's top word outranks words a
    much larger code source repeats less often, relative to its own size."""
    import subprocess
    import sys

    from specdec.models.registry import load_tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from draft_vocab import untag

    assert untag("The/at jury/nn said/vbd ``/`` no/at ''/'' ,/, done/vbn ./.") == 'The jury said " no ", done.'
    folder, *_ = tiny_pair
    tok = load_tokenizer(folder)
    code, prose = tmp_path / "code", tmp_path / "prose"
    code.mkdir()
    prose.mkdir()
    (code / "a.py").write_text("return\n" * 300 + "import\n" * 200)
    (prose / "ca01").write_text("elephant/nn " * 10)
    out = tmp_path / "out"
    root = Path(__file__).resolve().parents[2]

    def top(*args: str) -> list[int]:
        subprocess.run([sys.executable, str(root / "scripts" / "draft_vocab.py"), *args, "--tokenizer", str(folder),
                        "--size", "3", "--eos", "2", "--out", str(out)], check=True, capture_output=True, text=True)
        return json.loads((out / "draft_vocab.json").read_text())["ids"]

    elephant = set(tok.encode(" elephant", add_special_tokens=False)) | set(tok.encode("elephant", add_special_tokens=False))
    tag = set(tok.encode("/nn", add_special_tokens=False))
    by_size = top("--texts", str(code), "--tagged", str(prose))
    balanced = top("--texts", str(code), "--tagged", str(prose), "--balance")
    assert not elephant & set(by_size)  # 500 code tokens crowd out 10 prose words
    assert elephant & set(balanced) and not tag & set(balanced) - elephant


# ----------------------------------------------------------------------------- a draft whose context is shorter


ROOM = 24  # the draft's context; the target's is 4,096


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("prompt_len", [6, ROOM + 6], ids=["fits", "beyond"])
def test_a_draft_with_a_shorter_context_stops_drafting_at_its_end(tree, lazy, prompt_len):
    """Past the draft model's context (SmolLM2's draft holds 2,048 positions, its target 8,192) the
    drafter drafts nothing, never asks its cache for more, and the output stays plain decoding's:
    greedy, and seeded coupled sampling at T = 1 (which gives plain seeded sampling's tokens)."""
    from tiny import tiny_native


    target, draft = tiny_native(max_length=4096), tiny_native(max_length=ROOM)  # the same weights
    prompt = [(7 * i) % 60 + 1 for i in range(prompt_len)]
    for rule, temperature in (("greedy", 0.0), ("coupled", 1.0)):
        cfg = SamplingConfig(temperature=temperature, max_new_tokens=40, seed=5)
        plain = SpeculativeDecoder(target, None, get_rule(rule)).generate(prompt, cfg)
        drafter = ModelDrafter(draft, lazy_prefill=lazy)
        spec = SpeculativeDecoder(target, drafter, get_rule(rule), gamma=FixedGamma(3),
                                  tree=TreeSpec() if tree else None).generate(prompt, cfg)
        assert spec.tokens == plain.tokens, rule
        assert drafter.cache is not None and drafter.cache.length <= ROOM
        context = prompt_len
        for r in spec.rounds:  # drafted tokens only while the draft's cache could hold the round
            if r.gamma:
                assert context + (r.gamma if tree else r.gamma - 1) <= ROOM, (context, r.gamma)
            context += r.emitted
        assert (spec.stats.draft_tokens_proposed > 0) == (prompt_len < ROOM), spec.stats.draft_tokens_proposed
        assert any(r.gamma == 0 for r in spec.rounds)  # the end reached: rounds without a draft


@pytest.mark.parametrize("mode, compact", [("argmax", False), ("argmax", True), ("gumbel", False), ("gumbel", True),
                                           ("multinomial", False), ("multinomial", True)])
def test_the_confidence_stop_reads_the_drawn_tokens_own_q(mode, compact):
    """Every way of drawing a draft token (arg-max, keyed Gumbel, multinomial; whole rows or rows
    over a reduced draft vocabulary) asks to stop exactly where the drawn token's q is below
    ``min_confidence``: q = (0.7, 0.3) on two ids of a vocabulary of 8, 0.5 the bar, so token 0
    goes on and token 1 stops (arg-max reads the top q, 0.7, and goes on; a bar of 0.8 stops it).
    40 seeded draws a case; both tokens are drawn by the sampled modes."""
    vocab, ids = 8, torch.tensor([2, 5])
    row = torch.tensor([[math.log(0.7), math.log(0.3)]])  # [1, 2] over ids
    full = torch.full((1, vocab), -math.inf)
    full[0, ids] = row[0]
    cfg = SamplingConfig(temperature=0.0 if mode == "argmax" else 1.0)
    seen = {}
    for seed in range(40):
        for bar in (0.5, 0.8):
            sampler = DraftSampler(cfg, mode, penalties=None, generator=torch.Generator().manual_seed(seed),
                                   noise_seed=seed, min_confidence=bar)
            token, _ = sampler(row, seed, ids, vocab) if compact else sampler(full, seed)
            q = 0.7 if token == 2 else 0.3
            assert token in (2, 5) and sampler.stop_requested == (q < bar), (seed, bar, token)
            seen[token] = seen.get(token, 0) + 1
    assert set(seen) == ({2} if mode == "argmax" else {2, 5})


def _argmax() -> DraftSampler:
    return DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)


def test_a_prompt_that_exactly_fills_the_draft_context_is_still_prefilled():
    """``prepare`` prefills all but the last prompt token whenever the prompt fits the draft's
    room (``<=``, not ``<``): a prompt of exactly ``max_length`` tokens is prefilled up front,
    and the round after it feeds only the last token (no catch-up pass)."""
    model = ToyLM(7, order=2, seed=5)
    ctx = torch.tensor([1, 4, 2, 6, 3])
    d = ModelDrafter(model, max_length=ctx.numel())
    d.prepare(ctx)
    assert d.cache.length == ctx.numel() - 1
    draft = d.propose(ctx, 3, _argmax())
    assert draft.tokens.numel() == 1  # room for one drafted token: the cache ends full
    assert d.cache.length == ctx.numel()


def test_a_round_without_room_keeps_the_cache_on_commit():
    """A round past the draft's context drafts nothing, and its commit keeps the draft cache as
    it was (``_no_room`` starts the round at the cache's length, not at 0)."""
    model = ToyLM(7, order=2, seed=5)
    ctx = torch.tensor([1, 4, 2, 6, 3])
    d = ModelDrafter(model, max_length=6)
    d.prepare(ctx)
    d.propose(ctx, 3, _argmax())
    d.commit(Verdict(2, torch.tensor([0, 1, 2])))  # the two drafted tokens kept, one more
    kept = d.cache.length
    assert kept == ctx.numel() + 1
    longer = torch.cat([ctx, torch.tensor([0, 1, 2])])  # 8 tokens: past the draft's 6
    assert d.propose(longer, 3, _argmax()).tokens.numel() == 0
    d.commit(Verdict(0, torch.tensor([5])))
    assert d.cache.length == kept


def test_with_model_keeps_the_temperature_factor():
    """``with_model`` is a drafter of the same settings: the temperature factor too."""
    d = ModelDrafter(ToyLM(5, seed=1), max_length=32, temperature_factor=0.6, lazy_prefill=True)
    fresh = d.with_model(ToyLM(5, seed=2))
    assert fresh.temperature_factor == 0.6 and fresh.max_length == 32 and fresh.lazy_prefill


def test_a_tree_feeds_no_more_nodes_than_the_draft_cache_has_rows_left():
    """``propose_tree`` hands the tree builder the cache's free rows (``max_fed``): two rows left
    after the context, a tree of up to 10 nodes feeds at most two of them and the cache ends at
    its ``max_length`` (the decoder's own budget does not cap this: the drafter must)."""
    from tiny import tiny_native

    room = 24
    d = ModelDrafter(tiny_native(max_length=room))
    ctx = torch.tensor([(7 * i) % 60 + 1 for i in range(room - 2)])
    d.prepare(ctx)
    draft = d.propose_tree(ctx, 10, _argmax(), TreeSpec(min_prob=0.0), max_depth=6)
    assert draft.tokens.numel() > 2  # the last level is drawn, not fed
    assert d.cache.length <= room


def test_a_tree_commit_keeps_the_accepted_paths_fed_nodes_as_a_plain_pass_computes_them():
    """After a tree round, ``commit`` keeps the context and the accepted path's fed (expanded)
    nodes, compacted after the context: their keys/values are what one plain pass over the
    context and the path's tokens computes (each node attended to its own ancestors in the tree
    pass, and is kept at its slot after ``round_start``).  A 2-layer model, so a depth-2 node's
    layer-1 keys depend on its parent."""
    from tiny import tiny_native

    model = tiny_native()
    d = ModelDrafter(model)
    ctx = torch.tensor([5, 9, 3, 3, 17, 40])
    d.prepare(ctx)
    draft = d.propose_tree(ctx, 12, _argmax(), TreeSpec(min_prob=0.0, width=2, depth=4), max_depth=4)
    parents = draft.parents.tolist()

    def depth(v):
        return 0 if parents[v] < 0 else 1 + depth(parents[v])

    leaf = max(range(len(parents)), key=lambda v: (depth(v), -v))
    path = [leaf]
    while parents[path[0]] >= 0:
        path.insert(0, parents[path[0]])
    assert len(path) >= 3
    fed = 0
    while fed < len(path) and path[fed] in d._slots:
        fed += 1
    assert fed >= 2  # at least a root-level node and its child were fed
    tokens = draft.tokens[path]
    d.commit(Verdict(len(path), torch.cat([tokens, torch.tensor([1])]), path=tuple(path)))
    n = ctx.numel() + fed
    assert d.cache.length == n
    ref = model.new_cache(64)
    model.forward(torch.cat([ctx, tokens[:fed]]), ref)
    assert torch.allclose(d.cache.k[:, :, :n], ref.k[:, :, :n], atol=1e-5)
    assert torch.allclose(d.cache.v[:, :, :n], ref.v[:, :, :n], atol=1e-5)


def test_a_round_after_a_catch_up_reports_no_catch_up_seconds():
    """``catch_up_s`` is this round's: a lazy drafter's first round catches up (> 0); the next round,
    one or two tokens behind, reports 0.0 -- and so does a round that drafts nothing after it."""
    model = ToyLM(7, order=2, seed=5)
    n = defaults.DRAFT_CATCH_UP_SPLIT + 5
    ctx = torch.tensor([(3 * i) % 7 for i in range(n)])
    for second_gamma in (2, 0):
        d = ModelDrafter(model, lazy_prefill=True)
        d.prepare(ctx)
        draft = d.propose(ctx, 3, _argmax())
        assert d.catch_up_s > 0.0
        d.commit(Verdict(3, torch.tensor(draft.tokens.tolist() + [2])))
        longer = torch.cat([ctx, draft.tokens, torch.tensor([2])])
        d.propose(longer, second_gamma, _argmax())
        assert d.catch_up_s == 0.0, second_gamma


class _Keeping(ToyLM):
    """A toy draft model whose ``keep_sequence`` (the prefix cache's hand-over) records what it is given in ``kept``."""

    def __init__(self, kept: list, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kept = kept

    def keep_sequence(self, tokens, cache):
        self.kept.append((tokens.tolist(), cache.length))


def test_finish_hands_the_prefix_cache_only_the_tokens_the_draft_cache_holds():
    """``finish`` gives ``keep_sequence`` the committed tokens whose rows the draft cache holds (not
    the newest committed token, which was never fed), with the cache itself."""
    kept = []
    d = ModelDrafter(_Keeping(kept, 7, order=2, seed=5))
    ctx = torch.tensor([1, 4, 2, 6, 3])
    d.prepare(ctx)
    draft = d.propose(ctx, 3, _argmax())
    d.commit(Verdict(1, torch.tensor([int(draft.tokens[0]), 5])))
    committed = torch.cat([ctx, draft.tokens[:1], torch.tensor([5])])
    d.finish(committed)
    assert kept == [(committed[:6].tolist(), 6)]


def test_a_backlog_of_exactly_the_split_gets_a_catch_up_pass_of_its_own():
    """The catch-up pass starts at DRAFT_CATCH_UP_SPLIT tokens behind (``>=``): a lazy drafter's
    first round over SPLIT + 1 context tokens feeds SPLIT of them in a pass of its own, then the
    last one; over SPLIT tokens (a backlog of SPLIT - 1) it feeds all of them in one pass."""
    calls = []

    class Counted(ToyLM):
        def forward(self, tokens, cache, *, last_only=False, **kw):
            calls.append(tokens.numel())
            return super().forward(tokens, cache, last_only=last_only, **kw)

    split = defaults.DRAFT_CATCH_UP_SPLIT
    for n, want, timed in ((split + 1, [split, 1], True), (split, [split], False)):
        d = ModelDrafter(Counted(7, order=2, seed=5), lazy_prefill=True)
        ctx = torch.tensor([(3 * i) % 7 for i in range(n)])
        d.prepare(ctx)
        calls.clear()
        d.propose(ctx, 1, _argmax())
        assert calls == want and (d.catch_up_s > 0.0) == timed, n


def test_finish_hands_the_prefix_cache_nothing_when_the_draft_cache_holds_nothing():
    """A lazy drafter that never drafted (a busy server's sequence) has an empty cache: ``finish``
    does not hand the prefix cache an empty sequence to keep."""
    kept = []
    d = ModelDrafter(_Keeping(kept, 7, order=2, seed=5), lazy_prefill=True)
    ctx = torch.tensor([1, 4, 2, 6, 3])
    d.prepare(ctx)
    d.finish(torch.cat([ctx, torch.tensor([2, 5])]))
    assert kept == []


def test_finish_after_rounds_the_drafter_sat_out_hands_only_the_rows_it_holds():
    """The draft cache fell behind (rounds of prompt lookup, or at γ 0): ``finish`` hands the prefix
    cache the tokens its rows hold (the prefilled prompt less its last token), not the whole
    committed text, whose later tokens it never fed."""
    kept = []
    d = ModelDrafter(_Keeping(kept, 7, order=2, seed=5))
    ctx = torch.tensor([1, 4, 2, 6, 3])
    d.prepare(ctx)
    d.finish(torch.cat([ctx, torch.tensor([2, 5, 1])]))
    assert kept == [([1, 4, 2, 6], 4)]
