"""The edge's generate call: draft locally, verify remotely, through the local decoding loop.

:func:`generate_remote` is what ``specdec generate --remote URL`` runs: the local draft model (or
any drafter) proposes, a :class:`RemoteVerifier` carries each round to the server, the ordinary
:class:`SpeculativeDecoder` does the rest (γ policy, stops, streaming, stats).  The γ controller
sees each round's full round trip as the target's cost (``Outcome.target_s``), so ``auto`` γ
accounts for the network: a longer RTT makes longer drafts pay.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import httpx

from specdec import defaults
from specdec.decoder import GenerationResult, GenerationStats, SpeculativeDecoder
from specdec.drafters.base import Drafter
from specdec.engine import make_gamma, make_tree
from specdec.errors import ConfigError
from specdec.remote.client import RemoteConfig, RemoteTarget, RemoteVerifier
from specdec.remote.gating import Gate, GatedDrafter
from specdec.sampling import SamplingConfig, floor_stops
from specdec.text import output_sink, output_stop
from specdec.tokenizer import vocab_digest

#: default truncation of q in sparse-q mode (the drafter samples from its top-k and sends exactly that)
DEFAULT_Q_TOP_K = 16


@dataclass(frozen=True)
class EdgeResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    result: GenerationResult = field(repr=False)
    remote: dict[str, Any]  # wire mode, bytes, RTT, cloud time, retries, lossy counts
    gate: dict[str, Any] | None
    #: per token: its log-probability under the server target's law and the best alternatives
    #: (``generate_remote(logprobs=K)``; None otherwise)
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None

    @property
    def stats(self) -> GenerationStats:
        return self.result.stats

    @property
    def lossless(self) -> bool:
        return bool(self.remote["lossless"])

    def summary(self) -> dict[str, Any]:
        """The local generation stats plus the edge-cloud figures (the CLI's JSON ``stats``)."""
        st = self.result.stats
        out = st.to_dict()
        out["lossless"] = self.lossless
        generated = max(st.generated_tokens, 1)
        out.update(
            bytes_up=self.remote["bytes_up"],
            bytes_down=self.remote["bytes_down"],
            rtt_ms=self.remote["rtt_ms"],
            cloud_prefill_ms=self.remote["cloud_prefill_ms"],
            edge_time_ms=st.draft_s * 1e3,
            cloud_calls_per_token=self.remote["verify_calls"] / generated,
        )
        return out


def generate_remote(
    prompt_ids: list[int],
    sampling: SamplingConfig,
    remote: RemoteConfig,
    *,
    drafter: Drafter | None,
    drafter_name: str = "",
    tokenizer: Any | None = None,
    gamma: str | int = defaults.DEFAULT_GAMMA,
    tree: str | int = defaults.DEFAULT_TREE,
    tree_min_prob: float | None = None,
    eos_ids: frozenset[int] = frozenset(),
    q_top_k: int | None = DEFAULT_Q_TOP_K,
    gate: Gate | None = None,
    on_text: Callable[[str], None] | None = None,
    on_tokens: Callable[[list[int]], None] | None = None,
    client: httpx.Client | None = None,
    logprobs: int | None = None,
    vocab_size: int | None = None,
) -> EdgeResult:
    """Generate after ``prompt_ids`` with ``drafter`` here and the target behind ``remote``.

    ``logprobs`` (0-20): each token's log-probability under the server target's processed law and
    that many best alternatives, sent with each verdict (:attr:`EdgeResult.logprobs`).

    A missing ``sampling.seed`` is drawn here, so the edge and the cloud share it.  ``tokenizer``
    (the edge's, which encoded ``prompt_ids``) decodes the text, and its vocabulary's digest goes
    with the session's creation: a server whose tokenizer differs refuses it before any round.
    ``vocab_size``: the ids the edge drafts and decodes (its draft model's vocabulary; default the
    tokenizer's length): a token id the server sends past it is an error.
    ``q_top_k`` applies to the sparse-q wire mode only.  ``tree`` (``chain``, ``auto`` or a node
    count) sends token trees: ids + parent indices (+ sparse q rows where the rule reads q); under
    ``auto`` the tree controller's measured seconds per round include the round trip, so it
    weighs a bigger tree against the network as well as against the cloud's pass.
    """
    if not prompt_ids:
        raise ConfigError("the prompt is empty")
    if q_top_k is not None and q_top_k < 1:
        raise ConfigError(f"q top-k must be >= 1, got {q_top_k}")
    if sampling.seed is None:
        sampling = replace(sampling, seed=int.from_bytes(os.urandom(6), "little"))
    local_commit = None
    spec, controller = make_tree(tree, make_gamma(gamma), min_prob=tree_min_prob, drafter=drafter)
    if spec is not None and gate is not None and gate.cfg.policy != "off":
        raise ConfigError("the edge gate judges chain drafts token by token; use --tree chain with --gate")
    if gate is not None and gate.cfg.policy != "off":
        if drafter is not None:
            drafter = GatedDrafter(drafter, gate)
        if gate.cfg.policy == "lossy-local-commit":
            local_commit = gate.local_commit
    # min_tokens masks these until then: the server is told which, and the drafts are masked alike
    stops = frozenset(eos_ids) | frozenset(sampling.stop_token_ids)
    verifier = RemoteVerifier(
        remote, prompt_ids, sampling, max_new_tokens=sampling.max_new_tokens, client=client, local_commit=local_commit,
        floor_ids=stops, logprobs=logprobs,
        vocab_digest=vocab_digest(tokenizer) if hasattr(tokenizer, "get_vocab") else None,
        edge_vocab=vocab_size if vocab_size is not None else (len(tokenizer) if tokenizer is not None else None),
    )
    try:
        target = RemoteTarget(vocab_size=verifier.vocab_size, max_length=verifier.max_context)
        decoder = SpeculativeDecoder(
            target,  # type: ignore[arg-type]  # the decoder reads only vocab_size from it
            drafter,
            verifier.rule,
            gamma=controller,
            eos_ids=eos_ids,
            drafter_name=drafter_name,
            q_top_k=q_top_k if verifier.wire == "sparse-q" else None,
            tree=spec,
        )
        sink = output_sink(tokenizer, sampling, on_text, eos_ids=eos_ids)
        stop = output_stop(tokenizer, sampling)

        def emit(tokens: list[int]) -> None:
            sink.push(tokens)
            if on_tokens is not None:
                on_tokens(tokens)

        result = decoder.generate(prompt_ids, floor_stops(sampling, stops), stop=stop, on_tokens=emit, verifier=verifier)
        text = sink.finish(result.tokens)
    finally:
        verifier.close()
    info = verifier.stats.summary()
    info.update(
        url=remote.url,
        model=verifier.model_name,
        wire=verifier.wire,
        method=verifier.rule.name,
        lossless=verifier.lossless,  # exact unless a lossy rule ran or a token went unverified
        lossy_options=[
            name
            for name, on in (
                ("lossy_timeout_commit", remote.lossy_timeout_commit_ms is not None),
                ("lossy_local_commit", local_commit is not None),
            )
            if on
        ],
        seed=sampling.seed,
        q_top_k=q_top_k if verifier.wire == "sparse-q" else None,
        lossy_timeout_commit_ms=remote.lossy_timeout_commit_ms,
        max_context=verifier.max_context,
    )
    return EdgeResult(
        text=text,
        token_ids=result.tokens,
        prompt_ids=list(prompt_ids),
        result=result,
        remote=info,
        gate=gate.summary() if gate is not None else None,
        logprobs=verifier.emitted_logprobs[: len(result.tokens)] if logprobs is not None else None,
    )
