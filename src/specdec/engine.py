"""The one factory: names -> models, drafter, rule, γ policy; and the text-level generate call.

The CLI, the benchmark harness and the server all build engines here, so a name means the same
thing everywhere and the decoder itself never switches on strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from specdec import defaults
from specdec.decoder import GenerationResult, SpeculativeDecoder
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.drafters.base import Drafter
from specdec.errors import ConfigError
from specdec.drafters.tree_builder import TreeSpec
from specdec.gamma import CostGamma, FixedGamma, GammaController, GuideGamma, TreeBudget
from specdec.models.registry import LoadedModel, check_compatible, load
from specdec.sampling import SamplingConfig
from specdec.text import StopStrings, TextSink, encode_prompt
from specdec.verify import Rule, get_rule

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    target: str = defaults.DEFAULT_TARGET
    draft: str = defaults.DEFAULT_DRAFT  # registry name | path | "ngram" | "self" | "none"
    backend: str = "auto"  # auto | native | hf
    dtype: str = "float32"  # the target's dtype: exactness is relative to the target as loaded
    #: the draft's dtype (never affects exactness, only acceptance and speed): "auto" = bfloat16
    #: where the CPU has native bf16 matmuls (measured: a SmolLM2-draft step 1.0 ms vs 2.25 ms in
    #: float32), else the target's dtype with an int8 LM head where torch has an int8 engine;
    #: "int8" = float32 layers + int8 LM head
    draft_dtype: str = "auto"
    #: native target scores a draft block bitwise as it would score the tokens one by one
    #: (greedy / coupled output identical to plain decoding); ~10% slower verification
    batch_invariant: bool = True


def draft_dtype(cfg: EngineConfig) -> torch.dtype:
    """The draft model's dtype (see :attr:`EngineConfig.draft_dtype`)."""
    if cfg.draft_dtype == "auto":
        from specdec.models.linear import bf16_fast

        return torch.bfloat16 if cfg.backend != "hf" and bf16_fast() else DTYPES[cfg.dtype]
    if cfg.draft_dtype == "int8":
        return torch.float32
    if cfg.draft_dtype not in DTYPES:
        raise ConfigError(f"draft dtype must be auto, int8 or one of {', '.join(DTYPES)}, got {cfg.draft_dtype!r}")
    return DTYPES[cfg.draft_dtype]


def draft_int8_head(cfg: EngineConfig) -> bool:
    """Whether the draft's LM head runs as an int8 matmul: asked for (``int8``), or ``auto`` on a
    CPU without native bf16 matmuls where torch has an int8 engine (measured on a 2-core AVX2
    EPYC: the SmolLM2 draft's head 0.5 ms instead of 2.0 ms, a draft step 4.8 -> 3.3 ms)."""
    from specdec.models.linear import bf16_fast, int8_available

    if cfg.backend == "hf" or not int8_available():
        return False
    if cfg.draft_dtype == "int8":
        return True
    return cfg.draft_dtype == "auto" and cfg.dtype == "float32" and not bf16_fast()


def load_draft(cfg: EngineConfig, ref: str | None = None) -> LoadedModel:
    """The draft model in :func:`draft_dtype` (never batch-invariant: it scores one token at a time)."""
    return load(ref or cfg.draft, backend=cfg.backend, dtype=draft_dtype(cfg), batch_invariant=False,
                int8_head=draft_int8_head(cfg))


def default_method(cfg: SamplingConfig) -> str:
    """Greedy at temperature 0, block verification otherwise (optimal among single-draft rules)."""
    return "greedy" if cfg.greedy else "block"


def parse_gamma(value: str | int) -> str | int:
    """``auto`` (cost-based), ``guide`` (the reference guide's rule) or an integer >= 1."""
    if isinstance(value, int):
        g = value
    else:
        text = str(value).strip().lower()
        if text in ("auto", "guide"):
            return text
        try:
            g = int(text)
        except ValueError:
            raise ConfigError(f"gamma must be an integer >= 1, 'auto' or 'guide', got {value!r}") from None
    if not 1 <= g <= defaults.MAX_GAMMA:
        raise ConfigError(f"gamma must be between 1 and {defaults.MAX_GAMMA}, got {g}")
    return g


