"""The network side of ``specdec bench``: a cloud server process and an emulated RTT to it.

Modes (see docs/edge-cloud.md):

* ``edge_cloud``           — ``specdec serve`` holds the target; a separate edge process drafts
  with the draft model and verifies over HTTP, for every RTT × wire mode valid at each temperature;
* ``cloud_streaming``      — the cloud-only baseline: the edge streams a completion from the same
  server's OpenAI-compatible endpoint, which decodes plainly (``--draft none``);
* ``cloud_streaming_spec`` — the same with speculative decoding on the server (``--draft`` there).

``edge_cloud`` and ``cloud_streaming`` share one server (``--draft none``: the verify API needs no
drafter) and one edge process per RTT, which runs them interleaved prompt by prompt, so every
speed-up compares runs seconds apart (this shared machine drifts by 10-20 % over minutes).
``cloud_streaming_spec`` needs a server with a drafter: its own server and edge processes.

The RTT is emulated by ``tc netem`` in two network namespaces where the kernel has it
(``scripts/netem.sh``), otherwise by :mod:`specdec.remote.delay_proxy` between the edge and the
server (RTT/2 each way); which one ran is recorded in the results.  The server and each edge
process use ``--threads`` torch threads (default 1 each), as two one-core machines would.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from specdec.bench.journal import Journal, Kept
from specdec.errors import SpecdecError

NETWORK_MODES = ("edge_cloud", "cloud_streaming", "cloud_streaming_spec")
DEFAULT_RTTS = (0.0, 20.0, 50.0, 100.0)
DEFAULT_WIRES = ("greedy", "coupled", "sparse-q", "lossy-scalar")
EMULATIONS = ("auto", "proxy", "netem")

#: the namespaces and addresses scripts/netem.sh sets up
NETEM_CLOUD_NS, NETEM_EDGE_NS, NETEM_CLOUD_IP = "specdec-cloud", "specdec-edge", "10.201.0.1"


def wire_valid(wire: str, temperature: float) -> bool:
    """Greedy runs at T = 0 only; coupled, sparse-q and lossy-scalar at T > 0 only."""
    return (wire == "greedy") == (temperature == 0.0)


def network_settings(mode: str, temperatures: list[float], wires: list[str], gammas: list[str]):
    """(temperature, wire, γ) triples a network mode runs at one RTT, in a fixed order.

    ``wire`` is None for the streaming modes; γ is None for plain streaming.
    """
    for t in temperatures:
        if mode == "edge_cloud":
            for w in wires:
                if wire_valid(w, t):
                    for g in gammas:
                        yield t, w, g
        elif mode == "cloud_streaming_spec":
            for g in gammas:
                yield t, None, g
        else:
            yield t, None, None


def count(mode: str, n_prompts: int, repeats: int, rtts: list[float], temperatures: list[float],
          wires: list[str], gammas: list[str]) -> int:
    """Generations a network mode records (for the progress bar)."""
    per_rtt = sum(1 for _ in network_settings(mode, temperatures, wires, gammas))
    return n_prompts * repeats * per_rtt * len(rtts)


# ----------------------------------------------------------------------------- emulation


@dataclass(frozen=True)
class Emulation:
    kind: str  # "netem" | "proxy"
    detail: str  # why (the netem check's answer)
    script: str | None = None


def netem_script() -> Path | None:
    """``scripts/netem.sh`` of a source checkout (None for an installed package)."""
    path = Path(__file__).resolve().parents[3] / "scripts" / "netem.sh"
    return path if path.is_file() else None


def detect(choice: str = "auto", script: Path | None = None) -> Emulation:
    """Which RTT emulation to use: ``netem`` where ``netem.sh check`` passes, else the delay proxy."""
    if choice not in EMULATIONS:
        raise SpecdecError(f"unknown RTT emulation {choice!r}; choose from {', '.join(EMULATIONS)}")
    if choice == "proxy":
        return Emulation("proxy", "asked for (--rtt-emulation proxy)")
    script = script or netem_script()
    if script is None:
        detail = "scripts/netem.sh not found (not a source checkout)"
    else:
        try:
            proc = subprocess.run(["bash", str(script), "check"], capture_output=True, text=True, timeout=60)
            answer = (proc.stdout.strip() or proc.stderr.strip()).splitlines()
            detail = answer[-1] if answer else f"netem.sh check exited with {proc.returncode}"
            if proc.returncode == 0:
                return Emulation("netem", detail, str(script))
        except (OSError, subprocess.TimeoutExpired) as exc:
            detail = f"netem.sh check failed ({exc})"
    if choice == "netem":
        raise SpecdecError(f"--rtt-emulation netem: {detail}")
    return Emulation("proxy", detail)


# ----------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def thread_env(threads: int) -> dict[str, str]:
    """Environment of a child process limited to ``threads`` compute threads."""
    n = str(threads)
    return dict(os.environ, OMP_NUM_THREADS=n, MKL_NUM_THREADS=n, TOKENIZERS_PARALLELISM="false")


def peak_rss(pid: int) -> int | None:
    """A live process's peak resident set (VmHWM), in bytes."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class CloudServer:
    """``specdec serve`` in its own process (inside the cloud namespace under netem)."""

    def __init__(self, target: str, draft: str, *, threads: int, emulation: Emulation, draft_dtype: str = "auto",
                 draft_vocab: str = "auto", draft_temperature_factor: str = "auto", kv_dtype: str = "auto") -> None:
        self.api_key = secrets.token_urlsafe(24)
        self.port = free_port()
        self.emulation = emulation
        self.host = NETEM_CLOUD_IP if emulation.kind == "netem" else "127.0.0.1"
        prefix = ["ip", "netns", "exec", NETEM_CLOUD_NS] if emulation.kind == "netem" else []
        self.argv = [*prefix, sys.executable, "-m", "specdec.cli", "serve", "--host", self.host, "--port", str(self.port),
                     "--target", target, "--draft", draft, "--draft-dtype", draft_dtype, "--draft-vocab", draft_vocab,
                     "--draft-temperature-factor", draft_temperature_factor, "--kv-dtype", kv_dtype, "--max-sessions", "256"]
        self.env = dict(thread_env(threads), SPECDEC_API_KEY=self.api_key)  # the key stays off the command line
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile(mode="w+")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "CloudServer":
        self.proc = subprocess.Popen(self.argv, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log)
        return self

    def failure(self) -> str | None:
        """The server's last log lines if it has exited, else None."""
        if self.proc is None or self.proc.poll() is None:
            return None
        self._log.seek(0)
        tail = "\n".join(self._log.read().strip().splitlines()[-5:])
        return f"the cloud server exited with {self.proc.returncode}: {tail}"

    def stop(self) -> dict[str, Any]:
        info = {"rss_peak_bytes": peak_rss(self.proc.pid) if self.proc else None}
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return info


