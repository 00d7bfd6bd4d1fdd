"""Two targets and a pool of two drafters on loopback (issue 39's acceptance): real services (prompt-lookup drafters,
the default model), 16 concurrent SDK requests given both target addresses. Both targets serve, both drafters
draft, every output equals AR; a drafter SIGKILLed mid-run costs no tokens and its sessions go on speculating on
the other drafter (they re-open there with their context); a target SIGKILLed mid-run fails only the requests on it
(UNAVAILABLE) and new requests succeed on the other. The pool's choice and its dns lookups are tested without
processes below."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from dspark_grpc.client import RequestError, TargetClient
from dspark_grpc.client.local_stack import local_drafter, local_target
from dspark_grpc.protos.dspark.v1 import common_pb2
from dspark_grpc.target_service.drafter_pool import DrafterPool, dns_host_port, resolve

PROMPTS = ["1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,", "a b c d a b c d a b c d a b", "red green blue red green blue red",
           "x = x + 1\nx = x + 1\nx = x + 1\nx ="]
TOKENS = 16
LONG = 64  # tokens of the requests that a kill interrupts
# Tree proposals: the target finds prompt-lookup chains itself (no round), never trees, so every speculative step of
# these sessions asks its drafter for a round: whether a drafter is asked does not hang on what the lookup matches.
TREE = "tree"
UNAVAILABLE = 14


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def proposals(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=60).read().decode()
    return sum(float(v) for v in re.findall(r"^dspark:draft_proposals_total\{[^}]*\} (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def stack():
    """Two prompt-lookup drafters (each with its metrics) and two targets drafting with both."""
    with contextlib.ExitStack() as exits:
        drafters = []
        for _ in range(2):
            process: list[subprocess.Popen] = []
            port = free_port()
            address = exits.enter_context(local_drafter(["--drafter", "none", "--quiet", "--no-cost-profile",
                                                         "--metrics-port", str(port)], echo=False, process=process,
                                                        wait_serving=True))
            drafters.append(SimpleNamespace(address=address, process=process[-1],
                                            metrics=f"http://127.0.0.1:{port}/metrics"))
        targets = []
        for _ in range(2):  # both load at once: a launch returns once its target listens
            process = []
            address = exits.enter_context(local_target(
                ["--quiet", "--no-cost-profile", "--drafter", ",".join(d.address for d in drafters)], echo=False,
                process=process))
            targets.append(SimpleNamespace(address=address, process=process[-1]))
        for target in targets:
            with TargetClient(target.address) as probe:
                probe.wait_ready(timeout=300)
        yield SimpleNamespace(targets=targets, drafters=drafters)


@pytest.fixture(scope="module")
def reference(stack) -> dict[tuple[str, int], list[int]]:
    """Each prompt's AR tokens (TOKENS and LONG of them) from the first target alone (the requests at once: it
    batches them, and AR's tokens do not depend on a request's neighbours)."""
    keys = [(p, n) for p in PROMPTS for n in (TOKENS, LONG)]
    with TargetClient(stack.targets[0].address, mode="ar") as client, ThreadPoolExecutor(len(keys)) as pool:
        return dict(zip(keys, pool.map(lambda key: client.generate(key[0], max_new_tokens=key[1],
                                                                   ignore_eos=True).token_ids, keys), strict=True))


class Requests:
    """Concurrent streaming requests (one thread each); `wait_tokens(n)` returns once every request still running
    has streamed n tokens (a gate on progress, not on time)."""

    def __init__(self, client: TargetClient, prompts: list[str], tokens: int, proposal: str = TREE) -> None:
        self.client, self.tokens, self.proposal = client, tokens, proposal
        self.streamed = [0] * len(prompts)
        self.results: list[tuple[list[int], common_pb2.GenerationStats] | RequestError | None] = [None] * len(prompts)
        self.progress = threading.Condition()
        self.threads = [threading.Thread(target=self._one, args=(i, p)) for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _one(self, i: int, prompt: str) -> None:
        stats, ids = common_pb2.GenerationStats(), []
        try:
            for _, toks, _ in self.client.stream(prompt, max_new_tokens=self.tokens, ignore_eos=True, stats=stats,
                                                 mode="speculation", proposal=self.proposal):
                ids += toks
                with self.progress:
                    self.streamed[i] = len(ids)
                    self.progress.notify_all()
            self.results[i] = (ids, stats)
        except RequestError as e:
            self.results[i] = e
        with self.progress:
            self.streamed[i] = self.tokens
            self.progress.notify_all()

    def wait_tokens(self, n: int, timeout: float = 300) -> None:
        with self.progress:
            assert self.progress.wait_for(lambda: min(self.streamed) >= n, timeout), self.streamed

    def join(self) -> list:
        for t in self.threads:
            t.join(600)
        return self.results


def test_two_targets_and_two_drafters_serve_and_every_output_equals_ar(stack, reference):
    before = [proposals(d.metrics) for d in stack.drafters]
    prompts = PROMPTS * 4  # 16 concurrent requests
    with TargetClient([t.address for t in stack.targets], mode="speculation", proposal=TREE) as client, \
            ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: client.generate(p, max_new_tokens=TOKENS, ignore_eos=True), prompts))
        counted = dict(client.requests_by_target)
    assert [r.token_ids for r in results] == [reference[p, TOKENS] for p in prompts]
    assert counted == {t.address: 8 for t in stack.targets}  # both targets serve, in turn
    assert sum(r.stats.speculative_steps for r in results) > 0
    drafted = [proposals(d.metrics) - b for d, b in zip(stack.drafters, before, strict=True)]
    assert all(d > 0 for d in drafted), f"proposals per drafter: {drafted}"  # 16 sessions over 2 drafters


def steps_after_move(stats: common_pb2.GenerationStats) -> list[int] | None:
    """The tokens committed by each step after the session moved to another drafter (None: it did not move)."""
    found = re.search(r"step (\d+): [^;]*; drafting moved to", stats.fallback_reason)
    return None if found is None else list(stats.committed_per_step[int(found.group(1)):])


def test_a_killed_drafter_s_sessions_move_to_the_other_and_keep_speculating(stack, reference):
    dead, alive = stack.drafters
    prompts = PROMPTS * 4
    with TargetClient([t.address for t in stack.targets]) as client:
        requests = Requests(client, prompts, LONG)
        requests.wait_tokens(4)  # every session has drafted on its drafter
        dead.process.kill()
        dead.process.wait()
        before = proposals(alive.metrics)
        results = requests.join()
    assert [r[0] for r in results] == [reference[p, LONG] for p in prompts]  # not a token lost or changed
    moved = [steps_after_move(stats) for _, stats in results]
    assert not any("target-only" in stats.fallback_reason for _, stats in results), \
        [stats.fallback_reason for _, stats in results]
    assert sum(m is not None for m in moved) > 0  # the sessions that drafted on the dead drafter
    # after their move, their steps accepted drafts: they speculate on the surviving drafter
    assert sum(n > 1 for m in moved if m is not None for n in m) > 0, moved
    assert proposals(alive.metrics) > before


def test_a_killed_target_costs_only_the_requests_on_it(stack, reference):
    """Runs last in this file: it kills one of the module's targets."""
    kept, dead = stack.targets
    prompts = PROMPTS * 4
    with TargetClient([t.address for t in stack.targets]) as client:
        requests = Requests(client, prompts, LONG)
        requests.wait_tokens(2)
        on_dead = client.requests_by_target[dead.address]
        dead.process.kill()
        dead.process.wait()
        results = requests.join()
        failed = [r for r in results if isinstance(r, RequestError)]
        assert failed and all(e.code == UNAVAILABLE for e in failed), failed
        assert len(failed) <= on_dead
        assert [r[0] for r in results if not isinstance(r, RequestError)] == \
            [reference[p, LONG] for p, r in zip(prompts, results, strict=True) if not isinstance(r, RequestError)]
        later = [client.generate(p, max_new_tokens=TOKENS, ignore_eos=True, mode="speculation") for p in PROMPTS]
    assert [r.token_ids for r in later] == [reference[p, TOKENS] for p in PROMPTS]  # all on the kept target


