"""Logit processing semantics, the samplers, keyed noise, validation."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from specdec import defaults
from specdec.errors import ConfigError
from specdec.models import kernels
from specdec.sampling import (
    GUIDE_PRESET,
    PenaltyState,
    SamplingConfig,
    StopFloor,
    checked_bias,
    _top_p_mask,
    floor_stops,
    gumbel_sample,
    keyed_uniform,
    offset_seed,
    path_masks,
    penalised_logits,
    process_logits,
    sample_categorical,
    settled,
    target_logprobs,
    top_logprobs,
    with_overrides,
)
from stats import ALPHA, chi_square_pvalue


def test_guide_preset():
    assert (GUIDE_PRESET.temperature, GUIDE_PRESET.top_p, GUIDE_PRESET.repetition_penalty) == (1.0, 0.9, 1.1)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top-p"),
        ({"top_p": 1.5}, "top-p"),
        ({"top_k": 0}, "top-k"),
        ({"min_p": -0.1}, "min-p"),
        ({"repetition_penalty": 0.0}, "repetition penalty"),
        ({"max_new_tokens": 0}, "max new tokens"),
        ({"min_tokens": 5, "max_new_tokens": 4}, "min tokens"),
        ({"min_tokens": -1}, "min tokens"),
        ({"stop_token_ids": (3, -1)}, "stop token ids"),
        # values of the wrong kind were accepted and failed inside generation with a TypeError
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"seed": True}, "seed must be an integer, got True"),
        ({"top_k": 2.5}, "top-k must be an integer"),
        ({"max_new_tokens": 2.5}, "max new tokens must be an integer"),
        ({"max_new_tokens": math.nan}, "max new tokens must be an integer, got nan"),
        ({"min_tokens": 1.5}, "min tokens must be an integer"),
        ({"temperature": "1"}, "temperature must be a number, got '1'"),
        ({"top_p": "0.9"}, "top-p must be a number"),
        ({"stop": None}, "stop must be a list or tuple, got None"),
        ({"stop": [1]}, "stop strings must be non-empty strings"),
        ({"stop": ("",)}, "stop strings must be non-empty strings"),
        ({"stop_token_ids": (2.5,)}, "a stop token id must be an integer"),
        ({"skip_special_tokens": "false"}, "skip_special_tokens must be True or False"),
        ({"include_stop": 1}, "include_stop must be True or False"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit bias gives token 1 twice"),
        ({"logit_bias": ((1, 1.0, 3),)}, r"logit bias takes \(token id, bias\) pairs"),
        ({"logit_bias": {1: "x"}}, "a logit bias must be a number"),
        # past float32's range once multiplied by a count or divided by a temperature: NaN laws
        ({"frequency_penalty": 1e308}, "frequency penalty must be between -10000 and 10000"),
        ({"presence_penalty": -1e5}, "presence penalty must be between"),
        ({"logit_bias": ((100, 1e36),)}, "logit bias needs token ids >= 0 and values between"),
    ],
)
def test_validation(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        SamplingConfig(**kwargs)


def test_accepted_forms_are_kept_as_the_config_keeps_them():
    """One stop string is one stop (it was read as one stop per character: "Berlin" stopped at the
    first "r"), lists become tuples, a {token: bias} mapping sorted pairs, numpy integers Python's."""
    import numpy as np

    assert SamplingConfig(stop="Berlin").stop == ("Berlin",)
    assert SamplingConfig(stop=["a", "b"], stop_token_ids=[4, 2]).stop == ("a", "b")
    assert SamplingConfig(stop_token_ids=[4, 2]).stop_token_ids == (4, 2)
    assert SamplingConfig(logit_bias={5: 1, 2: -1.5}).logit_bias == ((2, -1.5), (5, 1.0))
    cfg = SamplingConfig(top_k=np.int64(3), seed=np.int32(7), temperature=np.float32(0.5))
    assert (cfg.top_k, cfg.seed) == (3, 7) and type(cfg.top_k) is int and type(cfg.temperature) is float
    assert SamplingConfig(temperature=0).greedy and SamplingConfig(stop="x") == SamplingConfig(stop=("x",))


def test_greedy_is_one_hot_of_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 1.0, 0.0]])
    probs = process_logits(logits, SamplingConfig(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_temperature_top_k_min_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64))
    t2 = process_logits(logits, SamplingConfig(temperature=2.0))
    assert torch.allclose(t2, torch.softmax(logits / 2, -1))
    k2 = process_logits(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(k2, torch.tensor([[0.625, 0.375, 0.0, 0.0]], dtype=torch.float64))
    mp = process_logits(logits, SamplingConfig(temperature=1.0, min_p=0.5))  # keep p >= 0.25
    assert torch.allclose(mp, torch.tensor([[0.625, 0.375, 0.0, 0.0]], dtype=torch.float64))


def _top_p_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    v, i = probs.sort(descending=True, stable=True)
    keep = (v.cumsum(-1) - v) < top_p
    keep[..., 0] = True
    return torch.zeros_like(probs, dtype=torch.bool).scatter_(-1, i, keep)


@pytest.mark.parametrize("scale", [0.3, 2.0, 6.0])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.99])
def test_top_p_matches_full_sort(scale, top_p):
    g = torch.Generator().manual_seed(int(scale * 10))
    probs = torch.softmax(torch.randn(5, 5000, generator=g) * scale, -1)
    assert torch.equal(_top_p_mask(probs, top_p), _top_p_by_full_sort(probs, top_p))


