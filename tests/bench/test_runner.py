"""``specdec bench``'s runner (specdec.bench.runner) without a model: the jobs and counts it plans,
what ``--draft-vocab`` accepts, how a worker's failure is reported, that a worker's stderr cannot
block it, and what ``run`` hands the network groups. Worker processes here are tiny shell scripts;
the end-to-end runs with models are in test_bench_e2e.py."""

from __future__ import annotations

import os
import sys
import threading
from types import SimpleNamespace

import pytest

from specdec.bench import runner
from specdec.bench.journal import Kept
from specdec.bench.workloads import Prompt
from specdec.errors import ConfigError, SpecdecError

P = Prompt(id="p", category="code", text="def f():", chat=False)


def _cfg(**kw):
    return runner.BenchConfig(target="t", draft="d", prompts=(P,), **kw)


def test_no_llamacpp_variants_no_llamacpp_rows():
    """--llamacpp with nothing to run: no worker hosts llama.cpp rows and none are counted."""
    cfg = _cfg(modes=("speculative", "llamacpp"), llamacpp=())
    assert runner._llamacpp_host(cfg) is None and "llamacpp" not in runner._job(cfg, "speculative")
    assert runner._count(cfg, "llamacpp") == 0


def test_the_edge_worker_job_carries_the_sparse_q_top_k():
    assert runner._job(_cfg(q_top_k=8), "edge_cloud")["q_top_k"] == 8
    assert "q_top_k" not in runner._job(_cfg(q_top_k=8), "plain")


def test_draft_vocab_is_case_insensitive_and_refuses_repeats_and_empty_lists():
    assert runner.split_vocabs(" Auto , FULL ") == ["auto", "full"]
    with pytest.raises(ConfigError, match="twice"):
        runner.split_vocabs("auto,auto")
    with pytest.raises(ConfigError, match="takes auto, full or both"):
        runner.split_vocabs(" , ")


def test_arm_labels_name_the_vocabulary_whenever_several_are_compared():
    assert [a[0] for a in runner.draft_arms("a,b", "auto")] == ["a", "b"]
    assert [a[0] for a in runner.draft_arms("a,b", "auto,full")] == [
        "a · auto vocabulary", "a · full vocabulary", "b · auto vocabulary", "b · full vocabulary"]


def test_the_progress_count_adds_the_coupled_reference_only_at_t_above_zero_and_greedy_only_at_zero():
    """Per prompt: one paired plain run per T, one more for coupled at T > 0, then each method × γ
    (greedy only at T = 0)."""
    assert runner._count(_cfg(modes=("speculative",), methods=("coupled",), temperatures=(0.0,)), "speculative") == 2
    assert runner._count(_cfg(modes=("speculative",), methods=("greedy", "block"), temperatures=(0.0, 1.0)), "speculative") == 5


def _sh(script):  # a worker command line: the runner appends python -m specdec.bench.worker, sh ignores it
    return ["sh", "-c", script, "sh"]


def test_a_worker_that_exits_without_its_done_row_has_failed():
    with pytest.raises(SpecdecError, match="bench mode plain failed"):
        runner._run_worker({"mode": "plain"}, dict(os.environ), _sh("exit 0"), "plain", lambda row: None)


def test_the_workers_own_error_line_is_shown_alone_even_after_warnings():
    script = "echo 'a warning' >&2; echo 'specdec-worker: error: no such model' >&2; exit 2"
    with pytest.raises(SpecdecError) as exc:
        runner._run_worker({"mode": "plain"}, dict(os.environ), _sh(script), "plain", lambda row: None)
    assert str(exc.value) == "bench mode plain: no such model"


def test_a_crashed_worker_shows_its_last_five_stderr_lines():
    script = "for i in 1 2 3 4 5 6 7; do echo line$i >&2; done; exit 1"
    with pytest.raises(SpecdecError) as exc:
        runner._run_worker({"mode": "plain"}, dict(os.environ), _sh(script), "plain", lambda row: None)
    assert str(exc.value) == "bench mode plain failed:\n" + "\n".join(f"line{i}" for i in range(3, 8))


def test_a_worker_killed_by_sighup_is_named_too():
    """The worker raises SIGHUP on itself with its default action restored: a shell's ``kill -HUP $$``
    does nothing where the tests run with SIGHUP ignored (nohup), and a shell cannot restore it."""
    hup = "import os, signal; signal.signal(signal.SIGHUP, signal.SIG_DFL); os.kill(os.getpid(), signal.SIGHUP)"
    with pytest.raises(SpecdecError, match=r"killed by SIGHUP \(a crash in native code\)"):
        runner._run_worker({"mode": "plain"}, dict(os.environ), [sys.executable, "-c", hup], "plain", lambda row: None)


