"""The target's rounds with its drafter, without gRPC: a fake link stream records the DraftRound messages; the
rounds' worker is held by an explicit gate while jobs queue, so what forms a round does not depend on timing."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, target_pb2
from dspark_grpc.serving.tensor_codec import from_proto, to_proto
from dspark_grpc.speculation.generation import RequestError
from dspark_grpc.speculation.mode_chooser import ModeChooser
from dspark_grpc.target_service.draft_rounds import DraftRounds, RoundJob
from dspark_grpc.target_service.steps import SessionDrafting

HANG_S = 60.0  # a wait for another thread, or a draft timeout no round here should reach: only a hang reaches it
NEXT_ROUND_S = 600.0  # how long a round may wait for the sessions of the last one: far past HANG_S


def one_token(propose: draft_pb2.Propose) -> draft_pb2.Proposal:
    return draft_pb2.Proposal(tree=common_pb2.TokenTree(tokens=[propose.anchor_token, 7], parents=[-1, 0]))


class FakeStream:
    """Answers a DraftRound op by op: opens, appends, and `proposal(op)` per propose (one token by default)."""

    def __init__(self, fail: bool = False,
                 proposal: Callable[[draft_pb2.Propose], draft_pb2.Proposal] = one_token) -> None:
        self.rounds: list[draft_pb2.DraftRound] = []
        self.ended, self.fail, self.proposal = False, fail, proposal
        self.waiting: list[Future] = []
        self.gate: threading.Event | None = None  # `hold`
        self.arrived = threading.Event()  # a call came in

    def hold(self) -> threading.Event:
        """From now on each call waits for the returned gate before it answers (`arrived` says one came in)."""
        self.gate = threading.Event()
        return self.gate

    def call(self, request: draft_pb2.DraftSessionRequest, timeout: float | None = None):
        self.arrived.set()
        if self.gate is not None:
            assert self.gate.wait(60)
        if self.fail:
            raise RequestError(14, "connection reset")
        self.rounds.append(request.round)
        proposals = sum(op.WhichOneof("op") == "propose" for op in request.round.ops)
        results = []
        for op in request.round.ops:
            kind = op.WhichOneof("op")
            if kind == "propose":
                proposal = self.proposal(op.propose)
                proposal.batch_sessions = proposals
                results.append(draft_pb2.DraftSessionResponse(proposal=proposal))
            elif kind == "open":
                results.append(draft_pb2.DraftSessionResponse(opened=draft_pb2.DraftOpened(
                    session_id=op.open.session_id)))
            else:
                results.append(draft_pb2.DraftSessionResponse(released=draft_pb2.DraftReleased()))
        return draft_pb2.DraftSessionResponse(request_id=request.request_id,
                                              round=draft_pb2.DraftRoundResult(results=results))

    def send(self, request: draft_pb2.DraftSessionRequest) -> Future:
        """`call` on a thread of its own, as a real stream's reply comes back on its reader thread; `close` fails
        the replies still out."""
        reply: Future = Future()
        self.waiting.append(reply)

        def answer() -> None:
            try:
                result = self.call(request)
            except RequestError as e:
                result = e
            if not reply.done():  # (closed meanwhile)
                reply.set_exception(result) if isinstance(result, RequestError) else reply.set_result(result)

        threading.Thread(target=answer, daemon=True).start()
        return reply

    def close(self, reason: str = "the stream was closed", code: int = 1) -> None:
        self.ended = True
        for reply in self.waiting:
            if not reply.done():
                reply.set_exception(RequestError(code, reason))


class FakeLink:
    down_reason = "drafter down"

    def __init__(self) -> None:
        self.streams: list[FakeStream] = []
        self.fail_next = False

    def open_stream(self) -> FakeStream:
        self.streams.append(FakeStream(self.fail_next))
        self.fail_next = False
        return self.streams[-1]


def drafting(sid: str, generation: int = 0) -> SessionDrafting:
    options = target_pb2.StepOptions(mode=common_pb2.DECODE_MODE_SPECULATION)
    return SessionDrafting.start(sid, options, draft_pb2.GetDrafterInfoResponse(), common_pb2.Fingerprint(),
                                 ModeChooser(), generation)


def run_round(rounds: DraftRounds, sessions: list[SessionDrafting]) -> list:
    """Queue one step per session while the worker is held, then let it go: they form one round."""
    gate, held = threading.Event(), threading.Event()
    blocker = threading.Thread(target=rounds.batcher.call, args=(lambda: (held.set(), gate.wait(HANG_S)),))
    blocker.start()
    held.wait(HANG_S)
    replies: dict[str, object] = {}

    def step(s: SessionDrafting) -> None:
        replies[s.session_id] = rounds.submit(RoundJob(s, s.round_ops(anchor=5, position=3, proposer=1)))

    threads = [threading.Thread(target=step, args=(s,), name=f"step-{s.session_id}") for s in sessions]
    for t in threads:
        t.start()
    while rounds.batcher.queued() < len(sessions):
        threading.Event().wait(0.005)
    gate.set()
    for t in [blocker, *threads]:
        t.join(HANG_S)
    return [replies[s.session_id] for s in sessions]


def test_steps_queued_together_are_one_round_and_verify_together():
    link, heard, planned = FakeLink(), [], []
    rounds = DraftRounds(link, timeout_s=HANG_S, on_round=heard.append,
                         plan=lambda jobs, replies: planned.append(len(jobs)))
    sessions = [drafting(f"s{i}") for i in range(4)]
    replies = run_round(rounds, sessions)
    (stream,) = link.streams
    assert len(stream.rounds) == 1  # one message for the four
    kinds = [op.WhichOneof("op") for op in stream.rounds[0].ops]
    assert kinds.count("open") == 4 and kinds.count("propose") == 4
    assert all(r.replies[-1].proposal.batch_sessions == 4 and r.error == "" for r in replies)
    # the target's batcher is told to expect all four verifies
    assert [sorted(ids) for ids in heard] == [["s0", "s1", "s2", "s3"]] and planned == [4]
    rounds.close()


def test_a_stream_that_ended_between_rounds_is_replaced_and_its_sessions_stop_drafting():
    link = FakeLink()
    rounds = DraftRounds(link, timeout_s=HANG_S)
    old = drafting("old")
    run_round(rounds, [old])
    link.streams[0].ended = True  # the drafter went away between rounds
    new = drafting("new")
    lost, fresh = run_round(rounds, [old, new])
    assert len(link.streams) == 2 and rounds.generation == 2
    assert lost.replies is None and "lost" in lost.error  # its draft session died with the old stream
    assert fresh.replies is not None and new.stream_generation == 2
    rounds.close()


def test_a_failed_round_fails_its_sessions_and_the_next_round_opens_a_new_stream():
    link = FakeLink()
    link.fail_next = True
    rounds = DraftRounds(link, timeout_s=HANG_S)
    (failed,) = run_round(rounds, [drafting("a")])
    assert failed.replies is None and "UNAVAILABLE" in failed.error
    (ok,) = run_round(rounds, [drafting("b")])
    assert ok.replies is not None and len(link.streams) == 2
    rounds.close()


def test_the_rows_of_consecutive_steps_reach_the_drafter_as_one_append():
    """After a stretch of AR steps the drafter projects the rows they committed in one pass: one append per run of
    contiguous rows, whose capture is the steps' captures stacked (compared through torch, not the wire helper)."""
    s = drafting("a")
    steps = [(0, [4, 5, 6]), (3, [7]), (4, [8, 9])]
    parts = [torch.randn(len(tokens), 2, 8).to(torch.bfloat16) for _, tokens in steps]
    for (start, tokens), rows in zip(steps, parts, strict=True):
        s.append(start, tokens, common_pb2.HiddenCapture(layer_ids=[1, 3], start_position=start, rows=to_proto(rows)))
    s.rollback(5)
    s.append(5, [10], common_pb2.HiddenCapture(layer_ids=[1, 3], start_position=5, rows=to_proto(parts[1])))
    ops = s.round_ops(anchor=11, position=6, proposer=1)
    assert [op.WhichOneof("op") for op in ops] == ["open", "append", "truncate", "append", "propose"]
    joined = ops[1].append
    assert (joined.start_position, list(joined.tokens)) == (0, [4, 5, 6, 7, 8, 9])
    assert list(joined.capture.layer_ids) == [1, 3] and joined.capture.start_position == 0
    assert torch.equal(from_proto(joined.capture.rows, "rows"), torch.cat(parts))
    assert (ops[3].append.start_position, list(ops[3].append.tokens)) == (5, [10])


