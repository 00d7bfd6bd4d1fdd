"""The target's rounds with its drafter: one DraftSession stream for all the target's sessions, one DraftRound
message per round.

The steps that want a proposal at about the same time form a round (a StepBatcher gathers them, waiting briefly
for the sessions of the last rounds): their queued ops (opens, the captures of the rows committed since their last
round) and their proposal requests go to the drafter as one message, which drafts them in one pass; the round's
sessions then verify in one target forward (`on_round` tells the target's batcher to expect them). A round that
fails (timeout, a dropped stream, the drafter's health probe failing) fails the drafting of every session in it;
their draft sessions lived on that stream, so a session opened on an earlier stream stops drafting, and new
sessions open on a new stream. When no round is under way or forming, a step's round is not handed to the
batcher's worker: the step's own thread sends it, and the reply completes it on the stream's reader thread
(`submit_ahead`; the draft timeout then applies in `result`). The reader thread only completes futures: the round
is planned (its chains cut together, the sessions about to verify told) by the first step thread that takes one of
its replies (`result`, `RoundSettlement`).

The sessions of a round verify, then ask for their next proposals (drafted ahead) within about one forward. A round
that formed meanwhile would split the sessions into groups that alternate between the drafter and the target, and
on shared cores each group's drafter pass then slows the other's verify: so the next round waits (up to
`next_round_s`) for the sessions of the last one whose steps are under way (a session stepped by its client over a
session stream may wait for its client's next Step: not waited for), unless a session says it will not come
(`unexpect`: it steps AR next, or drafts from its last chain, or ends). A session that needs no round (it verifies
the rest of its last chain) waits for the round under way (`wait_for_round`), to verify in its sessions' forward
rather than alone beside their drafter pass.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from dspark_grpc.protos.dspark.v1 import draft_pb2
from dspark_grpc.serving.batching import StepBatcher
from dspark_grpc.speculation.channel import SessionStream
from dspark_grpc.speculation.generation import RequestError
from dspark_grpc.speculation.wire import CODE_NAMES
from dspark_grpc.target_service.drafter_link import DrafterLink
from dspark_grpc.target_service.steps import SessionDrafting

# How long a round waits for a session of the last round that has not asked for its next proposal yet: it is
# verifying (one forward, a prompt's chunks at most); only a step thread that never gets to run waits this long.
NEXT_ROUND_WAIT_S = 0.1


@dataclass
class RoundJob:
    drafting: SessionDrafting
    ops: list[draft_pb2.DraftSessionRequest]
    verify_follows: bool = True  # the step waits for this round to verify (not a draft ahead, not a release)
    submitted: float = field(default_factory=time.perf_counter)  # made when it is handed to DraftRounds


@dataclass
class RoundReply:
    replies: list[draft_pb2.DraftSessionResponse] | None  # one per op of the job; None when the round failed
    error: str = ""
    depth: int | None = None  # how much of its chain to verify, decided for the round (None: not decided)
    seconds: float = 0.0  # from the job's submission to this reply (StepReport.round_seconds)
    drafter_seconds: float = 0.0  # of which the draft service's time on the round (DraftRoundResult.handle_seconds)
    settlement: RoundSettlement | None = field(default=None, repr=False)  # its round's planning (`result` runs it)


class RoundSettlement:
    """A round's planning, run once, by the first step thread that takes one of its replies (`DraftRounds.result`):
    the chains cut together (`plan`), the next round told to wait for the sessions about to verify, and the target
    told to expect their verifies (`on_round`). `thread` is the thread that ran it."""

    def __init__(self, rounds: DraftRounds, jobs: list[RoundJob], replies: list[RoundReply]) -> None:
        self.rounds, self.jobs, self.replies = rounds, jobs, replies
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            if self.thread is None:
                self.thread = threading.current_thread()
                self.rounds._settle(self.jobs, self.replies)


class DraftRounds:
    def __init__(self, link: DrafterLink, timeout_s: float | None,
                 on_round: Callable[[list[str]], None] | None = None,
                 plan: Callable[[list[RoundJob], list[RoundReply]], None] | None = None,
                 next_round_s: float = NEXT_ROUND_WAIT_S) -> None:
        """`plan(jobs, replies)` may set each reply's depth (the round's chains cut together); `on_round(ids)`
        hears which sessions are about to verify; the next round waits up to `next_round_s` for them (0: never)."""
        self.link, self.timeout_s, self.on_round, self.plan = link, timeout_s, on_round, plan
        self.next_round_s = next_round_s
        self.batcher: StepBatcher[RoundJob, RoundReply] = StepBatcher(
            self._run, name="draft-rounds", session=lambda job: job.drafting.session_id)
        self.generation = 0  # of the link stream; a session's draft session lives on the one it was opened on
        self._idle = threading.Event()  # no round under way
        self._idle.set()
        self._stream: SessionStream | None = None
        self._ids = itertools.count(1)

    def submit(self, job: RoundJob) -> RoundReply:
        """Run the job in the next round and wait for its reply."""
        return self.result(self.submit_ahead(job))

    def submit_ahead(self, job: RoundJob) -> Future:
        """The job's round without waiting: a Future of its RoundReply (wait with `result`). With no round under
        way or forming (StepBatcher.claim: no other session about to ask), it is sent from this thread at once and
        its reply completes it on the stream's reader thread: no worker to wake, none to wake this thread back.
        Else it goes with the next round, from the batcher's worker."""
        session = job.drafting.session_id
        if not self.batcher.claim(session):
            return self.batcher.submit_future(job)
        reply = _SentRound()

        def done(sent: Future) -> None:
            self.batcher.unclaim(session, time.perf_counter() - job.submitted)
            try:
                reply.set_result(sent.result()[0])
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits
                reply.set_exception(e)

        try:
            sent = self._start([job])
        except BaseException:
            self.batcher.unclaim(session)
            raise
        reply.stream, reply.deadline = sent.stream, sent.deadline
        sent.add_done_callback(done)
        return reply

    def result(self, reply: Future) -> RoundReply:
        """A submitted job's RoundReply, its round planned (by this thread, if it is the round's first to come here).
        A round sent from the asking thread has no worker bounding its wait: the draft timeout, from its sending, is
        applied here."""
        got = self._wait(reply) if isinstance(reply, _SentRound) else reply.result()
        if got.settlement is not None:
            got.settlement()
        return got

    def release(self, drafting: SessionDrafting, op: draft_pb2.DraftSessionRequest,
                after: Future | None = None) -> None:
        """Release a draft session without waiting (it goes with the next round, or alone); after `after`, the
        session's round drafted ahead if one is under way (a release that overtook it would leave its ops to a
        session the drafter no longer has)."""
        job = RoundJob(drafting, [op], False)
        if after is None:
            self._queue_quietly(job)
        else:
            after.add_done_callback(lambda _: self._queue_quietly(job))

    def _queue_quietly(self, job: RoundJob) -> None:
        try:
            self.batcher.submit_future(job)
        except RuntimeError:  # closed: the stream's end frees the drafter's sessions anyway
            pass

    def wait_for_round(self, timeout_s: float) -> bool:
        """Until the round under way (if any) has its replies, at most `timeout_s`; whether none is under way now."""
        return self._idle.wait(timeout_s)

    def unexpect(self, session_id: str) -> None:
        """This session of the last round will not ask for a proposal soon: the next round does not wait for it."""
        self.batcher.unexpect(session_id)

    def close(self) -> None:
        self.batcher.close()
        if self._stream is not None:
            self._stream.close()

    def _run(self, jobs: list[RoundJob]) -> list[RoundReply]:
        """The batcher worker's round: sent, waited for."""
        return self._wait(self._start(jobs))

    def _wait(self, sent: _SentRound):
        """The result of a round sent, waited for until its deadline: past it, its stream is closed (the round and
        every other one on the stream fail, their drafting with them) and the failure is the result."""
        try:
            return sent.result(None if sent.deadline is None else max(0.0, sent.deadline - time.perf_counter()))
        except TimeoutError:
            assert sent.stream is not None
            sent.stream.close(f"no reply within {self.timeout_s:g} s", code=4)
            return sent.result()

    def _start(self, jobs: list[RoundJob]) -> _SentRound:
        """Send the jobs' ops as one DraftRound: a Future of their RoundReplies, completed (by `_finish`) on the
        thread that reads the reply, or at once when nothing was sent."""
        self._idle.clear()
        try:
            return self._send(jobs)
        except BaseException:
            self._idle.set()
            raise

    def _send(self, jobs: list[RoundJob]) -> _SentRound:
        sent = _SentRound()
        replies: list[RoundReply | None] = [None] * len(jobs)
        if self._stream is None or self._stream.ended:  # ended between rounds (the drafter went away meanwhile)
            stream = self.link.open_stream()
            if stream is None:
                self._finish(jobs, [RoundReply(None, self.link.down_reason) for _ in jobs], sent)
                return sent
            self._stream, self.generation = stream, self.generation + 1
        ops, spans = [], []
        for i, job in enumerate(jobs):
            if job.ops and job.ops[0].WhichOneof("op") == "open":
                job.drafting.stream_generation = self.generation
            elif job.drafting.stream_generation != self.generation:
                replies[i] = RoundReply(None, "the stream to the drafter was lost with this session's context")
                continue
            spans.append((i, len(ops), len(job.ops)))
            ops.extend(job.ops)
        if not spans:
            self._finish(jobs, replies, sent)
            return sent
        stream = self._stream
        sent.stream, sent.deadline = stream, None if not self.timeout_s else time.perf_counter() + self.timeout_s
        request = draft_pb2.DraftSessionRequest(request_id=next(self._ids), round=draft_pb2.DraftRound(ops=ops))
        stream.send(request).add_done_callback(
            lambda response: self._finish(jobs, self._read(response, stream, len(ops), spans, replies), sent))
        return sent

    def _read(self, response: Future, stream: SessionStream, n_ops: int, spans: list[tuple[int, int, int]],
              replies: list[RoundReply | None]) -> list[RoundReply | None]:
        """Each job's share of the round's reply (a failed round fails every job in it)."""
        why = ""
        try:
            reply = response.result()
        except RequestError as e:  # a transport failure, a timeout: this stream is done
            stream.close()
            if self._stream is stream:
                self._stream = None
            why = f"drafter round failed ({CODE_NAMES.get(e.code, e.code)}: {e.message})"
        else:
            results = list(reply.round.results)
            if reply.status.code:
                why = f"drafter round refused ({CODE_NAMES.get(reply.status.code, reply.status.code)}: " \
                      f"{reply.status.message})"
            elif len(results) != n_ops:
                why = f"the drafter answered {len(results)} of {n_ops} ops"
        for i, start, n in spans:
            replies[i] = RoundReply(None, why) if why else \
                RoundReply(results[start: start + n], drafter_seconds=reply.round.handle_seconds)
        return replies

    def _finish(self, jobs: list[RoundJob], replies: list[RoundReply | None], sent: _SentRound) -> None:
        """The round's replies timed and given their settlement, `sent` completed (on the thread that read the
        reply: nothing more)."""
        now = time.perf_counter()
        settlement = RoundSettlement(self, jobs, replies)  # type: ignore[arg-type]
        for job, reply in zip(jobs, replies, strict=True):
            reply.seconds, reply.settlement = now - job.submitted, settlement  # type: ignore[union-attr]
        self._idle.set()
        sent.set_result(replies)

    def _settle(self, jobs: list[RoundJob], replies: list[RoundReply]) -> None:
        """`RoundSettlement`'s work: the round planned, the sessions about to verify told."""
        if self.plan is not None:
            self.plan(jobs, replies)
        # the sessions whose steps wait for this reply: they verify now (a step drafted ahead for a session whose
        # step has not started yet, over a session stream, waits for its client)
        stepping = [(job.drafting.session_id, reply.replies is not None)
                    for job, reply in zip(jobs, replies, strict=True)
                    if job.ops and job.ops[-1].WhichOneof("op") == "propose"
                    and (job.verify_follows or job.drafting.in_step)]
        drafted = [sid for sid, ok in stepping if ok]  # (a failed one steps AR: no next round)
        if self.next_round_s > 0 and drafted:
            self.batcher.expect(drafted, self.next_round_s)
        if self.on_round is not None:
            self.on_round([sid for sid, _ in stepping])


class _SentRound(Future):
    """A round's (or one job's share of a round's) Future, with the stream it went on and the time its wait ends
    (None: no bound)."""

    def __init__(self) -> None:
        super().__init__()
        self.stream: SessionStream | None = None
        self.deadline: float | None = None
