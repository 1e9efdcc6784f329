"""The fed draft (``specdec.drafters.fed``): its rows are training's streams, its output is exact.

Tiny random native models (2 layers, width 32, 64 tokens); the draft's projection and null vector
random, so a row that reads the wrong features, or none where it should, changes the logits.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters.fed import FedDrafter, fed_config, fed_input
from specdec.drafters.tree_builder import TreeSpec
from specdec.errors import ConfigError
from specdec.gamma import FixedGamma
from specdec.models.native import NativeCausalLM
from specdec.sampling import SamplingConfig
from specdec.train import online as on
from specdec.verify import get_rule
from tiny import tiny_llama_weights, tiny_native
from toy_drafters import Forced

TAPS = (1,)


def _fed(seed: int = 2):
    """(draft model, its weights with a random projection and null vector for the functional Llama)."""
    cfg, w = tiny_llama_weights(seed=1)
    g = torch.Generator().manual_seed(seed)
    w = {**w, on.FED_PROJ: torch.randn(32, (len(TAPS) + 1) * 32, generator=g),
         on.FED_NULL: torch.randn(32, generator=g) * 0.5}
    return NativeCausalLM(cfg, {k: v for k, v in w.items() if not k.startswith("fed.")}, batch_invariant=True), w


def _features(target, seq):  # [T, len(TAPS) + 1, D]: what the verifier hands a feature drafter
    found = {k: torch.empty(0) for k in TAPS}
    final = target.hidden(seq, target.new_cache(64), taps=found)
    return torch.stack([found[k] for k in TAPS] + [final], dim=1)


def test_each_drafted_row_is_trainings_stream():
    """Draft step k of a round after L committed tokens is stream k - 1 of ``train online``'s
    training pass at row L - 2 + k (the same weights and features); the next round, its drafted
    rows dropped and the accepted ones fed again with their features, is stream 0 again; a tree's
    path of two nodes is streams 1 and 2."""
    target = tiny_native(seed=0)
    draft, w = _fed()
    shape = on.Shape(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, eps=1e-6, theta=10000.0, vocab=64)
    seq = torch.tensor([5, 9, 3, 3, 17, 40, 2, 8, 11, 30, 7, 7, 21, 4])
    feats = _features(target, seq)
    student = on.Student("fed", shape, w, fed=3)
    laws = on._fed_laws(student, seq[None], torch.ones(1, seq.numel(), dtype=torch.bool), feats[None], False)
    d = FedDrafter(draft, w[on.FED_PROJ], w[on.FED_NULL], TAPS)
    length = 6
    d.prepare(seq[:2])  # room for two positions' features: the second chunk below grows the buffer
    d.add_features(feats[:2])
    d.add_features(feats[2 : length - 1])
    s = Forced(seq[length : length + 3].tolist())
    d.propose(seq[:length], 3, s)
    for k, row in enumerate(s.rows):
        assert torch.allclose(torch.log_softmax(row, -1), laws[k][length - 1 + k], atol=1e-4), k

    class Kept:
        num_accepted, path = 2, None

    d.commit(Kept())
    assert d.cache.length == length  # the accepted drafted rows are dropped too
    d.add_features(feats[length - 1 : length + 2])  # the pending token and the two accepted
    s = Forced(seq[length + 3 : length + 4].tolist())
    d.propose(seq[: length + 3], 1, s)
    assert torch.allclose(torch.log_softmax(s.rows[0], -1), laws[0][length + 2], atol=1e-4)

    # a tree's nodes are drafted rows: a two-level path is streams 1 and 2
    t = FedDrafter(draft, w[on.FED_PROJ], w[on.FED_NULL], TAPS)
    t.prepare(seq[:length])
    t.add_features(feats[: length - 1])
    t._after(seq[:length], {})
    rows = t._forward_tree(seq[length : length + 2], torch.tensor([-1, 0]), prefix=length)
    for k in (1, 2):
        assert torch.allclose(torch.log_softmax(rows[k - 1], -1), laws[k][length - 1 + k], atol=1e-4), k


def test_greedy_equals_plain_greedy():
    """Chains and trees, with and without a repetition penalty: the target's greedy tokens."""
    target = tiny_native(seed=0)
    draft, w = _fed()
    prompt = torch.tensor([7, 3, 3, 8])
    for cfg in (SamplingConfig(temperature=0.0, max_new_tokens=24),
                SamplingConfig(temperature=0.0, max_new_tokens=24, repetition_penalty=1.3)):
        plain = SpeculativeDecoder(target, None, get_rule("greedy")).generate(prompt, cfg).tokens
        for tree in (None, TreeSpec()):
            d = FedDrafter(draft, w[on.FED_PROJ], w[on.FED_NULL], TAPS)
            out = SpeculativeDecoder(target, d, get_rule("greedy"), gamma=FixedGamma(6 if tree else 3),
                                     tree=tree).generate(prompt, cfg)
            assert out.tokens == plain, tree
            assert out.stats.draft_tokens_proposed > 0 and (out.stats.tree_rounds > 0) == (tree is not None)
            assert d._n_feats == len(prompt) + len(plain) - 1 or d._n_feats == len(prompt) + len(plain) - 2


