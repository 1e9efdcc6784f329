"""What ships with specdec besides code, readable without torch: the data folders of the
self-speculative drafters, the draft heads' registry names, draft calibration files, and the rows
``specdec models`` prints for them.

``specdec models`` is a question about files on disk; importing torch to answer it cost ~2 s of its
~2.5 s.  The drafters' own modules (``drafters/self_spec.py``, ``drafters/kangaroo.py``,
``drafters/heads.py``) import what they need from here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from specdec import defaults
from specdec.errors import ConfigError

DATA_DIR = Path(__file__).resolve().parent / "data"
#: searched skip sets (``self-skip`` / ``swift``), one ``TARGET.json`` per target
SKIP_SETS_DIR = DATA_DIR / "self_skip"
#: trained Kangaroo adapters, one ``TARGET.safetensors`` per target
ADAPTERS_DIR = DATA_DIR / "kangaroo"
#: a draft folder's temperature calibration (``specdec train calibrate``)
CALIBRATION_FILE = "draft_calibration.json"
#: the draft head kinds specdec trains and runs
HEAD_KINDS = ("eagle1", "eagle3", "medusa", "mtp")
#: ``--draft`` values that draft without any model's distribution
MODEL_FREE_DRAFTS = ("none", "ngram", "lookahead")
#: ``--draft`` values that name a drafter with no model of its own to load
NON_MODEL_DRAFTS = (*MODEL_FREE_DRAFTS, "self")
#: registry names of the heads for SmolLM2-135M (folders under the package data dir when shipped)
HEADS: dict[str, str] = {
    "smollm2-135m-eagle3": "EAGLE-3 head for SmolLM2-135M (fused low/mid/high-layer features, reduced draft vocabulary)",
    "smollm2-135m-eagle1": "EAGLE-1 head for SmolLM2-135M (feature + next token, one decoder layer, the target's head rows)",
    "smollm2-135m-medusa": "Medusa-1 heads for SmolLM2-135M (residual blocks on the last hidden state)",
    "smollm2-135m-mtp": "MTP modules for SmolLM2-135M (DeepSeek-V3 style sequential modules)",
}


def check_temperature_factor(factor: float) -> float:
    """A draft temperature factor, checked: finite and within (0, 100]."""
    f = float(factor)
    if not math.isfinite(f) or not 0.0 < f <= defaults.MAX_DRAFT_TEMPERATURE_FACTOR:
        raise ConfigError(f"the draft temperature factor must be in (0, {defaults.MAX_DRAFT_TEMPERATURE_FACTOR:g}], got {factor}")
    return f


def calibrated_factor(folder: Path | None) -> float | None:
    """The temperature factor ``folder``'s calibration file names, or None where it has none."""
    path = folder / CALIBRATION_FILE if folder is not None else None
    if path is None or not path.is_file():
        return None
    try:
        return check_temperature_factor(json.loads(path.read_text())["temperature_factor"])
    except (ValueError, KeyError, TypeError, ConfigError) as exc:
        raise ConfigError(f"{path}: not a draft calibration ({type(exc).__name__}: {exc})".splitlines()[0]) from None


def parse_self_spec(name: str) -> tuple[str, str] | None:
    """``layerskip:K`` / ``self-skip[:PATH]`` / ``swift[:PATH]`` / ``kangaroo[:PATH]`` -> (family, argument), else None."""
    text = name.strip()
    family, _, arg = text.partition(":")
    family = family.lower()
    if family in ("layerskip", "self-skip", "swift", "kangaroo"):
        return family, arg.strip()
    return None


def skip_set_targets() -> list[str]:
    """Targets with a shipped skip set."""
    return sorted(p.stem for p in SKIP_SETS_DIR.glob("*.json")) if SKIP_SETS_DIR.is_dir() else []


def adapter_targets() -> list[str]:
    """Targets with a shipped Kangaroo adapter."""
    return sorted(p.name.removesuffix(".safetensors") for p in ADAPTERS_DIR.glob("*.safetensors")) if ADAPTERS_DIR.is_dir() else []


def check_shipped(name: str, target_name: str) -> None:
    """Fail where the self-speculative drafter ``name`` takes a file that ships per target and none
    ships for ``target_name``: ``self-skip`` a searched skip set, ``kangaroo`` an adapter (``swift``
    starts from an empty set instead; ``NAME:FILE`` brings its own).  Readable from the names alone,
    so a registry target is checked before it loads."""
    parsed = parse_self_spec(name)
    if parsed is None or parsed[1]:
        return
    family = parsed[0]
    if family == "self-skip" and target_name not in skip_set_targets():
        raise ConfigError(
            f"no searched skip set ships for {target_name!r} (shipped: {', '.join(skip_set_targets()) or 'none'}); "
            f"run `specdec train skip --target {target_name} --out skip.json` and use --draft self-skip:skip.json"
        )
    if family == "kangaroo" and target_name not in adapter_targets():
        raise ConfigError(
            f"no kangaroo adapter ships for {target_name!r} (shipped: {', '.join(adapter_targets()) or 'none'}); "
            f"run `specdec train kangaroo --target {target_name} --out kangaroo.safetensors` and use "
            "--draft kangaroo:kangaroo.safetensors"
        )


