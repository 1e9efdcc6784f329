import torch

from specdec.drafters import NgramDrafter
from specdec.drafters.base import DraftSampler
from specdec.sampling import SamplingConfig
from specdec.verify import Verdict

SAMPLER = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)


def test_copies_the_continuation_of_the_latest_match():
    d = NgramDrafter(max_ngram=3)
    ctx = torch.tensor([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7])
    d.prepare(ctx)
    draft = d.propose(ctx, 3, SAMPLER)
    assert draft.tokens.tolist() == [2, 3, 5] and draft.probs is None  # latest earlier "5 6 7"


def test_falls_back_to_shorter_ngrams_and_to_nothing():
    d = NgramDrafter(max_ngram=3)
    ctx = torch.tensor([1, 2, 3, 9, 3])
    d.prepare(ctx)
    assert d.propose(ctx, 4, SAMPLER).tokens.tolist() == [9, 3]
    ctx = torch.tensor([1, 2, 3, 4])
    d.prepare(ctx)
    assert d.propose(ctx, 4, SAMPLER).tokens.numel() == 0


def test_incremental_index_matches_fresh():
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, 4, (200,), generator=g)
    inc = NgramDrafter()
    inc.prepare(seq[:10])
    for end in range(10, 200, 7):
        fresh = NgramDrafter()
        fresh.prepare(seq[:end])
        a = inc.propose(seq[:end], 5, SAMPLER).tokens.tolist()
        inc.commit(Verdict(0, torch.tensor([0])))
        assert a == fresh.propose(seq[:end], 5, SAMPLER).tokens.tolist()
