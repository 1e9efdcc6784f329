"""vLLM's allowed_token_ids and bad_words (:mod:`specdec.token_filter`).

The masks are checked directly, then through the decoder: the law tests draw N = 8,000
independent generations (seed = sample index) of 3 new tokens from the 4-token order-2 toy target
of ``test_decoder.py`` (64 possible outputs) and run a chi-square goodness-of-fit test, failing at
p < 1e-4, against a law enumerated by hand from the target's logits and the filter's rules as
written here (not through the filter itself).
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters import ModelDrafter
from specdec.drafters.tree_builder import TreeSpec
from specdec.errors import ConfigError
from specdec.gamma import FixedGamma
from specdec.models.toy import ToyLM
from specdec.sampling import SamplingConfig, StopFloor
from specdec.token_filter import MAX_BAD_WORDS, TokenFilter, bad_word_ids, constraint_factory
from specdec.verify import get_rule
from stats import ALPHA, chi_square_pvalue

N_SAMPLES = 8_000
N_NEW = 3
PROMPT = [1, 2]  # ends with 2: a filter that looked at the prompt would ban 1 at the first position
TARGET = ToyLM(4, order=2, seed=0)
DRAFT = TARGET.perturbed(1.0, seed=1)
ALLOWED = (0, 1, 2)
BANNED = ((2, 1), (1, 1), (0, 2, 0), (3, 0))  # (3, 0) can never start: 3 is not allowed


def _oracle_law() -> dict[tuple[int, ...], float]:
    """The filtered target's law, from the rules in words: 3 never; 1 never after 2 or 1; 0 never after 0, 2."""
    law = {}
    for seq in itertools.product(range(4), repeat=N_NEW):
        p = 1.0
        for i in range(N_NEW):
            gen = seq[:i]
            ok = [t in ALLOWED for t in range(4)]
            if gen and gen[-1] in (1, 2):
                ok[1] = False
            if gen[-2:] == (0, 2):
                ok[0] = False
            logits = TARGET.logits_for(PROMPT + list(gen)).double()
            weights = [math.exp(float(logits[t])) if ok[t] else 0.0 for t in range(4)]
            p *= weights[seq[i]] / sum(weights)
        if p > 0:
            law[seq] = p
    return law


def test_masks_follow_the_rules():
    f = TokenFilter(4, allowed_ids=ALLOWED, banned=BANNED)
    rows = {(): [1, 1, 1, 0], (2,): [1, 0, 1, 0], (1,): [1, 0, 1, 0], (0,): [1, 1, 1, 0], (0, 2): [0, 0, 1, 0],
            (1, 0, 2): [0, 0, 1, 0], (2, 0): [1, 1, 1, 0]}
    for generated, want in rows.items():
        assert f.allowed(list(generated), 4).tolist() == [bool(w) for w in want], generated
    # one-token words are never allowed; ids the model cannot produce are ignored
    g = TokenFilter(5, banned=((3,), (7,), (9, 9)))
    assert g.allowed([], 5).tolist() == [True, True, True, False, True]


def test_the_narrower_wishes_give_way_when_nothing_is_left():
    f = TokenFilter(4, allowed_ids=(1, 2), banned=((1, 1), (1, 2)))
    assert f.allowed([1], 4).tolist() == [False, True, True, False]  # the bad words give way
    assert f.allowed([2], 4).tolist() == [False, True, True, False]

    class OnlyThree:
        def allowed(self, generated, vocab_size):
            return torch.tensor([False, False, False, True])

    over = f.over(OnlyThree())
    assert over.allowed([], 4).tolist() == [False, False, False, True]  # the inner constraint holds
    assert f.allowed([], 4).tolist() == [False, True, True, False]  # the twin left the original alone
    # composed: a stop floor over the filter over a grammar
    floor = StopFloor(frozenset({2}), 3, TokenFilter(4, banned=((0, 1),)))
    assert floor.allowed([0], 4).tolist() == [True, False, False, True]
    assert floor.allowed([0, 0, 0], 4).tolist() == [True, False, True, True]


