"""``specdec train distill``: labels are the target's law, training moves the draft towards it on
held-out sequences, a stopped run resumes bitwise, and the command writes a draft --draft loads.

Tiny random models (2 layers, width 32) with SmolLM2's tokenizer; the "target" and the draft
differ only in their random initialisation, so the untrained draft agrees with the target at
chance level and anything above it is learned.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.train import distill as ds
from specdec.train.data import DataConfig, generate, load_shards
from tests.tiny import make_tiny


def _peaked(folder: Path) -> Path:
    """Give the tiny target an untied LM head that favours 64 tokens: a random 2-layer model's tied
    head mostly predicts the token it just read, with a nearly flat law over 49,152 tokens —
    nothing a few training steps could learn or a held-out sequence could show."""
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    model.config.tie_word_embeddings = False
    g = torch.Generator().manual_seed(7)
    vocab, width = model.get_input_embeddings().weight.shape
    head = torch.nn.Linear(width, vocab, bias=False)
    head.weight.data = torch.zeros(vocab, width)
    favoured = torch.randperm(vocab, generator=g)[:64]
    head.weight.data[favoured] = torch.randn(64, width, generator=g) * 0.8
    model.lm_head = head
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    from specdec.models.registry import load

    root = tmp_path_factory.mktemp("distill")
    target_dir = _peaked(make_tiny(root / "target", seed=0, max_positions=512))
    draft_dir = make_tiny(root / "draft", seed=1, max_positions=512)
    target = load(str(target_dir), batch_invariant=False)
    cfg = DataConfig(sequences=40, batch=20, shard_size=20, max_new_chat=24, max_new_code=24,
                     temperatures=(1.0,), features=False)
    generate(cfg, target.model, target.tokenizer, frozenset(), root / "data")
    shards = load_shards(root / "data")
    assert shards.feats == []  # tokens only
    labels = [ds.label(target.model, t, n, k, top_k=16) for t, n, k in zip(shards.tokens, shards.prompt_len, shards.kind)]
    return root, target, draft_dir, labels


def test_labels_are_the_targets_law_at_reply_positions(setup) -> None:
    root, target, _, labels = setup
    x = labels[0]
    assert x.start == load_shards(root / "data").prompt_len[0] - 1  # the first row predicts the first reply token
    logits = target.model.forward(x.tokens, target.model.new_cache(x.tokens.numel()))  # [L, V]
    p = torch.softmax(logits.float(), -1)
    assert x.top_p.shape == (x.tokens.numel() - 1 - x.start, 16)
    for r in range(x.top_p.shape[0]):
        vals, idx = p[x.start + r].topk(16)
        assert torch.equal(idx, x.top_i[r]) and torch.allclose(vals, x.top_p[r])


@pytest.mark.parametrize("loss", ["kl", "tvd"])
def test_training_raises_held_out_acceptance(setup, loss: str) -> None:
    """N = 2 held-out sequences x 24 reply positions; the untrained draft is a different random
    model, so its acceptance is near chance; a broken objective (sign flipped: broken once, both
    losses failed) leaves it there."""
    _, _, draft_dir, labels = setup
    train_ix, held_ix = ds.split(len(labels), 20)
    assert len(held_ix) == 2 and len(train_ix) == 38
    student = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32)
    held = [labels[i] for i in held_ix]
    before = ds.held_out_acceptance(student, held)["all"]
    cfg = ds.DistillConfig(steps=80, batch=8, positions=128, lr=2e-2, warmup=5, top_k=16, loss=loss)
    losses = ds.train(student, [labels[i] for i in train_ix], cfg)
    after = ds.held_out_acceptance(student, held)["all"]
    assert after["positions"] == before["positions"] == 48
    assert sum(losses[-10:]) < 0.9 * sum(losses[:10])
    assert after["t1_lower"] > before["t1_lower"] + 0.05, (before, after)
    assert after["greedy"] > before["greedy"], (before, after)


def test_a_stopped_run_resumes_bitwise(setup) -> None:
    _, _, draft_dir, labels = setup
    cfg = ds.DistillConfig(steps=6, batch=4, positions=32, lr=1e-3, warmup=2, top_k=16)

    def fresh():
        return AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32)

    straight = fresh()
    ds.train(straight, labels, cfg)
    saved: dict = {}
    first = fresh()
    ds.train(first, labels, cfg,
             on_step=lambda step, loss, st: saved.update({step: copy.deepcopy((st, first.state_dict()))}))
    state, weights = saved[3]
    second = fresh()
    second.load_state_dict(weights)
    ds.train(second, labels, cfg, state=state)
    for (name, a), b in zip(straight.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name


def test_command_writes_a_draft_that_loads_and_resumes(setup, capsys) -> None:
    from specdec import cli
    from specdec.models.registry import load

    root, _, draft_dir, _ = setup
    out = root / "run"
    argv = ["train", "distill", "--data", str(root / "data"), "--out", str(out), "--target", str(root / "target"),
            "--draft", str(draft_dir), "--steps", "4", "--batch", "4", "--positions", "32", "--top-k", "8"]
    assert cli.main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["finished"] and report["steps"] == 4
    assert set(report["held_out_after"]) >= {"all"} and "held_out_before" in report
    card = (out / "draft" / "README.md").read_text()
    assert "Held-out teacher-forced acceptance" in card and "--steps 4" in card and "target-generated sequences" in card
    drafted = load(str(out / "draft"), batch_invariant=False)
    assert drafted.tokenizer.encode("hello") == load(str(draft_dir), batch_invariant=False).tokenizer.encode("hello")
    assert cli.main(argv) == 0  # a finished run: resumes at its last step, trains nothing
    assert "resuming from step 4" in capsys.readouterr().err


def test_a_run_continues_with_more_steps_and_refuses_other_settings(setup, capsys, monkeypatch) -> None:
    """A larger --steps continues the checkpoint (it restarted from step 0 and overwrote the draft);
    another --lr is refused in one line, the finished draft untouched; a run paused by
    --max-minutes between two checkpoints keeps its steps (it saved none below 25); a cut-short
    checkpoint is a one-line error naming it, not a torch traceback."""
    from specdec import cli

    root, _, draft_dir, _ = setup
    out = root / "grow"
    base = ["train", "distill", "--data", str(root / "data"), "--out", str(out), "--target", str(root / "target"),
            "--draft", str(draft_dir), "--batch", "4", "--positions", "32", "--top-k", "8"]
    assert cli.main([*base, "--steps", "3"]) == 0
    capsys.readouterr()
    assert cli.main([*base, "--steps", "5"]) == 0
    err = capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert "resuming from step 3" in err and report["finished"] and report["steps"] == 5
    assert len(report["last_losses"]) == 2  # steps 4 and 5 only
    weights = (out / "draft" / "model.safetensors").read_bytes()
    assert cli.main([*base, "--steps", "5", "--lr", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "was saved by a run with lr = 0.0001, this one asks for 0.5" in err and "Traceback" not in err
    assert (out / "draft" / "model.safetensors").read_bytes() == weights
    # paused after 2 steps by the time budget (a clock that jumps a minute a step)
    import specdec.train.distill as ds_module

    clock = iter(range(0, 10**6, 60))
    monkeypatch.setattr(ds_module.time, "perf_counter", lambda: float(next(clock)))
    paused = root / "paused"
    argv = [*base[:4], "--out", str(paused), *base[6:], "--steps", "100", "--max-minutes", "2.5"]
    assert cli.main(argv) == 0
    monkeypatch.undo()
    first = torch.load(paused / "ckpt.pt", weights_only=False)["state"]["step"]
    assert 0 < first < 25 and f"paused at step {first} of 100" in capsys.readouterr().err
    (paused / "ckpt.pt").write_bytes((paused / "ckpt.pt").read_bytes()[:100])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "ckpt.pt cannot be read" in err and "delete it to redo that part" in err and "Traceback" not in err


def test_command_without_data_is_a_clear_error(tmp_path: Path, capsys) -> None:
    from specdec import cli

    rc = cli.main(["train", "distill", "--data", str(tmp_path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc != 0 and "holds no training data" in err and "Traceback" not in err


def test_heads_refuse_tokens_only_data(setup, capsys) -> None:
    from specdec import cli

    root = setup[0]
    rc = cli.main(["train", "medusa", "--data", str(root / "data"), "--out", str(root / "medusa"), "--target", str(root / "target")])
    err = capsys.readouterr().err
    assert rc != 0 and "tokens only" in err and "Traceback" not in err


def test_on_policy_data_is_the_drafts_own_samples(setup, capsys) -> None:
    """``train data --sampled-by draft``: the replies are the draft's (greedy ones equal the draft's
    own one-token-at-a-time decoding, and differ from the target's), under the target's prompts;
    the folder says who sampled it and `train distill` labels it with the target's law.  Asking for
    features, or resuming a folder with other settings, is a one-line error."""
    from specdec import cli
    from specdec.models.registry import load

    root, target, draft_dir, _ = setup
    out = root / "on-policy"
    base = ["train", "data", "--target", str(root / "target"), "--out", str(out), "--sequences", "20", "--batch", "8",
            "--max-new-chat", "8", "--max-new-code", "8", "--temperatures", "0"]
    rc = cli.main([*base, "--sampled-by", "draft", "--draft", str(draft_dir)])
    err = capsys.readouterr().err
    assert rc == 2 and "--no-features" in err and "Traceback" not in err and not out.exists()
    rc = cli.main([*base, "--sampled-by", "draft", "--draft", str(root / "missing"), "--no-features"])
    err = capsys.readouterr().err
    assert rc != 0 and "missing" in err and "Traceback" not in err and not out.exists()
    assert cli.main([*base, "--sampled-by", "draft", "--draft", str(draft_dir), "--no-features"]) == 0
    assert json.loads((out / "config.json").read_text())["sampler"] == str(draft_dir)
    shards = load_shards(out)
    draft = load(str(draft_dir), batch_invariant=False).model
    differs = 0
    for ids, n0 in zip(shards.tokens, shards.prompt_len):
        seqs = {}
        for name, model in (("draft", draft), ("target", target.model)):
            cache = model.new_cache(ids.numel() + 1)
            logits = model.forward(ids[:n0].long(), cache, last_only=True)
            seq = ids[:n0].tolist()
            for _ in range(ids.numel() - n0):
                seq.append(int(logits[0].argmax()))
                logits = model.forward(torch.tensor(seq[-1:]), cache)
            seqs[name] = seq
        assert ids.tolist() == seqs["draft"]
        differs += seqs["target"] != seqs["draft"]
    assert differs >= 15  # the two random models disagree: these are not the target's replies
    rc = cli.main([*base, "--no-features"])  # the same folder, now sampled by the target: refused
    err = capsys.readouterr().err
    assert rc == 2 and "other settings (sampler)" in err and "Traceback" not in err
    run = root / "on-policy-run"
    argv = ["train", "distill", "--data", str(out), "--out", str(run), "--target", str(root / "target"),
            "--draft", str(draft_dir), "--steps", "2", "--batch", "2", "--positions", "8", "--top-k", "4"]
    assert cli.main(argv) == 0
    labels = torch.load(run / "labels.pt", weights_only=False)["labels"]
    assert len(labels) == 20 and labels[0].start == shards.prompt_len[0] - 1
    card = json.loads((run / "report.json").read_text())
    assert card["finished"] and f"`{draft_dir}`-generated (on-policy) sequences" in (run / "draft" / "README.md").read_text()


def _base(root, draft, out):
    return ["train", "distill", "--data", str(root / "data"), "--out", str(out), "--target", str(root / "target"),
            "--draft", str(draft), "--batch", "4", "--positions", "32"]


def test_a_checkpoint_of_another_source_draft_is_refused(setup, capsys) -> None:
    from specdec import cli

    root, _, draft_dir, _ = setup
    out = root / "source"
    assert cli.main([*_base(root, draft_dir, out), "--top-k", "8", "--steps", "1"]) == 0
    other = root / "other-draft"
    shutil.copytree(draft_dir, other)
    capsys.readouterr()
    assert cli.main([*_base(root, other, out), "--top-k", "8", "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "was saved by a run with source = " in err and "Traceback" not in err


def test_labels_of_other_settings_are_made_again_not_reused(setup, capsys) -> None:
    """labels.pt holds top-k probabilities for one --top-k: with the checkpoint gone, a run with
    another --top-k labels the data again (it used to train on the old labels)."""
    from specdec import cli

    root, _, draft_dir, _ = setup
    out = root / "relabel"
    assert cli.main([*_base(root, draft_dir, out), "--top-k", "8", "--steps", "1"]) == 0
    (out / "ckpt.pt").unlink()
    assert cli.main([*_base(root, draft_dir, out), "--top-k", "4", "--steps", "1"]) == 0
    saved = torch.load(out / "labels.pt", weights_only=False)
    assert saved["key"]["top_k"] == 4 and all(x.top_p.shape[-1] == 4 for x in saved["labels"])


@pytest.fixture(scope="module")
def student_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("student"), seed=1, max_positions=128)


def _student(folder: Path):
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)


def _labels(n: int = 6, k: int = 4, seed: int = 0) -> list[ds.Labels]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length, start = 8 + (i % 3) * 3, 2 + i % 2  # different lengths: the batch is right-padded
        rows = length - 1 - start
        tokens = torch.randint(0, 500, (length,), generator=g)
        p = torch.softmax(torch.randn(rows, k, generator=g) * 2, -1).sort(-1, descending=True).values * 0.9
        idx = torch.stack([torch.randperm(500, generator=g)[:k] for _ in range(rows)])
        out.append(ds.Labels(tokens, start, p, idx, "chat" if i % 2 else "code"))
    return out


def test_the_losses_are_forward_kl_and_tvd_on_the_renormalised_top_k() -> None:
    """KL(p || q) with p renormalised to its top-k support (not KL(q || p), not unnormalised p), and
    TVD = 1 - sum min(p, q) with q's own probabilities (its mass outside the support counts against it)."""
    logq = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.1, 0.2, 0.3, 3.0]]), -1)
    p = torch.tensor([[0.3, 0.2, 0.1], [0.5, 0.25, 0.05]])  # 60% and 80% of the mass: renormalised
    idx = torch.tensor([[0, 1, 2], [4, 3, 2]])
    pn = p / p.sum(-1, keepdim=True)
    lq = logq.gather(1, idx)
    kl = (pn * (pn.log() - lq)).sum(-1).mean()
    tvd = (1 - torch.minimum(pn, lq.exp()).sum(-1)).mean()
    torch.testing.assert_close(ds.loss_of(logq, p, idx, "kl"), kl)
    torch.testing.assert_close(ds.loss_of(logq, p, idx, "tvd"), tvd)
    # q equal to the renormalised p on the support: KL 0, TVD 0
    same = torch.full((1, 5), -30.0)
    same[0, :3] = pn[0].log()
    assert float(ds.loss_of(same, p[:1], idx[:1], "kl")) == pytest.approx(0.0, abs=1e-5)
    assert float(ds.loss_of(same, p[:1], idx[:1], "tvd")) == pytest.approx(0.0, abs=1e-5)
    with pytest.raises(ValueError, match="unknown loss"):
        ds.loss_of(logq, p, idx, "js")


