"""The asyncio SDK: the same generation as TargetClient, awaitable, without blocking the event loop.

Each step of the (synchronous, gRPC-stream driven) generation loop runs in a worker thread, so many requests can
be in flight from one event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from dspark_grpc.client.sdk import DEFAULT_TARGET, GenerationResult, TargetClient
from dspark_grpc.protos.dspark.v1 import draft_pb2, target_pb2


class AsyncTargetClient:
    """asyncio twin of TargetClient: same constructor arguments, same generate/stream arguments."""

    def __init__(self, address: str = DEFAULT_TARGET, **kwargs) -> None:
        self._client = TargetClient(address, **kwargs)

    async def __aenter__(self) -> AsyncTargetClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.to_thread(self._client.close)

    async def wait_ready(self, timeout: float = 120.0) -> None:
        await asyncio.to_thread(self._client.wait_ready, timeout)

    async def model_info(self) -> target_pb2.GetModelInfoResponse:
        return await asyncio.to_thread(self._client.model_info)

    async def drafter_info(self) -> draft_pb2.GetDrafterInfoResponse:
        return await asyncio.to_thread(self._client.drafter_info)

    async def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        return await asyncio.to_thread(self._client.generate, prompt, **kwargs)

    async def stream(self, prompt: str | None = None, **kwargs) -> AsyncIterator[tuple[str, list[int], str | None]]:
        """Yields (text, token_ids, finish_reason or None) as tokens are committed; leaving early (break,
        cancellation) ends the request and frees its sessions."""
        steps = self._client.stream(prompt, **kwargs)
        step = None
        try:
            while True:
                step = asyncio.ensure_future(asyncio.to_thread(next, steps, None))
                item = await step
                step = None
                if item is None:
                    return
                yield item
        finally:
            if step is not None:  # cancelled mid-step: the step finishes in its thread before the stream closes
                try:
                    await asyncio.shield(step)
                except BaseException:  # noqa: BLE001
                    pass
            await asyncio.to_thread(steps.close)
