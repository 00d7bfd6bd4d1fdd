"""The SDK over several targets: two real targets on loopback (AR, no drafter). New requests go round-robin (a list
of addresses, or one `ipv4:` target balanced by the channel), every output equals one target's own AR, and a target
that is SIGKILLed costs only the request streaming from it: new requests all succeed on the other one."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import subprocess
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from dspark_grpc.client import AsyncTargetClient, RequestError, TargetClient
from dspark_grpc.client.cli import main as dspark_main
from dspark_grpc.client.local_stack import local_target

PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,"]
TOKENS = 6
UNAVAILABLE = 14


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Target:
    def __init__(self, address: str, process: subprocess.Popen, metrics_url: str) -> None:
        self.address, self.process, self.metrics_url = address, process, metrics_url

    def finished_requests(self) -> int:
        """The target's own count of finished requests (its Prometheus counter, all modes)."""
        text = urllib.request.urlopen(self.metrics_url, timeout=60).read().decode()
        return int(sum(float(v) for v in re.findall(r'^dspark:requests_total\{[^}]*\} (\S+)$', text, re.M)))


@pytest.fixture(scope="module")
def targets():
    """Two targets (the default model, exact precision, no drafter), each with its metrics port."""
    with contextlib.ExitStack() as stack:
        started: list[Target] = []
        for _ in range(2):  # both load at once: a launch returns once its target listens
            process: list[subprocess.Popen] = []
            metrics_port = free_port()
            address = stack.enter_context(local_target(
                ["--quiet", "--no-cost-profile", "--precision", "exact", "--metrics-port", str(metrics_port)],
                echo=False, process=process))
            started.append(Target(address, process[-1], f"http://127.0.0.1:{metrics_port}/metrics"))
        for target in started:
            with TargetClient(target.address) as probe:
                probe.wait_ready(timeout=300)
        yield started


def run(client: TargetClient, prompts: list[str]) -> list[tuple[list[int], str]]:
    def one(prompt: str):
        r = client.generate(prompt, max_new_tokens=TOKENS, mode="ar")
        return r.token_ids, r.text

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


@pytest.fixture(scope="module")
def reference(targets) -> dict[str, tuple[list[int], str]]:
    """Each prompt's AR output from the first target alone (single-address client; the prompts at once)."""
    with TargetClient(targets[0].address) as single:
        return dict(zip(PROMPTS, run(single, PROMPTS), strict=True))


def test_a_list_of_targets_balances_requests_and_changes_no_output(targets, reference):
    prompts = PROMPTS * 4  # 16 concurrent requests
    before = [t.finished_requests() for t in targets]
    with TargetClient([t.address for t in targets]) as client:
        results = run(client, prompts)
        counted = dict(client.requests_by_target)
    assert results == [reference[p] for p in prompts]
    served = [t.finished_requests() - b for t, b in zip(targets, before, strict=True)]
    assert sum(served) == len(prompts) and min(served) > 0, served  # the targets' own counts
    assert counted == {t.address: 8 for t in targets}  # in turn: 8 each, none retried
    assert served == [8, 8]


def test_one_ipv4_target_with_both_addresses_balances_round_robin(targets, reference):
    """One channel for a name that stands for several servers (as `dns:///` does for a headless Service)."""
    before = [t.finished_requests() for t in targets]
    address = "ipv4:" + ",".join(t.address for t in targets)
    with TargetClient(address) as client:
        client.wait_ready(timeout=60)
        # round_robin spreads calls over the subchannels that are READY: wait (bounded) until both are, by
        # sending requests one after another until each target has served one
        for _ in range(50):
            if min(t.finished_requests() - b for t, b in zip(targets, before, strict=True)) > 0:
                break
            assert client.generate(PROMPTS[0], max_new_tokens=TOKENS, mode="ar").token_ids == reference[PROMPTS[0]][0]
        served = [t.finished_requests() - b for t, b in zip(targets, before, strict=True)]
        assert min(served) > 0, served
        results = run(client, PROMPTS * 4)
    assert results == [reference[p] for p in PROMPTS * 4]


def test_async_client_takes_the_list_too(targets, reference):
    async def go():
        async with AsyncTargetClient([t.address for t in targets]) as client:
            results = await asyncio.gather(*[client.generate(p, max_new_tokens=TOKENS, mode="ar") for p in PROMPTS])
            return [(r.token_ids, r.text) for r in results], dict(client.requests_by_target)

    results, counted = asyncio.run(go())
    assert results == [reference[p] for p in PROMPTS]
    assert counted == {t.address: 2 for t in targets}


def test_the_cli_takes_a_comma_separated_list(targets, reference, capsys):
    before = [t.finished_requests() for t in targets]
    for _ in targets:  # two requests from two runs: the first target of the list each time
        dspark_main(["generate", PROMPTS[0], "--target", ",".join(t.address for t in targets), "--mode", "ar",
                     "--max-new-tokens", str(TOKENS), "--json"])
        assert json.loads(capsys.readouterr().out)["token_ids"] == reference[PROMPTS[0]][0]
    assert [t.finished_requests() - b for t, b in zip(targets, before, strict=True)] == [2, 0]


def test_the_readme_example_runs(targets, capsys):
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    [snippet] = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "requests_by_target" in b]
    code = snippet.replace("10.0.0.1:50051", targets[0].address).replace("10.0.0.2:50051", targets[1].address)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    assert targets[0].address in capsys.readouterr().out


def test_a_killed_target_costs_only_the_request_streaming_from_it(targets, reference):
    """Runs last in this file: it kills one of the module's targets."""
    with TargetClient([t.address for t in targets]) as client:
        before = Counter(client.requests_by_target)
        stream = client.stream(PROMPTS[0], max_new_tokens=2000, ignore_eos=True, mode="ar")
        next(stream)  # streaming: its target is the one whose count went up
        (victim_address,) = (Counter(client.requests_by_target) - before).keys()
        victim = next(t for t in targets if t.address == victim_address)
        survivor = next(t for t in targets if t is not victim)
        victim.process.kill()
        victim.process.wait(timeout=60)
        with pytest.raises(RequestError) as failed:
            for _ in stream:
                pass
        assert failed.value.code == UNAVAILABLE, failed.value  # on its target, not moved to another

        counted = Counter(client.requests_by_target)
        survivor_before = survivor.finished_requests()
        prompts = PROMPTS * 4
        results = run(client, prompts)  # half of them go to the dead target first: retried on the next one
        assert results == [reference[p] for p in prompts]
        new = Counter(client.requests_by_target) - counted
        assert new == {survivor.address: len(prompts)}
        assert client.retries >= 1
        assert survivor.finished_requests() - survivor_before == len(prompts)
