"""The one factory: names -> models, drafter, rule, γ policy; and the text-level generate call.

The CLI, the benchmark harness and the server all build engines here, so a name means the same
thing everywhere and the decoder itself never switches on strings.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from specdec import defaults
from specdec.batch import BatchResult, generate_batch
from specdec.catalog import CALIBRATION_FILE, MODEL_FREE_DRAFTS, NON_MODEL_DRAFTS, calibrated_factor, check_shipped  # noqa: F401 - re-exported
from specdec.decoder import GenerationResult, SpeculativeDecoder
from specdec.drafters import ModelDrafter, NgramDrafter
from specdec.drafters import self_spec
from specdec.drafters.hybrid import LOOKUP_SUFFIX, LookupThenModel, split_lookup
from specdec.drafters.lookahead import LookaheadDrafter
from specdec.drafters.base import Drafter, check_temperature_factor, feature_taps
from specdec.drafters.fed import FedDrafter, fed_config, load_projection
from specdec.errors import ConfigError, SpecdecError
from specdec.drafters.tree_builder import TreeSpec
from specdec.gamma import CostGamma, FixedGamma, GammaController, GammaMemory, GuideGamma, ObservedGamma, TreeBudget
from specdec.models import registry
from specdec.models.registry import LoadedModel, check_compatible
from specdec.sampling import SamplingConfig, floor_stops
from specdec.session import TargetSession
from specdec.text import StopWhen, encode_messages, encode_prompt, first_stop, output_sink, output_stop, prompt_ids
from specdec.verify import Rule, get_rule

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: quantised target formats of the native backend (activations and norms stay float32)
QUANTS = ("int8", "q4")
#: draft dtypes that quantise a draft model's layer matrices, and the quantisation each means
DRAFT_QUANTS = {"w8a8": "int8", "q4": "q4"}


@dataclass(frozen=True)
class EngineConfig:
    target: str = defaults.DEFAULT_TARGET
    draft: str = defaults.DEFAULT_DRAFT  # registry name | path | "ngram" | "self" | "none" | self-speculative (layerskip:K, self-skip[:PATH], swift[:PATH], kangaroo[:PATH])
    backend: str = "auto"  # auto | native | hf
    #: the target's precision: auto | float32 | bfloat16 | float16 | int8 (W8A8Linear layers,
    #: native backend) | q4 (4-bit layer matrices, a GGUF's Q4_0 / Q4_1 / Q4_K blocks as shipped, its
    #: Q6_K matrices and an untied head as shipped too, any other LM head as int8's; Q4Linear).  "auto" where torch has fbgemm (x86): q4 for a model that ships
    #: as a GGUF whose layer matrices are mostly Q4_0 / Q4_1 / Q4_K blocks, where the 4-bit kernel runs
    #: vectorised (AVX-512 VNNI or AVX2), int8 otherwise; float32
    #: elsewhere.  Measured on SmolLM2-135M (a Q4_1 GGUF): int8 steps 3x faster than float32, KL to
    #: float32 0.015-0.024 nats; q4 a further ~40 % faster with KL 0.006-0.007 (its weights are
    #: the file's own).  Exactness is relative to the target as it runs.
    dtype: str = defaults.TARGET_DTYPE
    #: the draft's dtype (never affects exactness, only acceptance and speed): "auto" = w8a8 where
    #: torch has fbgemm (x86) and the CPU has AVX-512 VNNI, q4 where it has fbgemm and AVX2 only,
    #: else bfloat16 where the CPU has native bf16 matmuls, else float32, either with an int8 LM
    #: head where torch has an int8 engine; "int8" = float32 layers + int8 LM head; "w8a8" = every
    #: linear layer as the int8 target's; "q4" = 4-bit layer matrices (see :func:`draft_quant`); a
    #: target-aware head's own layers follow the non-w8a8 rule
    draft_dtype: str = "auto"
    #: the draft model's vocabulary (never affects exactness, only acceptance and speed): "auto" =
    #: the draft folder's reduced vocabulary (``draft_vocab.json``: its LM head over the most
    #: frequent tokens of the target's replies, -inf elsewhere) where it ships one; "full" = all
    draft_vocab: str = "auto"
    #: native target scores a draft block bitwise as it would score the tokens one by one
    #: (greedy / coupled output identical to plain decoding); ~10% slower verification
    batch_invariant: bool = True
    #: the int8 target's matmul kernel: auto | fbgemm | onednn | mixed (see :func:`specdec.models.linear.int8_kernel`)
    int8_kernel: str = "auto"
    #: a chat template (its text) to render conversations with in place of the target's own (None: the model's)
    chat_template: str | None = None
    #: the draft samples at this factor x the request's temperature (never affects exactness, only
    #: acceptance; greedy decoding is untouched): "auto" = the value its folder ships
    #: (``draft_calibration.json``, measured by ``specdec train calibrate``), else 1; or a number
    #: in (0, 100].  A small draft is less sure than its target, so a factor below 1 makes q agree
    #: with p more often (the shipped draft: 0.85)
    draft_temperature_factor: str | float = "auto"
    #: the target's key/value cache: "auto" = its float dtype (float32 for int8 / q4 targets), or
    #: "float16" (native backend, exact attention): half the bytes a long context's decoding step
    #: reads and holds (plain steps ~1.5x faster at 4,000-6,000 tokens of SmolLM2, verification
    #: passes ~1.1x: their rows' attention is compute; llama.cpp's cache is float16 too).  Keys and
    #: values rounded to float16 make a slightly different target, and exactness holds relative to
    #: it: plain and speculative decoding both run it
    kv_dtype: str = defaults.KV_DTYPE

    def __post_init__(self) -> None:
        # a value of the wrong kind failed later inside a loader (EngineConfig(target=None): AttributeError: strip)
        for name in ("target", "draft"):  # a folder may come as a Path
            if isinstance(getattr(self, name), os.PathLike):
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
        for name in ("target", "draft", "backend", "dtype", "draft_dtype", "draft_vocab", "int8_kernel", "kv_dtype"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string, got {getattr(self, name)!r}")
        if self.backend not in ("auto", "native", "hf"):
            raise ConfigError(f"unknown backend {self.backend!r}; choose auto, native or hf")
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        if self.chat_template is not None:
            if not isinstance(self.chat_template, str):
                raise ConfigError(f"chat_template must be a string, got {type(self.chat_template).__name__}")
            from specdec.tokenizer import check_chat_template

            check_chat_template(self.chat_template)  # a broken one failed only at the first chat


#: --kv-dtype's choices
KV_DTYPES = {"auto": None, "float16": torch.float16}


def check_kv_dtype(cfg: EngineConfig, dtype: torch.dtype) -> torch.dtype | None:
    """The cache dtype ``cfg.kv_dtype`` asks for (None: the target's own), or a ConfigError, before
    the target (of float dtype ``dtype``) loads, where its settings already say it cannot hold it."""
    if cfg.kv_dtype not in KV_DTYPES:
        raise ConfigError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {cfg.kv_dtype!r}")
    kv = KV_DTYPES[cfg.kv_dtype]
    if kv is not None and not cfg.batch_invariant:
        raise ConfigError(f"--kv-dtype {cfg.kv_dtype} needs exact attention: drop --fast-attention")
    if kv is not None and dtype != torch.float32:
        raise ConfigError(f"--kv-dtype {cfg.kv_dtype} needs a float32, int8 or q4 target with exact attention"
                          f" (not --dtype {cfg.dtype})")
    return kv


def apply_kv_dtype(target: "LoadedModel", kv_dtype: torch.dtype | None, name: str) -> None:
    """Set the loaded ``target``'s cache dtype (:func:`check_kv_dtype`'s answer, ``name`` as asked),
    or raise a ConfigError that says why the model cannot hold it."""
    if kv_dtype is None:
        return
    setter = getattr(target.model, "set_kv_dtype", None)
    if setter is None:
        raise ConfigError(f"--kv-dtype {name} needs the native backend (this target runs on {target.backend})")
    try:
        setter(kv_dtype)
    except ValueError as e:
        raise ConfigError(f"--kv-dtype {name}: {e}") from None


def target_dtype(cfg: EngineConfig) -> tuple[torch.dtype, str | None]:
    """The target's float dtype and quantisation (see :attr:`EngineConfig.dtype`)."""
    if cfg.dtype in QUANTS and registry.is_hub_ref(cfg.target):
        raise ConfigError(f"--dtype {cfg.dtype} needs a local model (a hub id loads on the Hugging Face backend):"
                          " download it and pass its folder, or use float32")
    if cfg.dtype == "auto":
        from specdec.models.linear import w8a8_available

        # a model the native backend cannot run (a GPT-2, say) loads on the hf backend, in float
        native = cfg.backend != "hf" and registry.native_runs(cfg.target) is not False
        if not (native and w8a8_available()):
            return target_dtype(replace(cfg, dtype="float32"))
        from specdec.models import kernels
        from specdec.models.gguf_blocks import ships_q4

        # q4 only where its kernel runs vectorised: the portable C++ or the ATen reference (no
        # compiler) is several times slower than int8 on fbgemm
        return target_dtype(replace(cfg, dtype="q4" if ships_q4(cfg.target) and kernels.q4_fast() else "int8"))
    if cfg.dtype in QUANTS:
        if cfg.backend == "hf":
            raise ConfigError(f"--dtype {cfg.dtype} needs the native backend (not --backend hf)")
        if registry.native_runs(cfg.target) is False:
            raise ConfigError(f"--dtype {cfg.dtype} needs the native backend, which runs Llama, Qwen2, Mistral, Qwen3 and"
                              f" Gemma 3 text models; {cfg.target} is not one: use --dtype float32 (the hf backend)")
        from specdec.models.linear import w8a8_available

        if not w8a8_available():
            raise ConfigError(f"--dtype {cfg.dtype} needs torch's fbgemm int8 engine (x86 CPUs); use float32")
        return torch.float32, cfg.dtype
    if cfg.dtype not in DTYPES:
        raise ConfigError(f"dtype must be auto or one of {', '.join((*DTYPES, *QUANTS))}, got {cfg.dtype!r}")
    return DTYPES[cfg.dtype], None