# -- the pool, without processes --------------------------------------------------------------------------------------


def member(address: str, up: bool = True) -> SimpleNamespace:
    link = SimpleNamespace(address=address, info=object() if up else None, down_reason="" if up else "down",
                           stop=lambda: None)
    return SimpleNamespace(link=link, rounds=SimpleNamespace(name=f"rounds of {address}", close=lambda: None),
                           address=address, close=lambda: setattr(link, "closed", True))


def test_a_session_keeps_its_drafter_while_it_answers_and_moves_only_when_it_goes_away():
    members = {f"127.0.0.1:{5000 + i}": member(f"127.0.0.1:{5000 + i}") for i in range(3)}
    pool = DrafterPool(",".join(members), lambda address, _: members[address])
    ids = [f"session-{i}" for i in range(300)]
    first = {sid: pool.pick(sid).address for sid in ids}
    assert set(first.values()) == set(members)  # spread over the pool
    members["127.0.0.1:5001"].link.info = None  # drafter 1 stops answering its probes
    second = {sid: pool.pick(sid).address for sid in ids}
    assert all(second[sid] == first[sid] for sid in ids if first[sid] != "127.0.0.1:5001")  # the others stay put
    assert "127.0.0.1:5001" not in second.values()
    # a session whose drafter failed moves to another one that answers, never back to the one it leaves
    for sid in ids:
        leaving = pool.pick(sid)
        assert pool.pick(sid, besides=leaving.rounds) not in (None, leaving)
    for m in members.values():
        m.link.info, m.link.down_reason = None, f"drafter {m.address} unavailable"
    assert pool.pick("session-0") is None and pool.info() is None
    assert pool.down_reason() == "; ".join(f"drafter {a} unavailable" for a in members)