def test_a_fed_folder_through_the_command_line(tmp_path, capsys):
    """A folder written as `train online --fed` writes it (tiny models): `generate --draft FOLDER`
    equals plain greedy (chains and trees) and drafts; `--remote` refuses it in one line, and the
    server's drafter factory with a ConfigError (`serve` prints it as one line)."""

    from safetensors.torch import load_file, save_file

    from specdec.cli import main
    from tiny import make_tiny

    target = make_tiny(tmp_path / "target", seed=0, max_positions=64)
    fed = make_tiny(tmp_path / "fed", seed=1, max_positions=64)
    w = load_file(str(fed / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    taps = on.default_taps(2)
    w[on.FED_PROJ] = torch.randn(32, (len(taps) + 1) * 32, generator=g)
    w[on.FED_NULL] = torch.randn(32, generator=g) * 0.5
    save_file(w, str(fed / "model.safetensors"))
    cfg = json.loads((fed / "config.json").read_text())
    (fed / "config.json").write_text(json.dumps(dict(cfg, specdec_fed={"taps": list(taps), "target_hidden": 32, "steps": 3})))

    def run(*argv):
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    common = ["generate", "-p", "def f(x):", "--target", str(target), "-n", "12", "--json", "-t", "0"]
    code, out, err = run(*common, "--draft", "none")
    assert code == 0, err
    plain = json.loads(out)["token_ids"]
    for extra in ([], ["--tree", "6", "--tree-min-prob", "0"]):
        code, out, err = run(*common, "--draft", str(fed), "-g", "3", *extra)
        assert code == 0, err
        payload = json.loads(out)
        assert payload["token_ids"] == plain and payload["stats"]["draft_tokens_proposed"] > 0
    code, _, err = run("generate", "-p", "x", "--remote", "http://127.0.0.1:9", "--draft", str(fed))
    assert code == 2 and "does not send" in err and "Traceback" not in err
    from specdec.engine import Engine, EngineConfig
    from specdec.server.command import _fresh_drafter

    engine = Engine.build(EngineConfig(target=str(target), draft=str(fed)))  # what `serve` makes its drafters from
    with pytest.raises(ConfigError, match="fed draft"):
        _fresh_drafter(engine, None)


def test_a_fed_draft_for_another_targets_width_is_a_config_error():
    """Features of another width (a target the draft was not trained for) stop with a one-line
    ConfigError at the first features, not a shape error inside a matrix product."""
    draft, w = _fed()
    d = FedDrafter(draft, w[on.FED_PROJ], w[on.FED_NULL], TAPS)
    d.prepare(torch.tensor([1, 2, 3]))
    with pytest.raises(ConfigError, match="another target"):
        d.add_features(torch.zeros(2, len(TAPS) + 1, 48))
    assert d.spawn(lambda m: m).model is draft and d.spawn().feature_taps == TAPS


def test_features_longer_than_the_doubled_buffer_all_land():
    """A chunk of features larger than twice the buffer (and than 64 rows) still lands whole:
    the buffer grows to at least what it must hold, and every row reads its projection."""
    draft, w = _fed()
    d = FedDrafter(draft, w[on.FED_PROJ], w[on.FED_NULL], TAPS)
    d.prepare(torch.tensor([1, 2]))  # room for two positions' features
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(100, len(TAPS) + 1, 32, generator=g)
    d.add_features(feats[:1])
    d.add_features(feats[1:])
    assert d._n_feats == 100
    want = fed_input(feats) @ w[on.FED_PROJ].T
    assert torch.allclose(d._pf[:100], want, atol=1e-5)
    # row r reads position r - 1's features; row 0 the null vector
    rows = d._extra(0, 101)
    assert torch.equal(rows[0], w[on.FED_NULL]) and torch.allclose(rows[1:], want, atol=1e-5)


def test_a_spawned_or_rebuilt_fed_drafter_keeps_its_settings():
    """``with_model``/``spawn``: the same projection, taps, max_length and temperature factor."""
    draft, w = _fed()
    d = FedDrafter(draft, w[on.FED_PROJ], w[on.FED_NULL], TAPS, max_length=40, temperature_factor=0.6)
    for fresh in (d.spawn(), d.with_model(draft)):
        assert fresh is not d and fresh.temperature_factor == 0.6 and fresh.max_length == 40
        assert fresh.feature_taps == TAPS and fresh.proj is d.proj and fresh.null is d.null


def test_a_new_sequence_forgets_the_last_ones_features():
    """``prepare`` for the next sequence starts with no features: until the verifier hands this
    sequence's, every row reads the null vector (not the last sequence's feature count over a
    fresh, uninitialised buffer)."""
    draft, w = _fed()
    d = FedDrafter(draft, w[on.FED_PROJ], w[on.FED_NULL], TAPS)
    d.prepare(torch.tensor([1, 2, 3, 4, 5, 6]))
    d.add_features(torch.randn(5, len(TAPS) + 1, 32, generator=torch.Generator().manual_seed(1)))
    d.prepare(torch.tensor([7, 8, 9, 10, 11, 12]))
    assert d._n_feats == 0
    assert torch.equal(d._extra(0, 6), w[on.FED_NULL].expand(6, -1))


def test_fed_input_is_each_tap_over_its_rms_concatenated_at_unit_norm():
    """Training's layout (a trained projection reads exactly this): per row, each tap divided by
    its own RMS, the taps concatenated, the whole scaled to unit L2 norm."""
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(4, 3, 16, generator=g) * torch.tensor([1.0, 5.0, 0.5])[None, :, None]  # taps of unlike scales
    got = fed_input(feats)  # [4, 48]
    assert got.shape == (4, 48)
    assert torch.allclose(got.norm(dim=-1), torch.ones(4), atol=1e-3)
    for t in range(3):  # every tap's block has the same norm: each was divided by its own RMS
        block = got[:, 16 * t : 16 * (t + 1)]
        assert torch.allclose(block.norm(dim=-1), torch.full((4,), 3 ** -0.5), atol=1e-3)
        assert torch.allclose(block / block.norm(dim=-1, keepdim=True),
                              feats[:, t] / feats[:, t].norm(dim=-1, keepdim=True), atol=1e-5)


def test_fed_config_reads_the_block_and_is_none_without_a_config(tmp_path):
    """A folder without config.json (a GGUF folder, say) is not a fed draft: None, not an error."""
    assert fed_config(None) is None and fed_config(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"specdec_fed": {"taps": [1], "target_hidden": 32, "steps": 3}}))
    assert fed_config(tmp_path) == {"taps": [1], "target_hidden": 32, "steps": 3}


