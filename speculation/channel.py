"""gRPC channels and session streams, shared by the SDK and the services' links (target -> drafter).

Needs only grpcio + protobuf."""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import os
import queue
import socket
import struct
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import grpc
from dspark_grpc.speculation.generation import RequestError

MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class SessionStream:
    """A session stream (TargetSession or DraftSession): requests go out in order and their replies come back in
    order, each to the Future `send` returned for it.

    Closing it ends the stream, which frees its sessions on the server. A reader thread takes the replies, and hands
    each to its Future (its callbacks run on that thread), so a caller may wait with a timeout (a drafter that stops
    answering is treated as failed, not waited for) or not wait at all. Once the stream has ended (an error, the
    deadline, `close`), every request not answered and every later one fails with the same status.
    """

    def __init__(self, open_stream: Callable, timeout: float | None) -> None:
        self._start_replies()
        self._requests: queue.Queue = queue.Queue()
        self._responses = open_stream(iter(self._requests.get, None), timeout=timeout)
        threading.Thread(target=self._read, name="session-stream-reader", daemon=True).start()

    def _start_replies(self) -> None:
        self._waiting: collections.deque[Future] = collections.deque()  # one per request not answered yet
        self._error: RequestError | None = None  # why the stream ended
        self._lock = threading.Lock()

    @property
    def ended(self) -> bool:
        """The stream is over (an error, the deadline, `close`): every call fails at once."""
        return self._error is not None

    def _read(self) -> None:
        try:
            for response in self._responses:
                self._reply(response)
            self._end(RequestError(14, "the server closed the stream"))
        except grpc.RpcError as e:
            self._end(RequestError(e.code().value[0], e.details() or e.code().name))
        except Exception as e:  # noqa: BLE001 - e.g. a reply grpc could not deserialize: still an end, not a hang
            self._end(RequestError(13, f"the stream failed: {type(e).__name__}: {e}"))

    def _reply(self, response) -> None:
        with self._lock:
            waiting = self._waiting.popleft() if self._waiting else None
        if waiting is None:
            raise RuntimeError("a reply to no request")
        waiting.set_result(response)

    def _end(self, error: RequestError) -> None:
        with self._lock:
            self._error = self._error or error
            waiting, self._waiting = list(self._waiting), collections.deque()
        for future in waiting:
            future.set_exception(self._error)

    def send(self, request) -> Future:
        """Send a request without waiting: the Future of its reply (a RequestError if the stream ends first)."""
        future: Future = Future()
        with self._lock:  # the order of the waiting Futures is the order of the requests
            if self._error is None:
                self._waiting.append(future)
                self._transmit(request)
                return future
        future.set_exception(self._error)
        return future

    def _transmit(self, request) -> None:
        """Hand `request` on, in order (called under the lock; must not block)."""
        self._requests.put(request)

    def call(self, request, timeout: float | None = None):
        """Send a request and wait for its reply; past `timeout` the stream is closed (RequestError
        DEADLINE_EXCEEDED)."""
        return self.result(self.send(request), timeout)

    def result(self, reply: Future, timeout: float | None = None):
        """The reply `send` returned the Future of, waited for up to `timeout`: past it the stream is closed
        (RequestError DEADLINE_EXCEEDED, for this request and every other one not answered)."""
        try:
            return reply.result(timeout)
        except TimeoutError:
            self.close(f"no reply within {timeout:g} s", code=4)
            return reply.result()

    def close(self, reason: str = "the stream was closed", code: int = 1) -> None:
        self._end(RequestError(code, reason))
        self._requests.put(None)
        self._responses.cancel()


# A session stream's frame on a local socket: the serialized message's length (4 bytes, little-endian), then it.
FRAME_HEADER = struct.Struct("<I")


def frame(message) -> bytes:
    payload = message.SerializeToString()
    return FRAME_HEADER.pack(len(payload)) + payload


def read_frame(sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES) -> bytes | None:
    """The next frame's payload; None when the peer closed the socket between frames. ValueError: a frame over
    `max_bytes`; ConnectionError: closed within a frame."""
    header = _read_exactly(sock, FRAME_HEADER.size, eof_ok=True)
    if header is None:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    if size > max_bytes:
        raise ValueError(f"a message of {size} bytes is over the {max_bytes}-byte limit")
    return _read_exactly(sock, size)


