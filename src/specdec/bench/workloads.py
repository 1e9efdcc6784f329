"""Benchmark workloads: a built-in set of code-completion and chat prompts, or any JSONL file.

The built-in prompts were written for specdec (function headers with docstrings in the style of
the Python standard library, and everyday instructions); none is copied from a dataset.  Code
prompts are plain completions; chat prompts go through the target's chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specdec.errors import ConfigError


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str  # "code" | "chat" | anything a JSONL file says
    text: str
    chat: bool


def check_chat(prompts: list[Prompt], tokenizer: object, target: str) -> None:
    """A clear error, before any prompt runs, where chat prompts meet a model with no chat template
    (a base model such as Gemma-3-270M): say how to run the rest, or the chat prompts as plain text."""
    if any(p.chat for p in prompts) and not getattr(tokenizer, "chat_template", None):
        raise _no_chat_template(target)


def check_chat_files(prompts: list[Prompt], target: str) -> None:
    """:func:`check_chat` before any model loads, read off the target's files
    (:func:`specdec.models.registry.chat_template_known`); a target whose files cannot tell (a hub
    id, a model not converted yet) is checked by :func:`check_chat` once its tokenizer loads."""
    from specdec.models.registry import chat_template_known

    if any(p.chat for p in prompts) and chat_template_known(target) is False:
        raise _no_chat_template(target)


def _no_chat_template(target: str) -> ConfigError:
    return ConfigError(
        f"{target} has no chat template, which the chat prompts need: keep the others with --categories code,"
        ' or pass --prompts FILE whose chat prompts say "chat": false (their text as a plain prompt)'
    )


_CODE = [
    ("merge_intervals", '''def merge_intervals(intervals):
    """Merge overlapping closed intervals.

    >>> merge_intervals([(1, 3), (2, 6), (8, 10)])
    [(1, 6), (8, 10)]
    """
'''),
    ("parse_query", '''from urllib.parse import unquote


def parse_query(query):
    """Parse a URL query string like 'a=1&b=two' into a dict of lists of strings."""
'''),
    ("lru_cache_class", '''class LRUCache:
    """A least-recently-used cache with a fixed capacity."""

    def __init__(self, capacity):
'''),
    ("count_words", '''import collections
import re


def count_words(path, top=10):
    """Return the `top` most common words in the text file at `path`, lower-cased."""
'''),
    ("flatten", '''def flatten(nested):
    """Yield the items of arbitrarily nested lists and tuples, depth first.

    >>> list(flatten([1, [2, (3, 4)], [[5]]]))
    [1, 2, 3, 4, 5]
    """
'''),
    ("read_csv_rows", '''import csv


def read_rows(path, *, skip_header=True):
    """Read a CSV file and return its rows as lists of strings."""
'''),
    ("binary_search", '''def binary_search(items, target):
    """Return the index of `target` in the sorted list `items`, or -1 if it is absent."""
'''),
    ("retry_decorator", '''import functools
import time


def retry(times=3, delay=0.5, exceptions=(Exception,)):
    """Decorator: call the function again, up to `times` attempts, when it raises."""
'''),
]

_CHAT = [
    ("explain_tcp", "Explain the difference between TCP and UDP to a new programmer."),
    ("story_lighthouse", "Write a short story about a lighthouse keeper who finds a message in a bottle."),
    ("email_meeting", "Write a polite email asking my team to move our weekly meeting to Thursday."),
    ("tips_sleep", "Give me five practical tips for sleeping better."),
    ("summarise_photosynthesis", "Summarise how photosynthesis works in a paragraph."),
    ("recipe_pancakes", "How do I make fluffy pancakes? List the steps."),
    ("compare_languages", "What are the main strengths of Python compared with C?"),
    ("plan_trip", "Plan a relaxed two-day trip to a small coastal town."),
]

BUILTIN: tuple[Prompt, ...] = tuple(
    [Prompt(f"code/{name}", "code", text, False) for name, text in _CODE]
    + [Prompt(f"chat/{name}", "chat", text, True) for name, text in _CHAT]
)


#: the fields a prompt file's line takes (see :func:`load_jsonl`)
PROMPT_FIELDS = ("prompt", "id", "category", "chat")


def load_jsonl(path: str | Path) -> list[Prompt]:
    """Prompts from a JSONL file: one object per line with ``prompt`` and optional ``id`` (unique;
    default "lineN"), ``category`` (default "custom") and ``chat`` (a JSON boolean, default false).
    Anything else is a one-line ConfigError naming the line: runs pair their rows by id, so a
    repeated id ran one prompt twice in the other's place, and a misspelt field was ignored."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prompt file {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not valid UTF-8 (byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"cannot read the prompt file {path}: {exc.strerror or exc}") from None
    prompts: list[Prompt] = []
    first: dict[str, int] = {}
    # lines end at "\n" alone: a JSON string may hold U+2028 or U+0085, where str.splitlines() cuts too
    for n, line in enumerate(text.removeprefix("\ufeff").split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise ConfigError(f"{path}:{n}: each line needs a non-empty string field 'prompt'")
        unknown = sorted(set(row) - set(PROMPT_FIELDS))
        if unknown:
            raise ConfigError(f"{path}:{n}: unknown field {unknown[0]!r} (a line takes {', '.join(PROMPT_FIELDS)})")
        if not isinstance(row.get("chat", False), bool):
            raise ConfigError(f"{path}:{n}: 'chat' must be true or false, got {json.dumps(row['chat'])}")
        for name in ("id", "category"):
            if name in row and (not isinstance(row[name], (str, int)) or isinstance(row[name], bool)):
                raise ConfigError(f"{path}:{n}: '{name}' must be a string, got {json.dumps(row[name])}")
        pid = str(row.get("id", f"line{n}"))
        if pid in first:
            raise ConfigError(f"{path}:{n}: id {pid!r} repeats line {first[pid]}'s (rows are paired by id)")
        first[pid] = n
        prompts.append(Prompt(pid, str(row.get("category", "custom")), row["prompt"], row.get("chat", False)))
    if not prompts:
        raise ConfigError(f"{path} holds no prompts")
    return prompts


def select(prompts: list[Prompt] | tuple[Prompt, ...], *, categories: list[str] | None = None, limit: int | None = None) -> list[Prompt]:
    """Filter by category; ``limit`` keeps the first ``limit`` prompts *of each category*."""
    chosen = [p for p in prompts if not categories or p.category in categories]
    if limit is not None:
        kept: dict[str, int] = {}
        out = []
        for p in chosen:
            if kept.get(p.category, 0) < limit:
                out.append(p)
                kept[p.category] = kept.get(p.category, 0) + 1
        chosen = out
    if not chosen:
        raise ConfigError("no prompts left after filtering")
    return chosen
