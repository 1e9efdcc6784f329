"""``specdec bench``: plan the jobs, run each mode in its own process, collect the samples.

Modes, all on the same prompts, sampling settings and seeds:

* ``plain``   — the target alone (plain decoding through specdec's loop, same backend);
* ``edge_only``    — the draft model alone;
* ``speculative``  — target + draft with every requested rule × γ;
* ``hf_plain``     — Hugging Face ``model.generate`` on the same target weights;
* ``hf_assisted``  — Hugging Face assisted generation (``assistant_model=`` the same draft);
* ``llamacpp``     — llama.cpp on the GGUF file the target comes from (``llama-cpp-python``),
  plain and speculative (:mod:`specdec.bench.llamacpp`); when ``speculative`` runs too, these
  rows run inside its worker, prompt by prompt next to specdec's, so their ratios are paired;
* ``edge_cloud``, ``cloud_streaming``, ``cloud_streaming_spec`` — the edge–cloud split over an
  emulated RTT (see :mod:`specdec.bench.network`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specdec import defaults
from specdec.bench import network
from specdec.bench.journal import Journal, Kept
from specdec.bench.workloads import Prompt, check_chat_files
from specdec.errors import SpecdecError

#: how a worker marks a user-facing error on its last stderr line (the runner shows that line alone)
ERROR_MARK = "specdec-worker: error: "

LOCAL_MODES = ("plain", "edge_only", "speculative", "hf_plain", "hf_assisted", "llamacpp")
MODES = LOCAL_MODES + network.NETWORK_MODES


@dataclass(frozen=True)
class BenchConfig:
    target: str
    draft: str
    prompts: tuple[Prompt, ...]
    modes: tuple[str, ...] = MODES
    methods: tuple[str, ...] = ("default",)
    gammas: tuple[str, ...] = ("auto",)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_new_tokens: int = 128
    repeats: int = 1
    seed: int = 0
    top_p: float | None = None
    repetition_penalty: float | None = None
    draft_dtype: str = "auto"
    draft_vocab: str = "auto"  # auto | full | auto,full (the draft model's vocabulary; see EngineConfig.draft_vocab)
    draft_temperature_factor: str = "auto"  # see EngineConfig.draft_temperature_factor
    dtype: str = "auto"  # the target's precision for specdec's rows
    tree_min_prob: float = defaults.TREE_MIN_PROB  # the probability floor of greedy / coupled trees
    batch_invariant: bool = True
    kv_dtype: str = defaults.KV_DTYPE  # the target's key/value cache (see EngineConfig.kv_dtype)
    threads: int | None = None
    command: str = ""
    extra: dict = field(default_factory=dict)
    # network modes
    rtts: tuple[float, ...] = network.DEFAULT_RTTS
    wires: tuple[str, ...] = network.DEFAULT_WIRES
    rtt_emulation: str = "auto"  # auto | proxy | netem
    q_top_k: int = 16
    # llama.cpp rows (mode "llamacpp")
    llamacpp: tuple[str, ...] = ("plain", "spec")
    llamacpp_draft_max: int = 16
    llamacpp_p_min: float = 0.75


def _llamacpp_host(cfg: BenchConfig) -> str | None:
    """The worker that runs the llama.cpp rows: the speculative one when both are requested
    (interleaved prompt by prompt), else a ``llamacpp`` process of its own."""
    if "llamacpp" not in cfg.modes or not cfg.llamacpp:
        return None
    return "speculative" if "speculative" in cfg.modes else "llamacpp"


def _job(cfg: BenchConfig, mode: str) -> dict:
    llama = {"llamacpp": list(cfg.llamacpp), "llamacpp_draft_max": cfg.llamacpp_draft_max,
             "llamacpp_p_min": cfg.llamacpp_p_min} if _llamacpp_host(cfg) == mode else {}
    return {
        "mode": mode, "target": cfg.target, "draft": cfg.draft,
        "prompts": [asdict(p) for p in cfg.prompts], "temperatures": list(cfg.temperatures),
        "methods": list(cfg.methods), "gammas": [str(g) for g in cfg.gammas],
        "max_new_tokens": cfg.max_new_tokens, "repeats": cfg.repeats, "seed": cfg.seed,
        "top_p": cfg.top_p, "repetition_penalty": cfg.repetition_penalty,
        "draft_dtype": cfg.draft_dtype, "draft_vocab": cfg.draft_vocab,
        "draft_temperature_factor": cfg.draft_temperature_factor, "dtype": cfg.dtype, "tree_min_prob": cfg.tree_min_prob, "batch_invariant": cfg.batch_invariant,
        "kv_dtype": cfg.kv_dtype, "threads": cfg.threads,
        **({"wires": list(cfg.wires), "q_top_k": cfg.q_top_k} if mode in network.NETWORK_MODES else {}),
        **llama,
    }


def _target_precision(target: str, dtype: str) -> str | None:
    """What the target's dtype resolves to on this machine (``auto`` = q4 | int8 | float32)."""
    from specdec.engine import EngineConfig, target_dtype
    from specdec.errors import SpecdecError

    try:
        torch_dtype, quant = target_dtype(EngineConfig(target=target, dtype=dtype))
    except SpecdecError:
        return None
    return quant or str(torch_dtype).removeprefix("torch.")


