"""Kangaroo: the adapter, its drafter and its trainer on a tiny random native model.

The drafter proposes tokens only; verification is the unchanged rules (their law tests are
drafter-independent), so these check what is new: an untrained adapter is exactly early exit,
drafting and training compute the same function, greedy speculative output equals plain greedy
output under every rule and sampling option, cache sharing stays bitwise, and training lowers the
loss and resumes from a checkpoint to the very same weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace

import pytest
import torch

from specdec.decoder import SpeculativeDecoder
from specdec.drafters import self_spec
from specdec.drafters.base import DraftSampler
from specdec.drafters.kangaroo import Adapter, AdapterConfig, KangarooDrafter, KangarooView, load_adapter, save_adapter
from specdec.drafters.self_spec import LayerPlan, LayerView
from specdec.errors import ConfigError
from specdec.gamma import FixedGamma
from specdec.sampling import SamplingConfig
from specdec.session import TargetSession
from specdec.train import kangaroo as kt
from specdec.verify import get_rule
from drafters.test_self_spec import tiny_native

MODEL = tiny_native(vocab=11, layers=4, batch_invariant=False)
INVARIANT = tiny_native(vocab=11, layers=4)
PROMPTS = [[1, 2, 3], [0, 4], [3, 3, 1, 2], [5, 6], [7, 1, 9], [10, 2, 2, 4]]


def _trained(model=MODEL, steps: int = 6) -> Adapter:
    adapter = kt.new_adapter(model, 2, seed=1)
    kt.train(adapter, _data(model), kt.head_weight(model), kt.TrainConfig(steps=steps, batch=3, positions=16, warmup=1))
    return adapter


def _data(model=MODEL) -> list[kt.Features]:
    seqs = kt.continue_batched(model, PROMPTS, new_tokens=10, temperatures=(0.0, 1.0), batch=4)
    return [kt.features(model, s, len(p) - 1, 2, top_k=5) for p, s in zip(PROMPTS, seqs)]


def test_untrained_adapter_is_early_exit_bitwise():
    view = KangarooView(INVARIANT, kt.new_adapter(INVARIANT, 2))
    plain = LayerView(INVARIANT, LayerPlan.early_exit(4, 2))
    seq = torch.tensor([1, 2, 3, 4, 0, 9, 8])
    assert torch.equal(view.forward(seq, view.new_cache(16)), plain.forward(seq, plain.new_cache(16)))


def test_drafting_computes_what_training_trained():
    adapter = _trained()
    with torch.no_grad():  # a large attention contribution, so that any train/draft mismatch shows
        adapter.out.copy_(torch.randn(adapter.out.shape, generator=torch.Generator().manual_seed(0)))
    f = _data()[2]
    view = KangarooView(MODEL, adapter)
    cache = view.new_cache(32)
    rows = [view.forward(f.tokens[:3], cache)] + [view.forward(f.tokens[i : i + 1], cache) for i in range(3, f.tokens.numel())]
    drafted = torch.cat(rows)  # [L, V] incremental, as a draft runs
    with torch.no_grad():
        trained = kt.draft_log_probs(adapter, adapter(f.hidden.unsqueeze(0))[0], kt.head_weight(MODEL))
    assert torch.allclose(torch.log_softmax(drafted, -1), trained, atol=1e-4)
    early = LayerView(MODEL, LayerPlan.early_exit(4, 2))
    assert not torch.allclose(drafted, early.forward(f.tokens, early.new_cache(32)), atol=1e-2)  # the adapter matters


def test_training_lowers_the_loss_and_resumes_to_the_same_weights():
    data, w = _data(), kt.head_weight(MODEL)
    cfg = kt.TrainConfig(steps=8, batch=3, positions=16, warmup=1, lr=1e-2)
    straight = kt.new_adapter(MODEL, 2, seed=1)
    losses = kt.train(straight, data, w, cfg)
    assert sum(losses[-3:]) < sum(losses[:3])
    saved = {}

    def stop_at_4(step, loss, state):
        if step == 4:
            saved.update(torch.utils._pytree.tree_map(lambda x: x.clone() if torch.is_tensor(x) else x, state))
            raise KeyboardInterrupt

    interrupted = kt.new_adapter(MODEL, 2, seed=1)
    with pytest.raises(KeyboardInterrupt):
        kt.train(interrupted, data, w, cfg, on_step=stop_at_4)
    resumed = kt.new_adapter(MODEL, 2, seed=7)  # other initial weights: the checkpoint must replace them
    again = kt.train(resumed, data, w, cfg, state=saved)
    assert again == losses
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_report_and_file_round_trip(tmp_path):
    adapter = _trained()
    rep = kt.report(MODEL, adapter, _data()[:2])
    assert set(rep) == {"held_out_positions", "kangaroo", "layerskip:2"} and rep["held_out_positions"] == 20
    assert 0.0 <= rep["kangaroo"]["alpha_t1"] <= 1.0
    path = tmp_path / "a.safetensors"
    save_adapter(adapter, path, card={"steps": 6})
    back, card = load_adapter(path)
    assert card == {"steps": 6} and back.cfg == adapter.cfg
    for a, b in zip(adapter.parameters(), back.parameters()):
        assert torch.equal(a.detach().half().float(), b)
    drafter, label = self_spec.build(f"kangaroo:{path}", MODEL, "tiny")
    assert isinstance(drafter, KangarooDrafter) and label == "kangaroo:a.safetensors"
    assert drafter.extra_bytes() == back.nbytes  # nothing drafted yet: only the weights
    with pytest.raises(ConfigError, match="specdec train kangaroo"):
        self_spec.build("kangaroo", MODEL, "tiny")
    with pytest.raises(ConfigError, match="does not exist"):
        self_spec.build(f"kangaroo:{tmp_path / 'none.safetensors'}", MODEL, "tiny")
    (tmp_path / "bad.safetensors").write_text("x")
    with pytest.raises(ConfigError, match="cannot read"):
        self_spec.build(f"kangaroo:{tmp_path / 'bad.safetensors'}", MODEL, "tiny")
    with pytest.raises(ConfigError, match="another shape"):
        KangarooView(tiny_native(vocab=11, layers=3), back)


def test_a_damaged_adapter_card_or_shape_is_a_one_line_error(tmp_path):
    """A card that is not a JSON object used to end in a JSONDecodeError traceback; a file of another
    shape in "Error(s) in loading state_dict", its tensors on further lines."""
    from safetensors.torch import load_file, save_file

    adapter = kt.new_adapter(MODEL, 2, seed=1)
    save_adapter(adapter, tmp_path / "a.safetensors")
    tensors = load_file(str(tmp_path / "a.safetensors"))
    meta = {"format": "specdec-kangaroo-adapter", "config": json.dumps(asdict(adapter.cfg))}
    save_file(tensors, str(tmp_path / "card.safetensors"), metadata=meta | {"card": "{not json"})
    save_file(tensors, str(tmp_path / "list.safetensors"), metadata=meta | {"card": "[1]"})
    wide = json.dumps(asdict(adapter.cfg) | {"n_heads": 2 * adapter.cfg.n_heads})
    save_file(tensors, str(tmp_path / "wide.safetensors"), metadata=meta | {"config": wide})
    for name, says in (("card", "Expecting property name"), ("list", "card is not a JSON object"),
                       ("wide", "size mismatch for qkv: copying a param with shape")):
        with pytest.raises(ConfigError, match=says) as err:
            load_adapter(tmp_path / f"{name}.safetensors")
        assert "\n" not in str(err.value)


SAMPLING = [
    ("greedy", SamplingConfig(temperature=0.0)),
    ("token", SamplingConfig(temperature=1.0, top_k=5, top_p=0.9)),
    ("block", SamplingConfig(temperature=0.7, min_p=0.05, repetition_penalty=1.3)),
    ("token", SamplingConfig(temperature=1.2, frequency_penalty=0.5, presence_penalty=0.3)),
    ("coupled", SamplingConfig(temperature=1.0)),
]


@pytest.mark.parametrize("method,cfg", SAMPLING, ids=[f"{m}-{i}" for i, (m, _) in enumerate(SAMPLING)])
def test_every_rule_and_sampling_option_runs_with_kangaroo(method, cfg):
    """Greedy: output equal to plain greedy; sampled: a full, reproducible generation that drafted."""
    drafter = KangarooDrafter(KangarooView(INVARIANT, _trained(INVARIANT)), stop_below=0.0)
    run = dict(cfg.__dict__, seed=5, max_new_tokens=14)
    dec = SpeculativeDecoder(INVARIANT, drafter, get_rule(method), gamma=FixedGamma(3))
    out = dec.generate([1, 2, 3], SamplingConfig(**run))
    assert len(out.tokens) == 14 and out.stats.draft_tokens_proposed > 0
    assert dec.generate([1, 2, 3], SamplingConfig(**run)).tokens == out.tokens
    if cfg.greedy:
        plain = SpeculativeDecoder(INVARIANT, None, get_rule("greedy")).generate([1, 2, 3], SamplingConfig(**run)).tokens
        assert out.tokens == plain


def test_early_stopping_shortens_drafts_and_cache_sharing_is_bitwise():
    adapter = _trained(INVARIANT)
    cfg = SamplingConfig(temperature=0.0)
    sampler = lambda: DraftSampler(cfg, "argmax", penalties=None, generator=None)  # noqa: E731
    eager = KangarooDrafter(KangarooView(INVARIANT, adapter), stop_below=0.0)
    eager.prepare(torch.tensor([1, 2, 3]))
    assert eager.propose(torch.tensor([1, 2, 3]), 6, sampler()).tokens.numel() == 6
    cautious = KangarooDrafter(KangarooView(INVARIANT, adapter), stop_below=0.999)
    cautious.prepare(torch.tensor([1, 2, 3]))
    assert cautious.propose(torch.tensor([1, 2, 3]), 6, sampler()).tokens.numel() < 6
    shared = TargetSession(INVARIANT, [1, 2, 3], cfg, get_rule("greedy"), seed=0)
    plain = TargetSession(INVARIANT, [1, 2, 3], cfg, get_rule("greedy"), seed=0)
    eager.prepare(shared.context)
    draft = eager.propose(shared.context, 4, sampler())
    feed = torch.cat([shared.context[-1:], draft.tokens])
    with_sharing = draft.reuse.forward(INVARIANT, feed, shared.cache)
    assert with_sharing is not None and torch.equal(with_sharing, INVARIANT.forward(feed, plain.cache))
    end = shared.cache.length
    assert torch.equal(shared.cache.k[:, :, :end], plain.cache.k[:, :, :end])


def test_spawn_for_the_server_keeps_kangaroo():
    """The server builds one drafter per request with ``spawn(wrap)``: same adapter and threshold,
    no prefill before a round drafts, the wrapped view drafts, and the output is still plain greedy."""
    drafter = KangarooDrafter(KangarooView(INVARIANT, _trained(INVARIANT)), stop_below=0.3)
    calls = []

    class Wrapped:
        def __init__(self, view):
            self.view = view

        def __getattr__(self, name):
            return getattr(self.view, name)

        def forward(self, *a, **k):
            calls.append(1)
            return self.view.forward(*a, **k)

    fresh = drafter.spawn(Wrapped)
    assert isinstance(fresh, KangarooDrafter) and fresh.stop_below == 0.3 and fresh.view is drafter.view
    assert drafter.feature_taps == (2,) and fresh.feature_taps is None  # batched passes hand out no features
    fresh.prepare(torch.tensor([1, 2, 3]))
    assert fresh.cache.length == 0 and not calls  # lazy: the first round that drafts feeds the prompt
    run = SamplingConfig(temperature=0.0, max_new_tokens=10)
    out = SpeculativeDecoder(INVARIANT, fresh, get_rule("greedy"), gamma=FixedGamma(3)).generate([1, 2, 3], run)
    assert calls and out.tokens == SpeculativeDecoder(INVARIANT, None, get_rule("greedy")).generate([1, 2, 3], run).tokens


class _Pattern:
    """γ by a repeated pattern: plain rounds between drafted ones."""

    name = "pattern"

    def __init__(self, pattern: list[int]) -> None:
        self.pattern, self.i = pattern, 0

    def next_gamma(self) -> int:
        return self.pattern[self.i % len(self.pattern)]

    def update(self, **_) -> None:
        self.i += 1


def _count_fed(view: KangarooView) -> list[int]:
    """Rows each call of the view's forward feeds (its layers run over them)."""
    calls: list[int] = []
    forward = view.forward

    def spy(tokens, cache, **kw):
        calls.append(tokens.numel())
        return forward(tokens, cache, **kw)

    view.forward = spy  # type: ignore[method-assign]
    return calls


