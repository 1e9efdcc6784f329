"""Fill-in-the-middle prompts (``specdec.fim``): the style read off the tokenizer, the prompt's ids."""

from __future__ import annotations

import pytest

from specdec import fim
from specdec.errors import ConfigError


@pytest.fixture
def tok():
    from transformers import AutoTokenizer

    from specdec.models.registry import DATA_DIR

    return AutoTokenizer.from_pretrained(str(DATA_DIR / "smollm2-135m-draft"))


@pytest.mark.parametrize("style", fim.STYLES, ids=lambda s: s.name)
def test_the_prompt_is_prefix_suffix_middle_in_the_models_own_tokens(tok, style):
    """Each style's markers as added tokens: the prompt is marker, prefix, marker, suffix, marker,
    each part encoded alone; the ends the tokenizer has are its stop tokens."""
    assert fim.style_of(tok) is None
    tok.add_tokens([style.prefix, style.suffix, style.middle, *style.ends[:1]], special_tokens=True)
    assert fim.style_of(tok) == style
    ids = {name: tok.convert_tokens_to_ids(name) for name in (style.prefix, style.suffix, style.middle)}
    before, after = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    expected = [ids[style.prefix], *enc(before), ids[style.suffix], *enc(after), ids[style.middle]]
    assert fim.prompt_ids(tok, before, after) == expected
    assert fim.prompt_ids(tok, enc(before), after) == expected  # a prefix given as ids
    assert fim.prompt_ids(tok, "", after) == [ids[style.prefix], ids[style.suffix], *enc(after), ids[style.middle]]
    ends = fim.end_ids(tok, style)  # SmolLM2's tokenizer has <|endoftext|> and <file_sep> already
    assert tok.convert_tokens_to_ids(style.ends[0]) in ends and {tok.convert_ids_to_tokens(i) for i in ends} <= set(style.ends)
    with pytest.raises(ConfigError, match="empty"):
        fim.prompt_ids(tok, "", "")
    # at most k tokens: the prefix loses its first tokens (the code farthest from the gap), never a
    # marker nor the suffix; a suffix too long for k is an error
    fixed = len(enc(after)) + 3
    for k in (fixed, fixed + 2, len(expected), len(expected) + 5):
        cut = fim.prompt_ids(tok, before, after, at_most=k)
        assert cut == [expected[0], *enc(before)[len(expected) - min(k, len(expected)):], *expected[-fixed + 1:]]
        assert len(cut) == min(k, len(expected))
    with pytest.raises(ConfigError, match="suffix and the markers alone take"):
        fim.prompt_ids(tok, before, after, at_most=fixed - 1)


def test_a_model_without_the_markers_is_a_clear_error(tok):
    tok.add_tokens(["<|fim_prefix|>", "<|fim_suffix|>"])  # two of three: not a style
    assert fim.style_of(tok) is None
    with pytest.raises(ConfigError, match="no fill-in-the-middle tokens"):
        fim.prompt_ids(tok, "a", "b")


def test_tokenizer_files_without_any_styles_markers_are_told_apart_before_a_load(tmp_path):
    """``absent_from`` says absent for the bundled draft's files (no style complete there, and the
    loaded tokenizer has none), and never where the markers are written, raw or escaped as JSON
    escapes them (DeepSeek's are not ASCII), so a tokenizer with a style is never refused."""
    import json

    from tiny import draft_renaming

    from specdec.models.registry import DATA_DIR, load_tokenizer

    draft = DATA_DIR / "smollm2-135m-draft"
    files = [draft / n for n in ("tokenizer.json", "tokenizer_config.json")]
    assert fim.absent_from(files) and fim.style_of(load_tokenizer(draft)) is None
    renamed = draft_renaming(tmp_path / "qwen", {"<repo_name>": "<|fim_prefix|>", "<reponame>": "<|fim_suffix|>",
                                                 "<file_sep>": "<|fim_middle|>"})
    assert not fim.absent_from([renamed / "tokenizer.json"])
    assert fim.style_of(load_tokenizer(renamed)) is not None
    deepseek = fim.STYLES[2]
    escaped = tmp_path / "tokenizer.json"
    escaped.write_text(json.dumps({"added_tokens": [{"content": m} for m in (deepseek.prefix, deepseek.suffix, deepseek.middle)]}))
    assert "\\u" in escaped.read_text() and not fim.absent_from([escaped])
    assert not fim.absent_from([tmp_path / "missing.json"])  # unreadable: "maybe", left to the load