def draft_dtype(cfg: EngineConfig) -> torch.dtype:
    """The draft model's dtype (see :attr:`EngineConfig.draft_dtype`)."""
    if cfg.draft_dtype == "auto":
        from specdec.models.linear import bf16_fast

        if cfg.backend != "hf" and bf16_fast():
            return torch.bfloat16
        # the target's float dtype: float32 whatever "auto" resolves to (q4, int8 or float32), so
        # no need to resolve it (that reads the target GGUF's header)
        return torch.float32 if cfg.dtype == "auto" else target_dtype(cfg)[0]
    if cfg.draft_dtype in ("int8", *DRAFT_QUANTS):
        return torch.float32
    if cfg.draft_dtype not in DTYPES:
        raise ConfigError(f"draft dtype must be auto, int8, {', '.join(DRAFT_QUANTS)} or one of {', '.join(DTYPES)},"
                          f" got {cfg.draft_dtype!r}")
    return DTYPES[cfg.draft_dtype]


def draft_quant(cfg: EngineConfig) -> str | None:
    """How a draft model's layer matrices are quantised, if they are:

    * ``"int8"``: every linear layer as the target's int8 matmul — asked for (``w8a8``), or
      ``auto`` where torch has fbgemm and the 4-bit kernel does not run vectorised (below).
      Chosen first for CPUs with 512-bit VNNI, against bfloat16.  Measured on a 2-core
      Sapphire Rapids (SmolLM2-135M int8 target, the 16 built-in prompts, prompt lookup + the
      small draft, paired in one process): a draft step 1.43 -> 1.19 ms against bfloat16 with an
      int8 head, tokens per call 2.10 -> 2.18 at T = 0, ×1.295 -> ×1.325 over plain at T = 0 and
      ×0.980 -> ×0.992 at T = 1;
    * ``"q4"``: the layers as 4-bit blocks (llama.cpp's Q4_1 rule) on the 4-bit kernel, the LM
      head int8 — asked for (``q4``), or ``auto`` wherever the 4-bit kernel runs vectorised
      (AVX-512 VNNI or AVX2). On AVX2 the int8 layers used to fall back to one fbgemm call and ~25
      ATen calls per layer (see NOTES, "Machine F"); since the few-row int8 product has an AVX2
      build the two are level there (machine H, paired: a draft token 1.13 against 1.03 ms,
      ×1.262 against ×1.275 over plain at T = 0, ×1.154 against ×1.173 at T = 1). With 512-bit
      VNNI (machine I, a Zen 5, paired) the 4-bit draft is the faster one: SmolLM2's draft token
      0.288 -> 0.249 ms at T = 0, ×1.280 -> ×1.316 over plain, ×1.178 -> ×1.188 at T = 1;
      Qwen2.5-Coder-0.5B's 10.5 -> 7.8 ms, ×1.292 -> ×1.370 and ×1.253 -> ×1.377 over its 1.5B
      target, at the same acceptance. On an Intel Xeon with VNNI and AMX (machine J, paired) too:
      0.672 -> 0.557 ms, ×1.381 -> ×1.425 at T = 0, ×1.127 -> ×1.156 at T = 1."""
    from specdec.models import kernels
    from specdec.models.linear import w8a8_available

    if cfg.draft_dtype == "auto":
        if cfg.backend == "hf" or not w8a8_available():
            return None
        return "q4" if kernels.q4_fast() else "int8"
    if cfg.draft_dtype not in DRAFT_QUANTS:
        return None
    if cfg.backend == "hf" or not w8a8_available():
        raise ConfigError(f"--draft-dtype {cfg.draft_dtype} needs the native backend and torch's fbgemm int8 engine (x86)")
    return DRAFT_QUANTS[cfg.draft_dtype]