class Link:
    """The emulated path from the edge to the server at one RTT."""

    def __init__(self, server: CloudServer, rtt_ms: float) -> None:
        self.server = server
        self.rtt_ms = rtt_ms
        self.proc: subprocess.Popen | None = None
        self._errfile: Any = None  # the proxy's stderr, a temporary file while it runs
        self.url = server.url

    @property
    def edge_prefix(self) -> list[str]:
        """What the edge process runs under (the edge namespace under netem)."""
        return ["ip", "netns", "exec", NETEM_EDGE_NS] if self.server.emulation.kind == "netem" else []

    def start(self) -> "Link":
        em = self.server.emulation
        if em.kind == "netem":
            subprocess.run(["bash", str(em.script), "set", f"{self.rtt_ms:g}"], check=True, capture_output=True, text=True)
            return self
        self._errfile = tempfile.TemporaryFile(mode="w+", errors="replace")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specdec.remote.delay_proxy", "--listen", "0", "--to", f"127.0.0.1:{self.server.port}",
             "--rtt-ms", f"{self.rtt_ms:g}"],
            # stderr to a file: nothing reads a pipe while the proxy runs, and a full one would block it
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self._errfile, text=True, env=thread_env(1),
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        try:
            self.url = f"http://127.0.0.1:{json.loads(line)['listening']}"
        except (ValueError, KeyError):
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # a proxy that said something else and runs on
                self.proc.kill()
                self.proc.wait()
            self._errfile.seek(0)
            raise SpecdecError(f"the delay proxy did not start: {line.strip() or self._errfile.read().strip()}") from None
        return self

    def stop(self) -> dict[str, Any]:
        """Stop the proxy; its totals (bytes each way, connections), or {} under netem."""
        if self.proc is None:
            return {}
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate(timeout=10)
        if self._errfile is not None:
            self._errfile.close()
        for line in reversed(out.strip().splitlines()):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("stopped"):
                return {k: v for k, v in row.items() if k != "stopped"}
        return {}


@dataclass
class NetworkRun:
    """What the network modes add to the results (``result["network"]``)."""

    rtt_emulation: str
    detail: str
    rtts_ms: list[float]
    proxy_totals: dict[str, dict] = field(default_factory=dict)  # "<mode>@<rtt>" -> bytes each way, connections
    servers: dict[str, dict] = field(default_factory=dict)  # mode -> {draft, rss_peak_bytes}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def server_draft(modes: list[str], draft: str) -> str:
    """The server's drafter: none for edge_cloud (the verify API needs none) and plain streaming."""
    return draft if "cloud_streaming_spec" in modes else "none"


