"""What a ``specdec bench`` run has finished so far, kept in ``OUT/partial.jsonl`` while it runs,
so that a run stopped by Ctrl-C, SIGTERM or a failing worker goes on with ``--resume``.

One JSON object per line: first ``{"journal": 1, "config": ...}`` (the run's settings, which a
resumed run must repeat), then one line per finished *unit* of a worker: a (temperature, repeat,
prompt) with every row the worker made for it (``{"mode", "unit", "seconds", "samples"}``: each of
a prompt's rows comes from one process, so the paired ratios stay paired), and ``{"mode",
"finished": {...}}`` when a worker ends. A worker is a local mode's, or an edge-cloud group's at
one RTT (``mode`` is then ``"<group>@<rtt>ms"``). A resumed run keeps those rows and gives each
worker the units to leave out. The edge-cloud runs' other processes, the cloud server and the delay
proxy, write ``{"mode", "totals": {...}}`` whenever they stop, finished or not (peak memory and
seconds; bytes forwarded): a resumed run adds up every part's. A line cut short by the
interruption is dropped (its unit runs again). A finished run removes the file once results.json is
written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from specdec.errors import ConfigError

NAME = "partial.jsonl"
FORMAT = 1


@dataclass
class Kept:
    """What earlier parts of a run left: rows in the order they came, each worker's finished units
    ((temperature, repeat, prompt id)), the workers that ended ({mode: process info}), and the
    totals each server or proxy reported when it stopped."""

    samples: list[dict] = field(default_factory=list)
    units: dict[str, set[tuple]] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)  # worker time that made the units kept, per mode
    rss_peak_bytes: dict[str, int] = field(default_factory=dict)  # the highest its rows saw, per mode
    workers: dict[str, int] = field(default_factory=dict)  # the runs whose worker made units kept, per mode
    finished: dict[str, dict] = field(default_factory=dict)
    totals: dict[str, list[dict]] = field(default_factory=dict)  # a server's or proxy's totals, one per run it ran in
    parts: int = 0  # how many runs wrote this journal before this one
    size: int = 0  # the journal's bytes up to its last whole line


def config_key(config: dict) -> dict:
    """The settings a resumed run must repeat: everything but the command line (``--resume`` itself
    is in it), JSON-normalised (tuples as lists)."""
    return json.loads(json.dumps({k: v for k, v in config.items() if k != "command"}))


class Journal:
    """Append-only record of one bench run's finished units (see the module)."""

    def __init__(self, path: Path, handle: IO[bytes], kept: Kept, made: list[Path] | None = None) -> None:
        self.path = path
        self._handle = handle
        self.kept = kept
        self.units_lengths: list[int] = []  # the rows of each unit this run wrote
        self._made = made or []  # the folders opening it made, innermost first

    @classmethod
    def open(cls, out: Path, config: dict, *, resume: bool, machine: dict | None = None) -> Journal:
        """Start ``out``'s journal, or with ``resume`` read the one an interrupted run left there.
        ``machine``: what the run reports of the machine (``runner.machine_info``).

        Refused (ConfigError, nothing touched): ``resume`` with no journal in ``out``, a journal
        whose run had other settings or ran on another machine or software (rows of the two would
        not compare), a damaged one, or a journal there without ``resume`` (its rows would be lost)."""
        path = out / NAME
        key = config_key(config)
        where = machine_key(machine or {})
        if not resume:
            if path.exists():
                raise ConfigError(f"--out {out} holds an interrupted run ({path}): pass --resume to go on from it, "
                                  f"or remove {path} to start over")
            made = [f for f in (out, *out.parents) if not f.exists()]
            out.mkdir(parents=True, exist_ok=True)
            journal = cls(path, path.open("wb"), Kept(), made)
            journal._write({"journal": FORMAT, "config": key, "machine": where})
            return journal
        if not path.is_file():
            raise ConfigError(f"--resume: {out} holds no interrupted run (no {NAME}; a finished run removes it)")
        kept = read(path, key, where)
        handle = path.open("r+b")
        handle.truncate(kept.size)  # a line cut short goes: its unit runs again
        handle.seek(kept.size)
        journal = cls(path, handle, kept)
        journal._write({"resumed": kept.parts})
        return journal

    def unit(self, mode: str, unit: list, seconds: float, samples: list[dict]) -> None:
        """A unit of ``mode`` finished with its rows; it took ``seconds`` (from its worker's start,
        or the unit before it, to its end)."""
        self._write({"mode": mode, "unit": unit, "seconds": seconds, "samples": samples})
        self.units_lengths.append(len(samples))

    def finished(self, mode: str, process: dict) -> None:
        self._write({"mode": mode, "finished": process})

    def totals(self, name: str, totals: dict) -> None:
        """A cloud server or delay proxy of this run stopped (finished or interrupted) with ``totals``."""
        self._write({"mode": name, "totals": totals})

    def _write(self, line: dict) -> None:
        self._handle.write(json.dumps(line).encode() + b"\n")  # one line per write: a cut can only end the file
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()

    @property
    def kept_count(self) -> int:
        """Generations a resumed run would keep: those of earlier runs and this one's finished units."""
        return len(self.kept.samples) + sum(self.units_lengths)

    def remove(self) -> None:
        """The run finished and its results.json is written: the journal has served."""
        self.close()
        self.path.unlink(missing_ok=True)

    def stop(self) -> int:
        """The run stops short: keep the journal where it holds a finished unit, else remove it and
        the folders opening it made (a run stopped before its first unit leaves nothing behind).
        Returns the generations kept."""
        self.close()
        if not self.kept_count:
            self.path.unlink(missing_ok=True)
            for folder in self._made:
                try:
                    folder.rmdir()
                except OSError:  # not empty: something else is in it now
                    break
        return self.kept_count


