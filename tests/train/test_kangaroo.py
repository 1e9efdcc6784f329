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
