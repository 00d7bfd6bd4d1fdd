"""Model math (torch): checkpoint readers, the transformer and its compiled step, KV caches, tree decode, sampling
and acceptance, the drafter and its heads, prompt lookup, training. No serving here (that is dspark_grpc.serving)."""