def test_bad_input_is_refused():
    with pytest.raises(ConfigError, match="must not be empty"):
        TokenFilter(4, allowed_ids=())
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        TokenFilter(4, allowed_ids=(1, 4))
    with pytest.raises(ConfigError, match="ban every allowed token"):
        TokenFilter(4, allowed_ids=(1,), banned=((1,),))
    with pytest.raises(ConfigError, match=">= 0"):
        TokenFilter(banned=((1, -2),))
    lazy = TokenFilter(allowed_ids=(1, 6))  # no vocabulary yet: masks made for each size asked about
    assert lazy.allowed([], 4).tolist() == [False, True, False, False]
    assert lazy.allowed([], 7).tolist() == [False, True] + [False] * 4 + [True]
    with pytest.raises(ConfigError, match="no allowed token id is inside"):
        TokenFilter(allowed_ids=(5,)).allowed([], 4)


def test_bad_words_are_banned_as_written_and_after_a_space():
    from specdec.tokenizer import FastTokenizer, plain_config

    folder = Path(__file__).resolve().parents[1] / "src" / "specdec" / "data" / "smollm2-135m-draft"
    tok = FastTokenizer.load(folder, plain_config(folder))
    seqs = bad_word_ids(tok, ["Paris", "  Paris", "unbelievable"])
    assert (tok.encode("Paris", add_special_tokens=False) in [list(s) for s in seqs]
            and tok.encode(" Paris", add_special_tokens=False) in [list(s) for s in seqs])
    assert len(seqs) == len(set(seqs)) == 4  # "  Paris" is "Paris" again
    assert any(len(s) > 1 for s in seqs)
    with pytest.raises(ConfigError, match="white space"):
        bad_word_ids(tok, [" "])


@pytest.mark.parametrize("method", ["token", "block", "coupled"])
def test_output_law_is_the_filtered_targets(method):
    cfg = SamplingConfig(temperature=1.0, constraint=TokenFilter(4, allowed_ids=ALLOWED, banned=BANNED))
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), get_rule(method), gamma=FixedGamma(2))
    out = [tuple(dec.generate(PROMPT, SamplingConfig(**{**cfg.__dict__, "seed": i, "max_new_tokens": N_NEW})).tokens)
           for i in range(N_SAMPLES)]
    assert chi_square_pvalue(out, _oracle_law()) > ALPHA


@pytest.mark.parametrize("method", ["token", "block"])
def test_tree_output_law_is_the_filtered_targets(method):
    spec = TreeSpec(sample_branching=(2, 2, 1), sample_width=2, sibling_stop=0.0, sample_expand=0.0)
    cfg = SamplingConfig(temperature=1.0, constraint=TokenFilter(4, allowed_ids=ALLOWED, banned=BANNED))
    dec = SpeculativeDecoder(TARGET, ModelDrafter(DRAFT), get_rule(method), gamma=FixedGamma(6), tree=spec)
    out, trees = [], 0
    for i in range(N_SAMPLES // 2):
        res = dec.generate(PROMPT, SamplingConfig(**{**cfg.__dict__, "seed": i, "max_new_tokens": N_NEW}))
        out.append(tuple(res.tokens))
        trees += res.stats.tree_rounds
    assert trees > 0
    assert chi_square_pvalue(out, _oracle_law()) > ALPHA


def _obeys(tokens: list[int], allowed: set[int], banned: tuple[tuple[int, ...], ...]) -> bool:
    return set(tokens) <= allowed and not any(tuple(tokens[i:i + len(b)]) == b for b in banned for i in range(len(tokens)))


@pytest.mark.parametrize(("allowed", "banned"), [
    ((0, 1, 2, 3, 5), ((5,), (1, 2), (2, 3, 1))),
    (None, ((4,), (2, 1), (0, 3, 2))),  # each of these occurs in the unfiltered outputs
    (None, ((2, 1), (3, 5, 0))),  # no one-token ban: the multi-token ones alone change the outputs
])
def test_greedy_speculation_equals_plain_greedy_under_the_filter(allowed, banned):
    target = ToyLM(6, order=3, seed=7)
    draft = target.perturbed(0.8, seed=8)
    f = TokenFilter(6, allowed_ids=allowed, banned=banned)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=40, constraint=f)
    changed = 0
    for prompt in ([1], [2, 3, 4], [5, 5, 0, 1]):
        plain = SpeculativeDecoder(target, None, get_rule("greedy"))
        ref = plain.generate(prompt, cfg).tokens
        free = plain.generate(prompt, SamplingConfig(temperature=0.0, max_new_tokens=40)).tokens
        assert _obeys(ref, set(allowed or range(6)), banned)
        changed += ref != free
        for gamma in (1, 3, 6):
            for method in ("greedy", "block"):
                dec = SpeculativeDecoder(target, ModelDrafter(draft), get_rule(method), gamma=FixedGamma(gamma))
                assert dec.generate(prompt, cfg).tokens == ref
    assert changed == 3


