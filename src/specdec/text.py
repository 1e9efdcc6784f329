"""Text around the token loop: prompts (plain or chat), streaming detokenisation, stop strings."""

from __future__ import annotations

import numbers
from bisect import bisect_right
from typing import Any

from specdec.errors import ConfigError


def encode_prompt(tokenizer: Any, prompt: str, *, chat: bool, system: str | None = None) -> list[int]:
    """Token ids of ``prompt``; with ``chat`` the model's chat template wraps it as a user turn."""
    if not prompt or not prompt.strip():
        raise ConfigError("the prompt is empty")
    if chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        return encode_messages(tokenizer, messages)
    return encode_text(tokenizer, prompt)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a plain (not chat) prompt with the special tokens the model's tokenizer puts
    around a text: a BOS where it adds one (Llama 3, Gemma, Mistral; none for SmolLM2 or Qwen), as
    Hugging Face and vLLM encode a completion's prompt.  Models trained with a BOS in front of every
    text wander without it (Gemma 3 loops on its first word).  A chat template writes its own
    special tokens, so its text is encoded without them (:func:`encode_messages`)."""
    return list(tokenizer.encode(text))


def encode_messages(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation in the model's chat template, ending where the assistant answers."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("this model has no chat template; drop --chat, or give one with --chat-template")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ConfigError(f"message {i} needs a 'role' string, got {m!r}"[:300])
        if m["role"] == "user" and not isinstance(m.get("content"), str):
            raise ConfigError(f"user message {i} needs a 'content' string, got {m.get('content')!r}"[:300])
    if not any(m["role"] == "user" for m in messages):
        roles = ", ".join(sorted({repr(m["role"]) for m in messages})) or "none"
        raise ConfigError(f"no message has the role 'user' (roles given: {roles})")
    if not any(m["content"].strip() for m in messages if m["role"] == "user"):
        raise ConfigError("the prompt is empty")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a template that rejects the conversation (raise_exception, a bad index)
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(f"the chat template rejected the conversation: {detail}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_ids(prompt: Any, vocab_size: int, what: str = "the prompt") -> list[int]:
    """``prompt`` (a sequence of token ids) as a list, each id checked: an integer (not a float,
    which was cut silently, nor bytes, read as ids) inside the vocabulary (an id past it failed
    inside the model with an IndexError); a one-line ConfigError naming ``what`` otherwise."""
    if isinstance(prompt, (bytes, bytearray)) or not hasattr(prompt, "__iter__"):
        raise ConfigError(f"{what} must be text or a list of token ids, got {type(prompt).__name__}")
    ids = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)  # a tensor's or array's ids as ints
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise ConfigError(f"{what}: token {i} must be an integer id, got {token!r}")
        if not 0 <= token < vocab_size:
            raise ConfigError(f"{what}: token {i} = {token} is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in ids]


class TextStream:
    """Incremental detokeniser: feed token ids, get the new text (never a half UTF-8 character).

    With a fast tokenizer this is the ``tokenizers`` library's own ``DecodeStream`` (constant work
    per token); otherwise the whole output is decoded again at each push and diffed.
    """

    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.tokens: list[int] = []
        self.text = ""
        self._backend = getattr(tokenizer, "_tokenizer", None)
        self._incremental = None
        # clean-up of tokenization spaces rewrites text across token boundaries: full decode only
        if self._backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            try:
                from tokenizers.decoders import DecodeStream
            except ImportError:  # tokenizers < 0.21
                DecodeStream = None  # noqa: N806
            if DecodeStream is not None:
                self._incremental = DecodeStream(skip_special_tokens=skip_special_tokens)

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=self.skip)

    def push(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        if self._incremental is not None:
            delta = "".join(piece for t in tokens if (piece := self._incremental.step(self._backend, int(t))))
            self.text += delta
            return delta
        text = self.decode(self.tokens)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more tokens
            return ""
        delta = text[len(self.text):] if text.startswith(self.text) else ""
        self.text = text
        return delta


class StopStrings:
    """A decoder ``stop`` check: stop once the generated text contains any stop string.

    Returns how many tokens to keep: the shortest prefix whose text contains the stop string, so
    the stop string is cut from the visible text by :func:`trim_at_stop`.  With ``min_tokens``
    (vLLM's), a stop string counts only where it starts after the first ``min_tokens`` tokens'
    text.
    """

    def __init__(self, tokenizer: Any, stops: tuple[str, ...], *, min_tokens: int = 0, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.min_tokens = min_tokens
        self.skip = skip_special_tokens  # the text looked in is the output's text
        self._floor: int | None = None  # characters of the first min_tokens tokens' text
        self._checked_chars = 0

    def __call__(self, tokens: list[int]) -> int | None:
        if not self.stops or len(tokens) <= self.min_tokens:
            return None
        if self._floor is None:
            self._floor = len(self.tokenizer.decode(tokens[: self.min_tokens], skip_special_tokens=self.skip)) if self.min_tokens else 0
        text = self.tokenizer.decode(tokens, skip_special_tokens=self.skip)
        longest = max(len(s) for s in self.stops)
        window_start = max(self._floor, self._checked_chars - longest)
        # a half-arrived character may decode as several U+FFFDs (one per byte with byte fallback)
        # that become one character later: the next search starts before them
        self._checked_chars = len(text.rstrip("\ufffd"))
        if not any(s in text[window_start:] for s in self.stops):
            return None
        # shortest token prefix whose text (after the floor) contains a stop string
        for keep in range(self.min_tokens + 1, len(tokens) + 1):
            part = self.tokenizer.decode(tokens[:keep], skip_special_tokens=self.skip)
            if any(s in part[self._floor :] for s in self.stops):
                return keep
        return len(tokens)


class StopWhen:
    """A decoder ``stop`` check on what the text says rather than on a string: stop at the shortest
    token prefix whose text satisfies ``done`` (a test that, once true of a text, stays true as the
    text grows), keeping that prefix's text whole (the server's ``parallel_tool_calls: false`` stops
    once the first call's block is closed).  The text is decoded incrementally; only the round that
    makes ``done`` true decodes its prefixes."""

    def __init__(self, tokenizer: Any, done: Any, *, skip_special_tokens: bool = True) -> None:
        self.stream = TextStream(tokenizer, skip_special_tokens=skip_special_tokens)
        self.done = done
        self._checked = 0  # tokens whose text was not done

    def __call__(self, tokens: list[int]) -> int | None:
        self.stream.push(tokens[len(self.stream.tokens):])
        if not self.done(self.stream.text):
            self._checked = len(tokens)
            return None
        for keep in range(self._checked + 1, len(tokens) + 1):
            if self.done(self.stream.decode(tokens[:keep])):
                return keep
        return len(tokens)


def first_stop(*checks: Any) -> Any:
    """One decoder ``stop`` check from several (None ones left out): the fewest tokens any keeps."""
    live = [c for c in checks if c is not None]
    if len(live) <= 1:
        return live[0] if live else None

    def check(tokens: list[int]) -> int | None:
        kept = [k for c in live if (k := c(tokens)) is not None]
        return min(kept) if kept else None

    return check


class TextSink:
    """Streams generated text to a callback, holding back what could still become a stop string.

    ``push`` takes each round's new tokens; ``finish`` returns the final text (cut at the first
    stop string) and flushes what was held back.  Used by local and edge generation alike.

    ``on_span(text, start, end)``, where given, is called with each piece of text too, and with
    the generated tokens ``[start, end)`` whose text that piece completes: a token counts as shown
    once the text up to its end is out, so a token held back with a possible stop string (or
    still half a character) goes with a later piece; ``finish`` hands over every token left, with
    or without text.  Together the spans cover the tokens in order, each once.

    vLLM's options: ``min_tokens`` (a stop string counts only where it starts after the first
    ``min_tokens`` tokens' text), ``keep_stop`` (``include_stop_str_in_output``: the text ends
    after the stop string instead of before it) and ``hidden`` (stop token ids: such a token ends
    the output, and its text is left out unless ``keep_stop``) and ``skip_special_tokens`` (False: the
    text keeps special tokens; an end-of-sequence token that ends the output belongs in ``hidden``).
    """

    def __init__(self, tokenizer: Any | None, stops: tuple[str, ...], on_text: Any | None,
                 on_span: Any | None = None, *, min_tokens: int = 0, keep_stop: bool = False,
                 hidden: frozenset[int] = frozenset(), skip_special_tokens: bool = True) -> None:
        self.stream = TextStream(tokenizer, skip_special_tokens=skip_special_tokens) if tokenizer is not None else None
        self.stops = tuple(s for s in stops if s)  # an empty stop string matches nothing (as in StopStrings)
        self.on_text = on_text
        self.on_span = on_span
        self.min_tokens = min_tokens
        self.keep_stop = keep_stop
        self.hidden = frozenset() if keep_stop else hidden
        self.printed = 0
        self.ends: list[int] = []  # with on_span: the text's length once each token's text was out
        self._known = 0  # ... known for the first so many (a token may be half a character, or have no text)
        self.shown = 0  # with on_span: tokens handed over so far
        self._count = 0  # tokens pushed
        self._floor: int | None = 0 if min_tokens == 0 else None  # the first min_tokens tokens' characters

    def _feed(self, tokens: list[int]) -> None:
        assert self.stream is not None
        if self.on_span is None:
            self.stream.push(tokens)
            return
        for t in tokens:  # one at a time, for where each token's text ends
            self.ends.append(-1)  # not yet known
            if self.stream.push([t]):  # this token's text is out, and that of any before it whose wasn't
                while self._known < len(self.ends):
                    self.ends[self._known] = len(self.stream.text)
                    self._known += 1

    def push(self, tokens: list[int]) -> None:
        if self.stream is None:
            return
        tokens = list(tokens)
        tail = tokens[-1:] if tokens and tokens[-1] in self.hidden else []  # a stop token: always the last
        if tail:
            tokens = tokens[:-1]
        if self._floor is None and self._count + len(tokens) >= self.min_tokens:
            k = self.min_tokens - self._count
            self._feed(tokens[:k])
            self._floor = len(self.stream.text)
            self._feed(tokens[k:])
        else:
            self._feed(tokens)
        self._count += len(tokens)
        for t in tail:  # in the ids, not in the text
            self.stream.tokens.append(t)
            if self.on_span is not None:
                self.ends.append(-1)
        self._count += len(tail)
        if self.on_text is None and self.on_span is None:
            return
        text = self.stream.text
        if self._floor is None:  # nothing yet can be cut
            safe = len(text)
        else:
            cut = stop_cut(text, self.stops, start=self._floor, keep=self.keep_stop) if self.stops else None
            hold = max((len(s) - 1 for s in self.stops), default=0)
            safe = cut if cut is not None else max(self.printed, self._floor, len(text) - hold)
        if safe > self.printed:
            self._emit(text[self.printed : safe], bisect_right(self.ends, safe, hi=self._known))
            self.printed = safe

    def finish(self, tokens: list[int]) -> str:
        if self.stream is None:
            return ""
        shown = tokens[:-1] if tokens and tokens[-1] in self.hidden else tokens
        text = self.stream.decode(shown)
        if self.stops and len(shown) > self.min_tokens:
            floor = len(self.stream.decode(shown[: self.min_tokens])) if self.min_tokens else 0
            text = trim_at_stop(text, self.stops, start=floor, keep=self.keep_stop)
        if len(text) > self.printed or (self.on_span is not None and len(tokens) > self.shown):
            self._emit(text[self.printed :], len(tokens))
            self.printed = max(self.printed, len(text))
        return text

    def _emit(self, text: str, shown: int) -> None:
        if self.on_text is not None and text:
            self.on_text(text)
        if self.on_span is not None:
            self.on_span(text, self.shown, max(shown, self.shown))
            self.shown = max(shown, self.shown)


def output_sink(tokenizer: Any | None, sampling: Any, on_text: Any | None = None, on_span: Any | None = None, *,
                eos_ids: frozenset[int] = frozenset()) -> TextSink:
    """The :class:`TextSink` of ``sampling``'s text options (stop strings, ``min_tokens``,
    ``include_stop``, ``stop_token_ids``, ``skip_special_tokens``); ``eos_ids``: the end-of-sequence
    tokens that may end the output, whose text is left out too where special tokens are kept."""
    hidden = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.skip_special_tokens else frozenset(eos_ids))
    return TextSink(tokenizer, sampling.stop, on_text, on_span, min_tokens=sampling.min_tokens, keep_stop=sampling.include_stop,
                    hidden=hidden, skip_special_tokens=sampling.skip_special_tokens)


def output_stop(tokenizer: Any | None, sampling: Any) -> StopStrings | None:
    """The decoder's stop-string check of ``sampling`` (None without stop strings or a tokenizer)."""
    if not sampling.stop or tokenizer is None:
        return None
    return StopStrings(tokenizer, sampling.stop, min_tokens=sampling.min_tokens, skip_special_tokens=sampling.skip_special_tokens)