def test_with_the_feature_tap_the_view_never_reruns_committed_tokens():
    """The decoder hands Kangaroo the target's residual after K layers at every committed position,
    so the view copies the shallow keys/values of the prompt and of plain rounds from the target's
    cache and computes only the adapter's: each drafting round feeds its layers one row (the
    pending token), where without the tap it re-runs them over the prompt and every token of a
    plain stretch.  Its cache then holds what its own layers compute (the shallow keys/values and
    residuals bitwise, the adapter's keys/values to the matmul's rounding), and greedy output is
    plain greedy output.  Sizes: a 6-token prompt, 24 tokens, 4 plain rounds before each 3-token draft."""
    adapter = _trained(INVARIANT)
    prompt = [1, 2, 3, 4, 5, 6]
    run = SamplingConfig(temperature=0.0, max_new_tokens=24)
    plain = SpeculativeDecoder(INVARIANT, None, get_rule("greedy")).generate(prompt, run).tokens
    fed, drafters = {}, {}
    for tap in (True, False):
        drafter = KangarooDrafter(KangarooView(INVARIANT, adapter), stop_below=0.0)
        if not tap:
            drafter.feature_taps = None
        fed[tap] = _count_fed(drafter.view)
        dec = SpeculativeDecoder(INVARIANT, drafter, get_rule("greedy"), gamma=_Pattern([0, 0, 0, 0, 3]))
        out = dec.generate(prompt, run)
        assert out.tokens == plain and out.stats.draft_tokens_proposed >= 9
        drafters[tap] = drafter
    assert fed[True] and max(fed[True]) == 1, fed[True]
    assert fed[False][0] == len(prompt) - 1 and max(fed[False][1:]) >= 4, fed[False]  # prefill, catch-ups
    a, b = drafters[True].cache, drafters[False].cache
    n, k = min(a.length, b.length), 2
    assert n >= len(prompt) + 16
    assert torch.equal(a.k[:k, :, :n], b.k[:k, :, :n]) and torch.equal(a.v[:k, :, :n], b.v[:k, :, :n])
    assert torch.equal(a.resid[:n], b.resid[:n]) and torch.equal(a.tokens[:n], b.tokens[:n])
    assert torch.allclose(a.k[k, :, :n], b.k[k, :, :n], atol=1e-5) and torch.allclose(a.v[k, :, :n], b.v[k, :, :n], atol=1e-5)


