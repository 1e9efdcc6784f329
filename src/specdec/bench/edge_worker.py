"""The edge process of the network bench modes (run inside :mod:`specdec.bench.worker`).

``edge_cloud``: the draft model drafts here, :func:`specdec.remote.edge.generate_remote` verifies
on the server.  ``cloud_streaming`` / ``cloud_streaming_spec``: the prompt goes to the server's
``/v1/completions`` with ``stream: true`` and the tokens come back as server-sent events.

Both are timed as the client sees them, from sending the first request (session creation for the
edge, the completion request for streaming) to the arrival of the first token (TTFT) and of the
last one (wall time).  Bytes are counted per generation: JSON payload, and on the wire (HTTP
request/status line and headers, and the chunked framing of the event stream), both ways.
One keep-alive connection serves a whole RTT block, as a deployed client would keep one.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import httpx

from specdec.bench.network import network_settings
from specdec.bench.workloads import Prompt
from specdec.errors import SpecdecError
from specdec.remote.client import _head_bytes_request, _head_bytes_response

#: how long the edge waits for the server to load its model and answer /health
READY_TIMEOUT_S = 600.0
#: /health round trips timed per setting (the median is the measured RTT)
PINGS = 3
#: new tokens of the unrecorded warm-up generation of each setting
WARMUP_TOKENS = 8


def chunked_wire_bytes(chunk_sizes: list[int]) -> int:
    """Bytes of an HTTP/1.1 chunked body with these chunk sizes: ``<hex>\\r\\n<data>\\r\\n`` each, ``0\\r\\n\\r\\n`` last."""
    return sum(len(f"{n:x}") + 2 + n + 2 for n in chunk_sizes if n) + 5


@dataclass(frozen=True)
class StreamResult:
    tokens: int  # usage.completion_tokens
    ttft_s: float  # to the first event carrying text (or the end, if none did)
    wall_s: float  # to the event carrying finish_reason
    finish_reason: str | None
    text: str
    bytes_up: int  # request body
    bytes_down: int  # event-stream body
    wire_bytes_up: int  # + request line and headers
    wire_bytes_down: int  # + status line, headers and chunk framing


def _events(buffer: bytes) -> tuple[list[bytes], bytes]:
    """Split complete ``data: ...\\n\\n`` events off ``buffer``; returns (events, rest)."""
    parts = buffer.split(b"\n\n")
    return parts[:-1], parts[-1]


def stream_completion(client: httpx.Client, url: str, headers: dict[str, str], body: dict[str, Any]) -> StreamResult:
    """POST a streaming ``/v1/completions`` request and time and count what comes back.

    Assumes one HTTP chunk per server-sent event (what the server writes); the wire count is
    checked against the delay proxy's byte count in the tests.
    """
    content = json.dumps(body, separators=(",", ":")).encode()
    req = client.build_request("POST", url.rstrip("/") + "/v1/completions", content=content,
                               headers={**headers, "Content-Type": "application/json"})
    start = time.perf_counter()
    first = finish_t = None
    finish = None
    usage: dict[str, Any] = {}
    sizes: list[int] = []
    pieces: list[str] = []
    resp = client.send(req, stream=True)
    try:
        if resp.status_code != 200:
            resp.read()
            raise SpecdecError(f"streaming completion refused: HTTP {resp.status_code}: {resp.text[:200]}")
        rest = b""
        for raw in resp.iter_raw():
            events, rest = _events(rest + raw)
            now = time.perf_counter()
            for ev in events:
                sizes.append(len(ev) + 2)
                data = ev.decode().removeprefix("data: ")
                if data == "[DONE]":
                    continue
                obj = json.loads(data)
                if "error" in obj:
                    raise SpecdecError(f"the server stopped the stream: {obj['error'].get('message')}")
                for choice in obj.get("choices") or []:
                    if choice.get("text"):
                        pieces.append(choice["text"])
                        first = first or now
                    if choice.get("finish_reason"):
                        finish, finish_t = choice["finish_reason"], now
                usage = obj.get("usage") or usage
        end = time.perf_counter()
    finally:
        resp.close()
    wall = (finish_t or end) - start
    return StreamResult(
        tokens=int(usage.get("completion_tokens", 0)), ttft_s=(first or finish_t or end) - start, wall_s=wall,
        finish_reason=finish, text="".join(pieces), bytes_up=len(content), bytes_down=sum(sizes),
        wire_bytes_up=_head_bytes_request(req) + len(content),
        wire_bytes_down=_head_bytes_response(resp) + chunked_wire_bytes(sizes),
    )


def wait_ready(client: httpx.Client, url: str, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll ``/health`` until the server answers (it may still be loading its model)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if client.get(url + "/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SpecdecError(f"the server at {url} did not answer /health within {timeout_s:.0f} s")
        time.sleep(0.25)


def ping_ms(client: httpx.Client, url: str, n: int = PINGS) -> float:
    """Median time of ``n`` ``GET /health`` round trips over the kept-alive connection, in ms."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        client.get(url + "/health").raise_for_status()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def text_sha1(text: str) -> str:
    """A short fingerprint of a generated text (greedy edge and cloud outputs must match)."""
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def _gamma(g: str | None) -> int | str | None:
    return int(g) if g is not None and g.isdigit() else g


