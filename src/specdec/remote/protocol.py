"""The edge-cloud wire protocol: request and response bodies, shared by both ends.

One session per sequence.  The edge creates it once (prompt, sampling config, seed, wire mode),
then sends one :class:`VerifyRequest` per round and gets one :class:`VerifyResponse` back.

Wire modes (what crosses the wire besides the draft token ids):

``greedy``
    ids only; the cloud runs greedy verification (temperature 0).
``coupled``
    ids only; both ends draw keyed Gumbel noise from the session seed and the absolute position,
    the cloud accepts while its own sample equals the draft (drafter-invariant: output identical
    to cloud-only sampling with that seed).
``sparse-q``
    the edge samples each draft token from its top-k-truncated ``q`` and sends exactly the
    (id, prob) pairs of that ``q`` per position; the cloud densifies them into ``q`` [γ, V] and
    runs token or block verification (default block) — exact in distribution.
``lossy-scalar``
    a common simpler protocol: one scalar ``q_i = q(x_i)`` per draft token; the cloud runs a
    ``lossy_*`` rule (default ``lossy_resample_p``).  Not exact; every stat says so.

Everything the server can check without the session (types, ranges, lengths, finiteness, row sums)
is checked here, so that a malformed body never reaches a session; the checks that need the session
(ids below its vocabulary size, the mode's ``q`` shape) live in the server.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from specdec import defaults
from specdec.remote.wire import WIRE_METHODS, WIRE_MODES  # noqa: F401 - re-exported: the protocol's modes

WireMode = Literal["greedy", "coupled", "sparse-q", "lossy-scalar"]

#: a row of q may sum to at most 1 + this (float32 rounding of a renormalised top-k)
ROW_SUM_SLACK = 1e-4
#: bound on the prompt length and on token ids accepted anywhere (the server checks its own vocab)
MAX_PROMPT_TOKENS = 1 << 20
MAX_TOKEN_ID = (1 << 31) - 1
MAX_SEQ = (1 << 62) - 1
MAX_SEED = defaults.MAX_SEED
DEFAULT_MAX_BODY_BYTES = defaults.MAX_BODY_BYTES

TokenId = Annotated[int, Field(strict=True, ge=0, le=MAX_TOKEN_ID)]
Prob = Annotated[float, Field(strict=True, ge=0.0, le=1.0 + ROW_SUM_SLACK, allow_inf_nan=False)]


def default_wire(temperature: float) -> str:
    """Greedy at temperature 0, coupled otherwise (ids only, and exact)."""
    return "greedy" if temperature == 0.0 else "coupled"


def wire_method(wire: str, method: str | None) -> str:
    """The cloud rule for ``wire`` (``method`` if given and allowed, else the mode's default)."""
    allowed = WIRE_METHODS[wire]
    if method is None:
        return allowed[0]
    key = method.strip().lower().replace("-", "_")
    if key not in allowed:
        raise ValueError(
            f"method {method!r} is not available in wire mode {wire!r}; choose from: "
            + ", ".join(m.replace("_", "-") for m in allowed)
        )
    return key


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SamplingFields(_Body):
    """The target's sampling configuration (applied identically on both ends)."""

    temperature: Annotated[float, Field(strict=True, ge=0.0, le=1e4, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(strict=True, ge=1, le=MAX_TOKEN_ID)] | None = None
    top_p: Annotated[float, Field(strict=True, gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    min_p: Annotated[float, Field(strict=True, ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    repetition_penalty: Annotated[float, Field(strict=True, gt=0.0, le=1e4, allow_inf_nan=False)] = 1.0
    frequency_penalty: Annotated[float, Field(strict=True, ge=-1e4, le=1e4, allow_inf_nan=False)] = 0.0
    presence_penalty: Annotated[float, Field(strict=True, ge=-1e4, le=1e4, allow_inf_nan=False)] = 0.0
    #: [token id, bias] pairs added to the logits first (OpenAI's logit_bias)
    logit_bias: Annotated[list[tuple[TokenId, Annotated[float, Field(strict=True, ge=-1e4, le=1e4, allow_inf_nan=False)]]],
                          Field(max_length=1 << 16)] = []
    #: vLLM's min_tokens: ``floor_ids`` (the edge's end-of-sequence and stop token ids) are masked
    #: until this many tokens were generated (resumed ones count)
    min_tokens: Annotated[int, Field(strict=True, ge=0, le=MAX_PROMPT_TOKENS)] = 0
    floor_ids: Annotated[list[TokenId], Field(max_length=1024)] = []
    #: vLLM's allowed_token_ids (only these sampled) and bad words as token sequences (none completed)
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=1 << 18)] | None = None
    bad_token_ids: Annotated[list[Annotated[list[TokenId], Field(min_length=1, max_length=64)]],
                             Field(max_length=1024)] = []
    #: structured output: an llguidance grammar (the server reads it with its own tokenizer)
    grammar: Annotated[str, Field(min_length=1, max_length=1 << 22)] | None = None


class CreateSessionRequest(SamplingFields):
    """``POST /v1/sessions``.  Exactly one of ``prompt`` (text) and ``prompt_ids``.

    ``generated_ids`` resumes a sequence: tokens already committed after the prompt (a session the
    server lost is re-created with them; penalties count them as generated, not as prompt).
    """

    prompt: Annotated[str, Field(min_length=1, max_length=4 * MAX_PROMPT_TOKENS)] | None = None
    prompt_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKENS)] | None = None
    generated_ids: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKENS)] = []
    chat: Annotated[bool, Field(strict=True)] = False
    seed: Annotated[int, Field(strict=True, ge=0, le=MAX_SEED)] | None = None
    wire: WireMode | None = None
    method: Annotated[str, Field(max_length=64)] | None = None
    #: each committed token's log-probability under the target's processed law and this many best
    #: alternatives, in every verify reply (lossless rounds only: no unverified tokens)
    logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None
    #: tokens the edge may still generate (bounds the session's context); default: the model's context
    max_new_tokens: Annotated[int, Field(strict=True, ge=1, le=MAX_PROMPT_TOKENS)] | None = None
    #: the edge tokenizer's ``vocab_digest`` (SHA-256 hex of its vocabulary): a server whose own
    #: tokenizer's digest differs refuses the session (400) before the prompt's pass
    vocab_digest: Annotated[str, Field(min_length=64, max_length=64, pattern="^[0-9a-f]+$")] | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> "CreateSessionRequest":
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("give exactly one of 'prompt' (text) and 'prompt_ids'")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("the prompt is empty")
        if self.prompt is not None and self.generated_ids:
            raise ValueError("'generated_ids' needs 'prompt_ids' (ids are what the edge committed)")
        if self.wire is not None:
            wire_method(self.wire, self.method)
        if self.wire == "greedy" and self.temperature != 0.0:
            raise ValueError("wire mode 'greedy' needs temperature 0")
        return self