def test_a_dns_pool_follows_its_name():
    answers = {"drafters.ns.svc": ["10.0.0.1:50052", "10.0.0.2:50052"]}
    started: dict[str, tuple[str, str | None]] = {}

    def start(address: str, server_name: str | None) -> SimpleNamespace:
        started[address] = (address, server_name)
        return member(address)

    def lookup(host: str, port: int) -> list[str]:
        return [a for a in answers.get(host, []) if a.endswith(f":{port}")]

    pool = DrafterPool("dns:///drafters.ns.svc:50052", start, resolve_addresses=lookup, resolve_interval_s=3600)
    try:
        assert [d.address for d in pool.members] == ["10.0.0.1:50052", "10.0.0.2:50052"]
        # each IP's TLS certificate is checked against the name the pool was given
        assert started["10.0.0.1:50052"] == ("10.0.0.1:50052", "drafters.ns.svc")
        assert pool.several
        answers["drafters.ns.svc"] = ["10.0.0.2:50052", "10.0.0.3:50052"]  # a pod replaced
        old = pool.members[0]
        pool.refresh()
        assert {d.address for d in pool.members} == {"10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"}
        old.link.info = None  # gone from the name and down: it leaves at the next lookup
        pool.refresh()
        assert {d.address for d in pool.members} == {"10.0.0.2:50052", "10.0.0.3:50052"}
        assert getattr(old.link, "closed", False)
        answers.clear()  # a lookup that finds nothing keeps the members it had
        pool.refresh()
        assert len(pool.members) == 2
    finally:
        pool.close()


@pytest.mark.parametrize(("spec", "expected"), [("dns:///drafters:50052", ("drafters", 50052)),
                                                ("dns://8.8.8.8/drafters.ns:7", ("drafters.ns", 7)),
                                                ("dns:///[::1]:50052", ("::1", 50052))])
def test_dns_names_parse(spec, expected):
    assert dns_host_port(spec) == expected


def test_a_dns_name_without_a_port_is_refused_at_start():
    with pytest.raises(ValueError, match="needs a port"):
        DrafterPool("dns:///drafters", lambda address, _: member(address))


def test_a_loopback_name_resolves():
    assert set(resolve("localhost", 50052)) & {"127.0.0.1:50052", "[::1]:50052"}
    assert resolve("no-such-name.invalid", 50052) == []
