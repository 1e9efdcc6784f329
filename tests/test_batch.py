"""Batch generation: many prompts by continuous batching, each result exactly what generating
that prompt alone gives (same seed), whatever the batch size and the order prompts finish in."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdec.engine import Engine, EngineConfig
from specdec.errors import ConfigError
from specdec.sampling import SamplingConfig
from tiny import make_tiny
from specdec.batch import seed_for

PROMPTS = ["def add(a, b):", "The weather today", "Once upon a time there was a", "1, 2, 3,",
           "import os\nimport sys\n\ndef main():\n    print(", "Hello", "A list of fruits: apple, pear,"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    target = str(make_tiny(tmp_path_factory.mktemp("target"), seed=0, max_positions=256))
    draft = str(make_tiny(tmp_path_factory.mktemp("draft"), seed=1, layers=1))
    plain = Engine.build(EngineConfig(target=target, draft="none"))
    speculative = Engine.build(EngineConfig(target=target, draft=draft))
    return plain, speculative


CONFIGS = {
    "greedy": SamplingConfig(temperature=0.0, max_new_tokens=20),
    "seeded T=1 (coupled)": SamplingConfig(temperature=1.0, max_new_tokens=20, seed=7),
    "seeded top-p, penalties, stop": SamplingConfig(temperature=0.8, top_p=0.9, repetition_penalty=1.3,
                                                    max_new_tokens=12, seed=11, stop=("?",)),  # see _a_stop_that_ends_some
    "varied lengths": SamplingConfig(temperature=1.0, top_k=20, max_new_tokens=9, seed=2**63 - 3),
}


def _a_stop_that_ends_some(plain, sampling: SamplingConfig, method: str | None) -> SamplingConfig:
    """``sampling`` with a one-character stop string that ends one prompt's text early and leaves
    another's to its length, picked from this CPU's own texts without a stop (a stop string only
    cuts what sampling gives, and the sampled texts differ between CPUs whose float kernels sum in
    another order: a fixed stop string ended none of them on an AVX2 machine)."""
    free = plain.generate_batch(PROMPTS, replace(sampling, stop=()), batch=len(PROMPTS), method=method)
    full = [r.text for r in free if r.finish_reason == "length"]
    for r in free:
        for c in r.text[1:]:
            if c.strip() and any(c not in other for other in full if other != r.text):
                return replace(sampling, stop=(c,))
    raise AssertionError("no character ends one text and not another")


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("batch", [1, 3, 16])
def test_each_result_is_the_prompt_generated_alone(engines, name, batch):
    """Prompt i with seed + i (7 prompts, several finishing early: stop strings, end of sequence)."""
    plain, speculative = engines
    sampling = CONFIGS[name]
    method = "token" if name.startswith("seeded top-p") else None  # a sampling rule that is not coupled
    if sampling.stop:
        sampling = _a_stop_that_ends_some(plain, sampling, method)
    seen: list[int] = []
    got = plain.generate_batch(PROMPTS, sampling, batch=batch, method=method, logprobs=2,
                               on_result=lambda r: seen.append(r.index))
    assert [r.index for r in got] == list(range(len(PROMPTS))) and sorted(seen) == list(range(len(PROMPTS)))
    for i, (prompt, res) in enumerate(zip(PROMPTS, got)):
        seed = None if sampling.seed is None else (sampling.seed + i) % (2**63)
        assert res.seed == (seed if seed is not None else res.seed)
        alone = plain.generate(prompt, replace(sampling, seed=res.seed), method=method, logprobs=2)
        assert res.token_ids == alone.token_ids and res.text == alone.text, (name, i)
        assert res.finish_reason == alone.stats.finish_reason and res.prompt_tokens == alone.stats.prompt_tokens
        assert res.logprobs == alone.logprobs
        if method is None:  # greedy and coupled: the same tokens with a draft, too
            assert speculative.generate(prompt, replace(sampling, seed=res.seed)).token_ids == res.token_ids
    if name == "seeded top-p, penalties, stop":
        assert {r.finish_reason for r in got} >= {"stop", "length"}


def test_without_a_seed_each_prompt_gets_its_own_and_reports_it(engines):
    plain, _ = engines
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=12)
    got = plain.generate_batch(PROMPTS[:4], sampling, batch=4)
    assert len({r.seed for r in got}) == 4
    for prompt, res in zip(PROMPTS, got):
        assert res.method == "block"  # the rule without a seed; with one the default would be coupled
        assert plain.generate(prompt, replace(sampling, seed=res.seed), method=res.method).token_ids == res.token_ids


def test_edges_and_bad_input(engines):
    plain, _ = engines
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    # the first leaves one position of the 256-token context: one token, the one plain decoding gives
    long = plain.generate_batch([[5] * 255, "Hi"], greedy, batch=2)
    assert len(long[0].token_ids) == 1 and long[0].finish_reason == "length" and len(long[1].token_ids) == 8
    assert long[0].token_ids == plain.generate([5] * 255, greedy).token_ids
    assert plain.generate_batch([], greedy) == []
    with pytest.raises(ConfigError, match="prompt 1 is empty"):
        plain.generate_batch(["Hi", []], greedy)
    with pytest.raises(ConfigError, match="batch size"):
        plain.generate_batch(["Hi"], greedy, batch=0)
    with pytest.raises(ConfigError, match="constraint factory"):
        plain.generate_batch(["Hi"], replace(greedy, constraint=object()))
    vocab = plain.target.model.vocab_size
    # token ids are checked before anything is decoded: one past the vocabulary failed inside the
    # model (IndexError) after the prompts before it were decoded and lost; floats were cut to ints
    got = []
    for bad, says in (([vocab], rf"prompt 1: token 0 = {vocab} is outside the vocabulary"),
                      ([-5, 3], "prompt 1: token 0 = -5 is outside the vocabulary"),
                      ([1.7], "prompt 1: token 0 must be an integer id, got 1.7"),
                      (b"hi", "prompt 1 must be text or a list of token ids, got bytes")):
        with pytest.raises(ConfigError, match=says):
            plain.generate_batch(["Hi", bad], greedy, on_result=got.append)
        with pytest.raises(ConfigError, match=says.replace("prompt 1", "the prompt")):
            plain.generate(bad, greedy)
    assert got == []  # refused before the first prompt ran

    assert plain.generate(torch.tensor([5, 6, 7]), greedy).token_ids == plain.generate([5, 6, 7], greedy).token_ids
    for gamma in (2.5, True):
        with pytest.raises(ConfigError, match="gamma must be an integer >= 1"):
            engines[1].generate("Hi", greedy, gamma=gamma)
    for engine in engines:  # a stop id past the vocabulary was accepted and ended nothing
        with pytest.raises(ConfigError, match=rf"stop token ids \[{vocab}\] are outside the vocabulary"):
            engine.generate("Hi", replace(greedy, stop_token_ids=(3, vocab)))
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        plain.generate_batch(["Hi"], replace(greedy, stop_token_ids=(vocab + 7,)))
    assert plain.generate_batch(["Hi"], replace(greedy, stop_token_ids=(vocab - 1,)))[0].token_ids


def test_chat_prompts_go_through_the_template(engines):
    plain, _ = engines
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=6)
    got = plain.generate_batch(["Hi there"], greedy, chat=True)
    assert got[0].token_ids == plain.generate("Hi there", greedy, chat=True).token_ids
    assert got[0].prompt_tokens == len(plain.encode("Hi there", chat=True))


def test_end_of_sequence_ends_a_sequence_where_generating_it_alone_does(engines):
    """Tokens the tiny model does emit are declared end-of-sequence ids, so sequences end early."""
    plain, _ = engines
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=16)
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=16, seed=5)
    fourth = {r.token_ids[3] for s in (greedy, sampled) for r in plain.generate_batch(PROMPTS[:3], s)}
    eos = Engine(replace(plain.target, eos_ids=frozenset(fourth)), None, "none")
    for sampling in (greedy, sampled):
        got = eos.generate_batch(PROMPTS, sampling, batch=3)
        assert "eos" in {r.finish_reason for r in got}
        for i, (prompt, res) in enumerate(zip(PROMPTS, got)):
            alone = eos.generate(prompt, replace(sampling, seed=res.seed))
            assert res.token_ids == alone.token_ids and res.finish_reason == alone.stats.finish_reason, i
        ignored = eos.generate_batch(PROMPTS, sampling, batch=3, ignore_eos=True)
        assert all(len(r.token_ids) == 16 and r.finish_reason == "length" for r in ignored)


def test_a_target_without_batched_passes_runs_one_pass_per_sequence(tmp_path):
    """The Hugging Face backend has no ``forward_batch``: the same loop, each sequence's pass alone."""
    folder = str(make_tiny(tmp_path, seed=3, max_positions=128))
    hf = Engine.build(EngineConfig(target=folder, draft="none", backend="hf"))
    assert not hasattr(hf.target.model, "forward_batch")
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=4)
    got = hf.generate_batch(PROMPTS[:3], sampling, batch=2)
    for i, (prompt, res) in enumerate(zip(PROMPTS, got)):
        assert res.token_ids == hf.generate(prompt, replace(sampling, seed=4 + i)).token_ids, i


