"""`specdec bench --resume`: a run stopped by Ctrl-C, SIGTERM or a failing worker keeps the units
(temperature, repeat, prompt) its workers finished in OUT/partial.jsonl; the same command with
--resume runs only the rest, and the result has every row once. The end-to-end tests run real
worker processes (and, for the edge-cloud modes, a server and delay proxies) on the bundled
15.7 M-parameter draft as the target, 2-3 prompts, 4 tokens."""

from __future__ import annotations

import json

import pytest

from specdec.bench import journal as jr
from specdec.bench import report, runner
from specdec.bench.worker import Job, _FirstTokenTimer, _todo
from specdec.bench.workloads import BUILTIN, Prompt
from specdec.cli import main
from specdec.errors import ConfigError

MODEL = "smollm2-135m-draft"
CONFIG = {"target": "t", "max_new_tokens": 8, "prompts": [{"id": "a"}], "command": "specdec bench"}


def _row(prompt: str, mode: str = "plain") -> dict:
    return {"mode": mode, "prompt_id": prompt, "rss_peak_bytes": 100}


def test_the_journal_keeps_finished_units_and_drops_a_line_cut_short(tmp_path):
    j = jr.Journal.open(tmp_path, CONFIG, resume=False)
    j.unit("plain", [0.0, 0, "a"], 2.0, [_row("a")])
    j.unit("plain", [0.0, 0, "b"], 1.0, [_row("b")])
    j.finished("plain", {"rss_peak_bytes": 7, "seconds": 3.0})
    j.unit("speculative", [0.0, 0, "a"], 4.0, [_row("a", "plain_paired"), _row("a", "speculative")])
    j.close()
    path = tmp_path / jr.NAME
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"mode": "speculative", "unit": [0.0, 0, "b"], "sam')  # stopped mid-write
    # another command line (--resume added) is the same run; the settings are not
    j = jr.Journal.open(tmp_path, {**CONFIG, "command": "specdec bench --resume"}, resume=True)
    kept = j.kept
    assert [(r["mode"], r["prompt_id"]) for r in kept.samples] == [
        ("plain", "a"), ("plain", "b"), ("plain_paired", "a"), ("speculative", "a")]
    assert kept.units == {"plain": {(0.0, 0, "a"), (0.0, 0, "b")}, "speculative": {(0.0, 0, "a")}}
    assert kept.finished == {"plain": {"rss_peak_bytes": 7, "seconds": 3.0}} and kept.seconds["plain"] == 3.0
    assert kept.parts == 1 and kept.workers == {"plain": 1, "speculative": 1}
    j.unit("speculative", [0.0, 0, "b"], 4.0, [_row("b", "speculative")])
    j.close()
    # the cut line went before this run appended: the file reads whole, the unit once
    assert path.read_bytes().startswith(whole) and b'"sam\n' not in path.read_bytes()
    kept = jr.read(path, jr.config_key(CONFIG))
    assert kept.parts == 2 and kept.units["speculative"] == {(0.0, 0, "a"), (0.0, 0, "b")}
    assert kept.workers == {"plain": 1, "speculative": 2}


def test_the_journal_refuses_what_it_cannot_resume_and_loses_nothing(tmp_path):
    with pytest.raises(ConfigError, match="holds no interrupted run"):
        jr.Journal.open(tmp_path, CONFIG, resume=True)
    jr.Journal.open(tmp_path, CONFIG, resume=False).close()
    path = tmp_path / jr.NAME
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="holds an interrupted run .* pass --resume"):  # its rows would be lost
        jr.Journal.open(tmp_path, CONFIG, resume=False)
    with pytest.raises(ConfigError, match=r"had other settings \(max_new_tokens\)"):
        jr.Journal.open(tmp_path, {**CONFIG, "max_new_tokens": 16}, resume=True)
    assert path.read_bytes() == before
    path.write_bytes(before + b"not json\n" + b'{"resumed": 1}\n')
    with pytest.raises(ConfigError, match="damaged at line 2"):
        jr.Journal.open(tmp_path, CONFIG, resume=True)
    path.write_bytes(b'{"accuracy": 0.9}\n')
    with pytest.raises(ConfigError, match="not a specdec bench journal"):
        jr.Journal.open(tmp_path, CONFIG, resume=True)


