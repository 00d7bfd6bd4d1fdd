"""serving/session_socket.py and speculation/channel.py:SocketSessionStream over a real Unix socket, with a handler
that is a plain function (no model): replies in order to their own requests; a frame the socket cannot take at once
queues behind in order and never blocks the sender; over-limit and unparsable messages get a status, then the
connection ends; a closed connection releases its owner; the socket's file admits only this user and is removed at
the end. The draft service's use of it (the target on the same machine) runs in every service test; the link's
choice between it and gRPC is tested here."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import threading
import time

import grpc
import pytest
from dspark_grpc.protos.dspark.v1 import draft_pb2
from dspark_grpc.serving.session_socket import SessionSocketServer
from dspark_grpc.speculation.channel import (
    FRAME_HEADER,
    SessionStream,
    SocketSessionStream,
    frame,
    read_frame,
    socket_address,
)
from dspark_grpc.speculation.generation import RequestError
from dspark_grpc.target_service.drafter_link import DrafterLink

HOLD = 1_000_000  # a request id the handler does not answer until told


class Handler:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.released: list[object] = []
        self.owners: set[object] = set()

    def handle(self, request: draft_pb2.DraftSessionRequest, owner: object) -> draft_pb2.DraftSessionResponse:
        self.owners.add(owner)
        if request.request_id >= HOLD:
            self.release.wait(60)
        # the reply echoes the size of what it got, so a large request's arrival whole is checked
        return draft_pb2.DraftSessionResponse(request_id=request.request_id,
                                              appended=draft_pb2.ContextAppended(length=len(request.append.tokens)))


@pytest.fixture()
def served(tmp_path):
    handler = Handler()
    server = SessionSocketServer(None, handler.handle, handler.released.append, draft_pb2.DraftSessionRequest,
                                 draft_pb2.DraftSessionResponse, max_message_bytes=1 << 20, prefix="dspark-test-")
    asyncio.run(server.start())
    yield handler, server
    handler.release.set()
    asyncio.run(server.drain(0))


def request(request_id: int, tokens: int = 0) -> draft_pb2.DraftSessionRequest:
    return draft_pb2.DraftSessionRequest(request_id=request_id,
                                         append=draft_pb2.AppendContext(tokens=list(range(tokens))))


def test_replies_reach_their_requests_in_order(served):
    _, server = served
    stream = SocketSessionStream(server.address, draft_pb2.DraftSessionResponse)
    sent = [stream.send(request(i, tokens=i)) for i in range(1, 31)]
    replies = [stream.result(f, 60) for f in sent]
    assert [r.request_id for r in replies] == list(range(1, 31))
    assert [r.appended.length for r in replies] == list(range(1, 31))
    stream.close()
    assert stream.ended


def test_a_frame_the_socket_cannot_take_at_once_queues_in_order_without_blocking_the_sender(served):
    handler, server = served
    stream = SocketSessionStream(server.address, draft_pb2.DraftSessionResponse)
    held = stream.send(request(HOLD))  # the server's thread waits in the handler: it reads nothing more
    big = [stream.send(request(i, tokens=60_000)) for i in (1, 2, 3)]  # ~3 x 180 kB: more than the socket holds
    small = stream.send(request(4))
    # every send returned while the handler is still held (a blocking send would have waited for the release)
    assert not handler.release.is_set() and not held.done()
    assert stream._writer is not None and not small.done()  # the writer thread has the frames the socket did not take
    handler.release.set()
    assert stream.result(held, 60).request_id == HOLD
    assert [stream.result(f, 60).appended.length for f in big] == [60_000] * 3
    assert stream.result(small, 60).request_id == 4
    stream.close()


def test_a_wait_past_its_timeout_ends_the_stream_and_releases_its_owner(served):
    handler, server = served
    stream = SocketSessionStream(server.address, draft_pb2.DraftSessionResponse)
    assert stream.call(request(1), 60).request_id == 1
    held, behind = stream.send(request(HOLD)), stream.send(request(2))
    with pytest.raises(RequestError) as late:
        stream.result(held, timeout=0.2)
    assert late.value.code == 4 and "no reply within 0.2 s" in late.value.message
    with pytest.raises(RequestError):
        behind.result(0)
    with pytest.raises(RequestError):
        stream.send(request(3)).result(0)
    handler.release.set()
    deadline = time.monotonic() + 60
    while not handler.released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handler.released == list(handler.owners)  # the connection's one owner, released when it closed


def raw_exchange(address: str, data: bytes) -> list[draft_pb2.DraftSessionResponse]:
    """Send raw bytes, read replies until the server closes the connection."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(socket_address(address))
        sock.sendall(data)
        replies = []
        while (payload := read_frame(sock)) is not None:
            replies.append(draft_pb2.DraftSessionResponse.FromString(payload))
        return replies


