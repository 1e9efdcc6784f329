"""Drafter families.  ``specdec.factory`` maps names to them; the engine never switches on strings."""

from specdec.drafters.base import Draft, Drafter, DraftSampler
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter

__all__ = ["Draft", "Drafter", "DraftSampler", "ModelDrafter", "NgramDrafter"]
