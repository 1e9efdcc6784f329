"""The RTT-emulating TCP proxy: added delay, order and integrity, no bandwidth limit, CLI.

The lower bound (a round trip takes at least the configured RTT) is the property under test; the
upper bound (< RTT + 1.5 s) only catches a proxy that hangs or delays per byte, and is wide so
that a CI machine loaded by parallel tests cannot fail it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import subprocess
import sys
import time

import httpx
import pytest

from specdec.remote.delay_proxy import DelayProxy, ThreadedProxy, main, parse_address

SLACK_S = 1.5


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def _with_proxy(rtt_ms: float, body):
    """Run ``body(port)`` against an echo server behind a proxy adding ``rtt_ms``."""
    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    proxy = await DelayProxy("127.0.0.1", echo.sockets[0].getsockname()[1], rtt_ms).start()
    try:
        return await body(proxy)
    finally:
        await proxy.close()
        echo.close()
        await echo.wait_closed()


def test_round_trip_takes_the_configured_rtt():
    rtt_s = 0.1

    async def body(proxy: DelayProxy) -> list[float]:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        times = []
        for i in range(4):
            msg = f"ping {i}\n".encode()
            start = time.perf_counter()
            writer.write(msg)
            assert await reader.readexactly(len(msg)) == msg
            times.append(time.perf_counter() - start)
        writer.close()
        return times

    times = asyncio.run(_with_proxy(1e3 * rtt_s, body))
    assert all(rtt_s <= t < rtt_s + SLACK_S for t in times), times


def test_pipelined_chunks_keep_order_and_are_not_serialised():
    """Six sends 20 ms apart all come back about one RTT after they left: latency, not bandwidth.

    A proxy that serialised the chunks (each waiting out a full RTT) would take >= 6 RTT = 3 s,
    beyond the upper bound even with the wide slack.
    """
    rtt_s, gap_s, n = 0.5, 0.02, 6

    async def body(proxy: DelayProxy) -> float:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        start = time.perf_counter()
        for i in range(n):
            writer.write(bytes([i]) * 10)
            await writer.drain()
            await asyncio.sleep(gap_s)
        data = await reader.readexactly(10 * n)
        assert data == b"".join(bytes([i]) * 10 for i in range(n))
        writer.close()
        return time.perf_counter() - start

    elapsed = asyncio.run(_with_proxy(1e3 * rtt_s, body))
    assert (n - 1) * gap_s + rtt_s <= elapsed < (n - 1) * gap_s + rtt_s + SLACK_S


def test_large_transfer_is_intact_and_counted():
    payload = bytes(range(256)) * 4096  # 1 MiB

    async def body(proxy: DelayProxy) -> tuple[bytes, int, int]:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
        writer.write(payload)
        await writer.drain()
        got = await reader.readexactly(len(payload))
        writer.close()
        return got, proxy.stats.bytes_up, proxy.stats.bytes_down

    got, up, down = asyncio.run(_with_proxy(10.0, body))
    assert got == payload and up == down == len(payload)


def test_refused_upstream_closes_the_client_connection():
    """The client's connection is closed, and counted: ProxyStats.connections counts the clients the
    proxy accepted, refused upstream or not."""

    async def main() -> tuple[bytes, int]:
        probe = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = probe.sockets[0].getsockname()[1]
        probe.close()
        await probe.wait_closed()  # nothing listens on `port` any more
        proxy = await DelayProxy("127.0.0.1", port, 0).start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            data = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            return data, proxy.stats.connections
        finally:
            await proxy.close()

    assert asyncio.run(main()) == (b"", 1)


def test_parse_address_and_bad_rtt():
    assert parse_address("8001") == ("127.0.0.1", 8001)
    assert parse_address("10.0.0.1:80") == ("10.0.0.1", 80)
    assert parse_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError):
        parse_address("host:port")
    with pytest.raises(ValueError):
        DelayProxy("127.0.0.1", 1, -1.0)


def test_cli_proxies_http_and_reports_bytes(toy_server):
    """``python -m specdec.remote.delay_proxy``: announce the port, delay HTTP, print totals on SIGTERM."""
    rtt_s = 0.06
    proc = subprocess.Popen(
        [sys.executable, "-m", "specdec.remote.delay_proxy", "--listen", "0", "--to", f"127.0.0.1:{toy_server.port}",
         "--rtt-ms", str(1e3 * rtt_s)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        hello = json.loads(proc.stdout.readline())
        url = f"http://127.0.0.1:{hello['listening']}"
        with httpx.Client(timeout=60) as client:
            client.get(url + "/health").raise_for_status()  # connection set-up
            for _ in range(3):
                start = time.perf_counter()
                assert client.get(url + "/health").status_code == 200
                assert rtt_s <= time.perf_counter() - start < rtt_s + SLACK_S
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    totals = json.loads(out.strip().splitlines()[-1])
    assert totals["stopped"] and totals["connections"] == 1 and totals["bytes_up"] > 0 and totals["bytes_down"] > 0


def test_client_wire_byte_estimate_matches_the_bytes_on_the_wire(toy_server):
    """RemoteVerifier's on-the-wire estimate (HTTP head + body) equals what the proxy forwarded."""
    import torch

    from specdec.drafters.base import Draft
    from specdec.remote.client import RemoteConfig, RemoteVerifier
    from specdec.sampling import SamplingConfig

    from .conftest import API_KEY

    with ThreadedProxy("127.0.0.1", toy_server.port, 0.0) as proxy:
        cfg = RemoteConfig(url=proxy.url, api_key=API_KEY, wire="greedy")
        verifier = RemoteVerifier(cfg, [1, 2], SamplingConfig(temperature=0.0, seed=0, max_new_tokens=8))
        try:
            verifier.verify(Draft(tokens=torch.tensor([1, 2, 3]), probs=None))
            st = verifier.stats
            assert st.session_creates == 1 and st.verify_calls == 1
            assert (proxy.stats.bytes_up, proxy.stats.bytes_down) == (st.wire_bytes_up, st.wire_bytes_down)
        finally:
            verifier.close()


