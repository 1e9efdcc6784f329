"""``specdec train distill``: distil the small draft model towards the target (DistillSpec).

DistillSpec (Zhou et al. 2024) trains the draft on the *target's own law*: what speculative
sampling accepts at T = 1 is ``sum_v min(p_v, q_v) = 1 - TVD(p, q)``, and at T = 0 the draft
token is kept when the two arg-maxes agree, so the draft should match the target's next-token
distribution where the target actually goes — not the pre-training corpus.  Here:

* **data**: sequences the target itself generated (``specdec train data --no-features``:
  chat replies and code continuations at T = 0 and T = 1, none of the benchmark's prompts);
* **labels**: one teacher-forced target pass per sequence, keeping the top-``k`` probabilities at
  every reply position (``k`` = 32 covers most of the mass; the loss renormalises them);
* **loss**: forward KL ``KL(p || q)`` on the top-``k`` support (``kl``) or the total variation
  distance ``TVD = 1 - sum min(p, q)`` over that support, the quantity acceptance is (``tvd``);
* **student**: the shipped draft (a Hugging Face Llama), trained in float32 with AdamW and a
  cosine schedule on a random sample of reply positions per step (the 49k-row LM head makes every
  position's softmax the dear part), then saved in float16 as a model folder ``--draft`` loads.

Every 20th sequence is held out.  The report gives, per prompt kind, the held-out teacher-forced
acceptance before and after training: greedy agreement (arg-max q = arg-max p) and
``sum min(p, q)`` over the target's top-``k`` (a lower bound of T = 1 acceptance).  A run
checkpoints its state and resumes where it stopped.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from specdec.train.common import split  # noqa: F401 - part of this module's interface (ds.split)
from specdec.train.kangaroo import lr_at  # warm-up then cosine: the same schedule as the Kangaroo adapter's

LOSSES = ("kl", "tvd")


@dataclass(frozen=True)
class DistillConfig:
    steps: int = 600
    batch: int = 8  # sequences per step
    positions: int = 512  # reply positions per step the loss is computed on
    lr: float = 1e-4
    warmup: int = 20
    weight_decay: float = 0.0
    top_k: int = 32
    loss: str = "kl"  # kl | tvd
    held_out_every: int = 20  # every n-th sequence is held out
    seed: int = 0


@dataclass(frozen=True)
class Labels:
    """One sequence with the target's law at its reply positions."""

    tokens: Tensor  # [L] int64
    start: int  # first position whose *next* token is part of the reply (prompt length - 1)
    top_p: Tensor  # [L - 1 - start, K] float32: target probabilities (T = 1) of its top-k tokens
    top_i: Tensor  # [L - 1 - start, K] int64
    kind: str  # chat | code


@torch.inference_mode()
def label(target: Any, tokens: Tensor, prompt_len: int, kind: str, *, top_k: int) -> Labels:
    """One teacher-forced pass of ``target`` (a LanguageModel) over ``tokens`` [L]."""
    tokens = tokens.long()
    logits = target.forward(tokens, target.new_cache(tokens.numel()))  # [L, V]
    start = max(prompt_len - 1, 0)
    p = torch.softmax(logits[start:-1].float(), -1)  # [L - 1 - start, V]: the law of tokens start+1 ..
    vals, idx = p.topk(top_k, dim=-1)
    return Labels(tokens.clone(), start, vals.clone(), idx.clone(), kind)


def _batch(items: Sequence[Labels]) -> tuple[Tensor, Tensor]:  # -> tokens [B, T] (right-padded), mask [B, T]
    t = max(x.tokens.numel() for x in items)
    ids = torch.zeros(len(items), t, dtype=torch.long)
    mask = torch.zeros(len(items), t, dtype=torch.long)
    for b, x in enumerate(items):
        ids[b, : x.tokens.numel()] = x.tokens
        mask[b, : x.tokens.numel()] = 1
    return ids, mask


def draft_log_probs(student: Any, items: Sequence[Labels], rows: Tensor) -> Tensor:
    """log q at the ``rows`` [P, 2] = (sequence in ``items``, reply row) positions -> [P, V]."""
    ids, mask = _batch(items)
    hidden = student.model(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, T, D]
    starts = torch.tensor([x.start for x in items])
    h = hidden[rows[:, 0], starts[rows[:, 0]] + rows[:, 1]]  # [P, D]: positions that predict the next token
    return torch.log_softmax(student.lm_head(h).float(), -1)


def loss_of(logq: Tensor, p: Tensor, idx: Tensor, kind: str) -> Tensor:  # logq: [P, V]; p, idx: [P, K]
    """Mean loss over positions: forward KL on the renormalised top-k support, or TVD on it."""
    p = p / p.sum(-1, keepdim=True)
    lq = logq.gather(1, idx)  # [P, K]
    if kind == "kl":
        return (p * (p.clamp_min(1e-30).log() - lq)).sum(-1).mean()
    if kind == "tvd":  # 1 - sum min(p, q): mass of q outside the support counts as disagreement
        return (1.0 - torch.minimum(p, lq.exp()).sum(-1)).mean()
    raise ValueError(f"unknown loss {kind!r}; choose one of {', '.join(LOSSES)}")


def _all_rows(items: Sequence[Labels]) -> Tensor:  # -> [P, 2]: (sequence in items, reply row) for every row
    return torch.cat([torch.stack([torch.full((x.top_p.shape[0],), b), torch.arange(x.top_p.shape[0])], 1)
                      for b, x in enumerate(items)])