def head_quant(cfg: EngineConfig) -> str | None:
    """A target-aware head's quantisation: int8 where a draft model's would be int8 or 4-bit (heads
    have no 4-bit path)."""
    return "int8" if draft_quant(cfg) is not None else None


def draft_int8_head(cfg: EngineConfig) -> bool:
    """Whether the draft's LM head (80% of a small draft's weights) runs as an int8 matmul:
    asked for (``int8``), or ``auto`` wherever torch has an int8 engine."""
    from specdec.models.linear import int8_available

    if cfg.backend == "hf" or not int8_available():
        return False
    if cfg.draft_dtype in ("int8", *DRAFT_QUANTS):
        return True
    # auto: on every CPU with an int8 engine (measured here, AVX-512 + bf16: a bf16 SmolLM2-draft
    # step 1.57 -> 1.25 ms with the int8 head; AVX2 without bf16: 4.8 -> 3.3 ms)
    return cfg.draft_dtype == "auto"


def draft_precision(cfg: EngineConfig) -> str:
    """What ``cfg.draft_dtype`` resolves to for a draft model on this machine, in words (reports)."""
    quant = draft_quant(cfg)
    if quant:
        return "w8a8" if quant == "int8" else quant
    name = str(draft_dtype(cfg)).removeprefix("torch.")
    return name + (" + int8 head" if draft_int8_head(cfg) else "")