def test_a_pass_that_reuses_the_draft_hands_over_the_targets_features_bitwise():
    """With the tap, a verification pass that reuses the draft's shallow layers returns the logits
    and the features (residual after K layers, final hidden state) of the target's own pass, bit
    for bit; it declines taps it does not hold."""
    adapter = _trained(INVARIANT)
    cfg = SamplingConfig(temperature=0.0)
    drafter = KangarooDrafter(KangarooView(INVARIANT, adapter), stop_below=0.0)
    shared = TargetSession(INVARIANT, [1, 2, 3, 4], cfg, get_rule("greedy"), seed=0, feature_taps=(2,))
    plain = TargetSession(INVARIANT, [1, 2, 3, 4], cfg, get_rule("greedy"), seed=0, feature_taps=(2,))
    drafter.prepare(shared.context)
    draft = drafter.propose(shared.context, 4, DraftSampler(cfg, "argmax", penalties=None, generator=None))
    feed = torch.cat([shared.context[-1:], draft.tokens])
    assert draft.reuse.forward_features(INVARIANT, feed, shared.cache, (1,)) is None
    got = draft.reuse.forward_features(INVARIANT, feed, shared.cache, (2,))
    want = INVARIANT.forward_features(feed, plain.cache, (2,))
    assert got is not None and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_prompt_lookup_in_front_passes_the_tap_through():
    """``kangaroo+lookup``: the hybrid declares the model drafter's tap and forwards the features;
    the view still feeds one row per model round and greedy output is plain greedy output."""
    from specdec.drafters.hybrid import LookupThenModel

    drafter = KangarooDrafter(KangarooView(INVARIANT, _trained(INVARIANT)), stop_below=0.0)
    hybrid = LookupThenModel(drafter, lookup_tokens=3)  # fixed: which rounds are the model's must not follow timings
    assert hybrid.feature_taps == (2,)
    fed = _count_fed(drafter.view)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # something for the lookup to find
    run = SamplingConfig(temperature=0.0, max_new_tokens=20)
    out = SpeculativeDecoder(INVARIANT, hybrid, get_rule("greedy"), gamma=_Pattern([0, 0, 3])).generate(prompt, run)
    assert out.tokens == SpeculativeDecoder(INVARIANT, None, get_rule("greedy")).generate(prompt, run).tokens
    assert fed and max(fed) == 1, fed