def _draft_precision(draft_dtype: str) -> str | None:
    """What the draft dtype resolves to here (None where it cannot run: the workers then say why)."""
    from specdec.engine import EngineConfig, draft_precision
    from specdec.errors import ConfigError

    try:
        return draft_precision(EngineConfig(draft_dtype=draft_dtype))
    except ConfigError:
        return None


def split_drafts(draft: str) -> list[str]:
    """The drafters of a ``--draft A,B,...`` value (one name is a list of one)."""
    return [d.strip() for d in draft.split(",") if d.strip()]


def split_vocabs(vocab: str) -> list[str]:
    """The draft vocabularies of a ``--draft-vocab auto,full`` value, or a ConfigError."""
    from specdec.errors import ConfigError

    out = [v.strip().lower() for v in vocab.split(",") if v.strip()]
    bad = [v for v in out if v not in ("auto", "full")]
    if not out or bad:
        raise ConfigError(f"--draft-vocab takes auto, full or both (auto,full), got {vocab!r}")
    if len(out) != len(set(out)):
        raise ConfigError(f"--draft-vocab lists a vocabulary twice: {vocab}")
    return out


def draft_arms(draft: str, vocab: str) -> list[tuple[str, str, str]]:
    """(label, drafter, vocabulary) for every drafter of ``--draft`` under every vocabulary of
    ``--draft-vocab``; the label names the vocabulary only where several are compared."""
    vocabs = split_vocabs(vocab)
    return [(d if len(vocabs) == 1 else f"{d} · {v} vocabulary", d, v) for d in split_drafts(draft) for v in vocabs]


def _count(cfg: BenchConfig, mode: str) -> int:
    """Samples a mode's worker emits (the speculative one adds one paired plain run per prompt, two
    where coupled verification runs at T > 0)."""
    if mode in network.NETWORK_MODES:
        return network.count(mode, len(cfg.prompts), cfg.repeats, list(cfg.rtts), list(cfg.temperatures),
                             list(cfg.wires), list(cfg.gammas))
    n = len(cfg.prompts) * cfg.repeats * len(cfg.temperatures)
    hosted = n * len(cfg.llamacpp) if _llamacpp_host(cfg) == mode else 0
    if mode == "llamacpp":
        return hosted
    if mode == "speculative":
        per_t = 0
        for t in cfg.temperatures:
            per_t += 1 + (t > 0 and "coupled" in cfg.methods) + len(draft_arms(cfg.draft, cfg.draft_vocab)) * sum(len(cfg.gammas) for m in cfg.methods if not (m == "greedy" and t > 0))
        return len(cfg.prompts) * cfg.repeats * per_t + hosted
    return n