def make_gamma(spec: str | int, *, extra_target_s: float = 0.0) -> GammaController:
    spec = parse_gamma(spec)
    if spec == "auto":
        return CostGamma(extra_target_s=extra_target_s)
    if spec == "guide":
        return GuideGamma()
    return FixedGamma(int(spec))


def parse_tree(value: str | int) -> str | int:
    """``chain`` (no trees), ``auto`` (node budget from the cost controller) or a node count N."""
    text = str(value).strip().lower()
    if text in ("chain", "auto"):
        return text
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(f"tree must be 'chain', 'auto' or a node count, got {value!r}") from None
    if not 1 <= n <= defaults.MAX_TREE_NODES:
        raise ConfigError(f"tree node count must be between 1 and {defaults.MAX_TREE_NODES}, got {n}")
    return n


def make_tree(tree: str | int, gamma: GammaController) -> tuple[TreeSpec | None, GammaController]:
    """The tree spec and the controller for a ``--tree`` value (``chain`` keeps ``gamma``)."""
    tree = parse_tree(tree)
    if tree == "chain":
        return None, gamma
    if tree == "auto":
        return TreeSpec(), TreeBudget()
    return TreeSpec(), FixedGamma(int(tree))


@dataclass
class TextResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    result: GenerationResult = field(repr=False)

    @property
    def stats(self):
        return self.result.stats


class Engine:
    """Loaded target (+ drafter); builds a decoder per request (γ controllers are per sequence)."""

    def __init__(self, target: LoadedModel, drafter: Drafter | None, drafter_name: str,
                 draft_model: LoadedModel | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.drafter_name = drafter_name
        self.draft_model = draft_model

    @classmethod
    def build(cls, cfg: EngineConfig, *, progress: Callable[[str], None] | None = None) -> "Engine":
        if cfg.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
        dtype = DTYPES[cfg.dtype]
        if progress:
            progress(f"loading target {cfg.target}")
        target = load(cfg.target, backend=cfg.backend, dtype=dtype, batch_invariant=cfg.batch_invariant)
        kind = cfg.draft.strip().lower()
        if kind == "none":
            return cls(target, None, "none")
        if kind == "ngram":
            return cls(target, NgramDrafter(max_ngram=defaults.NGRAM_MAX, min_ngram=defaults.NGRAM_MIN), "ngram")
        if kind == "self":
            return cls(target, ModelDrafter(target.model), "self", target)
        if progress:
            progress(f"loading draft {cfg.draft}")
        draft = load_draft(cfg)
        check_compatible(target, draft)
        return cls(target, ModelDrafter(draft.model), draft.name, draft)

    def decoder(
        self,
        rule: Rule,
        gamma: str | int = defaults.DEFAULT_GAMMA,
        *,
        min_confidence: float | None = None,
        tree: str | int = defaults.DEFAULT_TREE,
    ) -> SpeculativeDecoder:
        spec, controller = make_tree(tree, make_gamma(gamma))
        return SpeculativeDecoder(
            self.target.model,
            self.drafter,
            rule,
            gamma=controller,
            tree=spec,
            eos_ids=self.target.eos_ids,
            drafter_name=self.drafter_name,
            min_confidence=defaults.MIN_CONFIDENCE if min_confidence is None else min_confidence,
        )

    def encode(self, prompt: str, *, chat: bool) -> list[int]:
        return encode_prompt(self.target.tokenizer, prompt, chat=chat)

    def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingConfig,
        *,
        method: str | None = None,
        gamma: str | int = defaults.DEFAULT_GAMMA,
        chat: bool = False,
        on_text: Callable[[str], None] | None = None,
        min_confidence: float | None = None,
        tree: str | int = defaults.DEFAULT_TREE,
    ) -> TextResult:
        rule = get_rule(method or default_method(sampling))
        ids = self.encode(prompt, chat=chat) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ConfigError("the prompt is empty")
        sink = TextSink(self.target.tokenizer, sampling.stop, on_text)
        stop = StopStrings(self.target.tokenizer, sampling.stop) if sampling.stop else None
        decoder = self.decoder(rule, gamma, min_confidence=min_confidence, tree=tree)
        result = decoder.generate(ids, sampling, stop=stop, on_tokens=sink.push)
        text = sink.finish(result.tokens)
        return TextResult(text=text, token_ids=result.tokens, prompt_ids=ids, result=result)