def test_a_run_is_resumed_only_on_the_machine_and_software_it_ran_on(tmp_path):
    """Rows measured on two CPUs (or torch builds) would be compared as if from one run."""
    here = {"cpu": "AMD EPYC 9R14", "cpu_count": 2, "torch": "2.13.0", "platform": "Linux-6.1"}
    jr.Journal.open(tmp_path, CONFIG, resume=False, machine=here).close()
    rebooted = {**here, "platform": "Linux-6.2"}  # the OS release alone: the same machine
    jr.Journal.open(tmp_path, CONFIG, resume=True, machine=rebooted).close()
    for other, says in (({**here, "cpu": "Intel Xeon 8488C"}, "cpu: AMD EPYC 9R14 there, Intel Xeon 8488C here"),
                        ({**here, "torch": "2.12.0"}, "torch: 2.13.0 there, 2.12.0 here")):
        with pytest.raises(ConfigError, match=f"ran on another machine or software \\({says}\\)"):
            jr.Journal.open(tmp_path, CONFIG, resume=True, machine=other)


def test_a_run_stopped_before_its_first_unit_leaves_nothing_behind(tmp_path):
    out = tmp_path / "runs" / "one"
    j = jr.Journal.open(out, CONFIG, resume=False)
    assert (out / jr.NAME).is_file()
    assert j.stop() == 0 and not (tmp_path / "runs").exists()


def test_a_stopped_bench_resumes_where_it_stopped_with_every_row_once(tmp_path, monkeypatch):
    """Stopped (KeyboardInterrupt, as Ctrl-C or SIGTERM raise) after the speculative worker's second
    prompt: the resumed run skips the plain mode (its worker had ended) and those two prompts, and
    returns each (mode, prompt) row once, the kept rows as they were."""
    a, b, c = BUILTIN[0], BUILTIN[1], BUILTIN[2]
    cfg = runner.BenchConfig(target=MODEL, draft=MODEL, prompts=(a, b, c), modes=("plain", "speculative"),
                             temperatures=(0.0,), max_new_tokens=4, threads=1)
    config = runner.config_dict(cfg)
    real_unit = jr.Journal.unit

    def stop_after_two(self, mode, unit, seconds, samples):
        real_unit(self, mode, unit, seconds, samples)
        if mode == "speculative" and len(self.units_lengths) == 5:  # plain's 3, speculative's 2
            raise KeyboardInterrupt

    monkeypatch.setattr(jr.Journal, "unit", stop_after_two)
    journal = jr.Journal.open(tmp_path, config, resume=False)
    with pytest.raises(KeyboardInterrupt):
        runner.run(cfg, progress=False, journal=journal)
    assert journal.stop() == 3 + 2 * 2  # plain's rows, and plain_paired + speculative for a and b
    monkeypatch.setattr(jr.Journal, "unit", real_unit)

    journal = jr.Journal.open(tmp_path, config, resume=True)
    kept = [dict(r) for r in journal.kept.samples]
    spawned = []
    real_worker = runner._run_worker

    def worker(job, *args, **kwargs):
        spawned.append((job["mode"], job["skip"]))
        return real_worker(job, *args, **kwargs)

    monkeypatch.setattr(runner, "_run_worker", worker)
    result = runner.run(cfg, progress=False, journal=journal)
    journal.remove()
    assert spawned == [("speculative", [[0.0, 0, a.id], [0.0, 0, b.id]])]  # plain's worker had ended
    rows = [(s["mode"], s["prompt_id"]) for s in result["samples"]]
    assert sorted(rows) == sorted((m, p.id) for m in ("plain", "plain_paired", "speculative") for p in (a, b, c))
    assert result["samples"][:len(kept)] == kept and result["resumed"] == 1
    spec = {s["prompt_id"]: s for s in result["samples"] if s["mode"] == "speculative"}
    paired = {s["prompt_id"]: s for s in result["samples"] if s["mode"] == "plain_paired"}
    assert all(spec[p]["tokens_sha1"] == paired[p]["tokens_sha1"] for p in spec)  # greedy = plain, both parts
    assert result["processes"]["speculative"]["workers"] == 2 and "workers" not in result["processes"]["plain"]
    assert not (tmp_path / jr.NAME).exists()
    md = report.markdown(result, report.aggregate(result["samples"], result["processes"]), [], [])
    assert "This run was stopped and resumed once (`--resume`)" in md and "| speculative (2 processes) |" in md


