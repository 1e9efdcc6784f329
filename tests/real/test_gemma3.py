"""Gemma-3-270M's real weights on the fused layer call (where its GGUF chunks are installed: the
README's test command does not install them, so CI skips this file's test).

The fused C++ call runs Gemma 3's layer (output norms, tanh-GELU, the sliding layers' own rotary
table) and windows the rows past its 512-token sliding window itself; the Python layer loop is the
reference it must equal bit for bit.  Here on the int8 model ``--dtype auto`` loads: decoding
steps, a chain pass and a token tree below the window, then steps across it and a tree past it.
"""

from __future__ import annotations

import pytest
import torch

from specdec.models import registry
from tiny import assert_tokenizers_agree, on_python_loop

NAME = "gemma-3-270m"


def _installed() -> bool:
    try:
        registry.resolve(NAME, convert=False)
    except Exception:  # noqa: BLE001 - the Gemma chunks are optional
        return False
    return True


@pytest.mark.skipif(not _installed(), reason=f"{NAME} is not installed")
def test_the_fused_call_is_bitwise_the_python_loop_on_the_real_weights():
    from specdec.engine import EngineConfig, target_dtype

    dtype, quant = target_dtype(EngineConfig(target=NAME))
    model = registry.load(NAME, dtype=dtype, quant=quant).model
    if model.scripted is None or model.scripted.fused is None:
        pytest.skip("the fused layer call is not available here")
    window = model.cfg.sliding_window
    assert window == 512 and model.layers[0].window == window and model.cfg.gemma
    ids = torch.randint(0, model.vocab_size, (window + 40,), generator=torch.Generator().manual_seed(0))
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, -1, 6, 3])

    def run() -> list[torch.Tensor]:
        cache = model.new_cache(window + 64)
        out = [model.forward(ids[:40], cache, last_only=True)]
        out += [model.forward(ids[i : i + 1], cache) for i in range(40, 52)]  # steps
        out.append(model.forward(ids[52:58], cache))  # a chain pass
        base = cache.length
        out.append(model.forward_tree(ids[58:67], parents, cache))  # a tree below the window
        cache.truncate(base)
        out.append(model.forward(ids[58 : window - 6], cache, last_only=True))  # (a prefill: the Python loop either way)
        out += [model.forward(ids[i : i + 1], cache) for i in range(window - 6, window + 6)]  # steps across the window
        out.append(model.forward_tree(ids[window + 6 : window + 15], parents, cache))  # a tree past it
        return out + [cache.k[:, :, : cache.length].clone(), cache.v[:, :, : cache.length].clone()]

    fused, reference = run(), on_python_loop(model, run)
    assert len(fused) == len(reference)
    for i, (a, b) in enumerate(zip(fused, reference)):
        assert torch.equal(a, b), i


@pytest.mark.skipif(not _installed(), reason=f"{NAME} is not installed")
def test_the_installed_tokenizer_loads_without_transformers_and_equals_it():
    """The installed folder's 262,144-token tokenizer loads as specdec's FastTokenizer (the
    ``tokenizers`` file alone: ~1.2 s against ~5 s through transformers' GemmaTokenizer) and
    encodes, decodes and counts as transformers' does."""
    from transformers import AutoTokenizer

    from specdec.tokenizer import FastTokenizer

    folder = registry.resolve(NAME, convert=False).folder
    tok = registry.load_tokenizer(folder)
    ref = AutoTokenizer.from_pretrained(str(folder))
    assert isinstance(tok, FastTokenizer) and type(ref).__name__ == "GemmaTokenizer"
    assert_tokenizers_agree(tok, ref, ("Hello world", "  two  spaces\n\n\ttab\r\n", "東京 café naïve 🦙 ½ \u2581",
                                       "<bos>x<eos> <mask>", "def f(x):\n    return x ** 2  # code", "", " "))
