"""The target and drafter networks: transformer (attention and linear-attention layers), caches, the batch-invariant
attention, the verify/commit of token trees."""