@pytest.mark.parametrize("vocab", [3000, 49152, 151936])
def test_processed_rows_are_independent_of_the_batch_and_the_threads(vocab):
    """A verification pass processes γ + 1 rows where plain decoding processes one: each row's law
    and log-probabilities must have the bits it has alone (else coupled tokens at near-ties and the
    reported log-probabilities drift), with one thread or two.  Summing the renormalised rows with
    ``x.sum(-1)`` failed this with two threads on 131 of 250 rows (top-p) and 122 (min-p) at
    SmolLM2's vocabulary size."""
    g = torch.Generator().manual_seed(5)
    scale = torch.tensor([[0.2], [1], [3], [0.5], [8], [2]])
    logits = torch.randn(6, vocab, generator=g) * scale  # [6, V]
    configs = [SamplingConfig(temperature=t, top_p=p, min_p=m, top_k=k) for t, p, m, k in
               [(1.0, 0.8, None, None), (0.7, None, 0.05, None), (1.0, 0.95, 0.02, 40), (1.3, None, None, None), (0.0, None, None, None)]]
    before = torch.get_num_threads()
    seen = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for cfg in configs:
                batched, logp = process_logits(logits, cfg), target_logprobs(logits, cfg)
                assert torch.equal(batched, torch.cat([process_logits(logits[i : i + 1], cfg) for i in range(6)]))
                assert torch.equal(logp, torch.cat([target_logprobs(logits[i : i + 1], cfg) for i in range(6)]))
                for n in (2, 3):
                    assert torch.equal(process_logits(logits[:n], cfg), batched[:n])
                seen.append(batched)
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(seen[: len(configs)], seen[len(configs):]))  # one thread or two


def test_repetition_penalty_matches_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 40, generator=g)
    prompt = torch.tensor([3, 7, 7, 20])
    ours = penalised_logits(logits, SamplingConfig(repetition_penalty=1.3), PenaltyState.start(prompt, 40))
    theirs = RepetitionPenaltyLogitsProcessor(1.3)(prompt.unsqueeze(0), logits.clone())
    assert torch.allclose(ours, theirs)


def test_frequency_and_presence_count_generated_tokens_only():
    state = PenaltyState.start(torch.tensor([1, 1]), 5)  # prompt tokens do not count
    state.append(torch.tensor([2, 2, 3]))
    out = penalised_logits(torch.zeros(1, 5), SamplingConfig(frequency_penalty=0.5, presence_penalty=0.25), state)
    assert out.tolist() == [[0.0, 0.0, -1.25, -0.75, 0.0]]


def test_penalties_see_draft_tokens_position_by_position():
    """Row i of a verification block equals plain processing after appending draft[:i]."""
    cfg = SamplingConfig(temperature=0.8, repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2, top_p=0.9)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 12, generator=g, dtype=torch.float64)
    prompt = torch.tensor([0, 1])
    draft = torch.tensor([5, 5, 9])
    state = PenaltyState.start(prompt, 12)
    state.append(torch.tensor([2]))  # one token already generated
    batched = process_logits(logits, cfg, state, draft)
    for i in range(4):
        ref_state = PenaltyState(state.seen.clone(), state.counts.clone())
        if i:
            ref_state.append(draft[:i])
        assert torch.allclose(batched[i], process_logits(logits[i : i + 1], cfg, ref_state)[0], atol=1e-12)


def test_sample_categorical_law_and_zero_weights():
    g = torch.Generator().manual_seed(0)
    weights = torch.tensor([0.0, 2.0, 0.0, 1.0, 1.0, 0.0])
    n = 20_000
    draws = [(sample_categorical(weights, g),) for _ in range(n)]
    assert all(d[0] in (1, 3, 4) for d in draws)
    law = {(1,): 0.5, (3,): 0.25, (4,): 0.25}
    assert chi_square_pvalue(draws, law) > ALPHA


def test_keyed_uniform_is_a_pure_function():
    a = keyed_uniform(11, 5, None, 1000)
    b = keyed_uniform(11, 5, torch.tensor([3, 999, 0]), 1000)
    assert torch.equal(b, a[[3, 999, 0]])
    assert not torch.equal(a, keyed_uniform(11, 6, None, 1000))
    assert not torch.equal(a, keyed_uniform(12, 5, None, 1000))
    assert 0.0 < float(a.min()) and float(a.max()) < 1.0
    many = torch.cat([keyed_uniform(1, pos, None, 1000) for pos in range(50)])  # 50k draws
    assert abs(float(many.mean()) - 0.5) < 0.005 and abs(float(many.var()) - 1 / 12) < 0.002


def _splitmix64_reference(x: int) -> int:  # the published finaliser, on Python integers
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


@pytest.mark.parametrize("seed", [0, 7, -3, 2**63 + 11, 2**70 + 5])
def test_keyed_uniform_compiled_and_torch_paths_give_the_same_bits(seed, monkeypatch):
    """The compiled pass (used once a model has loaded the kernels) and the torch ops give the
    same float64 bits, for the whole vocabulary and for id subsets, and both are the SplitMix64
    construction the docstring states (checked on a few ids with Python integers)."""

    if not kernels.load():
        pytest.skip("the kernels did not build here")
    vocab = 49_152
    for position in (0, 1, 37, 10**6, 2**40):
        ids = torch.tensor([0, 1, 5, 4_095, 49_151, 17])
        compiled = (keyed_uniform(seed, position, None, vocab), keyed_uniform(seed, position, ids, vocab))
        with monkeypatch.context() as m:
            m.setattr(kernels, "loaded", lambda: False)
            plain = (keyed_uniform(seed, position, None, vocab), keyed_uniform(seed, position, ids, vocab))
        assert compiled[0].dtype == torch.float64 and torch.equal(compiled[0], plain[0])
        assert torch.equal(compiled[1], plain[1]) and torch.equal(compiled[1], compiled[0][ids])
        mask = (1 << 64) - 1
        key = _splitmix64_reference((seed & mask) ^ ((position * 0x9E3779B1 + 0x1234567) & mask))
        for v in (0, 4_095, 49_151):
            bits = _splitmix64_reference(_splitmix64_reference(v + 0x5DEECE66D) ^ key)
            assert float(compiled[0][v]) == ((bits >> 11) + 0.5) / 2**53


