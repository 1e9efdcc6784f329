"""Draft-head training: the training-time-test pattern is what drafting computes, the loop learns and resumes."""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specdec.errors import ConfigError
from specdec.heads.modules import Eagle, HeadConfig, build, load_head, rope_tables, save_head, ttt_mask
from specdec.train import heads as th
from specdec.train.data import Shard, load_shards
from specdec.train.heads import (
    Batch,
    TargetHead,
    TrainConfig,
    draft_vocabulary,
    evaluate,
    expected_tokens_per_call,
    loss_fn,
    reply_mask,
    score,
    step_outputs,
    train,
)

D, V = 32, 64


def _cfg(kind: str, **kw) -> HeadConfig:
    base = dict(kind=kind, hidden_size=D, n_heads=4, n_kv_heads=2, head_dim=8, intermediate_size=64, target_vocab=V,
                draft_vocab=V, inputs=(0, 1, 2) if kind == "eagle3" else (3,), taps=(1, 2, 3), depth=3)
    return HeadConfig(**(base | kw))


def test_ttt_mask_pattern() -> None:
    # step 2, 4 positions: step-0 keys at <= t-2, step-1 key at t-1, step-2 key at t
    m = ttt_mask(4, 2).int()
    expect = torch.tensor([
        [0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1],
    ])
    assert torch.equal(m, expect)


@pytest.mark.parametrize("kind", ["eagle3", "eagle1"])
def test_training_time_test_matches_incremental_drafting(kind: str) -> None:
    """Step s of the batched training pass at row t equals drafting step s after committing
    tokens 0..t-s+1 with the target's features, the draft feeding its own outputs back."""
    torch.manual_seed(0)
    head = build(_cfg(kind)).eval()
    assert isinstance(head, Eagle)
    n = 12
    tokens = torch.randint(0, V, (1, n))
    feats = torch.randn(1, n, 4, D)
    embed = torch.randn(V, D)
    batch = Batch(tokens, feats, torch.tensor([n]), torch.tensor([1]))
    with torch.no_grad():
        outs = step_outputs(head, batch, embed)
        attn = head.layer.attn
        for c in (3, 6, 8):  # committed tokens x_0..x_c, features known at positions <= c-1
            g0 = head.fuse(feats)[0]  # [n, D]
            keys, values = [], []
            o_prev = None
            for s in range(3):
                pos = c - 1 + s
                if s == 0:  # the committed context: positions 0..c-1 with the target's features
                    rows = torch.arange(c)
                    g = g0[:c]
                    tok = tokens[0, 1 : c + 1]
                else:  # drafting step s: own output as the feature, the (teacher-forced) drafted token
                    rows = torch.tensor([pos])
                    g = o_prev
                    tok = tokens[0, pos + 1 : pos + 2]
                cos, sin = rope_tables(rows, 8, 10000.0)
                x_in, resid = head.layer_input(g[None], embed[tok][None])
                q, k, v = attn.project(x_in, cos, sin)
                keys.append(k)
                values.append(v)
                kk, vv = torch.cat(keys, 2), torch.cat(values, 2)
                mask = None
                if s == 0:
                    mask = torch.ones(c, c, dtype=torch.bool).tril()
                o = head.layer.finish(resid, attn.attend(q, kk, vv, mask))[0]  # [rows, D]
                o_prev = o[-1:]
                logits, _, _, _ = outs[s]
                torch.testing.assert_close(head.logits(o[-1]), logits[0, pos], atol=1e-5, rtol=1e-5)