def test_the_command_continues_with_more_steps_and_refuses_other_settings(tmp_path, capsys):
    """`specdec train kangaroo` on a tiny target: a larger --steps continues the checkpoint (it
    restarted from step 0 and overwrote the adapter), another --lr is refused in one line before any
    data is made, the adapter untouched; a cut-short data file is a one-line error naming it."""
    from specdec.cli import main
    from tiny import make_tiny

    target = make_tiny(tmp_path / "target", seed=0, layers=4, max_positions=256)
    out = tmp_path / "k" / "adapter.safetensors"
    base = ["train", "kangaroo", "--target", str(target), "--out", str(out), "--prompts", "4", "--new-tokens", "6",
            "--batch", "2", "--positions", "16", "--top-k", "8"]
    assert main([*base, "--steps", "25"]) == 0
    capsys.readouterr()
    assert main([*base, "--steps", "30"]) == 0
    assert "resuming from step 25" in capsys.readouterr().err
    assert torch.load(out.with_name(out.name + ".ckpt.pt"), weights_only=False)["state"]["step"] == 30
    weights = out.read_bytes()
    assert main([*base, "--steps", "30", "--lr", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "was saved by a run with lr = 0.002, this one asks for 0.5" in err and "Traceback" not in err
    assert out.read_bytes() == weights
    data = out.with_name(out.name + ".data.pt")
    data.write_bytes(data.read_bytes()[:64])
    assert main([*base, "--steps", "30"]) == 2
    err = capsys.readouterr().err
    assert "adapter.safetensors.data.pt cannot be read" in err and "Traceback" not in err


#: a small `specdec train kangaroo` run's settings
COMMAND_BASE = {"--prompts": "2", "--new-tokens": "4", "--batch": "2", "--positions": "8", "--steps": "1", "--top-k": "4"}


def _command(target, out, **over: str) -> list[str]:
    """The argv of a small kangaroo run, ``over`` (e.g. ``top_k="8"``) replacing its settings."""
    opts = {**COMMAND_BASE, **{f"--{k.replace('_', '-')}": str(v) for k, v in over.items()}}
    return ["train", "kangaroo", "--target", str(target), "--out", str(out), *(x for kv in opts.items() for x in kv)]


@pytest.mark.parametrize("setting, first, then", [("top_k", "8", "4"), ("new_tokens", "4", "5")])
def test_the_command_refuses_a_checkpoint_of_other_data(tmp_path, capsys, setting, first, then):
    """--top-k and --new-tokens (like --prompts, --layers) make other training data: the old data is
    not reused, and a checkpoint trained on it is refused in one line, naming the setting, not
    continued."""
    from specdec.cli import main
    from tiny import make_tiny

    target = make_tiny(tmp_path / "target", seed=0, layers=4, max_positions=256)
    out = tmp_path / "k" / "adapter.safetensors"
    assert main(_command(target, out, **{setting: first})) == 0
    weights = out.read_bytes()
    capsys.readouterr()
    assert main(_command(target, out, **{setting: then})) == 2
    err = capsys.readouterr().err
    assert "was saved by a run with key = " in err and "Traceback" not in err
    assert out.read_bytes() == weights


def test_the_commands_settings_reach_the_trainer_and_the_report(tmp_path, capsys):
    """--positions (and batch, top-k, seed) are the ones the run used, as its JSON report says; without
    --layers K is half the target's layers (4 -> 2)."""
    from specdec.cli import main
    from tiny import make_tiny

    target = make_tiny(tmp_path / "target", seed=0, layers=4, max_positions=256)
    out = tmp_path / "k" / "adapter.safetensors"
    assert main(_command(target, out, seed=3)) == 0
    capsys.readouterr()
    card = json.loads(out.with_name("adapter.json").read_text())
    assert (card["positions"], card["batch"], card["top_k"], card["seed"], card["layers"]) == (8, 2, 4, 3, 2)
    assert torch.load(out.with_name(out.name + ".ckpt.pt"), weights_only=False)["train"].positions == 8


@pytest.mark.parametrize("setting, first, then", [("seed", "0", "1"), ("layers", "1", "2")])
def test_the_command_makes_data_of_another_seed_or_layer_again_not_reused(tmp_path, capsys, setting, first, then):
    """The seed draws the prompts and samples the continuations, the exit layer decides the features:
    with the checkpoint gone, a run with another --seed or --layers makes its own data instead of
    reusing the data saved for the old one."""
    from specdec.cli import main
    from tiny import make_tiny

    target = make_tiny(tmp_path / "target", seed=0, layers=4, max_positions=256)
    out = tmp_path / "k" / "adapter.safetensors"
    assert main(_command(target, out, **{setting: first})) == 0
    out.with_name(out.name + ".ckpt.pt").unlink()
    capsys.readouterr()
    assert main(_command(target, out, **{setting: then})) == 0
    assert "sequences from" not in capsys.readouterr().err
    assert torch.load(out.with_name(out.name + ".data.pt"), weights_only=False)["key"][setting] == int(then)


def test_the_adapter_scales_the_residual_sum_per_channel():
    """Kangaroo §3.1 as the module docstring states it: RMSNorm → attention → residual add → a
    learned per-channel scale, i.e. ``(x + attn(x)) * scale``.  Training and drafting share
    ``_finish``, so the existing tests (drafting == training) cannot see which of the two the
    scale multiplies; this writes one position out by hand (one key: attention returns v)."""
    adapter = kt.new_adapter(MODEL, 2, seed=1)
    cfg = adapter.cfg
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        adapter.out.copy_(torch.randn(adapter.out.shape, generator=g) * 0.3)
        adapter.out_scale.copy_(1 + torch.randn(adapter.out_scale.shape, generator=g))
        adapter.in_norm.copy_(1 + 0.1 * torch.randn(adapter.in_norm.shape, generator=g))
        x = torch.randn(1, 1, cfg.hidden_size, generator=g)
        got = adapter(x)[0, 0]
    xn = x[0, 0] * torch.rsqrt(x[0, 0].pow(2).mean() + cfg.rms_eps) * adapter.in_norm
    h, hk, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    v = (xn @ adapter.qkv.T)[(h + hk) * d :].view(hk, d).repeat_interleave(h // hk, 0).flatten()
    want = (x[0, 0] + v @ adapter.out.T) * adapter.out_scale
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)


def test_an_exit_at_or_past_the_last_layer_is_refused():
    """Kangaroo exits *early*: ``1 <= layers < n_layers``.  Exiting after every layer would make the
    draft the target itself plus an adapter (no speedup, a cache slot past the target's); the
    existing tests only build adapters at K = 2 of 4."""
    n = MODEL.cfg.n_layers
    assert AdapterConfig.for_target(MODEL.cfg, n - 1).exit_after == n - 1
    for bad in (0, n, n + 1):
        with pytest.raises(ConfigError, match="kangaroo needs 1 <= layers"):
            AdapterConfig.for_target(MODEL.cfg, bad)


def test_a_stopping_threshold_of_one_is_refused():
    """``stop_below`` is a probability threshold in [0, 1): at 1 every draft would stop after its
    first token whatever the draft's confidence (q < 1 almost always), which is a misconfiguration."""
    view = KangarooView(INVARIANT, kt.new_adapter(INVARIANT, 2, seed=1))
    assert KangarooDrafter(view, stop_below=0.999).stop_below == 0.999
    for bad in (1.0, -0.1):
        with pytest.raises(ConfigError, match="stopping threshold"):
            KangarooDrafter(view, stop_below=bad)


def test_the_decoders_own_min_confidence_is_kept_when_higher():
    """Kangaroo's threshold never *lowers* the decoder's ``min_confidence``: with ``stop_below=0``
    and a sampler asking for 0.999, drafts still stop early (the existing early-stopping test only
    raises the threshold from the sampler's default)."""
    drafter = KangarooDrafter(KangarooView(INVARIANT, _trained(INVARIANT)), stop_below=0.0)
    context = torch.tensor([1, 2, 3])
    drafter.prepare(context)
    sampler = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
    assert drafter.propose(context, 6, sampler).tokens.numel() == 6  # as in the early-stopping test
    drafter.prepare(context)
    cautious = DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)
    cautious.min_confidence = 0.999
    assert drafter.propose(context, 6, cautious).tokens.numel() < 6
    assert cautious.min_confidence == 0.999


def test_a_file_not_written_by_the_trainer_is_refused(tmp_path):
    """``load_adapter`` checks the ``format`` tag: a safetensors file carrying the same tensors and
    config but another (or no) format tag is not taken for an adapter.  The damaged-file test keeps
    the tag on every file it writes."""
    from safetensors.torch import load_file, save_file

    adapter = kt.new_adapter(MODEL, 2, seed=1)
    save_adapter(adapter, tmp_path / "a.safetensors")
    assert load_adapter(tmp_path / "a.safetensors")[0].cfg == adapter.cfg
    tensors = load_file(str(tmp_path / "a.safetensors"))
    save_file(tensors, str(tmp_path / "other.safetensors"),
              metadata={"format": "pt", "config": json.dumps(asdict(adapter.cfg)), "card": "{}"})
    with pytest.raises(ConfigError, match="not written by `specdec train kangaroo`"):
        load_adapter(tmp_path / "other.safetensors")


def test_the_adapters_rotary_embedding_is_the_llama_convention():
    """The adapter's rotary embedding is Llama's ``x * cos + rotate_half(x) * sin`` with
    ``rotate_half(x) = [-x2, x1]`` (the target's and the heads' convention).  Training and drafting
    share ``_rope``, so a flipped sign would pass every drafting == training test while changing
    what a shipped adapter computes; pinned against the heads' own rotary helpers."""
    from specdec.heads.modules import _rotate, rope_tables

    adapter = kt.new_adapter(MODEL, 2, seed=1)
    cfg = adapter.cfg
    x = torch.randn(5, cfg.n_heads, cfg.head_dim, generator=torch.Generator().manual_seed(0))  # [T, h, d]
    positions = torch.arange(3, 8)
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)  # [T, d]
    want = _rotate(x.transpose(0, 1), cos, sin).transpose(0, 1)  # _rotate takes [h, T, d]
    torch.testing.assert_close(adapter._rope(x, positions), want, rtol=1e-6, atol=1e-6)