FOUR_PROMPTS = ["def add(a, b):", "The weather today", "Once upon a time there was a", "Hello"]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return Engine.build(EngineConfig(target=str(make_tiny(tmp_path_factory.mktemp("t"), seed=0, max_positions=128)),
                                     draft="none"))


def _same_as_alone(engine, prompts, sampling, **kw):
    got = engine.generate_batch(prompts, sampling, batch=2, **kw)
    for p, res in zip(prompts, got):
        alone = engine.generate(p, replace(sampling, seed=res.seed), **kw)
        assert (res.token_ids, res.text, res.finish_reason) == (alone.token_ids, alone.text, alone.stats.finish_reason), p
        if "logprobs" in kw:
            assert res.logprobs == alone.logprobs and len(res.logprobs) == len(res.token_ids)
    return got


def test_stop_token_ids_end_a_sequence_where_generating_it_alone_does(plain):
    """A stop token id (not the model's end of sequence) ends the sequence there, as alone."""
    free = plain.generate_batch(FOUR_PROMPTS, GREEDY)
    stop = free[0].token_ids[2]
    got = _same_as_alone(plain, FOUR_PROMPTS, replace(GREEDY, stop_token_ids=(stop,)))
    assert len(got[0].token_ids) <= 3 and got[0].token_ids[-1] == stop and got[0].finish_reason != "length"


