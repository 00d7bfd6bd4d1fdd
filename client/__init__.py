"""dspark-grpc client SDK (torch-free): `TargetClient(address, mode="adaptive").generate(...)`, or the asyncio twin
`AsyncTargetClient`. The target speculates with the draft service it was started with; the client talks to the
target only."""

from dspark_grpc.client.aio import AsyncTargetClient
from dspark_grpc.client.sdk import GenerationResult, TargetClient
from dspark_grpc.speculation.generation import RequestError

__all__ = ["AsyncTargetClient", "GenerationResult", "RequestError", "TargetClient"]