class CreateSessionResponse(_Body):
    session_id: str
    model: str
    wire: WireMode
    method: str
    lossless: bool
    seed: int
    vocab_size: int
    #: the model's context window
    max_context: int
    #: prompt + generated + one full draft must fit in this many tokens
    max_length: int
    max_gamma: int
    prompt_ids: list[int]
    prefill_ms: float
    #: prompt tokens whose keys/values the server's prefix cache copied instead of computing them
    #: (a sequence that starts with an ended session's, e.g. a chat's next turn)
    cached_prompt_tokens: int = 0


class SparseRow(_Body):
    """One position of a sparse ``q``: the ids with non-zero probability and their probabilities."""

    ids: Annotated[list[TokenId], Field(min_length=1, max_length=1 << 17)]
    probs: Annotated[list[Prob], Field(min_length=1, max_length=1 << 17)]

    @model_validator(mode="after")
    def _check(self) -> "SparseRow":
        if len(self.ids) != len(self.probs):
            raise ValueError(f"a q row has {len(self.ids)} ids but {len(self.probs)} probs")
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("a q row repeats a token id")
        total = math.fsum(self.probs)
        if total > 1.0 + ROW_SUM_SLACK:
            raise ValueError(f"a q row sums to {total:.6g} > 1")
        return self


def _q_kind(value: Any) -> str:
    first = value[0] if isinstance(value, list) and value else None
    return "rows" if isinstance(first, (dict, SparseRow)) else "scalars"


#: sparse-q rows or lossy-scalar probabilities, told apart by the first element
QRows = Annotated[
    Union[
        Annotated[list[SparseRow], Tag("rows"), Field(max_length=defaults.MAX_GAMMA)],
        Annotated[list[Prob], Tag("scalars"), Field(max_length=defaults.MAX_GAMMA)],
    ],
    Discriminator(_q_kind),
]


