"""Prometheus metrics of one server (a private registry, so several apps can share a process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

if TYPE_CHECKING:
    from specdec.decoder import GenerationStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_TOKEN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64, 65)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0, 300.0)
#: draft positions counted one by one; later ones are pooled into the last label
_POSITIONS = 16


class ServerMetrics:
    """Counters and histograms for the verify API and the OpenAI-compatible endpoints.

    Speculative counters (target calls, drafted / accepted / emitted tokens, per draft position)
    cover every path: the ``wire`` label is the edge's wire mode for the verify API and
    ``openai`` for the OpenAI endpoints.  Acceptance over any window is
    ``rate(accepted) / rate(proposed)`` in PromQL; the since-start gauge is kept for dashboards.
    Lossy wire modes and unverified tokens are labelled ``lossless="false"``.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        disable_created_metrics()  # no *_created series: they double the output and nobody reads them
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.active_sessions = Gauge("specdec_active_sessions", "Edge sessions held by the server", registry=r)
        self.sessions_created = Counter("specdec_sessions_created", "Edge sessions created", ["wire"], registry=r)
        self.sessions_evicted = Counter("specdec_sessions_evicted", "Edge sessions dropped by the server", ["reason"], registry=r)
        self.verify_calls = Counter("specdec_verify_calls", "Verify rounds (target calls) served", ["wire", "lossless"], registry=r)
        self.replays = Counter("specdec_verify_replays", "Retried rounds answered from the stored verdict", registry=r)
        self.drafted = Counter("specdec_draft_tokens_proposed", "Draft tokens received for verification", ["wire"], registry=r)
        self.accepted = Counter("specdec_draft_tokens_accepted", "Draft tokens accepted", ["wire"], registry=r)
        self.emitted = Counter("specdec_tokens_emitted", "Tokens committed (accepted + next token)", ["wire"], registry=r)
        self.unverified = Counter("specdec_unverified_tokens", "Tokens the edge committed without verification (lossy)", registry=r)
        self.acceptance = Gauge("specdec_acceptance_rate", "Accepted / proposed draft tokens since start", ["wire"], registry=r)
        self.tokens_per_call = Histogram(
            "specdec_tokens_per_call", "Tokens committed per target call", ["wire"], buckets=_TOKEN_BUCKETS, registry=r
        )
        self.verify_latency = Histogram(
            "specdec_verify_latency_seconds", "Server time of one verify round", ["wire"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.completions = Counter("specdec_completions", "OpenAI-compatible requests served", ["endpoint", "stream"], registry=r)
        self.completion_tokens = Counter("specdec_completion_tokens", "Tokens generated for OpenAI-compatible requests", registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of OpenAI-compatible requests", ["endpoint"], registry=r)
        self.prefix_reused = Counter("specdec_prefix_cache_reused_tokens",
                                     "Prompt tokens whose keys/values were copied from the prefix cache, not computed", registry=r)
        self.prefix_bytes = Gauge("specdec_prefix_cache_bytes", "Bytes of prompt keys/values held by the prefix cache", registry=r)
        self.position_proposed = Counter(
            "specdec_draft_position_proposed", "Rounds that drafted a token at this position (1-based; the last pools the rest)",
            ["wire", "position"], registry=r)
        self.position_accepted = Counter(
            "specdec_draft_position_accepted", "Rounds whose draft token at this position was accepted", ["wire", "position"],
            registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Request start to first emitted token (OpenAI endpoints)",
                              ["endpoint"], buckets=_LATENCY_BUCKETS + (25.0, 60.0), registry=r)
        self.inter_token = Histogram("specdec_inter_token_seconds", "Mean time between tokens after the first, per request",
                                     ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.request_latency = Histogram("specdec_request_seconds", "End-to-end decoding time of one completion",
                                         ["endpoint"], buckets=_REQUEST_BUCKETS, registry=r)
        self.http_errors = Counter("specdec_http_errors", "Requests answered with an error status", ["status"], registry=r)
        self._proposed: dict[str, float] = {}
        self._accepted: dict[str, float] = {}

    def observe_verify(self, *, wire: str, lossless: bool, gamma: int, accepted: int, emitted: int, seconds: float,
                       unverified: int) -> None:
        self.verify_calls.labels(wire, str(lossless).lower()).inc()
        self.drafted.labels(wire).inc(gamma)
        self.accepted.labels(wire).inc(accepted)
        self.emitted.labels(wire).inc(emitted)
        if unverified:
            self.unverified.inc(unverified)
        self.tokens_per_call.labels(wire).observe(emitted)
        self.verify_latency.labels(wire).observe(seconds)
        self._count_positions(wire, [1] * gamma, [1] * accepted)
        self._acceptance(wire, gamma, accepted)

    def observe_generation(self, endpoint: str, stats: "GenerationStats") -> None:
        """One completion decoded on the server (OpenAI endpoints): speculative counters and latencies."""
        wire = "openai"
        self.verify_calls.labels(wire, str(stats.lossless).lower()).inc(stats.target_calls)
        self.drafted.labels(wire).inc(stats.draft_tokens_proposed)
        self.accepted.labels(wire).inc(stats.draft_tokens_accepted)
        self.emitted.labels(wire).inc(stats.generated_tokens)
        proposed = stats.proposed_per_position
        accepted = [round(a * n) for a, n in zip(stats.acceptance_per_position, proposed)]
        self._count_positions(wire, proposed, accepted)
        self._acceptance(wire, stats.draft_tokens_proposed, stats.draft_tokens_accepted)
        self.prompt_tokens.labels(endpoint).inc(stats.prompt_tokens)
        if stats.generated_tokens:
            self.ttft.labels(endpoint).observe(stats.ttft_s)
        if stats.generated_tokens > 1:
            self.inter_token.labels(endpoint).observe((stats.wall_s - stats.ttft_s) / (stats.generated_tokens - 1))
        self.request_latency.labels(endpoint).observe(stats.wall_s)

    def _count_positions(self, wire: str, proposed: list[int], accepted: list[int]) -> None:
        """``proposed[k]`` / ``accepted[k]``: rounds that drafted / accepted a token at position k+1."""
        for counter, counts in ((self.position_proposed, proposed), (self.position_accepted, accepted)):
            for k, n in enumerate(counts):
                if n:
                    counter.labels(wire, str(min(k + 1, _POSITIONS))).inc(n)

    def _acceptance(self, wire: str, proposed: int, accepted: int) -> None:
        self._proposed[wire] = self._proposed.get(wire, 0.0) + proposed
        self._accepted[wire] = self._accepted.get(wire, 0.0) + accepted
        if self._proposed[wire]:
            self.acceptance.labels(wire).set(self._accepted[wire] / self._proposed[wire])

    def render(self) -> bytes:
        return generate_latest(self.registry)