def test_a_release_waits_for_the_round_drafted_ahead_for_its_session():
    """A request that ends (EOS) right after its last step was drafted ahead: the release goes to the drafter after
    that round, never before it (the drafter would refuse the round's ops for a session it no longer has)."""
    from concurrent.futures import Future, ThreadPoolExecutor

    link = FakeLink()
    rounds = DraftRounds(link, HANG_S)
    s = drafting("a")
    run_round(rounds, [s])  # the session's first round opens it
    gate, held = threading.Event(), threading.Event()
    blocker = threading.Thread(target=rounds.batcher.call, args=(lambda: (held.set(), gate.wait(HANG_S)),))
    blocker.start()
    held.wait(HANG_S)
    ahead_submitted: Future = Future()  # the servicer's draft-ahead future, before its job reached the rounds
    rounds.release(s, s.finish(), after=ahead_submitted)
    with ThreadPoolExecutor(1) as pool:
        ahead = pool.submit(rounds.submit, RoundJob(s, s.round_ops(anchor=5, position=4, proposer=1), False))
        while rounds.batcher.queued() < 1:
            threading.Event().wait(0.005)
        gate.set()
        ahead_submitted.set_result(ahead.result(HANG_S))
    blocker.join(HANG_S)
    stream = link.streams[-1]
    _wait_rounds(stream, 3)  # the release's round
    kinds = [[op.WhichOneof("op") for op in r.ops] for r in stream.rounds]
    assert kinds == [["open", "propose"], ["propose"], ["release"]]
    rounds.close()


