"""The target's rounds with its drafter: one DraftSession stream for all the target's sessions, one DraftRound
message per round.

The steps that want a proposal at about the same time form a round (a StepBatcher gathers them, waiting briefly
for the sessions of the last rounds): their queued ops (opens, the captures of the rows committed since their last
round) and their proposal requests go to the drafter as one message, which drafts them in one pass; the round's
sessions then verify in one target forward (`on_round` tells the target's batcher to expect them). A round that
fails (timeout, a dropped stream, the drafter's health probe failing) fails the drafting of every session in it;
their draft sessions lived on that stream, so a session opened on an earlier stream stops drafting, and new
sessions open on a new stream.

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
from dspark_grpc.speculation.steps import SessionDrafting
from dspark_grpc.speculation.wire import CODE_NAMES
from dspark_grpc.target_service.drafter_link import DrafterLink

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
    seconds: float = 0.0  # from the job's submission to this reply, planned (StepReport.round_seconds)
    drafter_seconds: float = 0.0  # of which the draft service's time on the round (DraftRoundResult.handle_seconds)


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
        return self.batcher.submit(job)[0]

    def submit_ahead(self, job: RoundJob) -> Future:
        """Queue the job for the next round without waiting: a Future of its RoundReply."""
        return self.batcher.submit_future(job)

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
        self._idle.clear()
        try:
            return self._run_round(jobs)
        finally:
            self._idle.set()

    def _run_round(self, jobs: list[RoundJob]) -> list[RoundReply]:
        replies: list[RoundReply | None] = [None] * len(jobs)
        if self._stream is None or self._stream.ended:  # ended between rounds (the drafter went away meanwhile)
            stream = self.link.open_stream()
            if stream is None:
                return [RoundReply(None, f"{self.link.down_reason}")] * len(jobs)
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
        if spans:
            request = draft_pb2.DraftSessionRequest(request_id=next(self._ids), round=draft_pb2.DraftRound(ops=ops))
            why = ""
            try:
                response = self._stream.call(request, timeout=self.timeout_s)
            except RequestError as e:  # a transport failure, a timeout: this stream is done
                self._stream.close()
                self._stream = None
                why = f"drafter round failed ({CODE_NAMES.get(e.code, e.code)}: {e.message})"
            else:
                results = list(response.round.results)
                if response.status.code:
                    why = f"drafter round refused ({CODE_NAMES.get(response.status.code, response.status.code)}: " \
                          f"{response.status.message})"
                elif len(results) != len(ops):
                    why = f"the drafter answered {len(results)} of {len(ops)} ops"
            for i, start, n in spans:
                replies[i] = RoundReply(None, why) if why else \
                    RoundReply(results[start: start + n], drafter_seconds=response.round.handle_seconds)
        if self.plan is not None:
            self.plan(jobs, replies)  # type: ignore[arg-type]
        now = time.perf_counter()
        for job, reply in zip(jobs, replies, strict=True):
            reply.seconds = now - job.submitted  # type: ignore[union-attr]
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
        return replies  # type: ignore[return-value]

