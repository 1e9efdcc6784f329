import torch

from specdec.drafters import ModelDrafter
from specdec.drafters.base import DraftSampler
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