def test_a_stopped_edge_cloud_run_resumes_at_the_rtt_and_prompt_it_stopped(tmp_path, monkeypatch):
    """Edge-cloud modes over the delay proxy, RTTs 0 and 30 ms, 2 prompts, stopped after the 30 ms
    worker's first prompt: the resumed run starts one server and one edge worker (the 30 ms one,
    skipping that prompt), returns each (RTT, mode, prompt) row once, and adds up what the two
    runs' servers and proxies reported (each wrote its totals to the journal when it stopped)."""
    a, b = BUILTIN[0], BUILTIN[1]
    cfg = runner.BenchConfig(target=MODEL, draft=MODEL, prompts=(a, b), modes=("edge_cloud", "cloud_streaming"),
                             temperatures=(0.0,), wires=("greedy",), rtts=(0.0, 30.0), max_new_tokens=4,
                             rtt_emulation="proxy", threads=1)
    config = runner.config_dict(cfg)
    leg0, leg30, server = ("cloud_streaming+edge_cloud" + s for s in ("@0ms", "@30ms", ":server"))
    real_unit = jr.Journal.unit

    def stop_in_the_second_rtt(self, mode, unit, seconds, samples):
        real_unit(self, mode, unit, seconds, samples)
        if mode == leg30:
            raise KeyboardInterrupt

    monkeypatch.setattr(jr.Journal, "unit", stop_in_the_second_rtt)
    journal = jr.Journal.open(tmp_path, config, resume=False)
    with pytest.raises(KeyboardInterrupt):
        runner.run(cfg, progress=False, journal=journal)
    assert journal.stop() == 3 * 2  # two rows a prompt: 0 ms's two prompts and 30 ms's first
    monkeypatch.setattr(jr.Journal, "unit", real_unit)

    journal = jr.Journal.open(tmp_path, config, resume=True)
    first = journal.kept
    assert set(first.finished) == {leg0} and set(first.totals) == {leg0, leg30, server}  # stopped ones report too
    spawned, servers = [], []
    real_worker, real_server = runner._run_worker, runner.network.CloudServer.start

    def worker(job, *args, **kwargs):
        spawned.append((job["rtt_ms"], job["skip"]))
        return real_worker(job, *args, **kwargs)

    def start(self):
        servers.append(self)
        return real_server(self)

    monkeypatch.setattr(runner, "_run_worker", worker)
    monkeypatch.setattr(runner.network.CloudServer, "start", start)
    result = runner.run(cfg, progress=False, journal=journal)
    assert spawned == [(30.0, [[0.0, 0, a.id]])] and len(servers) == 1
    rows = sorted((s["rtt_ms"], s["mode"], s["prompt_id"]) for s in result["samples"])
    assert rows == sorted((r, m, p.id) for r in (0.0, 30.0) for m in ("edge_cloud", "cloud_streaming") for p in (a, b))
    text = {(s["rtt_ms"], s["mode"], s["prompt_id"]): s["text_sha1"] for s in result["samples"]}
    assert all(text[(r, "edge_cloud", p.id)] == text[(r, "cloud_streaming", p.id)] for r in (0.0, 30.0) for p in (a, b))
    both = jr.read(tmp_path / jr.NAME, jr.config_key(config)).totals  # the two runs' reports
    assert len(both[leg30]) == len(both[server]) == 2 and len(both[leg0]) == 1
    net, procs = result["network"], result["processes"]
    assert net["proxy_totals"][leg0] == both[leg0][0]
    assert net["proxy_totals"][leg30] == {k: both[leg30][0][k] + both[leg30][1][k] for k in both[leg30][0]}
    assert procs[leg0] == first.finished[leg0] and procs[leg30]["workers"] == 2 and "workers" not in procs[leg0]
    assert procs[server]["workers"] == 2
    assert procs[server]["seconds"] == pytest.approx(sum(t["seconds"] for t in both[server]))
    assert net["servers"]["cloud_streaming+edge_cloud"]["rss_peak_bytes"] == max(t["rss_peak_bytes"] for t in both[server])
    journal.remove()