def _read_exactly(sock: socket.socket, n: int, eof_ok: bool = False) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if eof_ok and got == 0:
                return None
            raise ConnectionError("the socket closed within a message")
        got += k
    return bytes(buf)


def same_user(conn: socket.socket) -> bool:
    """The process at the other end of a Unix socket runs as this process's user (SO_PEERCRED: pid, uid, gid)."""
    _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return uid == os.getuid()


def socket_address(address: str) -> str:
    """A session socket's address as `socket.connect` takes it: "@name" is Linux's abstract socket "\\0name"."""
    return "\0" + address[1:] if address.startswith("@") else address


class SocketSessionStream(SessionStream):
    """A session stream over a Unix socket on the server's machine (the draft service's `session_socket`): the same
    messages, each one frame (`frame`), with no HTTP/2 and no gRPC threads between the caller and the socket. `send`
    writes on the caller's thread when the socket takes the frame at once; a frame it cannot take whole (a large
    capture, a server that stopped reading) goes to a writer thread, and the frames after it too, in order, so a
    caller never blocks on the socket. The reader thread completes the Futures, as for the gRPC stream."""

    def __init__(self, path: str, response_type: type, connect_timeout: float = 2.0) -> None:
        self._start_replies()
        self._response_type = response_type
        self._backlog: collections.deque[bytes] = collections.deque()  # frames the writer thread has yet to send
        self._backlog_ready = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(connect_timeout)
            self._sock.connect(socket_address(path))
            self._sock.settimeout(None)
            if not same_user(self._sock):  # it would refuse us: the caller uses gRPC instead
                raise ConnectionRefusedError(f"the session socket {path} belongs to another user")
        except OSError:
            self._sock.close()
            raise
        threading.Thread(target=self._read, name="session-socket-reader", daemon=True).start()

    def _read(self) -> None:
        try:
            while (payload := read_frame(self._sock)) is not None:
                self._reply(self._response_type.FromString(payload))
            self._end(RequestError(14, "the server closed the session socket"))
        except Exception as e:  # noqa: BLE001 - a socket error or a reply that does not parse: the stream's end
            self._end(RequestError(14, f"the session socket failed: {type(e).__name__}: {e}"))

    def _transmit(self, request) -> None:
        data = frame(request)
        if not self._backlog:
            try:
                sent = self._sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError:
                sent = 0  # the reader sees the socket fail and ends the stream
            if sent == len(data):
                return
            data = data[sent:]
        self._backlog.append(data)
        if self._writer is None:
            self._writer = threading.Thread(target=self._write, name="session-socket-writer", daemon=True)
            self._writer.start()
        self._backlog_ready.notify()

    def _write(self) -> None:
        while True:
            with self._lock:
                while not self._backlog and self._error is None:
                    self._backlog_ready.wait()
                if self._error is not None:
                    return
                data = self._backlog[0]  # left in the backlog while it is sent: later frames queue behind it
            try:
                self._sock.sendall(data)
            except OSError as e:
                self.close(f"the session socket failed: {e}", code=14)
                return
            with self._lock:
                self._backlog.popleft()

    def close(self, reason: str = "the stream was closed", code: int = 1) -> None:
        self._end(RequestError(code, reason))
        with self._lock:
            self._backlog_ready.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # the reader's recv returns; the server releases the sessions


# gRPC's reconnect backoff grows to 2 minutes while a service is down: a restarted service would be found only
# after tens of seconds. Retry at least once a second instead.
# keepalive: a connection that has heard nothing for 30 s is pinged, and closed (UNAVAILABLE for its calls) when the
# ping is not answered within 20 s: a frozen service fails its calls in under a minute instead of at their deadline.
# The services accept pings every 10 s (serving/server.py).
KEEPALIVE_TIME_MS, KEEPALIVE_TIMEOUT_MS = 30_000, 20_000
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.initial_reconnect_backoff_ms", 250), ("grpc.max_reconnect_backoff_ms", 1000),
                   ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                   ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS)]  # grpcio waits 60 s for a ping's ack else


