"""``specdec generate --prompts-file``: a JSON-lines file of prompts in, a JSON-lines file of results out.

Input: one JSON value per line (blank lines skipped) — a string (the prompt), or an object with
``"prompt"`` (a string; ``"system"`` optional, for ``--chat``; or ``"suffix"``: fill in the middle,
the prompt the code before a gap and the suffix the code after it, as ``generate --suffix``) or
``"messages"`` (a chat: a list of ``{"role", "content"}``, always through the chat template).  Where
any line has a suffix, the model's end-of-file tokens end every line's output.  Output: one object per prompt, in
input order, written as soon as it and every prompt before it are done, so an interrupted job keeps
what it finished; run the same command again with the same ``--out`` and it goes on from there.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

from specdec.errors import SpecdecError
from specdec.text import logprob_rows


@dataclass(frozen=True)
class PromptLine:
    """One prompt of the input: ``value`` as written there (echoed in the output), and how to encode it."""

    value: Any  # str | dict
    text: str | None
    messages: list[dict[str, str]] | None


def _bad(where: str, what: str) -> SpecdecError:
    return SpecdecError(f"{where}: {what}; each line must be a JSON string, or an object with \"prompt\" (a string) or "
                        "\"messages\" (a list of {\"role\", \"content\"} objects)")


#: the fields a prompts file's object line takes ("id" and "metadata" only travel to the results)
LINE_FIELDS = ("prompt", "system", "suffix", "messages", "id", "metadata")


def parse_prompt_lines(text: str, source: str) -> list[PromptLine]:
    """The prompts of a JSON-lines text; a line that is not one names its number."""
    out = []
    # lines end at "\n" alone: a JSON string may hold U+2028 or U+0085, where str.splitlines() cuts too
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{source} line {number}"
        try:
            value = json.loads(line)
        except ValueError as exc:
            raise _bad(where, f"not JSON ({exc.msg})") from None
        if isinstance(value, str):
            out.append(PromptLine(value, value, None))
            continue
        if not isinstance(value, dict) or ("prompt" in value) == ("messages" in value):
            raise _bad(where, "neither a string nor an object with exactly one of \"prompt\" and \"messages\"")
        unknown = sorted(set(value) - set(LINE_FIELDS))
        if unknown:  # a misspelt "sytem" was ignored, the prompt run without its system message
            raise _bad(where, f"unknown field {unknown[0]!r} (a line takes {', '.join(LINE_FIELDS)}; \"id\" and"
                              " \"metadata\" are echoed back untouched)")
        if "prompt" in value:
            if not isinstance(value["prompt"], str) or not isinstance(value.get("system", ""), str) \
                    or not isinstance(value.get("suffix", ""), str):
                raise _bad(where, "\"prompt\", \"system\" and \"suffix\" must be strings")
            if "suffix" in value and "system" in value:
                raise _bad(where, "a \"suffix\" fills a gap in plain text: it takes no \"system\"")
            out.append(PromptLine(value, value["prompt"], None))
            continue
        if "system" in value or "suffix" in value:  # a system message goes in the list; messages fill no gap
            raise _bad(where, "\"messages\" take no \"system\" or \"suffix\" (put a system message in the list)")
        msgs = value["messages"]
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
            raise _bad(where, "\"messages\" must be a non-empty list of {\"role\": str, \"content\": str}")
        out.append(PromptLine(value, None, [{"role": m["role"], "content": m["content"]} for m in msgs]))
    return out


def read_prompts(path: str) -> list[PromptLine]:
    """``path`` ('-': stdin) as prompts; a missing, unreadable or empty file is a one-line error."""
    if path == "-":
        raw = sys.stdin.buffer.read() if hasattr(sys.stdin, "buffer") else sys.stdin.read().encode()
        source = "stdin"
    else:
        try:
            raw = Path(path).read_bytes()
        except OSError as exc:
            raise SpecdecError(f"cannot read the prompts file {path}: {exc.strerror or exc}") from None
        source = path
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecdecError(f"{source} is not valid UTF-8 (byte {exc.start})") from None
    prompts = parse_prompt_lines(text, source)
    if not prompts:
        raise SpecdecError(f"{source} holds no prompts")
    return prompts


def fills(p: PromptLine) -> bool:
    """Whether the line fills in the middle (has a ``"suffix"``)."""
    return isinstance(p.value, dict) and "suffix" in p.value


def needs_chat(p: PromptLine, *, chat: bool) -> bool:
    """Whether the line goes through the chat template (as :func:`encode` encodes it)."""
    if p.messages is not None:
        return True
    return not fills(p) and (chat or (isinstance(p.value, dict) and "system" in p.value))


def encode(engine: Any, p: PromptLine, *, chat: bool, system: str | None) -> list[int]:
    if p.messages is not None:
        return engine.encode_messages(p.messages)
    if fills(p):
        from specdec import fim

        if chat:
            raise SpecdecError("a \"suffix\" fills a gap in plain text; drop --chat")
        return fim.prompt_ids(engine.target.tokenizer, p.text or "", p.value["suffix"])
    own = isinstance(p.value, dict) and "system" in p.value  # a line's own system message implies the template
    return engine.encode(p.text or "", chat=chat or own, system=p.value["system"] if own else system)


#: the ``generate`` options that shape a result: a rerun with another value of any of them does not
#: go on after results it would not have made (``--batch`` is not among them: batching never
#: changes an output)
SHAPING = ("target", "dtype", "backend", "fast_attention", "chat", "system", "method", "preset", "temperature",
           "top_k", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed",
           "max_new_tokens", "stop", "stop_token_id", "include_stop", "keep_special_tokens", "min_tokens",
           "json_object", "json_schema", "regex", "grammar", "choice", "allowed_token_id", "bad_word", "logprobs")


def settings_key(args: Any) -> str:
    """A short fingerprint of the options in :data:`SHAPING` (each result line carries it)."""
    import hashlib

    shaping = {name: getattr(args, name, None) for name in SHAPING}
    if getattr(args, "kv_dtype", "auto") != "auto":  # only where set: files written before the option keep their key
        shaping["kv_dtype"] = args.kv_dtype
    return hashlib.sha1(json.dumps(shaping, sort_keys=True, default=str).encode()).hexdigest()[:12]


def done_lines(path: Path, prompts: list[PromptLine], settings: str | None = None) -> tuple[int, int]:
    """(results already in ``path`` for the first prompts, the byte length of those lines): a
    rerun goes on after them; a last line cut short by an interruption is not counted.  Anything
    else in ``path`` — a file that is not a results file, results for other prompts or made with
    other ``settings`` — is an error: the rerun would overwrite it."""
    if not path.is_file():  # nothing yet, or a device or pipe (/dev/null, /dev/stdout): written, never read
        return 0, 0
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SpecdecError(f"cannot read {path}: {exc.strerror or exc}") from None
    n = size = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n") and line.startswith(b'{"index": '):
            break  # written in part when the job stopped
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if not isinstance(row, dict) or "index" not in row:
            raise SpecdecError(f"{path} is not a results file (line {n + 1}); choose another --out, or delete it"
                               " to start again")
        if row.get("index") != n or n >= len(prompts) or row.get("prompt") != prompts[n].value:
            raise SpecdecError(f"{path} holds results for other prompts (line {n + 1}); choose another --out, or delete it"
                               " to start again")
        if settings is not None and row.get("settings", settings) != settings:
            raise SpecdecError(f"{path} holds results made with other options (line {n + 1}: the model, sampling or"
                               " output options differ); rerun with the same options, choose another --out, or delete it")
        n += 1
        size += len(line)
    return n, size


class OrderedWriter:
    """Writes results in input order as they arrive in any order; flushes each line."""

    def __init__(self, stream: TextIO, prompts: list[PromptLine], start: int, row: Callable[[Any], dict]) -> None:
        self.stream, self.prompts, self.next, self.row = stream, prompts, start, row
        self.waiting: dict[int, Any] = {}

    def add(self, index: int, result: Any) -> None:
        self.waiting[index] = result
        while self.next in self.waiting:
            res = self.waiting.pop(self.next)
            payload = {"index": self.next, "prompt": self.prompts[self.next].value, **self.row(res)}
            try:
                self.stream.write(json.dumps(payload, ensure_ascii=False) + "\n")
                self.stream.flush()
            except OSError as exc:  # a full disk, a file that takes no writes: what was written stays
                raise SpecdecError(f"cannot write result {self.next}: {exc.strerror or exc}") from None
            self.next += 1


@dataclass(frozen=True)
class Job:
    """What ``--prompts-file`` will do, known before any model loads."""

    prompts: list[PromptLine]
    out: Path | None
    start: int  # results already in ``out``: generation goes on from this prompt
    size: int  # their bytes (``out`` is cut there: a half-written last line goes)
    settings: str | None = None  # :func:`settings_key` of the options, written in each result line


def plan(prompts_file: str, out: str | None, settings: str | None = None) -> Job:
    """Read the prompts and what ``out`` already holds; every problem with either is a one-line error."""
    prompts = read_prompts(prompts_file)
    out_path = Path(out) if out else None
    if out_path is not None and out_path.is_dir():
        raise SpecdecError(f"--out {out_path} is a folder; give a file")
    if out_path is not None and not out_path.parent.is_dir():  # found now, not after the model has loaded
        raise SpecdecError(f"--out {out_path}: the folder {out_path.parent} does not exist; create it first")
    start, size = done_lines(out_path, prompts, settings) if out_path is not None else (0, 0)
    return Job(prompts, out_path, start, size, settings)


def run(engine: Any, job: Job, args: Any, sampling: Any, log: Callable[[str], None], *,
        constraint: Callable[[], Any] | None = None) -> int:
    """Generate for every prompt of ``job`` not done yet (``specdec generate --prompts-file``)."""
    from tqdm.auto import tqdm

    prompts, out_path, start, size = job.prompts, job.out, job.start, job.size
    if start:
        log(f"{out_path} already holds the first {start} of {len(prompts)} results; going on from prompt {start}")
    todo = list(range(start, len(prompts)))
    context = engine.target.model.max_length
    ids = []
    for i in todo:  # every prompt encoded and checked before the first is decoded
        try:
            x = encode(engine, prompts[i], chat=args.chat, system=args.system)
        except SpecdecError as exc:
            raise SpecdecError(f"prompt {i} (counting from 0): {exc}") from None
        if not x:
            raise SpecdecError(f"prompt {i} (counting from 0): the prompt is empty")
        if len(x) >= context:
            raise SpecdecError(f"prompt {i} (counting from 0) has {len(x)} tokens but the model's context is {context}")
        ids.append(x)
    tok = engine.target.tokenizer
    if any(fills(prompts[i]) for i in todo):  # the model closing the file ends a filled middle
        from dataclasses import replace

        from specdec import fim

        sampling = replace(sampling, stop_token_ids=fim.stop_ids(tok, fim.require_style(tok), sampling.stop_token_ids))

    def row(res: Any) -> dict:
        r = {"text": res.text, "token_ids": res.token_ids, "finish_reason": res.finish_reason,
             "prompt_tokens": res.prompt_tokens, "generated_tokens": len(res.token_ids),
             "seed": None if sampling.greedy else res.seed, "method": res.method}  # greedy draws nothing
        if job.settings is not None:
            r["settings"] = job.settings
        if res.logprobs is not None:
            r["logprobs"] = logprob_rows(tok, res.token_ids, res.logprobs)
        return r

    if out_path is not None:
        try:
            if out_path.is_file():  # cut after the results it holds (a half-written last line goes)
                stream = open(out_path, "r+", encoding="utf-8")
                stream.truncate(size)
                stream.seek(size, os.SEEK_SET)
            else:
                stream = open(out_path, "w", encoding="utf-8")
        except OSError as exc:
            raise SpecdecError(f"cannot write {out_path}: {exc.strerror or exc}") from None
    else:
        stream = sys.stdout
    writer = OrderedWriter(stream, prompts, start, row)
    sampling_for = sampling
    if sampling.seed is not None and start:  # prompt i keeps seed + i on a rerun
        from dataclasses import replace

        from specdec.sampling import offset_seed

        sampling_for = replace(sampling, seed=offset_seed(sampling.seed, start))
    bar = tqdm(total=len(prompts), initial=start, unit="prompt", desc="generating", file=sys.stderr, disable=None)
    tokens = 0

    def on_result(res: Any) -> None:
        nonlocal tokens
        tokens += len(res.token_ids)
        writer.add(todo[res.index], res)
        bar.update(1)

    t0 = time.perf_counter()
    try:
        engine.generate_batch(ids, sampling_for, batch=args.batch, method=args.method, logprobs=args.logprobs,
                              constraint=constraint, on_result=on_result)
    finally:
        bar.close()
        if stream is not sys.stdout:
            try:
                stream.close()
            except OSError:
                pass  # each line was flushed as it was written: a failed write has already been reported
    wall = time.perf_counter() - t0
    log(f"{len(todo)} prompts, {tokens} tokens in {wall:.2f} s = {tokens / wall if wall > 0 else 0.0:.1f} tok/s "
        f"(continuous batching of up to {args.batch} sequences, plain decoding)"
        + (f"; results in {out_path}" if out_path is not None else ""))
    return 0


__all__ = ["Job", "PromptLine", "SHAPING", "done_lines", "parse_prompt_lines", "plan", "read_prompts", "run", "settings_key"]
