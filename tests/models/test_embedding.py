"""The embedding table as int8 blocks (``specdec.models.embedding``): kept only where it returns
the float32 table bit for bit, and a saved quantised model that holds it so is the same model."""

from __future__ import annotations

import pytest
import torch

from specdec.models.embedding import BlockTable, exact_blocks
from tiny import make_tiny


def q8_table(v: int, d: int, seed: int = 0) -> torch.Tensor:  # [v, d] float32
    """A table as a GGUF's Q8_0 embedding dequantises: int8 values, each block of 32 with one float16
    scale and its largest magnitude 127 (as the Q8_0 quantiser writes it), multiplied in float32."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (v, d // 32, 32), generator=g).to(torch.int8)
    q[..., 3] = torch.where(torch.rand(v, d // 32, generator=g) < 0.5, -127, 127).to(torch.int8)
    scale = (torch.rand(v, d // 32, 1, generator=g) * 0.02 + 1e-4).half().float()
    return (q.float() * scale).view(v, d)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def test_a_q8_table_comes_back_bit_for_bit():
    table = q8_table(5000, 96)  # more rows than one comparison chunk
    blocks = exact_blocks(table)
    assert isinstance(blocks, BlockTable) and blocks.shape == table.shape and blocks.dtype == torch.float32
    assert blocks.nbytes == 5000 * 96 + 5000 * 3 * 4  # a quarter of the float table, and the scales
    ids = torch.tensor([0, 4999, 17, 17, 2500])
    assert torch.equal(_bits(blocks.index_select(0, ids)), _bits(table.index_select(0, ids)))
    grid = torch.tensor([[1, 2], [3, 4999]])
    assert torch.equal(_bits(blocks[grid]), _bits(table[grid])) and blocks[grid].shape == (2, 2, 96)
    assert torch.equal(_bits(blocks.float()), _bits(table))
    with pytest.raises(ValueError):
        blocks.index_select(1, ids)


def test_any_other_table_stays_float():
    """A float model's table, one value off by one unit in the last place, a negative zero (an int8
    zero comes back positive), a half-precision table, a width that is no multiple of 32."""
    assert exact_blocks(torch.randn(300, 64)) is None
    table = q8_table(300, 64)
    off = table.clone()
    off[200, 5] = torch.nextafter(off[200, 5], torch.tensor(1.0))
    assert exact_blocks(off) is None
    zero = table.clone()
    zero[7, :32] = 0.0
    zero[7, 3] = -0.0
    assert exact_blocks(zero) is None
    zero[7, 3] = 0.0
    assert exact_blocks(zero) is not None  # a block of positive zeros is fine (scale 0)
    assert exact_blocks(table.half()) is None and exact_blocks(q8_table(10, 64)[:, :48]) is None


@pytest.fixture
def q8_folder(tmp_path):
    """A tiny model whose (tied) embedding is a Q8_0 table, as the registry's converted GGUFs are."""
    from safetensors.torch import load_file, save_file

    folder = make_tiny(tmp_path / "tiny", hidden=64)
    path = next(folder.glob("*.safetensors"))
    weights = load_file(str(path))
    weights["model.embed_tokens.weight"] = q8_table(*weights["model.embed_tokens.weight"].shape, seed=3)
    weights.pop("lm_head.weight", None)  # tied
    save_file(weights, str(path), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_a_saved_model_keeps_the_blocks_and_is_the_same_model(q8_folder, tmp_path, monkeypatch, quant):
    """The first load (the cache on) holds the table as blocks and saves them; the second reads them
    and not the float table; both score a prefill and a 4-row pass bit for bit as a load with the
    cache off, whose table stays the float one."""
    from specdec.models import linear, native

    if not (linear.w8a8_available() and linear.vnni_available() and linear.q4_kernel_available()):
        pytest.skip("needs fbgemm's int8 engine and the few-row int8 and 4-bit kernels")
    monkeypatch.setenv("SPECDEC_QUANTISED_CACHE", str(tmp_path / "quantised"))
    read: list[str] = []
    real = native._read_tensor
    monkeypatch.setattr(native, "_read_tensor", lambda files, name: (read.append(name), real(files, name))[1])

    def load():
        return native.NativeCausalLM.from_folder(q8_folder, quant=quant, int8_kernel="fbgemm", batch_invariant=True)

    first, second = load(), load()
    assert isinstance(first.embed, BlockTable) and isinstance(second.embed, BlockTable)
    assert "model.embed_tokens.weight" not in read  # the second start read the blocks instead
    monkeypatch.setenv("SPECDEC_QUANTISED_CACHE", "off")
    plain = load()
    assert isinstance(plain.embed, torch.Tensor)
    prompt, step = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(1)), torch.tensor([5, 900, 3, 77])
    outs = []
    for model in (first, second, plain):
        cache = model.new_cache(64)
        outs.append((model.forward(prompt, cache), model.forward(step, cache)))
    for a, b in outs[:2]:
        assert torch.equal(a, outs[2][0]) and torch.equal(b, outs[2][1])