@pytest.fixture
def no_workers(monkeypatch):
    """run() without processes: no worker starts, each network group's arguments are recorded."""
    groups = []

    def no_worker(*args, **kwargs):
        raise AssertionError("no worker may start")

    monkeypatch.setattr(runner, "_run_worker", no_worker)
    monkeypatch.setattr(runner.network, "run_group", lambda group, **kw: groups.append((group, kw)))
    monkeypatch.setattr(runner, "machine_info", lambda: {})
    return groups


def test_an_unknown_mode_is_refused_before_any_worker_starts(no_workers):
    with pytest.raises(SpecdecError, match="unknown bench mode 'edge'"):
        runner.run(_cfg(modes=("edge",)), progress=False)


def test_run_hands_each_network_group_the_runs_threads_vocabulary_and_job(no_workers):
    cfg = _cfg(modes=("edge_cloud", "cloud_streaming_spec"), threads=3, draft_vocab="full", kv_dtype="float16",
               rtt_emulation="proxy", q_top_k=8)
    runner.run(cfg, progress=False)
    [(shared, kw), (spec, kw2)] = no_workers
    assert shared == ["edge_cloud"] and spec == ["cloud_streaming_spec"]
    assert (kw["threads"], kw["draft_vocab"], kw["kv_dtype"], kw["emulation"].kind) == (3, "full", "float16", "proxy")
    assert kw["job"]["q_top_k"] == 8 and kw2["job"]["mode"] == "cloud_streaming_spec"


def test_the_recorded_target_precision_is_that_of_the_runs_dtype(no_workers, monkeypatch):
    asked = []
    monkeypatch.setattr(runner, "_target_precision", lambda target, dtype: asked.append((target, dtype)) or dtype)
    result = runner.run(_cfg(modes=(), dtype="bfloat16"), progress=False)
    assert asked == [("t", "bfloat16")] and result["config"]["target_precision"] == "bfloat16"


def test_a_resumed_runs_progress_starts_at_the_rows_it_kept(no_workers, monkeypatch):
    """Every mode's worker ended in the run resumed: nothing runs, the bar starts at the kept rows."""
    import tqdm.auto

    bars = []

    def bar(**kw):
        bars.append(kw)
        return SimpleNamespace(set_postfix_str=lambda s: None, update=lambda n: None, close=lambda: None)

    monkeypatch.setattr(tqdm.auto, "tqdm", bar)
    row = {"mode": "plain", "prompt_id": "p"}
    kept = Kept(samples=[row], finished={"plain": {"rss_peak_bytes": 1, "seconds": 2.0}}, parts=1)
    result = runner.run(_cfg(modes=("plain",), temperatures=(0.0,)), progress=False, journal=SimpleNamespace(kept=kept))
    assert bars[0]["initial"] == 1 and bars[0]["total"] == 1
    assert result["samples"] == [row] and result["processes"] == {"plain": kept.finished["plain"]} and result["resumed"] == 1



def test_a_worker_that_writes_much_to_stderr_does_not_hang_the_bench():
    """200 kB of stderr (past a 64 KiB pipe), then the done row: _run_worker returns it. Its stderr
    once was a pipe read only after stdout ended, so the worker blocked on it and the bench hung.
    The 30 s join only guards against that hang; nothing here is timed."""
    script = "head -c 200000 /dev/zero | tr '\\0' x >&2; echo '{\"done\": true, \"rss_peak_bytes\": 1}'"
    out = {}

    def call():
        out["done"] = runner._run_worker({"mode": "plain"}, dict(os.environ), _sh(script), "plain", lambda row: None)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the runner deadlocked on a worker's full stderr pipe"
    assert out["done"] == {"done": True, "rss_peak_bytes": 1}


def test_a_crashed_worker_whose_stderr_is_not_utf8_is_still_reported():
    """A native crash may write any bytes to stderr: the failure is still reported (the bytes that
    are not UTF-8 replaced), not a UnicodeDecodeError."""
    script = "printf 'bad \\377\\376 bytes\\n' >&2; exit 1"
    with pytest.raises(SpecdecError, match="bench mode plain failed:\nbad .* bytes"):
        runner._run_worker({"mode": "plain"}, dict(os.environ), _sh(script), "plain", lambda row: None)