def test_the_draft_is_read_where_it_predicts_each_reply_token(student_dir) -> None:
    """Row r of a sequence is the draft's law after tokens[: start + r + 1], as the sequence alone
    (no padding) gives it: the batch's padding changes nothing."""
    student = _student(student_dir).eval()
    items = _labels(3)
    rows = ds._all_rows(items)
    with torch.no_grad():
        got = ds.draft_log_probs(student, items, rows)
        alone = [torch.log_softmax(student(x.tokens[None]).logits[0].float(), -1) for x in items]
        for (b, r), row in zip(rows.tolist(), got):
            want = alone[b][items[b].start + r]
            torch.testing.assert_close(row, want, atol=1e-4, rtol=1e-4)


def test_a_step_samples_exactly_positions_distinct_rows() -> None:
    items = _labels(4)
    total = sum(x.top_p.shape[0] for x in items)
    g = torch.Generator().manual_seed(0)
    rows = ds._rows(items, 10, g)
    assert rows.shape == (10, 2) and len({tuple(r) for r in rows.tolist()}) == 10
    assert ds._rows(items, 10 * total, g).shape == (total, 2)  # fewer rows than asked: all of them


def _train(folder: Path, cfg: ds.DistillConfig, **kw):
    student = _student(folder)
    losses = ds.train(student, _labels(), cfg, **kw)
    return student, losses