class VerifyRequest(_Body):
    """``POST /v1/sessions/{id}/verify``: round ``seq`` (0, 1, 2, ...) of the session.

    ``q`` is required in ``sparse-q`` mode (one :class:`SparseRow` per draft token) and in
    ``lossy-scalar`` mode (one probability per draft token), and must be absent otherwise.
    ``unverified_tokens`` (lossy, from the edge's local-commit option) are appended to the session
    without verification before the draft is verified.
    """

    seq: Annotated[int, Field(strict=True, ge=0, le=MAX_SEQ)]
    draft_tokens: Annotated[list[TokenId], Field(max_length=defaults.MAX_GAMMA)] = []
    q: QRows | None = None
    unverified_tokens: Annotated[list[TokenId], Field(max_length=defaults.MAX_GAMMA * 8)] = []
    #: a token tree: one parent per draft token (-1: child of the last committed token, else the
    #: index of an earlier draft token); absent for a chain.  ``q`` rows are then per node (the
    #: distribution the node was drawn from) and ``siblings`` says how siblings were drawn.
    parents: Annotated[list[Annotated[int, Field(strict=True, ge=-1)]], Field(max_length=defaults.MAX_TREE_NODES)] | None = None
    siblings: Literal["iid", "without_replacement"] = "iid"

    @field_validator("q", mode="before")
    @classmethod
    def _q_list(cls, value: object) -> object:
        if value is not None and not isinstance(value, list):
            raise ValueError("q must be a list (sparse rows or scalars) or null")
        return value

    @model_validator(mode="after")
    def _lengths(self) -> "VerifyRequest":
        if self.parents is not None:
            if len(self.parents) != len(self.draft_tokens):
                raise ValueError(f"{len(self.parents)} parents for {len(self.draft_tokens)} draft tokens")
            if any(p >= i for i, p in enumerate(self.parents)):
                raise ValueError("each parent must be -1 or the index of an earlier draft token")
        if self.q is None:
            return self
        if len(self.q) != len(self.draft_tokens):
            raise ValueError(f"q has {len(self.q)} rows but there are {len(self.draft_tokens)} draft tokens")
        for i, (tok, row) in enumerate(zip(self.draft_tokens, self.q)):
            if isinstance(row, SparseRow):
                q_tok = row.probs[row.ids.index(tok)] if tok in row.ids else 0.0
            else:
                q_tok = row
            if not q_tok > 0.0:
                raise ValueError(f"draft token {i} (id {tok}) has q = 0: it cannot have been sampled from q")
        return self


class VerifyMetrics(_Body):
    gamma: int
    target_ms: float  # the cloud's forward pass over [pending] + draft
    verify_ms: float  # processing + rule + bookkeeping
    server_ms: float  # request handling on the server, forward pass included
    committed: int  # tokens committed after the prompt so far
    lossless: bool
    replayed: bool = False  # True when this is the stored verdict of a retried seq
    #: a busy batching server verified only the first ``gamma`` of this many draft tokens (lossless:
    #: the answer is that of the shorter draft); None = the whole draft was verified
    capped_from: int | None = None


class TokenLogprob(_Body):
    """One committed token's log-probability under the target's law (-9999.0 for a removed token,
    as OpenAI reports it) and the best alternatives as ``[id, log-probability]`` pairs."""

    logprob: float
    top: list[tuple[int, float]] = []


class VerifyResponse(_Body):
    seq: int
    num_accepted: int
    tokens: list[int]  # accepted prefix + next token
    next_token: int
    metrics: VerifyMetrics
    path: list[int] | None = None  # token trees: the accepted draft indices, root level first
    logprobs: list[TokenLogprob] | None = None  # one per token, for a session created with logprobs


class SessionInfo(_Body):
    """``GET /v1/sessions/{id}``: where a session stands."""

    session_id: str
    wire: WireMode
    method: str
    lossless: bool
    next_seq: int
    prompt_tokens: int
    committed: int
    unverified: int
    max_length: int
    idle_s: float


class ErrorBody(_Body):
    message: str
    type: str = "invalid_request_error"
    code: int | None = None


class ErrorResponse(_Body):
    error: ErrorBody


class Health(_Body):
    status: Literal["ok"] = "ok"
    model: str
    vocab_size: int
    max_context: int
    sessions: int
    #: the target's numerics as it runs, e.g. "int8 (onednn)" or "float32": an edge that checks
    #: outputs against a local copy of the target must load it the same way
    precision: str | None = None
    #: the server tokenizer's ``vocab_digest`` (SHA-256 hex of its vocabulary; None without a
    #: tokenizer): an edge tokenizer with another digest maps ids to other tokens
    vocab_digest: str | None = None
    #: what the OpenAI endpoints draft with on the server ("none": plain decoding), as
    #: ``specdec models`` names it; edge sessions draft on the edge whatever this says
    drafter: str = "none"
