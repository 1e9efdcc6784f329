"""The llguidance constraint: a pure function of the history, whatever was asked before (rollback)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("llguidance")

from transformers import AutoTokenizer  # noqa: E402

from specdec.errors import ConfigError  # noqa: E402
from specdec.grammar import GrammarConstraint, grammar_for  # noqa: E402
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
    with pytest.raises(ConfigError, match="breaks the grammar"):
        shared.allowed(tok.encode("hello", add_special_tokens=False), V)


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
    from specdec.models import registry

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
