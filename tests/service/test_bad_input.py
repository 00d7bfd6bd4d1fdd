"""Bad input gets a clear status, and the service stays SERVING and keeps the other sessions."""

from __future__ import annotations

import grpc
import pytest
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2, target_pb2_grpc

from tests.service.conftest import MAX_MESSAGE_BYTES, MAX_SESSIONS, RawSession, assert_serving, wait_live_sessions

INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, FAILED_PRECONDITION = 3, 5, 8, 9
VOCAB = 49152


def tokens_prompt(ids):
    return common_pb2.Prompt(tokens=common_pb2.TokenIds(ids=ids))


def prefilled_session(raw: RawSession) -> tuple[str, int]:
    sid = raw.ok(open=target_pb2.OpenSession()).session_id
    pre = raw.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=tokens_prompt([504, 3575, 282, 4649, 314])))
    return sid, pre.next_token


def tree(tokens, parents, **tensors):
    return common_pb2.TokenTree(tokens=tokens, parents=parents, **tensors)


def expect(raw: RawSession, code: int, words: str, **op) -> str:
    response = raw.call(**op)
    assert response.status.code == code, (response.status.code, response.status.message)
    assert response.WhichOneof("result") is None
    assert words in response.status.message, response.status.message
    return response.status.message


def test_unknown_session(raw, target_address):
    expect(raw, NOT_FOUND, "unknown session", prefill=target_pb2.Prefill(session_id="nope", prompt=tokens_prompt([1])))
    expect(raw, NOT_FOUND, "unknown session", verify=target_pb2.Verify(session_id="nope", tree=tree([1], [-1])))
    expect(raw, NOT_FOUND, "unknown session", release=target_pb2.Release(session_id="nope"))
    assert_serving(target_address)


def test_token_ids_out_of_vocab(raw, target_address):
    sid = raw.ok(open=target_pb2.OpenSession()).session_id
    expect(raw, INVALID_ARGUMENT, str(VOCAB),
           prefill=target_pb2.Prefill(session_id=sid, prompt=tokens_prompt([5, VOCAB])))
    sid, pending = prefilled_session(raw)
    for bad in (VOCAB + 7, -3):
        bad_tree = target_pb2.Verify(session_id=sid, tree=tree([pending, bad], [-1, 0]))
        expect(raw, INVALID_ARGUMENT, "vocab", verify=bad_tree)
    # the session survived the bad requests and still decodes
    assert raw.ok(verify=target_pb2.Verify(session_id=sid, tree=tree([pending], [-1]), commit=True)).committed
    assert_serving(target_address)


@pytest.mark.parametrize("tokens,parents,words", [
    ([], [], "empty"),
    (None, [-1, 0, 5], "parent"),            # parent out of range
    (None, [-1, 2, 0], "topological"),       # parent after child
    (None, [-1, 0, 1, 1, 1], "one parent per token"),  # lengths differ
    (None, [0, 0, 1], "root"),               # root with a parent
])
def test_bad_trees(raw, target_address, tokens, parents, words):
    sid, pending = prefilled_session(raw)
    if tokens is None:
        tokens = [pending] + [100 + i for i in range(min(len(parents), 4) - 1)]
    message = expect(raw, INVALID_ARGUMENT, "", verify=target_pb2.Verify(session_id=sid, tree=tree(tokens, parents)))
    assert words in message.lower(), message
    assert raw.ok(verify=target_pb2.Verify(session_id=sid, tree=tree([pending], [-1]), commit=True)).committed
    assert_serving(target_address)


def test_tree_root_must_be_pending_token(raw):
    sid, pending = prefilled_session(raw)
    wrong_root = target_pb2.Verify(session_id=sid, tree=tree([pending + 1], [-1]))
    expect(raw, INVALID_ARGUMENT, "pending token", verify=wrong_root)


def test_tensor_byte_length_mismatch(raw, target_address):
    sid, pending = prefilled_session(raw)
    bad = common_pb2.Tensor(dtype=common_pb2.D_TYPE_FLOAT32, shape=[2], data=b"\0" * 7)
    expect(raw, INVALID_ARGUMENT, "7 bytes but shape [2]",
           verify=target_pb2.Verify(session_id=sid, tree=tree([pending, 5], [-1, 0], child_logprobs=bad)))
    wrong_rows = common_pb2.Tensor(dtype=common_pb2.D_TYPE_FLOAT32, shape=[3, 1], data=b"\0" * 12)
    expect(raw, INVALID_ARGUMENT, "number of nodes",
           verify=target_pb2.Verify(session_id=sid, tree=tree([pending, 5], [-1, 0], child_logprobs=wrong_rows)))
    assert_serving(target_address)


def test_too_many_live_sessions(raw, target_address):
    """One client holds all it may (all but the reserve), a second one gets the reserved session, a third finds the
    service full."""
    wait_live_sessions(target_address, 0)
    opened, refused = [], None
    for _ in range(MAX_SESSIONS + 1):
        response = raw.call(open=target_pb2.OpenSession())
        if response.status.code:
            refused = response.status
            break
        opened.append(response.opened.session_id)
    assert refused is not None and refused.code == RESOURCE_EXHAUSTED, refused
    assert f"--max-sessions-per-principal {MAX_SESSIONS - 1}" in refused.message
    assert len(opened) == MAX_SESSIONS - 1
    newcomer, third = (RawSession(target_address, own_connection=True) for _ in range(2))  # other principals
    try:
        assert newcomer.call(open=target_pb2.OpenSession()).status.code == 0
        full = third.call(open=target_pb2.OpenSession()).status
        assert full.code == RESOURCE_EXHAUSTED and "too many live sessions" in full.message, full
    finally:
        newcomer.close()
        third.close()
    raw.ok(release=target_pb2.Release(session_id=opened[0]))
    raw.ok(open=target_pb2.OpenSession())  # a released slot can be reused
    assert_serving(target_address)