def test_a_suffix_on_a_model_without_markers_fails_before_it_loads(tmp_path, monkeypatch, capsys):
    """``generate --suffix`` and a prompts file's suffix lines on such a model: the one-line error
    before any model loads."""
    from specdec.cli import main
    from specdec.engine import Engine

    monkeypatch.setattr(Engine, "build", classmethod(lambda cls, *a, **k: pytest.fail("a model loaded")))
    assert main(["generate", "-p", "def f(", "--suffix", ")", "--target", "smollm2-135m-draft", "-n", "4"]) == 2
    assert "no fill-in-the-middle tokens" in capsys.readouterr().err
    lines = tmp_path / "prompts.jsonl"
    lines.write_text('"plain"\n{"prompt": "def f(", "suffix": ")"}\n')
    assert main(["generate", "--prompts-file", str(lines), "--target", "smollm2-135m-draft", "-n", "4"]) == 2
    assert "no fill-in-the-middle tokens" in capsys.readouterr().err


#: (style, the markers in prompt order: before the prefix, before the suffix, before the middle, the ends)
LAYOUTS = {
    "qwen": (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
             {"<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|file_separator|>", "<|endoftext|>"}),
    "starcoder": (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), {"<fim_pad>", "<file_sep>", "<|endoftext|>"}),
    "deepseek": (("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"), {"<｜end▁of▁sentence｜>"}),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_each_family_gets_its_own_marker_layout_and_ends(tok, name):
    """Prefix after the family's first marker, suffix after its second (DeepSeek: the hole), the
    middle generated after its third (DeepSeek: end); every end token the tokenizer has stops it."""
    (pre, suf, mid), ends = LAYOUTS[name]
    tok.add_tokens([pre, suf, mid, *sorted(ends)], special_tokens=True)
    style = fim.style_of(tok)
    assert style is not None and style.name == name
    ids = fim.prompt_ids(tok, "x = 1", "y = 2")
    tokens = tok.convert_ids_to_tokens(ids)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert tokens[0] == pre and tokens[-1] == mid
    assert ids == [ids[0], *enc("x = 1"), tok.convert_tokens_to_ids(suf), *enc("y = 2"), ids[-1]]
    assert {tok.convert_ids_to_tokens(i) for i in fim.end_ids(tok, style)} == ends
    assert set(fim.stop_ids(tok, style, (7,))) == {7, *fim.end_ids(tok, style)}


def test_tokenizer_files_with_only_part_of_a_style_are_told_apart_before_a_load(tmp_path):
    """Two of a style's three markers written (and one of another's): no style is complete, so the
    loaded tokenizer would have none and a suffix is refused before the load."""
    import json

    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"added_tokens": [{"content": m} for m in ("<|fim_prefix|>", "<|fim_suffix|>", "<fim_middle>")]}))
    assert fim.absent_from([path])


class _BosTokenizer:
    """A tokenizer that puts a BOS (id 1) in front unless told not to, as DeepSeek-Coder's does."""

    def get_added_vocab(self) -> dict[str, int]:
        return {"<｜fim▁begin｜>": 100, "<｜fim▁hole｜>": 101, "<｜fim▁end｜>": 102, "<｜end▁of▁sentence｜>": 103}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_each_part_is_encoded_without_the_tokenizers_special_tokens():
    """A tokenizer that adds a BOS: no BOS inside the prompt, before the prefix nor the suffix."""
    assert fim.prompt_ids(_BosTokenizer(), "ab", "c") == [100, 97, 98, 101, 99, 102]


def test_generate_suffix_keeps_the_given_stop_tokens_beside_the_style_ends():
    """``fill_request`` (``generate --suffix``, locally or at the edge): the sampling's own stop
    tokens stay, the style's ends join them, and the prompt is the style's layout."""
    from specdec.sampling import SamplingConfig

    ids, sampling = fim.fill_request(_BosTokenizer(), "ab", "c", SamplingConfig(stop_token_ids=(7,)))
    assert ids == [100, 97, 98, 101, 99, 102]
    assert sampling.stop_token_ids == (7, 103)


def test_a_budget_of_no_tokens_is_refused_not_ignored():
    """``at_most=0`` is a budget (the markers alone do not fit), not "no budget"."""
    with pytest.raises(ConfigError, match="suffix and the markers alone take 4 tokens, more than the 0"):
        fim.prompt_ids(_BosTokenizer(), "ab", "c", at_most=0)
    assert fim.prompt_ids(_BosTokenizer(), "ab", "c", at_most=5) == [100, 98, 101, 99, 102]