def test_gumbel_sample_law():
    """Gumbel-max over keyed noise is distributed as p (n = 20,000 positions)."""
    p = torch.tensor([0.1, 0.0, 0.25, 0.4, 0.25])
    draws = [(gumbel_sample(p, 3, pos),) for pos in range(20_000)]
    assert chi_square_pvalue(draws, {(i,): float(v) for i, v in enumerate(p) if v > 0}) > ALPHA
    assert Counter(draws)[(1,)] == 0


def _gumbel_torch(probs, seed, position, monkeypatch):  # gumbel_sample's torch ops alone
    with monkeypatch.context() as m:
        m.setattr(kernels, "loaded", lambda: False)
        return gumbel_sample(probs, seed, position)


def test_gumbel_compiled_draws_the_torch_token(monkeypatch):
    """The compiled Gumbel-max (``csrc/keyed.cpp``, used once a model has loaded the kernels) picks
    the token the torch ops pick, on 1,800 rows: 49,152 and 1,000 words, float32 and float64, flat,
    peaked and top-k-truncated laws, tiny (subnormal float32) entries, seeds beyond 64 bits and
    negative ones, large positions.  It may decline a row (about one in 10^9); here it must answer
    all but a handful, so a broken screen or logarithm shows as mismatches or refusals."""
    from specdec.sampling import _gumbel_compiled

    if not kernels.load():
        pytest.skip("the kernels did not build here")
    g = torch.Generator().manual_seed(5)
    declined = 0
    for t in range(1_800):
        vocab = 49_152 if t % 3 else 1_000
        logits = torch.randn(vocab, generator=g) * (0.3, 1.0, 4.0, 12.0)[t % 4]
        p = torch.softmax(logits, -1)
        if t % 5 == 1:  # top-k: a few hundred ids with p > 0
            keep = p.topk(1 + t % 300).indices
            p = torch.zeros_like(p).index_put_((keep,), p[keep])
        if t % 7 == 2:
            p[t % vocab] = 1e-42  # a subnormal float32 entry
        if t % 2:
            p = p.double()
        seed = (t * 7_919, -t - 1, 2**64 + t, 2**63 + t)[t % 4]
        position = (t, 10**9 + t)[t % 2]
        won = _gumbel_compiled(p, seed, position)
        ref = _gumbel_torch(p, seed, position, monkeypatch)
        if won is None:
            declined += 1
            assert gumbel_sample(p, seed, position) == ref  # then gumbel_sample runs the torch ops
        else:
            assert won == ref, (t, won, ref)
    assert declined <= 2


def test_gumbel_compiled_declines_what_it_cannot_vouch_for(monkeypatch):
    """Rows where the margin argument does not hold go to the torch ops: two ids whose ratios
    p / (-log u) are equal to the last bits (a near-tie built from the uniforms themselves), a NaN,
    a negative and an infinite entry; gumbel_sample still returns the torch version's token."""
    from specdec.sampling import _gumbel_compiled

    if not kernels.load():
        pytest.skip("the kernels did not build here")
    vocab, seed, position = 1_000, 17, 4
    u = keyed_uniform(seed, position, None, vocab)  # [V] float64
    e = -torch.log(u)
    base = torch.full((vocab,), 1e-6, dtype=torch.float64)
    assert _gumbel_compiled(base, seed, position) is not None
    tie = base.clone()
    tie[10], tie[20] = 0.3, 0.3 * float(e[20]) / float(e[10])  # r_10 == r_20 up to rounding
    odd = []
    for i, v in enumerate([math.nan, -0.5, math.inf]):
        row = base.clone()
        row[100 + i] = v
        odd.append(row)
    for row in [tie, *odd]:
        assert _gumbel_compiled(row, seed, position) is None
        assert gumbel_sample(row, seed, position) == _gumbel_torch(row, seed, position, monkeypatch)


@pytest.mark.parametrize("compiled", [True, False])
def test_a_compact_gumbel_row_draws_the_token_its_scattered_row_draws(monkeypatch, compiled):
    """A row over a reduced vocabulary (its target ids beside it, sorted or not) draws by keyed
    Gumbel noise exactly the token the same row scattered into the whole vocabulary draws: 600
    rows of 49,152 and 1,000 words, float32 and float64, top-k-truncated ones among them, with the
    compiled op and with the torch ops.  Keying a column by its index instead of its id, or
    returning the column, fails it."""
    from specdec.sampling import gumbel_column

    if compiled and not kernels.load():
        pytest.skip("the kernels did not build here")
    if not compiled:
        monkeypatch.setattr(kernels, "loaded", lambda: False)
    g = torch.Generator().manual_seed(9)
    differ = 0
    for t in range(600 if compiled else 150):
        vocab = 49_152 if t % 3 else 1_000
        m = (16_384, 400)[t % 2] if vocab > 1_000 else 300
        ids = torch.randperm(vocab, generator=g)[:m]
        if t % 4:
            ids = ids.sort().values
        q = torch.softmax(torch.randn(m, generator=g) * (0.5, 2.0, 6.0)[t % 3], -1)
        if t % 5 == 1:
            keep = q.topk(1 + t % 50).indices
            q = torch.zeros_like(q).index_put_((keep,), q[keep])
        if t % 2:
            q = q.double()
        full = torch.zeros(vocab, dtype=q.dtype)
        full[ids] = q
        seed, position = (t * 7_919, -t - 1)[t % 2], 10 * t
        token = gumbel_sample(q, seed, position, ids, vocab)
        assert token == gumbel_sample(full, seed, position), t
        col = gumbel_column(q, seed, position, ids, vocab)
        assert int(ids[col]) == token and q[col] > 0
        differ += token != int(ids[gumbel_column(q, seed, position)])  # keyed by column: another token
    assert differ > (300 if compiled else 75)  # (peaked rows agree either way)
    with pytest.raises(ValueError, match="compact row"):
        gumbel_sample(torch.ones(3) / 3, 0, 0, torch.tensor([1, 2]), 8)
    with pytest.raises(ValueError, match="compact row"):
        gumbel_sample(torch.ones(2) / 2, 0, 0, torch.tensor([1, 2]))


