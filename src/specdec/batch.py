"""Offline batch generation: many prompts decoded together by continuous batching.

Where a caller has many prompts and wants them all (an evaluation, a data set), the quantity that
matters is tokens per second over the whole job, not one reply's latency.  On a CPU the target's
linear layers read their weights once per pass whatever the number of rows, so a pass over the
next token of 16 sequences costs far less than 16 passes: measured on two cores with the 4-bit
SmolLM2 target, 4.9 ms for one row and 25.5 ms for sixteen (``benchmarks/offline-batch-g``).
Drafting, in contrast, pays only while a pass is memory-bound; a batched pass is compute-bound,
so each extra drafted row costs about what it would save.  This module therefore decodes plainly:
up to ``batch`` sequences at a time, one token each per pass, a finished sequence's slot taken by
the next prompt at once (Orca-style continuous batching).

**Exact.**  Each sequence is an ordinary :class:`~specdec.session.TargetSession` — its prompt's
prefill, its seed, penalties, log-probabilities and verification rule are the single-sequence
code — and only the pass is shared: :meth:`NativeCausalLM.forward_batch` gives each sequence's
logits bitwise as its own pass would (the native target is batch-invariant).  So every result is
token for token what ``Engine.generate`` gives for that prompt alone with the same seed, with no
draft — and, for greedy decoding and seeded sampling (the coupled rule), with any draft
(tested on toy and real weights).  A target without ``forward_batch`` (the Hugging Face backend)
runs the same loop one pass per sequence.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch import Tensor

from specdec import defaults
from specdec.decoder import _fresh_seed, cut_at_eos
from specdec.errors import ConfigError
from specdec.sampling import SamplingConfig, check_stop_token_ids, floor_stops, offset_seed
from specdec.session import TargetSession
from specdec.text import StopStrings, TextSink, output_sink, output_stop, prompt_ids
from specdec.verify import get_rule


@dataclass(frozen=True)
class BatchResult:
    """One prompt's generation: what ``Engine.generate`` returns for it alone, in short."""

    index: int  # the prompt's position in the input
    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos", "stop" or "length"
    seed: int  # the seed it used: `specdec generate --seed SEED --method METHOD` reproduces it
    method: str  # the verification rule it decoded with (every rule samples the target's own law here)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass(eq=False)
class _Running:
    index: int
    prompt_tokens: int
    session: TargetSession
    sink: TextSink
    stop: StopStrings | None
    max_new: int
    generated: list[int]
    finish: str = "length"


def seed_for(sampling: SamplingConfig, index: int) -> int:
    """Prompt ``index``'s seed: the configured seed + index (as OpenAI's ``n`` choices), else a fresh one."""
    if sampling.seed is None:
        return _fresh_seed()
    return offset_seed(sampling.seed, index)


def generate_batch(
    target: Any,  # a LoadedModel
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    *,
    batch: int = defaults.BATCH_SEQUENCES,
    method: str | None = None,
    logprobs: int | None = None,
    ignore_eos: bool = False,
    constraint: Callable[[], Any] | None = None,
    on_result: Callable[[BatchResult], None] | None = None,
) -> list[BatchResult]:
    """Decode every prompt (token ids) plainly, up to ``batch`` at a time in one pass per token;
    results in input order (``on_result`` also gets each as it finishes, in finishing order).
    ``constraint`` (structured output) makes each sequence's own constraint, e.g.
    ``lambda: GrammarConstraint(tokenizer, grammar, vocab_size)``: a grammar matcher follows one history."""
    from dataclasses import replace

    from specdec.engine import default_method

    if batch < 1:
        raise ConfigError(f"the batch size must be >= 1, got {batch}")
    if sampling.constraint is not None:
        raise ConfigError("give generate_batch a constraint factory (constraint=lambda: GrammarConstraint(...)): each"
                          " sequence needs its own matcher, one shared one would replay every history at every step")
    rule = get_rule(method or default_method(sampling))
    model, tokenizer = target.model, target.tokenizer
    check_stop_token_ids(sampling, model.vocab_size)
    stops = (frozenset() if ignore_eos else target.eos_ids) | frozenset(sampling.stop_token_ids)
    forward_batch = getattr(model, "forward_batch", None)
    # every prompt checked before the first is decoded: a bad one late in the list lost the results before it
    prompts = [prompt_ids(ids, model.vocab_size, f"prompt {i}") for i, ids in enumerate(prompts)]
    empty = next((i for i, ids in enumerate(prompts) if not ids), None)
    if empty is not None:
        raise ConfigError(f"prompt {empty} is empty")
    pending = deque(enumerate(prompts))
    running: list[_Running] = []
    results: list[BatchResult | None] = [None] * len(prompts)

    def finish(r: _Running) -> None:
        s = r.session
        s.close()  # as the decoder closes its sessions (a target that keeps finished sequences gets this one)
        lps = s.emitted_logprobs[: len(r.generated)] if logprobs is not None else None
        res = BatchResult(r.index, r.sink.finish(r.generated), list(r.generated), r.prompt_tokens, r.finish, s.seed, rule.name, lps)
        results[r.index] = res
        if on_result is not None:
            on_result(res)

    while pending or running:
        while pending and len(running) < batch:  # admit: each prompt's own prefill
            i, ids = pending.popleft()
            own = replace(sampling, constraint=constraint()) if constraint is not None else sampling
            own = floor_stops(own, stops)  # min_tokens: the stop tokens masked while too few were generated
            session = TargetSession(model, ids, own, rule, seed=seed_for(sampling, i), logprobs=logprobs)
            r = _Running(i, len(ids), session,
                         output_sink(tokenizer, sampling, eos_ids=stops), output_stop(tokenizer, sampling),
                         min(sampling.max_new_tokens, session.max_length - len(ids)), [])
            if r.max_new <= 0:
                finish(r)
            else:
                running.append(r)
        if not running:
            continue
        t0 = time.perf_counter()
        feeds = [r.session.plain_feed() for r in running]  # [1] each
        if forward_batch is not None:
            logits: list[Tensor] = forward_batch([(f, r.session.cache, False) for f, r in zip(feeds, running)])  # [1, V] each
        else:
            logits = [model.forward(f, r.session.cache) for f, r in zip(feeds, running)]
        share = (time.perf_counter() - t0) / len(running)
        still: list[_Running] = []
        for r, row in zip(running, logits):
            new = r.session.conclude_plain(row, target_s=share).verdict.tokens.tolist()[: r.max_new - len(r.generated)]
            new, ended = cut_at_eos(new, stops)  # as the decoder does after every round
            if ended:
                r.finish = "eos"
            r.generated.extend(new)
            if r.stop is not None:
                keep = r.stop(r.generated)
                if keep is not None:
                    del r.generated[keep:]
                    r.finish = "stop"
            if r.finish != "length" or len(r.generated) >= r.max_new:
                finish(r)
            else:
                still.append(r)
        running = still
    return [r for r in results if r is not None]


__all__ = ["BatchResult", "generate_batch", "seed_for"]