def groups(modes: list[str]) -> list[list[str]]:
    """Network modes that share a server and an edge process, in run order."""
    shared = [m for m in ("cloud_streaming", "edge_cloud") if m in modes]
    return [g for g in (shared, [m for m in modes if m == "cloud_streaming_spec"]) if g]


def add_totals(parts: list[dict]) -> dict[str, int]:
    """One proxy's totals over the runs of a resumed bench (bytes and connections add up)."""
    out: dict[str, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0) + v
    return out


def server_process(parts: list[dict]) -> dict[str, Any]:
    """A group's cloud server over the runs it ran in: the highest peak, the seconds added up."""
    peaks = [p["rss_peak_bytes"] for p in parts if p.get("rss_peak_bytes")]
    out: dict[str, Any] = {"rss_peak_bytes": max(peaks) if peaks else None, "seconds": sum(p["seconds"] for p in parts)}
    if len(parts) > 1:
        out["workers"] = len(parts)
    return out


def run_group(
    modes: list[str],
    *,
    target: str,
    draft: str,
    draft_dtype: str,
    draft_vocab: str = "auto",
    draft_temperature_factor: str = "auto",
    kv_dtype: str = "auto",
    threads: int,
    rtts: list[float],
    emulation: Emulation,
    job: dict[str, Any],
    run_worker: Callable[[dict[str, Any], dict[str, str], list[str], str], dict],
    record: NetworkRun,
    processes: dict[str, dict],
    kept: Kept | None = None,
    journal: Journal | None = None,
) -> None:
    """One server for ``modes``; per RTT a link and one edge worker, ``run_worker(job, env, prefix,
    name)``, which returns the worker's process record.

    Resuming (``kept``, :class:`specdec.bench.journal.Kept`): an RTT whose worker ended is not run
    again, and a server none of whose RTTs is left is not started. Each server and proxy writes its
    totals to ``journal`` whenever it stops, interrupted or not, and the record adds up every run's."""
    from specdec.engine import factor_for

    mode = "+".join(modes)
    served = server_draft(modes, draft)
    server_name = f"{mode}:server"
    kept_totals: dict[str, list[dict]] = kept.totals if kept is not None else {}
    finished: dict[str, dict] = kept.finished if kept is not None else {}

    def stopped(name: str, totals: dict) -> None:
        if journal is not None and totals:
            journal.totals(name, totals)

    def proxy(name: str, totals: dict | None = None) -> None:
        summed = add_totals([*kept_totals.get(name, []), *([totals] if totals else [])])
        if summed:
            record.proxy_totals[name] = summed

    left = []
    for rtt in rtts:
        name = f"{mode}@{rtt:g}ms"
        if name in finished:  # its worker ended in a run this one resumes
            processes[name] = finished[name]
            proxy(name)
        else:
            left.append((rtt, name))
    servers = list(kept_totals.get(server_name, []))
    if left:
        server = CloudServer(target, served, threads=threads, emulation=emulation, draft_dtype=draft_dtype,
                             draft_vocab=draft_vocab, draft_temperature_factor=factor_for(served, draft_temperature_factor),
                             kv_dtype=kv_dtype)
        if emulation.kind == "netem":
            subprocess.run(["bash", str(emulation.script), "up", "0"], check=True, capture_output=True, text=True)
        server_started = time.perf_counter()
        try:
            server.start()
            for rtt, name in left:
                link = Link(server, rtt).start()
                totals: dict = {}
                try:
                    edge_job = dict(job, mode=mode, net_modes=modes, url=link.url, api_key=server.api_key, rtt_ms=rtt,
                                    emulation=emulation.kind)
                    try:
                        processes[name] = run_worker(edge_job, thread_env(threads), link.edge_prefix, name)
                    except SpecdecError as exc:
                        raise SpecdecError(server.failure() or str(exc)) from None
                finally:
                    totals = link.stop()
                    stopped(name, totals)
                proxy(name, totals)
        finally:
            info = {**server.stop(), "seconds": time.perf_counter() - server_started}
            if emulation.kind == "netem":
                subprocess.run(["bash", str(emulation.script), "down"], capture_output=True, text=True)
            stopped(server_name, info)
        servers.append(info)
    processes[server_name] = server_process(servers)
    record.servers[mode] = {"draft": served, "rss_peak_bytes": processes[server_name]["rss_peak_bytes"]}
