"""`specdec bench` end to end in local modes: real worker processes (plain, speculative with its
paired plain run) on the bundled 15.7 M-parameter draft as the target, one prompt, 8 tokens.
No timing is asserted; what is checked is that every mode's worker runs and reports, and that
the report says what the run was."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from specdec.bench import report, runner, worker
from specdec.bench.workloads import BUILTIN

MODEL = "smollm2-135m-draft"


def test_local_bench_modes_run_their_workers_and_report(tmp_path):
    cfg = runner.BenchConfig(target=MODEL, draft=MODEL, prompts=(BUILTIN[0],), modes=("plain", "speculative"),
                             temperatures=(0.0,), max_new_tokens=8, threads=1)
    result = runner.run(cfg, progress=False)
    modes = {s["mode"] for s in result["samples"]}
    assert {"plain", "speculative", "plain_paired"} <= modes
    assert all(s["generated_tokens"] == 8 for s in result["samples"])
    spec = [s for s in result["samples"] if s["mode"] == "speculative"]
    paired = [s for s in result["samples"] if s["mode"] == "plain_paired"]
    assert spec and paired and spec[0]["tokens_sha1"] == paired[0]["tokens_sha1"]  # greedy = plain
    assert result["config"]["draft_precision"]
    report.write(result, tmp_path, make_plots=False)
    md = (tmp_path / "README.md").read_text()
    assert "speculative/greedy" in md and "plain_paired" in md
    assert "| code tok/s | code ×plain |" in md and "×cloud" not in md  # the mode was renamed plain long ago


def test_several_drafters_share_one_target_and_one_paired_plain_run(tmp_path):
    """`--draft A,B`: each drafter decodes the prompt beside the one plain_paired run, rows say
    which drafter made them, and the report keeps them apart."""
    cfg = runner.BenchConfig(target=MODEL, draft=f"{MODEL},ngram", prompts=(BUILTIN[0],), modes=("speculative",),
                             temperatures=(0.0,), max_new_tokens=8, threads=1)
    result = runner.run(cfg, progress=False)
    spec = [s for s in result["samples"] if s["mode"] == "speculative"]
    paired = [s for s in result["samples"] if s["mode"] == "plain_paired"]
    assert len(paired) == 1 and [s["draft"] for s in spec] == [MODEL, "ngram"]
    assert [s["drafter"] for s in spec] == [MODEL, "ngram"]  # the engine that ran is the one the row names
    assert all(s["tokens_sha1"] == paired[0]["tokens_sha1"] for s in spec)  # greedy = plain for both
    written = report.write(result, tmp_path, make_plots=True)
    stats = written["stats"]
    assert any(p.endswith("drafters.png") for p in written["plots"]) and (tmp_path / "drafters.png").stat().st_size > 0
    assert sorted(g.draft for g in stats if g.mode == "speculative") == sorted([MODEL, "ngram"])
    md = (tmp_path / "README.md").read_text()
    assert f"speculative/greedy · {MODEL}" in md and "speculative/greedy · ngram" in md
    table = report.drafters_by_category(result["samples"])
    assert [(r.draft, r.category) for r in table] == [(MODEL, "code"), ("ngram", "code")]
    own = next(r for r in table if r.draft == MODEL)
    row = spec[0]
    assert own.tokens_per_call == row["generated_tokens"] / row["target_calls"]
    assert own.speedup == row["tokens_per_s"] / paired[0]["tokens_per_s"]
    assert "## Drafters side by side" in md


def test_the_runs_take_turns_first_from_prompt_to_prompt():
    """A prompt's runs (the paired plain run and the (drafter, setting) pairs) go in an order rotated
    from prompt to prompt (a fixed order gives each its own place, the reference always first: a
    bias between rows compared), and from repeat to repeat on the same prompt."""
    a, b, c = BUILTIN[0], BUILTIN[1], BUILTIN[2]
    cfg = runner.BenchConfig(target=MODEL, draft=f"{MODEL},ngram", prompts=(a, b, c), modes=("speculative",),
                             temperatures=(0.0,), max_new_tokens=4, threads=1)
    samples = runner.run(cfg, progress=False)["samples"]
    order = [(s["prompt_id"], s.get("draft", s["mode"])) for s in samples]
    P = "plain_paired"
    assert order == [(a.id, P), (a.id, MODEL), (a.id, "ngram"), (b.id, MODEL), (b.id, "ngram"), (b.id, P),
                     (c.id, "ngram"), (c.id, P), (c.id, MODEL)]
    # a second repeat turns each prompt's order one place on (three prompts, three runs: the count divides)
    again = dataclasses.replace(cfg, repeats=2)
    samples = runner.run(again, progress=False)["samples"]
    order = [(s["seed"], s["prompt_id"], s.get("draft", s["mode"])) for s in samples]
    assert order[9:12] == [(1, a.id, MODEL), (1, a.id, "ngram"), (1, a.id, P)]
    # greedy alone at T = 1: no speculative setting to rotate, the paired plain runs all the same
    greedy = runner.BenchConfig(target=MODEL, draft=MODEL, prompts=(a, b), modes=("speculative",), methods=("greedy",),
                                temperatures=(1.0,), max_new_tokens=4, threads=1)
    samples = runner.run(greedy, progress=False)["samples"]
    assert [s["mode"] for s in samples] == ["plain_paired", "plain_paired"]


def test_coupled_rows_get_a_plain_seeded_reference_with_the_same_tokens(tmp_path):
    """At T > 0 with coupled verification, each prompt is also decoded plainly with the coupled rule
    (seeded Gumbel-max sampling, beside the block-rule plain run); the coupled rows' tokens equal
    it (the rule's promise) and the report pairs them with it; the block rows keep plain_paired."""
    a, b = BUILTIN[0], BUILTIN[8]
    cfg = runner.BenchConfig(target=MODEL, draft=MODEL, prompts=(a, b), modes=("speculative",), methods=("coupled", "block"),
                             temperatures=(1.0,), max_new_tokens=12, threads=1)
    result = runner.run(cfg, progress=False)
    samples = result["samples"]
    assert len(samples) == runner._count(cfg, "speculative") == 2 * 4  # what the progress bar expects
    P, C, S = "plain_paired", report.PAIRED_COUPLED, "speculative"
    assert [s["mode"] for s in samples if s["prompt_id"] == a.id] == [P, C, S, S]
    assert [s["mode"] for s in samples if s["prompt_id"] == b.id] == [C, S, S, P]  # the references take turns too
    refs = {s["prompt_id"]: s for s in samples if s["mode"] == report.PAIRED_COUPLED}
    coupled = [s for s in samples if s["mode"] == "speculative" and s["method"] == "coupled"]
    assert set(refs) == {a.id, b.id} and len(coupled) == 2
    assert all(s["tokens_sha1"] == refs[s["prompt_id"]]["tokens_sha1"] for s in coupled)
    written = report.write(result, tmp_path, make_plots=False)
    stats = {(g.mode, g.method): g for g in written["stats"]}
    ratios = sorted(s["tokens_per_s"] / refs[s["prompt_id"]]["tokens_per_s"] for s in coupled)
    assert stats[("speculative", "coupled")].speedup_vs_cloud == pytest.approx(sum(ratios) / 2)  # median of two
    md = (tmp_path / "README.md").read_text()
    assert "## Seeded output identical to plain seeded sampling" in md and "| speculative coupled γ=auto | 1 | 2 | 2 |" in md
    # greedy / block only: no second plain run
    block = runner.run(runner.BenchConfig(target=MODEL, draft=MODEL, prompts=(a,), modes=("speculative",), methods=("block",),
                                          temperatures=(1.0,), max_new_tokens=4, threads=1), progress=False)
    assert not any(s["mode"] == report.PAIRED_COUPLED for s in block["samples"])


def test_draft_vocab_full_reaches_the_worker_and_the_report(tmp_path):
    """``--draft-vocab full``: the speculative rows say the draft could propose every token (the
    shipped draft's reduced vocabulary otherwise), the config and the report's header say so."""
    base = dict(target=MODEL, draft=MODEL, prompts=(BUILTIN[0],), modes=("speculative",), temperatures=(0.0,),
                max_new_tokens=4, threads=1)
    sizes = {}
    for vocab in ("auto", "full"):
        result = runner.run(runner.BenchConfig(**base, draft_vocab=vocab), progress=False)
        spec = [s for s in result["samples"] if s["mode"] == "speculative"]
        sizes[vocab] = {s["draft_vocab_size"] for s in spec}
        assert result["config"]["draft_vocab"] == vocab
        report.write(result, tmp_path / vocab, make_plots=False)
        assert ("full vocabulary" in (tmp_path / vocab / "README.md").read_text()) == (vocab == "full")
    assert sizes == {"auto": {16384}, "full": {49152}}


def test_both_draft_vocabularies_run_side_by_side_in_one_run(tmp_path):
    """``--draft-vocab auto,full``: each drafter decodes every prompt under both vocabularies beside
    the one paired plain run; the rows are labelled apart, say how many tokens the draft could
    propose, equal plain greedy output, and the report keeps them apart and says both ran."""
    cfg = runner.BenchConfig(target=MODEL, draft=MODEL, prompts=(BUILTIN[0], BUILTIN[8]), modes=("speculative",),
                             temperatures=(0.0,), max_new_tokens=6, threads=1, draft_vocab="auto,full")
    result = runner.run(cfg, progress=False)
    samples = result["samples"]
    assert len(samples) == runner._count(cfg, "speculative") == 2 * 3
    spec = [s for s in samples if s["mode"] == "speculative"]
    paired = {s["prompt_id"]: s["tokens_sha1"] for s in samples if s["mode"] == "plain_paired"}
    auto, full = f"{MODEL} · auto vocabulary", f"{MODEL} · full vocabulary"
    assert sorted((s["prompt_id"], s["draft"], s["draft_vocab_size"]) for s in spec) == sorted(
        (p, d, n) for p in paired for d, n in ((auto, 16384), (full, 49152)))
    assert all(s["tokens_sha1"] == paired[s["prompt_id"]] for s in spec)
    report.write(result, tmp_path, make_plots=False)
    md = (tmp_path / "README.md").read_text()
    assert f"speculative/greedy · {auto}" in md and f"speculative/greedy · {full}" in md
    assert "its own and the full vocabulary side by side" in md


def test_the_draft_temperature_factor_reaches_the_worker_and_the_report(tmp_path):
    """``auto`` takes the shipped draft's calibrated 0.85, a number overrides it; ngram rows (no
    model's law) run at 1 in the same job; the report's header says what the drafts sampled at."""
    base = dict(target=MODEL, draft=f"{MODEL},ngram", prompts=(BUILTIN[0],), modes=("speculative",), temperatures=(1.0,),
                max_new_tokens=4, threads=1)
    for factor, want in (("auto", 0.85), ("1", 1.0)):
        result = runner.run(runner.BenchConfig(**base, draft_temperature_factor=factor), progress=False)
        spec = {s["draft"]: s["draft_temperature_factor"] for s in result["samples"] if s["mode"] == "speculative"}
        assert spec == {MODEL: want, "ngram": 1.0}
        report.write(result, tmp_path / factor, make_plots=False)
        assert ("sampled at 0.85 × T" in (tmp_path / factor / "README.md").read_text()) == (factor == "auto")


def test_the_tree_floor_reaches_the_worker_and_the_report(tmp_path):
    """``--tree-min-prob``: a tree round proposes only nodes at or above the floor (the draft is its
    own target here, so a high floor still leaves the confident nodes), greedy = plain either way,
    and the report's header names the floor."""
    base = dict(target=MODEL, draft=MODEL, prompts=(BUILTIN[0],), modes=("speculative",), temperatures=(0.0,),
                gammas=("tree-4",), max_new_tokens=16, threads=1)
    proposed = {}
    for floor in (0.0, 0.9):
        result = runner.run(runner.BenchConfig(**base, tree_min_prob=floor), progress=False)
        spec = [s for s in result["samples"] if s["mode"] == "speculative"]
        paired = [s for s in result["samples"] if s["mode"] == "plain_paired"]
        assert spec and all(s["tokens_sha1"] == paired[0]["tokens_sha1"] for s in spec)
        proposed[floor] = sum(s["draft_tokens_proposed"] for s in spec)
        assert result["config"]["tree_min_prob"] == floor
        report.write(result, tmp_path / str(floor), make_plots=False)
        assert f"tree probability floor {floor:g}" in (tmp_path / str(floor) / "README.md").read_text()
    assert 0 < proposed[0.9] < proposed[0.0]


def test_chat_prompts_on_a_model_with_no_chat_template_say_what_to_do(tmp_path, monkeypatch):
    """A base model (Gemma-3-270M has no chat template) with the built-in chat prompts: the run
    stops with a message naming both ways out, not the generic one of `generate`, before any worker
    starts (read off the folder's files); the code prompts alone run.  A target whose files do not
    tell is stopped the same way by the worker, once its tokenizer loads."""
    from tiny import make_tiny, without_chat_template

    from specdec.errors import SpecdecError

    folder = without_chat_template(make_tiny(tmp_path / "base"))
    chat = next(p for p in BUILTIN if p.chat)
    cfg = runner.BenchConfig(target=str(folder), draft="none", prompts=(BUILTIN[0], chat), modes=("plain",),
                             temperatures=(0.0,), max_new_tokens=4, threads=1)
    with monkeypatch.context() as m:
        m.setattr(runner, "_run_worker", lambda *a, **k: pytest.fail("a worker started"))
        with pytest.raises(SpecdecError, match=r"no chat template.*--categories code.*\"chat\": false"):
            runner.run(cfg, progress=False)
    with monkeypatch.context() as m:  # the files cannot tell: the worker's check, after the load
        m.setattr(runner, "check_chat_files", lambda *a: None)
        with pytest.raises(SpecdecError, match=r"no chat template.*--categories code.*\"chat\": false"):
            runner.run(cfg, progress=False)
    result = runner.run(dataclasses.replace(cfg, prompts=(BUILTIN[0],)), progress=False)
    assert [s["generated_tokens"] for s in result["samples"]] == [4]


def test_every_worker_job_carries_the_runs_sampling_and_cache_settings():
    """seed, top-p, repetition penalty and the key/value cache dtype go to each mode's worker as set."""
    cfg = runner.BenchConfig(target="t", draft="d", prompts=(BUILTIN[0],), modes=("plain", "speculative"),
                             seed=11, top_p=0.8, repetition_penalty=1.2, kv_dtype="float16", repeats=2)
    for mode in cfg.modes:
        job = runner._job(cfg, mode)
        assert (job["seed"], job["top_p"], job["repetition_penalty"], job["kv_dtype"], job["repeats"]) == (11, 0.8, 1.2, "float16", 2)
        assert job["mode"] == mode and [p["id"] for p in job["prompts"]] == [BUILTIN[0].id]


def _job(**kw):
    kw.setdefault("temperatures", [0.0])
    return worker.Job(mode=kw.pop("mode", "speculative"), target="t", draft="d", prompts=[], **kw)


def test_each_repeat_runs_at_its_own_seed(monkeypatch):
    """Repeat r of a prompt runs at seed + r (--repeats: seed, seed+1, ...), announcing its unit after its rows."""
    p = BUILTIN[0]
    emitted = []
    monkeypatch.setattr(worker, "_emit", emitted.append)
    got = [(rep, seed) for rep, seed, _, _ in worker._units(_job(temperatures=[0.0], repeats=3, seed=5), [p], 0.0)]
    assert got == [(0, 5), (1, 6), (2, 7)]
    assert emitted == [{"unit": [0.0, r, p.id]} for r in range(3)]


def test_sampling_settings_follow_the_job():
    """top-p applies at T > 0 only; the repetition penalty applies as set (1.0 when off); the seed is the unit's."""
    job = _job(top_p=0.9, repetition_penalty=1.3, max_new_tokens=7)
    hot, cold = worker._sampling(job, 0.7, 3), worker._sampling(job, 0.0, 3)
    assert (hot.top_p, hot.repetition_penalty, hot.seed, hot.max_new_tokens) == (0.9, 1.3, 3, 7)
    assert cold.top_p is None and worker._sampling(_job(), 0.7, 0).repetition_penalty == 1.0


def test_greedy_runs_at_temperature_zero_only():
    """--methods greedy,block: greedy at T = 0 only; at any T > 0 (0.5 too) only the sampling rule runs."""
    job = _job(methods=["greedy", "block"], gammas=["4"])
    assert list(worker._settings(job, 0.0)) == [("greedy", "4"), ("block", "4")]
    assert list(worker._settings(job, 0.5)) == [("block", "4")]


def test_the_order_turns_from_repeat_to_repeat_on_one_prompt():
    """A prompt's runs start one place further on in each repeat, not in the same order every repeat."""
    arms = ["a", "b", "c"]
    assert [worker._in_turn(arms, 0, rep)[0] for rep in range(3)] == ["a", "b", "c"]
    assert worker._in_turn(arms, 1, 1) == ["c", "a", "b"]


def test_a_row_carries_its_prompts_category():
    """Each row is labelled with its prompt's category, mode, method, γ, T and seed."""
    chat = next(p for p in BUILTIN if p.category == "chat")
    res = SimpleNamespace(tokens=[1, 2], stats=SimpleNamespace(method="block", to_dict=lambda: {"method": "block", "generated_tokens": 2}))
    row = worker._row(_job(), "speculative", "block", "4", 1.0, chat, 9, res)
    assert (row["category"], row["prompt_id"], row["mode"], row["method"], row["gamma"], row["temperature"], row["seed"]) == (
        "chat", chat.id, "speculative", "block", "4", 1.0, 9)
    assert row["rule"] == "block" and row["generated_tokens"] == 2