def test_spawn_wraps_the_draft_model():
    """``spawn(wrap)`` (the server's per-request drafters) drafts with ``wrap(model)``, not the bare model."""
    draft, w = _fed()
    d = FedDrafter(draft, w[on.FED_PROJ], w[on.FED_NULL], TAPS)
    wrapped = object()
    assert d.spawn(lambda m: wrapped if m is draft else None).model is wrapped


def test_extra_bytes_counts_the_projection_and_the_null_vector_as_float32():
    draft, w = _fed()
    d = FedDrafter(draft, w[on.FED_PROJ], w[on.FED_NULL], TAPS)
    assert d.extra_bytes() == (32 * 64 + 32) * 4


def test_fed_input_keeps_trainings_epsilon_for_small_features():
    """Drafts trained with ``train online --fed`` read rows divided by sqrt(mean square + 1e-6):
    at feature scales near that epsilon the exact value matters, so it is pinned."""
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(3, 2, 16, generator=g) * 1e-3  # mean square ~1e-6, as large as the epsilon
    want = (feats * torch.rsqrt(feats.pow(2).mean(-1, keepdim=True) + 1e-6)).flatten(-2) / (2 * 16) ** 0.5
    assert torch.allclose(fed_input(feats), want, rtol=1e-5, atol=1e-7)


