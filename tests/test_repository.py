"""The repository's own references hold: every benchmark folder is indexed in
``benchmarks/README.md``, every ``benchmarks/NAME`` the documents name exists (a renamed or
dropped result would otherwise leave a figure nobody can check), and every script that made one
still imports."""

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


def test_every_script_imports():
    """The scripts that made the committed benchmarks still import against the package (a renamed
    helper once broke one silently).  Run in a child process with ``scripts/`` on the path, as
    ``python scripts/NAME.py`` would have it; a third-party package missing here is not a failure."""
    import subprocess
    import sys

    code = r"""
import importlib, pathlib, sys, traceback
scripts = pathlib.Path(sys.argv[1])
sys.path.insert(0, str(scripts))
names = sorted(p.stem for p in scripts.glob("*.py"))
print("count", len(names))
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (e.name.split(".")[0] == "specdec" or (scripts / (e.name + ".py")).exists()):
            print("FAIL", name, repr(e))
    except Exception as e:
        print("FAIL", name, "".join(traceback.format_exception_only(e)).strip())
"""
    out = subprocess.run([sys.executable, "-c", code, str(ROOT / "scripts")], capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines and lines[0].startswith("count ") and int(lines[0].split()[1]) > 30
    assert [line for line in lines if line.startswith("FAIL")] == []