def test_min_tokens_masks_the_stop_ids_while_too_few_were_generated(plain):
    free = plain.generate_batch(FOUR_PROMPTS, GREEDY)
    stop = free[0].token_ids[0]  # would end prompt 0 at once
    got = _same_as_alone(plain, FOUR_PROMPTS, replace(GREEDY, stop_token_ids=(stop,), min_tokens=3))
    assert len(got[0].token_ids) >= 3 and stop not in got[0].token_ids[:3]


def test_a_stop_string_cuts_tokens_and_their_log_probabilities_alike(plain):
    """Stop strings drop the tokens past the stop; the log-probabilities drop the same ones."""
    free = plain.generate_batch(FOUR_PROMPTS, GREEDY)
    c = next(ch for ch in free[0].text[1:] if ch.strip())
    got = _same_as_alone(plain, FOUR_PROMPTS, replace(GREEDY, stop=(c,)), logprobs=1)
    assert got[0].finish_reason == "stop"


def _pass_sizes(engine, batch: int) -> list[int]:  # how many sequences each batched pass held
    model = engine.target.model
    sizes = []
    real = model.forward_batch
    model.forward_batch = lambda items, *a, **k: (sizes.append(len(items)), real(items, *a, **k))[1]
    try:
        engine.generate_batch(FOUR_PROMPTS, GREEDY, batch=batch)
    finally:
        del model.forward_batch
    return sizes


def test_no_pass_holds_more_than_batch_sequences(plain):
    assert max(_pass_sizes(plain, 3)) == 3


def test_every_finished_sequence_is_closed_and_handed_to_a_target_that_keeps_them(plain):
    """A target with ``keep_sequence`` (a prefix cache) gets each finished sequence, as the decoder gives it."""
    model = plain.target.model
    kept = []
    model.keep_sequence = lambda ids, cache: kept.append(ids.tolist())
    try:
        got = plain.generate_batch(FOUR_PROMPTS, GREEDY, batch=2)
    finally:
        del model.keep_sequence
    assert len(kept) == len(FOUR_PROMPTS)
    assert sorted(kept) == sorted((plain.encode(p, chat=False) + r.token_ids)[:-1] for p, r in zip(FOUR_PROMPTS, got))


class _Only:
    """A constraint: only the token ids in ``ids`` may come next."""

    made = 0

    def __init__(self, ids):
        self.ids = list(ids)
        _Only.made += 1

    def allowed(self, generated, vocab_size):
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.ids] = True
        return mask