def stop_process(proc: subprocess.Popen, timeout_s: float = 5.0) -> None:
    """End ``proc`` if it still runs: SIGTERM, then SIGKILL after ``timeout_s`` seconds."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _run_worker(job: dict, env: dict[str, str], prefix: list[str], name: str, on_sample, on_unit=None) -> dict:  # noqa: ANN001
    """One worker process: send ``job``, pass each sample to ``on_sample`` and each finished unit's
    key (``[temperature, repeat, prompt id]``, after its samples) to ``on_unit``; return its final
    ``done`` row."""
    # stderr goes to a file, not a pipe: a worker that wrote more than a pipe holds (64 KiB) would
    # block on it while this process waits for its stdout to end, and the bench would hang
    errfile = tempfile.TemporaryFile(mode="w+", errors="replace")  # a native crash may write any bytes
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "specdec.bench.worker"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errfile, text=True, env=env,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
    except BrokenPipeError:  # the worker died before reading its job: reported below
        pass
    done = None
    try:
        for line in proc.stdout:
            row = json.loads(line)
            if row.get("done"):
                done = row
            elif "unit" in row:
                if on_unit is not None:
                    on_unit(row["unit"])
            else:
                on_sample(row)
        rc = proc.wait()
        errfile.seek(0)
        err = errfile.read()
    finally:  # interrupted (Ctrl-C, SIGTERM) or failed here: the worker must not run on without us
        stop_process(proc)
        errfile.close()
    if rc != 0 or done is None:
        lines = err.strip().splitlines()
        if lines and lines[-1].startswith(ERROR_MARK):  # the worker's own one-line error
            raise SpecdecError(f"bench mode {name}: {lines[-1][len(ERROR_MARK):]}")
        tail = "\n".join(lines[-5:])
        if rc < 0:  # killed by a signal: a crash in native code prints no Python traceback
            import signal

            try:
                sig = signal.Signals(-rc).name
            except ValueError:
                sig = f"signal {-rc}"
            tail = (tail + "\n" if tail else "") + f"the worker process was killed by {sig} (a crash in native code"
            tail += ", e.g. llama.cpp's AMX kernel: see NOTES.md)" if "llamacpp" in json.dumps(job) else ")"
        raise SpecdecError(f"bench mode {name} failed:\n{tail}")
    return done


def config_dict(cfg: BenchConfig) -> dict:
    """``cfg`` as the run's results record it (prompts as objects)."""
    config = asdict(cfg)
    config["prompts"] = [asdict(p) for p in cfg.prompts]
    return config


def run(cfg: BenchConfig, *, progress: bool = True, journal: Journal | None = None) -> dict:
    """Run every mode; returns ``{"config": ..., "samples": [...], "processes": {...}}``
    (and ``"network"``: the RTT emulation, proxy byte totals, server peak RSS, when a network mode ran).

    With a ``journal`` (:mod:`specdec.bench.journal`) each worker's finished units are recorded as
    they end, and what the journal kept from an interrupted run is not run again: its rows come
    first in ``samples``, each worker (a local mode's, an edge-cloud group's at one RTT) leaves its
    finished units out, a worker that ended is skipped (and a cloud server whose workers all
    ended is not started); ``"resumed"`` counts the runs before this one."""
    from tqdm.auto import tqdm

    for mode in cfg.modes:
        if mode not in MODES:
            raise SpecdecError(f"unknown bench mode {mode!r}; choose from {', '.join(MODES)}")
    check_chat_files(list(cfg.prompts), cfg.target)  # a base model with chat prompts fails before any worker starts
    total = sum(_count(cfg, m) for m in cfg.modes)
    kept = journal.kept if journal is not None else Kept()
    samples: list[dict] = list(kept.samples)
    processes: dict[str, dict] = {m: p for m, p in kept.finished.items() if m in LOCAL_MODES}
    bar = tqdm(total=total, initial=len(samples), desc="bench", unit="gen", disable=not progress)

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    net_modes = [m for m in cfg.modes if m in network.NETWORK_MODES]
    record = None
    if net_modes:
        emulation = network.detect(cfg.rtt_emulation)
        record = network.NetworkRun(emulation.kind, emulation.detail, list(cfg.rtts))
    try:
        for mode in cfg.modes:
            if mode in network.NETWORK_MODES or (mode == "llamacpp" and _llamacpp_host(cfg) != "llamacpp"):
                continue
            if mode in processes:  # its worker ended in a run this one resumes
                continue
            bar.set_postfix_str(mode)
            processes[mode] = _run_journaled(_job(cfg, mode), env, [], mode, kept, journal, samples, bar)
        for group in network.groups(net_modes):
            bar.set_postfix_str("+".join(group))
            network.run_group(
                group, target=cfg.target, draft=cfg.draft, draft_dtype=cfg.draft_dtype, draft_vocab=cfg.draft_vocab,
                draft_temperature_factor=cfg.draft_temperature_factor, kv_dtype=cfg.kv_dtype, threads=cfg.threads or 1,
                rtts=list(cfg.rtts), emulation=emulation, job=_job(cfg, group[0]),
                run_worker=lambda job, wenv, prefix, name: _run_journaled(job, wenv, prefix, name, kept, journal, samples, bar),
                record=record, processes=processes, kept=kept, journal=journal,
            )
    finally:
        bar.close()
    config = config_dict(cfg)
    config["draft_precision"] = _draft_precision(cfg.draft_dtype)  # what the draft dtype resolved to here
    config["target_precision"] = _target_precision(cfg.target, cfg.dtype)  # ... and the target's
    result = {"config": config, "samples": samples, "processes": processes, "machine": machine_info()}
    if record is not None:
        result["network"] = record.to_dict()
    if kept.parts:
        result["resumed"] = kept.parts
    return result


