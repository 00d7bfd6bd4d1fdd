"""Concurrent requests through the real services: batched target forwards must not mix sessions up, every mode
gives AR's tokens at any concurrency, and the start-up cost tables are published and reloaded on a second start."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from dspark_grpc.client import TargetClient
from dspark_grpc.client.local_stack import local_target
from dspark_grpc.protos.dspark.v1 import target_pb2, target_pb2_grpc
from dspark_grpc.speculation.channel import make_channel

from tests.service.conftest import SLOW_MACHINE_DRAFT_TIMEOUT

PROMPTS = [
    "List three uses of copper.",
    "Write a Python function that reverses a string.",
    "Why do cats purr?",
    "The history of the printing press",
]
NEW_TOKENS = 24


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


def test_every_mode_at_concurrency_gives_ar_tokens(target_address, draft_address):
    with TargetClient(target_address, drafter=draft_address, draft_timeout=SLOW_MACHINE_DRAFT_TIMEOUT) as client:
        reference = _generate_all(client, 1, mode="ar")
        for options in (dict(mode="speculation"), dict(mode="speculation", proposal="tree", proposer="hybrid"),
                        dict(mode="adaptive")):
            assert _generate_all(client, 3, **options) == reference, options


def _verify_costs(address: str) -> list:
    channel = make_channel(address)
    try:
        return list(target_pb2_grpc.TargetServiceStub(channel).GetModelInfo(target_pb2.GetModelInfoRequest(),
                                                                            timeout=30).verify_costs)
    finally:
        channel.close()


def test_cost_tables_are_published_monotone_and_are_what_the_cache_holds(tmp_path, tiny_hf_models, smollm2_path):
    """Two starts on one cache: each publishes monotone tables (in rows and in sessions) equal to the cache's files.
    Whether the second start reused them depends on a timing spot check (tests/test_cost_table.py tests reuse and
    re-profiling deterministically, on a fake spot check)."""
    from dspark_grpc.runtime.tokenizer import TextTokenizer
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
