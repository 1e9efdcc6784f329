"""EAGLE-3 heads in the format vLLM / SGLang users share them in (placeholder, filled below)."""

from __future__ import annotations


def is_eagle3_checkpoint(raw: dict) -> bool:
    """A ``config.json`` of an EAGLE-3 head in the speculators or SpecForge/EAGLE format."""
    if raw.get("speculators_model_type") == "eagle3":
        return True
    archs = [str(a) for a in raw.get("architectures") or []]
    return any("eagle3" in a.lower() for a in archs)
