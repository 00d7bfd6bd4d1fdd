"""The generation loop: open, prefill, then one step per target forward (the target drafts with its own drafter,
verifies and commits: target_service/step_engine.py), turned into what each step adds to the text, with EOS, stop
strings, the length bound and the request's statistics.

The target service's Generate RPC runs it in-process, calling its step engine directly (`TargetSteps`). It only
speaks dspark.v1 messages, so it needs no torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2
from dspark_grpc.speculation.wire import CODE_NAMES, PROPOSER_NAMES, PROTOCOL_VERSION


class RequestError(Exception):
    """An operation failed with a gRPC status code (google.rpc.Code numbering) and a message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{CODE_NAMES.get(code, code)}: {message}")
        self.code = code
        self.message = message




class TargetSteps(Protocol):
    """The session operations a generation makes, in this order, each raising on failure (a status-carrying error:
    speculation/errors.py)."""

    def open(self, m: target_pb2.OpenSession) -> target_pb2.SessionOpened: ...

    def prefill(self, m: target_pb2.Prefill) -> target_pb2.Prefilled: ...

    def step(self, session_id: str, tokens_left: int) -> target_pb2.Stepped: ...

    def release(self, session_id: str) -> None: ...


class StopStrings:
    """Holds back text that may be the start of a stop string; cuts the text before the first stop."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was reached)."""
        buf = self.held + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        hold = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


@dataclass
class Delta:
    text: str
    token_ids: list[int]
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: common_pb2.SamplingParams = field(default_factory=common_pb2.SamplingParams)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


def generate_deltas(target: TargetSteps, prompt: common_pb2.Prompt, config: GenerationConfig,
                    eos_token_ids: frozenset[int], stats: common_pb2.GenerationStats,
                    step_options: target_pb2.StepOptions | None = None) -> Iterator[Delta]:
    """Prefill, then one step (one target forward) at a time; yields what each step adds. `step_options` (unset:
    AR) say how the target decodes the steps. Releases the session on every exit."""
    if config.max_new_tokens <= 0:
        raise RequestError(3, f"max_new_tokens must be >= 1, got {config.max_new_tokens}")
    sums = _StepSums()
    opened = target.open(target_pb2.OpenSession(protocol_version=PROTOCOL_VERSION, step_options=step_options))
    sid = opened.session_id
    reasons = [opened.fallback_reason] if opened.fallback_reason else []
    stop = StopStrings(list(config.stop))
    drafted: list[int] = []  # per depth: steps that drafted a token at that depth
    accepted: list[int] = []  # per depth: steps whose accepted path reached that depth
    t0 = time.perf_counter()
    try:
        pre = target.prefill(target_pb2.Prefill(session_id=sid, prompt=prompt, sampling=config.sampling))
        t_prefill = time.perf_counter()
        stats.prompt_tokens = len(pre.prompt_tokens)
        stats.prefill_seconds = t_prefill - t0
        length = len(pre.prompt_tokens)
        emitted, texts = [pre.next_token], [pre.text]
        while True:
            delta = Delta("", [])
            for token, piece in zip(emitted, texts, strict=True):
                if token in eos_token_ids and not config.ignore_eos:
                    delta.finish_reason = common_pb2.FINISH_REASON_EOS
                    break
                delta.token_ids.append(token)
                stats.generated_tokens += 1
                safe, hit = stop.push(piece)
                delta.text += safe
                if hit:
                    delta.finish_reason = common_pb2.FINISH_REASON_STOP_STRING
                    break
                if stats.generated_tokens >= config.max_new_tokens:
                    delta.finish_reason = common_pb2.FINISH_REASON_LENGTH
                    break
            if not delta.finish_reason and length + 1 > opened.max_length:
                delta.finish_reason = common_pb2.FINISH_REASON_CONTEXT_FULL
            if delta.finish_reason and delta.finish_reason != common_pb2.FINISH_REASON_STOP_STRING:
                delta.text += stop.flush()
            if delta.finish_reason:
                _finish_stats(stats, time.perf_counter() - t_prefill, drafted, accepted, sums, reasons)
                yield delta
                return
            yield delta

            t_step = time.perf_counter()
            left = config.max_new_tokens - stats.generated_tokens
            stepped = target.step(sid, left)
            _add_step(stats, stepped.report, len(stepped.tokens) - 1, time.perf_counter() - t_step, drafted,
                      accepted, reasons, sums)
            length = stepped.length
            emitted = list(stepped.tokens[1:]) + [stepped.next_token]
            texts = list(stepped.token_texts)
    finally:
        try:
            target.release(sid)
        except Exception:  # noqa: BLE001 - already gone (evicted, the service stopping): nothing to free
            pass