def test_sessions_are_freed_when_the_stream_ends(target_address):
    for _ in range(3 * MAX_SESSIONS):  # would run out of sessions if closing a stream leaked them
        s = RawSession(target_address)
        for _ in range(2):
            s.call(open=target_pb2.OpenSession())
        s.close()
    wait_live_sessions(target_address, 0)  # the server frees a closed stream's sessions asynchronously
    s = RawSession(target_address)
    assert s.call(open=target_pb2.OpenSession()).status.code == 0
    s.close()


def test_oversized_message(target_address):
    with grpc.insecure_channel(target_address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        request = target_pb2.GenerateRequest(prompt=common_pb2.Prompt(text="x" * (MAX_MESSAGE_BYTES + 1024)))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=60))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in e.value.details()
    assert_serving(target_address)


def test_deadline_exceeded(target_address):
    with grpc.insecure_channel(target_address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        request = target_pb2.GenerateRequest(prompt=common_pb2.Prompt(text="Once upon a time"),
                                             max_new_tokens=2000, ignore_eos=True)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=1.0))
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_serving(target_address)
    # the aborted request's session was released: the target counts none live, and a new one opens
    wait_live_sessions(target_address, 0)
    s = RawSession(target_address)
    s.ok(open=target_pb2.OpenSession())
    s.close()


def test_bad_generate_requests(target_address):
    with grpc.insecure_channel(target_address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        cases = [
            (target_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "prompt is missing"),
            (target_pb2.GenerateRequest(prompt=common_pb2.Prompt(text="hi"),
                                        sampling=common_pb2.SamplingParams(temperature=-1)),
             grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
            (target_pb2.GenerateRequest(prompt=common_pb2.Prompt(text="hi"), mode=common_pb2.DECODE_MODE_SPECULATION),
             grpc.StatusCode.FAILED_PRECONDITION, "drafter"),
        ]
        for request, code, words in cases:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request, timeout=60))
            assert e.value.code() == code and words in e.value.details(), e.value.details()
    assert_serving(target_address)


def test_handshake_refuses_foreign_drafter_and_bad_layers(raw, target_address):
    foreign = common_pb2.Fingerprint(model="0" * 64, tokenizer="1" * 64)
    expect(raw, FAILED_PRECONDITION, "drafter", open=target_pb2.OpenSession(drafter_target=foreign))
    expect(raw, FAILED_PRECONDITION, "protocol version", open=target_pb2.OpenSession(protocol_version=7))
    expect(raw, INVALID_ARGUMENT, "out of range", open=target_pb2.OpenSession(capture_layer_ids=[3, 30]))
    expect(raw, INVALID_ARGUMENT, "out of range", open=target_pb2.OpenSession(capture_layer_ids=[-1]))
    # the real fingerprint is accepted
    info = target_pb2_grpc.TargetServiceStub(raw.channel).GetModelInfo(target_pb2.GetModelInfoRequest())
    raw.ok(open=target_pb2.OpenSession(drafter_target=info.fingerprint, capture_layer_ids=[1, 15, 27]))
    assert_serving(target_address)


def test_operations_out_of_order(raw):
    sid = raw.ok(open=target_pb2.OpenSession()).session_id
    expect(raw, FAILED_PRECONDITION, "prefill", verify=target_pb2.Verify(session_id=sid, tree=tree([1], [-1])))
    expect(raw, INVALID_ARGUMENT, "empty request")
    sid, pending = prefilled_session(raw)
    expect(raw, FAILED_PRECONDITION, "already prefilled",
           prefill=target_pb2.Prefill(session_id=sid, prompt=tokens_prompt([1, 2])))
    expect(raw, FAILED_PRECONDITION, "Verify a tree first",
           commit=target_pb2.Commit(session_id=sid, path=[0], next_token=5))
    raw.ok(verify=target_pb2.Verify(session_id=sid, tree=tree([pending, 7, 8], [-1, 0, 0])))
    off_path = target_pb2.Commit(session_id=sid, path=[1], next_token=5)
    expect(raw, INVALID_ARGUMENT, "root-to-node path", commit=off_path)
    expect(raw, INVALID_ARGUMENT, "rollback length", rollback=target_pb2.Rollback(session_id=sid, length=99))


def test_commit_refuses_paths_that_are_not_root_paths(raw):
    """The engine checks a commit's path (runtime/decode.commit_path only asserts it); a refused path leaves the
    verified tree as it was."""
    sid, pending = prefilled_session(raw)
    raw.ok(verify=target_pb2.Verify(session_id=sid, tree=tree([pending, 7, 8, 9, 10], [-1, 0, 0, 1, 2])))
    for bad in ([], [1], [0, 2, 3], [0, 1, 4], [0, 0], [0, 7], [0, -1]):
        expect(raw, INVALID_ARGUMENT, "root-to-node path", commit=target_pb2.Commit(session_id=sid, path=bad,
                                                                                   next_token=5))
    expect(raw, INVALID_ARGUMENT, str(VOCAB), commit=target_pb2.Commit(session_id=sid, path=[0, 2, 4],
                                                                        next_token=VOCAB))
    assert raw.ok(commit=target_pb2.Commit(session_id=sid, path=[0, 2, 4], next_token=5)).length == 5 + 3
    expect(raw, FAILED_PRECONDITION, "Verify a tree first", commit=target_pb2.Commit(session_id=sid, path=[0],
                                                                                     next_token=5))
