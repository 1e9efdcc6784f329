"""The Hugging Face backend's token trees: custom attention masks per pass (one per layer kind
where some layers are windowed), a cache kept on one path."""

from __future__ import annotations

import json

import pytest
import torch

from specdec.models.hf import HFCausalLM, sliding_window, tree_attention
from specdec.tree import paths
from tiny import make_tiny

#: a tree of 7 nodes two levels deep under the last cached token: two roots, branches of 2 and 1
PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2, 4])


#: (model type, sliding window): a window of 4 is shorter than the 7-token prompt plus a tree's depth,
#: so windowed layers must drop keys the full ones keep
MODELS = [("llama", None), ("qwen2", None), ("qwen3", None), ("gemma3", 4), ("qwen2", 4), ("mistral", 4)]


@pytest.fixture(scope="module", params=MODELS, ids=[f"{kind}-w{window}" if window else kind for kind, window in MODELS])
def hf(request, tmp_path_factory):
    kind, window = request.param
    return HFCausalLM.from_folder(str(make_tiny(tmp_path_factory.mktemp(kind), model_type=kind, window=window)))


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


def test_a_windowed_cache_rolls_back_past_its_window(hf):
    """Rejected drafts are cut from the cache whatever its length: past a sliding window too
    (transformers' own windowed cache layer cannot be cut once full), and what follows is scored as
    if only the kept tokens had been fed."""
    ids = torch.randint(0, 49152, (12,), generator=torch.Generator().manual_seed(1))
    cache = hf.new_cache()
    hf.forward(ids, cache)
    cache.truncate(9)
    assert torch.allclose(hf.forward(ids[9:10], cache)[-1], _alone(hf, ids[:10]), atol=1e-4)


def test_which_models_get_a_tree_pass():
    """Full and sliding-window layers get tree masks; a model with other layer kinds (chunked or
    linear attention) gets no ``forward_tree``: drafters and sessions keep to chains, and a tree
    asked of it is a clear error."""
    from types import SimpleNamespace

    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    from specdec.drafters.base import Draft
    from specdec.errors import ConfigError
    from specdec.sampling import SamplingConfig
    from specdec.session import TargetSession
    from specdec.verify import get_rule

    assert sliding_window(LlamaConfig()) is None and sliding_window(MistralConfig(sliding_window=None)) is None
    assert sliding_window(MistralConfig(sliding_window=4096)) == 4096 and sliding_window(Gemma3TextConfig(sliding_window=512)) == 512
    assert sliding_window(Qwen2Config(sliding_window=4096)) is None  # Qwen2 windows no layer unless asked
    assert all(tree_attention(c) for c in (LlamaConfig(), MistralConfig(sliding_window=4096), Gemma3TextConfig()))
    assert not tree_attention(SimpleNamespace(layer_types=["sliding_attention", "chunked_attention"]))
    tiny = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    from transformers import Qwen2ForCausalLM

    model = HFCausalLM(Qwen2ForCausalLM(Qwen2Config(**tiny)))
    del model.forward_tree  # as for a model with chunked attention
    session = TargetSession(model, [1, 2], SamplingConfig(temperature=0.0), get_rule("greedy"), seed=0)
    with pytest.raises(ConfigError, match="tree attention"):
        session.verify(Draft(tokens=torch.tensor([1, 2]), probs=None, parents=torch.tensor([-1, -1])))


@pytest.mark.parametrize("kind, window", [("llama", None), ("gemma3", 4)], ids=["llama", "gemma3-w4"])
def test_greedy_trees_on_the_hf_backend_equal_plain_decoding(tmp_path, capsys, kind, window):
    """Through the command line on the hf backend (a tiny target, a second tiny model as draft):
    fixed and auto trees give plain greedy decoding's tokens, and trees were played; on a target
    with sliding-window layers too, whose 4-token window the 32 tokens pass (windowed masks, and
    rejected drafts cut past the window)."""
    from specdec.cli import main

    target = make_tiny(tmp_path / "target", model_type=kind, layers=2, hidden=64, window=window)
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


def test_features_match_the_native_backend(tmp_path):
    """``forward_features`` on the hf backend hands out what the native backend's does for the same
    weights (float rounding apart; every norm's weight random): the embeddings (tap 0), each layer's
    residual (tap 2 is the last layer's, read through a hook on the final norm) and the final hidden
    state over its RMS without the norm's weight, for a chain pass and a tree pass; and the pass's
    logits are the plain pass's."""
    from specdec.models.native import NativeCausalLM

    folder = make_tiny(tmp_path / "llama", layers=2, hidden=32, norms=True)
    ours, theirs = NativeCausalLM.from_folder(str(folder)), HFCausalLM.from_folder(str(folder))
    assert theirs.n_layers == 2 and torch.equal(theirs.embed, ours.embed)
    ids = torch.randint(0, 49152, (7,), generator=torch.Generator().manual_seed(2))
    tree = torch.randint(0, 49152, (PARENTS.numel(),), generator=torch.Generator().manual_seed(3))
    taps = (0, 1, 2)
    a, b = ours.new_cache(), theirs.new_cache()
    for kw in ({"tokens": ids}, {"tokens": tree, "parents": PARENTS}):
        (la, fa), (lb, fb) = ours.forward_features(cache=a, taps=taps, **kw), theirs.forward_features(cache=b, taps=taps, **kw)
        assert fb.shape == (kw["tokens"].numel(), len(taps) + 1, 32)
        assert torch.allclose(fa, fb, atol=1e-4) and torch.allclose(la, lb, atol=1e-4)
    assert not torch.allclose(fb[:, 2], fb[:, 3], atol=1e-2)  # the last layer's residual is not the normed state
    plain = theirs.new_cache()
    last, feats = theirs.forward_features(ids, plain, (1,), last_only=True)
    assert last.shape == (1, 49152) and feats.shape == (7, 2, 32)
    assert torch.allclose(last[0], _alone(theirs, ids), atol=1e-5)
    with pytest.raises(ValueError, match="outside"):
        theirs.forward_features(ids[:1], plain, (3,))