def _bench(capsys, *args: str) -> tuple[int, str]:
    code = main(["bench", "--modes", "plain", "--limit", "1", "--temperatures", "0", *args])
    return code, capsys.readouterr().err


def test_bench_resume_says_what_it_needs_and_what_it_kept(capsys, tmp_path, monkeypatch):
    code, err = _bench(capsys, "--resume")
    assert code == 2 and "--resume needs --out" in err and "Traceback" not in err
    code, err = _bench(capsys, "--resume", "--report-only", "--out", str(tmp_path))
    assert code == 2 and "give one of them" in err
    code, err = _bench(capsys, "--resume", "--out", str(tmp_path))
    assert code == 2 and "holds no interrupted run" in err

    def stopped(cfg, *, progress=True, journal=None):  # one unit finished, then Ctrl-C
        journal.unit("plain", [0.0, 0, cfg.prompts[0].id], 1.0, [_row(cfg.prompts[0].id)])
        raise KeyboardInterrupt

    monkeypatch.setattr(runner, "run", stopped)
    code, err = _bench(capsys, "--out", str(tmp_path))
    assert code == 130 and f"{tmp_path}/partial.jsonl keeps 1 generation; the same command with --resume goes on" in err
    code, err = _bench(capsys, "--out", str(tmp_path), "--max-new-tokens", "9")
    assert code == 2 and "pass --resume to go on from it" in err  # not started over: the kept row stays
    code, err = _bench(capsys, "--out", str(tmp_path), "--max-new-tokens", "9", "--resume")
    assert code == 2 and "had other settings (max_new_tokens)" in err
    path = tmp_path / jr.NAME
    assert len(jr.read(path, json.loads(path.read_text().splitlines()[0])["config"]).samples) == 1


def test_a_resumed_run_stopped_again_before_a_new_unit_keeps_the_earlier_rows(tmp_path):
    j = jr.Journal.open(tmp_path, CONFIG, resume=False)
    j.unit("plain", [0.0, 0, "a"], 1.0, [{"mode": "plain", "prompt_id": "a"}])
    assert j.stop() == 1
    j = jr.Journal.open(tmp_path, CONFIG, resume=True)
    assert j.kept_count == 1  # the first run's row, none of this one's yet
    assert j.stop() == 1 and (tmp_path / jr.NAME).is_file()  # not removed: its row would be lost
    j = jr.Journal.open(tmp_path, CONFIG, resume=True)
    j.unit("plain", [0.0, 0, "b"], 1.0, [{"mode": "plain", "prompt_id": "b"}])
    assert j.stop() == 2


def test_a_resumed_worker_skips_exactly_the_kept_units_of_each_repeat():
    a, b = Prompt("a", "code", "x", False), Prompt("b", "code", "y", False)
    job = Job(mode="plain", target="t", draft="d", prompts=[], temperatures=[0.0, 1.0], repeats=2,
              skip=[[0.0, 0, "a"], [0.0, 1, "b"], [1.0, 0, "b"]])
    # (repeat, index, prompt): T = 0 leaves out repeat 0 of a and repeat 1 of b; T = 1 repeat 0 of b
    assert _todo(job, [a, b], 0.0) == [(0, 1, b), (1, 0, a)]
    assert _todo(job, [a, b], 1.0) == [(0, 0, a), (1, 0, a), (1, 1, b)]


