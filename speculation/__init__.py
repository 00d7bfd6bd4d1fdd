"""The torch-free speculation layer, below the SDK and the services: the generation loop over the session
protocol, the cost model, the adaptive planner, channels and metrics."""