def _wait_rounds(stream: FakeStream, n: int) -> None:
    deadline = time.monotonic() + HANG_S
    while len(stream.rounds) < n:
        assert time.monotonic() < deadline, f"{len(stream.rounds)} rounds reached the drafter, not {n}"
        threading.Event().wait(0.005)


def _proposing(round_msg: draft_pb2.DraftRound) -> list[str]:
    return sorted(op.propose.session_id for op in round_msg.ops if op.WhichOneof("op") == "propose")


def test_the_next_round_waits_for_the_sessions_of_the_last_one():
    """b asks for its next proposal while a is still verifying: the round waits for a (a bound far beyond the test),
    so the two keep drafting in one pass and verifying in one forward instead of splitting into alternating groups."""
    link = FakeLink()
    rounds = DraftRounds(link, timeout_s=HANG_S, next_round_s=NEXT_ROUND_S)
    a, b = drafting("a"), drafting("b")
    run_round(rounds, [a, b])
    replies: dict[str, object] = {}
    first = threading.Thread(target=lambda: replies.update(
        b=rounds.submit(RoundJob(b, b.round_ops(anchor=6, position=4, proposer=1), False))))
    first.start()
    first.join(0.5)  # (a round that did not wait would have run by now; one that waits is still waiting)
    replies["a"] = rounds.submit(RoundJob(a, a.round_ops(anchor=6, position=4, proposer=1), False))
    first.join(HANG_S)
    stream = link.streams[-1]
    assert [_proposing(r) for r in stream.rounds] == [["a", "b"], ["a", "b"]]
    assert all(r.replies[-1].proposal.batch_sessions == 2 for r in replies.values())
    rounds.close()


def test_a_session_that_will_not_draft_next_is_not_waited_for():
    """a steps AR next (or drafts from its chain, or ends): it says so, and b's round runs without it."""
    link = FakeLink()
    rounds = DraftRounds(link, timeout_s=HANG_S, next_round_s=NEXT_ROUND_S)
    a, b = drafting("a"), drafting("b")
    run_round(rounds, [a, b])
    rounds.unexpect("a")
    done = threading.Thread(target=rounds.submit, args=(RoundJob(b, b.round_ops(anchor=6, position=4, proposer=1)),))
    done.start()
    done.join(HANG_S)  # without the unexpect it would wait NEXT_ROUND_S
    assert not done.is_alive()
    assert [_proposing(r) for r in link.streams[-1].rounds] == [["a", "b"], ["b"]]
    rounds.close()


