"""Draft-head training: the training-time-test pattern is what drafting computes, the loop learns and resumes."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specdec.heads.modules import Eagle, HeadConfig, build, load_head, rope_tables, save_head, ttt_mask
from specdec.train.data import Shard
from specdec.train.heads import (
    Batch,
    TargetHead,
    TrainConfig,
    draft_vocabulary,
    evaluate,
    expected_tokens_per_call,
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
    from specdec.train.data import load_shards

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


def test_resume_gives_the_same_head(tmp_path: Path) -> None:
    target, data = _toy_data(tmp_path / "data", sequences=24)
    cfg = TrainConfig(kind="eagle3", steps=12, batch_tokens=128, lr=1e-3, draft_vocab=V, depth=2, eval_every=1000,
                      warmup=2, ckpt_every=4)
    train(cfg, data, tmp_path / "whole", target)
    train(cfg, data, tmp_path / "split", target, stop_after=5)
    train(cfg, data, tmp_path / "split", target)
    a = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=False)["model"]
    for key in a:
        assert torch.equal(a[key], b[key]), key


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
    a = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=False)["model"]
    for key in a:
        assert torch.equal(a[key], b[key]), key
