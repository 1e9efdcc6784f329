"""Server settings: one frozen dataclass, defaults here and nowhere else."""

from __future__ import annotations

from dataclasses import dataclass

from specdec import defaults
from specdec.errors import ConfigError
from specdec.remote.protocol import DEFAULT_MAX_BODY_BYTES


@dataclass(frozen=True)
class ServerSettings:
    #: bearer token every endpoint but /health (and the OpenAPI document) requires; None = open
    api_key: str | None = None
    #: the name /v1/models and the OpenAI endpoints answer to
    model_name: str = "target"
    max_sessions: int = 64  # the least recently used idle session is evicted past this
    session_ttl_s: float = 900.0  # idle sessions are dropped after this
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_gamma: int = defaults.MAX_GAMMA
    #: OpenAI endpoints: max_tokens when a chat request gives none, and the draft length policy
    default_max_tokens: int = 256
    gamma: str | int = defaults.DEFAULT_GAMMA
    #: /metrics needs the API key too (default: open, so that Prometheus can scrape it)
    metrics_need_key: bool = False

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ConfigError(f"max sessions must be >= 1, got {self.max_sessions}")
        if not self.session_ttl_s > 0:
            raise ConfigError(f"session TTL must be > 0 seconds, got {self.session_ttl_s}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max body size must be >= 1024 bytes, got {self.max_body_bytes}")
        if not 1 <= self.max_gamma <= defaults.MAX_GAMMA:
            raise ConfigError(f"max gamma must be between 1 and {defaults.MAX_GAMMA}, got {self.max_gamma}")
        if self.default_max_tokens < 1:
            raise ConfigError(f"default max tokens must be >= 1, got {self.default_max_tokens}")
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("the API key is empty")
