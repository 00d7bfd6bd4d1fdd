"""dspark-grpc: lossless DSpark speculative decoding served as a target/drafter gRPC pair.

Subpackages: `protos` (generated dspark.v1 stubs), `client` (the SDK; torch-free), `runtime` (model code both
services share), `target_service`, `draft_service`.
"""

__version__ = "0.1.0"
