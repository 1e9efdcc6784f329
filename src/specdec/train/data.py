"""``specdec train data``: sequences sampled from the target, with the features drafters learn from.

(Or sampled from the draft model itself, tokens only: on-policy data for ``specdec train distill``.)

Generation is batched the way the server batches users (continuous batching over
:meth:`NativeCausalLM.forward_batch`): up to ``batch`` sequences decode together, one row each
per pass, and a finished sequence's slot is refilled with the next prompt at once.  On a 2-core
CPU a pass over 32-64 rows costs little more than over one (the weights stream once), so this is
far faster than generating one reply at a time.

Each finished sequence is then scored once more, teacher-forced, to record the target's features
at every position: the residual stream after the layers in ``taps`` and the final hidden state
(the LM head's input), stored as float16.  Shards of ``shard_size`` sequences are written as
they fill (``shard-00000.pt`` …); a restarted run skips the sequences already on disk, so the
job resumes where it stopped.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from specdec.errors import ConfigError
from specdec.models.registry import read_config
from specdec.text import encode_prompt


@dataclass(frozen=True)
class DataConfig:
    target: str = "smollm2-135m"
    sequences: int = 2000
    chat_share: float = 0.7  # the rest are code completions
    temperatures: tuple[float, ...] = (0.0, 1.0)  # cycled over sequences
    max_new_chat: int = 192
    max_new_code: int = 128
    batch: int = 32
    shard_size: int = 100
    #: residual-stream taps (layer counts; 0 = embeddings): EAGLE-3's low / middle / high layers
    taps: tuple[int, ...] = (2, 15, 27)
    seed: int = 0
    #: store the features (False: tokens only, enough for distilling a small draft model; a
    #: position's features take ~4.6 kB for SmolLM2, its token 4 bytes)
    features: bool = True
    #: JSONL prompts (``prompt``, ``chat``, optional ``category``) used instead of the built-in
    #: templates: the head learns the prompt distribution it is trained on, so train on prompts
    #: like the ones it will serve
    prompt_file: str | None = None
    #: who sampled the replies: "target", or the draft model (its registry name or folder) whose
    #: own samples the target then labels -- DistillSpec's on-policy data (tokens only)
    sampler: str = "target"


@dataclass
class _Slot:
    index: int
    ids: list[int]
    prompt_len: int
    temperature: float
    kind: str
    max_new: int
    cache: Any = None
    generated: int = 0


@dataclass
class Shard:
    """What one shard file holds (lists are per sequence)."""

    tokens: list[Tensor] = field(default_factory=list)  # [n_i] int32
    prompt_len: list[int] = field(default_factory=list)
    temperature: list[float] = field(default_factory=list)
    kind: list[str] = field(default_factory=list)
    feats: list[Tensor] = field(default_factory=list)  # [n_i, len(taps) + 1, D] float16 (empty: tokens only)

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(asdict(self), tmp)
        tmp.replace(path)  # atomic: a killed run never leaves a half-written shard


def load_shards(folder: Path) -> Shard:
    out = Shard()
    for path in sorted(folder.glob("shard-*.pt")):
        try:
            part = torch.load(path, weights_only=True)
            for key in ("tokens", "prompt_len", "temperature", "kind", "feats"):
                getattr(out, key).extend(part[key])
        except Exception as exc:  # noqa: BLE001 - a damaged or foreign file fails inside torch's unpickler, in many ways
            raise ConfigError(f"{path} is not a shard written by `specdec train data` ({type(exc).__name__}); "
                              "delete it, or make the data again") from None
    return out


def plan(cfg: DataConfig, tokenizer: Any) -> list[tuple[list[int], str, float, int]]:
    """Every sequence's (prompt ids, kind, temperature, max new tokens), deterministic in ``seed``."""
    from specdec.train.prompts import chat_prompts, code_prompts

    if cfg.prompt_file is not None:  # the user's prompts, each used once (cycled when more sequences are asked)
        from specdec.bench.workloads import load_jsonl

        rows = load_jsonl(cfg.prompt_file)
        random.Random(cfg.seed).shuffle(rows)
        items = []
        for i in range(cfg.sequences):
            row = rows[i % len(rows)]
            kind = row.category if row.category != "custom" else ("chat" if row.chat else "code")
            items.append((encode_prompt(tokenizer, row.text, chat=row.chat), kind,
                          cfg.max_new_chat if row.chat else cfg.max_new_code))
    else:
        n_chat = round(cfg.sequences * cfg.chat_share)
        chats = chat_prompts(n_chat, seed=cfg.seed)
        codes = code_prompts(cfg.sequences - len(chats), seed=cfg.seed)
        items = [(encode_prompt(tokenizer, c, chat=True), "chat", cfg.max_new_chat) for c in chats]
        items += [(encode_prompt(tokenizer, c, chat=False), "code", cfg.max_new_code) for c in codes]
        random.Random(cfg.seed + 1).shuffle(items)
    temps = cfg.temperatures
    return [(ids, kind, temps[i % len(temps)], max_new) for i, (ids, kind, max_new) in enumerate(items)]


