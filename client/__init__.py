"""dspark-grpc client SDK (torch-free): `TargetClient(address, drafter=...).generate(...)`, or the asyncio twin
`AsyncTargetClient`."""

from dspark_grpc.client.aio import AsyncTargetClient
from dspark_grpc.client.sdk import GenerationResult, TargetClient
from dspark_grpc.speculation.generation import RequestError

__all__ = ["AsyncTargetClient", "GenerationResult", "RequestError", "TargetClient"]
