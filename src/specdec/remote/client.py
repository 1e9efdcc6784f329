"""The edge's view of the cloud: :class:`RemoteVerifier`, a :class:`specdec.session.Verifier` over HTTP.

The decoding loop is the local one (:class:`specdec.decoder.SpeculativeDecoder`); only the target
side moves to the server.  Per round the edge sends ``{seq, draft_tokens, q?}`` and applies the
verdict to its mirror of the committed context.

Failure handling (lossless by default):

* a timeout or connection error is retried with the **same** ``seq`` (the server answers a repeated
  ``seq`` with the stored verdict, so a lost response costs nothing but time);
* a session the server no longer knows (404: evicted, expired, server restarted) is re-created
  with prompt + committed tokens and the round is sent again.  Greedy and coupled verdicts are
  pure functions of the committed context and the seed, so the output is the uninterrupted run's,
  token for token; token/block verification restarts the server's generator with a seed derived
  from the session seed and the committed length (fresh randomness: still exact in distribution).

Lossy options (off by default, counted as unverified tokens in every stat):

* ``lossy_timeout_commit_ms``: a common fallback: when the cloud has not answered
  within this many ms, commit the first draft token unverified and re-sync the session later;
* ``local_commit``: a predicate (see :mod:`specdec.remote.gating`) that lets the edge commit an
  easy draft block without a cloud call; the tokens travel to the server, unverified, with the
  next round.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import torch
from torch import Tensor

from specdec.drafters.base import Draft
from specdec.errors import ConfigError, SpecdecError
from specdec.remote.protocol import default_wire, wire_method
from specdec.sampling import SamplingConfig, StopFloor
from specdec.session import Outcome
from specdec.token_filter import TokenFilter
from specdec.verify import Rule, Verdict, get_rule

#: at most this many locally committed tokens wait for the next cloud call
MAX_PENDING_UNVERIFIED = 256
_SPLITMIX = 0x9E3779B97F4A7C15


class RemoteError(SpecdecError):
    """The cloud refused a request or could not be reached (one-line message for the CLI)."""


@dataclass(frozen=True)
class RemoteConfig:
    """Where the cloud is and how to talk to it."""

    url: str
    api_key: str | None = None
    wire: str | None = None  # greedy | coupled | sparse-q | lossy-scalar; None: greedy at T=0, else coupled
    method: str | None = None  # the cloud's rule; None: the wire mode's default
    timeout_s: float = 60.0  # per request (read) timeout
    connect_timeout_s: float = 5.0
    #: a round (or the session's creation), retries and back-off included, never takes longer
    #: than this; every attempt's timeout is cut to what is left of it
    retry_budget_s: float = 60.0
    backoff_s: float = 0.05  # first retry delay, doubled per retry ...
    max_backoff_s: float = 1.0  # ... up to this
    #: lossy: commit the first draft token when the cloud has not answered after this many ms
    lossy_timeout_commit_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"the remote URL must start with http:// or https://, got {self.url!r}")
        if self.lossy_timeout_commit_ms is not None and not self.lossy_timeout_commit_ms > 0:
            raise ConfigError(f"the lossy timeout must be > 0 ms, got {self.lossy_timeout_commit_ms}")
        for name in ("timeout_s", "connect_timeout_s", "retry_budget_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class RemoteStats:
    """What the edge measured about the wire (mutable; totals over the session's life)."""

    verify_calls: int = 0  # rounds the cloud answered (replays of a retry count once)
    session_creates: int = 0  # the first one included
    session_recreates: int = 0  # sessions the server lost and the edge re-created
    retries: int = 0
    bytes_up: int = 0  # JSON bodies sent (retries included)
    bytes_down: int = 0  # JSON bodies received
    wire_bytes_up: int = 0  # the same plus HTTP/1.1 request line and headers
    wire_bytes_down: int = 0  # the same plus status line and headers
    rtt_s: list[float] = field(default_factory=list)  # per verify round, retries included
    cloud_target_ms: float = 0.0  # the server's forward passes (summed)
    cloud_server_ms: float = 0.0  # the server's handling time of the verify calls
    session_prefill_ms: float = 0.0  # the server's prompt prefill(s)
    session_cached_tokens: int = 0  # prompt tokens the server's prefix cache copied for them
    unverified_tokens: int = 0  # lossy: committed without the cloud
    timeout_commits: int = 0  # lossy: rounds where the timeout fallback fired
    local_commits: int = 0  # lossy: rounds the gate committed locally

    @property
    def lossless(self) -> bool:
        return self.unverified_tokens == 0

    def summary(self) -> dict[str, Any]:
        rtts = sorted(self.rtt_s)

        def pct(q: float) -> float:
            return rtts[min(len(rtts) - 1, int(q * len(rtts)))] * 1e3 if rtts else 0.0

        calls = max(self.verify_calls, 1)
        return {
            "verify_calls": self.verify_calls,
            "session_creates": self.session_creates,
            "session_recreates": self.session_recreates,
            "retries": self.retries,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "wire_bytes_up": self.wire_bytes_up,
            "wire_bytes_down": self.wire_bytes_down,
            "rtt_ms": sum(rtts) / len(rtts) * 1e3 if rtts else 0.0,
            "rtt_ms_p50": pct(0.5),
            "rtt_ms_p95": pct(0.95),
            "cloud_prefill_ms": self.cloud_target_ms / calls,
            "cloud_prefill_ms_total": self.cloud_target_ms,
            "cloud_server_ms_total": self.cloud_server_ms,
            "session_prefill_ms": self.session_prefill_ms,
            "session_cached_tokens": self.session_cached_tokens,
            "unverified_tokens": self.unverified_tokens,
            "timeout_commits": self.timeout_commits,
            "local_commits": self.local_commits,
        }


@dataclass(frozen=True)
class RemoteTarget:
    """Stands in for the target on the edge: the decoder only reads its vocabulary and context."""

    vocab_size: int
    max_length: int
    name: str = "remote"

    def new_cache(self, max_length: int | None = None) -> Any:
        raise SpecdecError("the target is remote: pass a RemoteVerifier to generate()")

    def forward(self, tokens: Tensor, cache: Any, *, last_only: bool = False) -> Tensor:
        raise SpecdecError("the target is remote: pass a RemoteVerifier to generate()")


def _head_bytes_request(req: httpx.Request) -> int:
    line = len(req.method) + 1 + len(req.url.raw_path) + len(" HTTP/1.1\r\n")
    return line + sum(len(k) + len(v) + 4 for k, v in req.headers.raw) + 2


def _head_bytes_response(resp: httpx.Response) -> int:
    line = len(f"HTTP/1.1 {resp.status_code} {resp.reason_phrase}\r\n")
    return line + sum(len(k) + len(v) + 4 for k, v in resp.headers.raw) + 2


def _error_message(resp: httpx.Response) -> str:
    """The server's error message, made safe to print: on one line, without control characters (a
    message holding terminal escapes could rewrite the line it is printed on) or HTML tags, short."""
    try:
        text = str(resp.json()["error"]["message"])
    except Exception:  # noqa: BLE001 - not our server, or not JSON
        text = re.sub(r"<[^>]*>", " ", resp.text[:2000])
    text = " ".join(re.sub(r"[\x00-\x1f\x7f-\x9f]", " ", text).split())
    return (text[:297] + "...") if len(text) > 300 else text or resp.reason_phrase


#: the largest reply body the edge reads (a verdict is a few kilobytes; logprobs add a few more)
MAX_REPLY_BYTES = 64 << 20


def _reply(resp: httpx.Response, what: str) -> dict[str, Any]:
    """A 200 reply's JSON object, or a RemoteError saying it is not one."""
    try:
        data = resp.json()
    except ValueError:
        raise RemoteError(f"the server's reply to {what} is not JSON ({len(resp.content)} bytes)") from None
    if not isinstance(data, dict):
        raise RemoteError(f"the server's reply to {what} is not a JSON object")
    return data


def _whole(data: dict[str, Any], key: str, what: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    """``data[key]`` as a JSON integer in [lo, hi] (not a bool, a float or a numeric string, which
    ``int()`` would have turned into some integer), or a RemoteError naming it."""
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise RemoteError(f"the server's reply to {what} has a bad {key!r}: {json.dumps(value)[:80]}")
    return value


def _millis(data: dict[str, Any], key: str, what: str) -> float:
    """A timing figure of a reply (0 when absent): a finite number >= 0, or a RemoteError (a NaN one
    made the edge's --json output invalid JSON)."""
    value = data.get(key, 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < float("inf"):
        raise RemoteError(f"the server's reply to {what} has a bad {key!r}: {json.dumps(value)[:80]}")
    return float(value)


def derived_seed(seed: int, committed: int) -> int:
    """A fresh generator seed for a re-created token/block session (independent of the first one's)."""
    x = (seed * _SPLITMIX + committed + 1) & ((1 << 64) - 1)
    x ^= x >> 31
    return x & ((1 << 63) - 1)


def wire_options(sampling: SamplingConfig, floor_ids: frozenset[int] = frozenset()) -> dict[str, Any]:
    """What a session body carries of ``sampling`` beyond temperature, truncation and penalties:
    its logit bias, min_tokens over ``floor_ids`` (the edge's end-of-sequence and stop token ids),
    and a constraint made of allowed ids and bad words (a :class:`~specdec.token_filter.TokenFilter`)
    and a grammar (a :class:`~specdec.grammar.GrammarConstraint`, alone or under the filter), possibly
    under the :class:`~specdec.sampling.StopFloor` that ``floor_stops`` makes.  Any other constraint
    is refused: the server could not apply it, and verifying without it would give the
    unconstrained target's law."""
    constraint, min_tokens, floor = sampling.constraint, sampling.min_tokens, frozenset(floor_ids)
    if isinstance(constraint, StopFloor):
        if min_tokens:
            raise ConfigError("min_tokens given twice: as a number and as a floor already applied")
        min_tokens, floor, constraint = constraint.n, frozenset(constraint.stop_ids), constraint.inner
    from specdec.grammar import GrammarConstraint  # llguidance itself loads only when a grammar is made

    token_filter = constraint if isinstance(constraint, TokenFilter) else None
    inner = constraint.inner if token_filter is not None else constraint
    if inner is not None and not isinstance(inner, GrammarConstraint):
        raise ConfigError("over the wire a constraint may be allowed token ids, bad words and a grammar"
                          f" (specdec.grammar.GrammarConstraint), not {type(inner).__name__}: run it locally")
    body: dict[str, Any] = {}
    if sampling.logit_bias:
        body["logit_bias"] = [[int(t), float(b)] for t, b in sampling.logit_bias]
    if min_tokens and floor:
        body.update(min_tokens=int(min_tokens), floor_ids=sorted(floor))
    if token_filter is not None:
        if token_filter.allowed_ids is not None:
            body["allowed_token_ids"] = list(token_filter.allowed_ids)
        if token_filter.banned:
            body["bad_token_ids"] = [list(seq) for seq in token_filter.banned]
    if inner is not None:
        body["grammar"] = inner.grammar
    return body


class RemoteVerifier:
    """Implements :class:`specdec.session.Verifier` by calling a specdec server.

    ``sampling.seed`` must be set (the decoder must use the same seed: coupled drafting keys its
    Gumbel noise on it).  Creating the verifier creates the server session (and its prefill).
    """

    def __init__(
        self,
        cfg: RemoteConfig,
        prompt: Tensor | list[int],
        sampling: SamplingConfig,
        *,
        max_new_tokens: int | None = None,
        client: httpx.Client | None = None,
        local_commit: Callable[[Draft], bool] | None = None,
        floor_ids: frozenset[int] = frozenset(),
        logprobs: int | None = None,
        vocab_digest: str | None = None,
        edge_vocab: int | None = None,
    ) -> None:
        """``vocab_digest``: the edge tokenizer's :func:`specdec.tokenizer.vocab_digest`; the server
        refuses the session when its own tokenizer's differs (None: not checked).  ``edge_vocab``:
        the ids the edge can draft and decode (its draft model's vocabulary, else its tokenizer's);
        a token the server sends past it is an error (None: the server's vocabulary bounds them)."""
        self.edge_vocab = edge_vocab
        if sampling.seed is None:
            raise ConfigError("a remote session needs a fixed seed (the edge and the cloud must share it)")
        self.cfg = cfg
        self.sampling = sampling
        self._options = wire_options(sampling, floor_ids)  # refused here, before the server is asked
        if logprobs is not None:
            if not 0 <= logprobs <= 20:
                raise ConfigError(f"logprobs must be between 0 and 20, got {logprobs}")
            if local_commit is not None or cfg.lossy_timeout_commit_ms:
                raise ConfigError("logprobs come from the server's target, which never scores tokens committed"
                                  " without it: no lossy local commits with logprobs")
            self._options["logprobs"] = logprobs
        if vocab_digest is not None:
            self._options["vocab_digest"] = vocab_digest
        #: each committed token's (log-probability, [(id, log-probability)] best) from the server's
        #: target (-9999.0 for a removed token), when created with ``logprobs``
        self.emitted_logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.logprobs = logprobs
        self.wire = cfg.wire or default_wire(sampling.temperature)
        try:
            self.method = wire_method(self.wire, cfg.method) if self.wire in _WIRES else None
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.method is None:
            raise ConfigError(f"unknown wire mode {self.wire!r}; choose from: {', '.join(_WIRES)}")
        if self.wire == "greedy" and not sampling.greedy:
            raise ConfigError("wire mode greedy needs temperature 0")
        self.rule: Rule = get_rule(self.method)
        self.stats = RemoteStats()
        self.local_commit = local_commit
        self._prompt = torch.as_tensor(prompt, dtype=torch.long).reshape(-1).tolist()
        if not self._prompt:
            raise ConfigError("the prompt is empty")
        self._budget = max_new_tokens if max_new_tokens is not None else sampling.max_new_tokens
        self._base = cfg.url.rstrip("/")
        if self._base.endswith("/v1"):  # an OpenAI-style base URL: the session API lives at <server>/v1/sessions
            self._base = self._base[: -len("/v1")]
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if cfg.api_key:
            headers["Authorization"] = f"Bearer {cfg.api_key}"
        self._headers = headers
        self._owns_client = client is None
        self._http = client or httpx.Client(
            timeout=httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(max_keepalive_connections=2, keepalive_expiry=60.0),
        )
        self._session: str | None = None
        self._seq = 0
        self._pending: list[int] = []  # locally committed tokens the server has not seen yet
        self._ctx = torch.empty(0, dtype=torch.long)
        self._n = 0
        self._round_start = (0, 0, 0, 0, 0)
        #: most draft tokens worth sending next round: a busy batching server verified only
        #: ``metrics.gamma`` tokens of the last draft (``capped_from``), so send one more than that
        #: (to notice when the cap lifts) instead of drafting tokens it will not look at; None = no cap
        self.gamma_limit: int | None = None
        self._create(resume=False)

    # ------------------------------------------------------------------ Verifier

    @property
    def context(self) -> Tensor:
        """[L] int64: prompt + every committed token (the edge's mirror of the session)."""
        return self._ctx[: self._n]

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def lossless(self) -> bool:
        return self.rule.lossless and self.stats.lossless

    def verify(self, draft: Draft) -> Outcome:
        """One round: send the draft with the next ``seq``, apply the cloud's verdict."""
        started = time.perf_counter()
        self._round_start = (self.stats.bytes_up, self.stats.bytes_down, self.stats.wire_bytes_up,
                             self.stats.wire_bytes_down, self.stats.retries)
        gamma = draft.tokens.numel()
        tree = draft.parents is not None
        if tree and self.wire == "lossy-scalar":
            raise ConfigError("token trees need a wire mode that sends whole rows of q (sparse-q) or none; not lossy-scalar")
        if (
            self.local_commit is not None
            and not tree  # the gate judges a chain's tokens in order; a tree always goes to the cloud
            and gamma > 0
            and len(self._pending) + gamma <= MAX_PENDING_UNVERIFIED
            and self.local_commit(draft)
        ):
            self.stats.local_commits += 1
            return self._commit_unverified(draft.tokens, started, "local_commit")
        drafted = draft.tokens.tolist()
        payload: dict[str, Any] = {"draft_tokens": drafted}
        parents: list[int] | None = None
        if tree:  # ids + one parent index per node (+ how siblings were drawn, for sampled trees)
            parents = draft.parents.tolist()  # type: ignore[union-attr]
            payload["parents"] = parents
            if draft.probs is not None:
                payload["siblings"] = draft.siblings
        q = self._q_payload(draft)
        if q is not None:
            payload["q"] = q
        lossy_s = self.cfg.lossy_timeout_commit_ms / 1e3 if self.cfg.lossy_timeout_commit_ms else None
        # the lossy deadline only where there is a drafted token to commit at it: an empty round has
        # nothing to fall back on, and cutting its retries to the passed deadline left each 1 ms
        deadline = started + lossy_s if lossy_s is not None and gamma > 0 else None
        attempts = 0
        lost = 0
        while True:
            try:
                if self._session is None:
                    self._create(resume=True, deadline=deadline)
                body = dict(payload, seq=self._seq)
                if self._pending:
                    body["unverified_tokens"] = self._pending
                timeout = self._attempt_timeout(started)
                if deadline is not None:
                    timeout = max(1e-3, min(timeout, deadline - time.perf_counter()))
                resp = self._exchange("POST", f"/v1/sessions/{self._session}/verify", body, timeout)
            except (httpx.TransportError, _DeadlinePassed) as exc:
                failure: Exception = exc
            else:
                status = resp.status_code
                if status == 200:
                    return self._apply(_reply(resp, f"round {self._seq}"), drafted, started, parents)
                if status == 404 and self._session is not None:
                    lost += 1
                    if lost > 3:
                        raise RemoteError(f"the server keeps losing the session: {_error_message(resp)}")
                    self._session = None  # re-created (with everything committed so far) on the next pass
                    self.stats.session_recreates += 1
                    continue
                if status not in (429, 502, 503, 504):
                    raise RemoteError(f"the server refused round {self._seq}: HTTP {status}: {_error_message(resp)}")
                failure = RemoteError(f"HTTP {status}")
            # a lost connection, a busy server or the deadline: retried, or past a lossy deadline committed
            attempts += 1
            self.stats.retries += 1
            if deadline is not None and time.perf_counter() >= deadline:
                self.stats.timeout_commits += 1
                self._abandon_session()
                return self._commit_unverified(draft.tokens[:1], started, "timeout_commit")
            self._wait(attempts, started, failure, deadline)

    def close(self) -> None:
        """Delete the server session (best effort) and close the connection pool if we own it."""
        if self._session is not None:
            try:
                self._http.request("DELETE", f"{self._base}/v1/sessions/{self._session}", headers=self._headers, timeout=2.0)
            except httpx.HTTPError:
                pass
            self._session = None
        if self._owns_client:
            self._http.close()

    def __enter__(self) -> "RemoteVerifier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _exchange(self, method: str, path: str, payload: dict[str, Any] | None, timeout: float) -> httpx.Response:
        """One HTTP exchange, counted in bytes (payload and estimated on-the-wire)."""
        body = json.dumps(payload, separators=(",", ":")).encode() if payload is not None else b""
        # (connect, read, write, pool) as a tuple: a client of another httpx build (Starlette's test
        # client on httpx2) refuses this module's httpx.Timeout, and both take the tuple
        limits = (min(timeout, self.cfg.connect_timeout_s), timeout, timeout, timeout)
        req = self._http.build_request(method, self._base + path, content=body or None, headers=self._headers,
                                       timeout=limits)
        self.stats.bytes_up += len(body)
        self.stats.wire_bytes_up += _head_bytes_request(req) + len(body)
        # httpx's read timeout bounds each read, not the reply: a server that drips a byte a second
        # never hit it, and --remote-timeout did not hold. The body is read against one deadline.
        deadline = time.perf_counter() + timeout
        resp = self._http.send(req, stream=True)
        try:
            chunks, size = [], 0
            for chunk in resp.iter_bytes():
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_REPLY_BYTES:
                    raise RemoteError(f"the server's reply is larger than {MAX_REPLY_BYTES >> 20} MiB")
                if time.perf_counter() > deadline:
                    raise httpx.ReadTimeout(f"the reply took longer than {timeout:.3g} s", request=req)
        finally:
            resp.close()
        headers = [(k, v) for k, v in resp.headers.raw if k.lower() not in (b"content-encoding", b"transfer-encoding")]
        resp = httpx.Response(resp.status_code, headers=headers, content=b"".join(chunks), request=req)
        self.stats.bytes_down += len(resp.content)
        self.stats.wire_bytes_down += _head_bytes_response(resp) + len(resp.content)
        return resp

    def _attempt_timeout(self, started: float) -> float:
        """One attempt's timeout: the per-request timeout, cut to what is left of the retry window."""
        left = self.cfg.retry_budget_s - (time.perf_counter() - started)
        if left <= 0:
            raise RemoteError(f"the server at {self._base} did not answer within {self.cfg.retry_budget_s:g} s; giving up")
        return min(self.cfg.timeout_s, left)

    def _wait(self, attempts: int, started: float, exc: Exception, deadline: float | None = None) -> None:
        """Back off before the next attempt (never past ``deadline``, a round's own), or give up if
        that would leave the retry window."""
        delay = min(self.cfg.max_backoff_s, self.cfg.backoff_s * 2 ** (attempts - 1))
        if deadline is not None:
            delay = max(0.0, min(delay, deadline - time.perf_counter()))
        waited = time.perf_counter() - started
        if waited + delay >= self.cfg.retry_budget_s:
            raise RemoteError(
                f"the server at {self._base} did not answer within {self.cfg.retry_budget_s:g} s"
                f" ({type(exc).__name__}); giving up"
            )
        time.sleep(delay)

    def _create(self, *, resume: bool, deadline: float | None = None) -> None:
        """Create the session (``resume``: again, with every committed token as ``generated_ids``)."""
        committed = self.context.tolist()[len(self._prompt):] if resume else []
        seed = int(self.sampling.seed)  # type: ignore[arg-type]
        if resume and self.rule.draft_sampling == "multinomial":
            seed = derived_seed(seed, len(committed))  # the restarted generator must not replay old uniforms
        s = self.sampling
        body: dict[str, Any] = {
            "prompt_ids": self._prompt,
            "generated_ids": committed,
            "temperature": s.temperature,
            "top_k": s.top_k,
            "top_p": s.top_p,
            "min_p": s.min_p,
            "repetition_penalty": s.repetition_penalty,
            "frequency_penalty": s.frequency_penalty,
            "presence_penalty": s.presence_penalty,
            "seed": seed,
            "wire": self.wire,
            "method": self.method,
            "max_new_tokens": max(1, self._budget - len(committed)),
            **self._options,
        }
        started = time.perf_counter()
        attempts = 0
        while True:
            try:
                if deadline is not None:
                    timeout = deadline - time.perf_counter()
                    if timeout <= 0:
                        raise _DeadlinePassed()
                else:
                    timeout = self._attempt_timeout(started)
                resp = self._exchange("POST", "/v1/sessions", body, timeout)
            except httpx.TransportError as exc:
                if deadline is not None:
                    raise
                if not resume and isinstance(exc, httpx.ConnectError):
                    # nothing listens there (refused, unknown host): waiting will not help
                    raise RemoteError(
                        f"cannot connect to {self._base} ({exc}); is `specdec serve` running there?"
                    ) from None
                attempts += 1
                self.stats.retries += 1
                self._wait(attempts, started, exc)
                continue
            if resp.status_code in (200, 201):
                break
            if resp.status_code in (429, 502, 503, 504):  # within the deadline, if any (checked next pass)
                attempts += 1
                self.stats.retries += 1
                self._wait(attempts, started, RemoteError(f"HTTP {resp.status_code}"), deadline)
                continue
            raise RemoteError(f"the server refused the session: HTTP {resp.status_code}: {_error_message(resp)}")
        what = "the session's creation"
        data = _reply(resp, what)
        if data.get("prompt_ids") != self._prompt:
            raise RemoteError("the server's session does not hold the prompt the edge sent")
        sid = data.get("session_id")
        if not isinstance(sid, str) or not 0 < len(sid) <= 256 or not sid.isprintable() or "/" in sid:
            raise RemoteError(f"the server's reply to {what} has a bad 'session_id': {json.dumps(sid)[:80]}")
        # the session must be the one asked for: its rule decides exactness (a lossy one the edge did
        # not ask for was reported lossless), its seed reproducibility
        if _whole(data, "seed", what) != seed:
            raise RemoteError(f"the server's session samples with seed {data['seed']}, not the {seed} the edge sent")
        try:
            same_rule = data.get("wire") == self.wire and get_rule(str(data.get("method"))).name == self.rule.name
        except (ValueError, SpecdecError):
            same_rule = False
        if not same_rule or data.get("lossless") is not self.rule.lossless:
            raise RemoteError(f"the server's session verifies with wire {data.get('wire')!r} and rule"
                              f" {data.get('method')!r} (lossless: {data.get('lossless')!r}), not the {self.wire} /"
                              f" {self.rule.name} the edge asked for")
        vocab = _whole(data, "vocab_size", what, lo=1)
        max_context = _whole(data, "max_context", what, lo=1)
        max_gamma = _whole(data, "max_gamma", what, lo=1)
        max_length = _whole(data, "max_length", what, lo=len(self._prompt) + len(committed) + 1, hi=1 << 24)
        prefill_ms = _millis(data, "prefill_ms", what)
        cached = data.get("cached_prompt_tokens", 0)
        cached = _whole(data, "cached_prompt_tokens", what) if cached else 0
        self._session = sid
        self._seq = 0
        self._pending = []
        self.stats.session_creates += 1
        self.stats.session_prefill_ms += prefill_ms
        self.stats.session_cached_tokens += cached
        if not resume:
            self.vocab_size = vocab
            # ids the edge accepts: inside the server's vocabulary and its own (an id past the edge's
            # was printed as no text, or failed in the draft's embedding)
            self._token_bound = min(vocab, self.edge_vocab) if self.edge_vocab is not None else vocab
            self.max_context = max_context
            #: the longest draft (chain tokens or tree nodes) the server verifies in one round
            #: (its --max-gamma); the decoder drafts no more, since a longer one is refused
            self.max_draft = max_gamma
            self.seed = seed
            self.model_name = str(data.get("model", "remote"))[:256]
            self._max_length = max_length
            self._ctx = torch.empty(self._max_length, dtype=torch.long)
            self._ctx[: len(self._prompt)] = torch.tensor(self._prompt, dtype=torch.long)
            self._n = len(self._prompt)

    def _abandon_session(self) -> None:
        """Forget the current session (its state is unknown after a lossy timeout); delete it in the background."""
        sid, self._session = self._session, None
        if sid is None:
            return

        def delete() -> None:  # its own connection: the edge's client stays single-threaded
            try:
                httpx.request("DELETE", f"{self._base}/v1/sessions/{sid}", headers=self._headers, timeout=2.0)
            except Exception:  # noqa: BLE001 - best effort; the server's TTL collects it anyway
                pass

        threading.Thread(target=delete, daemon=True).start()

    def _q_payload(self, draft: Draft) -> list[Any] | None:
        """What the wire mode sends besides the ids: sparse rows of q, or one q(x_i) per token."""
        gamma = draft.tokens.numel()
        if self.wire in ("greedy", "coupled") or gamma == 0:
            return None
        probs = draft.probs  # [γ, V] or None (a deterministic drafter: q is one-hot)
        if self.wire == "lossy-scalar":
            if probs is None:
                return [1.0] * gamma
            return probs[torch.arange(gamma), draft.tokens].tolist()
        if probs is None:
            return [{"ids": [t], "probs": [1.0]} for t in draft.tokens.tolist()]
        rows = []
        for i in range(gamma):
            ids = probs[i].nonzero().flatten()  # [k]
            rows.append({"ids": ids.tolist(), "probs": probs[i, ids].tolist()})
        return rows

    def _append(self, tokens: list[int]) -> None:
        k = len(tokens)
        if self._n + k > self._ctx.numel():
            raise RemoteError("the sequence outgrew the session's context")
        self._ctx[self._n : self._n + k] = torch.tensor(tokens, dtype=torch.long)
        self._n += k

    def _apply(self, data: dict[str, Any], drafted: list[int], started: float, parents: list[int] | None = None) -> Outcome:
        what = f"round {self._seq}"
        n = _whole(data, "num_accepted", what, hi=len(drafted))  # a negative count looped for ever
        raw_tokens = data.get("tokens")
        if not isinstance(raw_tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in raw_tokens):
            raise RemoteError(f"the server's reply to {what} has a bad 'tokens': {json.dumps(raw_tokens)[:80]}")
        tokens = list(raw_tokens)
        m = data.get("metrics", {})
        if not isinstance(m, dict):
            raise RemoteError(f"the server's reply to {what} has a bad 'metrics': {json.dumps(m)[:80]}")
        path: tuple[int, ...] | None = None
        if parents is not None:  # a tree: the accepted nodes must form a root path of the draft
            raw = data.get("path")
            path = tuple(raw) if isinstance(raw, list) and all(type(i) is int for i in raw) else None
            ok = path is not None and len(path) == n and all(0 <= i < len(drafted) for i in path) and all(
                parents[i] == (path[j - 1] if j else -1) for j, i in enumerate(path)
            )
            expected = [drafted[i] for i in path] if ok and path is not None else None
        else:
            expected = drafted[:n]
        if (
            data.get("seq") != self._seq
            or len(tokens) != n + 1
            or expected is None
            or tokens[:n] != expected
        ):
            raise RemoteError(f"the server's verdict for round {self._seq} is inconsistent with the draft")
        past = next((t for t in tokens if not 0 <= t < self._token_bound), None)
        if past is not None:
            raise RemoteError(f"the server sent token id {past} in round {self._seq}, outside the vocabulary"
                              f" [0, {self._token_bound}) the edge decodes")
        if self.logprobs is not None:
            rows = data.get("logprobs")
            if not isinstance(rows, list) or len(rows) != len(tokens):
                raise RemoteError(f"the server sent no log-probabilities for round {self._seq}'s {len(tokens)} tokens")
            try:
                got = [(float(r["logprob"]), [(int(i), float(v)) for i, v in r.get("top", [])]) for r in rows]
            except (KeyError, TypeError, ValueError, AttributeError):
                raise RemoteError(f"the server's log-probabilities for round {self._seq} are malformed") from None
            if not all(math.isfinite(lp) and all(math.isfinite(v) for _, v in top) for lp, top in got):
                raise RemoteError(f"the server's log-probabilities for round {self._seq} are malformed")
            self.emitted_logprobs += got
        self._seq += 1
        self._pending = []
        self._append(tokens)
        committed = m.get("committed")
        if committed is not None and committed != self._n - len(self._prompt):
            raise RemoteError(
                f"the server's session holds {committed} committed tokens but the edge has {self._n - len(self._prompt)}"
            )
        rtt = time.perf_counter() - started
        target_ms, server_ms, verify_ms = (_millis(m, key, what) for key in ("target_ms", "server_ms", "verify_ms"))
        if parents is None:
            capped = m.get("capped_from") is not None
            self.gamma_limit = _whole(m, "gamma", what, hi=1 << 16) + 1 if capped else None
        self.stats.verify_calls += 1
        self.stats.rtt_s.append(rtt)
        self.stats.cloud_target_ms += target_ms
        self.stats.cloud_server_ms += server_ms
        verdict = Verdict(num_accepted=n, tokens=torch.tensor(tokens, dtype=torch.long), path=path)
        up, down, wire_up, wire_down, retries = self._round_start
        metrics = {  # this round's figures
            "rtt_ms": rtt * 1e3,
            "cloud_prefill_ms": target_ms,
            "server_ms": server_ms,
            "bytes_up": self.stats.bytes_up - up,
            "bytes_down": self.stats.bytes_down - down,
            "wire_bytes_up": self.stats.wire_bytes_up - wire_up,
            "wire_bytes_down": self.stats.wire_bytes_down - wire_down,
            "retries": self.stats.retries - retries,
            "unverified": 0,
        }
        return Outcome(verdict=verdict, target_s=rtt, verify_s=verify_ms / 1e3, metrics=metrics)

    def _commit_unverified(self, tokens: Tensor, started: float, reason: str) -> Outcome:  # tokens: [k]
        """Lossy: keep ``tokens`` without the cloud (the last one plays the 'next token')."""
        toks = tokens.tolist()
        self._append(toks)
        if self._session is not None:
            self._pending.extend(toks)  # the server appends them, unverified, with the next round
        self.stats.unverified_tokens += len(toks)
        verdict = Verdict(num_accepted=len(toks) - 1, tokens=tokens.clone())
        elapsed = time.perf_counter() - started
        return Outcome(verdict=verdict, target_s=elapsed, verify_s=0.0, metrics={"unverified": len(toks), reason: True})


class _DeadlinePassed(Exception):
    """The lossy timeout ran out before a request could be sent."""


_WIRES = ("greedy", "coupled", "sparse-q", "lossy-scalar")
