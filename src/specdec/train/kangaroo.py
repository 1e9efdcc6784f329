"""Training a Kangaroo adapter (Liu et al. 2024, *Kangaroo*, §3.1) on the target's own outputs.

The shallow sub-network (the target's first ``k`` layers) and the LM head are frozen; only the
adapter (:class:`~specdec.drafters.kangaroo.Adapter`, about 1 % of SmolLM2-135M) is trained, so
this runs on a CPU in minutes:

1. **Data** (self-distillation, as Kangaroo and Medusa-2 do): built-in prompts (chat
   instructions and code headers written for specdec; none of the benchmark's or the skip
   search's), continued by the target itself — batched over
   :meth:`~specdec.models.native.NativeCausalLM.forward_batch`, greedy and sampled at T = 1
   alternately.  Each sequence is then scored once, teacher-forced: the residual stream leaving
   layer ``k`` (the adapter's input) and the target's top-``top_k`` next-token probabilities
   (the distillation target) at every position.
2. **Loss**: cross-entropy of the draft's next-token distribution (adapter → target's final norm
   and LM head) against the target's top-k distribution (renormalised), on a random subset of
   positions per step (the LM head dominates the cost).  AdamW, warm-up then cosine decay.
3. **Resumable**: data and the training state (adapter, optimiser, step) are checkpointed next to
   the output; batches are drawn from a generator seeded by the step, so a resumed run is the
   same run.
4. **Held-out report**: teacher-forced acceptance on held-out prompts continued greedily by the
   target, for the trained draft and for plain early exit at the same depth (``layerskip:k``):
   α₀ = agreement of arg-maxes (T = 0 chain acceptance), α₁ = mean Σ min(p, q) (T = 1).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from specdec.drafters.kangaroo import Adapter, AdapterConfig, KangarooView
from specdec.drafters.self_spec import LayerPlan, LayerView

_TASKS = (
    "Explain {t} in simple words.",
    "Write a short paragraph about {t}.",
    "List four facts about {t}.",
    "Give a beginner three tips about {t}.",
    "Write a short poem about {t}.",
    "What are the pros and cons of {t}?",
    "Describe {t} to a child.",
    "Write a friendly message recommending {t} to a colleague.",
)
_TOPICS = (
    "volcanoes", "learning to juggle", "the water cycle", "indoor plants", "electric bicycles", "chess openings",
    "bread baking", "the Roman calendar", "solar panels", "bird migration", "public libraries", "knitting",
    "compound interest", "the moon's phases", "recycling glass", "mountain hiking",
)
_CODE = (
    'def median(values):\n    """Return the median of a non-empty list of numbers."""\n',
    'def chunked(items, size):\n    """Split `items` into consecutive lists of at most `size` elements."""\n',
    'import os\n\n\ndef find_files(root, suffix):\n    """Return the paths under `root` whose names end with `suffix`."""\n',
    'def transpose(matrix):\n    """Return the transpose of a matrix given as a list of rows."""\n',
    'class Counter:\n    """Count how often each hashable item was added."""\n\n    def __init__(self):\n',
    'def gcd(a, b):\n    """Greatest common divisor of two non-negative integers (Euclid)."""\n',
    'import datetime\n\n\ndef days_between(first, second):\n    """Number of days from date `first` to date `second`."""\n',
    'def dedupe(items):\n    """Remove duplicates from `items`, keeping the first occurrence of each."""\n',
    'def caesar(text, shift):\n    """Shift each letter of `text` by `shift` places in the alphabet."""\n',
    'class Queue:\n    """A first-in first-out queue built from two lists."""\n\n    def __init__(self):\n',
    'def word_lengths(sentence):\n    """Map each word of `sentence` to its length."""\n',
    'def clamp(value, low, high):\n    """Limit `value` to the closed range [low, high]."""\n',
    'import hashlib\n\n\ndef file_digest(path):\n    """Return the SHA-256 hex digest of the file at `path`."""\n',
    'def rotate(items, k):\n    """Rotate the list `items` right by `k` places."""\n',
    'def to_roman(number):\n    """Convert a positive integer to a Roman numeral string."""\n',
    'def is_prime(n):\n    """True when `n` is a prime number."""\n',
)
#: held out from training (different tasks, topics and functions); used only for the report
HELD_OUT: tuple[tuple[str, bool], ...] = (
    ("How does a refrigerator keep food cold?", True),
    ('def running_total(numbers):\n    """Return the list of cumulative sums of `numbers`."""\n', False),
    ("Write a thank-you note to a teacher who retired this year.", True),
    ('def vowels(text):\n    """Count the vowels in `text`."""\n', False),
    ("What should I pack for a rainy weekend of camping?", True),
    ('class Matrix:\n    """A small dense matrix of floats."""\n\n    def __init__(self, rows):\n', False),
)


def training_prompts(n: int, *, seed: int = 0) -> list[tuple[str, bool]]:
    """``n`` built-in training prompts, chat and code interleaved (deterministic order)."""
    chat = [(task.format(t=topic), True) for topic in _TOPICS for task in _TASKS]
    random.Random(seed).shuffle(chat)
    out: list[tuple[str, bool]] = []
    for i in range(max(len(chat), len(_CODE))):
        for pool in (chat, _CODE):
            if i < len(pool):
                item = pool[i]
                out.append(item if isinstance(item, tuple) else (item, False))
    return out[:n]


def continue_batched(target: Any, prompts: Sequence[Sequence[int]], *, new_tokens: int, temperatures: Sequence[float],
                     eos_ids: frozenset[int] = frozenset(), seed: int = 0, batch: int = 32,
                     progress: Callable[[int], None] | None = None) -> list[Tensor]:
    """Each prompt continued by ``target`` (prompt i at ``temperatures[i % len]``, 0 = greedy),
    ``batch`` sequences decoding together through ``forward_batch``; each ``[L]`` int64."""
    gen = torch.Generator().manual_seed(seed)
    out: list[Tensor] = []
    for lo in range(0, len(prompts), batch):
        group = [list(p) for p in prompts[lo : lo + batch]]
        temps = [temperatures[(lo + j) % len(temperatures)] for j in range(len(group))]
        caches = [target.new_cache(len(p) + new_tokens + 1) for p in group]
        logits = target.forward_batch([(torch.tensor(p), c, True) for p, c in zip(group, caches)])
        live = list(range(len(group)))
        for _ in range(new_tokens):
            nxt = []
            for j, row in zip(live, logits):
                row = row[-1]  # [V]
                tok = int(row.argmax()) if temps[j] == 0 else int(torch.multinomial(torch.softmax(row / temps[j], -1), 1, generator=gen))
                group[j].append(tok)
                if tok not in eos_ids:
                    nxt.append(j)
            live = nxt
            if not live:
                break
            logits = target.forward_batch([(torch.tensor(group[j][-1:]), caches[j], True) for j in live])
        out.extend(torch.tensor(g, dtype=torch.long) for g in group)
        if progress:
            progress(len(group))
    return out


@dataclass(frozen=True)
class Features:
    """Teacher-forced features of one sequence: the adapter's input and the target's next-token law."""

    tokens: Tensor  # [L] int64
    start: int  # first continuation position's predecessor (the last prompt token)
    hidden: Tensor  # [L, D] residual stream leaving layer k (float32)
    top_p: Tensor  # [L, K] target's top-K next-token probabilities (float32)
    top_i: Tensor  # [L, K] their token ids (int64)


def features(target: Any, seq: Tensor, start: int, k: int, *, top_k: int) -> Features:
    """One teacher-forced pass of the target over ``seq`` [L], tapping the residual after layer ``k``."""
    n = target.cfg.n_layers
    cache = target.new_cache(seq.numel())
    with torch.inference_mode():
        cache.reserve(seq.numel())
        h = target.run_layers(target.embed_tokens(seq), cache, [(i, True, True) for i in range(k)], start=0)  # [L, D]
        top = target.run_layers(h, cache, [(i, True, True) for i in range(k, n)], start=0)
        p = torch.softmax(target.head(top), -1)  # [L, V]
        vals, idx = p.topk(top_k, dim=-1)  # [L, K]
    # clones made outside inference mode: ordinary tensors that autograd may use
    return Features(seq, start, h.float().clone(), vals.float().clone(), idx.clone())


def head_weight(target: Any) -> Tensor:  # -> [V, D]
    """The target's LM head as a dense matrix (final-norm weight folded in): ``head(x) = rms_norm(x) @ W.T``."""
    d = target.cfg.hidden_size
    with torch.inference_mode():
        w = target.lm_head(torch.eye(d, dtype=target.dtype)).float().T  # [V, D]
    return w.contiguous().clone()  # outside inference mode: an ordinary tensor


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 300
    batch: int = 8  # sequences per step
    positions: int = 256  # positions per step the loss is computed on
    lr: float = 2e-3
    warmup: int = 20
    weight_decay: float = 0.0
    seed: int = 0