def test_the_loss_is_the_mean_cross_entropy_against_the_renormalised_top_k() -> None:
    """With every sequence and every position picked, the loss is the mean over positions with a
    next token of ``-Σ_k p̂_k log q(i_k)``, p̂ the target's top-k probabilities renormalised to 1."""
    data, w = _data(), kt.head_weight(MODEL)
    adapter = kt.new_adapter(MODEL, 2, seed=1)
    cfg = kt.TrainConfig(batch=len(data), positions=10_000)
    with torch.no_grad():
        got = float(kt.batch_loss(adapter, data, w, torch.Generator().manual_seed(0), cfg))
        per = []
        for f in data:
            logq = kt.draft_log_probs(adapter, adapter(f.hidden[None])[0], w)[:-1]  # rows with a next token
            p = f.top_p[:-1] / f.top_p[:-1].sum(-1, keepdim=True)
            per.append(-(p * logq.gather(1, f.top_i[:-1])).sum(-1))
    assert float(data[0].top_p.sum(-1).min()) < 0.999  # top-5 of 11 is not all the mass: renormalising matters
    assert got == pytest.approx(float(torch.cat(per).mean()), rel=1e-5)


def test_learning_rate_warms_up_from_the_first_step_then_decays_to_zero() -> None:
    cfg = kt.TrainConfig(steps=10, warmup=4, lr=1.0)
    assert kt.lr_at(0, cfg) == pytest.approx(0.25 * 0.5 * (1 + math.cos(0.0)))
    assert kt.lr_at(5, cfg) == pytest.approx(0.5)  # warm, half way down the cosine
    assert kt.lr_at(10, cfg) == pytest.approx(0.0, abs=1e-12)