def test_a_session_whose_client_has_not_sent_its_next_step_is_not_waited_for():
    """Drafted ahead for a session stepped by its client (a session stream): its next Step waits for that client,
    so the next round does not wait for it; it does for a session whose step is under way."""
    link = FakeLink()
    rounds = DraftRounds(link, timeout_s=HANG_S, next_round_s=NEXT_ROUND_S)
    idle, busy = drafting("idle"), drafting("busy")
    run_round(rounds, [idle, busy])
    rounds.unexpect("idle")
    rounds.unexpect("busy")
    busy.in_step = True  # (idle.in_step stays False: between its client's steps)
    ahead = [rounds.submit_ahead(RoundJob(s, s.round_ops(anchor=6, position=4, proposer=1), False))
             for s in (idle, busy)]
    assert all(rounds.result(f).replies is not None for f in ahead)  # as the steps take them: planned
    other = drafting("other")
    done = threading.Thread(target=rounds.submit,
                            args=(RoundJob(other, other.round_ops(anchor=6, position=4, proposer=1)),))
    done.start()
    done.join(0.5)
    assert done.is_alive()  # waits for busy (up to NEXT_ROUND_S), not for idle
    rounds.submit(RoundJob(busy, busy.round_ops(anchor=7, position=5, proposer=1), False))
    done.join(HANG_S)
    assert not done.is_alive()
    assert [_proposing(r) for r in link.streams[-1].rounds][-1] == ["busy", "other"]
    rounds.close()


