"""The bench's link-delay proxy: bytes arrive intact and in order, each direction at least the delay late."""

from __future__ import annotations

import socket
import threading
import time

from dspark_grpc.bench.delay_proxy import delay_proxy


def _echo_server() -> tuple[socket.socket, str]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    return server, f"127.0.0.1:{server.getsockname()[1]}"


def test_proxy_forwards_in_order_and_delays_each_way():
    server, address = _echo_server()
    delay = 0.05
    with server, delay_proxy(address, delay) as proxied:
        host, port = proxied.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as conn:
            payload = bytes(range(256)) * 400  # several chunks
            t0 = time.perf_counter()
            conn.sendall(payload)
            got = b""
            while len(got) < len(payload):
                got += conn.recv(65536)
            elapsed = time.perf_counter() - t0
    assert got == payload
    assert elapsed >= 2 * delay  # a lower bound: a slow machine only adds to it