def test_the_compiled_compact_gumbel_op_refuses_bad_ids():
    """The op checks what it is given: ids outside the vocabulary, of another length or type."""

    if not kernels.load():
        pytest.skip("the kernels did not build here")
    row = torch.ones(3) / 3
    for ids, vocab in ((torch.tensor([0, 1, 8]), 8), (torch.tensor([0, 1]), 8), (torch.tensor([0, 1, 2], dtype=torch.int32), 8),
                       (torch.tensor([0, 1, 2]), 0), (torch.tensor([0, -1, 2]), 8)):
        with pytest.raises(RuntimeError, match="gumbel_argmax"):
            torch.ops.specdec.gumbel_argmax(row, 5, ids, vocab)


def _argmax_cases(g: torch.Generator):
    """Rows for the arg-max tests: random, full of ties (small integers), with repeated maxima,
    NaN before and after the maximum, infinities, signed zeros; widths around the compiled
    kernel's vector steps (8, 16) and a 49,152-word row."""
    for t in range(400):
        n, width = 1 + t % 5, (4099, 1, 7, 15, 16, 17, 31, 33, 49_152)[t % 9]
        x = torch.randint(-3, 3, (n, width), generator=g).float() if t % 2 else torch.randn(n, width, generator=g)
        if t % 7 == 0:
            x[:, width // 3] = x.max()
            x[:, width - 1] = x.max()
        if t % 11 == 3:
            x[0, int(torch.randint(width, (1,), generator=g))] = float("nan")
            x[-1, width - 1] = float("nan")
        if t % 13 == 4:
            x[n // 2] = -math.inf
            x[0, width // 2] = math.inf
        if t % 17 == 5:
            x = torch.zeros(n, width)
            x[0, ::2] = -0.0
        yield x


@pytest.mark.parametrize("compiled", [False, True])
def test_argmax_last_is_argmax_ties_and_nan_included(monkeypatch, compiled):
    """The fast arg-max every greedy path uses returns exactly what ``argmax(-1)`` returns: the first
    maximal index (the first NaN where a row holds one), on 400 batches of rows (see _argmax_cases),
    with torch's reduction and with the compiled ``argmax_rows`` a model's kernels bring in."""
    from specdec.sampling import argmax_last

    if compiled and not kernels.load():
        pytest.skip("the kernels did not build here")
    if not compiled:
        monkeypatch.setattr(kernels, "loaded", lambda: False)
    g = torch.Generator().manual_seed(0)
    for x in _argmax_cases(g):
        want = x.argmax(-1)
        assert torch.equal(argmax_last(x), want)
        assert torch.equal(argmax_last(x[0]), want[0])
        if compiled:  # the op itself, not a fallback
            assert torch.equal(torch.ops.specdec.argmax_rows(x), want)
    x = torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [2.0, 5.0, 5.0, -1.0]])
    assert argmax_last(x).tolist() == x.argmax(-1).tolist() == [1, 1]
    # what the compiled path leaves to torch: other dtypes, strided rows, more dimensions
    for y in (x.double(), x.t().contiguous().t(), x.reshape(1, 2, 4), x.half()):
        assert torch.equal(argmax_last(y), y.argmax(-1))


def test_the_compiled_argmax_refuses_what_it_cannot_read():
    if not kernels.load():
        pytest.skip("the kernels did not build here")
    for bad in (torch.zeros(4), torch.zeros(2, 4).double(), torch.zeros(4, 2).t(), torch.zeros(2, 0)):
        with pytest.raises(RuntimeError, match="argmax_rows"):
            torch.ops.specdec.argmax_rows(bad)


def test_sample_categorical_compiled_and_torch_paths_give_the_same_draws(monkeypatch):
    """Once a model has loaded the kernels a draw is one compiled call (``sample_weights``); it
    must return the torch version's token for the same generator state, and leave the generator
    where the torch version leaves it: 3,000 rows (float32 and float64; 1 to 49,152 entries; flat,
    sharp, with zeros, a single non-zero entry, all zeros, tiny weights) drawn with both paths."""

    if not kernels.load():
        pytest.skip("the kernels did not build here")
    g = torch.Generator().manual_seed(4)
    real = torch.ops.specdec.sample_weights
    for case in range(3000):
        n = (1, 2, 5, 511, 512, 513, 4099, 49_152)[case % 8]
        w = torch.softmax(torch.randn(n, generator=g) * (0.3, 3.0, 12.0)[case % 3], -1)
        if case % 5 == 1:
            w = w * (torch.rand(n, generator=g) < 0.3)
        if case % 11 == 2:
            w = torch.zeros(n)
            w[int(torch.randint(n, (1,), generator=g))] = 0.25
        if case % 13 == 3:
            w = torch.zeros(n)
        if case % 17 == 4:
            w = w * 1e-30
        if case % 2:
            w = w.double()
        mine, ref = torch.Generator().manual_seed(case), torch.Generator().manual_seed(case)
        got = sample_categorical(w, mine)
        with monkeypatch.context() as m:
            m.setattr(kernels, "loaded", lambda: False)
            want = sample_categorical(w, ref)
        assert got == want, case
        assert torch.equal(torch.rand(2, generator=mine, dtype=torch.float64), torch.rand(2, generator=ref, dtype=torch.float64))
    # the compiled call really ran: it answers the same as the torch path for a draw by hand
    w = torch.tensor([0.0, 0.5, 0.0, 0.25, 0.25])
    assert [int(real(w, u)) for u in (0.0, 0.49, 0.5, 0.74, 0.75, 0.99, 1.0)] == [1, 1, 3, 3, 4, 4, 4]
    w = torch.zeros(1025, dtype=torch.float64)  # across the search's 512-entry chunks
    w[511], w[512], w[1000] = 1.0, 1.0, 2.0
    assert [int(real(w, u)) for u in (0.0, 0.2, 0.25, 0.3, 0.49, 0.5, 0.99)] == [511, 511, 512, 512, 512, 1000, 1000]


def test_top_p_stops_once_the_mass_reaches_top_p_exactly():
    """The nucleus is the smallest set whose mass reaches top_p: a set reaching it exactly is enough
    (mass strictly before a token must be below top_p); dyadic probabilities make the sums exact."""
    probs = torch.tensor([[0.5, 0.25, 0.1875, 0.0625]], dtype=torch.float64)
    assert _top_p_mask(probs, 0.5).tolist() == [[True, False, False, False]]
    assert _top_p_mask(probs, 0.75).tolist() == [[True, True, False, False]]
    assert _top_p_mask(probs, 0.76).tolist() == [[True, True, True, False]]
    out = process_logits(probs.log(), SamplingConfig(top_p=0.75))
    assert torch.allclose(out, torch.tensor([[2 / 3, 1 / 3, 0.0, 0.0]], dtype=torch.float64))


def test_min_p_keeps_tokens_at_the_threshold():
    """min-p keeps p >= min_p * max p: with min_p = 1 the tied maxima stay (not an all-zero, NaN row)."""
    logits = torch.tensor([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0]])
    out = process_logits(logits, SamplingConfig(min_p=1.0))
    assert out.tolist() == [[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]]


