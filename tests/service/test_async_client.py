"""The asyncio SDK gives the sync SDK's results and runs requests concurrently on one event loop."""

from __future__ import annotations

import asyncio

from dspark_grpc.client import AsyncTargetClient, TargetClient

from tests.service.conftest import concurrently

QUESTIONS = ["Name three colours.", "What is 2 + 2?", "Say hello in Spanish."]


def test_async_generate_and_stream_match_sync(target_address, spec_target_address):
    with TargetClient(target_address) as sync:  # the sync SDK's requests from threads, at once
        expected = concurrently(lambda q: sync.generate(messages=[{"role": "user", "content": q}], max_new_tokens=20,
                                                        mode="ar"), QUESTIONS)

    async def run():
        async with AsyncTargetClient(spec_target_address) as client:
            await client.wait_ready(60)
            results = await asyncio.gather(*[
                client.generate(messages=[{"role": "user", "content": q}], max_new_tokens=20, mode="speculation")
                for q in QUESTIONS])
            streamed = []
            async for text, ids, finish in client.stream(messages=[{"role": "user", "content": QUESTIONS[0]}],
                                                         max_new_tokens=20):
                streamed.append((text, ids, finish))
            # leaving a stream early ends the request cleanly
            async for _ in client.stream(messages=[{"role": "user", "content": QUESTIONS[1]}], max_new_tokens=50):
                break
            return results, streamed

    results, streamed = asyncio.run(run())
    for got, want in zip(results, expected, strict=True):
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert got.stats.speculative_steps > 0
    assert "".join(t for t, _, _ in streamed) == expected[0].text
    assert [i for _, ids, _ in streamed for i in ids] == expected[0].token_ids
    assert streamed[-1][2] == expected[0].finish_reason
