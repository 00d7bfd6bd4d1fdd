"""KV caches that live in one preallocated store per layer, [slots, num_kv_heads, capacity, head_dim].

A compiled step (runtime/kernels/compiled_step.py) reads and writes every sequence of a batch through one fixed set of
tensors: each sequence owns a slot, its rows are written by index and its keys gathered by slot. A `SlotCache`
is a KVCache whose per-layer rows are views of its slot, so the eager paths (prompt chunks, commit compaction,
rollback) work on it unchanged. The store grows by doubling (slots or capacity; capacity in BUCKET multiples,
kept above every sequence's length so a step never reads past it); a slot is freed when its cache is collected.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence

import torch
from dspark_grpc.runtime.models.batch_invariant import BUCKET
from dspark_grpc.runtime.models.config import ModelConfig
from dspark_grpc.runtime.models.kv_cache import KVCache


class WaitedLock:
    """A reentrant lock that counts the threads waiting for it: a thread that takes it in turns (a prompt chunk, a
    layer at a time) lets them in between two turns (`let_waiters_in`); a plain RLock would go back to whoever
    releases it and takes it again at once, and a session's commit would wait for the whole chunk."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._changed = threading.Condition(threading.Lock())
        self.waiting = 0

    def acquire(self) -> None:
        if self._lock.acquire(blocking=False):
            return
        with self._changed:
            self.waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._changed:
                self.waiting -= 1
                self._changed.notify_all()

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> WaitedLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def let_waiters_in(self, timeout_s: float) -> None:
        """Until every thread now waiting has taken the lock (at most `timeout_s`); call it without holding it."""
        with self._changed:
            self._changed.wait_for(lambda: self.waiting == 0, timeout_s)


class SlotStore:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str | None = None,
                 slots: int = 4, capacity: int = 256) -> None:
        assert not config.linear_layers, "a hybrid model's caches hold recurrent states, not only K/V rows"
        assert capacity % BUCKET == 0, capacity
        self.num_layers, self.num_kv_heads, self.head_dim = config.num_layers, config.num_kv_heads, config.head_dim
        self.dtype, self.device = dtype, device
        shape = (slots, self.num_kv_heads, capacity, self.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        self._free = list(range(slots))
        # Growing replaces every tensor: a forward or commit in flight (the batcher's thread) would write to the
        # old ones while a session opens on another thread. Everything that uses or grows the store holds this.
        self.lock = WaitedLock()

    @property
    def slots(self) -> int:
        return self.k[0].shape[0]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    @property
    def in_use(self) -> int:
        return self.slots - len(self._free)

    def acquire(self) -> int:
        with self.lock:
            if not self._free:
                old = self.slots
                self._grow(slots=2 * old)
                self._free = list(range(old, 2 * old))
            return self._free.pop(0)

    def release(self, slot: int) -> None:
        with self.lock:
            for t in self.k + self.v:
                t[slot].zero_()  # rows past a sequence's length are read masked: keep them finite
            self._free.append(slot)

    def reserve(self, rows: int) -> None:
        """Capacity strictly above `rows` (a step's keys are a prefix shorter than the capacity)."""
        with self.lock:
            if rows >= self.capacity:
                capacity = self.capacity
                while capacity <= rows:
                    capacity *= 2
                self._grow(capacity=capacity)

    def _grow(self, slots: int | None = None, capacity: int | None = None) -> None:
        slots, capacity = slots or self.slots, capacity or self.capacity
        for store in (self.k, self.v):
            for i, old in enumerate(store):
                new = old.new_zeros(slots, self.num_kv_heads, capacity, self.head_dim)
                new[: old.shape[0], :, : old.shape[2]] = old
                store[i] = new


class SlotCache(KVCache):
    """A KVCache whose layer i rows are `store.k[i][slot]`, `store.v[i][slot]` (views: the store may grow)."""

    def __init__(self, store: SlotStore, max_length: int) -> None:
        if max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {max_length}")
        self.store = store
        self.num_layers, self.num_kv_heads, self.head_dim = store.num_layers, store.num_kv_heads, store.head_dim
        self.max_length, self.dtype = max_length, store.dtype
        self.length, self.pending, self.pending_parents = 0, 0, None
        self.slot = store.acquire()
        weakref.finalize(self, store.release, self.slot)

    @property
    def k(self) -> list[torch.Tensor]:
        return [t[self.slot] for t in self.store.k]

    @property
    def v(self) -> list[torch.Tensor]:
        return [t[self.slot] for t in self.store.v]

    @property
    def capacity(self) -> int:
        return self.store.capacity - 1

    def _resize(self, capacity: int) -> None:
        self.store.reserve(capacity)

    def commit(self, rows: Sequence[int] | torch.Tensor) -> None:
        with self.store.lock:
            super().commit(rows)