def test_a_step_that_needs_no_round_waits_for_the_round_under_way():
    """A session verifying the rest of its last chain asks the drafter nothing; while other sessions' round is at
    the drafter it waits for that round (then verifies in their forward), and without one it does not wait."""
    link = FakeLink()
    rounds = DraftRounds(link, timeout_s=HANG_S, next_round_s=0.0)
    a = drafting("a")
    run_round(rounds, [a])
    assert rounds.wait_for_round(0.0)  # none under way
    stream = link.streams[-1]
    release = stream.hold()
    ahead = rounds.submit_ahead(RoundJob(a, a.round_ops(anchor=6, position=4, proposer=1), False))
    assert stream.arrived.wait(HANG_S)
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(rounds.wait_for_round(NEXT_ROUND_S)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and not ahead.done()
    release.set()
    waiter.join(HANG_S)
    assert waited == [True] and ahead.result(HANG_S).replies is not None
    rounds.close()


def test_the_target_expects_the_verifies_of_the_sessions_whose_steps_wait_for_the_round():
    """A round drafted ahead: its sessions whose steps are under way verify as soon as it answers, so the target's
    forward is told to wait for them (one forward for the round); one whose client has not sent its next Step yet is
    not waited for."""
    link, heard = FakeLink(), []
    rounds = DraftRounds(link, timeout_s=HANG_S, on_round=heard.append, next_round_s=0.0)
    waiting, idle = drafting("waiting"), drafting("idle")
    run_round(rounds, [waiting, idle])
    waiting.in_step = True
    gate, held = threading.Event(), threading.Event()
    blocker = threading.Thread(target=rounds.batcher.call, args=(lambda: (held.set(), gate.wait(HANG_S)),))
    blocker.start()
    held.wait(HANG_S)
    ahead = [rounds.submit_ahead(RoundJob(s, s.round_ops(anchor=6, position=4, proposer=1), False))
             for s in (waiting, idle)]
    gate.set()
    assert all(rounds.result(f).replies is not None for f in ahead)  # as the steps take them: planned
    blocker.join(HANG_S)
    assert [_proposing(r) for r in link.streams[-1].rounds][-1] == ["idle", "waiting"]
    assert sorted(heard[-1]) == ["waiting"]
    rounds.close()


def test_a_lone_sessions_round_is_sent_by_the_asking_thread_and_completed_by_the_reply():
    """No round under way or forming: the asking thread sends the round itself (no batcher worker to wake) and the
    reply completes it where it is read; while it is out, another session's step waits for the next round, which
    the worker sends after it."""
    link = FakeLink()
    rounds = DraftRounds(link, timeout_s=HANG_S, next_round_s=0.0)
    a, b = drafting("a"), drafting("b")
    run_round(rounds, [a])
    stream, senders = link.streams[-1], []
    send, release = stream.send, stream.hold()

    def recorded_send(request):
        senders.append(threading.current_thread().name)
        return send(request)

    stream.send = recorded_send
    ahead = rounds.submit_ahead(RoundJob(a, a.round_ops(anchor=6, position=4, proposer=1), False))
    assert senders == [threading.current_thread().name] and stream.arrived.wait(HANG_S)
    other = rounds.batcher.submit_future(RoundJob(b, b.round_ops(anchor=6, position=4, proposer=1)))
    assert not other.done() and rounds.batcher.queued() == 1  # the worker does not send while a's round is out
    release.set()
    assert rounds.result(ahead).replies is not None and other.result(HANG_S).replies is not None
    assert senders[1] == "draft-rounds"  # b's round, after a's, from the worker
    assert [_proposing(r) for r in stream.rounds][-2:] == [["a"], ["b"]]
    rounds.close()


def test_a_round_sent_by_the_asking_thread_is_bounded_by_the_draft_timeout():
    """No worker waits on a round its step's thread sent: `result` applies the draft timeout, and a drafter that
    never answers closes the stream and fails the round (the step then goes AR), leaving the rounds usable."""
    link = FakeLink()
    rounds = DraftRounds(link, timeout_s=0.2, next_round_s=0.0)
    a = drafting("a")
    run_round(rounds, [a])
    stream = link.streams[-1]
    never = stream.hold()
    ahead = rounds.submit_ahead(RoundJob(a, a.round_ops(anchor=6, position=4, proposer=1), False))
    reply = rounds.result(ahead)
    assert reply.replies is None and "DEADLINE_EXCEEDED" in reply.error and stream.ended, reply
    assert rounds.wait_for_round(0.0)  # no round left under way
    fresh = drafting("fresh")
    assert run_round(rounds, [fresh])[0].replies is not None and len(link.streams) == 2
    never.set()
    rounds.close()


def test_a_release_after_a_round_its_step_sent_goes_after_that_round():
    """The same rule when the round drafted ahead was sent by the step's own thread (no worker involved): the
    release is queued only once that round's reply is in."""
    link = FakeLink()
    rounds = DraftRounds(link, HANG_S, next_round_s=0.0)
    s = drafting("a")
    run_round(rounds, [s])
    stream = link.streams[-1]
    go = stream.hold()
    ahead = rounds.submit_ahead(RoundJob(s, s.round_ops(anchor=5, position=4, proposer=1), False))
    rounds.release(s, s.finish(), after=ahead)
    assert not ahead.done() and rounds.batcher.queued() == 0  # the release waits for the round, not in the queue
    go.set()
    assert rounds.result(ahead).replies is not None
    _wait_rounds(stream, 3)  # the release's round
    assert [[op.WhichOneof("op") for op in r.ops] for r in stream.rounds] == [["open", "propose"], ["propose"],
                                                                              ["release"]]
    rounds.close()


def test_a_round_is_planned_by_the_first_step_thread_that_takes_a_reply_never_by_the_reader():
    """The link's reader thread only completes futures: the round's plan (its chains cut together) and what the
    target is told run on the thread of the step that takes the round's reply first, once for the round."""
    link, planned_on, heard_on = FakeLink(), [], []
    rounds = DraftRounds(link, timeout_s=HANG_S, next_round_s=0.0,
                         plan=lambda jobs, replies: planned_on.append((threading.current_thread(), len(jobs))),
                         on_round=lambda ids: heard_on.append(threading.current_thread()))
    a, b = drafting("a"), drafting("b")
    run_round(rounds, [a, b])  # opens both: a round of two, taken by two step threads
    assert len(planned_on) == 1 and planned_on[0][1] == 2 and len(heard_on) == 1
    first_taker = planned_on[0][0]
    assert first_taker.name.startswith("step-") and heard_on[0] is first_taker
    ahead = rounds.submit_ahead(RoundJob(a, a.round_ops(anchor=6, position=4, proposer=1), False))
    assert ahead.result(HANG_S).replies is not None  # the reply came back on the fake stream's reader thread...
    assert len(planned_on) == 1  # ...which planned nothing
    rounds.result(ahead)
    assert planned_on[-1] == (threading.current_thread(), 1) and heard_on[-1] is threading.current_thread()
    rounds.result(ahead)  # once per round
    assert len(planned_on) == 2
    rounds.close()
