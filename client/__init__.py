"""dspark-grpc client SDK (torch-free): `TargetClient(address).generate(...)`."""

from dspark_grpc.client.generation import RequestError
from dspark_grpc.client.sdk import GenerationResult, TargetClient

__all__ = ["GenerationResult", "RequestError", "TargetClient"]
