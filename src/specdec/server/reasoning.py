"""A reasoning model's thinking, apart from its answer (vLLM's ``--reasoning-parser``).

Models such as DeepSeek-R1's distillations (Qwen2 and Llama layouts) and Qwen3 think inside
``<think>`` ... ``</think>`` before they answer; Mistral's reasoning models (Magistral) inside
``[THINK]`` ... ``[/THINK]``, two special tokens of their tokenizer (the answer's text then keeps
special tokens, as vLLM's Mistral parser reads it).  The tags are read off the tokenizer.  With the parser on, a chat answer's thinking goes
to the message's ``reasoning`` (the field vLLM and OpenAI's guidance name; ``reasoning_content``,
DeepSeek's older name, carries the same text) and only what follows ``</think>`` is the
``content``, where tool calls are looked for.  Streamed, thinking goes out as ``reasoning`` deltas
and the answer as ``content`` deltas.

The thinking opens either in the answer (it starts with ``<think>``) or in the prompt: R1's template
ends the generation prompt with ``<think>``, so the answer begins inside the block (``opened``).
Without ``</think>`` an answer that is inside the block is all thinking (cut off while thinking, as
vLLM's R1 parser reads it); one that never opened a block is all answer.  The text is only split:
the tokens, and so the output's law, do not change.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from specdec.tokenizer import added_vocab


class Tags(NamedTuple):
    """A thinking block's opening and closing tags, as text."""

    open: str
    close: str


THINK = Tags("<think>", "</think>")
#: Mistral's: special tokens of its tokenizer (Magistral)
MISTRAL = Tags("[THINK]", "[/THINK]")
OPEN, CLOSE = THINK
#: ``--reasoning-parser``: ``auto`` (on where the tokenizer has both tags of a pair as tokens of its
#: own), ``think`` (on), ``none`` (off: the thinking stays in the content)
PARSERS = ("auto", "think", "none")


def tags_of(tokenizer: Any) -> Tags:
    """Mistral's tags where the tokenizer has both as tokens, else ``<think>`` / ``</think>``."""
    vocab = added_vocab(tokenizer)
    return MISTRAL if MISTRAL.open in vocab and MISTRAL.close in vocab else THINK


def parser_on(choice: str, tokenizer: Any) -> bool:
    """Whether answers are split for ``choice`` (see :data:`PARSERS`) and this tokenizer."""
    if choice == "auto":
        return tag_ids(tokenizer, tags_of(tokenizer)) is not None
    return choice == "think"


def special_tags(tokenizer: Any, tags: Tags) -> bool:
    """Whether a text that leaves special tokens out loses ``tags`` (Mistral's are special tokens):
    the answer's text must then keep them to be split."""
    ids = tag_ids(tokenizer, tags)
    return ids is not None and any(tokenizer.decode([i], skip_special_tokens=True) == "" for i in ids)


def tag_ids(tokenizer: Any, tags: Tags = THINK) -> tuple[int, int] | None:
    """The ids of ``tags`` where each is one token of the tokenizer's own (R1's distillations,
    Qwen3, Magistral), else None: structured output then starts after the thinking's last token
    (:class:`specdec.grammar.AfterThinking`); without them it holds from the first token."""
    vocab = added_vocab(tokenizer)
    if tags.open not in vocab or tags.close not in vocab:
        return None
    return int(vocab[tags.open]), int(vocab[tags.close])


def prompt_opens(tokenizer: Any, prompt_ids: list[int], tags: Tags = THINK) -> bool:
    """Whether the rendered prompt ends inside a thinking block (R1's generation prompt)."""
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    return tail.rstrip().endswith(tags.open)


def split(text: str, opened: bool, tags: Tags = THINK) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished answer; None where there is none."""
    body = text
    if text.lstrip().startswith(tags.open):
        body, opened = text.lstrip()[len(tags.open):], True
    if not opened:
        return None, text
    end = body.find(tags.close)
    if end < 0:
        return body, None
    return body[:end], body[end + len(tags.close):] or None


def thinking_tokens(tokenizer: Any, token_ids: list[int], text: str, opened: bool, *, skip_special_tokens: bool = True,
                    tags: Tags = THINK) -> int:
    """How many of an answer's tokens (``text`` its text) are thinking, up to the one that completes
    the closing tag (usage's ``reasoning_tokens``): all of them while the block never closed, none
    without a block."""
    thought, content = split(text, opened, tags)
    if thought is None:
        return 0
    if content is None and tags.close not in text:
        return len(token_ids)
    from specdec.text import TextStream

    stream = TextStream(tokenizer, skip_special_tokens=skip_special_tokens)
    for k, token in enumerate(token_ids, start=1):
        stream.push([token])
        if tags.close in stream.text:
            return k
    return len(token_ids)


class StreamedReasoning:
    """One streamed answer split as it grows: :meth:`feed` takes each new piece of text and gives
    (reasoning, content) to send now; a tail that may still become a tag waits.  The pieces sent
    add up to what :func:`split` gives the finished answer."""

    def __init__(self, opened: bool, tags: Tags = THINK) -> None:
        self.text = ""
        self.opened = opened
        self.tags = tags
        self.sent_reasoning = 0  # characters of the reasoning sent
        self.sent_content = 0  # ... of the content

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.text += piece
        body = self.text.lstrip()
        opening, closing = self.tags
        if not final and opening.startswith(body):
            return "", ""  # may still open a block (or be nothing yet): wait
        if body.startswith(opening):
            start = len(self.text) - len(body) + len(opening)
        elif self.opened:
            start = 0
        else:  # no block: all of it is content
            return "", self._content(self.text)
        end = self.text.find(closing, start)
        if end < 0:
            stop = len(self.text) if final else _held(self.text, start, closing)
            return self._reasoning(self.text[start:stop]), ""
        return self._reasoning(self.text[start:end]), self._content(self.text[end + len(closing):])

    def finish(self) -> tuple[str, str]:
        """What is left to send once the answer is finished."""
        return self.feed("", final=True)

    def _reasoning(self, reasoning: str) -> str:
        out = reasoning[self.sent_reasoning:]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        return out

    def _content(self, content: str) -> str:
        out = content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(content))
        return out


def _held(text: str, start: int, close: str) -> int:
    """Where streamed thinking stops for now: before a tail of ``text[start:]`` that may become ``close``."""
    for k in range(min(len(close) - 1, len(text) - start), 0, -1):
        if close.startswith(text[-k:]):
            return len(text) - k
    return len(text)
