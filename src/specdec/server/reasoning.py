"""A reasoning model's thinking, apart from its answer (vLLM's ``--reasoning-parser``).

Models such as DeepSeek-R1's distillations (Qwen2 and Llama layouts) and Qwen3 think inside
``<think>`` ... ``</think>`` before they answer.  With the parser on, a chat answer's thinking goes
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

from typing import Any

OPEN, CLOSE = "<think>", "</think>"
#: ``--reasoning-parser``: ``auto`` (on where the tokenizer has both tags as tokens of their own),
#: ``think`` (on), ``none`` (off: the thinking stays in the content)
PARSERS = ("auto", "think", "none")


def parser_on(choice: str, tokenizer: Any) -> bool:
    """Whether answers are split for ``choice`` (see :data:`PARSERS`) and this tokenizer."""
    if choice == "auto":
        added = getattr(tokenizer, "get_added_vocab", None)
        vocab = added() if added is not None else {}
        return OPEN in vocab and CLOSE in vocab
    return choice == "think"


def tag_ids(tokenizer: Any) -> tuple[int, int] | None:
    """The ids of ``<think>`` and ``</think>`` where each is one token of the tokenizer's own (R1's
    distillations, Qwen3), else None: structured output then starts after the thinking's last
    token (:class:`specdec.grammar.AfterThinking`); without them it holds from the first token."""
    added = getattr(tokenizer, "get_added_vocab", None)
    vocab = added() if added is not None else {}
    if OPEN not in vocab or CLOSE not in vocab:
        return None
    return int(vocab[OPEN]), int(vocab[CLOSE])


def prompt_opens(tokenizer: Any, prompt_ids: list[int]) -> bool:
    """Whether the rendered prompt ends inside a ``<think>`` block (R1's generation prompt)."""
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    return tail.rstrip().endswith(OPEN)


def split(text: str, opened: bool) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished answer; None where there is none."""
    body = text
    if text.lstrip().startswith(OPEN):
        body, opened = text.lstrip()[len(OPEN):], True
    if not opened:
        return None, text
    end = body.find(CLOSE)
    if end < 0:
        return body, None
    return body[:end], body[end + len(CLOSE):] or None


def thinking_tokens(tokenizer: Any, token_ids: list[int], text: str, opened: bool, *, skip_special_tokens: bool = True) -> int:
    """How many of an answer's tokens (``text`` its text) are thinking, up to the one that completes
    ``</think>`` (usage's ``reasoning_tokens``): all of them while the block never closed, none
    without a block."""
    thought, content = split(text, opened)
    if thought is None:
        return 0
    if content is None and CLOSE not in text:
        return len(token_ids)
    from specdec.text import TextStream

    stream = TextStream(tokenizer, skip_special_tokens=skip_special_tokens)
    for k, token in enumerate(token_ids, start=1):
        stream.push([token])
        if CLOSE in stream.text:
            return k
    return len(token_ids)


class StreamedReasoning:
    """One streamed answer split as it grows: :meth:`feed` takes each new piece of text and gives
    (reasoning, content) to send now; a tail that may still become a tag waits.  The pieces sent
    add up to what :func:`split` gives the finished answer."""

    def __init__(self, opened: bool) -> None:
        self.text = ""
        self.opened = opened
        self.sent_reasoning = 0  # characters of the reasoning sent
        self.sent_content = 0  # ... of the content

    def feed(self, piece: str, final: bool = False) -> tuple[str, str]:
        self.text += piece
        body = self.text.lstrip()
        if not final and OPEN.startswith(body):
            return "", ""  # may still open a block (or be nothing yet): wait
        if body.startswith(OPEN):
            start = len(self.text) - len(body) + len(OPEN)
        elif self.opened:
            start = 0
        else:  # no block: all of it is content
            return "", self._content(self.text)
        end = self.text.find(CLOSE, start)
        if end < 0:
            stop = len(self.text) if final else _held(self.text, start)
            return self._reasoning(self.text[start:stop]), ""
        return self._reasoning(self.text[start:end]), self._content(self.text[end + len(CLOSE):])

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


def _held(text: str, start: int) -> int:
    """Where streamed thinking stops for now: before a tail of ``text[start:]`` that may become ``</think>``."""
    for k in range(min(len(CLOSE) - 1, len(text) - start), 0, -1):
        if CLOSE.startswith(text[-k:]):
            return len(text) - k
    return len(text)
