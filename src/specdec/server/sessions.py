"""Server-side edge sessions: one :class:`TargetSession` per edge sequence, plus ``seq`` bookkeeping.

Every request is validated completely before the session is touched, so a bad request leaves it
exactly as it was.  ``seq`` makes a round idempotent: the verdict of the last round is stored, a
retry of that ``seq`` returns it again, any other out-of-order ``seq`` is a 409.
"""

from __future__ import annotations

import dataclasses

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
from torch import Tensor

from specdec.drafters.base import Draft
from specdec.errors import SpecdecError
from specdec.models.base import LanguageModel
from specdec.remote.protocol import (
    CreateSessionRequest,
    CreateSessionResponse,
    SessionInfo,
    SparseRow,
    TokenLogprob,
    VerifyMetrics,
    VerifyRequest,
    VerifyResponse,
    default_wire,
    wire_method,
)
from specdec.sampling import SamplingConfig, checked_bias, floor_stops
from specdec.server.compute import COMPUTE
from specdec.server.errors import ApiError
from specdec.server.served import ServedModel, compact_kw
from specdec.server.settings import ServerSettings
from specdec.session import TargetSession
from specdec.token_filter import TokenFilter
from specdec.tree import depths
from specdec.verify import Rule, Verdict, get_rule

log = logging.getLogger("specdec.server")

#: the forward-pass lock shared by every model a server process holds
FORWARD_LOCK = threading.Lock()


class SerializedModel(ServedModel):
    """A :class:`LanguageModel` whose forward passes run one at a time under a shared lock, on the
    process's compute thread (:mod:`specdec.server.compute`).

    Sessions are independent, but the model objects are not meant for concurrent forwards (and
    on a small CPU box running two at once only thrashes the cores).  Caches stay per session.
    """

    def __init__(self, model: LanguageModel, lock: threading.Lock = FORWARD_LOCK, *, initial_length: int | None = None,
                 prefix_cache: Any | None = None) -> None:
        super().__init__(model, initial_length=initial_length, prefix_cache=prefix_cache)
        self.lock = lock

    def _forward(self, tokens: Tensor, cache: Any, *, last_only: bool = False, compact: bool = False) -> Tensor:  # tokens: [n]
        return self._alone(self.inner.forward, tokens, cache, last_only=last_only, **compact_kw(compact))

    def _alone(self, fn: Any, *args: Any, **kw: Any) -> Any:
        return COMPUTE.run_locked(self.lock, fn, *args, **kw)

    def forward_features(self, tokens: Tensor, cache: Any, taps: Any, **kw: Any) -> tuple[Tensor, Tensor]:
        return self._alone(self._features_fn(), tokens, cache, taps, **kw)


def serialized(model: LanguageModel, lock: threading.Lock = FORWARD_LOCK, *, initial_length: int | None = None,
               prefix_cache: Any | None = None) -> LanguageModel:
    if isinstance(model, SerializedModel):
        return model
    return SerializedModel(model, lock, initial_length=initial_length, prefix_cache=prefix_cache)


def cache_bytes(cache: Any) -> int:
    """Bytes a session's cache holds now (0 for caches that do not say)."""
    return int(getattr(cache, "nbytes", 0) or 0)


def growth_bytes(cache: Any, n: int) -> int:
    """Bytes a cache would add to hold ``n`` more positions (0 for caches that do not grow)."""
    fn = getattr(cache, "growth_bytes", None)
    return int(fn(n)) if fn is not None else 0


# ----------------------------------------------------------------------------- unverified appends


def _commit_all(
    draft_tokens: Tensor,  # [k] int64
    draft_probs: Tensor | None,  # unused
    target_probs: Tensor,  # [k+1, V] unused
    *,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Keep every given token (no verification): the lossy edge's locally committed tokens."""
    return Verdict(num_accepted=draft_tokens.numel() - 1, tokens=draft_tokens.clone())


_APPEND = Rule("lossy_append", _commit_all, False, "argmax", False, needs_target_probs=False)


def append_unverified(session: TargetSession, tokens: Tensor) -> None:  # tokens: [k] int64, k >= 1
    """Append ``tokens`` to ``session`` without verification (one forward pass of k + 1 positions).

    Uses the session's own round machinery with a rule that keeps everything, so the cache,
    context and penalty state move exactly as if the tokens had been accepted.
    """
    rule = session.rule
    session.rule = _APPEND
    try:
        session.verify(Draft(tokens=tokens, probs=None))
    finally:
        session.rule = rule


# ----------------------------------------------------------------------------- one session


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(7), "little")


