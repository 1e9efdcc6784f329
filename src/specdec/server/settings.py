"""Server settings: one frozen dataclass, defaults here and nowhere else."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdec import defaults
from specdec.errors import ConfigError

if TYPE_CHECKING:
    from specdec.server.scheduler import SchedulerConfig


def past_bound(bound: int, *, gamma: str | int, tree: str | int) -> tuple[str, int] | None:
    """The first of a γ and a tree node count that drafts more than ``bound`` tokens a round (the
    server's --max-gamma), as (its name, its value); None where neither does ('auto', 'guide' and
    'chain' stay within it)."""
    for name, value in (("gamma", gamma), ("tree", tree)):
        if isinstance(value, int) and value > bound:
            return name, value
    return None


@dataclass(frozen=True)
class ServerSettings:
    #: bearer token every endpoint but /health (and the OpenAPI document) requires; None = open
    api_key: str | None = None
    #: more accepted keys (a key file); every session belongs to the key that created it
    api_keys: tuple[str, ...] = ()
    #: the name /v1/models and the OpenAI endpoints answer to (and responses carry)
    model_name: str = "target"
    #: more names the OpenAI endpoints answer to (vLLM's ``--served-model-name`` after the first)
    model_aliases: tuple[str, ...] = ()
    #: the longest context (prompt and output) a request or session may use; None = the model's own
    max_model_len: int | None = None
    max_sessions: int = 64  # the least recently used idle session is evicted past this
    session_ttl_s: float = 900.0  # idle sessions are dropped after this
    max_body_bytes: int = defaults.MAX_BODY_BYTES
    max_gamma: int = defaults.MAX_GAMMA
    #: OpenAI endpoints: max_tokens when a chat request gives none, and the draft length policy
    default_max_tokens: int = 256
    gamma: str | int = defaults.DEFAULT_GAMMA
    #: OpenAI endpoints: token trees (chain | auto | a node count); a request's ``tree`` overrides it
    tree: str | int = defaults.DEFAULT_TREE
    #: /metrics needs the API key too (default: open, so that Prometheus can scrape it)
    metrics_need_key: bool = False
    #: all sessions' KV caches together may hold at most this many bytes (503 + Retry-After past it)
    max_kv_bytes: int = defaults.SERVER_MAX_KV_BYTES
    #: positions a session's KV cache allocates first; it grows on demand
    kv_initial_length: int = defaults.SERVER_KV_INITIAL_LENGTH
    #: bytes of prompt keys/values kept for reuse by later prompts with the same beginning (0: off;
    #: exact, so only for batch-invariant targets: server/prefix_cache.py)
    prefix_cache_bytes: int = defaults.SERVER_PREFIX_CACHE_BYTES
    sweep_interval_s: float = defaults.SERVER_SWEEP_INTERVAL_S
    #: slow clients: time to send the request headers, and to send each part of the body
    header_timeout_s: float = defaults.SERVER_HEADER_TIMEOUT_S
    body_timeout_s: float = defaults.SERVER_BODY_TIMEOUT_S
    #: on Ctrl-C / SIGTERM: how long requests in flight may go on before they end with an error (0: at once)
    shutdown_timeout_s: float = defaults.SERVER_SHUTDOWN_TIMEOUT_S
    #: continuous batching (one forward pass for the pending work of all requests); False = one
    #: request's forward pass at a time under a lock (the serialised server, for comparisons)
    batching: bool = True
    #: with batching: verify only the draft positions worth a row of the busy pass (server/draft_cap.py)
    draft_cap: bool = True
    max_tokens_per_pass: int = defaults.SCHEDULER_MAX_TOKENS
    prefill_chunk: int = defaults.SCHEDULER_PREFILL_CHUNK
    max_queue: int = defaults.SCHEDULER_MAX_QUEUE
    #: with batching: before a pass, wait for the last pass's sequences while they keep arriving,
    #: at most this long after the latest (server/scheduler.py); 0 = start each pass at once
    gather_gap_s: float = defaults.SCHEDULER_GATHER_GAP_S
    #: OpenAI requests generating at once (429 + Retry-After past it)
    max_active_requests: int = defaults.SERVER_MAX_ACTIVE_REQUESTS
    #: Host names a keyless server answers to (loopback names are always accepted); DNS-rebinding guard
    allowed_hosts: tuple[str, ...] = ()
    #: put before every session id this server creates (a Ray Serve replica puts its own id there,
    #: so that a session's requests can be routed to the replica holding its KV cache)
    session_id_prefix: str = ""
    #: a chat request's own ``chat_template`` (vLLM's extension) replaces the model's; off: a 400
    trust_request_chat_template: bool = False
    #: a chat answer's ``<think>`` block goes to ``reasoning``: ``auto`` (where the tokenizer has both
    #: tags as tokens), ``think`` or ``none`` (see :mod:`specdec.server.reasoning`)
    reasoning_parser: str = "auto"

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the OpenAI endpoints answer to, the one responses carry first."""
        return (self.model_name, *(a for a in self.model_aliases if a != self.model_name))

    @property
    def keys(self) -> tuple[str, ...]:
        """Every accepted key (empty: the server is open, loopback only)."""
        return ((self.api_key,) if self.api_key is not None else ()) + tuple(k for k in self.api_keys if k != self.api_key)

    def __post_init__(self) -> None:
        for name in (self.model_name, *self.model_aliases):
            if not name.strip() or len(name) > 256:
                raise ConfigError(f"a served model name must be 1 to 256 characters and not blank, got {name!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max model length must be >= 2 (a prompt token and one to generate), got {self.max_model_len}")
        if self.max_sessions < 1:
            raise ConfigError(f"max sessions must be >= 1, got {self.max_sessions}")
        if not self.session_ttl_s > 0:
            raise ConfigError(f"session TTL must be > 0 seconds, got {self.session_ttl_s}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max body size must be >= 1024 bytes, got {self.max_body_bytes}")
        if not 1 <= self.max_gamma <= defaults.MAX_GAMMA:
            raise ConfigError(f"max gamma must be between 1 and {defaults.MAX_GAMMA}, got {self.max_gamma}")
        from specdec.engine import parse_tree

        parse_tree(self.tree)  # ConfigError with the accepted spellings
        over = past_bound(self.max_gamma, gamma=self.gamma, tree=self.tree)
        if over is not None:
            raise ConfigError(f"the server's {over[0]} ({over[1]}) drafts more than its max gamma ({self.max_gamma}) allows in a round")
        if self.default_max_tokens < 1:
            raise ConfigError(f"default max tokens must be >= 1, got {self.default_max_tokens}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key is empty")
        if any(not k.strip() for k in self.api_keys):
            raise ConfigError("an API key is empty")
        self._check_times()
        if not re.fullmatch(r"[A-Za-z0-9_.-]{0,64}", self.session_id_prefix):
            raise ConfigError(f"a session id prefix may hold only letters, digits, '_', '-' and '.', got {self.session_id_prefix!r}")
        if self.max_kv_bytes < 1:
            raise ConfigError(f"the key/value budget must be >= 1 byte, got {self.max_kv_bytes}")
        if self.prefix_cache_bytes < 0:
            raise ConfigError(f"the prefix cache size must be >= 0 bytes, got {self.prefix_cache_bytes}")
        if self.kv_initial_length < 1:
            raise ConfigError(f"the initial KV length must be >= 1, got {self.kv_initial_length}")
        if self.max_active_requests < 1:
            raise ConfigError(f"max active requests must be >= 1, got {self.max_active_requests}")
        self.scheduler_config()  # checks the batching limits

    def scheduler_config(self) -> "SchedulerConfig":
        from specdec.server.scheduler import SchedulerConfig

        return SchedulerConfig(max_tokens=self.max_tokens_per_pass, chunk=self.prefill_chunk, max_queue=self.max_queue,
                               gather_gap=self.gather_gap_s)

    def _check_times(self) -> None:
        for name in ("sweep_interval_s", "header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name.removesuffix('_s').replace('_', ' ')} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 <= self.shutdown_timeout_s < math.inf:
            raise ConfigError(f"shutdown timeout must be >= 0 seconds, got {self.shutdown_timeout_s}")