@torch.inference_mode()
def features(model: Any, ids: Tensor, taps: tuple[int, ...]) -> Tensor:  # ids: [n] -> [n, len(taps)+1, D] fp16
    """The target's tapped residual streams and final hidden state at every position of ``ids``."""
    found: dict[int, Tensor] = {k: torch.empty(0) for k in taps}
    cache = model.new_cache(ids.numel())
    final = model.hidden(ids, cache, taps=found)  # [n, D]
    return torch.stack([found[k] for k in taps] + [final], dim=1).to(torch.float16)


def _shard_name(index: int) -> str:
    """The file name of shard ``index`` (written, and looked for on a resume)."""
    return f"shard-{index:05d}.pt"


@torch.inference_mode()
def generate(
    cfg: DataConfig,
    model: Any,
    tokenizer: Any,
    eos_ids: frozenset[int],
    out: Path,
    *,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Generate (or finish generating) the planned sequences into ``out``; returns how many exist."""
    out.mkdir(parents=True, exist_ok=True)
    settings = json.loads(json.dumps(asdict(cfg)))  # as config.json holds them (tuples as lists)
    shards = sorted(out.glob("shard-*.pt"))
    if shards and (out / "config.json").is_file():
        before = {"sampler": "target", **read_config(out)}  # older folders lack it
        changed = sorted(k for k in settings if before.get(k) != settings[k])
        if changed:
            raise ConfigError(f"{out} holds sequences generated with other settings ({', '.join(changed)}); "
                              "rerun with the same options to resume, or write to a new folder")
    (out / "config.json").write_text(json.dumps(settings, indent=1))
    todo = plan(cfg, tokenizer)
    # the shards on disk from the first one without a gap: a shard deleted in the middle (as
    # load_shards' error advises for a damaged one) is generated again, with every one after it
    have = {p.name for p in shards}
    kept = next(i for i in range(len(shards) + 1) if _shard_name(i) not in have)
    done = kept * cfg.shard_size
    if progress is not None:
        progress(min(done, len(todo)))
    if done >= len(todo):
        return len(todo)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + done)
    pending = list(range(done, len(todo)))
    finished: dict[int, _Slot] = {}
    next_shard = kept
    active: list[_Slot] = []

    def start(i: int) -> _Slot:
        ids, kind, temp, max_new = todo[i]
        slot = _Slot(i, list(ids), len(ids), temp, kind, max_new)
        slot.cache = model.new_cache(len(ids) + max_new + 1)
        logits = model.forward(torch.tensor(ids, dtype=torch.long), slot.cache, last_only=True)  # [1, V]
        _append(slot, logits[0], gen)
        return slot

    def flush() -> None:
        nonlocal next_shard
        while True:
            first = next_shard * cfg.shard_size
            batch = range(first, min(first + cfg.shard_size, len(todo)))
            if not batch or not all(i in finished for i in batch):
                return
            write(batch)

    def write(batch: range) -> None:
        nonlocal next_shard
        shard = Shard()
        for i in batch:
            s = finished.pop(i)
            ids = torch.tensor(s.ids, dtype=torch.long)
            shard.tokens.append(ids.to(torch.int32))
            shard.prompt_len.append(s.prompt_len)
            shard.temperature.append(s.temperature)
            shard.kind.append(s.kind)
            if cfg.features:
                shard.feats.append(features(model, ids, cfg.taps))
        shard.save(out / _shard_name(next_shard))
        next_shard += 1

    while pending or active:
        while pending and len(active) < cfg.batch:
            active.append(start(pending.pop(0)))
        still: list[_Slot] = []
        for s in active:
            if s.ids[-1] in eos_ids or s.generated >= s.max_new:
                finished[s.index] = s
                s.cache = None
                if progress is not None:
                    progress(1)
            else:
                still.append(s)
        active = still
        flush()
        if not active:
            continue
        items = [(torch.tensor(s.ids[-1:], dtype=torch.long), s.cache, True) for s in active]
        for s, logits in zip(active, model.forward_batch(items)):
            _append(s, logits[0], gen)
    flush()
    return len(todo)


def _append(slot: _Slot, logits: Tensor, gen: torch.Generator) -> None:  # logits: [V]
    if slot.temperature == 0.0:
        token = int(logits.argmax())
    else:
        probs = torch.softmax(logits.float() / slot.temperature, dim=-1)
        token = int(torch.multinomial(probs, 1, generator=gen))
    slot.ids.append(token)
    slot.generated += 1
