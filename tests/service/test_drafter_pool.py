"""A target with a drafter pool (`--drafter A,B`): real services on loopback (prompt-lookup drafters, the default
model). Each session drafts on one drafter of the pool, so both draft; every output equals AR; when one drafter is
SIGKILLed the requests under way on it finish target-only (same tokens) and new sessions speculate on the other."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from dspark_grpc.client import TargetClient
from dspark_grpc.client.local_stack import local_drafter, local_target

PROMPTS = ["1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", "a b c d a b c d a b c d a b", "red green blue red green blue red",
           "x = x + 1\nx = x + 1\nx = x + 1\nx ="]
TOKENS = 16


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def proposals(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    return sum(float(v) for v in re.findall(r"^dspark:draft_proposals_total\{[^}]*\} (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def pool():
    """Two prompt-lookup drafters (each with its metrics) and a target drafting with both."""
    with contextlib.ExitStack() as stack:
        drafters = []
        for _ in range(2):
            process: list[subprocess.Popen] = []
            port = free_port()
            address = stack.enter_context(local_drafter(["--drafter", "none", "--quiet", "--no-cost-profile",
                                                         "--metrics-port", str(port)], echo=False, process=process,
                                                        wait_serving=True))
            drafters.append((address, process[-1], f"http://127.0.0.1:{port}/metrics"))
        target = stack.enter_context(local_target(
            ["--quiet", "--no-cost-profile", "--drafter", ",".join(a for a, _, _ in drafters)], echo=False,
            wait_serving=True))
        yield target, drafters


def generate_all(target: str, mode: str) -> list:
    with TargetClient(target, mode=mode) as client, ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: client.generate(p, max_new_tokens=TOKENS, ignore_eos=True, temperature=0),
                             PROMPTS * 2))


def test_sessions_spread_over_the_pool_and_every_output_equals_ar(pool):
    target, drafters = pool
    ar = generate_all(target, "ar")
    before = [proposals(url) for _, _, url in drafters]
    spec = generate_all(target, "speculation")
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    assert sum(r.stats.speculative_steps for r in spec) > 0
    drafted = [proposals(url) - b for (_, _, url), b in zip(drafters, before, strict=True)]
    assert all(d > 0 for d in drafted), f"proposals per drafter: {drafted}"  # 8 sessions over 2 drafters


def test_a_dead_drafter_costs_only_its_sessions_speed_and_new_sessions_use_the_other(pool):
    target, drafters = pool
    ar = [r.token_ids for r in generate_all(target, "ar")]
    (_, dead, _), (_, _, alive_url) = drafters
    dead.kill()
    dead.wait()
    before = proposals(alive_url)
    deadline, speculated = time.monotonic() + 180, 0
    while not speculated:  # the target's probe drops the dead drafter within about a second
        assert time.monotonic() < deadline, "no session speculated on the surviving drafter"
        spec = generate_all(target, "speculation")
        assert [r.token_ids for r in spec] == ar  # the requests on the dead drafter finish target-only
        speculated = sum(r.stats.speculative_steps for r in spec if not r.stats.fallback_reason)
    assert proposals(alive_url) > before


def test_a_session_keeps_its_drafter_while_it_answers_and_moves_only_when_it_goes_away():
    from types import SimpleNamespace

    from dspark_grpc.target_service.servicer import TargetServicer

    servicer = TargetServicer(max_message_bytes=1 << 20)
    links = [SimpleNamespace(address=f"127.0.0.1:{5000 + i}", info=object()) for i in range(3)]
    servicer.drafter, servicer.rounds = links[0], "rounds-0"
    servicer.more_drafters = [(links[1], "rounds-1"), (links[2], "rounds-2")]
    ids = [f"session-{i}" for i in range(300)]
    first = {sid: servicer._pick_drafter(sid)[1] for sid in ids}
    assert set(first.values()) == {"rounds-0", "rounds-1", "rounds-2"}  # spread over the pool
    links[1].info = None  # drafter 1 stops answering its probes
    second = {sid: servicer._pick_drafter(sid)[1] for sid in ids}
    assert all(second[sid] == first[sid] for sid in ids if first[sid] != "rounds-1")  # the others stay put
    assert "rounds-1" not in second.values()
    for link in links:
        link.info = None
    assert servicer._pick_drafter("session-0") is None