def test_a_projection_stored_in_bfloat16_loads_as_float32(tmp_path):
    """A fed folder whose projection and null vector were saved in bfloat16 still drafts: the
    drafter's features are float32, so ``load_projection`` hands float32 back."""
    from safetensors.torch import save_file

    from specdec.drafters.fed import NULL, PROJ, load_projection

    save_file({PROJ: torch.ones(4, 6, dtype=torch.bfloat16), NULL: torch.ones(4, dtype=torch.bfloat16)},
              str(tmp_path / "model.safetensors"))
    proj, null = load_projection(tmp_path)
    assert proj.dtype == null.dtype == torch.float32 and proj.shape == (4, 6) and null.shape == (4,)


def test_a_tree_pass_passes_its_options_on_to_the_draft_model():
    """``_forward_tree(..., compact=True)`` (a reduced draft vocabulary) reaches the model's
    ``forward_tree`` with the option and the null vector for every node; so does a chain pass's."""
    draft, w = _fed()
    d = FedDrafter(draft, w[on.FED_PROJ], w[on.FED_NULL], TAPS)
    d.prepare(torch.tensor([5, 9, 3]))
    d._after(torch.tensor([5, 9, 3]), {})
    seen = {}
    draft.forward_tree = lambda tokens, parents, cache, *, prefix, extra, **kw: seen.update(tree=(kw, extra.clone()))
    draft.forward = lambda tokens, cache, *, extra, **kw: seen.update(chain=kw)
    d._forward_tree(torch.tensor([1, 2]), torch.tensor([-1, 0]), prefix=3, compact=True)
    assert seen["tree"][0] == {"compact": True} and torch.equal(seen["tree"][1], w[on.FED_NULL].expand(2, -1))
    d._forward(torch.tensor([1]), compact=True)
    assert seen["chain"] == {"compact": True}


def test_bfloat16_features_are_read_in_float32():
    """A bfloat16 target hands bfloat16 features: they are normalised and projected in float32
    (the projection's dtype), as the same values in float32 would be."""
    draft, w = _fed()
    d = FedDrafter(draft, w[on.FED_PROJ], w[on.FED_NULL], TAPS)
    d.prepare(torch.tensor([1, 2, 3]))
    feats = torch.randn(2, len(TAPS) + 1, 32, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    d.add_features(feats)
    assert d._pf.dtype == torch.float32
    assert torch.allclose(d._pf[:2], fed_input(feats.float()) @ w[on.FED_PROJ].T, atol=1e-5)


def test_fed_config_of_a_plain_model_folder_is_none(tmp_path):
    """A config.json without the ``specdec_fed`` block (an ordinary draft model's folder) is not a
    fed draft: None, not an empty block."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    assert fed_config(tmp_path) is None


def test_features_with_another_number_of_taps_are_a_config_error():
    """Features of the right width but another number of taps (a target that hands three rows a
    position where the draft was trained on two) stop with the one-line ConfigError too: the
    check is on the values a position carries, taps times width, not on the width alone."""
    draft, w = _fed()
    d = FedDrafter(draft, w[on.FED_PROJ], w[on.FED_NULL], TAPS)
    d.prepare(torch.tensor([1, 2, 3]))
    with pytest.raises(ConfigError, match="another target"):
        d.add_features(torch.zeros(2, len(TAPS) + 2, 32))
    assert d._n_feats == 0
