"""Engine configuration: how the draft's precision is chosen (it never affects exactness)."""

from __future__ import annotations

import pytest
import torch

import specdec.models.linear as linear
from specdec.engine import EngineConfig, draft_dtype, draft_int8_head
from specdec.errors import ConfigError


@pytest.mark.parametrize(
    ("bf16", "int8", "expect_dtype", "expect_int8"),
    [
        (True, True, torch.bfloat16, True),  # native bf16 (AVX512-BF16 / AMX): bf16 layers, int8 LM head
        (True, False, torch.bfloat16, False),  # bf16 without an int8 engine: the whole draft in bf16
        (False, True, torch.float32, True),  # e.g. AVX2: float32 layers, int8 LM head
        (False, False, torch.float32, False),  # neither: plain float32
    ],
)
def test_auto_draft_precision_follows_the_cpu(monkeypatch, bf16, int8, expect_dtype, expect_int8):
    monkeypatch.setattr(linear, "bf16_fast", lambda: bf16)
    monkeypatch.setattr(linear, "int8_available", lambda: int8)
    cfg = EngineConfig()
    assert draft_dtype(cfg) == expect_dtype and draft_int8_head(cfg) is expect_int8


def test_explicit_draft_precision(monkeypatch):
    monkeypatch.setattr(linear, "int8_available", lambda: True)
    assert draft_dtype(EngineConfig(draft_dtype="int8")) == torch.float32
    assert draft_int8_head(EngineConfig(draft_dtype="int8"))
    assert not draft_int8_head(EngineConfig(draft_dtype="float32"))
    assert not draft_int8_head(EngineConfig(draft_dtype="int8", backend="hf"))  # native backend only
    with pytest.raises(ConfigError, match="draft dtype"):
        draft_dtype(EngineConfig(draft_dtype="int4"))