def _edge_runner(job: Any, client: httpx.Client) -> tuple[Callable[[str], list[int]], Callable[..., dict]]:
    """(encode, generate) for edge_cloud: the draft model here, the target behind ``job.url``."""
    from specdec.drafters.hybrid import split_lookup
    from specdec.engine import EngineConfig, load_draft, model_drafter
    from specdec.remote.client import RemoteConfig
    from specdec.remote.edge import generate_remote
    from specdec.text import encode_prompt

    cfg = EngineConfig(draft=job.draft, draft_dtype=job.draft_dtype, draft_vocab=job.draft_vocab,
                       draft_temperature_factor=job.draft_temperature_factor)
    draft = load_draft(cfg)
    lookup = split_lookup(job.draft)[1]
    name = model_drafter(cfg, draft, lookup=lookup)[1]

    def encode(text: str, chat: bool) -> list[int]:
        return encode_prompt(draft.tokenizer, text, chat=chat)

    def generate(ids: list[int], sampling, wire: str, gamma: str) -> dict:  # noqa: ANN001 - SamplingConfig
        first = last = None

        def on_tokens(tokens: list[int]) -> None:
            nonlocal first, last
            if tokens:
                last = time.perf_counter()
                first = first or last

        remote = RemoteConfig(url=job.url, api_key=job.api_key, wire=wire)
        start = time.perf_counter()
        drafter = model_drafter(cfg, draft, lookup=lookup)[0]
        out = generate_remote(ids, sampling, remote, drafter=drafter, drafter_name=name,
                              gamma=_gamma(gamma) or "auto", eos_ids=draft.eos_ids, q_top_k=job.q_top_k,
                              tokenizer=draft.tokenizer, on_tokens=on_tokens, client=client)
        end = time.perf_counter()
        r, st, n = out.remote, out.stats, len(out.token_ids)
        wall = (last or end) - start
        calls = r["verify_calls"]
        return {
            "generated_tokens": n, "wall_s": wall, "tokens_per_s": n / wall if wall > 0 else 0.0,
            "ttft_s": (first or end) - start, "cloud_calls": calls, "tokens_per_call": n / calls if calls else None,
            "bytes_up": r["bytes_up"], "bytes_down": r["bytes_down"],
            "wire_bytes_up": r["wire_bytes_up"], "wire_bytes_down": r["wire_bytes_down"],
            "round_ms": r["rtt_ms"], "round_ms_p50": r["rtt_ms_p50"],
            "net_rtt_ms": r["rtt_ms"] - r["cloud_server_ms_total"] / calls if calls else None,
            "cloud_target_ms": r["cloud_prefill_ms"], "session_prefill_ms": r["session_prefill_ms"],
            "retries": r["retries"], "session_recreates": r["session_recreates"], "unverified_tokens": r["unverified_tokens"],
            "draft_tokens_proposed": st.draft_tokens_proposed, "draft_tokens_accepted": st.draft_tokens_accepted,
            "acceptance_rate": st.acceptance_rate, "mean_gamma": st.mean_gamma, "edge_draft_s": st.draft_s,
            "draft_temperature_factor": st.draft_temperature_factor,
            "rule": r["method"], "lossless": out.lossless, "finish_reason": st.finish_reason, "text_sha1": text_sha1(out.text),
        }

    return encode, generate


