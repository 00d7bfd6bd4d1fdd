"""Hostile input gets a clear status before any expensive work: huge prompts and stop strings, unknown enum values,
bad numbers and tensors, captures over the message limit, undecodable bytes; sessions belong to their stream and
one principal cannot take them all. Figures (time, RSS growth) are printed for docs/RELIABILITY.md, not asserted."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import grpc
import pytest
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

from tests.reliability.conftest import HANG_S, Ops, Service, rss_mb, service, target_info, wait_until

PER_PRINCIPAL = 3
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def ngram_drafter() -> Iterator[Service]:
    with service("draft", ["--drafter", "none", "--max-sessions", "8"]) as s:
        yield s


@pytest.fixture(scope="module")
def target(ngram_drafter: Service) -> Iterator[Service]:
    with service("target", ["--drafter", ngram_drafter.address, "--max-sessions", "8",
                            "--max-sessions-per-principal", str(PER_PRINCIPAL)]) as s:
        yield s


@pytest.fixture()
def channel(target: Service) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(target.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        yield ch


def target_ops(channel: grpc.Channel, metadata: tuple = ()) -> Ops:
    return Ops(target_pb2_grpc.TargetServiceStub(channel).TargetSession, target_pb2.TargetSessionRequest,
               metadata=metadata)


def generate_error(channel: grpc.Channel, **fields) -> grpc.RpcError:
    request = target_pb2.GenerateRequest(**{"prompt": common_pb2.Prompt(text="Hi"), "max_new_tokens": 2, **fields})
    with pytest.raises(grpc.RpcError) as e:
        list(target_pb2_grpc.TargetServiceStub(channel).Generate(request, timeout=HANG_S))
    return e.value


def refused_quickly(target: Service, call) -> tuple[grpc.RpcError | common_pb2.Status, float, float]:
    """(the error, seconds, target RSS growth in MiB)."""
    rss0, t0 = rss_mb(target.pid), time.perf_counter()
    error = call()
    return error, time.perf_counter() - t0, rss_mb(target.pid) - rss0


def test_a_32_mib_text_prompt_is_refused_before_tokenizing(target: Service, channel: grpc.Channel):
    prompt = "lorem ipsum " * (32 * 2**20 // 12)
    for attempt in ("fresh channel", "again"):  # a fresh channel's flow-control window grows during the first one
        error, seconds, growth = refused_quickly(target, lambda: generate_error(channel, prompt=common_pb2.Prompt(
            text=prompt)))
        assert error.code() == INVALID and "characters" in error.details(), error.details()
        print(f"\n32 MiB text prompt, Generate ({attempt}): {error.code().name} in {seconds:.2f} s, target RSS "
              f"{growth:+.0f} MiB")
        assert seconds < HANG_S

    ops = target_ops(channel)
    sid = ops.ok(open=target_pb2.OpenSession()).session_id
    response, seconds, growth = refused_quickly(target, lambda: ops(prefill=target_pb2.Prefill(
        session_id=sid, prompt=common_pb2.Prompt(text=prompt))))
    assert response.status.code == INVALID.value[0], response.status.message
    print(f"32 MiB text prompt, TargetSession prefill: INVALID_ARGUMENT in {seconds:.2f} s, RSS {growth:+.0f} MiB")
    chat = common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="user",
                                                                                          content=prompt)]))
    assert ops(prefill=target_pb2.Prefill(session_id=sid, prompt=chat)).status.code == INVALID.value[0]
    ops.close()


def test_a_million_character_stop_string_is_refused(target: Service, channel: grpc.Channel):
    error, seconds, growth = refused_quickly(target, lambda: generate_error(channel, stop=["x" * 1_000_000]))
    assert error.code() == INVALID and "stop string" in error.details()
    print(f"\n1 M-character stop string: {error.code().name} in {seconds:.2f} s, target RSS {growth:+.0f} MiB")
    assert generate_error(channel, stop=["."] * 1000).code() == INVALID  # too many of them


@pytest.mark.parametrize("fields, what", [
    (dict(mode=99), "mode"),
    (dict(proposal=99), "proposal"),
    (dict(proposer=99), "proposer"),
    (dict(kernel=99), "kernel"),
    (dict(budget=-1), "budget"),
    (dict(sampling=common_pb2.SamplingParams(temperature=1e-30)), "temperature"),
    (dict(sampling=common_pb2.SamplingParams(temperature=math.nan)), "temperature"),
    (dict(sampling=common_pb2.SamplingParams(temperature=math.inf)), "temperature"),
    (dict(sampling=common_pb2.SamplingParams(temperature=1.0, top_p=math.nan)), "top_p"),
    (dict(prompt=common_pb2.Prompt(tokens=common_pb2.TokenIds(ids=[1] * 100_000))), "tokens"),
])
def test_generate_refuses_unknown_enums_and_bad_numbers(channel: grpc.Channel, fields: dict, what: str):
    error = generate_error(channel, **fields)
    assert error.code() == INVALID and what in error.details(), error.details()


@pytest.mark.parametrize("options, what", [
    (dict(mode=99), "step_options.mode"),
    (dict(proposal=99), "step_options.proposal"),
    (dict(kernel=99), "step_options.kernel"),
    (dict(proposer=99), "step_options.proposer"),
    (dict(budget=-1), "step_options.budget"),
])
def test_open_refuses_unknown_step_options(channel: grpc.Channel, options: dict, what: str):
    ops = target_ops(channel)
    response = ops(open=target_pb2.OpenSession(step_options=target_pb2.StepOptions(**options)))
    assert response.status.code == INVALID.value[0] and what in response.status.message, response.status.message
    ops.close()


def test_draft_session_refuses_bad_values(target: Service, ngram_drafter: Service):
    fp = target_info(target.address).fingerprint
    with grpc.insecure_channel(ngram_drafter.address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        ops = Ops(draft_pb2_grpc.DraftServiceStub(ch).DraftSession, draft_pb2.DraftSessionRequest)
        sid = ops.ok(open=draft_pb2.OpenDraft(target=fp)).session_id
        # the context's limit (the prompt-lookup drafter: 65536 rows) is checked before anything is stored
        response = ops(append=draft_pb2.AppendContext(session_id=sid, start_position=0, tokens=[1] * 65537))
        assert response.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], response.status.message
        assert ops.ok(append=draft_pb2.AppendContext(session_id=sid, start_position=0, tokens=[1, 2, 1, 2])).length == 4
        for bad in (dict(kernel=99), dict(kind=99), dict(proposer=99), dict(budget=-1),
                    dict(sampling=common_pb2.SamplingParams(temperature=math.nan)),
                    dict(sampling=common_pb2.SamplingParams(temperature=1e-30))):
            response = ops(propose=draft_pb2.Propose(session_id=sid, anchor_token=1, anchor_position=4, **bad))
            assert response.status.code == INVALID.value[0], (bad, response.status.message)
        assert ops.ok(propose=draft_pb2.Propose(session_id=sid, anchor_token=1, anchor_position=4)).tree.tokens[0] == 1
        ops.close()


def test_verify_refuses_malformed_tensors(channel: grpc.Channel):
    ops = target_ops(channel)
    sid = ops.ok(open=target_pb2.OpenSession()).session_id
    pending = ops.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(text="Hi"))).next_token
    f32, i32 = common_pb2.D_TYPE_FLOAT32, common_pb2.D_TYPE_INT32
    huge_empty = common_pb2.Tensor(dtype=f32, shape=[0, 1 << 40, 1 << 40])
    trees = [
        common_pb2.TokenTree(tokens=[pending], parents=[-1], child_logprobs=huge_empty),
        common_pb2.TokenTree(tokens=[pending], parents=[-1],  # ids without their log-probs
                             child_token_ids=common_pb2.Tensor(dtype=i32, shape=[1, 1], data=b"\0" * 4)),
        common_pb2.TokenTree(tokens=[pending], parents=[-1],  # a sampled child distribution with k = 0
                             child_token_ids=common_pb2.Tensor(dtype=i32, shape=[1, 0]),
                             child_logprobs=common_pb2.Tensor(dtype=f32, shape=[1, 0])),
        common_pb2.TokenTree(tokens=[pending], parents=[-1],
                             child_token_ids=common_pb2.Tensor(dtype=f32, shape=[1, 1], data=b"\0" * 4),
                             child_logprobs=common_pb2.Tensor(dtype=f32, shape=[1, 1], data=b"\0" * 4)),
    ]
    for tree in trees:
        response = ops(verify=target_pb2.Verify(session_id=sid, tree=tree))
        assert response.status.code == INVALID.value[0], (tree, response.status.message)
    assert list(ops.ok(verify=target_pb2.Verify(session_id=sid, tree=common_pb2.TokenTree(
        tokens=[pending], parents=[-1]), commit=True)).accepted_path) == [0]
    ops.close()


def test_a_capture_over_the_message_limit_is_refused_up_front(target: Service, channel: grpc.Channel):
    info = target_info(target.address)
    ops = target_ops(channel)
    sid = ops.ok(open=target_pb2.OpenSession(capture_layer_ids=range(info.num_layers))).session_id
    rss0, t0 = rss_mb(target.pid), time.perf_counter()
    response = ops(prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(
        tokens=common_pb2.TokenIds(ids=[1] * 4000))))
    seconds, growth = time.perf_counter() - t0, rss_mb(target.pid) - rss0
    assert response.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], response.status.message
    assert "138240000 bytes" in response.status.message and "--max-message-bytes" in response.status.message
    print(f"\n4000-token prefill capturing {info.num_layers} layers: RESOURCE_EXHAUSTED in {seconds:.2f} s, "
          f"RSS {growth:+.0f} MiB: {response.status.message}")
    # the same session still works with a prompt whose capture fits
    assert ops.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(text="Hi"))).capture.rows.data
    ops.close()


@pytest.mark.parametrize("method, streaming", [
    ("/dspark.v1.TargetService/GetModelInfo", "unary_unary"),
    ("/dspark.v1.TargetService/Generate", "unary_stream"),
    ("/dspark.v1.TargetService/TargetSession", "stream_stream"),
])
def test_undecodable_bytes_are_invalid_argument(channel: grpc.Channel, method: str, streaming: str):
    corrupt = b"\x0a\x05ab"  # a length-delimited field that claims 5 bytes and has 2
    call = getattr(channel, streaming)(method)  # no serializers: raw bytes both ways
    with pytest.raises(grpc.RpcError) as e:
        if streaming == "unary_unary":
            call(corrupt, timeout=HANG_S)
        else:
            list(call(corrupt if streaming == "unary_stream" else iter([corrupt]), timeout=HANG_S))
    assert e.value.code() == INVALID and "protobuf" in e.value.details(), e.value.details()


def test_a_session_belongs_to_the_stream_that_opened_it(channel: grpc.Channel):
    owner, other = target_ops(channel), target_ops(channel)
    sid = owner.ok(open=target_pb2.OpenSession(step_options=target_pb2.StepOptions(
        mode=common_pb2.DECODE_MODE_SPECULATION))).session_id
    for op in (dict(prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(text="Hi"))),
               dict(step=target_pb2.Step(session_id=sid)),
               dict(rollback=target_pb2.Rollback(session_id=sid, length=1)),
               dict(release=target_pb2.Release(session_id=sid))):
        response = other(**op)
        assert response.status.code == grpc.StatusCode.NOT_FOUND.value[0], (op, response.status.message)
    assert owner.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(text="Hi"))).prompt_tokens
    assert owner.ok(step=target_pb2.Step(session_id=sid)).length
    owner.ok(release=target_pb2.Release(session_id=sid))
    owner.close()
    other.close()


NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]


def _draft_round(*ops: draft_pb2.DraftSessionRequest) -> draft_pb2.DraftRound:
    for i, op in enumerate(ops):
        op.request_id = i + 1
    return draft_pb2.DraftRound(ops=ops)


def _ops_on(sid: str, position: int) -> list[draft_pb2.DraftSessionRequest]:
    """Every per-session op of a DraftRound, on `sid`."""
    return [draft_pb2.DraftSessionRequest(append=draft_pb2.AppendContext(session_id=sid, start_position=position,
                                                                         tokens=[1, 2])),
            draft_pb2.DraftSessionRequest(propose=draft_pb2.Propose(session_id=sid, anchor_token=1,
                                                                    anchor_position=position)),
            draft_pb2.DraftSessionRequest(truncate=draft_pb2.TruncateContext(session_id=sid, length=0)),
            draft_pb2.DraftSessionRequest(release=draft_pb2.ReleaseDraft(session_id=sid))]


def test_a_draft_round_reaches_only_its_own_streams_sessions(target: Service, ngram_drafter: Service,
                                                             channel: grpc.Channel):
    """Another client's draft session, and the target's own (opened on the drafter under the target session's id,
    which every client of that session knows), are NOT_FOUND to a round; a round inside a round is refused."""
    fp = target_info(target.address).fingerprint
    stepping = target_ops(channel)  # a target session that steps with the drafter
    t_sid = stepping.ok(open=target_pb2.OpenSession(step_options=target_pb2.StepOptions(
        mode=common_pb2.DECODE_MODE_SPECULATION, proposer=draft_pb2.PROPOSER_NGRAM))).session_id
    prompt = common_pb2.Prompt(text="1, 2, 3, 1, 2, 3, 1, 2, 3,")
    length = len(stepping.ok(prefill=target_pb2.Prefill(session_id=t_sid, prompt=prompt)).prompt_tokens)
    length = stepping.ok(step=target_pb2.Step(session_id=t_sid)).length  # the target's draft session is open now
    with grpc.insecure_channel(ngram_drafter.address) as ch:
        stub = draft_pb2_grpc.DraftServiceStub(ch)
        theirs, mine = (Ops(stub.DraftSession, draft_pb2.DraftSessionRequest) for _ in range(2))
        d_sid = theirs.ok(open=draft_pb2.OpenDraft(target=fp)).session_id
        assert theirs.ok(append=draft_pb2.AppendContext(session_id=d_sid, tokens=[1, 2, 1, 2])).length == 4
        own = mine.ok(open=draft_pb2.OpenDraft(target=fp)).session_id
        for sid, position in ((d_sid, 4), (t_sid, length)):
            result = mine.ok(round=_draft_round(*_ops_on(sid, position),
                                                draft_pb2.DraftSessionRequest(append=draft_pb2.AppendContext(
                                                    session_id=own, tokens=[5, 6, 5]))))
            assert [r.status.code for r in result.results] == [NOT_FOUND] * 4 + [0], list(result.results)
            assert [r.request_id for r in result.results] == [1, 2, 3, 4, 5]
        nested = mine(round=_draft_round(draft_pb2.DraftSessionRequest(round=_draft_round(*_ops_on(own, 3)))))
        assert nested.status.code == INVALID.value[0] and "round" in nested.status.message, nested.status.message
        # all of it left the others' sessions as they were
        proposal = theirs.ok(propose=draft_pb2.Propose(session_id=d_sid, anchor_token=1, anchor_position=4))
        assert list(proposal.tree.tokens[:2]) == [1, 2]  # prompt lookup: ... 1, 2, 1, 2 | 1 -> 2
        mine.close()
        theirs.close()
    step = stepping.ok(step=target_pb2.Step(session_id=t_sid))
    assert step.report.fallback_reason == "" and step.length > length, step.report
    stepping.close()


def test_one_principal_cannot_take_every_session(target: Service, channel: grpc.Channel):
    wait_until(lambda: target_info(target.address).live_sessions == 0, HANG_S,
               "the earlier tests' streams released their sessions")
    mine = target_ops(channel)
    for _ in range(PER_PRINCIPAL):
        mine.ok(open=target_pb2.OpenSession())
    response = mine(open=target_pb2.OpenSession())
    assert response.status.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    assert "--max-sessions-per-principal" in response.status.message
    # another principal (here: another bearer token; the service checks none) still gets sessions
    theirs = target_ops(channel, metadata=(("authorization", "Bearer someone-else"),))
    theirs.ok(open=target_pb2.OpenSession())
    mine.close()
    theirs.close()
    wait_until(lambda: target_info(target.address).live_sessions == 0, HANG_S,
               "a stream's sessions released when the server sees it end")


def test_a_prefill_stops_between_chunks_once_its_session_is_released(smollm2_path):
    """A stream that ends (cancelled, deadline) releases its sessions; a long prefill under way runs no further
    chunk (the engine's prefill runs PREFILL_CHUNK_ROWS rows per forward). Forced: the first chunk's forward
    releases the session."""
    from dspark_grpc.speculation.errors import NotFound
    from dspark_grpc.target_service.engine import PREFILL_CHUNK_ROWS, EngineLimits, TargetEngine

    engine = TargetEngine.load(smollm2_path, limits=EngineLimits(max_length=2048), progress=False)
    try:
        sid = engine.open_session()
        forwards = []
        run = engine._forward_in_slices

        def forward_then_release(inp, *args, **kwargs):
            forwards.append(inp.tokens.shape[0])
            out = run(inp, *args, **kwargs)
            engine.release(sid)
            return out

        engine._forward_in_slices = forward_then_release
        with pytest.raises(NotFound):
            engine.prefill(sid, [1] * 1500)  # twelve chunks
        assert forwards == [PREFILL_CHUNK_ROWS]
    finally:
        engine.close()