def test_one_token_bad_words_give_way_too_when_nothing_is_left():
    """Where the masks leave nothing, *all* the bad words give way (one-token words included),
    before the allowed ids do; an inner constraint still holds."""
    f = TokenFilter(4, allowed_ids=(1, 2, 3), banned=((3,), (1, 1), (1, 2)))
    assert f.allowed([], 4).tolist() == [False, True, True, False]  # 3 is a bad word
    assert f.allowed([1], 4).tolist() == [False, True, True, True]  # nothing left: the bad words give way

    class NotZero:
        def allowed(self, generated, vocab_size):
            return torch.tensor([False, True, True, True])

    assert f.over(NotZero()).allowed([1], 4).tolist() == [False, True, True, True]


class _OneIdPerWord:
    """A stand-in tokenizer: each distinct text is its own id; with ``add_special_tokens`` (the
    default of a Hugging Face tokenizer) it puts a BOS id 99 first, as Llama's tokenizers do."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, text, add_special_tokens=True):
        ids = [self.ids.setdefault(text, len(self.ids))]
        return [99, *ids] if add_special_tokens else ids


def test_exactly_max_bad_words_are_accepted():
    """The limit is inclusive: MAX_BAD_WORDS words are fine, one more is refused."""
    words = [f"w{i}" for i in range(MAX_BAD_WORDS)]
    assert len(bad_word_ids(_OneIdPerWord(), words)) == 2 * MAX_BAD_WORDS
    with pytest.raises(ConfigError, match="at most"):
        bad_word_ids(_OneIdPerWord(), [*words, "one more"])


def test_a_one_token_bad_word_past_a_smaller_vocabulary_is_ignored():
    """A one-token word whose id equals the vocabulary asked about cannot be sampled there: no ban, no IndexError."""
    f = TokenFilter(banned=((4,), (1,)))
    assert f.allowed([], 4).tolist() == [True, False, True, True]


def test_a_filter_over_a_grammar_keeps_the_grammar():
    """allowed_token_ids together with a grammar: each sequence's constraint is the filter over its
    own grammar, so a filter that allows every id leaves exactly the grammar's mask."""
    pytest.importorskip("llguidance")
    from transformers import AutoTokenizer

    from specdec.grammar import GrammarConstraint, grammar_for
    from specdec.models.registry import DATA_DIR

    tok = AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))
    vocab = 49152
    grammar = grammar_for("json_object", None)
    make = constraint_factory(tok, vocab, grammar=grammar, allowed_ids=range(vocab))
    want = GrammarConstraint(tok, grammar, vocab).allowed([], vocab)
    assert not bool(want.all())
    assert torch.equal(make().allowed([], vocab), want)


def test_without_an_inner_constraint_a_bad_word_gives_way_to_the_allowed_ids():
    """Only id 2 is allowed and the bad word [1, 2] bans it after 1: with no grammar underneath,
    the bad word gives way and the allowed ids' mask is returned (not an error, not an empty row)."""
    f = TokenFilter(5, allowed_ids=[2], banned=[[1, 2]])
    assert f.allowed([1], 5).tolist() == [False, False, True, False, False]


def test_a_bad_word_ending_in_the_last_id_of_the_vocabulary_is_banned():
    """The last id (vocab_size - 1) is inside the vocabulary: [1, 4] bans 4 right after 1 when V = 5."""
    f = TokenFilter(5, banned=[[1, 4]])
    assert f.allowed([1], 5).tolist() == [True, True, True, True, False]


def test_an_allowed_id_equal_to_a_smaller_vocabulary_is_ignored():
    """A filter built without a vocabulary is asked about each size: an allowed id equal to the size
    asked about (one past its last id) cannot be sampled there -- ignored, no IndexError."""
    f = TokenFilter(allowed_ids=(1, 4))
    assert f.allowed([], 4).tolist() == [False, True, False, False]
    assert f.allowed([], 5).tolist() == [False, True, False, False, True]


def test_a_multi_token_bad_word_ending_at_the_vocabulary_size_is_ignored():
    """[1, 5] bans id 5 after 1; a vocabulary of 5 has no id 5, so nothing is banned (no IndexError)."""
    f = TokenFilter(banned=[[1, 5]])
    assert f.allowed([1], 5).tolist() == [True] * 5
    assert f.allowed([1], 6).tolist() == [True] * 5 + [False]