def draft_batch_invariant(quant: str | None) -> bool:
    """Whether the draft model scores several rows with exact per-row attention.  Never needed for
    exactness (the draft only proposes); chosen for speed: an int8 draft on the compiled kernels
    then runs its multi-row passes — the catch-up after a round, a tree level — as one fused call
    (``csrc/layers.cpp``) instead of the TorchScript loop with one masked attention call per layer.
    Measured on machine E (a 2-core Zen 4): a 3-row catch-up 2.41 -> 1.37 ms, a 4-node tree level
    2.94 -> 2.01 ms; a one-row step is the same either way."""
    from specdec.models import kernels

    return quant is not None and kernels.attention_kernel()


#: reduced draft vocabularies shipped for registry models that are converted on setup, not shipped
#: (``NAME/draft_vocab.json``; a file in the model's own folder comes first)
SHIPPED_DRAFT_VOCABS = Path(__file__).parent / "data" / "draft_vocab"


def draft_vocabulary(cfg: EngineConfig, ref: str) -> torch.Tensor | None:
    """The token ids the draft's LM head keeps (``draft_vocab.json`` in its folder, or for a
    registry model in :data:`SHIPPED_DRAFT_VOCABS`, with ``draft_vocab="auto"`` and the native
    backend), or None for the whole vocabulary."""
    if cfg.draft_vocab not in ("auto", "full"):
        raise ConfigError(f"draft vocabulary must be auto or full, got {cfg.draft_vocab!r}")
    if cfg.draft_vocab == "full" or cfg.backend == "hf":
        return None
    from specdec.models.registry import resolve

    try:
        resolved = resolve(ref)
    except SpecdecError:
        return None  # load() reports what is wrong with the reference
    path = resolved.folder / "draft_vocab.json" if resolved.folder is not None else None
    if (path is None or not path.is_file()) and resolved.spec is not None:
        path = SHIPPED_DRAFT_VOCABS / resolved.spec.name / "draft_vocab.json"  # a registry model converted on setup
    if path is None or not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())["ids"]
        if not isinstance(raw, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in raw):
            raise TypeError("the ids must be whole numbers")  # (a float or a bool would be truncated to one)
        ids = torch.tensor(raw, dtype=torch.long)
    except (ValueError, KeyError, TypeError, OverflowError) as exc:
        raise ConfigError(f"{path}: not a draft vocabulary ({type(exc).__name__}: {exc})".splitlines()[0]) from None
    if ids.ndim != 1 or ids.numel() == 0 or not bool((ids[1:] > ids[:-1]).all()) or int(ids[0]) < 0:
        raise ConfigError(f"{path}: the ids must be a non-empty, sorted list of distinct token ids")
    return ids


def view_vocabulary(cfg: EngineConfig, target: str) -> torch.Tensor | None:
    """The reduced vocabulary a self-speculative view of the target ``target`` (a reference: a
    registry name or a folder) drafts over under ``draft_vocab="auto"``: the target's own
    (:func:`draft_vocabulary`), else its registry default draft's, which shares its tokenizer;
    None for the whole vocabulary."""
    ids = draft_vocabulary(cfg, target)
    if ids is not None or cfg.draft_vocab == "full":
        return ids
    from specdec.models.registry import resolve

    try:
        spec = resolve(target).spec
    except SpecdecError:
        return None
    return draft_vocabulary(cfg, spec.default_draft) if spec is not None and spec.default_draft else None


def parse_temperature_factor(value: str | float) -> str | float:
    """``auto`` or a draft temperature factor in (0, 100] (see :attr:`EngineConfig.draft_temperature_factor`)."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return "auto"
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"the draft temperature factor must be auto or a number, got {value!r}") from None
    return check_temperature_factor(value)


def samples_no_model(draft: str) -> bool:
    """Whether ``--draft`` names a drafter that samples from no model (``none``, ``ngram``, ``lookahead``)."""
    return split_lookup(draft)[0].strip().lower() in MODEL_FREE_DRAFTS


def check_factor_applies(kind: str, value: str | float) -> None:
    """A draft temperature factor other than auto or 1 for a drafter that samples from no model
    is refused: it would do nothing."""
    if samples_no_model(kind) and parse_temperature_factor(value) not in ("auto", 1.0):
        raise ConfigError(f"--draft {kind} drafts without a model's distribution: a draft temperature factor"
                          " applies to drafters that sample from a model")


def factor_for(draft: str, value: str | float) -> str | float:
    """``value`` for a drafter that samples from a model, else ``auto``: how a benchmark applies one
    ``--draft-temperature-factor`` to several drafters (or to a server without one)."""
    return "auto" if samples_no_model(draft) else value


def draft_temperature_factor(cfg: EngineConfig, folder: Path | None) -> float:
    """The factor a drafter loaded from ``folder`` samples at: the configured number, or under
    ``auto`` its folder's calibration (:data:`CALIBRATION_FILE`), else 1."""
    value = parse_temperature_factor(cfg.draft_temperature_factor)
    if value != "auto":
        return float(value)
    calibrated = calibrated_factor(folder)
    return 1.0 if calibrated is None else calibrated