def _toy_data(folder: Path, *, sequences: int = 40, seed: int = 0) -> tuple[TargetHead, Path]:
    """Sequences from a fixed bigram law; features = a fixed random embedding of the current token
    (so the next token's law is a function of the feature); the target head is consistent with it."""
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(V, D, generator=g)
    head = torch.randn(V, D, generator=g)
    feat_of = torch.randn(V, D, generator=g)  # feature of a position = function of its token
    shard = Shard()
    for i in range(sequences):
        n = 20 + i % 7
        ids = [int(torch.randint(0, V, (1,), generator=g))]
        for _ in range(n - 1):
            p = torch.softmax(feat_of[ids[-1]] @ head.T, -1)
            ids.append(int(torch.multinomial(p, 1, generator=g)))
        t = torch.tensor(ids)
        f = feat_of[t]  # [n, D]
        shard.tokens.append(t.to(torch.int32))
        shard.prompt_len.append(3)
        shard.temperature.append(1.0)
        shard.kind.append("chat" if (i // 20) % 2 else "code")  # held out (i % 20 == 0): one of each
        shard.feats.append(torch.stack([f * 0.5, f * 2, -f, f], dim=1).half())
    folder.mkdir(parents=True, exist_ok=True)
    shard.save(folder / "shard-00000.pt")
    (folder / "config.json").write_text(json.dumps({"taps": [1, 2, 3]}))

    class Cfg:
        hidden_size, n_heads, n_kv_heads, head_dim, intermediate_size = D, 4, 2, 8, 64
        vocab_size, rms_eps, rope_theta = V, 1e-6, 10000.0

    return TargetHead(embed, head, (0,), "toy", Cfg()), folder


@pytest.mark.parametrize("kind", ["eagle3", "eagle1", "medusa", "mtp"])
def test_training_improves_held_out_acceptance(tmp_path: Path, kind: str) -> None:
    """40 steps on 40 toy sequences (2 held out): the held-out step-1 acceptance rises clearly."""
    target, data = _toy_data(tmp_path / "data")
    cfg = TrainConfig(kind=kind, steps=40, batch_tokens=128, lr=3e-3, draft_vocab=V, depth=2, eval_every=1000, warmup=5)
    report = train(cfg, data, tmp_path / "out", target)
    first = report["history"][0]["ce"][0]
    last = report["history"][-1]["ce"][0]
    assert last < first - 0.2, (first, last)
    head = load_head(tmp_path / "out")
    assert head.cfg.kind == kind
    # an untrained head of the same shape does clearly worse on the same held-out rows

    shards = load_shards(data)
    fresh = build(head.cfg)
    with torch.no_grad():
        fresh.d2t.copy_(head.d2t)
        fresh.lm_head.weight.copy_(target.head[head.d2t])
        if kind == "medusa":
            for blk in fresh.blocks:
                torch.nn.init.normal_(blk.weight, std=0.3)
    held = [i for i in range(len(shards.tokens)) if i % 20 == 0]
    rep = evaluate(head, shards, held, target, head.d2t, 128)
    trained = rep["steps"][0]["accept_t1"]
    # the per-kind figures partition the overall ones
    kinds = rep["by_kind"]
    assert sorted(kinds) == ["chat", "code"]
    for k, overall in enumerate(rep["steps"]):
        parts = [steps[k] for steps in kinds.values()]
        assert sum(p["positions"] for p in parts) == overall["positions"]
        weighted = sum(p["top1"] * p["positions"] for p in parts) / overall["positions"]
        assert abs(weighted - overall["top1"]) < 1e-9
    baseline = evaluate(fresh, shards, held, target, head.d2t, 128)["steps"][0]["accept_t1"]
    # (Medusa's head 1 guesses two tokens ahead from the current token's feature alone: low in absolute terms)
    assert trained > 2 * baseline and trained > baseline + 0.02, (trained, baseline)


def _assert_same_head(one: Path, other: Path) -> None:
    """The heads the runs in ``one`` and ``other`` saved are bitwise equal."""
    a = torch.load(one / "ckpt.pt", weights_only=False)["model"]
    b = torch.load(other / "ckpt.pt", weights_only=False)["model"]
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_resume_gives_the_same_head(tmp_path: Path) -> None:
    target, data = _toy_data(tmp_path / "data", sequences=24)
    cfg = TrainConfig(kind="eagle3", steps=12, batch_tokens=128, lr=1e-3, draft_vocab=V, depth=2, eval_every=1000,
                      warmup=2, ckpt_every=4)
    train(cfg, data, tmp_path / "whole", target)
    train(cfg, data, tmp_path / "split", target, stop_after=5)
    train(cfg, data, tmp_path / "split", target)
    _assert_same_head(tmp_path / "whole", tmp_path / "split")


def test_a_checkpoint_of_another_head_or_data_is_refused_not_continued(tmp_path: Path, capsys) -> None:
    """A folder's checkpoint is continued only by the run that made it (a larger step count
    extends it): a Medusa run on an EAGLE-3 folder trained the EAGLE head on and wrote a card
    calling it Medusa; other data (another target's taps) mixed in silently."""
    from specdec.errors import ConfigError

    target, data = _toy_data(tmp_path / "data", sequences=24)
    cfg = TrainConfig(kind="eagle3", steps=4, batch_tokens=128, lr=1e-3, draft_vocab=V, depth=2, eval_every=1000, warmup=2)
    train(cfg, data, tmp_path / "out", target)
    report = train(replace(cfg, steps=6), data, tmp_path / "out", target)  # continues
    assert report["steps"] == 6 and "resuming from step 4" in capsys.readouterr().err
    card = (tmp_path / "out" / "README.md").read_text()
    for other, says in ((replace(cfg, kind="medusa"), 'kind = "eagle3", this one asks for "medusa"'),
                        (replace(cfg, lr=0.1), "lr = 0.001, this one asks for 0.1")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            train(other, data, tmp_path / "out", target)
    other_data = tmp_path / "data2"
    shutil.copytree(data, other_data)
    (other_data / "config.json").write_text(json.dumps({"taps": [1, 2]}))
    with pytest.raises(ConfigError, match="was saved by a run with data ="):
        train(cfg, other_data, tmp_path / "out", target)
    assert (tmp_path / "out" / "README.md").read_text() == card
    (tmp_path / "out" / "ckpt.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="ckpt.pt cannot be read .* delete it to redo that part"):
        train(cfg, data, tmp_path / "out", target)


def test_save_load_round_trip(tmp_path: Path) -> None:
    head = build(_cfg("mtp", depth=2))
    save_head(head, tmp_path / "h", dtype=torch.float32)
    back = load_head(tmp_path / "h")
    for (k1, v1), (k2, v2) in zip(head.state_dict().items(), back.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2)


def test_draft_vocabulary_keeps_frequent_reply_tokens_and_eos() -> None:
    shard = Shard(tokens=[torch.tensor([9, 9, 9, 1, 1, 5], dtype=torch.int32)], prompt_len=[3], temperature=[0.0], kind=["chat"],
                  feats=[torch.zeros(6, 1, 2)])
    d2t = draft_vocabulary(shard, 2, 16, always=(7,))
    assert d2t.tolist() == [1, 7]  # 9 is a prompt token only; 1 beats 5; eos 7 always kept


def test_expected_tokens_per_call() -> None:
    assert expected_tokens_per_call([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def test_ctrl_c_saves_the_step_in_progress_and_the_run_resumes_there(tmp_path: Path, capsys) -> None:
    """Ctrl-C (or SIGTERM) while a head trains: the step in progress ends, its state is saved and
    the run stops; the same command goes on from there to the head an uninterrupted run makes.
    (Checkpoints come every 4 steps here: the signal at step 5 used to lose step 5.)"""
    import os
    import signal

    target, data = _toy_data(tmp_path / "data", sequences=24)
    cfg = TrainConfig(kind="eagle3", steps=8, batch_tokens=128, lr=1e-3, draft_vocab=V, depth=2, eval_every=1000,
                      warmup=2, ckpt_every=4)
    train(cfg, data, tmp_path / "whole", target)

    def progress(step, loss, parts):
        if step == 5:
            os.kill(os.getpid(), signal.SIGINT)  # arrives during the progress call: noted, not raised

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, data, tmp_path / "split", target, progress=progress)
    assert torch.load(tmp_path / "split" / "ckpt.pt", weights_only=False)["step"] == 5
    assert "saved at step 5" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is before  # put back
    train(cfg, data, tmp_path / "split", target)
    _assert_same_head(tmp_path / "whole", tmp_path / "split")


def test_reply_mask_keeps_every_label_of_a_reply_token_and_only_those() -> None:
    """Row t (label offset o) is the target's law at t + o, predicting token t + o + 1: it counts
    exactly when that token is a reply token (the last prompt position predicts the first reply
    token) and the position exists; ``first`` drops the rows an EAGLE step s has no input for."""
    batch = Batch(torch.zeros(2, 7, dtype=torch.long), torch.zeros(2, 7, 1, 2), torch.tensor([6, 7]), torch.tensor([3, 1]))
    m = reply_mask(batch, 0, 7).int().tolist()
    assert m == [[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]]
    m = reply_mask(batch, 1, 6).int().tolist()  # row t: law at t + 1
    assert m == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    m = reply_mask(batch, 1, 6, first=2).int().tolist()
    assert m == [[0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1]]
    # EAGLE step s masks its first s rows (their input feature is padding, not a drafted one)
    torch.manual_seed(0)
    head = build(_cfg("eagle3")).eval()
    b = Batch(torch.randint(0, V, (1, 10)), torch.randn(1, 10, 4, D), torch.tensor([10]), torch.tensor([1]))
    with torch.no_grad():
        masks = [mask[0].int().tolist() for _, _, mask, _ in step_outputs(head, b, torch.randn(V, D))]
    assert masks == [[1] * 9, [0] + [1] * 8, [0, 0] + [1] * 7]


def _batch(seed: int = 0) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = 10
    batch = Batch(torch.randint(0, V, (2, n), generator=g), torch.randn(2, n, 4, D, generator=g), torch.tensor([n, 8]),
                  torch.tensor([2, 3]))
    return batch, torch.randn(V, D, generator=g), torch.randn(V, D, generator=g)


@pytest.mark.parametrize("kind", ["eagle3", "medusa", "mtp"])
def test_the_loss_weighs_draft_step_k_by_step_decay_to_the_k(kind: str) -> None:
    """The loss is Σ_k step_decay^k · CE_k (the later steps count less, as the config says)."""
    torch.manual_seed(0)
    batch, embed, w = _batch()
    model = build(_cfg(kind))
    cfg = TrainConfig(kind=kind, depth=3, step_decay=0.5)
    loss, parts = loss_fn(model, batch, embed, w, cfg)
    assert len(parts) == 3
    assert float(loss.detach()) == pytest.approx(sum(0.5**k * c for k, c in enumerate(parts)), rel=1e-5)


def test_eagle1_loss_is_the_feature_regression_plus_a_tenth_of_the_cross_entropy() -> None:
    """EAGLE-1: per step ``regression · smooth-L1(o_t, f_{t+1}) + 0.1 · CE``: the predicted feature of
    row t is compared with the target's feature at t + 1 (the position whose law row t's logits
    are scored against), on the masked rows only."""
    torch.manual_seed(0)
    batch, embed, w = _batch()
    model = build(_cfg("eagle1"))
    loss0, parts = loss_fn(model, batch, embed, w, TrainConfig(kind="eagle1", depth=3, regression=0.0))
    assert float(loss0.detach()) == pytest.approx(0.1 * sum(0.8**k * c for k, c in enumerate(parts)), rel=1e-5)
    loss, parts = loss_fn(model, batch, embed, w, TrainConfig(kind="eagle1", depth=3, regression=2.0))
    expect = 0.0
    for k, (_, off, mask, o) in enumerate(step_outputs(model, batch, embed)):
        n = o.shape[1]
        want = batch.feats[:, 1 : 1 + n, -1]  # the feature at t + 1
        per = torch.nn.functional.smooth_l1_loss(o, want, reduction="none").mean(-1)
        reg = float(((per * mask).sum() / mask.sum()).detach())
        expect += 0.8**k * (2.0 * reg + 0.1 * parts[k])
    assert float(loss.detach()) == pytest.approx(expect, rel=1e-5)


def test_held_out_scores_map_the_draft_vocabulary_to_target_ids(monkeypatch) -> None:
    """A draft that is the target's own law renormalised over a reduced draft vocabulary (odd ids):
    its E[min(p, q)] is the target's mass on that vocabulary, its top-1 agrees exactly where the
    target's argmax is in the vocabulary (draft index → target id through d2t), and vocab_mass is
    that mass, not 1."""
    batch, _, head = _batch(1)
    head = head * 3  # peaked laws, so that the argmax is in and out of the vocabulary
    d2t = torch.arange(1, V, 2)
    f = batch.feats[:, :, -1]
    n = batch.tokens.shape[1] - 1
    mask = reply_mask(batch, 1, n)
    logits = f[:, 1 : 1 + n] @ head[d2t].T  # the target's logits restricted to the draft vocabulary
    monkeypatch.setattr(th, "step_outputs", lambda model, b, embed: [(logits, 1, mask, None)])
    sums: dict[int, list[float]] = {}
    score(None, batch, torch.zeros(V, D), head, d2t, sums)
    accept, agree, mass, count = sums[0]
    rows = mask.nonzero(as_tuple=True)
    p = torch.softmax(f[:, 1 : 1 + n][rows] @ head.T, -1)
    in_vocab = torch.isin(p.argmax(-1), d2t)
    assert 0 < int(in_vocab.sum()) < int(in_vocab.numel())  # the case is not degenerate
    assert count == in_vocab.numel()
    assert mass == pytest.approx(float(p[:, d2t].sum()), rel=1e-5) and mass < count - 1
    assert accept == pytest.approx(mass, rel=1e-4)
    assert agree == int(in_vocab.sum())


def test_held_out_sequences_are_never_trained_on(tmp_path: Path, monkeypatch) -> None:
    """Every 20th sequence is held out: the training batches hold every other sequence (over
    enough steps for an epoch) and none of the held-out ones, so the held-out report is not
    scored on what was learnt."""
    target, data = _toy_data(tmp_path / "data")
    shards = load_shards(data)
    seen: set[tuple[int, ...]] = set()
    real = th.loss_fn

    def spy(model, batch, embed, w, cfg):
        for row, n in zip(batch.tokens, batch.length):
            seen.add(tuple(row[: int(n)].tolist()))
        return real(model, batch, embed, w, cfg)

    monkeypatch.setattr(th, "loss_fn", spy)
    cfg = TrainConfig(kind="medusa", steps=30, batch_tokens=128, lr=1e-3, draft_vocab=V, depth=1, eval_every=1000, warmup=2)
    report = train(cfg, data, tmp_path / "out", target)
    held = {tuple(shards.tokens[i].tolist()) for i in range(len(shards.tokens)) if i % 20 == 0}
    rest = {tuple(shards.tokens[i].tolist()) for i in range(len(shards.tokens)) if i % 20 != 0}
    assert seen == rest and not (seen & held)
    assert report["train_sequences"] == 38 and report["held_out_sequences"] == 2


@pytest.mark.parametrize("kind", ["eagle1", "medusa", "mtp"])
def test_the_targets_lm_head_rows_stay_frozen(tmp_path: Path, kind: str) -> None:
    """Every kind but EAGLE-3 drafts through the target's own LM-head rows: training leaves them
    the target's exactly and does not count them as trained parameters."""
    target, data = _toy_data(tmp_path / "data", sequences=24)
    cfg = TrainConfig(kind=kind, steps=3, batch_tokens=128, lr=1e-2, draft_vocab=V, depth=2, eval_every=1000, warmup=1)
    report = train(cfg, data, tmp_path / "out", target)
    model = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=False)["model"]
    assert torch.equal(model["lm_head.weight"], target.head[model["d2t"]])
    assert report["params_trained"] == report["params_total"] - V * D


def test_a_run_that_dies_keeps_its_last_periodic_checkpoint(tmp_path: Path) -> None:
    """``ckpt_every``: a run killed by an error (not a signal) at step 6 leaves the checkpoint of step 4."""
    target, data = _toy_data(tmp_path / "data", sequences=24)
    cfg = TrainConfig(kind="eagle3", steps=8, batch_tokens=128, lr=1e-3, draft_vocab=V, depth=2, eval_every=1000,
                      warmup=2, ckpt_every=4)

    def progress(step, loss, parts):
        if step == 6:
            raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        train(cfg, data, tmp_path / "out", target, progress=progress)
    assert torch.load(tmp_path / "out" / "ckpt.pt", weights_only=False)["step"] == 4


def test_medusa_head_k_scores_the_law_k_plus_one_ahead_on_reply_rows() -> None:
    """Medusa head k, row t: the target's law at t + k + 1 (predicting token t + k + 2), so the
    row counts where that position exists (padding rows do not) and that token is a reply token."""
    torch.manual_seed(0)
    head = build(_cfg("medusa", depth=2)).eval()
    b = Batch(torch.randint(0, V, (2, 7)), torch.randn(2, 7, 4, D), torch.tensor([7, 5]), torch.tensor([3, 4]))
    with torch.no_grad():
        outs = step_outputs(head, b, torch.randn(V, D))
    assert [off for _, off, _, _ in outs] == [1, 2]
    assert outs[0][2].int().tolist() == [[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]]
    assert outs[1][2].int().tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]


def test_the_draft_vocabulary_counts_reply_tokens_only_and_always_keeps_eos() -> None:
    """The last prompt token is context, not a reply token (9 here, twice, would beat 1); the
    end-of-sequence id is kept even where the most frequent reply token would tie with it."""
    shard = Shard(tokens=[torch.tensor([9, 1, 5, 5], dtype=torch.int32), torch.tensor([9, 5], dtype=torch.int32)],
                  prompt_len=[1, 1], temperature=[0.0, 0.0], kind=["chat", "chat"], feats=[torch.zeros(4, 1, 2), torch.zeros(2, 1, 2)])
    assert draft_vocabulary(shard, 3, 16, always=(7,)).tolist() == [1, 5, 7]
    assert draft_vocabulary(shard, 1, 16, always=(0,)).tolist() == [0]  # eos (never seen) beats 5 (3 times), not ties it


def test_step_s_trains_at_the_schedules_rate_for_s_across_a_resume(tmp_path: Path, monkeypatch) -> None:
    """Step s (0-based) of the run trains at ``warmup_cosine(s)``: the first at the warm-up's first
    rate, none skipped or repeated where a run stops and resumes."""
    target, data = _toy_data(tmp_path / "data", sequences=24)
    asked: list[int] = []
    real = th.warmup_cosine
    monkeypatch.setattr(th, "warmup_cosine", lambda s, total, warmup: asked.append(s) or real(s, total, warmup))
    cfg = TrainConfig(kind="medusa", steps=6, batch_tokens=128, lr=1e-3, draft_vocab=V, depth=1, eval_every=1000, warmup=3)
    first = train(cfg, data, tmp_path / "out", target, stop_after=2)
    assert first["steps"] == 2 and first["finished"] is False
    report = train(cfg, data, tmp_path / "out", target)
    assert asked == [0, 1, 2, 3, 4, 5]
    assert report["steps"] == 6 and report["finished"] is True


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_padding_rows_do_not_enter_the_loss(kind: str) -> None:
    """The loss is the mean over the masked (reply, in-sequence) rows: what the padding of a
    shorter sequence holds changes nothing."""
    torch.manual_seed(0)
    batch, embed, w = _batch()
    model = build(_cfg(kind))
    cfg = TrainConfig(kind=kind, depth=2)
    other = Batch(batch.tokens.clone(), batch.feats.clone(), batch.length, batch.prompt_len)
    other.tokens[1, 8:] = torch.tensor([5, 6])
    other.feats[1, 8:] = 10 * torch.randn(2, 4, D)
    a, _ = loss_fn(model, batch, embed, w, cfg)
    b, _ = loss_fn(model, other, embed, w, cfg)
    assert float(a.detach()) == pytest.approx(float(b.detach()), rel=1e-6)


def test_a_resume_past_an_epoch_gives_the_same_head(tmp_path: Path) -> None:
    """Each epoch is shuffled by seed + epoch: a run stopped in its second epoch and resumed
    continues with that epoch's order, so it ends where an uninterrupted run does."""
    target, data = _toy_data(tmp_path / "data", sequences=24)
    cfg = TrainConfig(kind="medusa", steps=14, batch_tokens=128, lr=1e-3, draft_vocab=V, depth=1, eval_every=1000, warmup=2)
    whole = train(cfg, data, tmp_path / "whole", target)
    assert whole["epochs"] >= 2
    train(cfg, data, tmp_path / "split", target, stop_after=9)
    assert torch.load(tmp_path / "split" / "ckpt.pt", weights_only=False)["epoch"] >= 1
    train(cfg, data, tmp_path / "split", target)
    _assert_same_head(tmp_path / "whole", tmp_path / "split")


def test_rate_table_divides_each_count_by_the_positions() -> None:
    from specdec.train.heads import rate_table

    rep = rate_table({"chat": {0: [2.0, 3.0, 4.0, 8.0]}, "code": {0: [1.0, 1.0, 2.0, 2.0]}})
    assert rep["steps"] == [{"step": 1, "accept_t1": 0.3, "top1": 0.4, "vocab_mass": 0.6, "positions": 10}]
    assert rep["by_kind"]["chat"] == [{"step": 1, "accept_t1": 0.25, "top1": 0.375, "vocab_mass": 0.5, "positions": 8}]


@pytest.mark.parametrize("kind", ["eagle1", "medusa", "mtp"])
def test_heads_but_eagle3_read_the_final_feature(tmp_path: Path, kind: str) -> None:
    """The data holds the taps' features then the final one; every head but EAGLE-3 is trained on
    the final one (``feats[..., -1]``), so its config must name that index for drafting."""
    from specdec.train.heads import head_config

    target, _ = _toy_data(tmp_path / "data", sequences=2)
    hc = head_config(kind, target, torch.arange(V), (1, 2, 3), TrainConfig(kind=kind))
    assert hc.inputs == (3,)
    assert head_config("eagle3", target, torch.arange(V), (1, 2, 3), TrainConfig(kind="eagle3")).inputs == (0, 1, 2)


def test_held_out_evaluations_are_recorded_every_eval_every_steps_and_a_resume_may_change_it(tmp_path: Path) -> None:
    """--eval-every 2 over 4 steps: evaluations at steps 2 and 4 in the history; how often a run
    evaluates changes nothing learnt, so a resume with another --eval-every continues."""
    target, data = _toy_data(tmp_path / "data", sequences=24)
    cfg = TrainConfig(kind="medusa", steps=4, batch_tokens=128, lr=1e-3, draft_vocab=V, depth=1, eval_every=2, warmup=2)
    report = train(cfg, data, tmp_path / "out", target)
    assert [h["step"] for h in report["history"] if "eval" in h] == [2, 4]
    assert report["finished"] is True and report["steps"] == 4
    shard = th.load_shards(data)  # the card's counts are of the training sequences only (every 20th is held out)
    train_idx = [i for i in range(24) if i % 20]
    assert report["train_tokens"] == sum(shard.tokens[i].numel() for i in train_idx)
    assert report["reply_tokens"] == sum(shard.tokens[i].numel() - shard.prompt_len[i] for i in train_idx)
    again = train(replace(cfg, steps=6, eval_every=3), data, tmp_path / "out", target)
    assert again["steps"] == 6 and [h["step"] for h in again["history"] if "eval" in h] == [2, 4, 6]


def test_each_epoch_is_shuffled_anew(tmp_path: Path, monkeypatch) -> None:
    """Batches are reshuffled by seed + epoch: the second epoch does not replay the first's order."""
    target, data = _toy_data(tmp_path / "data", sequences=24)
    seen: list[tuple[int, ...]] = []
    real = th.collate
    monkeypatch.setattr(th, "collate", lambda d, group: seen.append(tuple(group)) or real(d, group))
    cfg = TrainConfig(kind="medusa", steps=1, batch_tokens=128, lr=1e-3, draft_vocab=V, depth=1, eval_every=1000, warmup=1)
    order0 = th.batches(th.load_shards(data), [i for i in range(24) if i % 20], 128, random.Random(0))  # epoch 0, seed 0
    steps = 2 * len(order0)  # two full epochs
    train(replace(cfg, steps=steps), data, tmp_path / "out", target)
    trained = seen[:steps]
    assert trained[: len(order0)] == [tuple(g) for g in order0]
    assert trained[len(order0):] != trained[: len(order0)]


def test_a_short_batch_has_no_empty_draft_step() -> None:
    """A batch of 2 positions gives Medusa head 1 only (head 2 has no label there): no empty step
    whose zero-position scores would enter the report."""
    model = build(_cfg("medusa", depth=3))
    batch = Batch(torch.tensor([[1, 2]]), torch.randn(1, 2, 4, 32), torch.tensor([2]), torch.tensor([0]))
    outs = th.step_outputs(model, batch, torch.randn(V, 32))
    assert len(outs) == 1 and outs[0][0].shape[1] == 1


def _train_cfg(**kw) -> TrainConfig:
    base = dict(kind="medusa", steps=2, batch_tokens=128, lr=1e-3, draft_vocab=V, depth=2, eval_every=1000, warmup=1)
    return TrainConfig(**(base | kw))


def test_weight_decay_and_clip_reach_the_optimiser(tmp_path: Path, monkeypatch) -> None:
    """``weight_decay`` (AdamW's own default is 0.01, ours 0.0) and ``clip`` are the config's, not defaults."""
    target, data = _toy_data(tmp_path / "data", sequences=21)
    norms: list[float] = []
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda p, max_norm, *a, **k: norms.append(max_norm) or real(p, max_norm, *a, **k))
    train(_train_cfg(clip=0.25), data, tmp_path / "a", target)
    ck = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=False)
    assert ck["opt"]["param_groups"][0]["weight_decay"] == 0.0
    assert norms == [0.25, 0.25]
    train(_train_cfg(weight_decay=0.3), data, tmp_path / "b", target)
    assert torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)["opt"]["param_groups"][0]["weight_decay"] == 0.3


