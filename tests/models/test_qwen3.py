"""Qwen3's layout on the native backend: its per-head query and key norms, in float, int8 and 4-bit
targets, exactly as batch-invariant as the other layouts (a block, a tree, a batch = token by token),
and decoding through the engine (the float match with transformers is in test_native.py)."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.models.linear import w8a8_available
from specdec.models.native import NativeCausalLM
from specdec.tree import paths
from tiny import make_tiny

QUANTS = [None, pytest.param("int8", marks=pytest.mark.skipif(not w8a8_available(), reason="no int8 kernel")),
          pytest.param("q4", marks=pytest.mark.skipif(not w8a8_available(), reason="no int8 kernel for the head"))]
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 3])  # a small token tree


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("qwen3"), model_type="qwen3", hidden=64)


def test_the_layout_is_read_and_its_norms_are_per_layer(folder):
    model = NativeCausalLM.from_folder(folder)
    assert model.cfg.model_type == "qwen3" and model.cfg.qk_norm
    assert all(layer.q_norm is not None and layer.k_norm is not None for layer in model.layers)
    from specdec.models.scripted import compiled_layers

    if compiled_layers() is not None:  # the compiled loop has the norms too (bitwise: test_quantized, test_fused_layers)
        assert model.scripted is not None and sorted(model.scripted.head_norms) == list(range(len(model.layers)))
    assert not NativeCausalLM.from_folder(make_tiny(folder.parent / "llama", hidden=64)).cfg.qk_norm


@pytest.mark.parametrize("quant", QUANTS)
def test_blocks_trees_and_batches_are_scored_as_token_by_token(folder, quant):
    """With batch invariance a verification block, each node of a token tree and each sequence of
    a batched pass are bitwise what scoring token by token gives; quantised, close to float."""
    model = NativeCausalLM.from_folder(folder, quant=quant, batch_invariant=True)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 1000, (25,), generator=g)
    a = model.new_cache(64)
    model.forward(ids[:17], a)
    block = model.forward(ids[17:], a)
    b = model.new_cache(64)
    model.forward(ids[:17], b)
    steps = torch.cat([model.forward(ids[i:i + 1], b) for i in range(17, 25)])
    assert torch.equal(block, steps)
    toks = torch.randint(0, 1000, (PARENTS.numel(),), generator=g)
    cache = model.new_cache(64)
    model.forward(ids[:10], cache)
    tree = model.forward_tree(toks, PARENTS, cache)
    for j, path in enumerate(paths(PARENTS)):
        ref = model.new_cache(64)
        model.forward(ids[:10], ref)
        assert torch.equal(tree[j], torch.cat([model.forward(toks[i:i + 1], ref) for i in path])[-1]), j
    caches = [model.new_cache(64) for _ in range(2)]
    model.forward(ids[:12], caches[0])
    model.forward(ids[:5], caches[1])
    batched = model.forward_batch([(ids[12:15], caches[0], False), (ids[5:6], caches[1], False)])
    solo = [model.new_cache(64) for _ in range(2)]
    model.forward(ids[:12], solo[0])
    model.forward(ids[:5], solo[1])
    assert torch.equal(batched[0], model.forward(ids[12:15], solo[0])) and torch.equal(batched[1], model.forward(ids[5:6], solo[1]))
    if quant is not None:
        f = NativeCausalLM.from_folder(folder, batch_invariant=True)
        p = torch.softmax(model.forward(ids, model.new_cache(64)), -1)
        r = torch.softmax(f.forward(ids, f.new_cache(64)), -1)
        assert (p - r).abs().sum(-1).max() < 0.3  # total variation per position


@pytest.mark.parametrize("quant", ["int8", "q4"])
def test_a_saved_quantised_qwen3_reads_its_head_norms_from_the_weights(folder, monkeypatch, tmp_path, quant):
    """A saved quantised model holds the linear layers; a Qwen3 one is read back with its head norms
    from the safetensors (next to the embedding), and scores bit for bit as the model built from
    the weights (whose compiled loops have the norms too)."""
    from specdec.models import quantised_cache

    if not w8a8_available():
        pytest.skip("no int8 kernel")
    monkeypatch.setattr(quantised_cache, "cache_dir", lambda: tmp_path)
    read: list[bool] = []  # per start: whether it read a saved model
    load = quantised_cache.load

    def spied(*args):  # noqa: ANN002, ANN202
        state = load(*args)
        read.append(state is not None)
        return state

    monkeypatch.setattr(quantised_cache, "load", spied)
    built = NativeCausalLM.from_folder(folder, quant=quant)
    assert any(p.is_file() for p in tmp_path.rglob("*"))  # saved
    saved = NativeCausalLM.from_folder(folder, quant=quant)
    assert all(layer.q_norm is not None for layer in saved.layers) and read == [False, True]
    assert all(torch.equal(a.q_norm, b.q_norm) and torch.equal(a.k_norm, b.k_norm) for a, b in zip(built.layers, saved.layers))
    ids = torch.arange(9)
    assert torch.equal(built.forward(ids, built.new_cache(16)), saved.forward(ids, saved.new_cache(16)))


def test_speculative_greedy_decoding_equals_plain_on_qwen3(folder, tmp_path, capsys):
    """Through the command line (the target as the CLI loads a folder, a second tiny Qwen3 as draft,
    chains, trees and a self-speculative view): greedy speculative tokens = plain greedy tokens."""
    from specdec.cli import main

    draft = make_tiny(tmp_path / "draft", model_type="qwen3", hidden=64, layers=1, seed=1)
    base = ["generate", "-p", "def add(a, b):", "--target", str(folder), "-n", "24", "--json", "-t", "0"]
    outs = []
    for extra in (["--draft", "none"], ["--draft", str(draft)], ["--draft", str(draft), "--tree", "4"], ["--draft", "layerskip:1"]):
        assert main(base + extra) == 0
        outs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert all(out == outs[0] for out in outs[1:]) and len(outs[0]) == 24
