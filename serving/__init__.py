"""What both services run their models with: the step batcher, the session store, the tensor codec, the gRPC server
skeleton (health, reflection, security, shutdown), the start-up profilers, the thread governor and service metrics.
Above the model math (dspark_grpc.runtime), below the services."""
