"""The drafter seam: propose γ tokens, report the distribution they were sampled from."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from specdec import defaults
from specdec.catalog import check_temperature_factor  # noqa: F401 - re-exported
from specdec.errors import ConfigError
from specdec.models.base import full_probs
from specdec.sampling import (
    PenaltyState,
    SamplingConfig,
    argmax_last,
    gumbel_column,
    gumbel_sample,
    path_masks,
    penalise_with_extra,
    penalised_logits,
    process_logits,
    sample_categorical,
    with_overrides,
)
from specdec.verify import DraftSampling, Verdict


SiblingMode = Literal["iid", "without_replacement"]


@dataclass(frozen=True)
class Draft:
    """A chain (``parents is None``) or a token tree of N nodes in topological order.

    Tree: ``parents[i] == -1`` makes node i a child of the last committed token, otherwise
    ``parents[i] < i``; ``probs[i]`` is the q node i was drawn from (its parent context's
    distribution; siblings share it), and ``siblings`` says how sibling candidates were drawn
    from that q (independently, or each without the earlier siblings, renormalised).
    """

    tokens: Tensor  # [γ'] int64, γ' <= γ (a drafter may propose fewer, even none)
    probs: Tensor | None  # [γ', V] the q actually sampled from; None => deterministic drafter
    #: optional work the drafter already did for the verification pass (self-speculative cache
    #: sharing): ``reuse.forward(model, tokens, cache)`` returns the pass's logits, or None to
    #: run the plain pass; verifiers that cannot use it ignore it
    reuse: Any = None
    parents: Tensor | None = None  # [γ'] int64 tree parents; None => a chain
    siblings: SiblingMode = "iid"
    #: ask the verifier for the target's arg-max at the root and after every node
    #: (``Outcome.node_argmax``): Lookahead decoding's Jacobi step reads it
    wants_argmax: bool = False
    #: drafted without a model step (a prompt-lookup round of a hybrid drafter): the decoder's
    #: γ controller does not learn from this round; the drafter's ``update_free`` does
    free: bool = False

    @property
    def is_tree(self) -> bool:
        return self.parents is not None

    def chain_parents(self) -> Tensor:  # -> [γ'] int64
        """The parents of this draft seen as a tree (a chain: -1, 0, 1, ...)."""
        if self.parents is not None:
            return self.parents
        return torch.arange(-1, self.tokens.numel() - 1, dtype=torch.long)


def _draws_compiled(q: Tensor, ids: Tensor) -> bool:
    """Whether a compact draft row's draw and scatter run as one compiled call here: a model loaded
    the kernels, the row [1, Vd] is float32 and its ids int64, both contiguous (as they come)."""
    from specdec.models import kernels

    return (kernels.loaded() and q.dtype == torch.float32 and q.is_contiguous()
            and ids.dtype == torch.long and ids.is_contiguous())


class DraftChain:
    """A chain draft being collected by a drafter: each drawn token and the q it came from."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.rows: list[Tensor] = []

    def add(self, drawn: tuple[int, Tensor | None] | None, sampler: DraftSampler) -> bool:
        """Record ``drawn`` (None: nothing could be drawn); False when the draft should stop."""
        if drawn is None:
            return False
        token, q = drawn
        self.tokens.append(token)
        if q is not None:
            self.rows.append(q)
        return not getattr(sampler, "stop_requested", False)

    def draft(self) -> Draft:
        rows = self.rows
        return Draft(tokens=torch.tensor(self.tokens, dtype=torch.long), probs=torch.stack(rows) if rows else None)