def test_each_step_draws_its_own_batch(monkeypatch) -> None:
    """Batches come from a generator seeded by the step: the steps see different sequences."""
    data, w = _data(), kt.head_weight(MODEL)
    picks = []
    real = kt.batch_loss

    def spy(adapter, d, w_head, gen, cfg):
        probe = torch.Generator()
        probe.set_state(gen.get_state())
        picks.append(tuple(torch.randperm(len(d), generator=probe)[: cfg.batch].tolist()))
        return real(adapter, d, w_head, gen, cfg)

    monkeypatch.setattr(kt, "batch_loss", spy)
    kt.train(kt.new_adapter(MODEL, 2, seed=1), data, w, kt.TrainConfig(steps=6, batch=2, positions=8, warmup=1))
    assert len(picks) == 6 and len(set(picks)) > 1


def test_prompt_i_is_continued_at_temperature_i_across_batches() -> None:
    """Prompt i is continued at ``temperatures[i % len]`` whatever batch it falls in: with batches
    of 3, the greedy prompts (even i) continue as a greedy decode alone does, the others not."""
    out = kt.continue_batched(MODEL, PROMPTS, new_tokens=6, temperatures=(0.0, 5.0), batch=3, seed=3)
    same = []
    for i, p in enumerate(PROMPTS):
        alone = kt.continue_batched(MODEL, [p], new_tokens=6, temperatures=(0.0,), batch=1)[0]
        same.append(torch.equal(out[i], alone))
    assert same[0::2] == [True, True, True]
    assert not any(same[1::2])  # (at T = 5 this seed's samples leave the greedy path)


def test_a_continuation_stops_at_an_end_of_sequence_token() -> None:
    greedy = kt.continue_batched(MODEL, PROMPTS[:2], new_tokens=6, temperatures=(0.0,))
    eos = int(greedy[0][len(PROMPTS[0])])  # prompt 0's first greedy token
    out = kt.continue_batched(MODEL, PROMPTS[:2], new_tokens=6, temperatures=(0.0,), eos_ids=frozenset({eos}))
    assert out[0].tolist() == PROMPTS[0] + [eos]
    cut = greedy[1].tolist()
    stop = next((j + 1 for j in range(len(PROMPTS[1]), len(cut)) if cut[j] == eos), len(cut))
    assert out[1].tolist() == cut[:stop]


def test_held_out_scores_of_the_target_itself_are_one() -> None:
    """A view running every layer drafts the target's own law: α₀ = α₁ = 1 over the continuation
    positions (the draft's and the target's laws at the same positions)."""
    full = LayerView(MODEL, LayerPlan.skipping(MODEL.cfg.n_layers, set(), set()))
    rep = kt.held_out_acceptance(MODEL, {"full": full}, _data()[:3])
    assert rep["full"] == {"alpha_t0": 1.0, "alpha_t1": 1.0}


def test_every_step_clips_the_adapters_gradients_to_norm_one(monkeypatch) -> None:
    """Each optimiser step first clips the gradient of all the adapter's parameters (and only
    those: the target stays frozen) to a total norm of 1."""
    adapter = kt.new_adapter(MODEL, 2, seed=1)
    calls = []
    real = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *a, **k):
        params = list(params)
        calls.append((max_norm, {id(p) for p in params}))
        real(params, max_norm, *a, **k)
        assert torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])) <= max_norm + 1e-5

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    kt.train(adapter, _data(), kt.head_weight(MODEL), kt.TrainConfig(steps=3, batch=2, positions=8, warmup=1))
    mine = {id(p) for p in adapter.parameters()}
    assert [(n, ids == mine) for n, ids in calls] == [(1.0, True)] * 3


def test_all_144_built_in_prompts_are_distinct_and_interleaved():
    """--prompts allows up to 144: the 128 chat prompts and 16 code headers, chat and code
    alternating while both last, every prompt once."""
    prompts = kt.training_prompts(144)
    assert len(prompts) == 144 and len(set(prompts)) == 144
    assert sum(not chat for _, chat in prompts) == 16
    assert [chat for _, chat in prompts[:4]] == [True, False, True, False]
    assert kt.training_prompts(10) == prompts[:10]