@dataclass
class _StepSums:
    forward_sessions: int = 0
    forward_rows: int = 0
    draft_pass_sessions: int = 0
    drafting_steps: int = 0


def _add_step(stats: common_pb2.GenerationStats, report: target_pb2.StepReport, accepted_tokens: int, wall: float,
              drafted: list[int], accepted: list[int], reasons: list[str], sums: _StepSums) -> None:
    stats.steps += 1
    sums.forward_sessions += report.batch_sessions
    sums.forward_rows += report.batch_rows
    if report.draft_batch_sessions:
        sums.draft_pass_sessions += report.draft_batch_sessions
        sums.drafting_steps += 1
    stats.drafts_ready += report.draft_ready
    stats.drafts_from_chain += report.draft_from_chain
    stats.drafts_from_lookup += report.draft_from_lookup
    stats.committed_per_step.append(accepted_tokens + 1)
    stats.draft_seconds += report.draft_seconds
    if report.round_seconds:
        stats.draft_rounds += 1
        stats.draft_round_seconds += report.round_seconds
        stats.draft_service_seconds += report.round_drafter_seconds
        stats.draft_compute_seconds += report.draft_compute_seconds
    stats.verify_seconds += report.verify_seconds
    stats.transport_seconds += max(wall - report.draft_seconds - report.verify_seconds, 0.0)
    stats.planned_ar_steps += report.planned_ar
    stats.truncated_drafts += report.truncated
    if report.draft_depth:
        stats.speculative_steps += 1
        _count(drafted, report.draft_depth)
        _count(accepted, accepted_tokens)
        for proposer in report.accepted_proposers:
            stats.accepted_by_proposer[(PROPOSER_NAMES.get(proposer) or "unknown")] += 1
    else:
        stats.ar_steps += 1
    if report.fallback_reason:
        reasons.append(report.fallback_reason)


def _count(counts: list[int], depth: int) -> None:
    """counts[d-1] += 1 for d in 1..depth."""
    counts.extend([0] * (depth - len(counts)))
    for d in range(depth):
        counts[d] += 1


def _finish_stats(stats: common_pb2.GenerationStats, decode_seconds: float, drafted: list[int],
                  accepted: list[int], sums: _StepSums, reasons: list[str]) -> None:
    stats.decode_seconds = decode_seconds
    if stats.steps:
        stats.forward_sessions = sums.forward_sessions / stats.steps
        stats.forward_rows = sums.forward_rows / stats.steps
    if sums.drafting_steps:
        stats.draft_pass_sessions = sums.draft_pass_sessions / sums.drafting_steps
    # tokens committed per speculative step, bonus included (vLLM's 1 + accepted / drafts); AR steps have none, so a
    # run without a speculative step reports 0
    if stats.speculative_steps:
        stats.acceptance_length = 1 + sum(accepted) / stats.speculative_steps
    accepted = accepted + [0] * (len(drafted) - len(accepted))
    del stats.per_position_acceptance[:], stats.drafted_per_position[:], stats.accepted_per_position[:]
    stats.drafted_per_position.extend(drafted)
    stats.accepted_per_position.extend(accepted)
    stats.per_position_acceptance.extend(a / d for a, d in zip(accepted, drafted, strict=True))
    stats.mode_run = common_pb2.DECODE_MODE_SPECULATION if stats.speculative_steps else common_pb2.DECODE_MODE_AR
    stats.fallback_reason = "; ".join(reasons)
    total = stats.prefill_seconds + decode_seconds
    if total > 0:
        stats.tokens_per_second = stats.generated_tokens / total