def test_features_of_a_gemma3_start_from_its_scaled_embeddings(tmp_path):
    """Gemma scales its embeddings by sqrt(D) inside the embedding module: ``embed`` (what a head
    reads) and tap 0 are the scaled rows the first layer receives."""
    gemma = HFCausalLM.from_folder(str(make_tiny(tmp_path / "gemma3", model_type="gemma3", window=4)))
    ids = torch.tensor([5, 9, 11])
    rows = gemma.embed[ids]
    assert torch.allclose(rows, gemma.model.get_input_embeddings()(ids), atol=1e-6)
    assert not torch.allclose(rows, gemma.model.get_input_embeddings().weight[ids], atol=1e-3)
    _, feats = gemma.forward_features(ids, gemma.new_cache(), (0, 2))
    assert torch.allclose(feats[:, 0], rows, atol=1e-6)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """One small llama for the bookkeeping tests below (no window, so one layer kind)."""
    return HFCausalLM.from_folder(str(make_tiny(tmp_path_factory.mktemp("llama"), layers=2, hidden=32)))


def test_a_block_after_a_cached_prefix_is_scored_causally(llama):
    """A chain verification pass: k tokens after the cached prompt, each row its own prefix scored
    afresh (no row sees a later token of the block)."""
    ids = torch.randint(0, 49152, (9,), generator=torch.Generator().manual_seed(4))
    cache = llama.new_cache()
    llama.forward(ids[:5], cache)
    rows = llama.forward(ids[5:], cache)
    assert rows.shape == (4, llama.vocab_size) and cache.length == 9
    for j in range(4):
        assert torch.allclose(rows[j], _alone(llama, ids[: 6 + j]), atol=1e-4), j


def test_last_only_returns_one_row(llama):
    ids = torch.tensor([5, 6, 7, 8])
    out = llama.forward(ids, llama.new_cache(), last_only=True)
    assert out.shape == (1, llama.vocab_size)
    assert torch.allclose(out[0], _alone(llama, ids), atol=1e-5)


def test_truncating_to_the_current_length_keeps_the_cache(llama):
    ids = torch.tensor([5, 6, 7, 8])
    cache = llama.new_cache()
    llama.forward(ids, cache)
    cache.truncate(4)
    assert cache.length == 4 and cache.cache.get_seq_length() == 4
    got = llama.forward(torch.tensor([9]), cache)[-1]
    assert torch.allclose(got, _alone(llama, torch.tensor([5, 6, 7, 8, 9])), atol=1e-4)


def test_compact_refuses_positions_outside_the_region(llama):
    cache = llama.new_cache()
    llama.forward(torch.tensor([5, 6, 7, 8, 9, 10]), cache)
    for keep, start in (([2, 5], 3), ([4, 6], 3)):  # below start; at the cache's length
        with pytest.raises(ValueError, match="cannot keep positions"):
            cache.compact(torch.tensor(keep), start)
        assert cache.length == 6 and cache.cache.get_seq_length() == 6


def test_a_tree_region_starting_past_the_cache_is_refused(llama):
    cache = llama.new_cache()
    llama.forward(torch.tensor([5, 6, 7, 8]), cache)
    with pytest.raises(ValueError, match="tree parents"):
        llama.forward_tree(torch.tensor([3, 4]), torch.tensor([-1]), cache, prefix=5)
    assert cache.length == 4 and cache.cache.get_seq_length() == 4


def test_features_of_a_tree_need_a_tree_pass(tmp_path):
    """A model without tree attention (here: its tree pass removed, as for chunked layers) refuses a
    tree asked of forward_features instead of scoring it with a plain causal mask."""
    model = HFCausalLM.from_folder(str(make_tiny(tmp_path, layers=2, hidden=32)))
    del model.forward_tree
    with pytest.raises(ValueError, match="no tree pass"):
        model.forward_features(torch.tensor([3, 4, 5]), model.new_cache(), (1,), parents=PARENTS[:3])