def test_hf_first_token_time_is_taken_at_the_first_generated_token_not_the_prompt():
    timer = _FirstTokenTimer()
    timer.put("prompt ids")  # transformers' streamer gets the prompt first
    assert timer.first is None
    timer.put("token 1")
    first = timer.first
    assert first is not None
    timer.put("token 2")
    assert timer.first == first


def test_the_kept_peak_memory_is_the_highest_of_every_row_of_a_unit(tmp_path):
    """A unit's rows each report their worker's peak RSS: the journal keeps the highest, not the first."""
    j = jr.Journal.open(tmp_path, CONFIG, resume=False)
    j.unit("speculative", [0.0, 0, "a"], 1.0, [{"mode": "plain_paired", "rss_peak_bytes": 100},
                                               {"mode": "speculative", "rss_peak_bytes": 300}])
    j.close()
    assert jr.read(tmp_path / jr.NAME, jr.config_key(CONFIG)).rss_peak_bytes == {"speculative": 300}


def test_a_journal_that_recorded_no_machine_is_not_resumed_on_a_machine(tmp_path):
    """A journal whose first line names no machine does not match the machine of the resuming run."""
    jr.Journal.open(tmp_path, CONFIG, resume=False).close()  # no machine recorded
    with pytest.raises(ConfigError, match="ran on another machine or software"):
        jr.Journal.open(tmp_path, CONFIG, resume=True, machine={"cpu": "AMD EPYC 9R14", "cpu_count": 2})


class _Bar:
    def update(self, n):
        pass


def test_a_resumed_workers_record_adds_the_earlier_parts_time_and_keeps_their_peak(monkeypatch):
    """A resumed worker's process record: seconds = this part's + the kept units', peak RSS = the
    higher of this worker's and the kept rows', workers = 1 + the earlier ones; it skips the kept units."""
    seen = {}

    def worker(job, env, prefix, name, on_sample, on_unit=None):
        seen["skip"] = job["skip"]
        on_sample({"mode": "plain", "prompt_id": "b"})
        on_unit([0.0, 0, "b"])
        return {"done": True, "rss_peak_bytes": 200}

    monkeypatch.setattr(runner, "_run_worker", worker)
    kept = jr.Kept(units={"plain": {(0.0, 0, "a")}}, seconds={"plain": 50.0}, rss_peak_bytes={"plain": 900},
                   workers={"plain": 1}, parts=1)
    samples = []
    process = runner._run_journaled({"mode": "plain"}, {}, [], "plain", kept, None, samples, _Bar())
    assert seen["skip"] == [[0.0, 0, "a"]] and samples == [{"mode": "plain", "prompt_id": "b"}]
    assert process["seconds"] >= 50.0 and process["rss_peak_bytes"] == 900 and process["workers"] == 2


HERE = {"cpu": "AMD EPYC 9R14", "cpu_count": 2}


def _head(**fields) -> bytes:
    return json.dumps({"journal": jr.FORMAT, "config": jr.config_key(CONFIG), **fields}).encode() + b"\n"


def test_a_resumed_journal_holds_only_whole_lines_even_when_nothing_new_is_written(tmp_path):
    """The line cut short goes from the file itself (not only from what is read): a resumed run
    that stops before its next unit leaves a file of whole JSON lines."""
    j = jr.Journal.open(tmp_path, CONFIG, resume=False)
    j.unit("plain", [0.0, 0, "a"], 1.0, [{"mode": "plain", "prompt_id": "a"}])
    j.close()
    path = tmp_path / jr.NAME
    path.write_bytes(path.read_bytes() + b'{"mode": "plain", "unit": [0.0, 0, "b"], "seconds": 1.0, "samples": [{"mo')
    jr.Journal.open(tmp_path, CONFIG, resume=True).stop()
    data = path.read_bytes()
    assert data.endswith(b"\n") and all(isinstance(json.loads(x), dict) for x in data.splitlines())


