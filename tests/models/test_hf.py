"""The Hugging Face backend's token trees: a custom attention mask per pass, a cache kept on one path."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.models.hf import HFCausalLM, full_attention
from specdec.tree import paths
from tiny import make_tiny

#: a tree of 7 nodes two levels deep under the last cached token: two roots, branches of 2 and 1
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2, 4])


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def hf(request, tmp_path_factory):
    return HFCausalLM.from_folder(str(make_tiny(tmp_path_factory.mktemp(request.param), model_type=request.param)))


def _alone(hf: HFCausalLM, ids: torch.Tensor) -> torch.Tensor:  # -> [V] the last row of ``ids`` scored afresh
    return hf.forward(ids, hf.new_cache())[-1]


def test_each_tree_node_is_scored_as_its_own_path(hf):
    """A tree grown over two passes (the second names the region's start, as a drafter expanding its
    frontier does): each node's row is its path after the prompt scored token by token (up to float
    rounding: transformers' passes are not batch-invariant); then the cache kept on one path
    continues as if only that path had been fed."""
    g = torch.Generator().manual_seed(0)
    prompt, tokens = torch.randint(0, 49152, (7,), generator=g), torch.randint(0, 49152, (7,), generator=g)
    cache = hf.new_cache()
    hf.forward(prompt, cache)
    rows = torch.cat([hf.forward_tree(tokens[:3], PARENTS[:3], cache),
                      hf.forward_tree(tokens[3:], PARENTS, cache, prefix=7)])  # [7, V]
    assert cache.length == 14
    for i, path in enumerate(paths(PARENTS)):
        assert torch.allclose(rows[i], _alone(hf, torch.cat([prompt, tokens[path]])), atol=1e-4), i
    kept = paths(PARENTS)[6]  # nodes 1, 4, 6
    cache.compact(torch.tensor(kept) + 7, 7)
    assert cache.length == 10
    nxt = torch.tensor([5])
    assert torch.allclose(hf.forward(nxt, cache)[-1], _alone(hf, torch.cat([prompt, tokens[kept], nxt])), atol=1e-4)
    with pytest.raises(ValueError, match="parents"):
        hf.forward_tree(tokens[:2], PARENTS[:3], cache)


def test_models_with_sliding_window_layers_have_no_tree_pass():
    """One mask serves every layer of a pass, so a model with sliding-window layers (Gemma 3, a
    windowed Qwen2 or Mistral) gets no ``forward_tree``: drafters and sessions keep to chains, and a
    tree asked of it is a clear error."""
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen2ForCausalLM

    from specdec.drafters.base import Draft
    from specdec.errors import ConfigError
    from specdec.sampling import SamplingConfig
    from specdec.session import TargetSession
    from specdec.verify import get_rule

    assert full_attention(LlamaConfig()) and full_attention(MistralConfig(sliding_window=None))
    assert not full_attention(MistralConfig(sliding_window=4096)) and not full_attention(Gemma3TextConfig())
    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    assert full_attention(Qwen2Config(**tiny)) and hasattr(HFCausalLM(Qwen2ForCausalLM(Qwen2Config(**tiny))), "forward_tree")
    windowed = HFCausalLM(Qwen2ForCausalLM(Qwen2Config(**tiny, use_sliding_window=True, sliding_window=8, max_window_layers=0)))
    assert not hasattr(windowed, "forward_tree")
    session = TargetSession(windowed, [1, 2], SamplingConfig(temperature=0.0), get_rule("greedy"), seed=0)
    with pytest.raises(ConfigError, match="sliding-window"):
        session.verify(Draft(tokens=torch.tensor([1, 2]), probs=None, parents=torch.tensor([-1, -1])))


def test_greedy_trees_on_the_hf_backend_equal_plain_decoding(tmp_path, capsys):
    """Through the command line on the hf backend (a tiny target, a second tiny model as draft):
    fixed and auto trees give plain greedy decoding's tokens, and trees were played."""
    from specdec.cli import main

    target = make_tiny(tmp_path / "target", layers=2, hidden=64)
    draft = make_tiny(tmp_path / "draft", layers=1, hidden=64, seed=1)
    base = ["generate", "-p", "def add(a, b):", "--target", str(target), "--backend", "hf", "-n", "32", "--json", "-t", "0"]
    outs, rounds = [], []
    for extra in (["--draft", "none"], ["--draft", str(draft), "--tree", "4"], ["--draft", str(draft), "--tree", "8"], ["--draft", "ngram", "--tree", "auto"]):
        assert main(base + extra) == 0
        out = json.loads(capsys.readouterr().out)
        outs.append(out["token_ids"])
        rounds.append(out["stats"].get("tree_rounds", 0))
    assert all(out == outs[0] for out in outs[1:]) and len(outs[0]) == 32
    assert rounds[1] > 0 and rounds[2] > 0
