"""specdec: lossless speculative decoding for causal language models.

    from specdec import Engine, EngineConfig, SamplingConfig

    engine = Engine.build(EngineConfig())  # the default target and drafter
    out = engine.generate("def add(a, b):", SamplingConfig(temperature=0.0, max_new_tokens=64))

The names below are imported on first use, so ``import specdec`` stays cheap (no torch).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    "Engine": "specdec.engine",
    "EngineConfig": "specdec.engine",
    "SamplingConfig": "specdec.sampling",
    "SpecdecError": "specdec.errors",
}
__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