def test_the_seed_decides_the_training_run(student_dir) -> None:
    cfg = ds.DistillConfig(steps=1, batch=2, positions=4, lr=1e-3, warmup=1, top_k=4)
    a, _ = _train(student_dir, cfg)
    b, _ = _train(student_dir, cfg)
    c, _ = _train(student_dir, ds.DistillConfig(**{**cfg.__dict__, "seed": 1}))
    wa, wb, wc = (m.model.layers[0].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def test_each_step_uses_the_warmup_cosine_rate(student_dir) -> None:
    """Step s (0-based) trains at lr * min(1, (s+1)/warmup) * (1 + cos(pi s / steps)) / 2: the first
    step already learns, the rate is the one for the step being taken."""
    cfg = ds.DistillConfig(steps=5, batch=2, positions=4, lr=1e-2, warmup=2, top_k=4)
    rates = {}
    _train(student_dir, cfg, on_step=lambda step, loss, st: rates.update({step: st["optim"]["param_groups"][0]["lr"]}))
    for step, lr in rates.items():
        s = step - 1
        assert lr == pytest.approx(1e-2 * min(1.0, (s + 1) / 2) * 0.5 * (1 + math.cos(math.pi * s / 5))), step


def test_gradients_are_clipped_to_norm_one_every_step(student_dir, monkeypatch) -> None:
    calls = []
    real = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *a, **k):
        calls.append(max_norm)
        return real(params, max_norm, *a, **k)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    _train(student_dir, ds.DistillConfig(steps=3, batch=2, positions=4, lr=1e-3, warmup=1, top_k=4))
    assert calls == [1.0, 1.0, 1.0]