def draft_log_probs(adapter: Adapter, hidden: Tensor, w_head: Tensor) -> Tensor:  # hidden: [N, D] -> [N, V]
    """log q of the draft: adapter output → the target's final RMS norm → its LM head."""
    y = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + adapter.cfg.rms_eps)
    return torch.log_softmax(y @ w_head.T, -1)


def batch_loss(adapter: Adapter, data: Sequence[Features], w_head: Tensor, gen: torch.Generator, cfg: TrainConfig) -> Tensor:
    """Cross-entropy of the draft against the target's (renormalised) top-k law on a random batch."""
    pick = torch.randperm(len(data), generator=gen)[: cfg.batch].tolist()
    items = [data[i] for i in pick]
    t = max(f.tokens.numel() for f in items)
    d = items[0].hidden.shape[1]
    x = torch.zeros(len(items), t, d)  # [B, T, D] right-padded
    for b, f in enumerate(items):
        x[b, : f.tokens.numel()] = f.hidden
    rows = torch.cat([torch.stack([torch.full((f.tokens.numel() - 1,), b), torch.arange(f.tokens.numel() - 1)], 1)
                      for b, f in enumerate(items)])  # [M, 2] (sequence, position) with a next token
    rows = rows[torch.randperm(rows.shape[0], generator=gen)[: cfg.positions]]
    y = adapter(x)[rows[:, 0], rows[:, 1]]  # [P, D]
    logq = draft_log_probs(adapter, y, w_head)  # [P, V]
    p = torch.stack([items[b].top_p[i] for b, i in rows.tolist()])  # [P, K]
    idx = torch.stack([items[b].top_i[i] for b, i in rows.tolist()])
    p = p / p.sum(-1, keepdim=True)
    return -(p * logq.gather(1, idx)).sum(-1).mean()