def model_drafter(cfg: EngineConfig, draft: LoadedModel, *, lookup: bool) -> tuple[Drafter, str]:
    """(drafter, name) over a loaded draft model, sampling at its :func:`draft_temperature_factor`,
    with prompt lookup in front where asked (``NAME+lookup``); a fresh one per sequence stream."""
    factor = draft_temperature_factor(cfg, draft.folder)
    fed = fed_config(draft.folder)
    if fed is not None:  # a fed draft reads the target's features (specdec.drafters.fed)
        if not hasattr(draft.model, "hidden"):
            raise ConfigError(f"{draft.name}: a fed draft runs on the native backend")
        proj, null = load_projection(draft.folder)  # type: ignore[arg-type]
        drafter: ModelDrafter = FedDrafter(draft.model, proj, null, tuple(fed["taps"]), temperature_factor=factor)
    else:
        drafter = ModelDrafter(draft.model, temperature_factor=factor)
    return (LookupThenModel(drafter), draft.name + LOOKUP_SUFFIX) if lookup else (drafter, draft.name)


def load_draft(cfg: EngineConfig, ref: str | None = None, *, target: LoadedModel | None = None) -> LoadedModel:
    """The draft model in :func:`draft_dtype` (batch-invariant only where that is faster:
    :func:`draft_batch_invariant`), over its reduced vocabulary where it has one (:func:`draft_vocabulary`);
    with ``target``, its tokenizer object where the two folders' tokenizer files are the same."""
    quant = draft_quant(cfg)
    name = split_lookup(ref or cfg.draft)[0]
    return registry.load(name, backend=cfg.backend, dtype=torch.float32 if quant else draft_dtype(cfg),
                         batch_invariant=draft_batch_invariant(quant), int8_head=draft_int8_head(cfg), quant=quant,
                         int8_kernel="fbgemm" if quant else "auto", vocab_subset=draft_vocabulary(cfg, name),
                         tokenizer_of=target)


def default_method(cfg: SamplingConfig) -> str:
    """The rule used when none is named.

    * temperature 0: ``greedy`` (identical tokens to plain greedy decoding);
    * a seed is given: ``coupled``, so the seed fixes the output whatever γ the (timing-dependent)
      controller picks and whatever the drafter: its tokens are plain seeded sampling's;
    * otherwise ``block`` verification (optimal among single-draft rules: Sun et al. 2024).
    """
    if cfg.greedy:
        return "greedy"
    return "coupled" if cfg.seed is not None else "block"


def parse_gamma(value: str | int) -> str | int:
    """``auto`` (cost-based), ``guide`` (the simple dynamic rule of :class:`GuideGamma`) or an integer >= 1."""
    if isinstance(value, bool):
        raise ConfigError(f"gamma must be an integer >= 1, 'auto' or 'guide', got {value!r}")
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


def make_gamma(spec: str | int | GammaController, *, extra_target_s: float = 0.0) -> GammaController:
    """The controller for a γ spec (a controller passed in is used as it is)."""
    if hasattr(spec, "next_gamma"):
        return spec  # a controller (or one of the same shape)
    if isinstance(spec, bool) or not isinstance(spec, (str, int)):
        raise ConfigError(f"gamma must be an integer >= 1, 'auto', 'guide' or a controller, got {spec!r}")
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


def parse_tree_min_prob(value: float | None) -> float | None:
    """A ``--tree-min-prob`` value checked (None = the default floor): in [0, 1)."""
    if value is not None:
        TreeSpec(min_prob=value)  # raises ConfigError with the range
    return value


def parse_min_confidence(value: float | None) -> float | None:
    """A ``--min-confidence`` value checked (None = the default, off): a probability in [0, 1]."""
    if value is not None and not 0.0 <= value <= 1.0:
        raise ConfigError(f"min-confidence is a draft probability in [0, 1] (0 = off), got {value}")
    return value


def drafts_chains_only(drafter: object) -> bool:
    """True for a drafter without a tree pass (self-speculative views, MTP heads): a
    tree asked of it is drafted as a chain (the output is the same; only the speedup differs)."""
    return drafter is not None and not getattr(drafter, "supports_trees", False)


def make_tree(tree: str | int, gamma: GammaController, *, min_prob: float | None = None,
              drafter: object = None) -> tuple[TreeSpec | None, GammaController]:
    """The tree spec and the controller for a ``--tree`` value (``chain`` keeps ``gamma``, and so
    does a ``drafter`` with no tree pass: it drafts chains under the γ asked for, not under the
    tree's node count); ``min_prob``: the deterministic trees' probability floor (None = the default)."""
    tree = parse_tree(tree)
    if tree == "chain" or drafts_chains_only(drafter):
        return None, gamma
    spec = TreeSpec() if min_prob is None else TreeSpec(min_prob=min_prob)
    if tree == "auto":
        return spec, TreeBudget()
    return spec, FixedGamma(int(tree))


def draft_for_target(target: str, draft: str) -> str:
    """``draft``, unless it is the default drafter and ``target`` is a registry model with a draft
    of its own (the Qwen pair's 0.5B, whose tokenizer the default SmolLM2 draft does not share):
    then that draft, with prompt lookup in front as the default has it; or a model-free drafter
    where the registry names one (Gemma 3, which no draft model shares a tokenizer with: prompt
    lookup, without loading a draft model only to find that out)."""
    if draft != defaults.DEFAULT_DRAFT:
        return draft
    spec = registry.REGISTRY.get(target.strip().lower())
    if spec is None or not spec.default_draft or spec.default_draft == defaults.DEFAULT_DRAFT_MODEL:
        return draft
    if spec.default_draft in MODEL_FREE_DRAFTS:
        return spec.default_draft
    return spec.default_draft + LOOKUP_SUFFIX