def test_the_id_minus_one_is_refused():
    """Every negative id is refused, -1 included (the edge of ``t < 0``)."""
    with pytest.raises(ConfigError, match=">= 0"):
        TokenFilter(4, allowed_ids=(-1, 2))
    with pytest.raises(ConfigError, match=">= 0"):
        TokenFilter(4, banned=((-1,),))


def test_a_bad_word_of_tabs_and_newlines_only_is_refused():
    """"White space" is any white space, not only the spaces that are stripped from the front."""
    for word in ("\n", "\t", " \t\n "):
        with pytest.raises(ConfigError, match="white space"):
            bad_word_ids(_OneIdPerWord(), [word])


def test_bad_words_are_encoded_without_special_tokens():
    """A tokenizer that puts BOS first by default must not make every bad word start with BOS
    (then no generated text would ever complete it)."""
    tok = _OneIdPerWord()
    seqs = bad_word_ids(tok, ["foo"])
    assert seqs == ((tok.ids["foo"],), (tok.ids[" foo"],))


def test_bad_words_alone_make_a_filter():
    """constraint_factory with bad words and neither allowed ids nor a grammar still returns a
    constraint, and it bans the words."""
    tok = _OneIdPerWord()
    make = constraint_factory(tok, 4, bad_words=["a"])  # "a" -> 0, " a" -> 1
    assert make is not None
    assert make().allowed([], 4).tolist() == [False, False, True, True]
    assert constraint_factory(tok, 4) is None


def test_a_factory_grammar_after_thinking_lets_the_block_open():
    """constraint_factory passes ``after_thinking`` on: the first token may open the thinking block
    (the grammar alone would forbid it), and the filter still holds on top."""
    pytest.importorskip("llguidance")
    from transformers import AutoTokenizer

    from specdec.grammar import grammar_for
    from specdec.models.registry import DATA_DIR

    tok = AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))
    vocab = 49152
    think, done = tok.convert_tokens_to_ids(["<repo_name>", "<reponame>"])
    grammar = grammar_for("json_object", None)
    alone = constraint_factory(tok, vocab, grammar=grammar)().allowed([], vocab)
    assert not bool(alone[think])
    make = constraint_factory(tok, vocab, grammar=grammar, after_thinking=(think, done, False))
    assert bool(make().allowed([], vocab)[think])
    inside = constraint_factory(tok, vocab, grammar=grammar, after_thinking=(think, done, True),
                                allowed_ids=[think, done, 5])
    assert inside().allowed([], vocab).nonzero().flatten().tolist() == sorted([think, done, 5])


class _AllIds:
    """An inner constraint (a grammar) that allows every id."""

    def allowed(self, generated, vocab_size):
        return torch.ones(vocab_size, dtype=torch.bool)


def test_over_a_grammar_a_bad_word_that_gives_way_leaves_the_allowed_ids_not_the_whole_grammar():
    """Allowed (1, 2); after 1 the bad words [1, 1] and [1, 2] ban both: the bad words give way,
    but the allowed ids still hold under a grammar that allows everything (only the allowed ids
    give way to the grammar, and only where nothing of them is left)."""
    f = TokenFilter(4, allowed_ids=(1, 2), banned=((1, 1), (1, 2))).over(_AllIds())
    assert f.allowed([1], 4).tolist() == [False, True, True, False]


def test_a_factory_with_an_empty_allowed_id_list_is_refused():
    """``allowed_token_ids=[]`` is an error (vLLM's too), not "no filter": nothing could be sampled."""
    with pytest.raises(ConfigError, match="must not be empty"):
        constraint_factory(_OneIdPerWordTok(), 4, allowed_ids=[])


class _OneIdPerWordTok:
    def __init__(self) -> None:
        self.ids: dict[str, int] = {}

    def encode(self, text, add_special_tokens=True):
        return [self.ids.setdefault(text, len(self.ids))]


def test_a_bad_word_keeps_its_trailing_spaces():
    """Only leading spaces are dropped: "foo " is tokenized as "foo " and " foo ", not as "foo"."""
    tok = _OneIdPerWordTok()
    seqs = bad_word_ids(tok, ["foo "])
    assert set(tok.ids) == {"foo ", " foo "}
    assert seqs == ((tok.ids["foo "],), (tok.ids[" foo "],))
