"""The llguidance constraint: a pure function of the history, whatever was asked before (rollback)."""

from __future__ import annotations

import pickle

import pytest
import torch

pytest.importorskip("llguidance")

from transformers import AutoTokenizer  # noqa: E402

from specdec.errors import ConfigError  # noqa: E402
from specdec.grammar import AfterThinking, GrammarConstraint, choice_lark, grammar_for  # noqa: E402
from specdec.models import registry  # noqa: E402
from specdec.models.registry import DATA_DIR  # noqa: E402

V = 49152
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}}, "required": ["a", "b"]}


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))


def test_answers_depend_on_the_history_only(tok):
    doc = tok.encode('{"a":12,"b":"y"}', add_special_tokens=False)
    grammar = grammar_for("json_schema", SCHEMA)
    fresh = [GrammarConstraint(tok, grammar, V).allowed(doc[:k], V) for k in range(len(doc) + 1)]
    shared = GrammarConstraint(tok, grammar, V)
    order = [5, 2, len(doc), 0, 7, 6, 3, len(doc), 1, 4]  # forwards, back (rollback), forwards again
    for k in order:
        assert torch.equal(shared.allowed(doc[:k], V), fresh[k]), k
        # past the end token (a draft may run on after it): only the end, and no harm to later answers
        ended = shared.allowed(doc + [tok.eos_token_id] * 3, V)
        assert ended.nonzero().flatten().tolist() == [tok.eos_token_id]
    assert fresh[0].any() and not fresh[0].all()
    assert fresh[-1].nonzero().flatten().tolist() == [tok.eos_token_id]  # complete: only the end
    with pytest.raises(ConfigError, match="breaks the grammar") as broken:
        shared.allowed(tok.encode("hello", add_special_tokens=False), V)
    assert "\n" not in str(broken.value) and "<state>" not in str(broken.value)  # one line, no matcher dump


def test_a_grammar_the_matcher_gives_up_on_is_refused_up_front_in_one_line(tok, monkeypatch):
    """A regex that compiles but whose lexer runs out of budget on its first token is refused when
    the constraint is made (before any text: a server answers 400, not an error mid-stream), in
    one line; where the matcher gives up only further on (here: the walk ahead turned off), the
    error mid-generation is llguidance's first line, not its state and grammar dump (kilobytes)."""
    grammar = grammar_for("regex", "(a{1000}){1000}")
    with pytest.raises(ConfigError, match="the grammar cannot be followed: its matcher fails on a token it allows .*simplify it") as refused:
        GrammarConstraint(tok, grammar, V)
    messages = [str(refused.value)]
    monkeypatch.setattr("specdec.defaults.GRAMMAR_PROBE_TOKENS", 0)
    constraint = GrammarConstraint(tok, grammar, V)
    a = tok.encode("aaaa", add_special_tokens=False)
    with pytest.raises(ConfigError) as gave_up:
        for k in range(1, 40):
            constraint.allowed(a * k, V)
    messages.append(str(gave_up.value))
    for message in messages:
        assert "\n" not in message and "<state>" not in message and "<grammar>" not in message and len(message) < 300, message


def test_the_walk_ahead_passes_grammars_that_work(tok):
    """Grammars the matcher handles are not refused by the walk ahead, whatever they end with:
    complete after one token, a long repetition, a schema."""
    for kind, spec in (("regex", "[0-9]"), ("regex", "[a-z]{1,500}x"), ("lark", 'start: "yes" | "no"'),
                       ("json_schema", '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}')):
        constraint = GrammarConstraint(tok, grammar_for(kind, spec), V)
        assert constraint.allowed([], V).any(), spec


def test_bad_grammars_are_config_errors(tok):
    with pytest.raises(ConfigError, match="invalid grammar"):
        GrammarConstraint(tok, grammar_for("lark", "start: ("), V)
    digits = GrammarConstraint(tok, grammar_for("regex", "[0-9]+"), V)
    allowed = digits.allowed([], V).nonzero().flatten().tolist()
    assert allowed and all(tok.decode([i]).isdigit() for i in allowed)