def test_a_checkpoint_of_another_target_is_refused(tmp_path: Path) -> None:
    """The same settings and data but a target of another name: refused, not continued."""
    target, data = _toy_data(tmp_path / "data", sequences=21)
    train(_train_cfg(), data, tmp_path / "out", target)
    other = TargetHead(target.embed, target.head, target.eos_ids, "other-target", target.cfg)
    with pytest.raises(ConfigError, match=re.escape("was saved by a run with target =")):
        train(replace(_train_cfg(), steps=3), data, tmp_path / "out", other)


def test_the_report_history_estimates_and_kinds(tmp_path: Path) -> None:
    """The history logs step 1 (then every 10th); the chain estimates come from the top-1 (T = 0) and
    E[min(p, q)] (T = 1) rates; both held-out kinds (one chat, one code sequence) are scored."""
    target, data = _toy_data(tmp_path / "data", sequences=40)
    report = train(_train_cfg(steps=3), data, tmp_path / "out", target)
    assert [h["step"] for h in report["history"] if "loss" in h] == [1]
    ho = report["held_out"]
    assert ho["chain_tokens_per_call_t0_estimate"] == pytest.approx(expected_tokens_per_call([s["top1"] for s in ho["steps"]]))
    assert ho["chain_tokens_per_call_t1_estimate"] == pytest.approx(expected_tokens_per_call([s["accept_t1"] for s in ho["steps"]]))
    assert ho["chain_tokens_per_call_t0_estimate"] != pytest.approx(ho["chain_tokens_per_call_t1_estimate"])
    assert set(ho["by_kind"]) == {"chat", "code"}
    for k, st in enumerate(ho["steps"]):
        assert st["positions"] == sum(ho["by_kind"][kind][k]["positions"] for kind in ("chat", "code"))


