"""Fill-in-the-middle prompts: the code before a gap and the code after it, in the order a code
model was trained to fill the gap (OpenAI's ``suffix`` on completions, ``generate --suffix``).

Code models mark the two parts with tokens of their own and then write the middle.  Each style
here is prefix-suffix-middle: ``<PRE> prefix <SUF> suffix <MID>``, the middle generated after the
last marker.  The style is read off the tokenizer (its added tokens), never guessed from a name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from specdec.errors import ConfigError
from specdec.tokenizer import added_vocab


@dataclass(frozen=True)
class FimStyle:
    """One family's marker tokens (by their text) and the tokens that end a filled middle besides
    end-of-sequence (a model may close the file or start the next one instead)."""

    name: str
    prefix: str
    suffix: str
    middle: str
    ends: tuple[str, ...] = ()


STYLES = (
    # Qwen2.5-Coder, CodeGemma
    FimStyle("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
             ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|file_separator|>", "<|endoftext|>")),
    # StarCoder / StarCoder2 and the tokenizers derived from them
    FimStyle("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", ("<fim_pad>", "<file_sep>", "<|endoftext|>")),
    # DeepSeek-Coder: begin, hole, end
    FimStyle("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", ("<｜end▁of▁sentence｜>",)),
)


def style_of(tokenizer: Any) -> FimStyle | None:
    """The first style whose three markers are all added tokens of ``tokenizer``; None if none is."""
    vocab = added_vocab(tokenizer)
    for style in STYLES:
        if all(mark in vocab for mark in (style.prefix, style.suffix, style.middle)):
            return style
    return None


NO_STYLE = ("this model has no fill-in-the-middle tokens, so a suffix cannot be filled in "
            "(code models have them: Qwen2.5-Coder, StarCoder2, DeepSeek-Coder, CodeGemma)")


def require_style(tokenizer: Any) -> FimStyle:
    """:func:`style_of`, or a :class:`ConfigError` saying which models have one."""
    style = style_of(tokenizer)
    if style is None:
        raise ConfigError(NO_STYLE)
    return style


def absent_from(files: Sequence[Path]) -> bool:
    """Whether no style's three markers are all written in the tokenizer ``files`` (as UTF-8, or
    escaped as JSON writes them): a tokenizer read from them then has no style, so a suffix can be
    refused before a model loads.  False only says "maybe": the loaded tokenizer decides."""
    texts = []
    for path in files:
        try:
            texts.append(path.read_bytes())
        except OSError:
            return False

    def written(mark: str) -> bool:
        forms = {mark.encode("utf-8"), json.dumps(mark).strip('"').encode("ascii")}
        return any(form in text for text in texts for form in forms)

    return not any(all(written(m) for m in (s.prefix, s.suffix, s.middle)) for s in STYLES)


def prompt_ids(tokenizer: Any, prefix: str | list[int], suffix: str, style: FimStyle | None = None, *,
               at_most: int | None = None) -> list[int]:
    """The token ids of a fill-in-the-middle prompt: ``prefix`` (text, or ids already encoded) and
    ``suffix`` between the style's markers, each part encoded alone (no special tokens added), so a
    marker always is the model's own token.  An empty prefix or suffix is allowed (a gap at the
    start or the end of a file); both empty is not a prompt.  With ``at_most``, a longer prompt
    loses the prefix's first tokens (the code farthest from the gap), never a marker nor the suffix."""
    style = style or require_style(tokenizer)
    vocab = added_vocab(tokenizer)
    before = list(prefix) if isinstance(prefix, list) else list(tokenizer.encode(prefix, add_special_tokens=False)) if prefix else []
    after = list(tokenizer.encode(suffix, add_special_tokens=False)) if suffix else []
    if not before and not after:
        raise ConfigError("the prompt is empty: a fill-in-the-middle request needs a prefix or a suffix")
    if at_most is not None:
        fixed = len(after) + 3  # the three markers and the suffix
        if fixed > at_most:
            raise ConfigError(f"the suffix and the markers alone take {fixed} tokens, more than the {at_most} "
                              "the prompt may keep")
        before = before[max(0, len(before) - (at_most - fixed)):]
    return [vocab[style.prefix], *before, vocab[style.suffix], *after, vocab[style.middle]]


def end_ids(tokenizer: Any, style: FimStyle) -> tuple[int, ...]:
    """The ids of ``style``'s ending tokens that ``tokenizer`` has."""
    vocab = added_vocab(tokenizer)
    return tuple(sorted({vocab[name] for name in style.ends if name in vocab}))


def stop_ids(tokenizer: Any, style: FimStyle, given: Sequence[int] = ()) -> tuple[int, ...]:
    """``given`` stop tokens and :func:`end_ids`: the model closing the file ends the middle."""
    return tuple(sorted(set(given) | set(end_ids(tokenizer, style))))


def fill_request(tokenizer: Any, prefix: str, suffix: str, sampling: Any) -> tuple[list[int], Any]:
    """A fill-in-the-middle generation's prompt ids and its sampling settings (``sampling`` with
    :func:`stop_ids`): ``generate --suffix``, locally or at the edge."""
    style = require_style(tokenizer)
    return prompt_ids(tokenizer, prefix, suffix, style), replace(sampling, stop_token_ids=stop_ids(tokenizer, style, sampling.stop_token_ids))