@pytest.mark.parametrize("line", [b"[1, 2]", b'"text"', b'{"mode": "plain", "unit": \xff}'])
def test_a_line_that_is_not_a_json_object_is_damage_not_a_crash(tmp_path, line):
    """A JSON array or string, or bytes that are not UTF-8, is a damaged journal (ConfigError naming
    the line), not an AttributeError or UnicodeDecodeError, and not a line silently skipped."""
    path = tmp_path / jr.NAME
    path.write_bytes(_head() + line + b"\n")
    with pytest.raises(ConfigError, match="damaged at line 2"):
        jr.Journal.open(tmp_path, CONFIG, resume=True)


@pytest.mark.parametrize("head", [{"journal": 2, "config": jr.config_key(CONFIG)}, {"journal": 1}])
def test_a_journal_of_another_format_or_without_settings_is_not_resumed(tmp_path, head):
    """A first line of another journal format, or with no settings, is not a specdec bench journal
    (a ConfigError saying so, not a KeyError or a resume of rows written in another format)."""
    (tmp_path / jr.NAME).write_bytes(json.dumps(head).encode() + b"\n")
    with pytest.raises(ConfigError, match="not a specdec bench journal"):
        jr.Journal.open(tmp_path, CONFIG, resume=True)


def test_a_journal_that_recorded_a_machine_is_not_resumed_without_one(tmp_path):
    """The machine a journal recorded must be repeated: a resume that reports none ({}) differs."""
    jr.Journal.open(tmp_path, CONFIG, resume=False, machine=HERE).close()
    with pytest.raises(ConfigError, match="ran on another machine or software"):
        jr.Journal.open(tmp_path, CONFIG, resume=True)


def test_a_journal_written_without_a_machine_field_is_compared_as_an_empty_machine(tmp_path):
    """A first line with no "machine" key reads as {}: resumed where none is reported, and refused
    with the usual message (not an AttributeError) on a machine."""
    (tmp_path / jr.NAME).write_bytes(_head())
    jr.Journal.open(tmp_path, CONFIG, resume=True).close()
    with pytest.raises(ConfigError, match="ran on another machine or software"):
        jr.Journal.open(tmp_path, CONFIG, resume=True, machine=HERE)


def test_the_kept_peak_memory_is_the_highest_over_every_unit_of_a_mode(tmp_path):
    """The peak RSS kept for a mode is the highest of all its units' rows, not the last unit's."""
    j = jr.Journal.open(tmp_path, CONFIG, resume=False)
    j.unit("plain", [0.0, 0, "a"], 1.0, [{"mode": "plain", "rss_peak_bytes": 500}])
    j.unit("plain", [0.0, 0, "b"], 1.0, [{"mode": "plain", "rss_peak_bytes": 200}])
    j.close()
    assert jr.read(tmp_path / jr.NAME, jr.config_key(CONFIG)).rss_peak_bytes == {"plain": 500}


def test_every_stop_of_a_server_or_proxy_is_kept_not_only_the_last(tmp_path):
    """A server stopped in each of two parts: both totals are kept, in order, to be added up."""
    j = jr.Journal.open(tmp_path, CONFIG, resume=False)
    j.totals("g:server", {"seconds": 1.0})
    j.close()
    j = jr.Journal.open(tmp_path, CONFIG, resume=True)
    j.totals("g:server", {"seconds": 2.0})
    j.close()
    assert jr.read(tmp_path / jr.NAME, jr.config_key(CONFIG)).totals == {"g:server": [{"seconds": 1.0}, {"seconds": 2.0}]}


def test_a_finished_unit_is_on_disk_before_the_journal_closes(tmp_path):
    """Each line is flushed as it is written: a run killed outright (no close) keeps its finished units."""
    j = jr.Journal.open(tmp_path, CONFIG, resume=False)
    j.unit("plain", [0.0, 0, "a"], 1.0, [{"mode": "plain", "prompt_id": "a"}])
    try:
        assert jr.read(tmp_path / jr.NAME, jr.config_key(CONFIG)).units == {"plain": {(0.0, 0, "a")}}
    finally:
        j.close()
