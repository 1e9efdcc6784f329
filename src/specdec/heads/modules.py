"""Target-aware draft heads: EAGLE-1, EAGLE-3, Medusa-1 and MTP, as trainable torch modules.

All of them read the target's features (see :meth:`NativeCausalLM.hidden` ``taps``) and the
target's token embeddings (passed in, never stored: they are the target's own weights), and
predict over a *draft vocabulary*: ``d2t`` maps draft index i to target token ``d2t[i]``.  On a
CPU the target's 49k-row LM head is the largest matrix a draft step would touch; a draft
vocabulary of the most frequent few thousand tokens covers almost every accepted token at a
fraction of the cost (EAGLE-3's reduced vocabulary; we use it for every head).

Notation: ``f_t`` the target's feature at position t (the final hidden state, whose LM head
predicts token t+1), ``e_t`` the embedding of token t.

* EAGLE-1 (Li et al. 2024): ``x_t = fc([e_{t+1}; f_t])`` → one decoder layer → ``o_t``, trained
  to match ``f_{t+1}`` (regression) and the target's next-token law through the target's LM head
  rows of the draft vocabulary (frozen).  Drafting feeds ``o`` back in place of ``f``.
* EAGLE-3 (Li et al. 2025): the input feature fuses low / middle / high taps,
  ``g_t = fc([rms(h^a_t); rms(h^b_t); rms(h^c_t)])``; the layer attends from
  ``[norm(e_{t+1}); norm(g_t)]`` (2D wide) with ``g_t`` as its residual; its output ``o_t``
  goes through a trainable draft LM head.  Training-time test: step s feeds ``o^{s-1}_{t-1}``
  in place of ``g_t``, with the attention pattern drafting really has (see :func:`ttt_mask`).
* Medusa-1 (Cai et al. 2024): K residual blocks on ``f_t``; head k predicts token t+k+1 through
  the target's (frozen) LM head rows.
* MTP (DeepSeek-V3): K sequential modules; module k combines ``rms(h^{k-1}_t)`` (``h^0 = f``)
  with ``rms(e_{t+k})`` through a projection and one decoder layer and predicts token t+k+1
  through the shared (frozen) head.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specdec.catalog import HEAD_KINDS
from specdec.errors import ConfigError

KINDS = HEAD_KINDS  # the kinds specdec trains and runs (one list, in the torch-free catalog)


@dataclass(frozen=True)
class HeadConfig:
    kind: str  # one of KINDS
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_vocab: int
    draft_vocab: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    #: feature rows the head reads, as stored by ``specdec train data``: indices into
    #: (taps..., final); EAGLE-3 reads the taps, the others the final hidden state
    inputs: tuple[int, ...] = (-1,)
    #: layer counts of the target the taps came from (for the record and for loading features)
    taps: tuple[int, ...] = (2, 15, 27)
    #: Medusa heads / MTP modules; EAGLE: the training-time-test steps trained
    depth: int = 4
    target: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        for name in ("hidden_size", "n_heads", "n_kv_heads", "head_dim", "intermediate_size", "target_vocab", "draft_vocab",
                     "depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"a head's {name} must be a whole number, at least 1; got {value!r}")
        if self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ConfigError(f"a head's n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
                              f" and its head_dim ({self.head_dim}) even")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "HeadConfig":
        raw = json.loads(text)
        for key in ("inputs", "taps"):
            raw[key] = tuple(raw[key])
        return cls(**raw)


def rms(x: Tensor, eps: float = 1e-6) -> Tensor:  # [..., D] -> [..., D], parameter-free RMS norm
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms(x, self.eps) * self.weight


def rope_tables(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:  # -> [T, d] each
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim)  # [d/2]
    ang = positions.float()[:, None] * inv[None, :]  # [T, d/2]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x: [B, h, T, d]; cos/sin: [T, d]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    """Grouped-query attention whose keys may come from several blocks (cache, TTT steps)."""

    def __init__(self, cfg: HeadConfig, in_size: int) -> None:
        super().__init__()
        self.cfg = cfg
        h, hk, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q = nn.Linear(in_size, h * d, bias=False)
        self.k = nn.Linear(in_size, hk * d, bias=False)
        self.v = nn.Linear(in_size, hk * d, bias=False)
        self.o = nn.Linear(h * d, cfg.hidden_size, bias=False)
        #: inference only: one module computing [q | k | v] at once (see drafters.heads), or None
        self.qkv: nn.Module | None = None

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x`` [B, T, in] -> q [B, H, T, d], k, v [B, Hkv, T, d] (rope applied)."""
        cfg = self.cfg
        b, t, _ = x.shape
        if self.qkv is not None:
            hd, kd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
            q, k, v = self.qkv(x).split((hd, kd, kd), dim=-1)  # [B, T, hd], [B, T, kd] x2
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(b, t, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = k.view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.view(b, t, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """q [B, H, T, d], k/v [B, Hkv, S, d], mask [T, S] bool (True = may attend) or None (no mask)."""
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.cfg.n_heads != self.cfg.n_kv_heads)
        b, _, t, _ = out.shape
        return self.o(out.transpose(1, 2).reshape(b, t, -1))  # [B, T, D]


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        #: inference only: one module computing [gate | up] at once (see drafters.heads), or None
        self.gate_up: nn.Module | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(F.silu(gate) * up)
        return self.down(F.silu(self.gate(x)) * self.up(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer whose attention input may be wider than the residual (EAGLE-3)."""

    def __init__(self, cfg: HeadConfig, attn_in: int) -> None:
        super().__init__()
        self.attn = Attention(cfg, attn_in)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def finish(self, residual: Tensor, attn_out: Tensor) -> Tensor:  # -> [B, T, D]
        h = residual + attn_out
        return h + self.mlp(self.post_norm(h))


def ttt_mask(t: int, step: int, device: torch.device | None = None) -> Tensor:  # -> [T, (step+1) T] bool
    """Attention pattern of training-time-test step ``step``: query t sees step-0 keys at
    positions <= t - step (the committed context) and the key of step j at position t - step + j
    (the draft's own earlier positions), exactly what drafting step ``step`` sees."""
    idx = torch.arange(t, device=device)
    blocks = [idx[None, :] <= idx[:, None] - step]
    for j in range(1, step + 1):
        blocks.append(idx[None, :] == idx[:, None] - step + j)
    return torch.cat(blocks, dim=1)


class Eagle(nn.Module):
    """EAGLE-1 (``kind="eagle1"``) or EAGLE-3 (``"eagle3"``); see the module docstring."""

    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        if cfg.kind == "eagle3":
            self.fc = nn.Linear(len(cfg.inputs) * d, d, bias=False)
            self.embed_norm = RMSNorm(d, cfg.rms_eps)
            self.hidden_norm = RMSNorm(d, cfg.rms_eps)
            self.layer = DecoderLayer(cfg, 2 * d)
        else:
            self.fc = nn.Linear(2 * d, d, bias=False)
            self.input_norm = RMSNorm(d, cfg.rms_eps)
            self.layer = DecoderLayer(cfg, d)
        self.norm = RMSNorm(d, cfg.rms_eps)
        self.lm_head = nn.Linear(d, cfg.draft_vocab, bias=False)  # EAGLE-1: frozen target rows
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab), persistent=True)
        with torch.no_grad():  # start as "the target's feature passes through": fc picks the
            # last (highest) input, the residual branches start at zero; training moves from there
            self.fc.weight.zero_()
            self.fc.weight[:, -d:] = torch.eye(d)
            self.layer.attn.o.weight.zero_()
            self.layer.mlp.down.weight.zero_()

    def fuse(self, feats: Tensor) -> Tensor:  # [B, T, k, D] stored feature rows -> g [B, T, D]
        cfg = self.cfg
        rows = feats[:, :, list(cfg.inputs)].float()
        if cfg.kind == "eagle3":
            return self.fc(rms(rows).flatten(2))
        return rows[:, :, 0]

    def layer_input(self, g: Tensor, emb: Tensor) -> tuple[Tensor, Tensor]:  # -> (attention input, residual)
        if self.cfg.kind == "eagle3":
            return torch.cat([self.embed_norm(emb), self.hidden_norm(g)], dim=-1), g
        x = self.fc(torch.cat([emb, g], dim=-1))
        return self.input_norm(x), x

    def logits(self, o: Tensor) -> Tensor:  # [.., D] -> [.., Vd]
        if self.cfg.kind == "eagle3":
            return self.lm_head(self.norm(o))
        return self.lm_head(o)  # o predicts the target's (already normalised) feature


class Medusa(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(cfg.depth))
        for blk in self.blocks:  # start as the identity: every head begins as the target's own head
            nn.init.zeros_(blk.weight)
            nn.init.zeros_(blk.bias)
        self.lm_head = nn.Linear(d, cfg.draft_vocab, bias=False)  # frozen target rows
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab), persistent=True)

    def forward(self, f: Tensor) -> Tensor:  # f: [.., D] -> [K, .., Vd]
        return torch.stack([self.lm_head(f + F.silu(blk(f))) for blk in self.blocks])