def test_a_failed_pass_leaves_the_cache_as_it_found_it(llama):
    """As the native backend promises: a pass that fails part-way (here interrupted in layer 1, after
    layer 0 appended its keys) leaves the cache as it was, and the next pass is scored as if the
    failed one had never run (layer 0 had kept the 2 stale keys, and every later pass attended to
    them)."""
    ids = torch.tensor([5, 6, 7, 8])
    cache = llama.new_cache()
    llama.forward(ids, cache)

    def interrupt(_module, _args):
        raise KeyboardInterrupt

    hook = llama.model.model.layers[1].register_forward_pre_hook(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            llama.forward(torch.tensor([9, 10]), cache)
    finally:
        hook.remove()
    assert cache.length == 4
    assert [layer.keys.shape[-2] for layer in cache.cache.layers] == [4, 4]
    got = llama.forward(torch.tensor([9]), cache)[-1]
    assert torch.allclose(got, _alone(llama, torch.tensor([5, 6, 7, 8, 9])), atol=1e-4)


@pytest.mark.parametrize("parents", [[-5, 0], [1, -1], [0, -1]], ids=["below -1", "a later node", "itself"])
def test_bad_tree_parents_are_refused_with_a_value_error_and_nothing_cached(llama, parents):
    """As ``NativeCausalLM.forward_tree`` (whose behaviour the docstring promises): parents must be -1
    or an earlier node (-5 had been taken as a root in silence, a forward reference had failed
    with a bare IndexError)."""
    cache = llama.new_cache()
    llama.forward(torch.tensor([5, 6, 7, 8]), cache)
    with pytest.raises(ValueError, match="tree parents"):
        llama.forward_tree(torch.tensor([3, 4]), torch.tensor(parents), cache)
    assert cache.length == 4 and cache.cache.get_seq_length() == 4


PROMPT = torch.tensor([5, 6, 7, 8])


def _cached(llama: HFCausalLM, extra: list[int]):
    cache = llama.new_cache()
    llama.forward(torch.cat([PROMPT, torch.tensor(extra, dtype=torch.long)]), cache)
    return cache


def test_compact_may_keep_the_regions_first_position(llama):
    """Keeping a path that starts at ``start`` itself (the first tree node accepted) is allowed, and
    the cache then continues as if only that node had been fed."""
    cache = _cached(llama, [11, 12, 13])
    cache.compact(torch.tensor([4]), 4)
    assert cache.length == 5 and cache.cache.get_seq_length() == 5
    got = llama.forward(torch.tensor([9]), cache)[-1]
    assert torch.allclose(got, _alone(llama, torch.tensor([5, 6, 7, 8, 11, 9])), atol=1e-4)


def test_compact_keeping_nothing_cuts_the_region(llama):
    """Every drafted node rejected: an empty ``keep`` cuts the cache back to ``start``."""
    cache = _cached(llama, [11, 12])
    cache.compact(torch.tensor([], dtype=torch.long), 4)
    assert cache.length == 4 and cache.cache.get_seq_length() == 4
    got = llama.forward(torch.tensor([9]), cache)[-1]
    assert torch.allclose(got, _alone(llama, torch.tensor([5, 6, 7, 8, 9])), atol=1e-4)


def test_truncating_to_a_negative_length_is_refused(llama):
    cache = _cached(llama, [])
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(-1)
    assert cache.length == 4 and cache.cache.get_seq_length() == 4


def test_a_negative_tree_prefix_is_refused_and_nothing_cached(llama):
    """``prefix`` must lie in ``[0, cache.length]``: -1 (with as many parents as the region it would
    name) is a ValueError, not a crash deep in the mask code."""
    cache = _cached(llama, [])
    with pytest.raises(ValueError, match="tree parents"):
        llama.forward_tree(torch.tensor([3, 4]), torch.tensor([-1, 0, 1, 2, 3, 4, 5]), cache, prefix=-1)
    assert cache.length == 4 and cache.cache.get_seq_length() == 4


def test_a_negative_feature_tap_is_refused(llama):
    """Taps count layers from 0 (the embeddings): -1 is outside, not Python's 'the last one'."""
    with pytest.raises(ValueError, match="outside"):
        llama.forward_features(PROMPT, llama.new_cache(), (-1,))


def test_the_cache_counts_its_keys_and_its_values(llama):
    cache = _cached(llama, [])
    want = sum(t.numel() * t.element_size() for layer in cache.cache.layers for t in (layer.keys, layer.values))
    assert cache.nbytes == want > 0


def test_from_folder_passes_the_dtype_and_local_files_only_on(monkeypatch):
    """``local_files_only`` (an offline hub load reads the local cache only) and ``dtype`` reach
    transformers' loader."""
    from transformers import AutoModelForCausalLM

    seen = {}

    class Stop(Exception):
        pass

    def spy(cls, name, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    with pytest.raises(Stop):
        HFCausalLM.from_folder("someorg/some-model", dtype=torch.bfloat16, local_files_only=True)
    assert seen == {"dtype": torch.bfloat16, "local_files_only": True}


def test_truncating_past_the_current_length_is_refused(llama):
    """A cache of 4 positions cannot be "truncated" to 5: a ValueError, the cache left as it was
    (not a length past what the layers hold)."""
    cache = _cached(llama, [])
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(5)
    assert cache.length == 4 and cache.cache.get_seq_length() == 4