def _rows(items: Sequence[Labels], positions: int, gen: torch.Generator) -> Tensor:  # -> [P, 2], a random sample
    rows = _all_rows(items)
    return rows[torch.randperm(rows.shape[0], generator=gen)[:positions]]


def train(
    student: Any,
    data: Sequence[Labels],
    cfg: DistillConfig,
    *,
    state: dict | None = None,
    on_step: Callable[[int, float, dict], None] | None = None,
    max_seconds: float | None = None,
) -> list[float]:
    """Train ``student`` (a Hugging Face causal LM, modified in place) from ``state`` (a
    checkpoint's ``{"step", "optim", "gen"}``) up to ``cfg.steps``; returns this run's losses.
    ``on_step(step, loss, state)`` after every step, with the state to checkpoint (it refers to
    the live optimiser tensors: save or copy it at once)."""
    if cfg.loss not in LOSSES:
        raise ValueError(f"unknown loss {cfg.loss!r}; choose one of {', '.join(LOSSES)}")
    student.train()
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    step = 0
    if state is not None:
        opt.load_state_dict(state["optim"])
        gen.set_state(state["gen"])
        step = state["step"]
    t0 = time.perf_counter()
    losses = []
    while step < cfg.steps:
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
        pick = torch.randperm(len(data), generator=gen)[: cfg.batch].tolist()
        items = [data[i] for i in pick]
        rows = _rows(items, cfg.positions, gen)
        logq = draft_log_probs(student, items, rows)
        p = torch.stack([items[b].top_p[r] for b, r in rows.tolist()])  # [P, K]
        idx = torch.stack([items[b].top_i[r] for b, r in rows.tolist()])
        loss = loss_of(logq, p, idx, cfg.loss)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        losses.append(float(loss.detach()))
        if on_step is not None:
            on_step(step, float(loss.detach()), {"step": step, "optim": opt.state_dict(), "gen": gen.get_state()})
    student.eval()
    return losses


@torch.no_grad()
def held_out_acceptance(student: Any, data: Sequence[Labels], *, batch: int = 8) -> dict[str, dict[str, float]]:
    """Teacher-forced acceptance on ``data`` per kind (and ``all``): ``greedy`` = P(arg-max q =
    arg-max p), ``t1_lower`` = mean over positions of ``sum min(p, q)`` on the target's top-k
    (a lower bound of the T = 1 acceptance rate), ``positions``."""
    was_training = student.training
    student.eval()
    sums: dict[str, list[float]] = {}
    for a in range(0, len(data), batch):
        items = list(data[a : a + batch])
        rows = _all_rows(items)
        logq = draft_log_probs(student, items, rows)  # [P, V]
        for (b, r), lq in zip(rows.tolist(), logq):
            x = items[b]
            greedy = float(int(lq.argmax()) == int(x.top_i[r, 0]))
            t1 = float(torch.minimum(x.top_p[r], lq[x.top_i[r]].exp()).sum())
            for key in (x.kind, "all"):
                s = sums.setdefault(key, [0.0, 0.0, 0.0])
                s[0] += greedy
                s[1] += t1
                s[2] += 1
    if was_training:
        student.train()
    return {k: {"greedy": round(g / n, 4), "t1_lower": round(t / n, 4), "positions": int(n)} for k, (g, t, n) in sums.items()}


def save_draft(student: Any, source: Path, out: Path, card: dict) -> Path:
    """Write the student as a model folder (float16 safetensors, the source draft's tokenizer and
    chat template) with a model card (``README.md`` + ``card.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    student.to(torch.float16).save_pretrained(out)
    student.to(torch.float32)
    for f in source.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json",
                                                                         "special_tokens_map.json")):
            shutil.copy(f, out / f.name)
    (out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    (out / "README.md").write_text(model_card(card))
    return out


def model_card(card: dict) -> str:
    def row(name: str, acc: dict) -> list[str]:
        return [f"| {name} | {k} | {v['greedy']:.3f} | {v['t1_lower']:.3f} | {v['positions']} |" for k, v in sorted(acc.items())]

    sampler = card["data"].get("sampler", "target")
    source = "target-generated" if sampler == "target" else f"`{sampler}`-generated (on-policy)"
    lines = [
        f"# Distilled draft for {card['target']}",
        "",
        f"Re-distilled from `{card['source']}` towards the target's own next-token law (DistillSpec; loss "
        f"`{card['config']['loss']}` on the target's top-{card['config']['top_k']} probabilities).",
        "",
        f"* Data: {card['train_sequences']} {source} sequences ({card['train_positions']} reply positions), "
        f"{card['held_out_sequences']} held out; data settings: {card['data']}.",
        f"* Training: {card['steps']} steps × {card['config']['batch']} sequences × {card['config']['positions']} "
        f"positions, lr {card['config']['lr']}, AdamW + cosine; wall time {card['train_seconds']:.0f} s on "
        f"{card['machine']}.",
        f"* Command: `{card['command']}`",
        "",
        "Held-out teacher-forced acceptance on held-out sequences of the same data (greedy: arg-max agreement; "
        "t1_lower: sum min(p, q) on the target's top-k):",
        "",
        "| draft | kind | greedy | t1_lower | positions |",
        "|---|---|---|---|---|",
        *row("before (source draft)", card["held_out_before"]),
        *row("after", card["held_out_after"]),
        "",
    ]
    return "\n".join(lines)


def config_dict(cfg: DistillConfig) -> dict:
    return asdict(cfg)