@pytest.mark.parametrize("tied", [True, False])
def test_the_target_head_folds_the_final_norm_in(tmp_path: Path, tied: bool) -> None:
    """``TargetHead.from_folder``: head = (lm_head, or the embedding when tied) x the final norm's
    weight, per hidden channel; the embedding is left as it is."""
    from safetensors.torch import load_file

    from tiny import make_tiny

    folder = make_tiny(tmp_path / "m", vocab=300, tied=tied, norms=True)
    w = {}
    for f in folder.glob("*.safetensors"):
        w.update(load_file(str(f)))
    norm = w["model.norm.weight"].float()
    assert not torch.allclose(norm, torch.ones_like(norm))  # the case is not degenerate
    t = TargetHead.from_folder(folder, "tiny", frozenset({2}))
    raw = w["model.embed_tokens.weight"] if tied else w["lm_head.weight"]
    assert torch.equal(t.embed, w["model.embed_tokens.weight"].float())
    torch.testing.assert_close(t.head, raw.float() * norm)
    assert t.eos_ids == (2,)


def test_an_evaluation_interval_of_zero_is_a_config_error() -> None:
    """eval_every and ckpt_every are taken modulo the step: 0 is refused up front, not a ZeroDivisionError later."""
    for kw in (dict(eval_every=0), dict(ckpt_every=0)):
        with pytest.raises(ConfigError, match="must be >= 1"):
            TrainConfig(kind="medusa", **kw)