def test_a_constraint_factory_gives_each_sequence_its_own_constraint_and_it_is_applied(plain):
    _Only.made = 0
    got = plain.generate_batch(FOUR_PROMPTS, GREEDY, constraint=lambda: _Only([5, 6, 7]))
    assert _Only.made == len(FOUR_PROMPTS)
    assert all(set(r.token_ids) <= {5, 6, 7} for r in got)


def test_an_empty_first_prompt_is_refused(plain):
    with pytest.raises(ConfigError, match="prompt 0 is empty"):
        plain.generate_batch([[], "Hi"], GREEDY)


def test_end_of_sequence_text_is_left_out_where_special_tokens_are_kept(plain):
    """With ``skip_special_tokens=False`` an end-of-sequence token ends the output and its text is
    left out of the reply, as generating the prompt alone does."""
    free = plain.generate_batch(FOUR_PROMPTS, GREEDY)
    eos = Engine(replace(plain.target, eos_ids=frozenset({free[0].token_ids[2]})), None, "none")
    got = _same_as_alone(eos, FOUR_PROMPTS, replace(GREEDY, skip_special_tokens=False))
    assert got[0].finish_reason == "eos"


def test_ignore_eos_still_stops_at_stop_token_ids(plain):
    """``ignore_eos`` drops the model's end-of-sequence ids only: a stop token id still ends the
    sequence where generating the prompt alone (with ``ignore_eos``) ends it."""
    free = plain.generate_batch(FOUR_PROMPTS, GREEDY)
    stop = free[0].token_ids[2]
    sampling = replace(GREEDY, stop_token_ids=(stop,))
    got = plain.generate_batch(FOUR_PROMPTS, sampling, batch=2, ignore_eos=True)
    for p, res in zip(FOUR_PROMPTS, got):
        alone = plain.generate(p, sampling, ignore_eos=True)
        assert (res.token_ids, res.finish_reason) == (alone.token_ids, alone.stats.finish_reason), p
    assert len(got[0].token_ids) <= 3 and got[0].token_ids[-1] == stop and got[0].finish_reason == "eos"


def test_ignore_eos_with_special_tokens_kept_shows_the_eos_text_as_alone(plain):
    """With ``ignore_eos`` an end-of-sequence token is ordinary output: where special tokens are
    kept its text is in the reply, as generating the prompt alone gives it."""
    free = plain.generate_batch(FOUR_PROMPTS, GREEDY)
    eos_tok = free[0].token_ids[2]
    eos = Engine(replace(plain.target, eos_ids=frozenset({eos_tok})), None, "none")
    sampling = replace(GREEDY, skip_special_tokens=False)
    got = eos.generate_batch(FOUR_PROMPTS, sampling, batch=2, ignore_eos=True)
    for p, res in zip(FOUR_PROMPTS, got):
        alone = eos.generate(p, sampling, ignore_eos=True)
        assert (res.token_ids, res.text) == (alone.token_ids, alone.text), p
    assert eos_tok in got[0].token_ids and got[0].finish_reason == "length"


def test_seed_for_wraps_into_the_seed_range():
    """Prompt i's seed is seed + i wrapped into the seed range (as ``offset_seed``): the last seed
    plus one is 0, so ``--seed`` on the command line reproduces it."""
    top = SamplingConfig(seed=2**63 - 1)
    assert seed_for(top, 0) == 2**63 - 1
    assert seed_for(top, 1) == 0 and seed_for(top, 3) == 2


def test_each_result_reports_the_rule_generating_alone_would_use(plain):
    """Without ``method`` each result names the engine's default rule for its sampling (greedy at
    T = 0, coupled with a seed), so ``--method`` from the result reproduces it."""
    from specdec.engine import default_method

    for sampling in (GREEDY, SamplingConfig(temperature=1.0, max_new_tokens=4, seed=3)):
        got = plain.generate_batch(FOUR_PROMPTS[:2], sampling)
        assert [r.method for r in got] == [default_method(sampling)] * 2


def test_free_slots_are_filled_at_once(plain):
    """Continuous batching: with ``batch`` >= the number of prompts every prompt is admitted before
    the first pass, so the first pass holds all of them."""
    assert _pass_sizes(plain, 4)[0] == 4
