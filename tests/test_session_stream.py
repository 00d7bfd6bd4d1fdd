"""speculation/channel.py:SessionStream over a real loopback gRPC stream: each reply reaches the Future of its
request, in order, on the reader thread; a wait past its timeout closes the stream and fails every request still
out, and every later one at once."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from dspark_grpc.protos.dspark.v1 import draft_pb2, draft_pb2_grpc
from dspark_grpc.speculation.channel import SessionStream, make_channel
from dspark_grpc.speculation.generation import RequestError

HOLD = 1_000_000  # a request id the server does not answer until told


class Echo(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self) -> None:
        self.release = threading.Event()

    def DraftSession(self, request_iterator, context):
        for request in request_iterator:
            if request.request_id >= HOLD:
                self.release.wait(60)
            yield draft_pb2.DraftSessionResponse(request_id=request.request_id)


@pytest.fixture()
def echo():
    servicer, server = Echo(), grpc.server(futures.ThreadPoolExecutor(4))
    draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = make_channel(f"127.0.0.1:{port}")
    yield servicer, draft_pb2_grpc.DraftServiceStub(channel)
    servicer.release.set()
    channel.close()
    server.stop(0)


def request(request_id: int) -> draft_pb2.DraftSessionRequest:
    return draft_pb2.DraftSessionRequest(request_id=request_id)


def test_each_reply_completes_its_own_request_on_the_reader_thread(echo):
    _, stub = echo
    stream = SessionStream(stub.DraftSession, timeout=60)
    threads: list[str] = []
    sent = [stream.send(request(i)) for i in range(1, 21)]
    sent[-1].add_done_callback(lambda _: threads.append(threading.current_thread().name))
    assert [stream.result(f, 60).request_id for f in sent] == list(range(1, 21))
    assert stream.call(request(21), 60).request_id == 21
    assert threads in (["session-stream-reader"], [threading.current_thread().name])  # (done before the callback)
    stream.close()
    assert stream.ended


def test_a_wait_past_its_timeout_fails_every_request_out_and_every_later_one(echo):
    servicer, stub = echo
    stream = SessionStream(stub.DraftSession, timeout=60)
    held, behind = stream.send(request(HOLD)), stream.send(request(2))
    with pytest.raises(RequestError) as late:
        stream.result(held, timeout=0.2)  # the server holds it until released: the wait must end by the timeout
    assert late.value.code == 4 and "no reply within 0.2 s" in late.value.message
    with pytest.raises(RequestError) as also:
        behind.result(0)
    assert also.value.code == 4 and stream.ended
    with pytest.raises(RequestError):
        stream.send(request(3)).result(0)  # failed at once
    servicer.release.set()