def _run_journaled(job: dict, env: dict[str, str], prefix: list[str], name: str, kept: Kept, journal: Journal | None,
                   samples: list[dict], bar) -> dict:  # noqa: ANN001 - a tqdm bar
    """The worker ``name`` (a local mode, or an edge-cloud group at one RTT), less the units ``kept``
    has; each unit's rows reach ``samples`` (and the journal) when the worker says the unit is
    finished. Returns the worker's process record, earlier runs' share included."""
    started = last = time.perf_counter()
    rows: list[dict] = []

    def on_sample(row: dict) -> None:
        rows.append(row)
        bar.update(1)

    def on_unit(unit: list) -> None:
        nonlocal last
        now = time.perf_counter()
        if journal is not None:
            journal.unit(name, unit, now - last, rows)
        samples.extend(rows)
        rows.clear()
        last = now

    skip = sorted(kept.units.get(name, ()), key=json.dumps)
    done = _run_worker({**job, "skip": [list(u) for u in skip]}, env, prefix, name, on_sample, on_unit)
    samples.extend(rows)  # none: every row belongs to a unit
    process = {"rss_peak_bytes": done["rss_peak_bytes"], "seconds": time.perf_counter() - started + kept.seconds.get(name, 0.0)}
    if name in kept.units:  # its rows came from several workers, one per run
        process["rss_peak_bytes"] = max(process["rss_peak_bytes"], kept.rss_peak_bytes.get(name, 0))
        process["workers"] = 1 + kept.workers[name]
    if journal is not None:
        journal.finished(name, process)
    return process


def machine_info() -> dict:
    import platform

    import torch

    info = {
        "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        # "AVX512" / "AVX2" ...: the same model name covers CPUs whose kernels differ 2-3x in speed
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
    try:
        info["cpu_bf16"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        pass
    from specdec.models.linear import cpu_has, int8_kernel

    info["cpu_amx_int8"] = cpu_has("amx_int8")
    try:  # which kernel an int8 target runs on in this environment (SPECDEC_INT8_KERNEL included)
        info["int8_kernel"] = int8_kernel()
    except SpecdecError:
        pass
    from specdec.models import kernels

    if kernels.load():  # which path the 4-bit product runs: avx512-vnni, avx2 or portable (2-8x apart)
        info["q4_kernel"] = str(torch.ops.specdec.q4_isa())
        from specdec.models.linear import vnni_available

        # which build of the few-row int8 product runs W8A8 products (LM heads) beside fbgemm, if any
        info["q8_kernel"] = ("avx512-vnni" if kernels.q8_zero() == 128 else "avx2") if vnni_available() else "none"
    from specdec.models import hugepages

    # whether loading asks for 2 MiB pages for the weights (models.hugepages): a few per cent of decoding speed
    info["huge_pages"] = hugepages.available()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
