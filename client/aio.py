"""The asyncio SDK: the same generation as TargetClient, awaitable, without blocking the event loop.

Each request's (synchronous) Generate stream is read in a worker thread, so many requests can be in flight from one
event loop. Cancelling a request (task.cancel(), asyncio.wait_for / timeout) cancels its call at once: the read under
way fails fast, the target frees the session.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from dspark_grpc.client.sdk import DEFAULT_TARGET, GenerationResult, TargetClient
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2


class AsyncTargetClient:
    """asyncio twin of TargetClient: same constructor arguments (one address or several, balanced the same way),
    same generate/stream arguments."""

    def __init__(self, address: str | Sequence[str] = DEFAULT_TARGET, **kwargs) -> None:
        self._client = TargetClient(address, **kwargs)

    @property
    def requests_by_target(self):
        return self._client.requests_by_target

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

    async def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        stats = common_pb2.GenerationStats()
        text, ids, finish = [], [], None
        async for t, toks, reason in self.stream(prompt, stats=stats, **kwargs):
            finish = reason
            text.append(t)
            ids.extend(toks)
        return GenerationResult("".join(text), ids, finish or "", stats)

    async def stream(self, prompt: str | None = None, **kwargs) -> AsyncIterator[tuple[str, list[int], str | None]]:
        """Yields (text, token_ids, finish_reason or None) as tokens are committed; leaving early (break,
        cancellation) ends the request and frees its sessions."""
        calls: list = []
        steps = self._client.stream(prompt, _calls=calls, **kwargs)
        # one thread per request runs its steps; its own future tells whether a step is still running after the
        # awaiting task was cancelled (the asyncio wrapper is cancelled at once, the thread is not)
        worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dspark-aio")
        step = None
        try:
            while True:
                step = worker.submit(next, steps, None)
                item = await asyncio.wrap_future(step)
                if item is None:
                    return
                yield item
        finally:
            if step is not None and not step.done():  # cancelled mid-read: cancel the call, so it fails now
                for call in list(calls):
                    call.cancel()
                try:
                    await asyncio.shield(asyncio.wrap_future(step))
                except BaseException:  # noqa: BLE001 - the step's error is the cancellation's consequence
                    pass
            await asyncio.wrap_future(worker.submit(steps.close))
            worker.shutdown(wait=False)