def test_training_ends_in_eval_mode_and_evaluation_keeps_the_mode(student_dir) -> None:
    student, _ = _train(student_dir, ds.DistillConfig(steps=1, batch=2, positions=4, top_k=4))
    assert not student.training
    student.train()
    ds.held_out_acceptance(student, _labels(2))
    assert student.training
    student.eval()
    ds.held_out_acceptance(student, _labels(2))
    assert not student.training


def test_held_out_acceptance_is_greedy_agreement_and_sum_min(student_dir) -> None:
    """greedy: arg-max q equals the target's top-1; t1_lower: sum over the target's top-k of
    min(p, q), q the draft's full-vocabulary probability; per kind and for all."""
    student = _student(student_dir).eval()
    items = _labels(4)
    with torch.no_grad():
        logq = ds.draft_log_probs(student, items, ds._all_rows(items))
    # make the target's top-1 the draft's arg-max on the first row of each sequence: greedy is not 0
    rows = ds._all_rows(items).tolist()
    for (b, r), lq in zip(rows, logq):
        if r == 0:
            items[b].top_i[0, 0] = int(lq.argmax())
    sums: dict[str, list[float]] = {}
    for (b, r), lq in zip(rows, logq):
        x = items[b]
        g = float(int(lq.argmax()) == int(x.top_i[r, 0]))
        t = float(sum(min(float(x.top_p[r, j]), math.exp(float(lq[x.top_i[r, j]]))) for j in range(x.top_i.shape[1])))
        for key in (x.kind, "all"):
            s = sums.setdefault(key, [0.0, 0.0, 0])
            s[0], s[1], s[2] = s[0] + g, s[1] + t, s[2] + 1
    got = ds.held_out_acceptance(student, items, batch=3)
    assert set(got) == {"chat", "code", "all"}
    for key, (g, t, n) in sums.items():
        assert got[key]["positions"] == n
        assert got[key]["greedy"] == pytest.approx(g / n, abs=1e-4) and got[key]["greedy"] > 0
        assert got[key]["t1_lower"] == pytest.approx(t / n, abs=1e-4)