def test_specdecs_own_tokenizer_gives_llguidance_the_same_view(tok):
    """specdec's tokenizer hands llguidance its parsed tokenizer.json directly (without building
    transformers' class); every mask must equal the one llguidance makes from transformers'
    tokenizer, along every prefix of answers to a few grammars, and GrammarConstraint's masks
    must be those bits."""
    import llguidance
    import llguidance.hf
    import llguidance.torch

    from specdec.grammar import _tokenizer_info

    own = registry.load_tokenizer(DATA_DIR / "smollm2-135m-draft")
    assert type(own).__name__ == "FastTokenizer"
    views = (_tokenizer_info(own, V), llguidance.hf.from_tokenizer(tok, n_vocab=V))
    cases = [(grammar_for("json_schema", SCHEMA), '{"a":12,"b":"y"}'), (grammar_for("json_object", None), '{"k":[1,{"z":null}]}'),
             (grammar_for("regex", "[A-Z][a-z ]+[.!]"), "Hello there friend."),
             (grammar_for("lark", 'start: "<tool_call>\\n" /[a-z]+/ "\\n</tool_call>"'), "<tool_call>\nabc\n</tool_call>")]
    for grammar, text in cases:
        ids = own.encode(text, add_special_tokens=False)
        masks = []
        for view in views:
            matcher, bits, rows = llguidance.LLMatcher(view, grammar), llguidance.torch.allocate_token_bitmask(1, V), []
            for k in range(len(ids) + 1):
                llguidance.torch.fill_next_token_bitmask(matcher, bits, 0)
                rows.append(bits[0].clone())
                if k < len(ids):
                    assert matcher.consume_token(ids[k]), (text, k)
            assert matcher.is_stopped() or matcher.is_accepting()
            masks.append(torch.stack(rows))
        assert torch.equal(masks[0], masks[1]), text
        # and GrammarConstraint (its own fill, without llguidance.torch) answers with the same bits
        unpacked = ((masks[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().reshape(len(ids) + 1, -1)[:, :V]
        constraint = GrammarConstraint(own, grammar, V)
        assert torch.equal(torch.stack([constraint.allowed(ids[:k], V) for k in range(len(ids) + 1)]), unpacked), text


class _Asked:
    """A stand-in grammar whose mask names the history it was asked about: it allows the one token
    ``7 + len(history)``, and records each history."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def allowed(self, generated, vocab_size):
        self.asked.append(list(generated))
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[7 + len(generated)] = True
        return mask


OPEN_ID, CLOSE_ID = 1, 2
#: (the prompt opened the block, the history) -> what the grammar is asked about (None: not asked,
#: every token allowed), and whether the first token may also open the block
AFTER_THINKING = [
    (False, [], [], True), (False, [5], [5], False), (False, [5, 2, 9], [5, 2, 9], False),  # no block: the grammar's throughout
    (False, [1], None, False), (False, [1, 5, 9], None, False), (False, [1, 1, 5], None, False),  # thinking
    (False, [1, 5, 2], [], False), (False, [1, 5, 2, 9], [9], False), (False, [1, 2, 1, 2], [1, 2], False),  # after it
    (True, [], None, False), (True, [5, 1], None, False), (True, [2], [], False), (True, [5, 2, 9, 2], [9, 2], False),
]


@pytest.mark.parametrize("opened, history, asked, may_open", AFTER_THINKING)
def test_a_grammar_after_thinking_holds_only_past_the_block(opened, history, asked, may_open):
    """AfterThinking: inside the <think> block every token is allowed and the grammar is not asked;
    past the block's closing token the grammar is asked about what follows it alone; an answer
    that never opened a block is the grammar's from its first token, which may open one instead."""

    inner = _Asked()
    mask = AfterThinking(inner, OPEN_ID, CLOSE_ID, opened).allowed(history, 16)
    if asked is None:
        assert bool(mask.all()) and inner.asked == []
        return
    assert inner.asked == [asked]
    expected = {7 + len(asked)} | ({OPEN_ID} if may_open else set())
    assert set(mask.nonzero().flatten().tolist()) == expected


def test_a_json_grammar_after_thinking_through_llguidance(tok):
    """The real grammar engine under AfterThinking, asked in an order that rolls it back: the masks
    past the block equal a fresh matcher's for the answer alone, the first token may be the grammar's
    or the block's, and thinking allows everything (two unused special tokens stand for the tags)."""

    grammar = grammar_for("json_schema", SCHEMA)
    doc = tok.encode('{"a":12,"b":"y"}', add_special_tokens=False)
    fresh = [GrammarConstraint(tok, grammar, V).allowed(doc[:k], V) for k in range(len(doc) + 1)]
    think, done = tok.convert_tokens_to_ids(["<repo_name>", "<reponame>"])
    thought = [think, *tok.encode("Let me see", add_special_tokens=False), done]
    after = AfterThinking(GrammarConstraint(tok, grammar, V), think, done, opened=False)
    first = after.allowed([], V)
    assert bool(first[think]) and torch.equal(first.clone().index_fill_(0, torch.tensor([think]), False), fresh[0])
    for k in [3, len(doc), 0, 5, 1]:
        assert torch.equal(after.allowed(thought + doc[:k], V), fresh[k]), k
        assert bool(after.allowed(thought[:2 + k % 2], V).all())
        if k:  # no block: the grammar's from the first token
            assert torch.equal(after.allowed(doc[:k], V), fresh[k]), k
    opened = AfterThinking(GrammarConstraint(tok, grammar, V), think, done, opened=True)
    assert bool(opened.allowed([], V).all()) and torch.equal(opened.allowed(thought[1:] + doc[:4], V), fresh[4])


def test_ids_past_the_grammars_vocabulary_are_never_allowed(tok):
    """Asked about a larger vocabulary (a padded embedding) than it was made for, the constraint
    allows none of the extra ids, whatever the grammar allows."""
    constraint = GrammarConstraint(tok, grammar_for("json_object", None), V)
    base = constraint.allowed([], V)
    wide = constraint.allowed([], V + 100)
    assert wide.shape == (V + 100,)
    assert torch.equal(wide[:V], base) and not bool(wide[V:].any())


def test_anything_after_the_end_token_allows_only_the_end(tok):
    """A draft may run on past end-of-sequence with other tokens: the sequence has ended wherever
    the end token is in the history, not only when it is the last token, and the matcher is not
    fed it (no error, later answers unharmed)."""
    constraint = GrammarConstraint(tok, grammar_for("json_object", None), V)
    doc = tok.encode("{}", add_special_tokens=False)
    eos = tok.eos_token_id
    fresh = constraint.allowed([], V)
    for tail in ([eos], [eos, doc[0]], [eos, doc[0], doc[-1]]):
        assert constraint.allowed(doc + tail, V).nonzero().flatten().tolist() == [eos], tail
    assert torch.equal(constraint.allowed([], V), fresh)


def _walk(tok, constraint, text):
    """Feed ``text``'s tokens one at a time, each checked against the mask; the final mask."""
    ids = tok.encode(text, add_special_tokens=False)
    for k, t in enumerate(ids):
        assert bool(constraint.allowed(ids[:k], V)[t]), (text, k)
    return constraint.allowed(ids, V)


def test_json_grammars_are_compact_no_whitespace_between_tokens(tok):
    """json_object / json_schema grammars allow no whitespace where JSON would (small models
    spiral into it): after '{"a":' no allowed token starts with whitespace."""
    for kind, spec in (("json_object", None), ("json_schema", {"type": "object", "properties": {"a": {"type": "integer"}}})):
        c = GrammarConstraint(tok, grammar_for(kind, spec), V)
        mask = _walk(tok, c, '{"a":')
        allowed = mask.nonzero().flatten().tolist()
        assert allowed and not any(tok.decode([i])[:1].isspace() for i in allowed if i != tok.eos_token_id), kind


def test_a_choice_list_allows_exactly_its_strings_quotes_and_backslashes_included(tok):
    """choice_lark escapes each string: a choice holding '"' or '\\' is allowed as written, and
    once a choice is complete only the end token may follow; non-ASCII text (an accent, an emoji
    outside the BMP, which an ASCII escape would split into two surrogates) as written too."""
    choices = ['say "hi"', "back\\slash", "plain", "café", "ok 😀"]
    grammar = choice_lark(choices)
    for text in choices:
        end = _walk(tok, GrammarConstraint(tok, grammar, V), text)
        assert end.nonzero().flatten().tolist() == [tok.eos_token_id], text


@pytest.mark.parametrize("bad", [[], ["yes", ""], ["yes", 3]])
def test_a_choice_list_must_hold_non_empty_strings(bad):
    with pytest.raises(ConfigError, match="one or more non-empty strings"):
        choice_lark(bad)


class _Cached:
    """A stand-in inner constraint that answers with one cached mask (as a token filter's or a
    constraint's cache may): the same tensor every time."""

    def __init__(self, vocab_size: int) -> None:
        self.mask = torch.zeros(vocab_size, dtype=torch.bool)
        self.mask[7] = True

    def allowed(self, generated, vocab_size):
        return self.mask


def test_letting_the_first_token_open_the_block_leaves_the_inner_constraints_mask_alone():
    """AfterThinking adds the opening tag to a copy of the inner mask: the inner constraint's own
    (possibly cached) tensor is not changed, so a later answer past the block does not allow it."""
    inner = _Cached(16)
    after = AfterThinking(inner, open_id=1, close_id=2, opened=False)
    first = after.allowed([], 16)
    assert set(first.nonzero().flatten().tolist()) == {1, 7}
    assert inner.mask.nonzero().flatten().tolist() == [7]
    assert after.allowed([1, 5, 2], 16).nonzero().flatten().tolist() == [7]  # past the block: the grammar's alone


def test_the_last_ids_of_a_vocabulary_that_is_not_a_multiple_of_32_can_be_allowed(tmp_path):
    """The bitmask has ceil(V / 32) words: where the vocabulary size is not a multiple of 32 (GPT-2's
    50,257), the ids in the last, partial word are allowed where the grammar allows them.  SmolLM2's
    tokenizer with 20 added tokens (V = 49,172); the grammar allows only the last one."""
    import json
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DATA_DIR / "smollm2-135m-draft" / name, tmp_path / name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["added_tokens"] += [{"id": 49152 + i, "content": f"zqx{i}", "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": False} for i in range(20)]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tok = registry.load_tokenizer(tmp_path)
    V = len(tok)
    assert V == 49172 and V % 32
    mask = GrammarConstraint(tok, grammar_for("regex", "zqx19"), V).allowed([], V)
    assert mask.shape == (V,) and mask.nonzero().flatten().tolist() == [V - 1]


def test_the_walk_ahead_does_not_stop_at_an_end_the_grammar_allows_early(tok):
    """The walk ahead takes the first allowed token other than end-of-sequence: a grammar that may
    end after "x" but whose matcher gives up on what may follow it is still refused up front
    (were the end token taken, the walk would stop at "x" and the failure come mid-generation)."""
    grammar = grammar_for("lark", 'start: "x" | "x" TAIL\nTAIL: /;(a{1000}){1000}/')
    with pytest.raises(ConfigError, match="the grammar cannot be followed"):
        GrammarConstraint(tok, grammar, 49152)


def test_a_history_that_broke_the_grammar_does_not_spoil_later_answers(tok):
    """After a history the grammar refuses (ConfigError), the constraint's answers are still a pure
    function of the history asked about: a valid history longer than what the matcher had consumed
    gets a fresh constraint's mask, not a second 'breaks the grammar'."""
    grammar = grammar_for("json_object", None)
    doc = tok.encode('{"k":[1,2,3]}', add_special_tokens=False)
    shared = GrammarConstraint(tok, grammar, V)
    assert tok.decode(doc[:1]) == '{"'
    shared.allowed(doc[:3], V)
    with pytest.raises(ConfigError, match="breaks the grammar"):  # a raw line break inside the key
        shared.allowed(doc[:1] + tok.encode("\n", add_special_tokens=False), V)
    assert torch.equal(shared.allowed(doc[:5], V), GrammarConstraint(tok, grammar, V).allowed(doc[:5], V))


def test_a_vocabulary_one_larger_than_the_grammars_gets_a_mask_of_its_size(tok):
    """Asked about one id more than the constraint was made for (a padded embedding of V + 1), the
    mask has V + 1 entries and the extra id is not allowed."""

    constraint = GrammarConstraint(tok, grammar_for("json_object", None), V)
    base = constraint.allowed([], V)
    wide = constraint.allowed([], V + 1)
    assert wide.shape == (V + 1,) and torch.equal(wide[:V], base) and not bool(wide[V])


@pytest.mark.parametrize("own", [True, False], ids=["specdec", "transformers"])
def test_a_tokenizer_that_served_a_grammar_still_pickles(tok, own):
    """A tokenizer still pickles after serving a grammar (llguidance's view of it, which does not
    pickle, is cached beside it, not in it), and its copy gives the same masks."""
    from specdec.tokenizer import FastTokenizer, plain_config

    folder = registry.resolve("smollm2-135m-draft").folder
    if own:
        tok = FastTokenizer(folder, plain_config(folder))
    grammar = grammar_for("regex", "[0-9]+")
    before = GrammarConstraint(tok, grammar, V).allowed([], V)
    copied = pickle.loads(pickle.dumps(tok))
    assert copied.encode("12") == tok.encode("12")
    assert torch.equal(GrammarConstraint(copied, grammar, V).allowed([], V), before)


def test_an_engine_error_is_cut_before_its_state_dump():
    """llguidance's error line carries the matcher's ``<state>`` dump after the message: only the
    message is shown (or a generic one where nothing precedes the dump)."""
    from specdec.grammar import _first_line

    assert _first_line("lexer: too many states <state>{\"tokens\": [1, 2]}\nmore") == "lexer: too many states"
    assert _first_line("<state>{}") == "the matcher stopped"
    assert _first_line(None) == "the matcher stopped"


def test_a_regex_parsers_report_is_its_first_line_and_its_error_line():
    """A regex parser's report draws a caret under the pattern between its first line and its
    ``error:`` line: the message keeps the first and the error's cause, on one line."""
    from specdec.grammar import _one_line

    report = "regex parse error:\n    a(\n     ^\nerror: unclosed group\n"
    assert _one_line(report) == "regex parse error: unclosed group"
    assert _one_line("just one line") == "just one line"
    assert _one_line("  \n ") == ""
