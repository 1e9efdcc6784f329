#!/usr/bin/env python
"""Multi-turn chats through a server's OpenAI chat endpoint: a server at another commit against this checkout's.

    python scripts/server_chat_ab.py --base REV --turns 8 --repeats 3 --users 1 --out benchmarks/NAME

Not a test and not part of CI.  Two ``specdec serve`` processes on the default models and settings,
one from this checkout and one from ``--base`` (its ``src`` exported with ``git archive`` and put
first on ``PYTHONPATH``), both up at once.  ``--users`` clients at a time each play a conversation
of ``--turns`` user messages the way a chat client does: every turn streams
``/v1/chat/completions`` with the whole conversation so far (greedy replies of at most
``--max-new-tokens``) and appends the reply.  Conversations go to one server, then the other, the
order alternating per repeat; each repeat's conversations differ from the last (a new system
message), so nothing is reused across repeats.  Per turn: prompt tokens, cached tokens (where the
server reports ``usage.prompt_tokens_details``), time to first token (first content chunk) and wall
time.  Replies must be identical on both servers.  Writes ``README.md`` and ``results.json``.

``--edge`` plays each turn as ``specdec generate --remote`` does instead: the default draft model
drafts in this process and the server verifies in an edge session, deleted when the reply is done
(time to first token = to the first committed tokens; the session's prompt prefill on the server too).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import paired
from chat_prefix_ab import MESSAGES
from openai_choices_ab import _serve
from startup_ab import _export

ROOT = Path(__file__).resolve().parent.parent


def _turn(client: httpx.Client, url: str, messages: list[dict[str, str]], tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, text, usage = None, [], {}
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or ():
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(piece)
    wall = time.perf_counter() - t0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": cached, "completion_tokens": usage.get("completion_tokens"),
            "ttft_s": ttft if ttft is not None else wall, "wall_s": wall, "text": "".join(text)}


class _Edge:
    """``--edge``: a turn is ``specdec generate --remote``'s work in this process — the default draft
    model (prompt lookup first) drafts here, the server verifies in an edge session, which the edge
    deletes when the reply is done.  The same edge code for both servers."""

    def __init__(self) -> None:
        from specdec.engine import EngineConfig, load_draft

        self.cfg = EngineConfig()
        self.draft = load_draft(self.cfg)

    def turn(self, client: httpx.Client, url: str, messages: list[dict[str, str]], tokens: int) -> dict:
        from specdec.engine import model_drafter
        from specdec.remote.client import RemoteConfig
        from specdec.remote.edge import generate_remote
        from specdec.sampling import SamplingConfig
        from specdec.text import encode_messages

        ids = encode_messages(self.draft.tokenizer, messages)
        drafter, name = model_drafter(self.cfg, self.draft, lookup=True)
        first: list[float] = []
        t0 = time.perf_counter()
        out = generate_remote(ids, SamplingConfig(temperature=0.0, max_new_tokens=tokens), RemoteConfig(url=url),
                              drafter=drafter, drafter_name=name, tokenizer=self.draft.tokenizer, eos_ids=self.draft.eos_ids,
                              on_tokens=lambda new: first or first.append(time.perf_counter() - t0), client=client)
        wall = time.perf_counter() - t0
        return {"prompt_tokens": len(ids), "cached_tokens": out.remote.get("session_cached_tokens"),
                "completion_tokens": len(out.token_ids), "ttft_s": first[0] if first else wall, "wall_s": wall,
                "prefill_ms": out.remote.get("session_prefill_ms"), "text": out.text}


EDGE: _Edge | None = None  # set by --edge


def _conversation(url: str, user: int, rep: int, turns: int, tokens: int) -> list[dict]:
    history = [{"role": "system", "content": f"You are a helpful assistant (conversation {rep}.{user})."}]
    rows = []
    with httpx.Client(timeout=600) as client:  # one connection per conversation, as a chat client keeps
        for turn in range(turns):
            history.append({"role": "user", "content": MESSAGES[(turn + user) % len(MESSAGES)]})
            row = (EDGE.turn if EDGE is not None else _turn)(client, url, history, tokens)
            history.append({"role": "assistant", "content": row["text"]})
            rows.append({"turn": turn + 1, "user": user, **row})
    return rows


def _play(url: str, users: int, rep: int, turns: int, tokens: int) -> list[dict]:
    out: list[list[dict]] = [[] for _ in range(users)]
    threads = [threading.Thread(target=lambda u=u: out[u].extend(_conversation(url, u, rep, turns, tokens))) for u in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(len(rows) != turns for rows in out):
        raise RuntimeError("a conversation failed")
    return [r for rows in out for r in rows]


def main() -> int:
    ap = paired.parser(__doc__)
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--users", type=int, default=1, help="conversations played at once on a server")
    ap.add_argument("--edge", action="store_true",
                    help="each turn drafts here and verifies in an edge session (/v1/sessions), as `generate --remote`")
    ap.set_defaults(max_new_tokens=64)
    args = ap.parse_args()
    global EDGE
    if args.edge:
        if args.users != 1:
            ap.error("--edge plays one conversation at a time (the edge's draft model is one object)")
        EDGE = _Edge()
    with tempfile.TemporaryDirectory() as tmp:
        arms = {"base": _export(args.base, Path(tmp)), "this": ROOT / "src"}
        servers = {name: _serve(src, args.threads) for name, src in arms.items()}
        runs = []
        try:
            for _, url in servers.values():  # warm-up
                _play(url, 1, -1, 2, 8)
            for rep in range(args.repeats):
                order = list(servers) if rep % 2 == 0 else list(servers)[::-1]
                for name in order:
                    t0 = time.perf_counter()
                    rows = _play(servers[name][1], args.users, rep, args.turns, args.max_new_tokens)
                    print(f"repeat {rep} {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
                    runs += [{"arm": name, "repeat": rep, **r} for r in rows]
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=30)
    key = lambda r: (r["repeat"], r["user"], r["turn"])  # noqa: E731
    texts = {arm: {key(r): r["text"] for r in runs if r["arm"] == arm} for arm in arms}
    same = texts["base"] == texts["this"]

    def med(arm: str, turn: int, field: str) -> float:
        vals = [r[field] for r in runs if r["arm"] == arm and r["turn"] == turn and r[field] is not None]
        return statistics.median(vals) if vals else float("nan")

    lines = [f"{args.users} conversation(s) at a time per server, {args.repeats} repeats alternating which server goes "
             f"first, {args.turns} turns, greedy replies of at most {args.max_new_tokens} tokens through "
             f"{'edge sessions' if args.edge else 'streamed `/v1/chat/completions`'}; default models and server settings, {args.threads} threads per server. Base: "
             f"`{args.base}`. Medians over repeats and users; TTFT = time to the first content chunk.", "",
             *([f"`--edge`: each turn drafts in this script's process with the default draft model (prompt lookup first)"
                " and is verified in an edge session (`/v1/sessions`, deleted when the reply is done), as `specdec generate"
                " --remote` does; TTFT = time to the first committed tokens, prefill = the session's prompt prefill"
                " on the server.", ""] if args.edge else []),
             "| turn | prompt tokens | cached (this) | TTFT base ms | TTFT this ms | wall base s | wall this s |"
             + (" prefill base ms | prefill this ms |" if args.edge else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|" if args.edge else "")]
    for turn in range(1, args.turns + 1):
        lines.append(f"| {turn} | {med('base', turn, 'prompt_tokens'):.0f} | {med('this', turn, 'cached_tokens'):.0f} "
                     f"| {1000 * med('base', turn, 'ttft_s'):.0f} | {1000 * med('this', turn, 'ttft_s'):.0f} "
                     f"| {med('base', turn, 'wall_s'):.2f} | {med('this', turn, 'wall_s'):.2f} |"
                     + (f" {med('base', turn, 'prefill_ms'):.0f} | {med('this', turn, 'prefill_ms'):.0f} |" if args.edge else ""))
    total = {arm: statistics.median(sum(r["ttft_s"] for r in runs if r["arm"] == arm and r["repeat"] == rep and r["user"] == u)
                                    for rep in range(args.repeats) for u in range(args.users)) for arm in arms}
    wall = {arm: statistics.median(sum(r["wall_s"] for r in runs if r["arm"] == arm and r["repeat"] == rep and r["user"] == u)
                                   for rep in range(args.repeats) for u in range(args.users)) for arm in arms}
    lines += ["", f"Per conversation (median): TTFTs summed {total['base']:.2f} s base, {total['this']:.2f} s this; "
              f"wall summed {wall['base']:.2f} s base, {wall['this']:.2f} s this. "
              f"Replies identical on both servers: {'yes' if same else 'NO'}."]
    title = "edge sessions kept" if args.edge else "replies kept"
    paired.write_report(args.out, f"Multi-turn chats through the server: {title} in the prefix cache",
                        {"runs": runs, "same_replies": same}, lines)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
