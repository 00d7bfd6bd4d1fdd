"""A service's session stream on a Unix socket, beside its gRPC port: for a client on the same machine (the target
co-located with its draft service), the same request and reply messages as the gRPC stream, one frame each
(speculation/channel.py `frame`), without HTTP/2 and gRPC's threads in between (docs/PERFORMANCE.md: a loopback gRPC
round trip costs several times what the drafter's round does around its compute).

Each connection is a stream: its requests are handled in order on its own thread by the servicer's `handle`, it owns
the sessions it opens, and they are released when it closes. Only processes of this service's user are served (the
peer's credentials, checked at accept). The default address is an abstract socket ("@name": no file, gone with the
process, seen only from this machine's network namespace); a path makes a socket file of mode 0600, removed at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dspark_grpc.protos.dspark.v1 import common_pb2
from dspark_grpc.serving.sessions import Owner
from dspark_grpc.speculation.channel import frame, read_frame, same_user, socket_address


class SessionSocketServer:
    """`handle(request, owner) -> response` for each framed request of `request_type`; `release_owner(owner)` when
    a connection ends. Started and drained by serving/server.py `serve` (a Companion)."""

    def __init__(self, path: Path | None, handle: Callable, release_owner: Callable[[Owner], object],
                 request_type: type, response_type: type, max_message_bytes: int, prefix: str = "dspark-") -> None:
        self.path = path  # None: an abstract socket named at `start` (`address`)
        self.address = "" if path is None else str(path)  # what clients connect to: a path, or "@name"
        self.prefix = prefix
        self.handle, self.release_owner = handle, release_owner
        self.request_type, self.response_type = request_type, response_type
        self.max_message_bytes = max_message_bytes
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._busy = 0  # requests being handled
        self._lock = threading.Lock()
        self._numbers = itertools.count(1)

    async def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        if self.path is None:
            self.address = f"@{self.prefix}{os.getpid()}-{secrets.token_hex(8)}"
            listener.bind(socket_address(self.address))
        else:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()  # a stale socket of an earlier run
            listener.bind(str(self.path))
            os.chmod(self.path, 0o600)
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, name="session-socket-accept", daemon=True).start()

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed by drain
                return
            if not same_user(conn):
                with contextlib.suppress(OSError):
                    conn.sendall(frame(self._refusal(common_pb2.Status(
                        code=16, message="the session socket serves only its service's own user; use the gRPC port"))))
                    conn.close()
                continue
            with self._lock:
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="session-socket", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        owner = Owner(f"socket:{next(self._numbers)}")
        try:
            while True:
                try:
                    payload = read_frame(conn, self.max_message_bytes)
                except ValueError as e:  # over the limit: refused as gRPC refuses such a message, then closed
                    conn.sendall(frame(self._refusal(common_pb2.Status(code=8, message=str(e)))))
                    return
                if payload is None:
                    return
                try:
                    request = self.request_type.FromString(payload)
                except Exception as e:  # noqa: BLE001 - protobuf's DecodeError: the client's bytes, not a bug here
                    conn.sendall(frame(self._refusal(common_pb2.Status(
                        code=3, message=f"the message does not parse as {self.request_type.__name__}: {e}"))))
                    return
                with self._lock:
                    self._busy += 1
                try:
                    response = self.handle(request, owner)
                finally:
                    with self._lock:
                        self._busy -= 1
                conn.sendall(frame(response))
        except OSError:  # the client went away
            pass
        finally:
            with self._lock:
                self._connections.discard(conn)
            with contextlib.suppress(OSError):
                conn.close()
            self.release_owner(owner)

    def _refusal(self, status: common_pb2.Status):
        return self.response_type(request_id=0, status=status)

    async def drain(self, grace_s: float) -> None:
        """No new connections; requests under way get up to `grace_s` to finish; then every connection is closed
        (its sessions released) and the socket file removed."""
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        deadline = time.monotonic() + grace_s
        while self._busy and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()