def _fingerprint(req: VerifyRequest) -> bytes:
    return hashlib.blake2b(req.model_dump_json(exclude={"seq"}).encode(), digest_size=16).digest()


@dataclass
class EdgeSession:
    """A sequence the edge is decoding: the target's state plus the round counter."""

    id: str
    wire: str
    rule: Rule
    seed: int
    target: TargetSession
    prompt_tokens: int
    resumed_tokens: int
    #: the context length this session may reach (prompt + resumed + its max_new_tokens)
    limit: int = 0
    #: who made it (a digest of the API key; "" on a keyless server): only they may use it
    owner: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_seq: int = 0
    unverified: int = 0
    last_reply: VerifyResponse | None = None
    last_fingerprint: bytes = b""
    last_used: float = field(default_factory=time.monotonic)
    #: why no round can follow (a round failed after committing its unverified tokens), or None
    broken: str | None = None

    @property
    def lossless(self) -> bool:
        return self.rule.lossless and self.unverified == 0

    @property
    def committed(self) -> int:
        """Tokens committed after the prompt (those of a resumed sequence included)."""
        return self.target.context.numel() - self.prompt_tokens

    def info(self) -> SessionInfo:
        return SessionInfo(
            session_id=self.id,
            wire=self.wire,  # type: ignore[arg-type]
            method=self.rule.name,
            lossless=self.lossless,
            next_seq=self.next_seq,
            prompt_tokens=self.prompt_tokens,
            committed=self.committed,
            unverified=self.unverified,
            max_length=self.target.max_length,
            idle_s=time.monotonic() - self.last_used,
        )

    # ------------------------------------------------------------------ verification

    def verify(self, req: VerifyRequest, settings: ServerSettings, *, draft_cap: int | None = None) -> VerifyResponse:
        """One round (call with ``self.lock`` held).  Raises :class:`ApiError` before any change.

        ``draft_cap``: verify at most this many leading tokens of a chain draft (a busy batching
        server's choice, see :mod:`specdec.server.draft_cap`): the answer is exactly that of the
        shorter draft, so every rule stays lossless."""
        started = time.perf_counter()
        if self.last_reply is not None and req.seq == self.next_seq - 1:
            if _fingerprint(req) != self.last_fingerprint:
                raise ApiError(
                    409,
                    f"seq {req.seq} was already verified with a different draft; the next round is seq {self.next_seq}",
                )
            reply = self.last_reply
            return reply.model_copy(update={"metrics": reply.metrics.model_copy(update={"replayed": True})})
        if self.broken is not None:
            raise ApiError(409, self.broken)
        if req.seq != self.next_seq:
            expected = f"seq {self.next_seq}" + (f" (or {self.next_seq - 1} to repeat the last round)" if self.next_seq else "")
            raise ApiError(409, f"out-of-order seq {req.seq}: this session expects {expected}")
        draft, forced = self._check(req, settings)
        capped_from = None
        if draft_cap is not None and draft.parents is None and draft.tokens.numel() > draft_cap:
            capped_from = draft.tokens.numel()
            draft = dataclasses.replace(draft, tokens=draft.tokens[:draft_cap],
                                        probs=None if draft.probs is None else draft.probs[:draft_cap])
        if forced is not None:
            self._guarded(lambda: append_unverified(self.target, forced))
            self.unverified += forced.numel()
        left = self.limit - self.target.context.numel()  # >= 1, checked
        scored = len(self.target.emitted_logprobs)
        try:
            outcome = self._guarded(lambda: self.target.verify(draft, max_tokens=left))
        except Exception:
            if forced is not None:  # they stay committed, so the round cannot be repeated as sent
                self.broken = (
                    f"round {req.seq} failed after its {forced.numel()} unverified token(s) were committed, so this"
                    " session cannot go on; create a new one with generated_ids to resume the sequence"
                )
            raise
        verdict = outcome.verdict
        tokens = verdict.tokens.tolist()
        logprobs = None
        if self.target.logprobs is not None:  # -inf (a removed token) as OpenAI writes it: JSON has no infinity
            logprobs = [TokenLogprob(logprob=max(lp, -9999.0), top=[(i, max(v, -9999.0)) for i, v in top])
                        for lp, top in self.target.emitted_logprobs[scored:]]
        reply = VerifyResponse(
            logprobs=logprobs,
            seq=req.seq,
            num_accepted=verdict.num_accepted,
            tokens=tokens,
            next_token=tokens[-1],
            path=list(verdict.path) if verdict.path is not None else None,
            metrics=VerifyMetrics(
                gamma=draft.tokens.numel(),
                target_ms=outcome.target_s * 1e3,
                verify_ms=outcome.verify_s * 1e3,
                server_ms=(time.perf_counter() - started) * 1e3,
                committed=self.committed,
                lossless=self.lossless,
                capped_from=capped_from,
            ),
        )
        self.last_reply = reply
        self.last_fingerprint = _fingerprint(req)
        self.next_seq += 1
        return reply

    def _guarded(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; if it raises, put the cache and the rule's generator back as they were."""
        cache = self.target.cache
        base = cache.length
        state = self.target.generator.get_state()
        try:
            return fn()
        except SpecdecError as exc:
            cache.truncate(base)
            self.target.generator.set_state(state)
            raise ApiError(400, str(exc)) from None
        except Exception:
            cache.truncate(base)
            self.target.generator.set_state(state)
            raise

    def _check(self, req: VerifyRequest, settings: ServerSettings) -> tuple[Draft, Tensor | None]:
        """Validate ``req`` against this session; build the draft (dense q where the mode needs it)."""
        vocab = self.target.model.vocab_size
        gamma = len(req.draft_tokens)
        if gamma > settings.max_gamma:
            raise ApiError(400, f"the draft has {gamma} tokens; this server verifies at most {settings.max_gamma} per round")
        for name, ids in (("draft_tokens", req.draft_tokens), ("unverified_tokens", req.unverified_tokens)):
            for i, tok in enumerate(ids):
                if tok >= vocab:
                    raise ApiError(400, f"{name}[{i}] = {tok} is outside the vocabulary [0, {vocab})")
        n_forced = len(req.unverified_tokens)
        if n_forced and self.target.logprobs is not None:
            raise ApiError(400, "a session created with logprobs takes no unverified tokens (the target never scored them)")
        left = self.limit - self.target.context.numel()
        if n_forced + 1 > left:
            done = self.target.context.numel() - self.prompt_tokens - self.resumed_tokens
            raise ApiError(
                400,
                f"this session may commit {left} more token(s) (max_new_tokens reached: {done} committed)"
                if n_forced == 0 or left <= 0 else
                f"this round carries {n_forced} unverified tokens but the session may commit only {left} more"
                " (max_new_tokens)",
            )
        room = self.target.max_length - self.target.context.numel()
        parents = torch.tensor(req.parents, dtype=torch.long) if req.parents is not None else None
        length = gamma if parents is None or gamma == 0 else int(depths(parents).max()) + 1  # a tree's deepest path
        # a tree's every node also takes a row of the target's cache, which has the context's room or more
        need = n_forced + max(length + 1, gamma if parents is not None else 0)
        if need > room:
            raise ApiError(
                400,
                f"context full: this round needs {need} more positions but the session has {room} left"
                f" (its context is {self.target.max_length} tokens)",
            )
        tokens = torch.tensor(req.draft_tokens, dtype=torch.long)  # [γ]
        probs = self._dense_q(req, tokens, vocab)
        forced = torch.tensor(req.unverified_tokens, dtype=torch.long) if n_forced else None
        return Draft(tokens=tokens, probs=probs, parents=parents, siblings=req.siblings), forced

    def _dense_q(self, req: VerifyRequest, tokens: Tensor, vocab: int) -> Tensor | None:  # -> [γ, V] float64
        gamma = tokens.numel()
        q = req.q
        if self.wire in ("greedy", "coupled"):
            if q:
                raise ApiError(400, f"wire mode {self.wire!r} sends token ids only; drop 'q'")
            return None
        if gamma == 0:
            if q:
                raise ApiError(400, "'q' given for an empty draft")
            return None
        if self.wire == "sparse-q":
            if q is None or not all(isinstance(row, SparseRow) for row in q):
                raise ApiError(400, "wire mode 'sparse-q' needs 'q': one {ids, probs} row per draft token")
            rows = [i for i, row in enumerate(q) for _ in row.ids]  # type: ignore[union-attr]
            ids = [t for row in q for t in row.ids]  # type: ignore[union-attr]
            if max(ids) >= vocab:
                bad = max(ids)
                raise ApiError(400, f"q row id {bad} is outside the vocabulary [0, {vocab})")
            dense = torch.zeros(gamma, vocab, dtype=torch.float64)
            dense[rows, ids] = torch.tensor([p for row in q for p in row.probs], dtype=torch.float64)  # type: ignore[union-attr]
            return dense
        # lossy-scalar: only q[i, x_i] exists; the lossy rules read nothing else
        if q is None or not all(isinstance(v, float) for v in q):
            raise ApiError(400, "wire mode 'lossy-scalar' needs 'q': one probability per draft token")
        dense = torch.zeros(gamma, vocab, dtype=torch.float64)
        dense[torch.arange(gamma), tokens] = torch.tensor(q, dtype=torch.float64)
        return dense


# ----------------------------------------------------------------------------- creation


def _constraint(req: CreateSessionRequest, tokenizer: Any | None, vocab: int) -> Any:
    """The edge's grammar (read with this server's tokenizer) under its allowed ids and bad words
    (as token sequences); None where none is given."""
    grammar = None
    if req.grammar is not None:
        if tokenizer is None:
            raise ValueError("a grammar needs the server's tokenizer, and this server has none")
        from specdec.grammar import GrammarConstraint

        grammar = GrammarConstraint(tokenizer, req.grammar, vocab)
    if req.allowed_token_ids is None and not req.bad_token_ids:
        return grammar
    return TokenFilter(vocab, allowed_ids=req.allowed_token_ids, banned=req.bad_token_ids, inner=grammar)


def create_session(
    req: CreateSessionRequest,
    model: LanguageModel,
    tokenizer: Any | None,
    settings: ServerSettings,
    session_id: str,
    *,
    owner: str = "",
) -> tuple[EdgeSession, CreateSessionResponse]:
    """Validate ``req``, prefill the target on the prompt, return the new session."""
    from specdec.text import encode_prompt

    vocab = model.vocab_size
    ours = served_digest(tokenizer)
    if req.vocab_digest is not None and ours is not None and req.vocab_digest != ours:
        raise ApiError(400, f"the edge's tokenizer is not this server's ({settings.model_name}): its vocabulary gives"
                            " the same ids to other tokens; draft with the target's tokenizer (a draft model of the"
                            " target's family, or --tokenizer naming the target)")
    if req.prompt_ids is not None:
        prompt = list(req.prompt_ids)
    else:
        if tokenizer is None:
            raise ApiError(400, "this server has no tokenizer; send 'prompt_ids'")
        try:
            prompt = encode_prompt(tokenizer, req.prompt or "", chat=req.chat)
        except SpecdecError as exc:
            raise ApiError(400, str(exc)) from None
        if not prompt:
            raise ApiError(400, "the prompt encodes to no tokens")
    generated = list(req.generated_ids)
    for name, ids in (("prompt_ids", prompt), ("generated_ids", generated)):
        for i, tok in enumerate(ids):
            if tok >= vocab:
                raise ApiError(400, f"{name}[{i}] = {tok} is outside the vocabulary [0, {vocab})")
    n = len(prompt) + len(generated)
    if n >= model.max_length:
        held = f"the prompt has {n} tokens" if not generated else \
            f"the prompt and generated_ids hold {len(prompt)} + {len(generated)} = {n} tokens"
        raise ApiError(400, f"{held}, which fill the model's context of {model.max_length}: no room to generate")
    wire = req.wire or default_wire(req.temperature)
    try:
        method = wire_method(wire, req.method)
        if wire == "greedy" and req.temperature != 0.0:
            raise ValueError("wire mode 'greedy' needs temperature 0")
        rule = get_rule(method)
        cfg = SamplingConfig(
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            logit_bias=checked_bias(req.logit_bias, vocab),
            constraint=_constraint(req, tokenizer, vocab),
        )
        # min_tokens as the edge's floor over its stop ids: the drafts were masked the same way
        cfg = floor_stops(replace(cfg, min_tokens=req.min_tokens), frozenset(req.floor_ids))
    except (ValueError, SpecdecError) as exc:
        raise ApiError(400, str(exc)) from None
    budget = model.max_length - n  # up to the context's last position, as plain decoding
    if req.max_new_tokens is not None:
        budget = min(budget, req.max_new_tokens)
    seed = req.seed if req.seed is not None else fresh_seed()
    try:
        target = TargetSession(model, prompt + generated, cfg, rule, seed=seed, max_new_tokens=max(budget, 1),
                               logprobs=req.logprobs)
    except SpecdecError as exc:
        raise ApiError(400, str(exc)) from None
    if generated and target.penalties is not None:
        # a resumed sequence: penalties count these as generated tokens, as the first session did,
        # and a constraint (min_tokens, bad words) sees them in its history
        target.penalties.counts.index_add_(
            0, torch.tensor(generated), torch.ones(len(generated), dtype=target.penalties.counts.dtype)
        )
        target.penalties.generated.extend(generated)
    session = EdgeSession(
        id=session_id, wire=wire, rule=rule, seed=seed, target=target, prompt_tokens=len(prompt),
        resumed_tokens=len(generated), limit=n + max(budget, 1), owner=owner,
    )
    reply = CreateSessionResponse(
        session_id=session_id,
        model=settings.model_name,
        wire=wire,  # type: ignore[arg-type]
        method=rule.name,
        lossless=rule.lossless,
        seed=seed,
        vocab_size=vocab,
        max_context=model.max_length,
        max_length=target.max_length,
        max_gamma=settings.max_gamma,
        prompt_ids=prompt,
        prefill_ms=target.prefill_s * 1e3,
        cached_prompt_tokens=target.cached_prompt_tokens,
    )
    return session, reply


def served_digest(tokenizer: Any | None) -> str | None:
    """The server tokenizer's :func:`specdec.tokenizer.vocab_digest` (None: no tokenizer, or one
    without a vocabulary to read, e.g. a test's toy)."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return None
    from specdec.tokenizer import vocab_digest

    return vocab_digest(tokenizer)


# ----------------------------------------------------------------------------- the store


def keep_ended(session: EdgeSession) -> None:
    """A session that ended (deleted by its edge, or idle past the TTL) hands its committed rows to
    the server's prefix cache (``TargetSession.close`` -> ``ServedModel.keep_sequence``; nothing
    without one), as a finished OpenAI request does: an edge's next sequence that starts with this
    one — a chat's next turn, the conversation so far re-sent as its prompt — copies them instead of
    computing them.  Sessions evicted to make room are not kept: their memory is what was needed.
    A round still running on the session ends first; a failure here never fails the caller."""
    try:
        with session.lock:
            session.target.close()
    except Exception:  # noqa: BLE001 - the cache is an optimisation; the session is gone either way
        log.warning("could not keep ended session %s in the prefix cache", session.id, exc_info=True)


class SessionStore:
    """Sessions by id, least recently used first; bounded in count, idle time and KV bytes.

    A session belongs to the key that created it: another key can neither see, use, delete nor
    evict it (it gets the same 404 as for an unknown id).
    """

    def __init__(self, settings: ServerSettings, *, on_evict: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self._sessions: OrderedDict[str, EdgeSession] = OrderedDict()
        self._lock = threading.Lock()
        self._on_evict = on_evict or (lambda reason: None)
        #: KV bytes held for requests that are not sessions (OpenAI completions), see :meth:`claim`
        self._claimed = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def kv_bytes(self) -> int:
        """Bytes all sessions' caches hold now."""
        with self._lock:
            return sum(cache_bytes(s.target.cache) for s in self._sessions.values())

    def sweep(self) -> int:
        """Drop sessions idle for longer than the TTL (never one that is busy); returns how many."""
        now = time.monotonic()
        ttl = self.settings.session_ttl_s
        with self._lock:
            stale = [k for k, s in self._sessions.items() if now - s.last_used > ttl and not s.lock.locked()]
            ended = [self._sessions.pop(key) for key in stale]
            for _ in stale:
                self._on_evict("ttl")
        for session in ended:
            keep_ended(session)
        return len(stale)

    def reserve(self, owner: str = "", kv_bytes: int = 0) -> None:
        """Make room for one more session of ``owner`` needing ``kv_bytes`` or raise 429 / 503.

        Only ``owner``'s own idle sessions are evicted (least recently used first).
        """
        self.sweep()
        with self._lock:
            self._make_room(owner, kv_bytes, count=True)

    def ensure_kv(self, owner: str, kv_bytes: int, *, busy: str | None = None) -> None:
        """Make sure ``kv_bytes`` more fit under the KV cap (evicting ``owner``'s idle sessions) or raise 503."""
        if kv_bytes <= 0:
            return
        with self._lock:
            self._make_room(owner, kv_bytes, count=False, busy=busy)

    def claim(self, owner: str, kv_bytes: int) -> None:
        """Hold ``kv_bytes`` under the KV cap for a request that is not a session (an OpenAI
        completion: the most its caches can grow to), evicting ``owner``'s idle sessions if
        needed, or raise 503.  Give them back with :meth:`release`."""
        if kv_bytes <= 0:
            return
        self.sweep()
        with self._lock:
            self._make_room(owner, kv_bytes, count=False)
            self._claimed += kv_bytes

    def _used_bytes(self) -> int:  # under the lock
        """KV bytes held now: OpenAI requests' claims and the sessions' caches."""
        return self._claimed + sum(cache_bytes(s.target.cache) for s in self._sessions.values())

    def try_claim(self, kv_bytes: int) -> bool:
        """Hold ``kv_bytes`` under the KV cap if they fit as things stand (nothing is evicted for
        them); False where they do not.  Give them back with :meth:`release`."""
        if kv_bytes <= 0:
            return True
        with self._lock:
            used = self._used_bytes()
            if used + kv_bytes > self.settings.max_kv_bytes:
                return False
            self._claimed += kv_bytes
            return True

    def release(self, kv_bytes: int) -> None:
        with self._lock:
            self._claimed -= max(kv_bytes, 0)

    @property
    def claimed_bytes(self) -> int:
        return self._claimed

    def _make_room(self, owner: str, kv_bytes: int, *, count: bool, busy: str | None = None) -> None:
        cap = self.settings.max_kv_bytes
        while True:
            full = count and len(self._sessions) >= self.settings.max_sessions
            used = self._used_bytes()
            over = used + kv_bytes > cap
            if not full and not over:
                return
            victims = [k for k, s in self._sessions.items() if s.owner == owner and k != busy and not s.lock.locked()]
            # refuse before evicting anything where evicting every one of them would not make room
            freed = sum(cache_bytes(self._sessions[k].target.cache) for k in victims)
            if count and len(self._sessions) - len(victims) >= self.settings.max_sessions:
                raise ApiError(429, f"all {self.settings.max_sessions} sessions are in use or busy; retry later")
            if used - freed + kv_bytes > cap:
                raise ApiError(
                    503, f"the server's KV cache memory is full ({used} of {cap} bytes in use, {kv_bytes} more needed);"
                    " retry later or delete idle sessions",
                )
            victim = victims[0]
            del self._sessions[victim]
            self._on_evict("lru" if full else "kv_bytes")

    def add(self, session: EdgeSession) -> None:
        """Store a prefilled session: its cache's bytes must fit beside what is held now (another
        session may have taken the room :meth:`reserve` saw), evicting the owner's idle sessions, or 503."""
        with self._lock:
            self._make_room(session.owner, cache_bytes(session.target.cache), count=True)
            self._sessions[session.id] = session

    def get(self, session_id: str, owner: str | None = None) -> EdgeSession:
        """The session (``owner``: the caller's key digest; ``None`` only for internal use)."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or (owner is not None and session.owner != owner):
                raise ApiError(404, f"unknown session {session_id!r} (expired, evicted, deleted or the server restarted); create a new one")
            self._sessions.move_to_end(session_id)
            session.last_used = time.monotonic()
            return session

    def remove(self, session_id: str, owner: str | None = None) -> bool:
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None or (owner is not None and session.owner != owner):
                return False
            del self._sessions[session_id]
        keep_ended(session)
        return True
