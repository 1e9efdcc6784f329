"""The repository's own references hold: every benchmark folder is indexed in
``benchmarks/README.md`` and every ``benchmarks/NAME`` the documents name exists (a renamed or
dropped result would otherwise leave a figure nobody can check)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def _indexed() -> set[str]:
    """Folder names in the first column of the index's table (a cell may name several)."""
    names: set[str] = set()
    for line in (BENCH / "README.md").read_text().splitlines():
        cells = line.split("|")
        if line.startswith("| `") and len(cells) > 2:
            names |= set(re.findall(r"`([^`]+)`", cells[1]))
    return names


def test_every_benchmark_folder_is_indexed_and_every_index_entry_exists():
    folders = {p.name for p in BENCH.iterdir() if p.is_dir()}
    indexed = _indexed()
    assert len(folders) > 100  # the folder this test reads is the repository's own
    assert sorted(folders - indexed) == [], "benchmark folders missing from benchmarks/README.md"
    assert sorted(indexed - folders) == [], "benchmarks/README.md names folders that do not exist"


def test_every_benchmark_the_documents_name_exists():
    missing = []
    for doc in (ROOT / "README.md", ROOT / "NOTES.md", BENCH / "README.md"):
        for m in re.finditer(r"`?benchmarks/([A-Za-z0-9_.\-]+)((?:/[A-Za-z0-9_.\-]+)*)", doc.read_text()):
            if m.group(1) in ("NAME", "<folder>") or m.group(1).endswith("-"):
                continue  # a placeholder or a family of folders ("run-...")
            path = (m.group(1) + m.group(2)).rstrip(".,;:")
            if not (BENCH / path).exists():
                missing.append(f"{doc.name}: benchmarks/{path}")
    assert missing == []