class MTP(nn.Module):
    def __init__(self, cfg: HeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.proj = nn.ModuleList(nn.Linear(2 * d, d, bias=False) for _ in range(cfg.depth))
        self.input_norms = nn.ModuleList(RMSNorm(d, cfg.rms_eps) for _ in range(cfg.depth))
        self.layers = nn.ModuleList(DecoderLayer(cfg, d) for _ in range(cfg.depth))
        self.norm = RMSNorm(d, cfg.rms_eps)
        self.lm_head = nn.Linear(d, cfg.draft_vocab, bias=False)  # frozen target rows (shared)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab), persistent=True)

    def module_input(self, k: int, h_prev: Tensor, emb: Tensor) -> tuple[Tensor, Tensor]:
        x = self.proj[k](torch.cat([rms(h_prev), rms(emb)], dim=-1))
        return self.input_norms[k](x), x

    def logits(self, h: Tensor) -> Tensor:
        return self.lm_head(self.norm(h))


def build(cfg: HeadConfig) -> nn.Module:
    if cfg.kind in ("eagle1", "eagle3"):
        return Eagle(cfg)
    if cfg.kind == "medusa":
        return Medusa(cfg)
    return MTP(cfg)


def frozen_head_rows(kind: str) -> bool:
    """Whether the head's LM head is the target's (frozen) rather than trained."""
    return kind != "eagle3"


def save_head(module: nn.Module, folder: Path, *, dtype: torch.dtype = torch.float16) -> None:
    """``config.json`` + ``model.safetensors`` (weights in ``dtype``, ``d2t`` as int64)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg: HeadConfig = module.cfg  # type: ignore[assignment]
    (folder / "config.json").write_text(cfg.to_json())
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))


def load_head(folder: Path) -> nn.Module:
    cfg = HeadConfig.from_json((folder / "config.json").read_text())
    module = build(cfg)
    state = read_safetensors(folder / "model.safetensors")
    if "d2t" in state:
        check_vocab_map(state["d2t"], cfg.draft_vocab, cfg.target_vocab)
    load_state(module, {k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return module.eval()


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """The tensors of ``path``; a damaged file is a one-line :class:`ConfigError`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise ConfigError(f"{path} is not a readable safetensors file ({exc})".splitlines()[0]) from None


def check_vocab_map(d2t: Tensor, draft_vocab: int, vocab: int, t2d: Tensor | None = None) -> None:
    """A head's draft vocabulary ``d2t`` (draft index -> target id) must be ``draft_vocab`` integer
    ids, strictly increasing, in ``0 .. vocab - 1``; a ``t2d`` mask (the shared format's), where
    given, marks exactly those ids among ``vocab``."""
    if d2t.is_floating_point() or d2t.is_complex() or d2t.dtype == torch.bool or tuple(d2t.shape) != (draft_vocab,):
        raise ConfigError(f"a head's d2t must be {draft_vocab} integer token ids, got {d2t.dtype} of shape {list(d2t.shape)}")
    ids = d2t.long()
    if draft_vocab and (int(ids.min()) < 0 or int(ids.max()) >= vocab or not bool((ids[1:] > ids[:-1]).all())):
        raise ConfigError(f"a head's d2t must hold strictly increasing token ids in 0..{vocab - 1},"
                          f" got ids from {int(ids.min())} to {int(ids.max())}")
    if t2d is not None:
        if t2d.dim() != 1 or t2d.numel() != vocab or not bool(((t2d == 0) | (t2d == 1)).all()):
            raise ConfigError(f"a head's t2d must be a 0/1 mask over the {vocab} target ids,"
                              f" got {t2d.dtype} of shape {list(t2d.shape)}")
        mask = t2d.bool()
        if int(mask.sum()) != draft_vocab or not bool(mask[ids].all()):
            raise ConfigError(f"a head's t2d does not mark exactly its d2t's {draft_vocab} target ids"
                              f" ({int(mask.sum())} marked)")


def load_state(module: nn.Module, state: dict[str, Tensor], names: dict[str, str] | None = None) -> None:
    """``module.load_state_dict(state)``, with a one-line error naming the first tensor missing, extra
    or of the wrong shape (``names``: a tensor's name in the file, by the module's name, where they differ)."""
    own = module.state_dict()
    named = (names or {}).get
    for key, want in own.items():
        if key not in state:
            raise ConfigError(f"the head's file lacks the tensor {named(key, key)}")
        if tuple(state[key].shape) != tuple(want.shape):
            raise ConfigError(f"the head's tensor {named(key, key)} has shape {list(state[key].shape)},"
                              f" its config implies {list(want.shape)}")
    extra = sorted(set(state) - set(own))
    if extra:
        raise ConfigError(f"the head's file holds a tensor its config has no place for: {named(extra[0], extra[0])}")
    module.load_state_dict(state)


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())

