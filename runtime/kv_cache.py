"""Per-sequence KV cache: committed rows, then the pending rows of the last forward, compacted on commit."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import ModelConfig


class CacheFullError(ValueError):
    """A forward would take the cache past its max_length."""


class KVCache:
    """K/V rows of one sequence for every layer, stored as [num_kv_heads, capacity, head_dim].

    Rows [0, length) are committed. A forward writes its T rows at [length, length + T) as pending rows;
    `commit` keeps some of them (compacted right after the committed rows), `discard` drops them, and the
    next forward replaces them. Storage grows by doubling, up to max_length rows.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_length: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        initial_capacity: int = 256,
    ) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.max_length = max_length
        self.dtype = dtype
        self.length = 0
        self.pending = 0
        # Parents of the pending rows when a tree verify wrote them (decode.verify_tree); None: a chain.
        self.pending_parents: list[int] | None = None
        capacity = min(initial_capacity, max_length)
        shape = (num_kv_heads, capacity, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_config(
        cls,
        config: ModelConfig,
        max_length: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        initial_capacity: int = 256,
    ) -> KVCache:
        max_length = config.max_position_embeddings if max_length is None else max_length
        return cls(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            max_length,
            dtype,
            device,
            initial_capacity,
        )

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def begin(self, num_new: int) -> int:
        """Make room for `num_new` pending rows (dropping older pending ones); return the committed length."""
        if num_new < 1:
            raise ValueError(f"a forward needs at least one token, got {num_new}")
        needed = self.length + num_new
        if needed > self.max_length:
            raise CacheFullError(f"sequence would reach {needed} tokens, over the cache's max_length {self.max_length}")
        self.discard()
        if needed > self.capacity:
            capacity = self.capacity
            while capacity < needed:
                capacity *= 2
            self._resize(min(capacity, self.max_length))
        self.pending = num_new
        return self.length

    def _resize(self, capacity: int) -> None:
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                new = old.new_empty((self.num_kv_heads, capacity, self.head_dim))
                new[:, : self.length] = old[:, : self.length]
                store[i] = new

    def layer(self, index: int) -> LayerKV:
        return LayerKV(self, index)

    def commit(self, rows: Sequence[int] | torch.Tensor) -> None:
        """Keep pending rows `rows` (0-based within the last forward, strictly increasing); drop the rest."""
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        if any(not 0 <= r < self.pending for r in rows):
            raise ValueError(f"commit rows {rows} out of range for {self.pending} pending rows")
        if any(a >= b for a, b in zip(rows, rows[1:], strict=False)):
            raise ValueError(f"commit rows {rows} must be strictly increasing")
        n = len(rows)
        if rows != list(range(n)):
            src = torch.tensor(rows, dtype=torch.long, device=self.k[0].device) + self.length
            for store in (self.k, self.v):
                for t in store:
                    t[:, self.length : self.length + n] = t.index_select(1, src)
        self.length += n
        self.discard()

    def discard(self) -> None:
        self.pending = 0
        self.pending_parents = None

    def rollback(self, new_length: int) -> None:
        """Forget committed rows from `new_length` on (and any pending rows)."""
        if not 0 <= new_length <= self.length:
            raise ValueError(f"rollback to {new_length} outside [0, {self.length}]")
        self.length = new_length
        self.discard()


class LayerKV:
    """One layer's view of a KVCache: `update` stores the pending rows and returns all rows to attend to."""

    def __init__(self, cache: KVCache, index: int) -> None:
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cache
        assert k.shape == v.shape == (c.num_kv_heads, c.pending, c.head_dim), (k.shape, c.pending)
        end = c.length + c.pending
        kc, vc = c.k[self.index], c.v[self.index]
        kc[:, c.length : end] = k
        vc[:, c.length : end] = v
        return kc[:, :end], vc[:, :end]
