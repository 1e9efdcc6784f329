"""``specdec train online``: distil the small draft with the target running live beside it.

``specdec train distill`` is sized for two CPU cores: sequences generated once, the target's
top-32 probabilities cached, 512 positions a step.  When an accelerator is at hand the target
is cheap enough to run *inside* the training loop, which removes every one of those cuts:

1. **generate**: the target answers many prompts at once (chat instructions and code headers,
   none of the benchmark's; several temperatures) with a batched KV cache, for a fixed number
   of sequences or a time budget;
2. **distil**: every step scores a batch of those sequences with the target (teacher-forced)
   and the draft, and minimises the forward KL between the target's full next-token law and the
   draft's at every reply position (the quantity whose complement bounds T = 1 acceptance, and
   whose arg-max agreement is T = 0 acceptance);
3. **report**: held-out sequences (every 20th) scored before and after, per prompt kind:
   arg-max agreement and ``sum min(p, q)`` over the whole vocabulary (T = 1 acceptance).

The target is read from its GGUF file here (4-bit and 8-bit blocks dequantised), and both models
run through one small functional Llama (:func:`hidden`), so this module needs nothing but torch
and safetensors: it runs on a bare GPU machine from a bundle (:func:`write_bundle`: the draft
folder, the tokenised prompts, the target's config and sha256) and the GGUF file, and on a CPU
through the CLI (slowly: it is the same computation).
The draft can be deepened first (``add_layers``): new layers start as exact identities (their
output projections zero), so training starts from the shipped draft's behaviour.  Draft heads
(``heads``: EAGLE-3, EAGLE-1, Medusa, MTP, :mod:`specdec.heads.modules`) can train beside it on
the same target passes: the pass also records the target's feature taps, and each head is fitted
with ``specdec train eagle``'s loss (:func:`specdec.train.heads.loss_fn`, training-time test
included) over a draft vocabulary of the most frequent reply tokens.

Everything resumes to the result of an uninterrupted run: generation saves its sequences and
sampler state after every batch (``data.partial.pt``, then ``data.pt``), training the students
and optimisers every ``ckpt_every`` steps and when paused (``ckpt.pt``).  A time-bounded run
(``gen_seconds``, ``train_seconds``) records the counts it reached, so a rerun with
``sequences`` and ``steps`` set replays it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from specdec.drafters.fed import CONFIG_KEY as FED_CONFIG_KEY
from specdec.drafters.fed import NULL as FED_NULL
from specdec.drafters.fed import PROJ as FED_PROJ
from specdec.drafters.fed import fed_input  # the features' layout, shared with the drafter
from specdec.models.registry import read_config
from specdec.train import state
from specdec.train.common import length_batches, split, warmup_cosine


#: settings a run may change between its resumed parts (how long, in steps or seconds; how many
#: sequences a generation pass holds; how often it saves): every other one must match the folder's run
RESUMABLE = ("steps", "train_seconds", "gen_seconds", "gen_batch", "ckpt_every", "bf16")


@dataclass(frozen=True)
class OnlineConfig:
    sequences: int = 0  # sequences to generate (0: as many as gen_seconds allows)
    gen_seconds: float = 120.0  # generation budget when sequences == 0
    gen_batch: int = 512  # sequences decoded together
    max_new_chat: int = 192
    max_new_code: int = 128
    temperatures: tuple[float, ...] = (0.0, 1.0, 0.7)  # every prompt once at each
    code_repeats: int = 4  # code prompts are few (~1k): each is sampled this many times at each T > 0
    steps: int = 0  # optimiser steps (0: as many as train_seconds allows, measured after warm-up)
    train_seconds: float = 240.0
    batch_tokens: int = 16384  # padded tokens per step
    lr: float = 2e-4
    warmup: int = 30
    weight_decay: float = 0.0
    add_layers: tuple[int, ...] = (0,)  # one student per entry: identity-initialised layers appended to the draft (none: heads only)
    bf16: bool | None = None  # target in bfloat16, draft under bfloat16 autocast (None: on a GPU)
    #: draft heads trained beside the students on the same target passes (eagle3, eagle1, medusa, mtp)
    heads: tuple[str, ...] = ()
    head_vocab: int = 8192  # each head's draft vocabulary: the most frequent reply tokens of the training data
    head_depth: int = 3  # EAGLE's training-time-test steps, Medusa's heads, MTP's modules
    head_lr: float = 5e-4
    init_heads: str = ""  # a folder with <kind>/ head folders (an earlier run's --out): heads continue from them, their draft vocabulary kept
    #: > 0: also train a feature-fed copy of the draft (the target's taps projected into its input,
    #: see :func:`fed_streams`) with this many training-time-test streams (draft steps)
    fed: int = 0
    #: the fed draft's projection and null vector (its other weights take ``lr``): one fed draft per value
    fed_lr: tuple[float, ...] = (1e-3,)
    held_out_every: int = 20
    ckpt_every: int = 200
    seed: int = 0


# ----------------------------------------------------------------------------- the functional Llama


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    theta: float
    vocab: int

    @classmethod
    def from_hf(cls, c: dict) -> "Shape":
        rope = c.get("rope_parameters") or {}
        heads = int(c["num_attention_heads"])
        return cls(int(c["num_hidden_layers"]), int(c["hidden_size"]), heads, int(c.get("num_key_value_heads") or heads),
                   int(c.get("head_dim") or c["hidden_size"] // heads), float(c.get("rms_norm_eps", 1e-5)),
                   float(rope.get("rope_theta") or c.get("rope_theta") or 10000.0), int(c["vocab_size"]))


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x: [B, H, T, hd]; cos, sin: [B, 1, T, hd]
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin


def rope_tables(pos: Tensor, shape: Shape, dtype: torch.dtype) -> tuple[Tensor, Tensor]:  # pos [B, T] -> [B, 1, T, hd] x2
    inv = 1.0 / shape.theta ** (torch.arange(0, shape.head_dim, 2, device=pos.device, dtype=torch.float32) / shape.head_dim)
    f = pos.float()[..., None] * inv  # [B, T, hd/2]
    emb = torch.cat([f, f], -1)[:, None]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def hidden(shape: Shape, w: dict[str, Tensor], ids: Tensor, pos: Tensor, mask: Tensor | None,
           cache: dict[str, Tensor] | None = None, at: int = 0, taps: dict[int, Tensor] | None = None,
           extra: Tensor | None = None) -> Tensor:
    """The final-normed hidden states [B, T, D] of ``ids`` [B, T] at positions ``pos`` [B, T].

    ``mask`` [B, 1, T, S] (True: attend) over the cache slots ``0 .. at + T``; None means plain
    causal attention over these T tokens alone (training).  With ``cache`` ({"k", "v"}: [L, B,
    Hkv, S_max, hd]) the tokens' keys and values are written at slots ``at .. at + T``.  ``taps``:
    a dict whose keys are layer counts k in 0..L; each is set to the residual stream after the
    first k layers [B, T, D] (what the native target's ``hidden(taps=...)`` gives a draft head).
    ``extra`` [B, T, D]: added to the token embeddings (a fed draft's projected features)."""
    x = w["model.embed_tokens.weight"][ids]
    if extra is not None:
        x = x + extra
    if taps is not None and 0 in taps:
        taps[0] = x
    b, t, _ = x.shape
    cos, sin = rope_tables(pos, shape, x.dtype)
    rep = shape.heads // shape.kv_heads
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], shape.eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(b, t, shape.heads, shape.head_dim).transpose(1, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(b, t, shape.kv_heads, shape.head_dim).transpose(1, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(b, t, shape.kv_heads, shape.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if cache is not None:
            cache["k"][i, :, :, at : at + t] = k
            cache["v"][i, :, :, at : at + t] = v
            k, v = cache["k"][i, :, :, : at + t], cache["v"][i, :, :, : at + t]
        if t == 1 and mask is not None:  # decoding: a KV head's query heads as rows, no copy of the cache
            o = F.scaled_dot_product_attention(q.reshape(b, shape.kv_heads, rep, shape.head_dim), k, v,
                                               attn_mask=mask.expand(b, 1, rep, mask.shape[-1]))
            o = o.reshape(b, shape.heads, 1, shape.head_dim)
        else:
            if rep > 1:
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            if mask is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + o.transpose(1, 2).reshape(b, t, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], shape.eps)
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
        if taps is not None and i + 1 in taps:
            taps[i + 1] = x
    return _rms(x, w["model.norm.weight"], shape.eps)


def head(w: dict[str, Tensor]) -> Tensor:  # [V, D]
    return w.get("lm_head.weight", w["model.embed_tokens.weight"])


def grow(shape: Shape, w: dict[str, Tensor], add: int) -> tuple[Shape, dict[str, Tensor]]:
    """``add`` layers appended, each a copy of the last with its output projections zeroed: the
    model computes exactly what it did (each new layer adds zero to the residual stream)."""
    out = dict(w)
    last = f"model.layers.{shape.layers - 1}."
    for j in range(shape.layers, shape.layers + add):
        for name, t in w.items():
            if name.startswith(last):
                new = f"model.layers.{j}." + name[len(last):]
                zero = name.endswith(("o_proj.weight", "down_proj.weight"))
                out[new] = torch.zeros_like(t) if zero else t.clone()
    return replace(shape, layers=shape.layers + add), out


# ----------------------------------------------------------------------------- loading


def read_gguf_llama(path: str | Path, shape: Shape) -> dict[str, Tensor]:
    """Every weight of a Llama GGUF whose layer matrices are Q4_0 / Q4_1, dequantised to float32
    under Hugging Face names (the embedding may be Q8_0 or F32 / F16; norms F32)."""
    import numpy as np

    from specdec.models.gguf_blocks import _read_header, read_q4_blocks

    w = {name: b.dequantize() for name, b in read_q4_blocks(path, shape.heads, shape.kv_heads).items()}
    header = _read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    rename = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
    for name, dims, kind, offset in header.tensors:
        parts = name.split(".")
        if name in rename:
            hf = rename[name]
        elif len(parts) == 4 and parts[2] in ("attn_norm", "ffn_norm"):
            hf = f"model.layers.{parts[1]}." + ("input_layernorm" if parts[2] == "attn_norm" else "post_attention_layernorm") + ".weight"
        else:
            continue
        n = math.prod(dims)
        start = header.data_start + offset
        if kind == 0:  # F32
            t = torch.from_numpy(np.array(data[start : start + 4 * n]).view(np.float32))
        elif kind == 1:  # F16
            t = torch.from_numpy(np.array(data[start : start + 2 * n]).view(np.float16)).float()
        elif kind == 8:  # Q8_0: per block of 32, a float16 scale and 32 int8 codes
            raw = torch.from_numpy(np.array(data[start : start + n // 32 * 34])).view(-1, 34)
            d = raw[:, :2].contiguous().view(torch.float16).float()  # [nb, 1]
            t = (d * raw[:, 2:].contiguous().view(torch.int8).float()).reshape(-1)
        else:
            raise ValueError(f"{name}: GGUF block type {kind} is not read here")
        w[hf] = t.reshape(list(reversed(dims))) if len(dims) > 1 else t
    missing = [k for k in _names(shape) if k not in w]
    if missing:
        raise ValueError(f"{path}: missing {missing[:3]}")
    return w


def _names(shape: Shape) -> list[str]:
    per = ["input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
           "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    return ["model.embed_tokens.weight", "model.norm.weight"] + [f"model.layers.{i}.{n}.weight"
                                                                 for i in range(shape.layers) for n in per]


def load_folder(folder: Path) -> tuple[Shape, dict[str, Tensor], dict]:
    """A Hugging Face Llama folder (config.json + safetensors) as float32 weights."""
    from safetensors.torch import load_file

    cfg = read_config(folder)
    w: dict[str, Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        w.update({k: v.float() for k, v in load_file(str(f)).items()})
    if cfg.get("tie_word_embeddings", False):  # (transformers' default for a Llama: not tied)
        w.pop("lm_head.weight", None)
    return Shape.from_hf(cfg), w, cfg


# ----------------------------------------------------------------------------- generation


def _sample(logits: Tensor, temps: Tensor, gen: torch.Generator) -> Tensor:  # [B, V], [B] -> [B]
    greedy = logits.argmax(-1)
    safe = torch.where(temps > 0, temps, torch.ones_like(temps))
    probs = torch.softmax(logits.float() / safe[:, None], -1)
    sampled = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return torch.where(temps > 0, sampled, greedy)


@torch.inference_mode()
def generate(shape: Shape, w: dict[str, Tensor], prompts: list[list[int]], temps: list[float], max_new: int,
             eos: tuple[int, ...], gen: torch.Generator) -> list[list[int]]:
    """Each prompt's continuation (up to and including its first end-of-sequence token, at most
    ``max_new`` tokens), all decoded together: prompts left-padded, one KV cache [L, B, Hkv, S, hd]."""
    dev, dtype = w["model.norm.weight"].device, w["model.norm.weight"].dtype
    b, p = len(prompts), max(len(x) for x in prompts)
    pad = torch.tensor([p - len(x) for x in prompts], device=dev)  # [B]
    ids = torch.zeros(b, p, dtype=torch.long, device=dev)
    for r, x in enumerate(prompts):
        ids[r, p - len(x):] = torch.tensor(x, device=dev)
    s_max = p + max_new
    slots = torch.arange(s_max, device=dev)
    valid = slots[None, :] >= pad[:, None]  # [B, S]: left pads are never attended to
    cache = {n: torch.zeros(shape.layers, b, shape.kv_heads, s_max, shape.head_dim, device=dev, dtype=dtype) for n in "kv"}
    pos = (slots[None, :p] - pad[:, None]).clamp_min(0)
    causal = torch.ones(p, p, dtype=torch.bool, device=dev).tril()
    mask = (causal[None] & valid[:, None, :p]) | torch.eye(p, dtype=torch.bool, device=dev)[None]  # pads see themselves
    h = hidden(shape, w, ids, pos, mask[:, None], cache, 0)[:, -1]  # [B, D]
    out = torch.zeros(b, max_new, dtype=torch.long, device=dev)
    done = torch.zeros(b, dtype=torch.bool, device=dev)
    eos_t = torch.tensor(eos, device=dev)
    t = torch.tensor(temps, device=dev, dtype=torch.float32)
    n = 0
    for step in range(max_new):
        tok = _sample(h @ head(w).T, t, gen)
        out[:, step] = torch.where(done, eos_t[0], tok)
        done |= torch.isin(tok, eos_t)
        n = step + 1
        if step + 1 == max_new or (step % 8 == 7 and bool(done.all())):
            break
        s = p + step
        h = hidden(shape, w, tok[:, None], (s - pad)[:, None], valid[:, None, None, : s + 1], cache, s)[:, -1]
    rows = out[:, :n].tolist()
    result = []
    eos_set = set(eos)
    for r in rows:
        cut = next((i + 1 for i, x in enumerate(r) if x in eos_set), len(r))
        result.append(r[:cut])
    return result


# ----------------------------------------------------------------------------- data


@dataclass
class Sequence:
    tokens: list[int]
    prompt_len: int
    kind: str
    temperature: float


def plan(prompts: dict, cfg: OnlineConfig) -> list[tuple[list[int], str, float]]:
    """Every (prompt, kind, temperature), shuffled by ``seed`` so that a time-cut run keeps the
    mixture: each prompt once per temperature, code prompts ``code_repeats`` times at T > 0."""
    rng = random.Random(cfg.seed)
    items = [(x, kind, temp) for kind in ("chat", "code") for x in prompts[kind] for temp in cfg.temperatures
             for _ in range(cfg.code_repeats if kind == "code" and temp > 0 else 1)]
    rng.shuffle(items)
    return items


def generate_all(shape: Shape, w: dict[str, Tensor], prompts: dict, cfg: OnlineConfig, log: Callable[[str], None],
                 partial: Path | None = None, pause: Callable[[], bool] | None = None) -> tuple[list[Sequence], bool]:
    """Answer the planned prompts ``gen_batch`` at a time; returns (sequences, finished).  With
    ``partial`` the sequences so far, the sampler's state and the time spent are saved after every
    batch and a rerun continues from them (the same sequences as an uninterrupted run);
    ``pause()`` true after a batch stops there."""
    todo = plan(prompts, cfg)
    if cfg.sequences:
        todo = todo[: cfg.sequences]
    gen = torch.Generator(device=w["model.norm.weight"].device).manual_seed(cfg.seed)
    eos = tuple(prompts["eos"])
    out: list[Sequence] = []
    spent, tokens = 0.0, 0
    if partial is not None and partial.exists():
        st = state.load(partial)
        out, spent = [Sequence(**x) for x in st["sequences"]], st["seconds"]
        gen.set_state(st["gen"])
        tokens = sum(len(x.tokens) - x.prompt_len for x in out)
        log(f"generate: resuming after {len(out)} sequences")
    t0 = time.perf_counter() - spent
    for a in range(len(out), len(todo), cfg.gen_batch):
        if not cfg.sequences and time.perf_counter() - t0 > cfg.gen_seconds:
            break
        chunk = todo[a : a + cfg.gen_batch]
        for kind in ("chat", "code"):
            part = sorted((x for x in chunk if x[1] == kind), key=lambda x: len(x[0]))
            if not part:
                continue
            max_new = cfg.max_new_chat if kind == "chat" else cfg.max_new_code
            for x, reply in zip(part, _generate_fitting(shape, w, part, max_new, eos, gen, log)):
                out.append(Sequence(list(x[0]) + reply, len(x[0]), kind, x[2]))
                tokens += len(reply)
        dt = time.perf_counter() - t0
        log(f"generate: {len(out)} sequences, {tokens} reply tokens, {dt:.0f} s ({tokens / max(dt, 1e-9):.0f} tok/s)")
        if partial is not None:
            tmp = partial.with_suffix(".tmp")
            torch.save({"sequences": [asdict(x) for x in out], "seconds": dt, "gen": gen.get_state()}, tmp)
            tmp.replace(partial)
        if pause is not None and len(out) < len(todo) and pause():
            log(f"generate: paused after {len(out)} sequences")
            return out, False
    return out, True


def _generate_fitting(shape: Shape, w: dict[str, Tensor], part: list, max_new: int, eos: tuple[int, ...],
                      gen: torch.Generator, log: Callable[[str], None]) -> list[list[int]]:
    """:func:`generate` over ``part`` [(ids, kind, T)], in halves when a batch runs out of GPU memory."""
    try:
        return generate(shape, w, [x[0] for x in part], [x[2] for x in part], max_new, eos, gen)
    except RuntimeError as e:
        if not _oom(e) or len(part) < 2:
            raise
    torch.cuda.empty_cache()
    log(f"generate: out of memory at {len(part)} sequences, in halves")
    h = len(part) // 2
    return (_generate_fitting(shape, w, part[:h], max_new, eos, gen, log)
            + _generate_fitting(shape, w, part[h:], max_new, eos, gen, log))


def batches(data: list[Sequence], index: list[int], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Groups of similar length, about ``batch_tokens`` padded tokens each, in random order."""
    return length_batches([len(x.tokens) for x in data], index, batch_tokens, rng)


def collate(data: list[Sequence], group: list[int], device: torch.device) -> tuple[Tensor, Tensor]:
    """Right-padded ids [B, T] and the reply-position mask [B, T] (position t predicts token t + 1,
    a reply token)."""
    t = max(len(data[i].tokens) for i in group)
    ids = torch.zeros(len(group), t, dtype=torch.long)
    rows = torch.zeros(len(group), t, dtype=torch.bool)
    for r, i in enumerate(group):
        s = data[i]
        ids[r, : len(s.tokens)] = torch.tensor(s.tokens)
        rows[r, max(s.prompt_len - 1, 0) : len(s.tokens) - 1] = True
    return ids.to(device), rows.to(device)


# ----------------------------------------------------------------------------- distillation


@dataclass
class Student:
    """One draft being trained: its shape, float32 weights (trained in place) and optimiser."""

    name: str
    shape: Shape
    w: dict[str, Tensor]
    opt: torch.optim.Optimizer | None = None
    losses: list[float] | None = None
    fed: int = 0  # > 0: a fed draft (:func:`fed_streams`) trained over this many draft steps
    fed_lr: float = 0.0  # a fed draft's learning rate for its projection and null vector


@dataclass
class HeadStudent:
    """A draft head (EAGLE / Medusa / MTP, :mod:`specdec.heads.modules`) trained on the target's
    features from the same passes that label the students."""

    name: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer | None = None
    losses: list[float] | None = None


@dataclass
class Heads:
    """The head students and what they share: the target's taps, embeddings and LM head."""

    students: list[HeadStudent]
    taps: tuple[int, ...]  # layer counts read by the heads (the final hidden state comes after them)
    embed: Tensor  # [V, D] float32, the target's token embeddings
    head: Tensor  # [V, D] float32, the target's LM head with the final norm's weight folded in

    def w_draft(self, h: HeadStudent) -> Tensor:  # [Vd, D] the rows of the head's draft vocabulary
        return self.head[h.model.d2t]


def default_taps(layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high feature taps (layer counts), as ``specdec train data`` stores them."""
    return tuple(sorted({min(2, layers), layers // 2, max(layers - 3, 0)}))


def _target_pass(shape_t: Shape, wt: dict[str, Tensor], ids: Tensor, rows: Tensor,
                 taps: tuple[int, ...] | None = None, law: bool = True) -> tuple[Tensor | None, Tensor | None]:
    """The target's log-law at the reply rows [N, V] (None without ``law``: no draft student needs
    it) and, with ``taps``, the features a head reads [B, T, len(taps) + 1, D] float32: the tapped
    residual streams, then the final hidden state divided by its RMS (the layout of ``specdec
    train data``'s shards)."""
    pos = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
    found = None if taps is None else dict.fromkeys((*taps, shape_t.layers), ids)
    with torch.no_grad():
        ht = hidden(shape_t, wt, ids, pos, None, taps=found)
        logp = torch.log_softmax((ht[rows] @ head(wt).T).float(), -1) if law else None
        if found is None:
            return logp, None
        x = found[shape_t.layers].float()
        final = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + shape_t.eps)
        return logp, torch.stack([found[k].float() for k in taps] + [final], dim=2)


def _head_batch(data: list[Sequence], group: list[int], ids: Tensor, feats: Tensor):
    from specdec.train.heads import Batch

    dev = ids.device
    return Batch(ids, feats, torch.tensor([len(data[i].tokens) for i in group], device=dev),
                 torch.tensor([data[i].prompt_len for i in group], device=dev))


def _draft_law(s: Student, ids: Tensor, rows: Tensor, bf16: bool) -> Tensor:  # -> [N, V] log q
    pos = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        hs = hidden(s.shape, s.w, ids, pos, None)[rows]
        return torch.log_softmax((hs @ head(s.w).T).float(), -1)


def kl(logp: Tensor, logq: Tensor) -> Tensor:  # forward KL(p || q), mean over rows
    return (logp.exp() * (logp - logq)).sum(-1).mean()


# ----------------------------------------------------------------------------- the feature-fed draft
#
# A fed draft is the small draft whose input at position t is its token's embedding plus a
# projection of the target's features at position t - 1 (each tap divided by its RMS, then all
# concatenated) where the target has computed them, and a learned null vector where it has not.
# In decoding the target has computed features for every committed token but the last (the
# bonus or corrected token, which it has not seen yet) and for none of the drafted ones, so draft
# step k's row and the k - 1 rows before it have none.  Training reproduces that on teacher-forced
# text with ``depth`` streams of the same tokens in one pass (:func:`fed_streams`): stream 0 has
# every feature (draft step 1); stream s's row t reads stream 0's rows up to t - s, which have
# theirs, and stream r's row t - s + r for r = 1 .. s, which have none (draft step s + 1).  This
# is EAGLE's training-time test with the draft's own tokens replaced by the target's, which is
# exact for greedy acceptance: step k is only reached when the tokens before it were accepted,
# that is, equal to the target's.


def fed_streams(t: int, depth: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """(mask [depth T, depth T], True: attend; positions [depth T]) of ``depth`` streams of T tokens."""
    i = torch.arange(t, device=device)
    mask = torch.zeros(depth * t, depth * t, dtype=torch.bool, device=device)
    mask[:t, :t] = i[:, None] >= i[None, :]
    for s in range(1, depth):
        mask[s * t : (s + 1) * t, :t] = i[None, :] <= i[:, None] - s
        for r in range(1, s + 1):
            j = i - s + r  # the row of stream r that stream s's row i reads
            ok = j >= 0
            mask[s * t + i[ok], r * t + j[ok]] = True
    return mask, i.repeat(depth)


def fed_extra(w: dict[str, Tensor], feats: Tensor, depth: int) -> Tensor:  # feats [B, T, K, Dt] -> [B, depth T, D]
    """What :func:`hidden` adds to each stream's embeddings: stream 0's row t the projected features
    of row t - 1 (row 0: the null vector), every other stream's rows the null vector."""
    proj = fed_input(feats) @ w[FED_PROJ].T.to(feats.dtype)  # [B, T, D]
    b, t, d = proj.shape
    null = w[FED_NULL].to(proj.dtype)
    first = torch.cat([null.expand(b, 1, d), proj[:, :-1]], 1)
    return torch.cat([first, null.expand(b, (depth - 1) * t, d)], 1)


def fed_weights(w: dict[str, Tensor], target_hidden: int, n_feats: int) -> dict[str, Tensor]:
    """The draft's weights plus a zero projection and null vector: it computes what the draft does."""
    d = w["model.embed_tokens.weight"].shape[1]
    dev = w["model.embed_tokens.weight"].device
    return {**{k: v.clone() for k, v in w.items()}, FED_PROJ: torch.zeros(d, n_feats * target_hidden, device=dev),
            FED_NULL: torch.zeros(d, device=dev)}


def _fed_laws(s: "Student", ids: Tensor, rows: Tensor, feats: Tensor, bf16: bool) -> list[Tensor]:
    """Per draft step k = 1 .. depth: log q [N, V] at the reply rows, teacher-forced."""
    b, t = ids.shape
    mask, pos = fed_streams(t, s.fed, ids.device)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
        hs = hidden(s.shape, s.w, ids.repeat(1, s.fed), pos[None].expand(b, -1), mask[None, None],
                    extra=fed_extra(s.w, feats, s.fed)).view(b, s.fed, t, -1)
        return [torch.log_softmax((hs[:, k][rows] @ head(s.w).T).float(), -1) for k in range(s.fed)]


def _reached(rows: Tensor, k: int) -> Tensor:  # [N] bool: reply rows at index >= k (a round can start k rows back)
    return torch.nonzero(rows)[:, 1] >= k


@torch.no_grad()
def held_out(shape_t: Shape, wt: dict[str, Tensor], students: list[Student], data: list[Sequence], index: list[int],
             batch_tokens: int, bf16: bool) -> dict[str, dict[str, dict[str, float]]]:
    """Per student, per kind (and ``all``): arg-max agreement (T = 0 acceptance) and mean
    ``sum min(p, q)`` (T = 1 acceptance), teacher-forced at every reply position held out.  A fed
    draft is scored per draft step k, as ``<name>-step<k>`` (step k > 1: the rows a round can reach)."""
    sums: dict[str, dict[str, list[float]]] = {}
    dev = wt["model.norm.weight"].device
    taps = default_taps(shape_t.layers) if any(s.fed for s in students) else None
    for kind in sorted({data[i].kind for i in index}):
        for group in batches(data, [i for i in index if data[i].kind == kind], batch_tokens, random.Random(0)):
            ids, rows = collate(data, group, dev)
            logp, feats = _target_pass(shape_t, wt, ids, rows, taps)
            for s in students:
                laws = [(s.name, _draft_law(s, ids, rows, bf16), None)] if not s.fed else \
                    [(f"{s.name}-step{k + 1}", q, _reached(rows, k)) for k, q in enumerate(_fed_laws(s, ids, rows, feats, bf16))]
                for name, logq, keep in laws:
                    p, q = (logp, logq) if keep is None else (logp[keep], logq[keep])
                    agree = float((p.argmax(-1) == q.argmax(-1)).float().sum())
                    accept = float(torch.minimum(p.exp(), q.exp()).sum())
                    for key in (kind, "all"):
                        acc = sums.setdefault(name, {}).setdefault(key, [0.0, 0.0, 0.0])
                        acc[0] += agree
                        acc[1] += accept
                        acc[2] += p.shape[0]
    return {name: {k: {"greedy": round(a / n, 4), "t1": round(c / n, 4), "positions": int(n)}
                   for k, (a, c, n) in per.items()} for name, per in sums.items()}


@torch.no_grad()
def held_out_heads(shape_t: Shape, wt: dict[str, Tensor], heads: Heads, data: list[Sequence], index: list[int],
                   batch_tokens: int) -> dict[str, dict]:
    """Per head: teacher-forced E[min(p, q)] and top-1 agreement per draft step against the target's
    whole law, over all held-out sequences and per prompt kind (``specdec train eagle``'s report)."""
    from specdec.train.heads import rate_table, score

    sums: dict[str, dict[str, dict[int, list[float]]]] = {h.name: {} for h in heads.students}
    dev = wt["model.norm.weight"].device
    for kind in sorted({data[i].kind for i in index}):
        for group in batches(data, [i for i in index if data[i].kind == kind], batch_tokens, random.Random(0)):
            ids, rows = collate(data, group, dev)
            batch = _head_batch(data, group, ids, _target_pass(shape_t, wt, ids, rows, heads.taps, law=False)[1])
            for h in heads.students:
                score(h.model, batch, heads.embed, heads.head, h.model.d2t, sums[h.name].setdefault(kind, {}))
    return {name: rate_table(per) for name, per in sums.items()}


def _oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)


def train(shape_t: Shape, wt: dict[str, Tensor], students: list[Student], data: list[Sequence], index: list[int],
          cfg: OnlineConfig, ckpt: Path | None, log: Callable[[str], None], bf16: bool,
          pause: Callable[[int], bool] | None = None, heads: Heads | None = None) -> dict:
    """Train every student (weights modified in place) and every head on the same batches, the
    target scoring each batch once; returns {"finished", "steps", "seconds", "tokens",
    "batch_tokens"} (losses in ``Student.losses`` / ``HeadStudent.losses``).  Resumes from
    ``ckpt`` when it exists; ``pause(step)`` true after a step checkpoints and stops there (a rerun continues bitwise).  A step that runs out of GPU memory
    halves the batch."""
    dev = wt["model.norm.weight"].device
    for s in students:
        fed = [k for k in s.w if k.startswith("fed.")]
        groups = [{"params": [t.requires_grad_(True) for k, t in s.w.items() if k not in fed], "base_lr": cfg.lr}]
        if fed:
            groups.append({"params": [s.w[k].requires_grad_(True) for k in fed], "base_lr": s.fed_lr})
        s.opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        s.losses = []
    taps = heads.taps if heads is not None else default_taps(shape_t.layers) if any(s.fed for s in students) else None
    from specdec.train.heads import TrainConfig, loss_fn

    hs = heads.students if heads is not None else []
    head_cfgs = {h.name: TrainConfig(kind=h.model.cfg.kind, depth=cfg.head_depth) for h in hs}  # the loss's weights
    for h in hs:
        h.opt = torch.optim.AdamW([p for p in h.model.parameters() if p.requires_grad], lr=cfg.head_lr,
                                  weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
        h.losses = []
    step, total, epoch, tokens, batch_tokens = 0, cfg.steps, 0, 0, cfg.batch_tokens
    if ckpt is not None and ckpt.exists():
        st = state.load(ckpt, map_location=dev)
        for s in students:
            with torch.no_grad():
                for k, t in s.w.items():
                    t.copy_(st["students"][s.name]["weights"][k])
            s.opt.load_state_dict(st["students"][s.name]["optim"])
            s.losses = st["students"][s.name]["losses"]
        for h in hs:
            h.model.load_state_dict(st["heads"][h.name]["model"])
            h.opt.load_state_dict(st["heads"][h.name]["optim"])
            h.losses = st["heads"][h.name]["losses"]
        step, total, epoch, tokens, batch_tokens = st["step"], st["total"], st["epoch"], st["tokens"], st["batch_tokens"]
        earlier_s = st.get("seconds", 0.0)
        if cfg.steps and cfg.steps != total:  # --steps names the run's length: a larger one continues it
            log(f"train: {cfg.steps} steps asked for, the checkpoint planned {total}: going to {max(cfg.steps, step)}")
            total = max(cfg.steps, step)
        order: list[list[int]] = st["order"]
        log(f"resumed at step {step} of {total}")
    else:
        order = []
        earlier_s = 0.0
    t0 = time.perf_counter()
    warm_t = 0.0
    first = step  # a resumed time-bounded run measures its speed from its own steps
    while total == 0 or step < total:
        if not order:
            order = batches(data, index, batch_tokens, random.Random(cfg.seed * 7919 + epoch))
            epoch += 1
        group = order.pop()
        try:
            ids, rows = collate(data, group, dev)
            logp, feats = _target_pass(shape_t, wt, ids, rows, taps, law=bool(students))
            lr_factor = warmup_cosine(step, total or 10**9, cfg.warmup)
            stepped = []  # (optimiser, losses, loss): stepped once every student and head has its gradients,
            # so that running out of memory part-way leaves none of them a step ahead of the others
            for s in students:
                for g in s.opt.param_groups:
                    g["lr"] = g.get("base_lr", cfg.lr) * lr_factor
                if s.fed:  # every draft step weighs the same
                    laws = _fed_laws(s, ids, rows, feats, bf16)
                    loss = sum(kl(logp[keep], q[keep]) for q, keep in ((q, _reached(rows, k)) for k, q in enumerate(laws))) / s.fed
                else:
                    loss = kl(logp, _draft_law(s, ids, rows, bf16))
                s.opt.zero_grad(set_to_none=True)
                loss.backward()
                for g in s.opt.param_groups:  # a fed draft's projection apart: its draft weights move as a plain draft's
                    torch.nn.utils.clip_grad_norm_(g["params"], 1.0)
                stepped.append((s.opt, s.losses, loss.detach()))
            if hs:
                batch = _head_batch(data, group, ids, feats)
            for h in hs:
                for g in h.opt.param_groups:
                    g["lr"] = cfg.head_lr * lr_factor
                loss, _ = loss_fn(h.model, batch, heads.embed, heads.w_draft(h), head_cfgs[h.name])
                h.opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_([p for p in h.model.parameters() if p.requires_grad], 1.0)
                stepped.append((h.opt, h.losses, loss.detach()))
            for opt, losses, value in stepped:
                opt.step()
                losses.append(round(float(value), 5))
        except RuntimeError as e:  # torch.cuda.OutOfMemoryError is one
            if not _oom(e) or batch_tokens < 1024:
                raise
            del e
            for s in [*students, *hs]:
                s.opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            batch_tokens //= 2
            order = []
            log(f"train: out of memory, batch halved to {batch_tokens} tokens")
            continue
        step += 1
        tokens += int(rows.sum())
        if total == 0 and step == first + 10:
            warm_t = time.perf_counter()
        if total == 0 and step == first + 30:  # the step count that fits the budget, from 20 steps' speed
            per = (time.perf_counter() - warm_t) / 20
            left = cfg.train_seconds - earlier_s - (time.perf_counter() - t0)  # the earlier parts' time counts too
            total = max(step + 1, int(left / per) + step)
            log(f"train: {per * 1000:.0f} ms a step -> {total} steps")
        if step % 100 == 0 or step == total:
            losses = " ".join(f"{s.name} {sum(s.losses[-100:]) / len(s.losses[-100:]):.4f}" for s in [*students, *hs])
            log(f"train: step {step}/{total or '?'} loss {losses} ({time.perf_counter() - t0:.0f} s, {tokens} positions)")
        paused = pause is not None and step != total and pause(step)
        if ckpt is not None and (step % cfg.ckpt_every == 0 or step == total or paused):
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"students": {s.name: {"weights": {k: t.detach() for k, t in s.w.items()},
                                              "optim": s.opt.state_dict(), "losses": s.losses} for s in students},
                        "heads": {h.name: {"model": h.model.state_dict(), "optim": h.opt.state_dict(), "losses": h.losses}
                                  for h in hs},
                        "step": step, "total": total, "epoch": epoch, "tokens": tokens, "batch_tokens": batch_tokens,
                        "order": order, "seconds": earlier_s + time.perf_counter() - t0}, tmp)
            tmp.replace(ckpt)
        if paused:
            log(f"train: paused at step {step} of {total}")
            break
    for s in students:
        for t in s.w.values():
            t.requires_grad_(False)
        s.opt = None
    for h in hs:
        h.opt = None
    # seconds: training time across resumed runs (the card's wall time)
    return {"finished": step == total, "steps": step, "seconds": round(earlier_s + time.perf_counter() - t0, 1),
            "tokens": tokens, "batch_tokens": batch_tokens}


# ----------------------------------------------------------------------------- bundle and run


def tokenised_prompts(tokenizer, n_chat: int, n_code: int, eos: frozenset[int], seed: int = 0) -> dict:
    """The built-in training prompts (none of the benchmark's), tokenised: {"chat", "code": [[ids]], "eos"}."""
    from specdec.text import encode_prompt
    from specdec.train.prompts import chat_prompts, code_prompts

    return {"chat": [encode_prompt(tokenizer, x, chat=True) for x in chat_prompts(n_chat, seed=seed)],
            "code": [encode_prompt(tokenizer, x, chat=False) for x in code_prompts(n_code, seed=seed)],
            "eos": sorted(eos)}


def write_bundle(out: Path, *, gguf: Path, target_config: dict, draft: Path, prompts: dict) -> None:
    """What :func:`run` needs on a machine with torch alone: the target's GGUF (by path), its
    config, the draft folder's config + weights, and the tokenised prompts (+ end-of-sequence ids)."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    (out / "target_config.json").write_text(json.dumps(target_config))
    (out / "draft").mkdir(exist_ok=True)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(draft / f, out / "draft" / f)
    torch.save(prompts, out / "prompts.pt")
    (out / "target.sha256").write_text(sha256(gguf) + "\n")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def run(gguf: Path, target_config: dict, draft: Path, prompts: dict, cfg: OnlineConfig, out: Path,
        device: torch.device, log: Callable[[str], None] = print, command: str = "",
        pause: Callable[[int], bool] | None = None) -> dict:
    """Generate (or load ``out/data.pt``), distil every student (resuming ``out/ckpt.pt``), save each
    as a model folder ``out/<name>/`` (config.json + float16 model.safetensors; ``draft`` when there
    is one student, else ``draft-<layers>l``) and ``out/report.json``; returns the report.  When
    ``pause`` stops training early the report says ``"finished": false`` and no model is written."""
    from safetensors.torch import save_file

    t_start = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    bf16 = device.type == "cuda" if cfg.bf16 is None else cfg.bf16
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    shape_t = Shape.from_hf(target_config)
    wt = {k: v.to(device=device, dtype=torch.bfloat16 if bf16 else torch.float32)
          for k, v in read_gguf_llama(gguf, shape_t).items()}
    shape_s, ws, draft_cfg = load_folder(draft)
    ws = {k: v.to(device) for k, v in ws.items()}
    log(f"loaded target ({shape_t.layers} layers) and draft ({shape_s.layers} layers) in {time.perf_counter() - t_start:.0f} s")

    # a folder holds one run: its data, checkpoint and models are of these settings (a larger
    # --steps, or another time budget, continues it; anything else is refused, not mixed in)
    run_key = {**{k: v for k, v in asdict(cfg).items() if k not in RESUMABLE}, "target_sha256": sha256(gguf),
               "draft_sha256": sha256(draft / "model.safetensors")}
    saved_key = state.load_json(out / "run.json")
    if saved_key is not None:
        state.check_resume(out / "run.json", saved_key, run_key, restart=f"give another --out (or empty {out})")
    else:
        state.write_text(out / "run.json", json.dumps(run_key, indent=1) + "\n")
    data_path = out / "data.pt"
    t_gen = time.perf_counter()
    if data_path.exists():
        data = [Sequence(**x) for x in state.load(data_path)]
        gen_seconds = None
        log(f"loaded {len(data)} sequences from {data_path}")
    else:
        data, finished = generate_all(shape_t, wt, prompts, cfg, log, out / "data.partial.pt",
                                      (lambda: pause(0)) if pause is not None else None)
        if not finished:
            report = {"finished": False, "command": command, "config": asdict(cfg), "generated": len(data)}
            (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
            return report
        tmp = data_path.with_suffix(".tmp")
        torch.save([asdict(x) for x in data], tmp)
        tmp.replace(data_path)
        (out / "data.partial.pt").unlink(missing_ok=True)
        gen_seconds = round(time.perf_counter() - t_gen, 1)
    train_idx, held_idx = split(len(data), cfg.held_out_every)
    if not train_idx or not held_idx:
        raise ValueError(f"{len(data)} sequences: distillation needs at least {cfg.held_out_every}")
    before = held_out(shape_t, wt, [Student("source", shape_s, ws)], data, held_idx, cfg.batch_tokens, bf16)["source"]
    log(f"held-out, the source draft: {before}")
    students = []
    for add in cfg.add_layers:
        sh, w = grow(shape_s, ws, add) if add else (shape_s, ws)
        name = "draft" if len(cfg.add_layers) == 1 else f"draft-{sh.layers}l"
        students.append(Student(name, sh, {k: v.clone() for k, v in w.items()}))
    taps = default_taps(shape_t.layers)  # what a fed draft reads (as the heads do)
    n_feats = len(taps) + 1
    for lr in cfg.fed_lr if cfg.fed else ():
        name = "fed" if len(cfg.fed_lr) == 1 else f"fed-{lr:g}"
        students.append(Student(name, shape_s, fed_weights(ws, shape_t.hidden, n_feats), fed=cfg.fed, fed_lr=lr))
    heads = _make_heads(shape_t, wt, data, train_idx, prompts, cfg, out) if cfg.heads else None
    stats = train(shape_t, wt, students, data, train_idx, cfg, out / "ckpt.pt", log, bf16, pause, heads)
    if not stats["finished"]:
        report = {"finished": False, "command": command, "config": asdict(cfg), "train": stats}
        (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        return report
    after = held_out(shape_t, wt, students, data, held_idx, cfg.batch_tokens, bf16)
    steps = {s.name: [after[f"{s.name}-step{k + 1}"] for k in range(s.fed)] for s in students if s.fed}
    for s in students:
        if s.fed:  # its step-1 score is the one to set beside a plain draft's
            after[s.name] = steps[s.name][0]
        log(f"held-out, {s.name}: {after[s.name]}" + (f"; steps 2..: {steps[s.name][1:]}" if s.fed else ""))
        (out / s.name).mkdir(exist_ok=True)
        save_file({k: v.detach().to("cpu", torch.float16).contiguous() for k, v in s.w.items()},
                  str(out / s.name / "model.safetensors"), metadata={"format": "pt"})
        fed = {FED_CONFIG_KEY: {"taps": list(taps), "target_hidden": shape_t.hidden,
                               "steps": s.fed}} if s.fed else {}
        (out / s.name / "config.json").write_text(json.dumps(dict(draft_cfg, num_hidden_layers=s.shape.layers, **fed),
                                                             indent=1) + "\n")
    head_reports = {}
    if heads is not None:
        from specdec.heads.modules import save_head
        from specdec.train.heads import expected_tokens_per_call

        scored = held_out_heads(shape_t, wt, heads, data, held_idx, cfg.batch_tokens)
        for h in heads.students:
            ho = scored[h.name]
            ho["chain_tokens_per_call_t0_estimate"] = expected_tokens_per_call([x["top1"] for x in ho["steps"]])
            ho["chain_tokens_per_call_t1_estimate"] = expected_tokens_per_call([x["accept_t1"] for x in ho["steps"]])
            log(f"held-out, {h.name}: top-1 per step {[round(x['top1'], 3) for x in ho['steps']]}")
            save_head(h.model.cpu(), out / h.name)
            head_reports[h.name] = {"kind": h.model.cfg.kind, "taps": list(heads.taps),
                                    "draft_vocab": int(h.model.d2t.numel()),
                                    "params": sum(p.numel() for p in h.model.parameters()),
                                    "params_trained": sum(p.numel() for p in h.model.parameters() if p.requires_grad),
                                    "held_out": ho, "loss_first": h.losses[:10], "loss_last": h.losses[-10:]}
    reply = [len(x.tokens) - x.prompt_len for x in data]
    report = {
        "finished": True,
        "command": command,
        "config": asdict(cfg),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "target_sha256": prompts.get("target_sha256"),
        "sequences": len(data), "train_sequences": len(train_idx), "held_out_sequences": len(held_idx),
        "reply_tokens": sum(reply), "train_reply_tokens": sum(reply[i] for i in train_idx),
        "by_kind": {k: sum(1 for x in data if x.kind == k) for k in ("chat", "code")},
        "generate_seconds": gen_seconds, "train": stats,
        "held_out_before": before,
        "students": {s.name: {"layers": s.shape.layers, "added_layers": s.shape.layers - shape_s.layers,
                              "held_out_after": after[s.name], "loss_first": s.losses[:10], "loss_last": s.losses[-10:],
                              **({"fed_steps": s.fed, "fed_lr": s.fed_lr, "taps": list(taps),
                                  "held_out_per_step": steps[s.name]} if s.fed else {})}
                     for s in students},
        "heads": head_reports,
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    losses = {s.name: s.losses for s in [*students, *(heads.students if heads is not None else [])]}
    (out / "losses.json").write_text(json.dumps(losses) + "\n")
    return report


def _make_heads(shape_t: Shape, wt: dict[str, Tensor], data: list[Sequence], train_idx: list[int], prompts: dict,
                cfg: OnlineConfig, out: Path) -> Heads:
    """One fresh head per ``cfg.heads`` entry, over the ``head_vocab`` most frequent reply tokens of
    the training sequences (their counts are saved as ``out/token_counts.pt``)."""
    from specdec.heads.modules import HeadConfig, build, frozen_head_rows
    from specdec.train.heads import reply_counts, top_tokens

    counts = reply_counts(((torch.tensor(data[i].tokens), data[i].prompt_len) for i in train_idx), shape_t.vocab)
    state.save(counts, out / "token_counts.pt")
    d2t = top_tokens(counts, cfg.head_vocab, tuple(prompts["eos"]))
    init: dict[str, dict[str, Tensor]] = {}
    if cfg.init_heads:  # a continued head keeps its draft vocabulary, whatever the new data's counts
        from safetensors.torch import load_file

        for kind in cfg.heads:
            weights = init[kind] = load_file(str(Path(cfg.init_heads) / kind / "model.safetensors"))
            if weights["d2t"].numel() != cfg.head_vocab:
                raise ValueError(f"{cfg.init_heads}/{kind}: its draft vocabulary has {weights['d2t'].numel()} tokens,"
                                 f" not --head-vocab {cfg.head_vocab}")
    dev = wt["model.norm.weight"].device
    taps = default_taps(shape_t.layers)
    full = (head(wt).float() * wt["model.norm.weight"].float())  # [V, D]
    students = []
    for kind in cfg.heads:
        hc = HeadConfig(kind=kind, hidden_size=shape_t.hidden, n_heads=shape_t.heads, n_kv_heads=shape_t.kv_heads,
                        head_dim=shape_t.head_dim, intermediate_size=wt["model.layers.0.mlp.gate_proj.weight"].shape[0],
                        target_vocab=shape_t.vocab, draft_vocab=int(d2t.numel()), rms_eps=shape_t.eps,
                        rope_theta=shape_t.theta, inputs=tuple(range(len(taps))) if kind == "eagle3" else (len(taps),),
                        taps=taps, depth=cfg.head_depth, target=prompts.get("target_name", ""))
        torch.manual_seed(cfg.seed)
        model = build(hc).to(dev)
        if kind in init:  # its weights and draft vocabulary
            model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in init[kind].items()})
        else:
            with torch.no_grad():
                model.d2t.copy_(d2t)
                model.lm_head.weight.copy_(full[d2t.to(dev)])
        model.lm_head.weight.requires_grad_(not frozen_head_rows(kind))
        students.append(HeadStudent(kind, model))
    return Heads(students, taps, wt["model.embed_tokens.weight"].float(), full)


def main(argv: list[str] | None = None) -> int:
    """Run from a bundle (``write_bundle``) on a machine with torch alone: ``python -m
    specdec.train.online --bundle DIR --gguf FILE --out DIR [config flags]``."""
    ap = argparse.ArgumentParser(
        prog="python -m specdec.train.online",
        description="`specdec train online` on a machine with torch alone (a GPU machine, say), from a bundle that "
        "command wrote with --bundle. The other options mean what they mean there (see `specdec train online --help`).")
    ap.add_argument("--bundle", required=True, help="the folder `specdec train online --bundle` wrote")
    ap.add_argument("--gguf", required=True, help="the target's GGUF file (checked against the bundle's sha256)")
    ap.add_argument("--out", required=True, help="output folder: a rerun with the same folder resumes")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    special = ("temperatures", "add_layers", "bf16", "heads", "fed_lr")
    for f in OnlineConfig.__dataclass_fields__.values():
        if f.name not in special:
            ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    ap.add_argument("--temperatures", default="0,1,0.7")
    ap.add_argument("--add-layers", default="0", help="comma list: one student per entry (none: train heads only)")
    ap.add_argument("--heads", default="", help="comma list of head kinds trained beside the students (eagle3, ...)")
    ap.add_argument("--fed-lr", default="0.001", help="comma list: one fed draft per value (with --fed N)")
    a = ap.parse_args(argv)
    cfg = OnlineConfig(**{k: getattr(a, k) for k in OnlineConfig.__dataclass_fields__ if k not in special},
                       temperatures=tuple(float(x) for x in a.temperatures.split(",")),
                       add_layers=() if a.add_layers == "none" else tuple(int(x) for x in a.add_layers.split(",")),
                       heads=tuple(x for x in a.heads.split(",") if x),
                       fed_lr=tuple(float(x) for x in a.fed_lr.split(",")))
    bundle = Path(a.bundle)
    want = (bundle / "target.sha256").read_text().strip()
    got = sha256(Path(a.gguf))
    if got != want:
        raise SystemExit(f"{a.gguf}: sha256 {got} is not the bundle's {want}")
    prompts = torch.load(bundle / "prompts.pt", weights_only=False)
    prompts["target_sha256"] = got

    def log(msg: str) -> None:
        print(msg, flush=True)

    import shlex
    import sys

    out = Path(a.out)
    report = run(Path(a.gguf), json.loads((bundle / "target_config.json").read_text()), bundle / "draft", prompts, cfg,
                 out, torch.device(a.device), log, command="python -m specdec.train.online " + shlex.join(sys.argv[1:]))
    for name in report.get("heads", {}):
        (out / name / "README.md").write_text(head_card(report, name))
    return 0


def head_card(report: dict, name: str) -> str:
    """The Markdown card of the head ``name`` written by :func:`run`."""
    c, tr, h = report["config"], report["train"], report["heads"][name]
    ho = h["held_out"]
    init = c.get("init_heads")
    start = f"Continued from the head in `{init}/{name}` (its weights and draft vocabulary)" if init else "Trained from scratch"
    vocab = "kept from that head" if init else "the most frequent reply tokens of the training data"
    lines = [
        f"# {h['kind']} draft head, trained online against the target",
        "",
        f"{start} on the target's features (taps after layers {', '.join(map(str, h['taps']))} and the "
        "final hidden state) and its next-token law over the head's draft vocabulary, at every reply position of "
        "sequences the target generated, the target scoring each batch as training went.",
        "",
        f"* Parameters: {h['params'] / 1e6:.2f} M ({h['params_trained'] / 1e6:.2f} M trained), a {h['draft_vocab']}-token "
        f"draft vocabulary ({vocab}), plus the target's embeddings at run time.",
        f"* Data: {report['sequences']} target sequences ({report['by_kind']['chat']} chat, {report['by_kind']['code']} "
        f"code; temperatures {', '.join(str(t) for t in c['temperatures'])}), {report['reply_tokens']} reply tokens; "
        f"{report['held_out_sequences']} sequences held out (every {c['held_out_every']}th).",
        f"* Training: {tr['steps']} steps of ~{tr['batch_tokens']} padded tokens, lr {c['head_lr']}, depth "
        f"{c['head_depth']}, AdamW + cosine, {tr['seconds']:.0f} s on {report['device']}"
        + (" (shared with the other students trained on the same batches)." if report.get("students") or
           len(report["heads"]) > 1 else "."),
        f"* Target file sha256: `{report.get('target_sha256')}`.",
        f"* Command: `{report.get('command') or '(not recorded)'}`",
        "",
        "Held-out, teacher-forced, per draft step (E[min(p, q)]: token verification's acceptance at T = 1; top-1: "
        "agreement with the target's arg-max, T = 0):",
        "",
        "| prompts | step | E[min(p, q)] | top-1 | target mass in the draft vocabulary | positions |",
        "|---|---|---|---|---|---|",
    ]
    for kind, steps in [("all", ho["steps"]), *sorted(ho["by_kind"].items())]:
        lines += [f"| {kind} | {st['step']} | {st['accept_t1']:.3f} | {st['top1']:.3f} | {st['vocab_mass']:.3f} | "
                  f"{st['positions']} |" for st in steps]
    lines += ["", f"Chain estimate from these rates (independent steps): {ho['chain_tokens_per_call_t0_estimate']:.2f} "
              f"tokens per target call at T = 0, {ho['chain_tokens_per_call_t1_estimate']:.2f} at T = 1.", ""]
    return "\n".join(lines)


def model_card(report: dict, name: str, target: str, source: str) -> str:
    """The Markdown card of the student ``name`` written by :func:`run`."""
    c, tr, st = report["config"], report["train"], report["students"][name]

    def rows(label: str, acc: dict) -> list[str]:
        return [f"| {label} | {k} | {v['greedy']:.3f} | {v['t1']:.3f} | {v['positions']} |" for k, v in sorted(acc.items())]

    gen = f"{report['generate_seconds']:.0f} s" if report.get("generate_seconds") else "an earlier run"
    others = [n for n in report["students"] if n != name]
    return "\n".join([
        f"# Draft for {target}, distilled online",
        "",
        f"Started from `{source}`"
        + (f", deepened to {st['layers']} layers ({st['added_layers']} appended, identity-initialised)"
           if st["added_layers"] else "")
        + "; trained on the target's whole next-token law (forward KL) at every reply position of sequences the "
        "target generated, the target scoring each batch as training went"
        + (f" (trained side by side with {', '.join(others)} on the same batches)" if others else "") + ".",
        "",
        f"* Data: {report['sequences']} target sequences ({report['by_kind']['chat']} chat, {report['by_kind']['code']} "
        f"code; temperatures {', '.join(str(t) for t in c['temperatures'])}), {report['reply_tokens']} reply tokens, "
        f"generated in {gen}; {report['held_out_sequences']} sequences held out (every {c['held_out_every']}th).",
        f"* Training: {tr['steps']} steps of ~{tr['batch_tokens']} padded tokens ({tr['tokens']} reply positions), lr "
        f"{c['lr']}, AdamW + cosine, {tr['seconds']:.0f} s on {report['device']}; the whole run {report['total_seconds']:.0f} s.",
        f"* Target file sha256: `{report.get('target_sha256')}`.",
        f"* Command: `{report.get('command') or '(not recorded)'}`",
        "",
        "Held-out, teacher-forced (greedy: arg-max agreement, the T = 0 acceptance of one token; t1: sum min(p, q), "
        "its T = 1 acceptance):",
        "",
        "| draft | kind | greedy | t1 | positions |",
        "|---|---|---|---|---|",
        *rows(f"before (`{source}`)", report["held_out_before"]),
        *rows("after" if "held_out_per_step" not in st else "after, draft step 1", st["held_out_after"]),
        *[line for k, acc in enumerate(st.get("held_out_per_step", [])[1:], 2) for line in rows(f"after, draft step {k}", acc)],
        "",
        *([f"This is a fed draft: its input at each position adds a projection of the target's features at the "
           f"position before (taps {', '.join(map(str, st.get('taps', [])))} and the final state), where the target has "
           "computed them; draft step k has none for its own row and the k - 1 before it.", ""]
          if "held_out_per_step" in st else []),
    ])


def finish_folder(folder: Path, source: Path, card: str) -> None:
    """Make a student's folder a model folder ``--draft`` loads: the source draft's tokenizer, chat
    template and reduced draft vocabulary (the target's frequent reply tokens, the same for the
    student) beside the weights, and the model card.  A temperature calibration is the source's
    own and is not copied."""
    import shutil

    keep = ("chat_template.jinja", "generation_config.json", "draft_vocab.json")
    for f in source.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in keep):
            shutil.copy(f, folder / f.name)
    (folder / "README.md").write_text(card)


if __name__ == "__main__":
    raise SystemExit(main())
