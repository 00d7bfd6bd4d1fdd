"""Fair admission end to end (issue 37), both services on loopback with their default session limits: a stranger
who floods the draft service cannot stop the target's speculation, and a client that holds all the target gives it
leaves a second client a session and a third a whole Generate. Each client is its own connection, as separate
processes would be (gRPC shares one connection among a process's channels of equal options); without tokens or
client certificates a connection is a principal (serving/security.py `principal_of`). The rules themselves, with
counts: tests/test_fair_admission.py."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

from tests.reliability.conftest import Ops, Service, drafter_info, service, target_info, wait_until

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
PROMPT = "Count: 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2,"  # prompt lookup drafts at almost every step
TOKENS = 16
HANG_BOUND_S = 120.0  # only catches a hang


@pytest.fixture(scope="module")
def services() -> Iterator[tuple[Service, Service]]:
    """Prompt lookup (cheap to load); the target in the exact precision (no compile at start-up). No session flag."""
    with service("draft", ["--drafter", "none"]) as drafter:
        with service("target", ["--drafter", drafter.address, "--precision", "exact"]) as target:
            yield target, drafter


def connection(address: str) -> grpc.Channel:
    """A channel on a connection of its own: another principal."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def generate(channel: grpc.Channel, mode: int) -> tuple[list[int], common_pb2.GenerationStats]:
    request = target_pb2.GenerateRequest(prompt=common_pb2.Prompt(text=PROMPT), max_new_tokens=TOKENS,
                                         ignore_eos=True, mode=mode)
    ids, stats = [], common_pb2.GenerationStats()
    for reply in target_pb2_grpc.TargetServiceStub(channel).Generate(request, timeout=HANG_BOUND_S):
        ids += reply.token_ids
        if reply.HasField("stats"):
            stats = reply.stats
    return ids, stats


def open_all(ops: Ops, open_op: dict) -> tuple[int, common_pb2.Status]:
    """Open sessions on one stream until one is refused: (how many opened, the refusal)."""
    n = 0
    while (response := ops(**open_op)).status.code == 0:
        n += 1
    return n, response.status


def test_default_limits_keep_both_services_usable_for_others(services: tuple[Service, Service]):
    target, drafter = services
    limits = drafter_info(drafter.address)
    assert limits.max_sessions == 36 and target_info(target.address).max_sessions == 16
    with connection(target.address) as ours:
        reference, _ = generate(ours, common_pb2.DECODE_MODE_AR)

    # 1. A stranger floods the draft service: one connection, several streams; it gets a target's worth (16).
    fingerprint = target_info(target.address).fingerprint
    with connection(drafter.address) as stranger:
        streams = [Ops(draft_pb2_grpc.DraftServiceStub(stranger).DraftSession, draft_pb2.DraftSessionRequest)
                   for _ in range(3)]
        opened = [open_all(s, dict(open=draft_pb2.OpenDraft(target=fingerprint))) for s in streams]
        assert [n for n, _ in opened] == [16, 0, 0], opened
        assert all(s.code == EXHAUSTED and "--max-sessions-per-principal 16" in s.message for _, s in opened)
        print(f"\nstranger on one connection, 3 streams: {[n for n, _ in opened]} draft sessions, then "
              f"RESOURCE_EXHAUSTED: {opened[0][1].message}")
        # the target's speculative requests (4 at once, each a draft session of the target's one stream) speculate
        with connection(target.address) as ours, ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda _: generate(ours, common_pb2.DECODE_MODE_SPECULATION), range(4)))
        assert drafter_info(drafter.address).live_sessions >= 16  # the stranger's sessions were there throughout
        for ids, stats in results:
            assert ids == reference
            assert stats.speculative_steps > 0 and stats.fallback_reason == "", stats
        print(f"target's speculative requests during the flood: speculative steps "
              f"{[s.speculative_steps for _, s in results]} of {[s.steps for _, s in results]}, fallback reasons "
              f"{[s.fallback_reason for _, s in results]}, outputs == AR")
        for s in streams:
            s.close()

    # 2. One client takes all the target gives it (14 of 16): a second client still opens a session (one of the 2
    # reserved, not two of them), and a third finishes a Generate on the last one.
    wait_until(lambda: target_info(target.address).live_sessions == 0, HANG_BOUND_S, "the requests' sessions freed")
    with connection(target.address) as first, connection(target.address) as second, \
            connection(target.address) as third:
        hog = Ops(target_pb2_grpc.TargetServiceStub(first).TargetSession, target_pb2.TargetSessionRequest)
        held, refusal = open_all(hog, dict(open=target_pb2.OpenSession()))
        assert held == 14 and refusal.code == EXHAUSTED and "--max-sessions-per-principal 14" in refusal.message
        newcomer = Ops(target_pb2_grpc.TargetServiceStub(second).TargetSession, target_pb2.TargetSessionRequest)
        newcomer.ok(open=target_pb2.OpenSession())
        again = newcomer(open=target_pb2.OpenSession())
        assert again.status.code == EXHAUSTED and "--reserved-sessions 2" in again.status.message
        ids, _ = generate(third, common_pb2.DECODE_MODE_AR)
        assert ids == reference
        print(f"target: one client held {held} sessions ({refusal.message}); a second opened 1 (a second one: "
              f"{again.status.message}); a third finished a Generate equal to AR")
        hog.close()
        newcomer.close()