def _stream_runner(job: Any, client: httpx.Client, plain: bool) -> tuple[Callable[[str], list[int]], Callable[..., dict]]:
    """(encode, generate) for the streaming baselines (the same tokenizer as the edge's draft);
    ``plain``: the server decodes without a drafter."""
    from specdec.drafters.hybrid import split_lookup
    from specdec.models.registry import load_tokenizer, resolve
    from specdec.text import encode_prompt

    tokenizer = load_tokenizer(resolve(split_lookup(job.draft)[0]).folder)
    headers = {"Authorization": f"Bearer {job.api_key}", "Accept": "text/event-stream"}

    def encode(text: str, chat: bool) -> list[int]:
        return encode_prompt(tokenizer, text, chat=chat)

    def generate(ids: list[int], sampling, wire: None, gamma: str | None) -> dict:  # noqa: ANN001 - SamplingConfig
        body: dict[str, Any] = {"prompt": ids, "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                                "seed": sampling.seed, "stream": True, "stream_options": {"include_usage": True}}
        if sampling.top_p is not None:
            body["top_p"] = sampling.top_p
        if sampling.repetition_penalty != 1.0:
            body["repetition_penalty"] = sampling.repetition_penalty
        if gamma is not None:
            body["gamma"] = _gamma(gamma)
        res = stream_completion(client, job.url, headers, body)
        fields = {k: v for k, v in asdict(res).items() if k not in ("tokens", "text")}
        return {
            **fields, "generated_tokens": res.tokens, "text_sha1": text_sha1(res.text),
            "tokens_per_s": res.tokens / res.wall_s if res.wall_s > 0 else 0.0,
            # plain decoding: one target forward per token; the speculative server does not report its calls
            "cloud_calls": res.tokens if plain else None, "tokens_per_call": 1.0 if plain else None,
            "lossless": True,
        }

    return encode, generate


def interleaved_settings(modes: list[str], temperature: float, wires: list[str], gammas: list[str]) -> list[tuple]:
    """(mode, wire, γ) run for every prompt at ``temperature``, baseline first."""
    return [(m, w, g) for m in modes for _, w, g in network_settings(m, [temperature], wires, gammas)]


def run_network(job: Any, prompts: list[Prompt], emit: Callable[[dict], None], sampling_for: Callable,
                peak_rss: Callable[[], int], todo: Callable, units: Callable) -> None:
    """Every (mode, wire, γ) of ``job.net_modes`` at each temperature and ``job.rtt_ms``, interleaved
    prompt by prompt (so that compared runs are seconds apart); one ``emit`` per generation.
    ``todo(job, prompts, t)`` lists the units left at ``t`` (a resumed run has some), ``units``
    walks them (``(repeat, seed, index, prompt)``), announcing each when its rows are out."""
    limits = httpx.Limits(max_keepalive_connections=2, keepalive_expiry=300.0)
    with httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0), limits=limits) as client:
        wait_ready(client, job.url)
        runners = {m: (_edge_runner(job, client) if m == "edge_cloud" else _stream_runner(job, client, m == "cloud_streaming"))
                   for m in job.net_modes}
        encode = next(iter(runners.values()))[0]
        encoded = {p.id: encode(p.text, p.chat) for p in prompts}
        for t in job.temperatures:
            if not todo(job, prompts, t):
                continue
            settings = interleaved_settings(job.net_modes, t, job.wires, job.gammas)
            warm = replace(sampling_for(job, t, 0), max_new_tokens=WARMUP_TOKENS)
            for mode, wire, gamma in settings:  # warm-up, not recorded
                runners[mode][1](encoded[prompts[0].id], warm, wire, gamma)
            ping = ping_ms(client, job.url)
            for _, seed, _, p in units(job, prompts, t):
                for mode, wire, gamma in settings:
                    row = runners[mode][1](encoded[p.id], sampling_for(job, t, seed), wire, gamma)
                    emit({
                        "mode": mode, "method": wire or mode, "wire": wire, "gamma": gamma, "temperature": t,
                        "prompt_id": p.id, "category": p.category, "seed": seed, "rtt_ms": job.rtt_ms,
                        "emulation": job.emulation, "ping_ms": ping, **row, "rss_peak_bytes": peak_rss(),
                    })