def test_greedy_takes_the_argmax_of_the_biased_and_penalised_logits():
    """Temperature 0 is the arg-max after logit bias and penalties, not of the raw logits."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    biased = process_logits(logits, SamplingConfig(temperature=0.0, logit_bias={2: 5.0}))
    assert biased.tolist() == [[0.0, 0.0, 1.0, 0.0]]
    state = PenaltyState.start(torch.tensor([0]), 4)  # token 0 in the prompt: 3 / 2 = 1.5 < 2
    penalised = process_logits(logits, SamplingConfig(temperature=0.0, repetition_penalty=2.0), state)
    assert penalised.tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_stop_floor_gives_way_where_the_inner_constraint_allows_only_stops():
    """min_tokens never leaves an empty law: where the inner constraint (a complete grammar)
    allows only the stop token, the stop token stays allowed below the floor."""

    class OnlyStop:
        def allowed(self, generated, vocab_size):
            return torch.tensor([True, False, False])

    floor = StopFloor(frozenset({0}), 5, OnlyStop())
    assert floor.allowed([1, 2], 3).tolist() == [True, False, False]
    free = StopFloor(frozenset({0}), 2)
    assert free.allowed([1], 3).tolist() == [False, True, True]
    assert free.allowed([1, 1], 3).tolist() == [True, True, True]  # floor reached at exactly n tokens


def test_checked_bias_refuses_the_first_id_past_the_vocabulary():
    assert checked_bias([(9, 1.0), (0, -2)], 10) == ((0, -2.0), (9, 1.0))
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        checked_bias([(10, 1.0)], 10)


def test_offset_seed_wraps_into_the_seed_range():
    """Seeds run 0 .. MAX_SEED: the k-th seed after MAX_SEED - 1 is MAX_SEED, then 0."""
    top = defaults.MAX_SEED
    assert offset_seed(top - 1, 1) == top
    assert offset_seed(top, 1) == 0
    assert offset_seed(5, 3) == 8


def test_min_tokens_may_equal_max_new_tokens():
    """vLLM accepts min_tokens == max_tokens (the output is then exactly that long)."""
    cfg = SamplingConfig(min_tokens=4, max_new_tokens=4)
    assert (cfg.min_tokens, cfg.max_new_tokens) == (4, 4)


def test_top_k_one_below_the_vocabulary_still_truncates():
    """top-k = V - 1 removes the least likely token; only top-k >= V keeps every token."""
    logits = torch.tensor([[2.0, 1.0, 0.0, 3.0]])
    out = process_logits(logits, SamplingConfig(top_k=3))
    assert out[0, 2] == 0.0 and bool((out[0, [0, 1, 3]] > 0).all())
    assert bool((process_logits(logits, SamplingConfig(top_k=4)) > 0).all())


def test_path_masks_stop_at_a_token_the_constraint_forbids():
    """A path whose last token its parent's mask forbids gets None, as does everything below it,
    and the constraint is never asked about such a history (a grammar cannot follow it)."""
    asked = []

    class NoTwo:  # token 2 is never allowed
        def allowed(self, generated, vocab_size):
            assert 2 not in generated, "asked about a history the constraint forbids"
            asked.append(tuple(generated))
            return torch.tensor([True, True, False, True])

    out = path_masks(NoTwo(), [1], [[], [0], [2], [2, 0], [0, 3]], 4)
    assert [m is None for m in out] == [False, False, True, True, False]
    assert asked == [(1,), (1, 0), (1, 0, 3)]


# The compiled Gumbel-max draw answers only when the largest r = p / (-log u) leads every other by a
# relative margin of 1e-9 (so its token is torch's whatever logarithm torch used); the rows above
# never put a runner-up within that margin, so neither the margin's size nor the screen that skips
# ids whose bound p / (1 - u) is below the best r shrunk by it was pinned.  These rows hold two
# candidates a relative 5e-10 apart: in one block, and in the next block behind the screen with a
# uniform within 1.5e-10 of 1 (found once by search), where -log u and 1 - u differ by less than the gap.
KEY, FAR_ID = 49, 11_536_339  # keyed_uniform(49)[11_536_339] = 1 - 1.475e-10


VOCAB = FAR_ID + 1


def _u(key: int, ids: list[int]) -> list[float]:
    return torch.ops.specdec.keyed_uniform(key, torch.tensor(ids), VOCAB).tolist()


def _row(second_at: int, second_id: int, gap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A compact float64 row: id 0 at column 0 with p = 0.5, id second_id at column second_at with r
    a relative gap below id 0's, every other column p = 0 (distinct ids)."""
    ids = torch.arange(1, 1025)
    ids[0], ids[second_at] = 0, second_id
    u0, u1 = _u(KEY, [0, second_id])
    r0 = 0.5 / -math.log(u0)
    p = torch.zeros(1024, dtype=torch.float64)
    p[0], p[second_at] = 0.5, r0 * (1 - gap) * -math.log(u1)
    return p, ids


