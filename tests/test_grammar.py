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