def is_eagle3_checkpoint(raw: dict) -> bool:
    """A ``config.json`` of an EAGLE-3 head in the speculators or EAGLE / SpecForge format."""
    if raw.get("speculators_model_type") == "eagle3":
        return True
    archs = [str(a) for a in raw.get("architectures") or []]
    return any("eagle3" in a.lower() for a in archs)


def is_head_folder(path: Path) -> bool:
    """A folder holding a draft head: ours (``config.json`` with a head ``kind``) or an EAGLE-3
    checkpoint in the format vLLM / SGLang users share (see :mod:`specdec.heads.formats`)."""
    cfg = path / "config.json"
    if not (path.is_dir() and cfg.is_file()):
        return False
    try:
        raw = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and (raw.get("kind") in HEAD_KINDS or is_eagle3_checkpoint(raw))


def describe_families() -> list[dict[str, Any]]:
    """``specdec models`` rows for the self-speculative drafters (``--draft NAME``)."""
    shipped = ", ".join(skip_set_targets()) or "none"
    kangaroo_shipped = ", ".join(adapter_targets()) or "none"
    none = "none: a view of the target (native backend), no weights of its own"
    # every view drafts through the target's LM head cut to a reduced vocabulary where one ships
    head = ("; with --draft-vocab auto, a copy of the LM head's rows for the reduced vocabulary where one ships "
            "(Qwen2.5-Coder-1.5B 44 MB, SmolLM2-135M 10 MB)")
    return [
        {"name": "layerskip:K", "description": "early exit: the target's first K layers + its final norm and LM head; the "
         "verification pass reuses the draft's keys/values of layers < K, and the draft copies the target's for "
         "committed tokens instead of recomputing them. Extra memory: a K-layer KV cache" + head,
         "default_draft": None, "install": none, "license": "", "status": "bundled"},
        {"name": "self-skip", "description": "Draft & Verify: the target with a searched set of attention / MLP sub-layers "
         f"skipped (shipped for: {shipped}; self-skip:FILE from `specdec train skip`). Extra memory: a KV cache of the "
         "layers whose attention runs" + head, "default_draft": None, "install": none, "license": "", "status": "bundled"},
        {"name": "swift", "description": "SWIFT: a skip set adapted while generating (starts from the shipped set, or "
         f"swift:FILE; its scorings of candidate sets take at most {defaults.SWIFT_SCORING_BUDGET:.0%} of the decoding "
         "time, so it adapts over long replies). Extra memory: as self-skip", "default_draft": None, "install": none, "license": "", "status": "bundled"},
        {"name": "kangaroo", "description": "Kangaroo: the target's first K layers + a small trained adapter (one "
         "attention block) + its LM head, drafting stopped when its confidence drops; the verification pass reuses the "
         f"K layers' keys/values (adapter shipped for: {kangaroo_shipped}; kangaroo:FILE from `specdec train kangaroo`). "
         "Extra memory: the adapter's weights and a (K+1)-layer KV cache" + head, "default_draft": None,
         "install": "none: a view of the target (native backend) plus an adapter file", "license": "", "status": "bundled"},
        *({"name": name, "description": text, "default_draft": None, "install": "none: no weights", "license": "",
           "status": "bundled"} for name, text in MODEL_FREE_ROWS),
    ]


#: ``specdec models`` rows of the drafters that need no model at all
MODEL_FREE_ROWS = (
    ("ngram", "prompt lookup: continuations of the text's own earlier n-grams (the prompt and what was generated);"
              " free where the text repeats itself, as code does; NAME+lookup puts it in front of a draft model"),
    ("lookahead", "Lookahead decoding: a Jacobi window of the target's own parallel guesses feeding an n-gram pool,"
                  " verified as a tree in the same pass (best with --tree N)"),
    ("none", "plain decoding: the target alone, one token a pass"),
)


def describe_heads(folder: Path = DATA_DIR) -> list[dict[str, Any]]:
    """``specdec models`` rows for the registry's heads (shipped ones are folders under ``folder``)."""
    rows = []
    for name, text in HEADS.items():
        kind = name.rsplit("-", 1)[-1]
        train = "eagle" if kind.startswith("eagle") else kind
        variant = f" --variant {kind}" if kind == "eagle1" else ""
        rows.append({"name": name, "description": text + " — reads the target's hidden states (native backend, local)",
                     "default_draft": None, "license": "Apache-2.0",
                     "install": "not shipped (none trained so far beat the small draft); train your own: specdec train data"
                                f" --out data && specdec train {train} --data data --out HEAD{variant}, then --draft HEAD",
                     "status": "bundled" if is_head_folder(folder / name) else "missing"})
    return rows