def logprob_rows(tokenizer: Any, token_ids: list[int], logprobs: list[tuple[float, list[tuple[int, float]]]]) -> list[dict]:
    """The JSON form of a generation's log-probabilities (``--json --logprobs K``): per token its id,
    text and log-probability, and the K most likely alternatives; -inf (a token the processing
    removed) as -9999.0, as OpenAI's API reports it — JSON has no infinity."""
    return [{"id": t, "token": tokenizer.decode([t]), "logprob": max(lp, -9999.0),
             "top": [{"id": i, "token": tokenizer.decode([i]), "logprob": max(v, -9999.0)} for i, v in top]}
            for t, (lp, top) in zip(token_ids, logprobs)]


def stop_cut(text: str, stops: tuple[str, ...], *, start: int = 0, keep: bool = False) -> int | None:
    """Where ``text`` ends at its first stop string that starts at ``start`` or later (before it,
    or with ``keep`` after it), or None where there is none."""
    hits = [(at, len(s)) for s in stops if s and (at := text.find(s, start)) >= 0]
    if not hits:
        return None
    at, length = min(hits)
    return at + length if keep else at


def trim_at_stop(text: str, stops: tuple[str, ...], *, start: int = 0, keep: bool = False) -> str:
    """``text`` up to (not including, or with ``keep`` including) its first stop string that starts
    at ``start`` or later."""
    cut = stop_cut(text, stops, start=start, keep=keep)
    return text if cut is None else text[:cut]