def test_top_tokens_leaves_the_callers_counts_alone() -> None:
    counts = torch.tensor([5, 0, 3, 1])
    assert th.top_tokens(counts, 2, (1,)).tolist() == [0, 1]
    assert counts.tolist() == [5, 0, 3, 1]


def test_each_steps_cross_entropy_is_the_mean_over_its_masked_rows() -> None:
    """``parts[k]`` is -Σ p log q averaged over the reply rows of step k only (not over every row)."""
    torch.manual_seed(0)
    batch, embed, w = _batch()
    model = build(_cfg("medusa", depth=2))
    _, parts = th.loss_fn(model, batch, embed, w, TrainConfig(kind="medusa", depth=2))
    logp = th.target_logp(batch, w)
    for k, (logits, off, mask, _) in enumerate(th.step_outputs(model, batch, embed)):
        assert not bool(mask.all())  # the case is not degenerate
        n = logits.shape[1]
        per = -(logp[:, off : off + n].exp() * torch.log_softmax(logits, -1)).sum(-1)
        assert parts[k] == pytest.approx(float(per[mask].mean()), rel=1e-5)


def test_mtp_module_zero_row_t_reads_the_embedding_of_token_t_plus_one() -> None:
    """MTP module k, row t: the target's feature at t with the embedding of token t + k + 1 (the
    token the target's law at t predicted); changing token j moves row j - 1 of module 0 first."""
    torch.manual_seed(0)
    model = build(_cfg("mtp", depth=1)).eval()
    tokens = torch.randint(0, V, (1, 8))
    feats = torch.randn(1, 8, 4, D)
    embed = torch.randn(V, D)
    other = tokens.clone()
    other[0, 5] = (tokens[0, 5] + 1) % V
    with torch.no_grad():
        a = th.step_outputs(model, th.Batch(tokens, feats, torch.tensor([8]), torch.tensor([1])), embed)[0][0]
        b = th.step_outputs(model, th.Batch(other, feats, torch.tensor([8]), torch.tensor([1])), embed)[0][0]
    changed = [bool((a[0, t] - b[0, t]).abs().max() > 1e-6) for t in range(a.shape[1])]
    assert changed == [False] * 4 + [True] * (a.shape[1] - 4)


def test_the_held_out_report_scores_the_sequences_kept_out_of_training(tmp_path: Path, monkeypatch) -> None:
    """The held-out evaluation is given every 20th sequence (0, 20 of 24): the very ones the loop never trains on."""
    target, data = _toy_data(tmp_path / "data", sequences=24)
    asked: list[list[int]] = []
    real = th.evaluate
    monkeypatch.setattr(th, "evaluate", lambda model, d, index, *a: asked.append(list(index)) or real(model, d, index, *a))
    train(_train_cfg(steps=1), data, tmp_path / "out", target)
    assert asked == [[0, 20]]
