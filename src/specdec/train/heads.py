"""``specdec train eagle|medusa|mtp``: fit a draft head to the target's features, on a CPU.

Data: the shards of ``specdec train data`` (target-sampled sequences with the target's features
at every position).  Labels are the target's own next-token law, not the sampled tokens
(self-distillation): for position u, ``p_u = softmax(W f_u)`` over the draft vocabulary, with
``W`` the target's LM head (final norm folded in) — the draft should match the target's law,
which is what acceptance measures.  The loss is the cross-entropy ``-Σ p log q`` on reply
positions only (the prompt is context, not something a draft will be asked to guess).

The draft vocabulary is the ``draft_vocab`` most frequent tokens of the training replies (plus
the end-of-sequence tokens).  Every 20th sequence is held out; the report gives, on those, the
per-step acceptance a draft would see: ``E[min(p, q)]`` (the per-token acceptance of token
verification at T = 1) and top-1 agreement (T = 0), teacher-forced, per draft step.

Training resumes from ``ckpt.pt`` in the output folder (model, optimiser, step, data order);
``--max-minutes`` bounds one invocation so a long job runs across sessions.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.errors import ConfigError
from specdec.heads.modules import MTP, Eagle, HeadConfig, Medusa, build, frozen_head_rows, rope_tables, save_head, ttt_mask
from specdec.models.registry import read_config
from specdec.train import state
from specdec.train.common import length_batches, warmup_cosine
from specdec.train.data import Shard, load_shards


@dataclass(frozen=True)
class TrainConfig:
    kind: str
    steps: int = 2000
    batch_tokens: int = 2048
    lr: float = 5e-4
    warmup: int = 50
    weight_decay: float = 0.0
    clip: float = 1.0
    draft_vocab: int = 8192
    depth: int = 3  # TTT steps (EAGLE), heads (Medusa), modules (MTP)
    step_decay: float = 0.8  # weight of step/head k is step_decay ** k
    regression: float = 1.0  # EAGLE-1: weight of the feature regression loss (the LM loss has weight 0.1 there)
    eval_every: int = 500
    ckpt_every: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if self.eval_every < 1 or self.ckpt_every < 1:  # both are taken modulo the step
            raise ConfigError(f"eval_every and ckpt_every must be >= 1, not {self.eval_every} and {self.ckpt_every}")


@dataclass
class TargetHead:
    """The target's frozen pieces a head needs: token embeddings and LM head (final norm folded in)."""

    embed: Tensor  # [V, D]
    head: Tensor  # [V, D]
    eos_ids: tuple[int, ...]
    name: str
    cfg: Any  # NativeConfig

    @classmethod
    def from_folder(cls, folder: Path, name: str, eos_ids: frozenset[int]) -> "TargetHead":
        from safetensors.torch import load_file

        from specdec.models.native import NativeConfig

        cfg = NativeConfig.from_hf(read_config(folder))
        w: dict[str, Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            w.update(load_file(str(f)))
        embed = w["model.embed_tokens.weight"].float()
        head = embed if cfg.tie_embeddings or "lm_head.weight" not in w else w["lm_head.weight"].float()
        return cls(embed, head * w["model.norm.weight"].float(), tuple(sorted(eos_ids)), name, cfg)


def reply_counts(sequences: Iterable[tuple[Tensor, int]], vocab: int) -> Tensor:  # -> [V] int64
    """How often each token occurs in the replies of (ids [n], prompt length) pairs."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for ids, n0 in sequences:
        counts += torch.bincount(ids[n0:].long().cpu(), minlength=vocab)
    return counts


def top_tokens(counts: Tensor, size: int, always: tuple[int, ...]) -> Tensor:  # [V] -> [Vd] sorted target ids
    """The ``size`` most frequent tokens, ``always`` among them (end-of-sequence ids)."""
    counts = counts.clone()
    counts[list(always)] = counts.max() + 1
    return counts.topk(min(size, counts.numel())).indices.sort().values


def draft_vocabulary(data: Shard, size: int, vocab: int, always: tuple[int, ...]) -> Tensor:  # -> [Vd] sorted target ids
    return top_tokens(reply_counts(zip(data.tokens, data.prompt_len), vocab), size, always)


def head_config(kind: str, target: TargetHead, d2t: Tensor, data_taps: tuple[int, ...], cfg: TrainConfig) -> HeadConfig:
    t = target.cfg
    inputs = tuple(range(len(data_taps))) if kind == "eagle3" else (len(data_taps),)
    return HeadConfig(
        kind=kind, hidden_size=t.hidden_size, n_heads=t.n_heads, n_kv_heads=t.n_kv_heads, head_dim=t.head_dim,
        intermediate_size=t.intermediate_size, target_vocab=t.vocab_size, draft_vocab=int(d2t.numel()),
        rms_eps=t.rms_eps, rope_theta=t.rope_theta, inputs=inputs, taps=data_taps, depth=cfg.depth, target=target.name,
    )


# ----------------------------------------------------------------------------- batches


@dataclass
class Batch:
    tokens: Tensor  # [B, T] int64 (padded with 0)
    feats: Tensor  # [B, T, k, D] float32
    length: Tensor  # [B]
    prompt_len: Tensor  # [B]


def batches(data: Shard, index: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Groups of sequence indices of similar length, about ``batch_tokens`` padded tokens each."""
    return length_batches([t.numel() for t in data.tokens], index, batch_tokens, rng)


def collate(data: Shard, group: list[int]) -> Batch:
    t = max(data.tokens[i].numel() for i in group)
    b = len(group)
    k, d = data.feats[group[0]].shape[1:]
    tokens = torch.zeros(b, t, dtype=torch.long)
    feats = torch.zeros(b, t, k, d)
    for r, i in enumerate(group):
        n = data.tokens[i].numel()
        tokens[r, :n] = data.tokens[i].long()
        feats[r, :n] = data.feats[i].float()
    return Batch(tokens, feats, torch.tensor([data.tokens[i].numel() for i in group]),
                 torch.tensor([data.prompt_len[i] for i in group]))


def target_logp(batch: Batch, w_draft: Tensor) -> Tensor:  # -> [B, T, Vd] log p over the draft vocabulary
    return torch.log_softmax(batch.feats[:, :, -1] @ w_draft.T, dim=-1)


def reply_mask(batch: Batch, offset: int, count: int, first: int = 0) -> Tensor:  # -> [B, count] bool
    """Rows t in [0, count) whose label is the target's law at position t + offset, predicting token
    t + offset + 1: valid when that position exists, the token is a reply token, and t >= first."""
    t = torch.arange(count, device=batch.length.device)[None, :]
    pos = t + offset
    return (pos < batch.length[:, None]) & (pos + 1 >= batch.prompt_len[:, None]) & (t >= first)


# ----------------------------------------------------------------------------- per-kind forward


def _soft_ce(logits: Tensor, logp: Tensor, mask: Tensor) -> Tensor:  # [B, T, Vd] x2, [B, T] -> scalar
    per = -(logp.exp() * torch.log_softmax(logits, dim=-1)).sum(-1)
    return (per * mask).sum() / mask.sum().clamp_min(1)


def step_outputs(model: nn.Module, batch: Batch, embed: Tensor) -> list[tuple[Tensor, int, Tensor, Tensor | None]]:
    """Per draft step k: (logits [B, T', Vd], label offset, valid mask [B, T'], predicted feature or None).

    EAGLE: step k is training-time-test step k (row t predicts token t + 2 from the law at t + 1);
    Medusa: head k (row t predicts token t + k + 2); MTP: module k (the same as Medusa's offsets).
    """
    cfg: HeadConfig = model.cfg  # type: ignore[assignment]
    b, t = batch.tokens.shape
    dev = batch.tokens.device
    emb = embed[batch.tokens]  # [B, T, D]
    out: list[tuple[Tensor, int, Tensor, Tensor | None]] = []
    if isinstance(model, Eagle):
        tp = t - 1
        cos, sin = rope_tables(torch.arange(tp, device=dev), cfg.head_dim, cfg.rope_theta)
        g = model.fuse(batch.feats)[:, :tp]  # [B, T', D]
        emb_next = emb[:, 1:]
        keys: list[Tensor] = []
        values: list[Tensor] = []
        for s in range(cfg.depth):
            attn_in, resid = model.layer_input(g, emb_next)
            q, k, v = model.layer.attn.project(attn_in, cos, sin)
            keys.append(k)
            values.append(v)
            o = model.layer.finish(resid, model.layer.attn.attend(q, torch.cat(keys, 2), torch.cat(values, 2), ttt_mask(tp, s, dev)))
            out.append((model.logits(o), 1, reply_mask(batch, 1, tp, first=s), o))
            g = torch.cat([torch.zeros_like(o[:, :1]), o[:, :-1]], dim=1)  # step s+1 at t reads o^s at t-1
        return out
    f = batch.feats[:, :, -1]  # [B, T, D]
    if isinstance(model, Medusa):
        logits = model(f)  # [K, B, T, Vd]
        return [(logits[k][:, : t - k - 1], k + 1, reply_mask(batch, k + 1, t - k - 1), None)
                for k in range(cfg.depth) if t - k - 1 > 0]
    assert isinstance(model, MTP)
    h = f
    for k in range(cfg.depth):
        n = t - k - 1
        if n <= 0:
            break
        cos, sin = rope_tables(torch.arange(n, device=dev), cfg.head_dim, cfg.rope_theta)
        attn_in, resid = model.module_input(k, h[:, :n], emb[:, k + 1 : k + 1 + n])
        layer = model.layers[k]
        q, kk, v = layer.attn.project(attn_in, cos, sin)
        h = layer.finish(resid, layer.attn.attend(q, kk, v, ttt_mask(n, 0, dev)))
        out.append((model.logits(h), k + 1, reply_mask(batch, k + 1, n), None))
    return out


def loss_fn(model: nn.Module, batch: Batch, embed: Tensor, w_draft: Tensor, cfg: TrainConfig) -> tuple[Tensor, list[float]]:
    logp = target_logp(batch, w_draft)  # [B, T, Vd]
    total = torch.zeros((), device=batch.tokens.device)
    parts: list[float] = []
    for k, (logits, off, mask, o) in enumerate(step_outputs(model, batch, embed)):
        n = logits.shape[1]
        ce = _soft_ce(logits, logp[:, off : off + n], mask)
        term = ce
        if o is not None and model.cfg.kind == "eagle1":  # type: ignore[union-attr]
            target_f = batch.feats[:, off : off + n, -1]
            reg = (F.smooth_l1_loss(o, target_f, reduction="none").mean(-1) * mask).sum() / mask.sum().clamp_min(1)
            term = cfg.regression * reg + 0.1 * ce
        total = total + cfg.step_decay**k * term
        parts.append(float(ce.detach()))
    return total, parts


# ----------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model: nn.Module, data: Shard, index: list[int], target: TargetHead, d2t: Tensor, batch_tokens: int) -> dict:
    """Held-out, teacher-forced, per draft step: E[min(p, q)] (T = 1 acceptance) and top-1 agreement
    (T = 0), over all held-out sequences and per prompt kind (``by_kind``: chat, code)."""
    model.eval()
    sums: dict[str, dict[int, list[float]]] = {}  # kind -> step -> [accept, agree, covered, n]
    kinds = sorted({data.kind[i] for i in index})
    for kind in kinds:
        subset = [i for i in index if data.kind[i] == kind]
        for group in batches(data, subset, batch_tokens, random.Random(0)):
            score(model, collate(data, group), target.embed, target.head, d2t, sums.setdefault(kind, {}))
    model.train()
    return rate_table(sums)


@torch.no_grad()
def score(model: nn.Module, batch: Batch, embed: Tensor, head: Tensor, d2t: Tensor, sums: dict[int, list[float]]) -> None:
    """Add one batch's teacher-forced counts per draft step k to ``sums[k]`` = [sum min(p, q), top-1
    agreements, draft-vocabulary mass of p, positions]; ``head`` [V, D] is the target's whole LM head
    (final norm folded in), so p is the target's full law."""
    f = batch.feats[:, :, -1].float()  # [B, T, D]
    for k, (logits, off, mask, _) in enumerate(step_outputs(model, batch, embed)):
        n = logits.shape[1]
        rows = mask.nonzero(as_tuple=True)
        q = torch.softmax(logits[rows].float(), -1)  # [N, Vd]
        p = torch.softmax(f[:, off : off + n][rows] @ head.T, -1)  # [N, V]
        s = sums.setdefault(k, [0.0, 0.0, 0.0, 0.0])
        s[0] += float(torch.minimum(p[:, d2t], q).sum())
        s[1] += float((d2t[q.argmax(-1)] == p.argmax(-1)).float().sum())
        s[2] += float(p[:, d2t].sum())
        s[3] += float(rows[0].numel())


def rate_table(sums: dict[str, dict[int, list[float]]]) -> dict:
    """Per-kind counts of :func:`score` as rates: {"steps": [...all kinds...], "by_kind": {kind: [...]}}."""

    def rates(per_step: dict[int, list[float]]) -> list[dict]:
        return [{"step": k + 1, "accept_t1": a / max(n, 1), "top1": g / max(n, 1), "vocab_mass": c / max(n, 1),
                 "positions": int(n)} for k, (a, g, c, n) in sorted(per_step.items())]

    total: dict[int, list[float]] = {}
    for per_step in sums.values():
        for k, vals in per_step.items():
            total[k] = [x + y for x, y in zip(total.get(k, [0.0] * 4), vals)]
    return {"steps": rates(total), "by_kind": {kind: rates(sums[kind]) for kind in sums}}


def expected_tokens_per_call(rates: list[float]) -> float:
    """Chain of len(rates) with independent per-step acceptance rates: 1 + Σ_k Π_{j<=k} a_j."""
    total, run = 1.0, 1.0
    for a in rates:
        run *= a
        total += run
    return total


# ----------------------------------------------------------------------------- the loop


def train(
    cfg: TrainConfig,
    data_dir: Path,
    out: Path,
    target: TargetHead,
    *,
    max_minutes: float | None = None,
    stop_after: int | None = None,
    progress: Callable[[int, float, list[float]], None] | None = None,
) -> dict:
    """Train (or resume training) a head; writes ``out``/{ckpt.pt, config.json, model.safetensors, report.*}."""
    torch.manual_seed(cfg.seed)
    data = load_shards(data_dir)
    if not data.tokens:
        raise ValueError(f"{data_dir} holds no training shards (run `specdec train data` first)")
    data_cfg = read_config(data_dir)
    taps = tuple(data_cfg["taps"])
    held = [i for i in range(len(data.tokens)) if i % 20 == 0]
    train_idx = [i for i in range(len(data.tokens)) if i % 20 != 0]
    out.mkdir(parents=True, exist_ok=True)
    ckpt_path = out / "ckpt.pt"
    ckpt = state.load(ckpt_path)
    # what the checkpoint must have been made with to be continued (a larger --steps extends it;
    # how often it evaluates and saves changes nothing learnt)
    run_key = {**{k: v for k, v in asdict(cfg).items() if k not in ("steps", "eval_every", "ckpt_every")},
               "data": data_cfg, "target": target.name}
    if ckpt is not None:
        state.check_resume(ckpt_path, {**ckpt.get("train", {}), **ckpt.get("run", {})}, run_key)
        d2t = ckpt["d2t"]
        hcfg = HeadConfig.from_json(ckpt["head_config"])
    else:
        d2t = draft_vocabulary(data, cfg.draft_vocab, target.cfg.vocab_size, target.eos_ids)
        hcfg = head_config(cfg.kind, target, d2t, taps, cfg)
    model = build(hcfg)
    w_draft = target.head[d2t]  # [Vd, D]
    with torch.no_grad():
        model.d2t.copy_(d2t)
        model.lm_head.weight.copy_(w_draft)
    if frozen_head_rows(hcfg.kind):
        model.lm_head.weight.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step, seconds, epoch, cursor, history = 0, 0.0, 0, 0, []
    if ckpt is not None:
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        step, seconds, epoch, cursor, history = ckpt["step"], ckpt["seconds"], ckpt["epoch"], ckpt["cursor"], ckpt["history"]
        print(f"[specdec] resuming from step {step} ({ckpt_path})", file=sys.stderr)
    model.train()

    def schedule(s: int) -> float:
        return warmup_cosine(s, cfg.steps, cfg.warmup)

    def save_ckpt() -> None:
        state.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "seconds": seconds, "epoch": epoch,
                    "cursor": cursor, "history": history, "d2t": d2t, "head_config": hcfg.to_json(), "train": asdict(cfg),
                    "run": run_key}, ckpt_path)

    started = time.perf_counter()
    order = batches(data, train_idx, cfg.batch_tokens, random.Random(cfg.seed + epoch))
    tokens_seen = 0
    signals = state.BetweenSteps()  # Ctrl-C / SIGTERM: the step in progress ends, then its state is saved
    with signals:
        while step < cfg.steps:
            if max_minutes is not None and time.perf_counter() - started > 60 * max_minutes:
                break
            if stop_after is not None and step >= stop_after:
                break
            if cursor >= len(order):
                epoch, cursor = epoch + 1, 0
                order = batches(data, train_idx, cfg.batch_tokens, random.Random(cfg.seed + epoch))
            t0 = time.perf_counter()
            batch = collate(data, order[cursor])
            cursor += 1
            for g in opt.param_groups:
                g["lr"] = cfg.lr * schedule(step)
            loss, parts = loss_fn(model, batch, target.embed, w_draft, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
            opt.step()
            step += 1
            tokens_seen += int(batch.length.sum())
            seconds += time.perf_counter() - t0
            value = float(loss.detach())
            if step % 10 == 0 or step == 1:
                history.append({"step": step, "loss": value, "ce": parts, "epoch": epoch})
            if progress is not None:
                progress(step, value, parts)
            if step % cfg.ckpt_every == 0:
                save_ckpt()
            if step % cfg.eval_every == 0:
                history.append({"step": step, "eval": evaluate(model, data, held, target, d2t, cfg.batch_tokens)})
            if signals.pending is not None:
                save_ckpt()
                signals.stop_if_pending(step, ckpt_path)
    save_ckpt()
    report = {
        "kind": hcfg.kind, "target": target.name, "steps": step, "train_seconds": round(seconds, 1), "epochs": epoch,
        "train_sequences": len(train_idx), "held_out_sequences": len(held),
        "train_tokens": int(sum(data.tokens[i].numel() for i in train_idx)),
        "reply_tokens": int(sum(data.tokens[i].numel() - data.prompt_len[i] for i in train_idx)),
        "params_trained": sum(p.numel() for p in params), "params_total": sum(p.numel() for p in model.parameters()),
        "draft_vocab": int(d2t.numel()), "config": asdict(cfg), "data": data_cfg,
        "held_out": evaluate(model, data, held, target, d2t, cfg.batch_tokens), "finished": step >= cfg.steps,
    }
    rates = [s["top1"] for s in report["held_out"]["steps"]]
    report["held_out"]["chain_tokens_per_call_t0_estimate"] = expected_tokens_per_call(rates)
    rates1 = [s["accept_t1"] for s in report["held_out"]["steps"]]
    report["held_out"]["chain_tokens_per_call_t1_estimate"] = expected_tokens_per_call(rates1)
    save_head(model, out)
    report["history"] = history
    state.write_text(out / "report.json", json.dumps(report, indent=1))
    state.write_text(out / "README.md", model_card(report))
    return report


def model_card(report: dict) -> str:
    """A short model card: what the head is, the data, the training cost, held-out acceptance."""
    data = report["data"]
    cfg = report["config"]
    lines = [
        f"# {report['target']} {report['kind']} draft head",
        "",
        f"Trained with `specdec train` against the target `{report['target']}` as it runs by default (its features and "
        "its next-token law; the int8 target where torch has fbgemm).",
        "",
        f"- Parameters: {report['params_total'] / 1e6:.2f} M ({report['params_trained'] / 1e6:.2f} M trained"
        + ("" if report["params_trained"] == report["params_total"] else "; the rest is the target's LM head rows")
        + f"), a {report['draft_vocab']}-token draft vocabulary, plus the target's own embeddings at run time.",
        f"- Data: {report['train_sequences']} target-sampled sequences for training ({report['train_tokens']} tokens, "
        f"{report['reply_tokens']} of them reply tokens), {report['held_out_sequences']} held out; share of chat prompts "
        f"{data.get('chat_share')}, temperatures {data.get('temperatures')}, feature taps {data.get('taps')}.",
        f"- Training: {report['steps']} steps of about {cfg['batch_tokens']} padded tokens, lr {cfg['lr']}, depth "
        f"{cfg['depth']}, {report['epochs']} full epochs; {report['train_seconds'] / 60:.1f} min of training on this "
        "machine's CPU (data generation not included).",
        "",
        "Held-out, teacher-forced, per draft step (E[min(p, q)] = token verification's acceptance at T = 1; top-1 = "
        "agreement with the target's argmax, T = 0):",
        "",
        "| draft step | E[min(p, q)] | top-1 | target mass in the draft vocabulary | positions |",
        "|---|---|---|---|---|",
    ]
    for st in report["held_out"]["steps"]:
        lines.append(f"| {st['step']} | {st['accept_t1']:.3f} | {st['top1']:.3f} | {st['vocab_mass']:.3f} | {st['positions']} |")
    ho = report["held_out"]
    by_kind = ho.get("by_kind", {})
    if by_kind:
        depth = max(len(steps) for steps in by_kind.values())
        lines += ["", "By prompt kind (E[min(p, q)] / top-1 per draft step):", "",
                  "| prompts | positions | " + " | ".join(f"step {k + 1}" for k in range(depth)) + " |",
                  "|---|---|" + "---|" * depth]
        for kind, steps in by_kind.items():
            cells = [f"{st['accept_t1']:.3f} / {st['top1']:.3f}" for st in steps] + ["–"] * (depth - len(steps))
            lines.append(f"| {kind} | {steps[0]['positions'] if steps else 0} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Chain estimate from these rates (independent steps): {ho['chain_tokens_per_call_t0_estimate']:.2f} tokens per "
        f"target call at T = 0, {ho['chain_tokens_per_call_t1_estimate']:.2f} at T = 1.",
        "",
    ]
    return "\n".join(lines)


def replace_kind(cfg: TrainConfig, kind: str) -> TrainConfig:
    return replace(cfg, kind=kind)