@pytest.mark.skipif(not kernels.load(), reason="the kernels did not build here")
@pytest.mark.parametrize("second_at,second_id", [(7, 8), (512, FAR_ID)], ids=["same-block", "next-block-u-near-1"])
def test_the_compiled_gumbel_draw_declines_a_runner_up_within_the_margin(second_at, second_id):
    assert 1 - _u(KEY, [FAR_ID])[0] < 2e-10  # the search's find still holds
    p, ids = _row(second_at, second_id, 5e-10)
    assert torch.ops.specdec.gumbel_argmax(p, KEY, ids, VOCAB) == -1  # within 1e-9: torch decides
    p, ids = _row(second_at, second_id, 1e-6)
    assert torch.ops.specdec.gumbel_argmax(p, KEY, ids, VOCAB) == 0  # a clear lead: answered


def test_the_documented_bounds_are_accepted():
    """Every inclusive bound the validation states is itself accepted: top-p = 1, min-p = 0,
    stop token id 0, the largest seed, the largest penalty and bias."""
    top = defaults.MAX_PENALTY
    cfg = SamplingConfig(top_p=1.0, min_p=0.0, stop_token_ids=(0,), seed=defaults.MAX_SEED,
                         frequency_penalty=top, presence_penalty=-top, logit_bias={0: top})
    assert (cfg.top_p, cfg.min_p, cfg.stop_token_ids, cfg.seed) == (1.0, 0.0, (0,), defaults.MAX_SEED)


def test_truncates_names_each_truncation():
    assert not SamplingConfig().truncates
    assert all(SamplingConfig(**kw).truncates for kw in ({"top_k": 2}, {"top_p": 0.5}, {"min_p": 0.1}))


def test_presence_penalty_alone_is_applied():
    """A presence penalty with no other penalty still subtracts once per generated token seen."""
    state = PenaltyState.start(torch.tensor([0]), 4)
    state.append(torch.tensor([2, 2]))
    out = penalised_logits(torch.zeros(1, 4), SamplingConfig(presence_penalty=0.5), state)
    assert out.tolist() == [[0.0, 0.0, -0.5, 0.0]]


def test_logit_bias_comes_before_the_repetition_penalty_and_with_it():
    """Step 0 before step 1: token 1 (in the prompt) gets bias 2 then the penalty halves it to 1;
    the bias is not dropped when penalties are on, nor added after them (that would give 2)."""
    state = PenaltyState.start(torch.tensor([1]), 4)
    cfg = SamplingConfig(logit_bias={1: 2.0}, repetition_penalty=2.0)
    assert penalised_logits(torch.zeros(1, 4), cfg, state).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_a_logit_bias_id_equal_to_the_vocabulary_size_is_a_config_error():
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        process_logits(torch.zeros(1, 4), SamplingConfig(logit_bias={4: 1.0}))


def test_checked_bias_refuses_negative_ids():
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        checked_bias([(-1, 1.0)], 10)


def test_floor_stops_without_stop_ids_clears_min_tokens():
    """With nothing to mask, min_tokens is simply dropped (a second call must change nothing)."""
    out = floor_stops(SamplingConfig(min_tokens=3, max_new_tokens=5), frozenset())
    assert out.min_tokens == 0 and out.constraint is None


def test_stop_floor_ignores_stop_ids_outside_a_smaller_vocabulary():
    """A stop id equal to the vocabulary size (a draft's smaller vocabulary) is skipped, not an IndexError."""
    floor = StopFloor(frozenset({1, 4}), 3)
    assert floor.allowed([], 4).tolist() == [True, False, True, True]


def test_a_row_the_constraint_leaves_empty_is_a_config_error():
    """Every row must keep a token: here row 0 (history []) is fine, row 1 (after draft token 1)
    has none; an all-(-inf) row would turn the law to NaN."""

    class NothingAfterOne:
        def allowed(self, generated, vocab_size):
            return torch.tensor([bool(not generated)] * vocab_size)

    cfg = SamplingConfig(constraint=NothingAfterOne())
    state = PenaltyState.start(torch.tensor([0]), 4)
    with pytest.raises(ConfigError, match="allows no token"):
        process_logits(torch.zeros(2, 4), cfg, state, torch.tensor([1]))


def test_top_p_one_keeps_every_token_with_mass():
    """top-p = 1 is no truncation: a float32 tail whose mass before it rounds to 1.0 is kept
    (a nucleus cut at top-p = 1 would zero it)."""
    logits = torch.tensor([[0.0, -30.0]])
    out = process_logits(logits, SamplingConfig(top_p=1.0))
    assert torch.equal(out, torch.softmax(logits, -1)) and float(out[0, 1]) > 0


def test_sample_categorical_never_draws_a_leading_zero_weight(monkeypatch):
    """u = 0 (a possible draw) lands on the first token of positive weight, not a zero before it."""

    monkeypatch.setattr(kernels, "loaded", lambda: False)
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.zeros(1, dtype=torch.float64))
    assert sample_categorical(torch.tensor([0.0, 0.0, 1.0, 1.0]), None) == 2


def test_sample_categorical_never_draws_a_trailing_zero_weight(monkeypatch):
    """u < 1 keeps u * total below any normal float64 total, but a subnormal total absorbs the
    difference: with u the largest double below 1, u * 5e-324 == 5e-324 and no prefix sum exceeds
    it.  The draw must still land on the last token of positive weight, not on the zeros after it,
    on both paths (the torch search and the compiled one)."""

    w = torch.tensor([0.0, 5e-324, 0.0, 5e-324, 0.0, 0.0], dtype=torch.float64)
    u = math.nextafter(1.0, 0.0)
    assert u * 1e-323 == 1e-323 and u * 1.0 < 1.0
    with monkeypatch.context() as m:
        m.setattr(kernels, "loaded", lambda: False)
        m.setattr(torch, "rand", lambda *a, **k: torch.tensor([u], dtype=torch.float64))
        assert sample_categorical(w, None) == 3
        assert sample_categorical(torch.zeros(3), None) == 2  # all zeros: the last index, as before
    if kernels.load():
        assert int(torch.ops.specdec.sample_weights(w, u)) == 3
        assert int(torch.ops.specdec.sample_weights(torch.zeros(3), u)) == 2
        big = torch.zeros(1500, dtype=torch.float64)  # past the search's 512-entry chunks
        big[700] = big[1100] = 5e-324
        assert int(torch.ops.specdec.sample_weights(big, u)) == 1100