def test_a_zero_target_probability_in_the_top_k_keeps_the_kl_finite() -> None:
    """Top-k probabilities can underflow to 0 in float32: such a term adds 0 to the KL (0 log 0 = 0), not NaN."""
    logq = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.5, -1.0]]), -1)
    p = torch.tensor([[0.7, 0.3, 0.0]])
    idx = torch.tensor([[0, 1, 2]])
    got = ds.loss_of(logq, p, idx, "kl")
    want = ds.loss_of(logq, p[:, :2], idx[:, :2], "kl")
    assert torch.isfinite(got) and torch.allclose(got, want)


def test_the_positions_of_a_step_are_a_random_sample_of_all_rows() -> None:
    """_rows draws its positions at random from every reply row of the batch, not the first ones:
    100 draws of 3 rows out of the 4 sequences' rows reach every row at least once."""
    items = _labels(4)
    total = ds._all_rows(items).shape[0]
    g = torch.Generator().manual_seed(0)
    seen = {tuple(r) for _ in range(100) for r in ds._rows(items, 3, g).tolist()}
    assert len(seen) == total


def test_each_step_trains_on_batch_sequences(student_dir, monkeypatch) -> None:
    """A step's positions come from ``cfg.batch`` distinct sequences (3 steps, batch 3 of 6)."""
    seen: list[int] = []
    real = ds.draft_log_probs

    def spy(student, items, rows):
        seen.append(len({id(x) for x in items}))
        return real(student, items, rows)

    monkeypatch.setattr(ds, "draft_log_probs", spy)
    ds.train(_student(student_dir), _labels(), ds.DistillConfig(steps=3, batch=3, positions=4, warmup=1, top_k=4))
    assert seen == [3, 3, 3]