def machine_key(machine: dict) -> dict:
    """What a resumed run's machine must repeat: all it reports but the OS release (a reboot)."""
    return json.loads(json.dumps({k: v for k, v in machine.items() if k != "platform"}))


def read(path: Path, key: dict, machine: dict | None = None) -> Kept:
    """The journal at ``path``, checked against the settings ``key`` and the ``machine``
    (:func:`machine_key`) of the run that resumes it."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"--resume: cannot read {path}: {exc.strerror or exc}") from None
    whole = data[:data.rfind(b"\n") + 1]  # after the last newline: the line being written when the run stopped
    entries = []
    for n, text in enumerate(whole.splitlines(), 1):
        try:
            entry = json.loads(text)
            if not isinstance(entry, dict):
                raise ValueError("not an object")
        except ValueError:  # UnicodeDecodeError too
            raise ConfigError(f"--resume: {path} is damaged at line {n}; remove it to start over") from None
        entries.append(entry)
    if not entries or entries[0].get("journal") != FORMAT or not isinstance(entries[0].get("config"), dict):
        raise ConfigError(f"--resume: {path} is not a specdec bench journal; remove it to start over")
    before = entries[0]["config"]
    if before != key:
        differ = sorted(k for k in before.keys() | key.keys() if before.get(k) != key.get(k))
        raise ConfigError(f"--resume: the interrupted run in {path.parent} had other settings ({', '.join(differ)});"
                          " repeat its command with --resume, or remove " f"{path} to start over")
    there = entries[0].get("machine") or {}
    if machine is not None and there != machine:
        differ = sorted(k for k in there.keys() | machine.keys() if there.get(k) != machine.get(k))
        raise ConfigError(f"--resume: the interrupted run in {path.parent} ran on another machine or software "
                          f"({', '.join(f'{k}: {there.get(k)} there, {machine.get(k)} here' for k in differ)}); "
                          f"its rows and this run's would not compare: remove {path} to start over")
    kept = Kept(parts=1)
    parts: dict[str, set[int]] = {}
    for entry in entries[1:]:
        if "resumed" in entry:
            kept.parts += 1
        elif "unit" in entry:
            mode = entry["mode"]
            kept.samples.extend(entry["samples"])
            kept.units.setdefault(mode, set()).add(tuple(entry["unit"]))
            kept.seconds[mode] = kept.seconds.get(mode, 0.0) + entry["seconds"]
            kept.rss_peak_bytes[mode] = max([kept.rss_peak_bytes.get(mode, 0),
                                             *(r.get("rss_peak_bytes") or 0 for r in entry["samples"])])
            parts.setdefault(mode, set()).add(kept.parts)
        elif "finished" in entry:
            kept.finished[entry["mode"]] = entry["finished"]
        elif "totals" in entry:
            kept.totals.setdefault(entry["mode"], []).append(entry["totals"])
    kept.workers = {mode: len(p) for mode, p in parts.items()}
    kept.size = len(whole)
    return kept


__all__ = ["Journal", "Kept", "NAME", "config_key", "machine_key", "read"]
