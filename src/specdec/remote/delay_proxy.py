"""A TCP proxy that adds a fixed round-trip time: RTT emulation where ``tc netem`` is missing.

Every chunk read on one side is written to the other side ``RTT / 2`` after it arrived, in
arrival order, in both directions; nothing else is changed (no bandwidth limit, no loss, no
reordering).  A request/response exchange through the proxy therefore takes the configured RTT
plus whatever the server needs.  Unlike netem, the TCP handshake itself is not delayed (the
client connects to the local proxy); with keep-alive connections that is one handshake per
connection, not per request.

    python -m specdec.remote.delay_proxy --listen 8001 --to 127.0.0.1:8000 --rtt-ms 50

``--listen 0`` picks a free port.  The proxy prints one JSON line when it is listening
(``{"listening": port, ...}``) and, when stopped (SIGTERM / SIGINT), one JSON line with the
bytes it forwarded each way and the number of connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable

#: bytes read from a socket at a time
CHUNK = 1 << 16


@dataclass
class ProxyStats:
    """Totals over the proxy's life (TCP payload bytes, HTTP headers included)."""

    connections: int = 0
    bytes_up: int = 0  # client -> upstream
    bytes_down: int = 0  # upstream -> client


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float,
                count: Callable[[int], None]) -> None:
    """Copy ``reader`` to ``writer``, each chunk ``delay_s`` after it was read, in order.

    Reading and writing run as two tasks joined by a queue, so a long delay does not stop the
    proxy from reading (the delay adds latency, not a bandwidth limit).  End of stream is
    forwarded (half-close) after the same delay.
    """
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def read() -> None:
        try:
            while True:
                data = await reader.read(CHUNK)
                queue.put_nowait((time.monotonic() + delay_s, data))
                if not data:
                    return
        except (ConnectionError, OSError):
            queue.put_nowait((time.monotonic() + delay_s, b""))

    async def write() -> None:
        while True:
            due, data = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not data:
                if writer.can_write_eof():
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                return
            count(len(data))  # before the peer can see them (stats may be read from another thread)
            writer.write(data)
            await writer.drain()

    reading = asyncio.create_task(read())
    try:
        await write()
    finally:
        reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reading


class DelayProxy:
    """Listen on ``listen_host:listen_port``, forward to ``upstream`` with ``rtt_ms`` added per round trip."""

    def __init__(self, upstream_host: str, upstream_port: int, rtt_ms: float, *,
                 listen_host: str = "127.0.0.1", listen_port: int = 0) -> None:
        if rtt_ms < 0:
            raise ValueError(f"the RTT must be >= 0 ms, got {rtt_ms}")
        self.upstream = (upstream_host, upstream_port)
        self.rtt_ms = rtt_ms
        self.listen = (listen_host, listen_port)
        self.stats = ProxyStats()
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2e3

    @property
    def port(self) -> int:
        if self._server is None:
            raise RuntimeError("the proxy is not started")
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> "DelayProxy":
        self._server = await asyncio.start_server(self._handle, *self.listen)
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        self.stats.connections += 1
        try:
            try:
                up_r, up_w = await asyncio.open_connection(*self.upstream)
            except OSError:
                return  # the client sees the connection close, as with a refused connect
            pumps = [
                asyncio.create_task(_pump(client_r, up_w, self.one_way_s, self._count_up)),
                asyncio.create_task(_pump(up_r, client_w, self.one_way_s, self._count_down)),
            ]
            try:
                # both directions end normally; a reset on either side ends both
                await asyncio.wait(pumps, return_when=asyncio.FIRST_EXCEPTION)
            except asyncio.CancelledError:
                pass  # the proxy is closing; end this connection quietly
            finally:
                for t in pumps:
                    t.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
                up_w.close()
        finally:
            client_w.close()
            if task is not None:
                self._tasks.discard(task)

    def _count_up(self, n: int) -> None:
        self.stats.bytes_up += n

    def _count_down(self, n: int) -> None:
        self.stats.bytes_down += n


class ThreadedProxy:
    """A :class:`DelayProxy` on its own event loop in a daemon thread, for synchronous code.

    ``with ThreadedProxy("127.0.0.1", 8000, rtt_ms=20) as proxy: ... proxy.url ...``
    """

    def __init__(self, upstream_host: str, upstream_port: int, rtt_ms: float) -> None:
        self.proxy = DelayProxy(upstream_host, upstream_port, rtt_ms)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="delay-proxy")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}"

    @property
    def stats(self) -> ProxyStats:
        return self.proxy.stats

    def __enter__(self) -> "ThreadedProxy":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.proxy.close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


def parse_address(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (or ``PORT``, meaning 127.0.0.1) -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


async def serve(proxy: DelayProxy, *, announce: bool = True) -> None:
    """Run ``proxy`` until SIGTERM / SIGINT; print its totals as one JSON line on the way out."""
    await proxy.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if announce:
        print(json.dumps({"listening": proxy.port, "to": f"{proxy.upstream[0]}:{proxy.upstream[1]}",
                          "rtt_ms": proxy.rtt_ms}), flush=True)
    await stop.wait()
    await proxy.close()
    print(json.dumps({"stopped": True, **asdict(proxy.stats)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.remote.delay_proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--listen", required=True, help="port to listen on (0 = any free port), or HOST:PORT")
    p.add_argument("--to", required=True, help="upstream HOST:PORT")
    p.add_argument("--rtt-ms", type=float, required=True, help="round-trip time to add, in ms (half each way)")
    args = p.parse_args(argv)
    try:
        listen = parse_address(args.listen)
        upstream = parse_address(args.to)
        proxy = DelayProxy(*upstream, args.rtt_ms, listen_host=listen[0], listen_port=listen[1])
    except ValueError as exc:
        p.error(str(exc))
    try:
        asyncio.run(serve(proxy))
    except OSError as exc:
        print(f"delay proxy: cannot listen on {args.listen}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