def check_draft_name(draft: str) -> tuple[str, bool, Path | None]:
    """(base name, prompt lookup in front?, head folder or None) of a ``--draft`` value; a missing
    shipped head or a ``+lookup`` on a drafter that is not a model fails here, before anything loads."""
    from specdec.drafters import heads

    base, lookup = split_lookup(draft)
    kind = base.lower()
    head = heads.resolve_head(base)
    if lookup and (kind in MODEL_FREE_DRAFTS or head is not None):
        raise ConfigError(f"'{LOOKUP_SUFFIX}' adds prompt lookup to a drafting model (a draft model, 'self' or a"
                          f" self-speculative view); {base!r} is not one (use e.g. {defaults.DEFAULT_DRAFT_MODEL}{LOOKUP_SUFFIX})")
    if kind not in NON_MODEL_DRAFTS and head is None and self_spec.parse_name(kind) is None:
        registry.check_name(base, also="as --draft also: none, ngram, lookahead, self, layerskip:K, self-skip[:FILE],"
                                       " swift, kangaroo[:FILE], a trained head (see `specdec models`), NAME+lookup")
    return base, lookup, head


@dataclass(frozen=True)
class TextPiece:
    """One streamed piece of a generation (:meth:`Engine.generate`'s ``on_piece``): its new text,
    the generated tokens whose text it completes (possibly none, or tokens with no text of their
    own, such as an end-of-turn token) and, where log-probabilities were asked for, theirs."""

    text: str
    token_ids: list[int]
    #: per token in ``token_ids``, as :attr:`TextResult.logprobs`; None without ``logprobs``
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass
class TextResult:
    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    result: GenerationResult = field(repr=False)
    #: per generated token: (log-probability, [(id, log-probability) of the most likely]) or None
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = field(default=None, repr=False)
    #: with a prediction drafting (OpenAI's Predicted Outputs): its tokens the answer took and the rest
    #: (:meth:`specdec.drafters.predicted.Predicted.taken`); None without one
    prediction_tokens: tuple[int, int] | None = None

    @property
    def stats(self):
        return self.result.stats


