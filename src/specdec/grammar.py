"""Structured output: a grammar as a :class:`specdec.sampling.Constraint` (llguidance engine).

The grammar mask is part of the processing applied to *both* the draft's q and the target's p
(:func:`specdec.sampling.penalised_logits`), so the drafter proposes only tokens the grammar
allows and the target's law is the constrained law: speculation stays lossless.  The constraint
is asked about a token history, not advanced in place; the matcher is synced to each history by
rolling back to the common prefix and consuming the rest, so a rejected draft needs no special
handling (the next question is about the shorter, committed history).

llguidance was chosen by measured per-token mask cost on SmolLM2's 49,152-token vocabulary (see
NOTES.md) and because it has no dependencies beyond its wheel; install it with
``pip install 'specdec[structured]'``.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any, Sequence

import torch
from torch import Tensor

from specdec.errors import ConfigError, MissingPackageError


def _llguidance() -> Any:
    try:
        import llguidance  # not llguidance.torch: importing it compiles a kernel (torch._dynamo, ~4 s)
    except ImportError:
        raise MissingPackageError("structured output needs llguidance: pip install 'specdec[structured]'") from None
    return llguidance


#: per tokenizer, held weakly (its caches go with it, and nothing is added to the tokenizer itself,
#: which must still pickle): llguidance's view of it per vocabulary size, and the (vocabulary size,
#: grammar) pairs already probed
_PER_TOKENIZER: weakref.WeakKeyDictionary[Any, tuple[dict[int, Any], set[tuple[int, str]]]] = weakref.WeakKeyDictionary()
_PER_TOKENIZER_LOCK = threading.Lock()


def _caches(tokenizer: Any) -> tuple[dict[int, Any], set[tuple[int, str]]]:
    """``tokenizer``'s llguidance views and probed grammars (see :data:`_PER_TOKENIZER`)."""
    with _PER_TOKENIZER_LOCK:
        found = _PER_TOKENIZER.get(tokenizer)
        if found is None:
            found = _PER_TOKENIZER[tokenizer] = ({}, set())
        return found


