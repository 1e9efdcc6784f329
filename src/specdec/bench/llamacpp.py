"""llama.cpp rows of ``specdec bench``: the same GGUF, prompts, token budget and threads, run by
llama.cpp through ``llama-cpp-python`` (the ``llamacpp`` extra).

Variants (``--llamacpp``), each a row ``llamacpp_<variant>``:

* ``plain``  — ``Llama.generate``: the prompt in one batch, then one token per call;
* ``spec``   — the binding's own speculative loop (``Llama(draft_model=...)``: score
  ``[last] + draft`` in one call, sample every position, keep the prefix that matches) with *our*
  draft converted to GGUF and run by llama.cpp too (:class:`GGUFDraft`: greedy drafting of up to
  ``draft_max`` tokens, stopping early when the draft's top probability falls below ``p_min``, as
  llama.cpp's own speculative examples do);
* ``lookup`` — the same loop with the binding's prompt-lookup drafter
  (``LlamaPromptLookupDecoding``, its defaults).

Timing matches specdec's rows: ``wall_s`` runs from the call until the last token (prompt
processing included, model loading excluded), ``tokens_per_s = generated / wall_s``, and
``decode_tokens_per_s`` leaves the first token (prompt processing) out.  A *target call* is one
``eval`` of the target, the prompt's included (it yields the first token), so plain decoding has
exactly one token per call, as in specdec.  Seeded sampling (T > 0) uses llama.cpp's own sampler
chain (top-k off, top-p, min-p off, temperature, a ``dist`` sampler seeded per generation);
greedy is llama.cpp's ``greedy`` sampler.  Flash attention is on (llama.cpp's own default,
``auto``, turns it on for the CPU; the binding's default is off), which also makes llama.cpp's
block scoring batch-invariant on our GGUF (see NOTES.md), so its speculative and plain greedy
outputs agree.  Greedy rows record a hash of the tokens so the report
can say whether speculative and plain llama.cpp decoding produced the same text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from specdec.errors import MissingPackageError


def tokens_sha1(tokens: list[int]) -> str:
    """A short fingerprint of a generation's token ids (the same function as specdec's rows use)."""
    from specdec.bench.worker import tokens_sha1 as fingerprint

    return fingerprint(tokens)

VARIANTS = ("plain", "spec", "lookup")
DRAFT_MAX = 16  # llama.cpp's default --draft-max
DRAFT_P_MIN = 0.75  # llama.cpp's default --draft-p-min
N_CTX = 2048  # the smallest context a runner gets (see :func:`context_for`)


def context_for(longest_prompt: int, max_new: int, draft_max: int = DRAFT_MAX) -> int:
    """The llama.cpp context a job needs: its longest prompt, every token it may generate and one
    speculative call's ``[last] + draft`` past the end, rounded up to 256, and never below
    :data:`N_CTX`."""
    need = longest_prompt + max_new + draft_max + 1
    return max(N_CTX, -(-need // 256) * 256)


def require() -> Any:
    """The ``llama_cpp`` module, or a clear error naming the extra to install."""
    try:
        import llama_cpp
    except ImportError:
        raise MissingPackageError(
            "the llama.cpp rows need llama-cpp-python: pip install 'specdec[llamacpp]' (it compiles llama.cpp for this CPU)"
        ) from None
    return llama_cpp


def _counting_llama(llama_cpp: Any) -> type:
    class CountingLlama(llama_cpp.Llama):
        """``Llama`` that counts (and times the first of) its ``eval`` calls."""

        calls = 0
        scored = 0
        first_eval_s = 0.0

        def eval(self, tokens):  # noqa: ANN001, ANN202 - the binding's signature
            t0 = time.perf_counter()
            super().eval(tokens)
            if self.calls == 0:
                self.first_eval_s = time.perf_counter() - t0
            self.calls += 1
            self.scored += len(tokens)

    return CountingLlama


def _last_logits(llm: Any) -> np.ndarray:
    """The next-token logits of the last evaluated position, ``[V]`` (a view into llama.cpp's buffer)."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


class GGUFDraft:
    """A ``llama_cpp.LlamaDraftModel`` running a GGUF draft model in its own llama.cpp context.

    Keeps the draft's KV cache in step with the sequence (common prefix kept, the rest removed),
    then drafts greedily: at most ``draft_max`` tokens, stopping after a token whose probability
    under the draft is below ``p_min``.  The last drafted token is not fed back (if it is accepted,
    the next call evaluates it with the target's bonus token)."""

    def __init__(self, llm: Any, *, draft_max: int = DRAFT_MAX, p_min: float = DRAFT_P_MIN) -> None:
        self.llm = llm
        self.draft_max = draft_max
        self.p_min = p_min
        self.proposed = 0
        self.calls = 0
        self.seconds = 0.0

    def reset(self) -> None:
        self.llm.reset()
        self.proposed = self.calls = 0
        self.seconds = 0.0

    def __call__(self, input_ids: np.ndarray, /, **kwargs: Any) -> np.ndarray:
        t0 = time.perf_counter()
        llm = self.llm
        ids = input_ids.tolist()
        keep = 0
        for a, b in zip(llm.input_ids[: llm.n_tokens].tolist(), ids):
            if a != b:
                break
            keep += 1
        keep = min(keep, len(ids) - 1)  # re-score at least one token to get fresh logits
        llm.n_tokens = keep  # eval() removes the KV cells from here on
        llm.eval(ids[keep:])
        out: list[int] = []
        while len(out) < self.draft_max:
            logits = _last_logits(llm)
            tok = int(np.argmax(logits))
            out.append(tok)
            if self.p_min > 0:
                z = logits - logits[tok]
                if 1.0 / float(np.exp(z).sum()) < self.p_min:
                    break
            if len(out) < self.draft_max:
                llm.eval([tok])
        self.calls += 1
        self.proposed += len(out)
        self.seconds += time.perf_counter() - t0
        return np.asarray(out, dtype=np.intc)


@dataclass
class LlamaCppRunner:
    """The llama.cpp variants of one bench job, loaded once; ``run`` gives one sample row."""

    llms: dict[str, Any]
    draft: GGUFDraft | None
    lookup: Any | None
    eos_ids: frozenset[int]
    threads: int
    gguf: Path
    draft_gguf: Path | None

    @classmethod
    def load(cls, target_gguf: Path, variants: list[str], *, draft: str, eos_ids: frozenset[int], threads: int,
             draft_max: int = DRAFT_MAX, p_min: float = DRAFT_P_MIN, flash_attn: bool = True,
             n_ctx: int = N_CTX) -> "LlamaCppRunner":
        """``n_ctx``: the context of every llama.cpp model loaded (see :func:`context_for`)."""
        llama_cpp = require()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        counting = _counting_llama(llama_cpp)
        common = dict(n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False, flash_attn=flash_attn)
        # With a draft model the binding scores every position (logits_all) but sizes its buffer
        # of them by the logits_all *argument*: n_batch rows (512) when it is left False, so a
        # prompt plus its reply past 512 tokens failed in eval ("could not broadcast input array").
        # Passing True sizes it by n_ctx; the work done is the same, since the binding turns
        # logits_all on for a draft model anyway.
        spec_ctx = dict(common, logits_all=True)
        llms: dict[str, Any] = {}
        gdraft = lookup = None
        draft_path = None
        for v in variants:
            if v == "plain":
                llms[v] = counting(model_path=str(target_gguf), **common)
            elif v == "spec":
                from specdec.bench.gguf_export import draft_gguf

                draft_path = draft_gguf(draft, target_gguf)
                gdraft = GGUFDraft(llama_cpp.Llama(model_path=str(draft_path), **common), draft_max=draft_max, p_min=p_min)
                llms[v] = counting(model_path=str(target_gguf), draft_model=gdraft, **spec_ctx)
            elif v == "lookup":
                lookup = LlamaPromptLookupDecoding()
                llms[v] = counting(model_path=str(target_gguf), draft_model=lookup, **spec_ctx)
            else:
                raise ValueError(f"unknown llama.cpp variant {v!r}; choose from {', '.join(VARIANTS)}")
        return cls(llms, gdraft, lookup, eos_ids, threads, target_gguf, draft_path)

    def generate(self, variant: str, ids: list[int], *, temperature: float, seed: int, max_new: int,
                 top_p: float | None = None, repetition_penalty: float | None = None) -> dict:
        """Generate up to ``max_new`` tokens after ``ids``; returns the stats fields of a row."""
        llm = self.llms[variant]
        llm.reset()  # no prompt-prefix reuse between generations: every run pays its whole prompt
        llm.calls = llm.scored = 0
        if variant == "spec" and self.draft is not None:
            self.draft.reset()
        llm.set_seed(seed)
        kwargs = dict(temp=temperature, top_k=0, top_p=top_p or 1.0, min_p=0.0, typical_p=1.0,
                      repeat_penalty=repetition_penalty or 1.0)
        tokens: list[int] = []
        finish = "length"
        started = time.perf_counter()
        ttft = 0.0
        for tok in llm.generate(ids, **kwargs):
            if not tokens:
                ttft = time.perf_counter() - started
            tokens.append(int(tok))
            if tok in self.eos_ids:
                finish = "eos"
                break
            if len(tokens) >= max_new:
                break
        wall = time.perf_counter() - started
        n = len(tokens)
        row = {
            "generated_tokens": n, "prompt_tokens": len(ids), "wall_s": wall,
            "tokens_per_s": n / wall if wall > 0 else 0.0, "ttft_s": ttft, "prefill_s": llm.first_eval_s,
            "target_calls": llm.calls, "target_tokens_scored": llm.scored,
            "tokens_per_target_call": n / llm.calls if llm.calls else 0.0,
            "finish_reason": finish, "lossless": True,
            "tokens_sha1": tokens_sha1(tokens),
        }
        if variant == "spec" and self.draft is not None:
            proposed = self.draft.proposed
            row.update(draft_tokens_proposed=proposed, draft_calls=self.draft.calls, draft_s=self.draft.seconds,
                       draft_tokens_accepted=max(0, n - llm.calls),
                       acceptance_rate=max(0, n - llm.calls) / proposed if proposed else 0.0)
        return row


def run_rows(runner: LlamaCppRunner, variants: list[str], ids: list[int], *, temperature: float, seed: int,
             max_new: int, top_p: float | None, repetition_penalty: float | None,
             make_row: Callable[[str, dict], dict]) -> list[dict]:
    """One generation per variant (in the order given), each turned into a sample by ``make_row``."""
    out = []
    for v in variants:
        stats = runner.generate(v, ids, temperature=temperature, seed=seed, max_new=max_new, top_p=top_p,
                                repetition_penalty=repetition_penalty)
        out.append(make_row(v, stats))
    return out
