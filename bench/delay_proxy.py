"""A loopback TCP proxy that delays every chunk it forwards by a fixed one-way latency, in both directions.

`dspark bench --link-delay-ms D` puts one in front of each link (client -> target, target -> drafter) to see what a
network between the processes costs. Order is kept: a chunk leaves `delay_s` after it arrived, and never before
the chunk read ahead of it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def delay_proxy(upstream: str, delay_s: float, host: str = "127.0.0.1") -> Iterator[str]:
    """Listen on a free loopback port and forward to `upstream` ("host:port"); yields the proxy's address."""
    up_host, up_port = upstream.rsplit(":", 1)
    loop = asyncio.new_event_loop()
    ready: asyncio.Future | None = None
    stop = threading.Event()

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, chunk = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not chunk:
                    writer.close()
                    return
                writer.write(chunk)
                await writer.drain()

        sender = loop.create_task(send())
        try:
            while chunk := await reader.read(1 << 16):
                queue.put_nowait((loop.time() + delay_s, chunk))
            queue.put_nowait((loop.time() + delay_s, b""))
            await sender
        except ConnectionError:
            pass
        finally:
            sender.cancel()

    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(up_host, int(up_port))
        except OSError:
            client_writer.close()
            return
        try:
            await asyncio.gather(pipe(client_reader, server_writer), pipe(server_reader, client_writer))
        finally:
            client_writer.close()
            server_writer.close()

    async def main() -> None:
        nonlocal ready
        server = await asyncio.start_server(handle, host, 0)
        ready.set_result(server.sockets[0].getsockname()[1])
        while not stop.is_set():
            await asyncio.sleep(0.05)
        server.close()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main())
        loop.close()

    ready = loop.create_future()
    thread = threading.Thread(target=run, name="delay-proxy", daemon=True)
    thread.start()
    port = asyncio.run_coroutine_threadsafe(asyncio.wait_for(asyncio.shield(ready), 10), loop).result(15)
    try:
        yield f"{host}:{port}"
    finally:
        stop.set()
        thread.join(5)