class DraftSampler:
    """Turns a drafter's logits into a token exactly as the verification rule requires.

    Built by the decoder for each round; holds the sampling config, a private copy of the
    penalty state that follows the draft position by position, and the randomness (a generator
    for ``multinomial``, the Gumbel key for ``gumbel``).  Drafters never branch on the rule.
    """

    def __init__(
        self,
        cfg: SamplingConfig,
        mode: DraftSampling,
        *,
        penalties: PenaltyState | None,
        generator: torch.Generator | None,
        noise_seed: int = 0,
        want_probs: bool = True,
        q_top_k: int | None = None,
        min_confidence: float = 0.0,
        room: int | None = None,
    ) -> None:
        #: what the draft samples from: the request's config, or :func:`draft_config` of it (a
        #: drafter's temperature factor); lossless either way, the rules see the q drawn from
        self.cfg = cfg
        self.mode: DraftSampling = "argmax" if cfg.greedy else mode
        self.penalties = (
            penalties.copy()
            if penalties is not None and cfg.needs_state
            else None
        )
        self.generator = generator
        self.noise_seed = noise_seed
        self.want_probs = want_probs
        #: extra, draft-only truncation of q (sparse-q wire mode): the drafter samples from the
        #: q_top_k most likely tokens of the processed q, renormalised, and reports exactly that
        self.q_top_k = q_top_k
        #: dynamic draft length: stop drafting after a token whose draft probability (the top-1
        #: of q for argmax drafting, q(x) otherwise) is below this; lossless (the drafter only
        #: decides how many tokens to propose) and it saves the draft steps and verify positions
        #: that would most likely be rejected
        self.min_confidence = min_confidence
        self.stop_requested = False
        #: set by a call that found no token the constraint allows among those the drafter can
        #: propose (a reduced draft vocabulary under structured output): the drafter must stop
        #: there — nothing was drawn and the penalty / constraint state did not move
        self.undefined = False
        #: the most draft tokens this round can use (tokens left to generate, the γ cap); a
        #: drafter whose drafts cost nothing may propose up to this many, more than γ
        self.room = room
        #: this round's grammar masks by tree path (see :meth:`tree_rows`)
        self._tree_masks: dict[tuple[int, ...], Tensor] = {}

    @property
    def deterministic(self) -> bool:
        """True when the drafted tokens need no reported distribution (argmax / gumbel)."""
        return self.mode != "multinomial" or not self.want_probs

    @property
    def compact(self) -> bool:
        """Whether rows over a reduced draft vocabulary may be used as they are ([m, Vd] with its
        target ids beside them) instead of scattered into the whole vocabulary: nothing may read
        or change other tokens' logits (no bias, penalty or constraint), and the draft is chosen
        by arg-max, by keyed Gumbel noise or drawn from q (not truncated to a sparse q for the
        wire).  Arg-max picks the same token either way (``-inf`` elsewhere never wins); the
        Gumbel draw keys each column by its target id, so it picks the token the scattered row
        would (bar the last bits of q, rounded in a shorter sum); a draw from the compact q is a
        draw from the scattered q (zero elsewhere; the same law), which is reported over the whole
        vocabulary.  It saves the scatter and the reductions over the full vocabulary."""
        if self.cfg.needs_state or self.cfg.logit_bias:
            return False
        if self.mode == "multinomial":
            return self.want_probs and self.q_top_k is None
        return True  # argmax, gumbel

    def __call__(
        self, logits: Tensor, position: int, ids: Tensor | None = None, vocab: int | None = None
    ) -> tuple[int, Tensor | None]:
        """Sample the draft token at absolute ``position`` from ``logits`` [1, V].

        Returns the token and, in ``multinomial`` mode, the probabilities ``q`` [V] it was
        sampled from; then records the token so the next position's penalties see it.
        ``ids`` [Vd] (only when :attr:`compact`): ``logits`` are ``[1, Vd]`` over these target ids,
        and ``vocab`` is the whole vocabulary's size (the reported q is scattered into it).
        """
        probs: Tensor | None = None
        self.undefined = False
        if ids is not None and not self.compact:
            raise ValueError("compact draft rows need arg-max or Gumbel drafting or q reported, with no bias, penalty or constraint")
        if self.mode == "argmax":
            # compact rows have nothing to penalise (no bias, penalty or constraint: see compact)
            scores = logits if ids is not None else penalised_logits(logits, self.cfg, self.penalties)
            if self.cfg.constraint is not None and not bool(torch.isfinite(scores).any()):
                self.undefined = True
                return 0, None
            if self.min_confidence > 0.0:
                top, idx = torch.softmax(scores, -1).max(-1)
                token = int(idx)
                self.stop_requested = float(top) < self.min_confidence
            else:
                token = int(argmax_last(scores))
            if ids is not None:
                token = int(ids[token])  # a column of the draft vocabulary -> its target id
        elif ids is not None and self.mode == "gumbel":  # keyed by each column's target id
            if vocab is None:
                raise ValueError("compact draft rows drawn by Gumbel noise need the whole vocabulary's size")
            q = process_logits(logits, self.cfg)[0]  # [Vd]
            col = gumbel_column(q, self.noise_seed, position, ids, vocab)
            token = int(ids[col])
            if self.min_confidence > 0.0:
                self.stop_requested = float(q[col]) < self.min_confidence
        elif ids is not None:  # multinomial over the draft vocabulary's columns
            if vocab is None:
                raise ValueError("compact draft rows drawn from q need the whole vocabulary's size")
            q = process_logits(logits, self.cfg)  # [1, Vd]
            if self.min_confidence > 0.0 or not _draws_compiled(q, ids):
                col = sample_categorical(q[0], self.generator)
                if self.min_confidence > 0.0:
                    self.stop_requested = float(q[0, col]) < self.min_confidence
                token = int(ids[col])
                probs = full_probs(q, ids, vocab)[0]  # [V]
            else:  # the same draw and row in one compiled call (csrc/rules.cpp)
                u = torch.rand(1, generator=self.generator, dtype=torch.float64)
                token, probs = torch.ops.specdec.draw_scattered(q[0], ids, vocab, float(u))
        else:
            q = process_logits(logits, self.cfg, self.penalties)[0]  # [V]
            if self.cfg.constraint is not None and not bool(torch.isfinite(q).all()):
                self.undefined = True
                return 0, None
            if self.q_top_k is not None and self.mode == "multinomial":
                q = truncate_top_k(q, self.q_top_k)
            if self.mode == "gumbel":
                token = gumbel_sample(q, self.noise_seed, position)
            else:
                token = sample_categorical(q, self.generator)
                probs = q
            if self.min_confidence > 0.0:
                self.stop_requested = float(q[token]) < self.min_confidence
        if self.penalties is not None:
            self.penalties.append(torch.tensor([token]))
        return token, probs

    def tree_rows(self, logits: Tensor, histories: list[list[int]] | None = None) -> Tensor:  # [m, V] -> [m, V]
        """Distributions a tree builder ranks or samples candidates from, one per expanded node.

        Argmax mode: penalised logits; otherwise the processed q.  Penalties see the committed
        context only (not each node's path).  A constraint (structured output) masks row i with
        what it allows after the committed tokens + ``histories[i]`` (the node's path), so the
        tree holds only tokens the grammar allows; a row it would leave empty (a reduced draft
        vocabulary without any allowed token) stays unmasked, and without ``histories`` every row
        does: the target's rows apply the constraint along each path in any case.  q is a
        drafting choice, any q is lossless as long as it is the one the tokens were drawn from
        and the one reported.
        """
        cfg = self.cfg
        if cfg.has_penalties and self.penalties is not None:
            logits = penalise_with_extra(logits, cfg, self.penalties, torch.zeros(logits.shape, dtype=torch.float32))
            cfg = with_overrides(cfg, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
        if cfg.constraint is not None:
            if histories is not None and self.penalties is not None:
                logits = self._constrained(logits, cfg.constraint, histories)
            cfg = replace(cfg, constraint=None)  # (with_overrides ignores None)
        if self.mode == "argmax":
            return logits
        return process_logits(logits, cfg)

    def _constrained(self, logits: Tensor, constraint: Any, histories: list[list[int]]) -> Tensor:  # [m, V]
        """Rows masked by the constraint after each path.  A path whose last token its parent's
        mask forbids (drawn from a row left unmasked) is never handed to the constraint, which
        cannot follow it; nor is anything below it.  The masks of this round's paths are kept."""
        assert self.penalties is not None and len(histories) == logits.shape[0]
        masks = path_masks(constraint, self.penalties.generated, histories, logits.shape[-1], self._tree_masks)
        out = logits.clone()
        for i, mask in enumerate(masks):
            if mask is None:
                continue
            masked = logits[i].masked_fill(~mask, -math.inf)
            if bool(torch.isfinite(masked).any()):
                out[i] = masked
        return out


def draft_config(cfg: SamplingConfig, temperature_factor: float) -> SamplingConfig:
    """The sampling config a draft samples from: the request's, at ``temperature_factor`` x its
    temperature (kept within the temperatures a config allows); greedy stays greedy."""
    f = check_temperature_factor(temperature_factor)
    if f == 1.0 or cfg.greedy:
        return cfg
    t = min(max(cfg.temperature * f, defaults.MIN_TEMPERATURE), defaults.MAX_TEMPERATURE)
    return replace(cfg, temperature=t)


def temperature_factor(drafter: Any) -> float:
    """The factor ``drafter``'s model samples at (x the request's temperature); 1 for drafters
    that do not sample from a model or were not calibrated."""
    return float(getattr(drafter, "temperature_factor", 1.0)) if drafter is not None else 1.0


def truncate_top_k(q: Tensor, k: int) -> Tensor:  # q: [V] -> [V] with at most k non-zeros
    """``q`` restricted to its ``k`` most likely tokens and renormalised."""
    if k >= q.numel():
        return q
    vals, idx = q.topk(k)
    out = torch.zeros_like(q)
    out[idx] = vals / vals.sum()
    return out


class Drafter(Protocol):
    """Proposes draft tokens; keeps (and rolls back) whatever state it needs."""

    def prepare(self, prompt: Tensor) -> None:
        """Start a new sequence with ``prompt`` [L] (prefill caches, build indexes)."""
        ...

    def propose(self, context: Tensor, gamma: int, sampler: DraftSampler) -> Draft:
        """Up to ``gamma`` tokens continuing ``context`` [L] (prompt + generated so far)."""
        ...

    def commit(self, verdict: Verdict) -> None:
        """The target kept ``verdict.num_accepted`` tokens of the last draft and appended one."""
        ...

    def reset(self) -> None:
        """Forget everything (a new sequence starts)."""
        ...


class FeatureDrafter(Drafter, Protocol):
    """A target-aware drafter (EAGLE, Medusa, MTP): it reads the target's hidden states.

    It declares ``feature_taps`` (layer counts k: the residual stream after the target's first k
    layers) and receives, through :meth:`add_features`, the target's features at every committed
    position in order — rows ``(taps..., final hidden state)``, the layout ``specdec train data``
    stores.  The verifier computes them in the passes it runs anyway (the prompt's prefill and
    each verification pass), so drafters that do not declare taps pay nothing.
    """

    feature_taps: tuple[int, ...]

    def add_features(self, features: Tensor) -> None:
        """``features`` [k, len(feature_taps) + 1, D]: the next k committed positions' features.

        Called after :meth:`prepare` with the prompt's positions but its last (whose feature the
        first verification pass computes), then after every round (after :meth:`commit`) with
        the positions that round fed and kept: the pending token and the accepted draft tokens.
        The newest committed token never has a feature yet.
        """
        ...


def feature_taps(drafter: object) -> tuple[int, ...] | None:
    """The taps a drafter asks for, or None for drafters that read no target features."""
    taps = getattr(drafter, "feature_taps", None)
    return tuple(taps) if taps is not None else None