@pytest.mark.parametrize("decay", [0.0, 0.25])
def test_the_weight_decay_setting_reaches_the_optimiser(student_dir, decay: float) -> None:
    """DistillConfig.weight_decay is AdamW's weight_decay (0.0 by default, not AdamW's own 0.01)."""
    groups = []
    cfg = ds.DistillConfig(steps=1, batch=2, positions=4, warmup=1, top_k=4, weight_decay=decay)
    ds.train(_student(student_dir), _labels(), cfg, on_step=lambda step, loss, st: groups.append(st["optim"]["param_groups"]))
    assert [g["weight_decay"] for g in groups[0]] == [decay] * len(groups[0])


def _card(data: dict) -> dict:
    acc = {"all": {"greedy": 0.1, "t1_lower": 0.2, "positions": 5}}
    return {"target": "t", "source": "d", "config": ds.config_dict(ds.DistillConfig()), "data": data,
            "train_sequences": 3, "train_positions": 30, "held_out_sequences": 1, "steps": 1, "train_seconds": 1.0,
            "machine": "cpu", "command": "specdec train distill", "held_out_before": acc, "held_out_after": acc}


def test_the_card_of_data_from_before_the_sampler_setting_says_target_generated() -> None:
    """Data folders made before ``sampler`` existed were all target-sampled: their card says so
    (it must not fail on the missing key)."""
    assert "3 target-generated sequences" in ds.model_card(_card({"sequences": 4}))


def test_save_draft_copies_the_chat_template_and_leaves_the_student_in_float32(student_dir, tmp_path: Path) -> None:
    """The saved draft carries the source's chat template (chat prompts are encoded with it), and the
    student in memory is float32 again after the float16 save."""
    student = _student(student_dir)
    out = ds.save_draft(student, student_dir, tmp_path / "draft", _card({"sampler": "target"}))
    assert (out / "chat_template.jinja").read_text() == (student_dir / "chat_template.jinja").read_text()
    assert all(p.dtype == torch.float32 for p in student.parameters())


def test_an_unknown_loss_is_refused_before_training_starts(student_dir) -> None:
    """train() checks --loss up front: even a run with no step left to take (steps=0) refuses it,
    and the student is not switched into training mode on the way."""
    student = _student(student_dir).eval()
    with pytest.raises(ValueError, match="unknown loss 'js'"):
        ds.train(student, _labels(), ds.DistillConfig(steps=0, loss="js"))
    assert not student.training


def test_save_draft_copies_the_tokenizer_and_generation_files_and_nothing_else(student_dir, tmp_path: Path) -> None:
    """Beside the weights and the card: every tokenizer file, the chat template, generation config
    and special tokens map of the source; no other file of the source (its weights, say)."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "special_tokens_map.json", "calibration.json", "notes.txt"):
        (source / name).write_text(name)
    out = ds.save_draft(_student(student_dir), source, tmp_path / "draft", _card({"sampler": "target"}))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                 "special_tokens_map.json"):
        assert (out / name).read_text() == name, name
    assert not (out / "calibration.json").exists() and not (out / "notes.txt").exists()
    assert (out / "card.json").is_file() and "# Distilled draft for t" in (out / "README.md").read_text()


def test_the_card_names_an_on_policy_sampler_and_both_score_tables() -> None:
    """Data the draft sampled is named as on-policy with the sampler; the card has a row per kind
    for the source draft (before) and the trained one (after)."""
    card = _card({"sampler": "drafts/small"})
    card["held_out_after"] = {"all": {"greedy": 0.5, "t1_lower": 0.625, "positions": 5}}
    text = ds.model_card(card)
    assert "3 `drafts/small`-generated (on-policy) sequences (30 reply positions), 1 held out" in text
    assert "| before (source draft) | all | 0.100 | 0.200 | 5 |" in text
    assert "| after | all | 0.500 | 0.625 | 5 |" in text