def _tokenizer_info(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of ``tokenizer`` (built once per tokenizer and vocabulary size: seconds).
    specdec's own tokenizer hands llguidance its tokenizer.json as parsed, as llguidance's
    transformers helper does with transformers' tokenizer, without building that (~2-3 s)."""
    cache = _caches(tokenizer)[0]
    if vocab_size not in cache:
        from specdec.tokenizer import FastTokenizer, hf_tokenizer

        llg = _llguidance()
        if isinstance(tokenizer, FastTokenizer):
            cache[vocab_size] = llg.LLTokenizer(tokenizer.backend_json(), n_vocab=vocab_size, eos_token=tokenizer.eos_token_id)
        else:
            import llguidance.hf

            cache[vocab_size] = llguidance.hf.from_tokenizer(hf_tokenizer(tokenizer), n_vocab=vocab_size)
    return cache[vocab_size]


def grammar_for(kind: str, spec: Any) -> str:
    """An llguidance grammar: ``json_object``, ``json_schema`` (a schema dict), ``regex`` or ``lark``."""
    llg = _llguidance()
    # compact separators unless the schema says otherwise (small models spiral into whitespace)
    compact = {"whitespace_flexible": False}
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
    if kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(spec if isinstance(spec, str) else json.dumps(spec), defaults=compact)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(spec)
    if kind == "lark":
        return llg.LLMatcher.grammar_from_lark(spec)
    raise ConfigError(f"unknown grammar kind {kind!r}: json_object, json_schema, regex or lark")


def choice_lark(choices: list[str]) -> str:
    """A Lark grammar whose language is exactly ``choices`` (vLLM's ``guided_choice``): one literal
    per string, written with JSON's string escapes, which are Lark's."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ConfigError("a choice list must hold one or more non-empty strings")
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _first_line(error: str | None) -> str:
    """llguidance's error without the matcher's state dump that follows it (the lexer's tokens, its
    costs and the whole grammar as JSON: nothing a caller can act on, and long)."""
    line = (error or "").split("\n", 1)[0].strip()
    return line.split("<state>", 1)[0].strip() or "the matcher stopped"


class GrammarConstraint:
    """Tokens a grammar allows after a generated history (a :class:`specdec.sampling.Constraint`)."""

    def __init__(self, tokenizer: Any, grammar: str, vocab_size: int) -> None:
        llg = _llguidance()
        ok, warnings_or_error = _validate(llg, grammar)
        if not ok:
            raise ConfigError(f"invalid grammar: {warnings_or_error}")
        #: the llguidance grammar (what the edge-cloud wire sends the server)
        self.grammar = grammar
        self._info = _tokenizer_info(tokenizer, vocab_size)
        self._eos = getattr(tokenizer, "eos_token_id", None)
        self._new = lambda: llg.LLMatcher(self._info, grammar)
        self._matcher = self._new()
        self._bits = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)  # [1, ceil(V/32)] int32
        self._shifts = torch.arange(32, dtype=torch.int32)
        self._consumed: list[int] = []
        self._lock = threading.Lock()
        probed = _caches(tokenizer)[1]
        if (vocab_size, grammar) not in probed:  # each grammar once per tokenizer (a request's choices share it)
            self._probe(vocab_size)
            if len(probed) >= 256:
                probed.clear()
            probed.add((vocab_size, grammar))

    def _probe(self, vocab_size: int) -> None:
        """Walk a copy of the matcher :data:`defaults.GRAMMAR_PROBE_TOKENS` tokens ahead, taking the
        first token each step allows, and refuse the grammar where the matcher gives up on the way
        (e.g. ``(a{1000}){1000}``: its lexer runs out of budget on the first token; or a grammar
        that allows a token it then refuses, as text tags do where the tokenizer has them as tokens).  A grammar
        that gives up only further on is still refused then, mid-generation; this only moves the
        common case, one that fails at once, before any text is produced."""
        from specdec import defaults

        matcher = self._matcher.deep_copy()
        bits = torch.full_like(self._bits, -1)
        for _ in range(defaults.GRAMMAR_PROBE_TOKENS):
            matcher.unsafe_compute_mask_ptr(bits.data_ptr(), bits.numel() * bits.element_size())
            if matcher.is_error():
                break
            allowed = self._unpack(bits)[:vocab_size].nonzero().flatten()  # [k]
            allowed = allowed[allowed != self._eos] if self._eos is not None else allowed
            if allowed.numel() == 0 or not matcher.consume_token(int(allowed[0])):
                break
        if matcher.is_error():
            why = _first_line(matcher.get_error())
            hint = ("; simplify it (smaller repetition counts, fewer nested alternatives)" if "lexer" in why.lower()
                    else "")
            raise ConfigError(f"the grammar cannot be followed: its matcher fails on a token it allows ({why}){hint}")

    def _sync(self, generated: Sequence[int]) -> None:
        k = 0
        limit = min(len(self._consumed), len(generated))
        while k < limit and self._consumed[k] == generated[k]:
            k += 1
        if k < len(self._consumed):
            self._matcher.rollback(len(self._consumed) - k)
            del self._consumed[k:]
        if self._matcher.is_error():
            self._matcher, self._consumed, k = self._new(), [], 0
        for token in generated[k:]:
            if not self._matcher.consume_token(int(token)):
                raise ConfigError(f"token {token} breaks the grammar ({_first_line(self._matcher.get_error())})")
            self._consumed.append(int(token))

    def _unpack(self, bits: Tensor) -> Tensor:  # [1, W] int32 -> [W * 32] bool
        """llguidance's token bitmask (bit j of word w: token 32 w + j) as one bool per token."""
        return ((bits[0].unsqueeze(-1) >> self._shifts) & 1).bool().reshape(-1)

    def _fill(self) -> None:
        """The matcher's mask into :attr:`_bits` (what llguidance.torch's ``fill_next_token_bitmask`` does)."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * self._bits.element_size())

    def allowed(self, generated: Sequence[int], vocab_size: int) -> Tensor:  # -> [V] bool
        if self._eos is not None and self._eos in generated:
            # the sequence has ended (decoding stops at its end token): only the end may follow.
            # The end token is never fed to the matcher: a stopped matcher does not roll back cleanly
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[self._eos] = True
            return mask
        with self._lock:
            self._sync(generated)
            self._fill()
            if self._matcher.is_error():
                # a matcher that gave up (e.g. its complexity budget after many rollbacks) would
                # allow only end-of-sequence: rebuild it from the history, which defines the answer
                self._matcher, self._consumed = self._new(), []
                self._sync(generated)
                self._fill()
                if self._matcher.is_error():
                    raise ConfigError(f"the grammar engine failed: {self._matcher.get_error().splitlines()[0]}")
            mask = self._unpack(self._bits)  # [W * 32]
        if mask.numel() < vocab_size:  # ids past the tokenizer's (a padded embedding) are never allowed
            mask = torch.cat([mask, mask.new_zeros(vocab_size - mask.numel())])
        return mask[:vocab_size]


class AfterThinking:
    """A constraint that holds only after a reasoning model's thinking: the tokens inside a
    ``<think>`` ... ``</think>`` block are free, and ``inner`` (a grammar) rules what follows the
    block's closing token, as if the answer began there (vLLM applies structured output after the
    reasoning the same way).

    ``open_id`` and ``close_id`` are the two tags' tokens (each one token of the tokenizer's own).
    ``opened``: the prompt ended inside the block (R1's template writes ``<think>`` into it), so the
    answer starts thinking.  Otherwise the answer's first token may open the block or begin what
    ``inner`` allows, and an answer that does not open one is ``inner``'s from its first token.
    The mask is a pure function of the history, as every constraint's is: a history is in the
    block, or the block closed at a known token and ``inner`` is asked about what came after."""

    def __init__(self, inner: Any, open_id: int, close_id: int, opened: bool) -> None:
        self.inner = inner
        self.open_id, self.close_id, self.opened = int(open_id), int(close_id), bool(opened)
        self._free: dict[int, Tensor] = {}  # vocabulary size -> [V] all True

    def answer_start(self, generated: Sequence[int]) -> int | None:
        """Where the answer after the thinking starts in ``generated``; None while thinking."""
        start = 0
        if not self.opened:
            if not generated or generated[0] != self.open_id:
                return 0  # no block: the answer is all of it
            start = 1
        seq = generated if isinstance(generated, (list, tuple)) else list(generated)
        try:
            return seq.index(self.close_id, start) + 1  # one scan, no copy of the history
        except ValueError:
            return None

    def allowed(self, generated: Sequence[int], vocab_size: int) -> Tensor:  # -> [V] bool
        start = self.answer_start(generated)
        if start is None:  # inside the block: any token (the filter over this one, if any, still holds)
            if vocab_size not in self._free:
                self._free[vocab_size] = torch.ones(vocab_size, dtype=torch.bool)
            return self._free[vocab_size]
        mask = self.inner.allowed(generated[start:], vocab_size)
        if start == 0 and not generated and not self.opened:  # the first token may open the block instead
            mask = mask.clone()
            mask[self.open_id] = True
        return mask


def check_grammar(grammar: str) -> str:
    """``grammar`` if llguidance accepts it; otherwise a :class:`ConfigError` naming the problem
    (what :class:`GrammarConstraint` checks, without a tokenizer: before any model loads)."""
    ok, why = _validate(_llguidance(), grammar)
    if not ok:
        raise ConfigError(f"invalid grammar: {why}")
    return grammar


def _one_line(message: str) -> str:
    """The engine's message on one line: its first, and the ``error: …`` line of a regex
    parser's report (whose middle lines draw a caret under the pattern)."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    cause = next((line[len("error:"):].strip() for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {cause}" if cause else lines[0]


def _validate(llg: Any, grammar: str) -> tuple[bool, str]:
    try:
        result = llg.LLMatcher.validate_grammar(grammar)
    except Exception as exc:  # noqa: BLE001 - the engine's own message is the useful part
        return False, _one_line(str(exc))
    if isinstance(result, str):
        return (not result), _one_line(result)
    return True, ""