def test_a_penalty_state_copy_is_independent():
    state = PenaltyState.start(torch.tensor([0]), 4)
    twin = state.copy()
    twin.append(torch.tensor([3]))
    assert state.seen.tolist() == [True, False, False, False]
    assert state.counts.tolist() == [0.0] * 4 and state.generated == []


def test_min_p_zero_is_no_truncation_bit_for_bit():
    """min_p = 0 keeps every token and must not renormalise: the law equals min_p=None exactly."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3000, generator=gen) * 3
    assert torch.equal(process_logits(logits, SamplingConfig(min_p=0.0)), process_logits(logits, SamplingConfig()))


def test_top_p_widens_past_the_first_candidates_when_their_mass_is_just_below_top_p():
    """The partial sort's first 256 candidates hold 0.8995 < top_p = 0.9: the search must widen,
    and the nucleus is 256 + 4 tokens (the rest have 0.1005 / 744 ~ 1.35e-4 each), as a full sort gives."""
    head = torch.full((256,), 0.8995 / 256, dtype=torch.float64)
    tail = torch.full((744,), 0.1005 / 744, dtype=torch.float64)
    probs = torch.cat([head, tail]).unsqueeze(0)
    keep = _top_p_mask(probs, 0.9)
    assert int(keep.sum()) == 260
    assert bool(keep[0, :256].all())


def test_top_p_full_sort_keeps_the_lowest_ids_among_tied_tokens():
    """A nucleus over more than 4096 tokens is cut from a stable full sort: among 5000 tied tokens
    top_p = 0.9 keeps exactly ids 0..4499 (the same ids for p and q, whatever the sort's threads)."""
    probs = torch.full((1, 5000), 1 / 5000, dtype=torch.float64)
    keep = _top_p_mask(probs, 0.9)
    n = int(keep.sum())
    assert 4499 <= n <= 4501
    assert bool(keep[0, :n].all())


def test_logit_bias_is_added_to_the_logit_not_put_in_its_place():
    """OpenAI semantics: a bias is added (logit 2 + bias 1 = 3), it does not replace the logit."""

    out = penalised_logits(torch.tensor([[1.0, 2.0, 3.0]]), SamplingConfig(logit_bias={1: 1.0}), None)
    assert out.tolist() == [[1.0, 3.0, 3.0]]


def test_a_temperature_below_one_sharpens_the_law():
    """Temperature 0.5 divides the logits by 0.5 (not only temperatures above 1 are applied)."""
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = process_logits(logits, SamplingConfig(temperature=0.5))
    assert torch.allclose(out, torch.softmax(logits / 0.5, -1))


def test_settled_drops_a_stop_floor_once_the_floor_is_reached():
    """At exactly n generated tokens the floor no longer masks anything: settled() returns the inner constraint."""

    assert settled(StopFloor(frozenset({3}), 2, None), [1, 2]) is None


def test_a_stop_floor_asked_about_two_vocabularies_answers_each_at_its_size():
    """One StopFloor masks the target's rows and a draft's smaller vocabulary alike: its cached
    all-True mask must be remade when the vocabulary size changes, not reused at the old size."""
    floor = StopFloor(frozenset({1}), 3)
    assert floor.allowed([], 5).tolist() == [True, False, True, True, True]
    assert floor.allowed([], 3).tolist() == [True, False, True]
    assert floor.allowed([0, 0, 0], 3).tolist() == [True, True, True]  # floor reached: the free mask itself
    assert floor.allowed([0, 0, 0], 5).tolist() == [True] * 5


def test_a_negative_logit_bias_token_id_is_a_config_error():
    """A negative token id in logit_bias is refused when the config is made (one-line ConfigError),
    never indexed from the end of the vocabulary."""
    with pytest.raises(ConfigError, match="logit bias needs token ids >= 0"):
        SamplingConfig(logit_bias=((-1, 1.0),))
    with pytest.raises(ConfigError, match="logit bias needs token ids >= 0"):
        SamplingConfig(logit_bias={-3: -2.0})


def test_rows_up_to_a_draft_token_the_constraint_forbids_are_still_masked():
    """A free draft (prompt lookup) may leave the constraint: the rows up to and including its
    first forbidden token's row are masked as usual, the rows after it are left as they are."""

    class NoTwo:  # token 2 is never allowed
        def allowed(self, generated, vocab_size):
            assert 2 not in generated, "asked about a history the constraint forbids"
            return torch.tensor([True, True, False, True])

    cfg = SamplingConfig(constraint=NoTwo())
    state = PenaltyState.start(torch.tensor([0]), 4)
    out = process_logits(torch.zeros(4, 4), cfg, state, torch.tensor([1, 2, 0]))
    third = 1 / 3
    assert out[0].tolist() == pytest.approx([third, third, 0.0, third])  # history []
    assert out[1].tolist() == pytest.approx([third, third, 0.0, third])  # history [1]: draft token 2 forbidden here
    assert out[2].tolist() == pytest.approx([0.25] * 4)  # below the forbidden token: never kept, left as is
    assert out[3].tolist() == pytest.approx([0.25] * 4)


def test_top_logprobs_asked_for_more_than_the_vocabulary_lists_every_token():
    """The APIs allow up to 20 alternatives; over a smaller vocabulary every token is listed, best
    first, rather than torch.topk failing."""

    logp = torch.log(torch.tensor([[0.5, 0.2, 0.3]], dtype=torch.float64))
    [(chosen, top)] = top_logprobs(logp, torch.tensor([2]), 20)
    assert chosen == pytest.approx(float(logp[0, 2]))
    assert [t for t, _ in top] == [0, 2, 1]
    assert [v for _, v in top] == pytest.approx(logp[0, [0, 2, 1]].tolist())


def test_greedy_logprobs_are_float64_like_the_sampled_ones():
    """target_logprobs is float64 at every temperature: at T = 0 the log-softmax of the biased and
    penalised logits is taken in float64 (a float32 one loses a tail token's digits)."""

    logits = torch.tensor([[0.0, 1.0, -40.0], [2.0, 2.0, 0.5]])
    greedy = target_logprobs(logits, SamplingConfig(temperature=0.0))
    sampled = target_logprobs(logits, SamplingConfig())
    assert greedy.dtype == sampled.dtype == torch.float64
    assert torch.equal(greedy, torch.log_softmax(logits.double(), dim=-1))


@pytest.mark.parametrize("cfg", [SamplingConfig(repetition_penalty=1.1), SamplingConfig(presence_penalty=0.5),
                                 SamplingConfig(constraint=StopFloor(frozenset({0}), 2))])
def test_penalties_or_a_constraint_without_a_penalty_state_is_a_clear_error(cfg):
    """Processing that needs the generated history, called without a PenaltyState, says so (a
    ValueError naming it), not an AttributeError from deep inside the penalties."""

    with pytest.raises(ValueError, match="need a PenaltyState"):
        penalised_logits(torch.zeros(1, 4), cfg, None)
    with pytest.raises(ValueError, match="need a PenaltyState"):
        process_logits(torch.zeros(1, 4), cfg)


def test_min_p_applies_after_top_p_on_the_renormalised_law():
    """top-p then min-p, each on the law the previous step left: p = (.5, .3, .15, .05), top-p 0.9
    keeps three tokens, min-p 0.5 then drops the third (0.15 / 0.95 < 0.5 * 0.5 / 0.95)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    out = process_logits(logits, SamplingConfig(top_p=0.9, min_p=0.5))
    assert out[0].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    assert out[0, 2] == 0.0 and out[0, 3] == 0.0
    only_top_p = process_logits(logits, SamplingConfig(top_p=0.9))
    assert only_top_p[0].tolist() == pytest.approx([0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])


def test_the_temperature_and_repetition_penalty_bounds_are_inclusive():
    """The messages say "between" the documented limits: each limit itself is accepted, a value
    just past it is refused."""

    for t in (defaults.MIN_TEMPERATURE, defaults.MAX_TEMPERATURE):
        assert SamplingConfig(temperature=t).temperature == t
    for r in (defaults.MIN_REPETITION_PENALTY, defaults.MAX_REPETITION_PENALTY):
        assert SamplingConfig(repetition_penalty=r).repetition_penalty == r
    with pytest.raises(ConfigError, match="temperature must be 0"):
        SamplingConfig(temperature=defaults.MAX_TEMPERATURE * 1.001)
    with pytest.raises(ConfigError, match="repetition penalty must be between"):
        SamplingConfig(repetition_penalty=defaults.MIN_REPETITION_PENALTY * 0.999)


def test_with_overrides_ignores_options_left_unset():
    """The command line passes every option, None where the user gave none: those keep the
    config's value (a None temperature or max_new_tokens would be refused), the others replace it."""

    out = with_overrides(GUIDE_PRESET, temperature=None, top_p=None, max_new_tokens=None, top_k=5, seed=0)
    assert (out.temperature, out.top_p, out.max_new_tokens) == (
        GUIDE_PRESET.temperature, GUIDE_PRESET.top_p, GUIDE_PRESET.max_new_tokens)
    assert (out.top_k, out.seed) == (5, 0)


def test_path_masks_keeps_each_paths_mask_in_the_cache_it_is_given():
    """A draft round expands its tree level by level with one cache: a path asked about in an
    earlier call is answered from the cache, the constraint is asked once per path."""

    asked = []

    class Everything:
        def allowed(self, generated, vocab_size):
            asked.append(tuple(generated))
            return torch.ones(vocab_size, dtype=torch.bool)

    cache: dict = {}
    path_masks(Everything(), [7], [[], [1]], 4, cache)
    path_masks(Everything(), [7], [[], [1], [1, 2]], 4, cache)
    assert asked == [(7,), (7, 1), (7, 1, 2)]
    assert set(cache) == {(), (1,), (1, 2)}


def test_sampled_logprobs_are_the_float64_log_of_the_processed_law():
    """At T > 0 the reported log-probability is log(p) taken in float64 of the law sampled from
    (a float32 log cast up loses digits; the tail here is ~1e-30)."""

    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 50, generator=gen) * 8
    cfg = SamplingConfig(temperature=0.7, top_k=40)
    law = process_logits(logits, cfg)
    assert torch.equal(target_logprobs(logits, cfg), law.double().log())


@pytest.mark.parametrize("cfg", [SamplingConfig(temperature=0.0), SamplingConfig(frequency_penalty=0.5),
                                 SamplingConfig(temperature=0.0, presence_penalty=1.0), SamplingConfig(top_p=0.8)])
def test_the_processed_law_keeps_the_logits_dtype(cfg):
    """process_logits returns the logits' dtype whatever the options: a greedy one-hot is float (not
    int64 indices' dtype), and penalty counts do not promote float32 logits to float64."""

    state = PenaltyState.start(torch.tensor([1]), 5)
    state.append(torch.tensor([2, 2]))
    logits = torch.tensor([[0.5, 1.0, 3.0, 0.0, -1.0], [2.0, 0.0, 1.0, 0.5, 0.0]])
    out = process_logits(logits, cfg, state, torch.tensor([3]))
    assert out.dtype == torch.float32
    assert torch.allclose(out.sum(-1), torch.ones(2))