def lr_at(step: int, cfg: TrainConfig) -> float:
    warm = min(1.0, (step + 1) / max(cfg.warmup, 1))
    return cfg.lr * warm * 0.5 * (1.0 + math.cos(math.pi * step / max(cfg.steps, 1)))


def train(adapter: Adapter, data: Sequence[Features], w_head: Tensor, cfg: TrainConfig, *, state: dict | None = None,
          on_step: Callable[[int, float, dict], None] | None = None) -> list[float]:
    """Train ``adapter`` in place for ``cfg.steps`` steps, resuming from ``state`` (a checkpoint
    dict from ``on_step``: adapter, optimiser, step, losses) when given.  Returns the losses."""
    opt = torch.optim.AdamW(adapter.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    start, losses = 0, []
    if state:
        adapter.load_state_dict(state["adapter"])
        opt.load_state_dict(state["optimizer"])
        start, losses = int(state["step"]), list(state["losses"])
    adapter.train()
    for step in range(start, cfg.steps):
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        loss = batch_loss(adapter, data, w_head, gen, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(adapter.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if on_step:
            on_step(step + 1, losses[-1], {"adapter": adapter.state_dict(), "optimizer": opt.state_dict(),
                                            "step": step + 1, "losses": losses})
    adapter.eval()
    return losses


def held_out_acceptance(target: Any, views: dict[str, LayerView], data: Sequence[Features]) -> dict[str, dict[str, float]]:
    """α₀ and α₁ of each draft view on teacher-forced held-out sequences, at their continuation
    positions only (see the module docstring); the target's full next-token law is recomputed."""
    sums = {name: [0.0, 0.0] for name in views}
    count = 0
    for f in data:
        p = torch.softmax(target.forward(f.tokens, target.new_cache(f.tokens.numel()))[f.start : -1], -1)  # [n, V]
        best = p.argmax(-1)  # [n]
        for name, view in views.items():
            logits = view.forward(f.tokens, view.new_cache(f.tokens.numel()))[f.start : -1]  # [n, V]
            sums[name][0] += float((logits.argmax(-1) == best).sum())
            sums[name][1] += float(torch.minimum(p, torch.softmax(logits, -1)).sum())
        count += best.numel()
    return {name: {"alpha_t0": round(a / count, 4), "alpha_t1": round(b / count, 4)} for name, (a, b) in sums.items()}


def report(target: Any, adapter: Adapter, data: Sequence[Features]) -> dict[str, Any]:
    """Held-out α₀ / α₁ of the trained draft next to ``layerskip:k`` (the untrained draft)."""
    k = adapter.cfg.exit_after
    views = {"kangaroo": KangarooView(target, adapter),
             f"layerskip:{k}": LayerView(target, LayerPlan.early_exit(target.cfg.n_layers, k))}
    out: dict[str, Any] = {"held_out_positions": sum(f.tokens.numel() - 1 - f.start for f in data)}
    out.update(held_out_acceptance(target, views, data))
    return out


def new_adapter(target: Any, k: int, *, seed: int = 0) -> Adapter:
    return Adapter(AdapterConfig.for_target(target.cfg, k), seed=seed)