class Engine:
    """Loaded target (+ drafter); builds a decoder per request.  With γ auto a drafter that ended a
    sequence backed off, and would not pay at a fair acceptance, starts the next one backed off
    (:meth:`CostGamma.successor` of the last controller for the same rule)."""

    def __init__(self, target: LoadedModel, drafter: Drafter | None, drafter_name: str,
                 draft_model: LoadedModel | None = None) -> None:
        self.target = target
        self.drafter = drafter
        self.drafter_name = drafter_name
        self.draft_model = draft_model
        self._auto = GammaMemory()  # rule name -> the last γ auto controller handed out

    @classmethod
    def build(cls, cfg: EngineConfig, *, progress: Callable[[str], None] | None = None) -> "Engine":
        cfg = replace(cfg, draft=draft_for_target(cfg.target, cfg.draft))
        base, _, _ = check_draft_name(cfg.draft)  # a bad draft name fails before the target loads
        registry.check_name(cfg.target)
        spec = registry.REGISTRY.get(cfg.target.strip().lower())
        if spec is not None:  # ... and a self-speculative draft with nothing shipped for a registry target
            check_shipped(base, spec.name)
        dtype, quant = target_dtype(cfg)
        kv_dtype = check_kv_dtype(cfg, dtype)  # what can be told before the target loads
        if progress and quant is None and cfg.int8_kernel != "auto":  # asked for, and nothing reads it
            progress(f"--int8-kernel {cfg.int8_kernel} is not used: the target runs in {str(dtype).removeprefix('torch.')},"
                     " and the kernel is an int8 (or q4) target's")
        if progress:
            progress(f"loading target {cfg.target}" + (f" ({quant})" if quant else ""))
        target = registry.load(cfg.target, backend=cfg.backend, dtype=dtype, batch_invariant=cfg.batch_invariant,
                               quant=quant, int8_kernel=cfg.int8_kernel)
        apply_kv_dtype(target, kv_dtype, cfg.kv_dtype)
        if cfg.chat_template is not None:
            from specdec.tokenizer import set_chat_template

            set_chat_template(target.tokenizer, cfg.chat_template)
        return cls.attach(target, cfg, progress=progress)

    @classmethod
    def attach(cls, target: LoadedModel, cfg: EngineConfig, *, progress: Callable[[str], None] | None = None) -> "Engine":
        """An engine for ``cfg.draft`` over an already loaded ``target`` (which ``cfg`` describes):
        several drafters can share one target this way (``specdec bench --draft A,B``)."""
        from specdec.drafters import heads

        base, lookup, head = check_draft_name(cfg.draft)
        kind = base.lower()
        check_factor_applies(kind, cfg.draft_temperature_factor)
        wrap = (lambda d, name: (LookupThenModel(d), name + LOOKUP_SUFFIX)) if lookup else (lambda d, name: (d, name))
        if kind == "none":
            return cls(target, None, "none")
        if kind == "ngram":
            return cls(target, NgramDrafter(max_ngram=defaults.NGRAM_MAX, min_ngram=defaults.NGRAM_MIN), "ngram")
        if kind == "lookahead":
            return cls(target, LookaheadDrafter(), "lookahead")
        if kind == "self":
            return cls(target, *wrap(ModelDrafter(target.model, temperature_factor=draft_temperature_factor(cfg, None)),
                                     "self"), target)
        if self_spec.parse_name(kind) is not None:  # a view of the target: no second model is loaded
            vocab = view_vocabulary(cfg, cfg.target)
            if vocab is not None and int(vocab.max()) >= target.model.vocab_size:
                vocab = None  # (a default draft of another vocabulary)
            view, name = self_spec.build(base, target.model, target.name, vocab=vocab)
            view.temperature_factor = draft_temperature_factor(cfg, None)
            return cls(target, *wrap(view, name))
        if head is not None:  # a target-aware head (EAGLE, Medusa, MTP): reads the target's features
            if progress:
                progress(f"loading draft head {cfg.draft}")
            label = cfg.draft.strip().lower() if cfg.draft.strip().lower() in heads.HEADS else None
            drafter, name = heads.build(head, target.model, label=label, int8_head=draft_int8_head(cfg),
                                        dtype=draft_dtype(cfg), quant=head_quant(cfg))
            drafter.temperature_factor = draft_temperature_factor(cfg, head)
            return cls(target, drafter, name)
        if progress:
            progress(f"loading draft {base}")
        draft = load_draft(cfg, base, target=target)
        try:
            check_compatible(target, draft)
        except SpecdecError:
            if cfg.draft != defaults.DEFAULT_DRAFT:
                raise
            # the default drafter, on a target whose tokenizer its draft model does not share: drafts
            # from the prompt and the answer alone instead of refusing a run nobody chose a draft for
            if progress:
                progress(f"{defaults.DEFAULT_DRAFT_MODEL} does not share {target.name}'s tokenizer: drafting by prompt"
                         " lookup alone (--draft ngram); choose another draft with --draft")
            return cls(target, NgramDrafter(max_ngram=defaults.NGRAM_MAX, min_ngram=defaults.NGRAM_MIN), "ngram")
        return cls(target, *model_drafter(cfg, draft, lookup=lookup), draft)

    def with_prefix_cache(self, max_bytes: int = defaults.SERVER_PREFIX_CACHE_BYTES) -> "Engine":
        """This engine with a prefix cache (``target.model.prefix_cache``) in front of its target's
        prefills, for prompt after prompt that share their beginnings (a chat re-sending its history);
        itself where that would not be exact (a target that is not batch-invariant).  A draft model
        that is batch-invariant gets one too (its drafter's ``model.prefix_cache``)."""
        from specdec.server.prefix_cache import PrefixCache, PrefixCached, draft_prefix_cache, supports_prefix_cache

        if not supports_prefix_cache(self.target.model):
            return self
        model = PrefixCached(self.target.model, PrefixCache(max_bytes))
        drafter = self.drafter
        with_model = getattr(drafter, "with_model", None)
        if with_model is not None and self.draft_model is not None:
            draft = self.draft_model.model
            draft_cache = draft_prefix_cache(self.target.model, draft, max_bytes)
            if draft_cache is not None:
                drafter = with_model(PrefixCached(draft, draft_cache))
        return Engine(replace(self.target, model=model), drafter, self.drafter_name, self.draft_model)

    def decoder(
        self,
        rule: Rule,
        gamma: str | int | GammaController = defaults.DEFAULT_GAMMA,
        *,
        min_confidence: float | None = None,
        ignore_eos: bool = False,
        tree: str | int = defaults.DEFAULT_TREE,
        tree_min_prob: float | None = None,
        tree_observe: Callable[[int, int], None] | None = None,
        max_draft: int | None = None,
    ) -> SpeculativeDecoder:
        """``tree_observe(nodes, accepted)``: told of every tree round's budget controller update;
        ``max_draft``: the most tokens (a tree's nodes) any round drafts, whatever γ or the tree asks."""
        spec, controller = make_tree(tree, self._gamma(rule, gamma), min_prob=tree_min_prob, drafter=self.drafter)
        if spec is not None and tree_observe is not None:
            controller = ObservedGamma(controller, tree_observe)
        return SpeculativeDecoder(
            self.target.model,
            self.drafter,
            rule,
            gamma=controller,
            tree=spec,
            eos_ids=frozenset() if ignore_eos else self.target.eos_ids,
            drafter_name=self.drafter_name,
            min_confidence=defaults.MIN_CONFIDENCE if min_confidence is None else parse_min_confidence(min_confidence),
            max_draft=max_draft,
        )

    def _gamma(self, rule: Rule, gamma: str | int | GammaController) -> GammaController:
        """The controller for ``gamma``; γ auto's is the successor of this engine's last one for ``rule``."""
        if not isinstance(gamma, (str, int)) or parse_gamma(gamma) != "auto":
            return make_gamma(gamma)
        controller = self._auto.next(rule.name)
        self._auto.keep(rule.name, controller)  # one sequence at a time: the next one follows this one
        return controller

    def encode(self, prompt: str, *, chat: bool, system: str | None = None) -> list[int]:
        return encode_prompt(self.target.tokenizer, prompt, chat=chat, system=system)

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        """A whole conversation through the target's chat template, ready for the assistant's turn."""
        return encode_messages(self.target.tokenizer, messages)

    def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingConfig,
        *,
        method: str | None = None,
        gamma: str | int | GammaController = defaults.DEFAULT_GAMMA,
        chat: bool = False,
        on_text: Callable[[str], None] | None = None,
        min_confidence: float | None = None,
        logprobs: int | None = None,
        ignore_eos: bool = False,
        tree: str | int = defaults.DEFAULT_TREE,
        tree_min_prob: float | None = None,
        on_piece: Callable[[TextPiece], None] | None = None,
        tree_observe: Callable[[int, int], None] | None = None,
        stop_when: Callable[[str], bool] | None = None,
        max_draft: int | None = None,
    ) -> TextResult:
        """Decode ``prompt``; ``logprobs`` (k >= 0) records each emitted token's log-probability
        under the target's processed law and the k most likely alternatives; ``ignore_eos``
        keeps generating past end-of-sequence tokens.  ``on_text`` receives the text as it is
        decided; ``on_piece`` the same pieces with their tokens and log-probabilities
        (:class:`TextPiece`), the last one carrying whatever tokens are left.  ``tree_observe``: see
        :meth:`decoder`.  ``stop_when``: a test of the text so far that ends generation at the first
        token that makes it true, that token's text kept (:class:`~specdec.text.StopWhen`).  ``max_draft``: see
        :meth:`decoder`.  (The
        prompt's own log-probabilities: :func:`~specdec.session.score_prompt`.)"""
        rule = get_rule(method or default_method(sampling))
        vocab = self.target.model.vocab_size
        ids = self.encode(prompt, chat=chat) if isinstance(prompt, str) else prompt_ids(prompt, vocab)
        if not ids:
            raise ConfigError("the prompt is empty")
        session = None

        def span(text: str, start: int, end: int) -> None:  # the sink's tokens [start, end) with this text
            lps = session.emitted_logprobs[start:end] if session is not None else None
            on_piece(TextPiece(text, sink.stream.tokens[start:end], lps))  # type: ignore[misc, union-attr]

        tokenizer = self.target.tokenizer
        sink = output_sink(tokenizer, sampling, on_text, span if on_piece is not None else None,
                           eos_ids=frozenset() if ignore_eos else self.target.eos_ids)
        stop = first_stop(output_stop(tokenizer, sampling), StopWhen(tokenizer, stop_when, skip_special_tokens=sampling.skip_special_tokens)
                          if stop_when is not None else None)
        decoder = self.decoder(rule, gamma, min_confidence=min_confidence, ignore_eos=ignore_eos, tree=tree,
                               tree_min_prob=tree_min_prob, tree_observe=tree_observe, max_draft=max_draft)
        sampling = floor_stops(sampling, decoder.stop_ids(sampling))  # min_tokens: the session's law and the draft's
        if logprobs is not None:  # the decoder and the session must share the seed
            if sampling.seed is None:
                sampling = replace(sampling, seed=int.from_bytes(os.urandom(6), "little"))
            session = TargetSession(self.target.model, ids, sampling, rule, seed=int(sampling.seed), logprobs=logprobs,
                                    feature_taps=feature_taps(self.drafter))
        result = decoder.generate(ids, sampling, stop=stop, on_tokens=sink.push, verifier=session)
        if session is not None:
            session.close()
        text = sink.finish(result.tokens)
        lps = session.emitted_logprobs[: len(result.tokens)] if session is not None else None
        return TextResult(text=text, token_ids=result.tokens, prompt_ids=ids, result=result, logprobs=lps)

    def generate_batch(
        self,
        prompts: Sequence[str | list[int]],
        sampling: SamplingConfig,
        *,
        batch: int = defaults.BATCH_SEQUENCES,
        method: str | None = None,
        chat: bool = False,
        logprobs: int | None = None,
        ignore_eos: bool = False,
        constraint: Callable[[], object] | None = None,
        on_result: Callable[..., None] | None = None,
    ) -> list[BatchResult]:
        """Many prompts at once, by continuous batching, with plain decoding (the drafter is not
        used: a batched pass is compute-bound on a CPU, see :mod:`specdec.batch`).  Prompt i uses
        seed + i when ``sampling.seed`` is set; each result is what :meth:`generate` gives for that
        prompt alone with that seed.  Returns :class:`specdec.batch.BatchResult` in input order."""
        ids = [self.encode(p, chat=chat) if isinstance(p, str) else p for p in prompts]  # ids: checked by generate_batch
        return generate_batch(self.target, ids, sampling, batch=batch, method=method, logprobs=logprobs,
                              ignore_eos=ignore_eos, constraint=constraint, on_result=on_result)