def test_the_seed_decides_the_adapters_initial_weights():
    """--seed is the seed "of the data order and the initialisation": new_adapter passes it on."""
    model = tiny_native(vocab=11, layers=4, batch_invariant=False)
    a, b, c = kt.new_adapter(model, 2, seed=1), kt.new_adapter(model, 2, seed=1), kt.new_adapter(model, 2, seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not all(torch.equal(x, z) for x, z in zip(a.parameters(), c.parameters()))


def test_the_command_scores_every_continuation_position_of_train_and_held_out_sequences(tmp_path, capsys):
    """Each sequence's features start at its last prompt token (the position whose law is the first
    continuation token), for the training and the held-out prompts alike, so the held-out report
    counts every continuation token."""
    from specdec.cli import main
    from specdec.models.registry import load_tokenizer
    from specdec.text import encode_prompt
    from tiny import make_tiny

    target = make_tiny(tmp_path / "target", seed=0, layers=4, max_positions=256)
    out = tmp_path / "k" / "adapter.safetensors"
    assert main(["train", "kangaroo", "--target", str(target), "--out", str(out), "--prompts", "2", "--new-tokens", "4",
                 "--batch", "2", "--positions", "8", "--steps", "1", "--top-k", "4"]) == 0
    capsys.readouterr()
    saved = torch.load(out.with_name(out.name + ".data.pt"), weights_only=False)
    tok = load_tokenizer(target)
    for feats, prompts in ((saved["train"], kt.training_prompts(2)), (saved["held_out"], kt.HELD_OUT)):
        assert len(feats) == len(prompts)
        for f, (text, chat) in zip(feats, prompts):
            ids = encode_prompt(tok, text, chat=chat)
            assert f.start == len(ids) - 1 and f.tokens[: len(ids)].tolist() == list(ids)


OTHER = tiny_native(vocab=11, layers=4, seed=7)


def _adapter():
    """An adapter whose attention counts (its output projection is not zero)."""
    adapter = kt.new_adapter(INVARIANT, 2, seed=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        adapter.out.copy_(torch.randn(adapter.out.shape, generator=g) * 0.3)
    return adapter


def _argmax() -> DraftSampler:
    return DraftSampler(SamplingConfig(temperature=0.0), "argmax", penalties=None, generator=None)


def _cache_after(drafter: KangarooDrafter, prompt: list[int]):
    run = SamplingConfig(temperature=0.0, max_new_tokens=12)
    SpeculativeDecoder(INVARIANT, drafter, get_rule("greedy"), gamma=FixedGamma(3)).generate(prompt, run)
    c = drafter.cache
    return c.length, c.k[:, :, : c.length].clone(), c.resid[: c.length].clone()


def test_a_drafter_reused_for_a_second_sequence_holds_what_a_fresh_one_holds():
    """The tapped features are per sequence: after a first generation, a second one (another
    prompt) leaves the view's cache (keys of every layer, the adapter's included, and the
    residuals) exactly as a fresh drafter's after that generation alone."""
    adapter = _adapter()
    reused = KangarooDrafter(KangarooView(INVARIANT, adapter), stop_below=0.0)
    assert reused.feature_taps == (2,)
    _cache_after(reused, [1, 2, 3, 4, 5, 6, 7])
    n, k, resid = _cache_after(reused, [3, 1, 2])
    fresh_n, fresh_k, fresh_resid = _cache_after(KangarooDrafter(KangarooView(INVARIANT, adapter), stop_below=0.0), [3, 1, 2])
    assert n == fresh_n and torch.equal(resid, fresh_resid) and torch.equal(k, fresh_k)


def test_spawn_keeps_cache_sharing_off():
    """``spawn`` keeps every setting: a drafter built with ``share=False`` spawns one without it."""
    view = KangarooView(INVARIANT, _adapter())
    assert KangarooDrafter(view, stop_below=0.3).spawn().share
    off = KangarooDrafter(view, stop_below=0.3, share=False)
    assert not off.spawn().share


def test_no_feature_tap_without_cache_sharing():
    """The tap is asked for only where the target's pass can reuse the draft's layers (``share``)."""
    view = KangarooView(INVARIANT, _adapter())
    assert KangarooDrafter(view, stop_below=0.0).feature_taps == (2,)
    assert KangarooDrafter(view, stop_below=0.0, share=False).feature_taps is None


def test_a_view_takes_nothing_from_another_models_cache():
    """``bind_target`` binds only the view's own target: with another model's cache (and features)
    handed over, the view computes the committed positions itself, as an unbound view does."""
    ctx = torch.tensor([1, 3, 0, 2, 4, 1, 1])
    cache = OTHER.new_cache(32)
    OTHER.forward(ctx[:-1], cache)
    adapter = _adapter()
    bound = KangarooDrafter(KangarooView(INVARIANT, adapter), stop_below=0.0)
    bound.bind_target(OTHER, cache)
    bound.prepare(ctx)
    bound.add_features(torch.randn(ctx.numel() - 1, 2, INVARIANT.cfg.hidden_size))
    unbound = KangarooDrafter(KangarooView(INVARIANT, adapter), stop_below=0.0)
    unbound.prepare(ctx)
    assert torch.equal(bound.propose(ctx, 3, _argmax()).tokens, unbound.propose(ctx, 3, _argmax()).tokens)
    n = ctx.numel() - 1
    assert torch.equal(bound.cache.k[:, :, :n], unbound.cache.k[:, :, :n])
    assert torch.equal(bound.cache.resid[:n], unbound.cache.resid[:n])


def test_an_adapter_file_without_a_config_is_a_config_error(tmp_path):
    """A tagged file whose metadata lacks the config is refused as a one-line ConfigError."""
    from safetensors.torch import load_file, save_file

    adapter = kt.new_adapter(INVARIANT, 2, seed=1)
    save_adapter(adapter, tmp_path / "a.safetensors")
    save_file(load_file(str(tmp_path / "a.safetensors")), str(tmp_path / "noconfig.safetensors"),
              metadata={"format": "specdec-kangaroo-adapter", "card": "{}"})
    with pytest.raises(ConfigError, match="cannot read kangaroo adapter"):
        load_adapter(tmp_path / "noconfig.safetensors")


def test_an_adapter_loads_in_the_dtype_asked_for(tmp_path):
    """``load_adapter(dtype=...)``: the weights come back in that dtype (a bfloat16 target's)."""
    save_adapter(kt.new_adapter(INVARIANT, 2, seed=1), tmp_path / "a.safetensors")
    back, _ = load_adapter(tmp_path / "a.safetensors", dtype=torch.bfloat16)
    assert {p.dtype for p in back.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load_adapter(tmp_path / "a.safetensors")[0].parameters()} == {torch.float32}


def test_a_views_cache_holds_keys_and_values_in_the_targets_kv_dtype():
    """With ``--kv-dtype float16`` the view's own cache rounds its keys and values as the target's
    does: the view's layers must see what the target's pass would see for the same tokens."""
    target = tiny_native(vocab=11, layers=4)
    try:
        target.set_kv_dtype(torch.float16)
    except ValueError:
        pytest.skip("a float16 key/value cache needs specdec's compiled attention kernel")
    cache = KangarooView(target, kt.new_adapter(target, 2, seed=1)).new_cache(16)
    assert cache.k.dtype == cache.v.dtype == torch.float16


def test_the_seed_decides_the_order_of_the_chat_prompts() -> None:
    """``--seed`` is the seed of the data order: another seed shuffles the chat prompts otherwise
    (the same 144 prompts, code headers in the same places)."""
    a, b = kt.training_prompts(144, seed=0), kt.training_prompts(144, seed=1)
    assert a != b and set(a) == set(b)
    assert [chat for _, chat in a] == [chat for _, chat in b]
    assert kt.training_prompts(144, seed=1) == b


def test_the_seed_decides_the_batches(monkeypatch) -> None:
    """Each step's generator is seeded by the config's seed and the step: two seeds draw other batches."""
    data, w = _data(), kt.head_weight(MODEL)
    picks: dict[int, list[tuple[int, ...]]] = {}
    real = kt.batch_loss
    for seed in (0, 1):
        def spy(adapter, d, w_head, gen, cfg, seed=seed):
            probe = torch.Generator()
            probe.set_state(gen.get_state())
            picks.setdefault(seed, []).append(tuple(torch.randperm(len(d), generator=probe)[: cfg.batch].tolist()))
            return real(adapter, d, w_head, gen, cfg)

        monkeypatch.setattr(kt, "batch_loss", spy)
        kt.train(kt.new_adapter(MODEL, 2, seed=1), data, w, kt.TrainConfig(steps=4, batch=2, positions=8, warmup=1, seed=seed))
    assert picks[0] != picks[1]


def test_weight_decay_reaches_the_optimiser_and_a_resume_leaves_the_callers_state_alone() -> None:
    """AdamW's own default weight decay is 0.01, the config's 0.0: the optimiser gets the config's.
    Resuming from a checkpoint dict does not grow that dict's loss list."""
    data, w = _data(), kt.head_weight(MODEL)
    states: list[dict] = []
    cfg = kt.TrainConfig(steps=2, batch=2, positions=8, warmup=1)
    kt.train(kt.new_adapter(MODEL, 2, seed=1), data, w, cfg, on_step=lambda s, loss, st: states.append(st))
    assert [g["weight_decay"] for g in states[-1]["optimizer"]["param_groups"]] == [0.0]
    st = {**states[-1], "losses": list(states[-1]["losses"])}  # the checkpoint of step 2
    kt.train(kt.new_adapter(MODEL, 2, seed=1), data, w, replace(cfg, steps=3), state=st)
    assert len(st["losses"]) == 2


def test_the_draft_law_uses_the_adapters_own_norm_epsilon_and_training_ends_in_eval_mode() -> None:
    """``draft_log_probs`` normalises with the adapter config's rms_eps (the target's), not a constant."""
    cfg = replace(AdapterConfig.for_target(MODEL.cfg, 2), rms_eps=0.5)
    adapter = Adapter(cfg, seed=0)
    h = torch.randn(3, cfg.hidden_size) * 0.1
    w = kt.head_weight(MODEL)
    want = torch.log_softmax((h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 0.5)) @ w.T, -1)
    torch.testing.assert_close(kt.draft_log_probs(adapter, h, w), want)
    a = kt.new_adapter(MODEL, 2, seed=1)
    kt.train(a, _data(), w, kt.TrainConfig(steps=1, batch=2, positions=8, warmup=1))
    assert a.training is False


def test_the_report_counts_the_continuation_positions_it_scores() -> None:
    """``held_out_positions`` is the number of positions α is averaged over: L - 1 - start per sequence."""
    data = _data()[:2]
    rep = kt.report(MODEL, kt.new_adapter(MODEL, 2, seed=1), data)
    assert rep["held_out_positions"] == sum(len(f.tokens) - 1 - f.start for f in data)
    assert rep["held_out_positions"] == sum(f.tokens[f.start:-1].numel() for f in data)