async def _reply_at_eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Read the whole request (to end of stream), answer with its length, close."""
    data = await reader.read()
    writer.write(f"{len(data)}".encode())
    await writer.drain()
    writer.close()


def test_each_way_takes_half_the_rtt():
    assert DelayProxy("127.0.0.1", 1, 100.0).one_way_s == pytest.approx(0.05)
    assert DelayProxy("127.0.0.1", 1, 0.0).one_way_s == 0.0  # no delay at all is allowed


def test_connections_and_bytes_each_way_are_counted_and_end_of_stream_is_passed_on():
    """Two connections, each a request ended by a half-close that the server must see to answer."""

    async def run() -> tuple[list[bytes], tuple[int, int, int]]:
        server = await asyncio.start_server(_reply_at_eof, "127.0.0.1", 0)
        proxy = await DelayProxy("127.0.0.1", server.sockets[0].getsockname()[1], 0.0).start()
        try:
            answers = []
            for msg in (b"x" * 1000, b"y" * 234):
                reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
                writer.write(msg)
                writer.write_eof()
                answers.append(await asyncio.wait_for(reader.read(), 5.0))
                writer.close()
            s = proxy.stats
            return answers, (s.connections, s.bytes_up, s.bytes_down)
        finally:
            await proxy.close()
            server.close()
            await server.wait_closed()

    answers, counts = asyncio.run(run())
    assert answers == [b"1000", b"234"] and counts == (2, 1234, 7)


def test_addresses_take_any_port_up_to_65535():
    assert parse_address("0") == ("127.0.0.1", 0) and parse_address("host:65535") == ("host", 65535)
    assert parse_address(":8000") == ("127.0.0.1", 8000)
    for bad in ("65536", "h:99999", "h:-1", "h:"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            parse_address(bad)


def test_a_port_already_taken_is_one_line_and_exit_code_1(capsys):
    """The proxy's command on a port another socket holds: exit code 1 and one line naming the
    address, no traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--listen", f"127.0.0.1:{port}", "--to", "127.0.0.1:1", "--rtt-ms", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"delay proxy: cannot listen on 127.0.0.1:{port}") and err.count("\n") == 1, err


def test_a_client_reset_ends_the_upstream_stream():
    """A client that resets its connection (RST, not a clean close): the upstream side is sent end of
    stream (within 5 s here; at once in fact), not left waiting for bytes that will never come."""

    async def main() -> bytes:
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        async def upstream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            data = b""
            while chunk := await reader.read(1 << 16):
                data += chunk
            if not got.done():
                got.set_result(data)
            writer.close()

        server = await asyncio.start_server(upstream, "127.0.0.1", 0)
        proxy = await DelayProxy("127.0.0.1", server.sockets[0].getsockname()[1], 0.0).start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"hello")
            await writer.drain()
            await asyncio.sleep(0.2)  # the bytes reach the upstream first
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()  # linger 0: the close is a reset
            return await asyncio.wait_for(got, 5.0)
        finally:
            await proxy.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(main()) == b"hello"