@dataclass(frozen=True)
class ChannelSecurity:
    """One link's security: TLS when `root_ca` (PEM of the CA that signed the server's certificate) or a client
    certificate is given; mutual TLS with `cert_chain` + `private_key`; a bearer token sent with every call (over TLS
    or, on loopback, plaintext). `server_name` overrides the name the server's certificate must carry."""

    root_ca: bytes | None = None
    cert_chain: bytes | None = None
    private_key: bytes | None = None
    token: str | None = None
    server_name: str | None = None

    @property
    def tls(self) -> bool:
        return self.root_ca is not None or self.cert_chain is not None

    @classmethod
    def from_files(cls, tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                   token_file: str | None = None, server_name: str | None = None) -> ChannelSecurity:
        """Reads the PEM files and the token file (its first token: one per line, '#' comments)."""
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("give the client certificate and its key together (--tls-cert and --tls-key)")
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        token = None
        if token_file:
            lines = [line.split("#", 1)[0].strip() for line in Path(token_file).read_text().splitlines()]
            token = next((t for t in lines if t), None)
            if token is None:
                raise ValueError(f"{token_file} holds no token")
        return cls(read(tls_ca), read(tls_cert), read(tls_key), token, server_name)


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _add(self, details):
        return details._replace(metadata=[*(details.metadata or ()), self.header])

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._add(details), request)

    intercept_unary_stream = intercept_unary_unary

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._add(details), request_iterator)

    intercept_stream_stream = intercept_stream_unary


def tls_mismatch(details: str, options: str = "--tls-ca, --tls-cert/--tls-key") -> str | None:
    """What an UNAVAILABLE's details tell of a TLS mismatch between a client and a service, for a one-line error
    (None: nothing of the kind); `options` names where the caller sets TLS.

    grpcio 1.85 words them so (tests/test_cli_help.py): a plaintext client to a TLS service, or a TLS client without
    the certificate a mutual-TLS service requires: "failed to connect to all addresses; ...: Socket closed"; a TLS
    client to a plaintext service: "... Tls handshake failed (TSI_PROTOCOL_FAILURE): ... WRONG_VERSION_NUMBER ...";
    to a service whose certificate another CA signed: "... Tls handshake failed ... CERTIFICATE_VERIFY_FAILED ..."."""
    if "handshake failed" in details.lower():
        if "WRONG_VERSION_NUMBER" in details:
            why = "the TLS handshake failed: the service does not seem to serve TLS"
        elif "CERTIFICATE_VERIFY_FAILED" in details:
            why = "the TLS handshake failed: the service's certificate is not from the CA given (or names another host)"
        else:
            why = "the TLS handshake failed"
    elif "failed to connect" in details and details.rstrip().endswith("Socket closed"):
        why = "the service closed the connection at once: it may require TLS, or over TLS a client certificate"
    else:
        return None
    return f"{why} (see {options})"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def address_host(address: str) -> str:
    """The host of a gRPC target: `host:port`, `[v6]:port`, `dns:///host:port`; `unix:` sockets as localhost."""
    if address.startswith("unix:"):
        return "localhost"
    address = address.split("///", 1)[-1] if "://" in address else address.removeprefix("dns:")
    if address.startswith("["):
        return address[: address.index("]") + 1]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def token_in_the_clear(address: str, security: ChannelSecurity | None) -> str | None:
    """A warning when a bearer token would travel unencrypted to another machine, else None."""
    if security is None or not security.token or security.tls or is_loopback(address_host(address)):
        return None
    return (f"the bearer token for {address} is sent without TLS: anyone on the path can read it and use the "
            "service (give the CA with --tls-ca / ChannelSecurity(root_ca=...))")


def make_channel(address: str, security: ChannelSecurity | None = None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel with CHANNEL_OPTIONS, `options` added (e.g. the SDK's round-robin for a `dns:///` address)."""
    if warning := token_in_the_clear(address, security):
        warnings.warn(warning, stacklevel=2)
    options = CHANNEL_OPTIONS + list(options)
    if security is None or not security.tls:
        channel = grpc.insecure_channel(address, options=options)
    else:
        options += [("grpc.ssl_target_name_override", security.server_name)] if security.server_name else []
        credentials = grpc.ssl_channel_credentials(security.root_ca, security.private_key, security.cert_chain)
        channel = grpc.secure_channel(address, credentials, options=options)
    if security is not None and security.token:
        channel = grpc.intercept_channel(channel, _BearerToken(security.token))
    return channel