def test_an_over_limit_message_is_refused_with_a_status_then_the_connection_ends(served):
    _, server = served
    replies = raw_exchange(server.address, frame(request(1)) + FRAME_HEADER.pack(2 << 20))
    assert [r.request_id for r in replies] == [1, 0]
    assert replies[1].status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "over the 1048576-byte limit" in replies[1].status.message


def test_a_message_that_does_not_parse_is_refused_with_invalid_argument(served):
    _, server = served
    junk = b"\xff" * 7
    replies = raw_exchange(server.address, FRAME_HEADER.pack(len(junk)) + junk)
    assert len(replies) == 1 and replies[0].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "does not parse as DraftSessionRequest" in replies[0].status.message


def test_the_default_socket_is_abstract_and_leaves_no_file(served):
    _, server = served
    assert server.address.startswith("@dspark-test-") and server.path is None
    stream = SocketSessionStream(server.address, draft_pb2.DraftSessionResponse)
    assert stream.call(request(1), 60).request_id == 1
    stream.close()


def test_a_socket_at_a_path_is_this_users_only_and_removed_at_the_end(tmp_path):
    handler = Handler()
    path = tmp_path / "draft.sock"
    server = SessionSocketServer(path, handler.handle, handler.released.append, draft_pb2.DraftSessionRequest,
                                 draft_pb2.DraftSessionResponse, max_message_bytes=1 << 20)
    asyncio.run(server.start())
    assert server.address == str(path) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    stream = SocketSessionStream(server.address, draft_pb2.DraftSessionResponse)
    assert stream.call(request(2), 60).request_id == 2
    stream.close()
    asyncio.run(server.drain(0))
    assert not path.exists()


CONNECT_AS_ANOTHER_USER = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(30)
address = sys.argv[1]
sock.connect("\\0" + address[1:] if address.startswith("@") else address)
data = b""
while chunk := sock.recv(65536):
    data += chunk
sys.stdout.write(data.hex())
"""


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")  # one another user may run


@pytest.mark.skipif(os.getuid() != 0 or SYSTEM_PYTHON is None,
                    reason="needs root to connect as another user, and a python3 that user may run")
def test_another_user_is_refused_with_unauthenticated(served):
    _, server = served
    out = subprocess.run([SYSTEM_PYTHON, "-I", "-c", CONNECT_AS_ANOTHER_USER, server.address],
                         user=65534, capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    data = bytes.fromhex(out.stdout)
    (size,) = FRAME_HEADER.unpack(data[:4])
    reply = draft_pb2.DraftSessionResponse.FromString(data[4 : 4 + size])
    assert reply.status.code == grpc.StatusCode.UNAUTHENTICATED.value[0] and "own user" in reply.status.message


def test_the_link_takes_the_drafters_socket_when_this_machine_has_it(served, tmp_path):
    _, server = served
    channel = grpc.insecure_channel("127.0.0.1:1")  # never called: the link's info is set by hand
    link = DrafterLink(channel, "127.0.0.1:1", None)
    link.info = draft_pb2.GetDrafterInfoResponse(session_socket=server.address)
    local = link.open_stream()
    assert isinstance(local, SocketSessionStream)
    assert local.call(request(7), 60).request_id == 7
    link.info = draft_pb2.GetDrafterInfoResponse(session_socket=str(tmp_path / "elsewhere.sock"))  # another machine's
    remote = link.open_stream()
    assert type(remote) is SessionStream
    link.info = draft_pb2.GetDrafterInfoResponse(session_socket="@dspark-test-not-here")
    assert type(link.open_stream()) is SessionStream
    link.use_session_socket, link.info = False, draft_pb2.GetDrafterInfoResponse(session_socket=server.address)
    assert type(link.open_stream()) is SessionStream
    link._down("test over")  # closes every stream it opened
    assert local.ended and remote.ended
    channel.close()
