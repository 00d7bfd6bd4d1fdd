"""dspark-grpc: lossless DSpark speculative decoding served as a target/drafter gRPC pair.

Subpackages: `protos` (generated dspark.v1 stubs), `speculation` (torch-free: the step loop, cost model, planners,
errors), `client` (the SDK; torch-free), `runtime` (model math both services share), `serving` (batcher, sessions,
codec, gRPC skeleton, profilers), `target_service`, `draft_service`.
"""

__version__ = "0.1.0"
