"""Concurrent requests through the real services: batched target forwards must not mix sessions up, every mode
gives AR's tokens at any concurrency, and the start-up cost tables are published and reloaded on a second start."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from dspark_grpc.client import TargetClient
from dspark_grpc.client.local_stack import local_target
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2, target_pb2_grpc
from dspark_grpc.speculation.channel import make_channel

from tests.service.conftest import RawSession

PROMPTS = [
    "List three uses of copper.",
    "Write a Python function that reverses a string.",
    "Why do cats purr?",
    "The history of the printing press",
]
NEW_TOKENS = 16


def _generate_all(client: TargetClient, concurrency: int, **options) -> list[list[int]]:
    def one(prompt: str) -> list[int]:
        return client.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, **options).token_ids

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, PROMPTS))


def test_concurrent_ar_requests_get_the_tokens_each_gets_alone(target_address):
    with TargetClient(target_address) as client:
        alone = _generate_all(client, 1, mode="ar")
        together = _generate_all(client, len(PROMPTS), mode="ar")
    assert together == alone
    assert len({tuple(t) for t in alone}) == len(PROMPTS)  # different prompts, different outputs: a mix-up shows


@pytest.fixture(scope="module")
def spec_reference(spec_target_address) -> list[list[int]]:
    """AR's tokens for PROMPTS from the speculating target, one request at a time (for every test below)."""
    with TargetClient(spec_target_address) as client:
        return _generate_all(client, 1, mode="ar")


def test_every_mode_at_concurrency_gives_ar_tokens(spec_target_address, spec_reference):
    reference = spec_reference
    with TargetClient(spec_target_address) as client:
        for options in (dict(mode="speculation"), dict(mode="adaptive"),
                        dict(mode="speculation", proposal="tree", proposer="hybrid", budget=6)):
            assert _generate_all(client, 3, **options) == reference, options


@pytest.fixture(scope="module")
def round_of_four(spec_target_address, spec_reference
                  ) -> tuple[list[list[int]], list[list[int]], list[list[target_pb2.StepReport]]]:
    """Four sessions (mode speculation, the random drafter, greedy) opened and prefilled one by one, then stepped
    from four threads that send their first Steps together: (AR's tokens, each session's tokens, its reports)."""
    reference = spec_reference
    n = len(PROMPTS)
    sessions = [RawSession(spec_target_address) for _ in range(n)]  # one stream each, as n clients would
    try:
        sids, tokens = [], []
        for raw, prompt in zip(sessions, PROMPTS, strict=True):
            opened = raw.ok(open=target_pb2.OpenSession(step_options=target_pb2.StepOptions(
                mode=common_pb2.DECODE_MODE_SPECULATION)))
            assert opened.step_mode == common_pb2.DECODE_MODE_SPECULATION, opened.fallback_reason
            pre = raw.ok(prefill=target_pb2.Prefill(session_id=opened.session_id,
                                                    prompt=common_pb2.Prompt(text=prompt)))
            sids.append(opened.session_id)
            tokens.append([pre.next_token])
        together = threading.Barrier(n)

        def steps(i: int) -> list[target_pb2.StepReport]:
            reports = []
            together.wait(timeout=60)
            while len(tokens[i]) < NEW_TOKENS:
                stepped = sessions[i].ok(step=target_pb2.Step(session_id=sids[i]))
                tokens[i] += [*stepped.tokens[1:], stepped.next_token]
                reports.append(stepped.report)
            return reports

        with ThreadPoolExecutor(max_workers=n) as pool:
            reports = list(pool.map(steps, range(n)))
    finally:
        for raw in sessions:
            raw.close()
    return reference, [t[:NEW_TOKENS] for t in tokens], reports


def test_concurrent_speculative_steps_give_ar_tokens(round_of_four):
    reference, tokens, reports = round_of_four
    assert tokens == reference
    assert all(r.draft_depth >= 1 and r.fallback_reason == "" for rs in reports for r in rs)


def test_a_round_of_steps_verifies_in_one_forward(round_of_four):
    """The first Steps of the four sessions, sent together: whichever of them form a round (which do depends on
    when each arrives; tests/test_draft_rounds.py shows, with a gate, that steps queued together are one round)
    draft in one drafter pass and verify in one target forward (the target's batcher waits for every session of a
    round: StepBatcher.expect), so each forward holds at least the sessions of its round."""
    first = [rs[0] for rs in round_of_four[2]]
    assert all(r.draft_batch_sessions >= 1 and r.batch_sessions >= r.draft_batch_sessions for r in first), \
        [(r.draft_batch_sessions, r.batch_sessions, r.batch_rows) for r in first]


def _verify_costs(address: str) -> list:
    channel = make_channel(address)
    try:
        return list(target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(target_pb2.GetModelInfoRequest(),
                                                                            timeout=60).verify_costs)
    finally:
        channel.close()


def test_cost_tables_are_published_monotone_and_are_what_the_cache_holds(tmp_path, tiny_hf_models, smollm2_path):
    """Two starts on one cache: each publishes monotone tables (in rows and in sessions) equal to the cache's files.
    Whether the second start reused them depends on a timing spot check (tests/test_cost_table.py tests reuse and
    re-profiling deterministically, on a fake spot check)."""
    from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
    from dspark_grpc.speculation.cost_table import CostTable, lanes_problem

    model = tiny_hf_models["qwen3"]  # a tiny model: loading and profiling it take a fraction of SmolLM2's time
    TextTokenizer.from_gguf(smollm2_path).save(model)
    cache = tmp_path / "costs"
    for _ in range(2):
        with local_target(["--model", str(model), "--cost-cache", str(cache), "--quiet"], echo=False) as address:
            with TargetClient(address) as client:
                client.wait_ready(timeout=300)
            published = _verify_costs(address)
        assert [t.lanes for t in published] == [1, 2, 4, 8]
        for t in published:
            assert list(t.sizes) == [1, 2, 4, 8, 16]
            assert all(a <= b for a, b in zip(t.seconds, t.seconds[1:], strict=False)) and t.seconds[0] > 0
        cached = sorted((CostTable.load(f) for f in cache.iterdir()), key=lambda t: t.key.lanes)
        assert len(cached) == 4 and lanes_problem(cached) is None
        assert [list(t.seconds) for t in published] == [t.seconds for t in cached]
