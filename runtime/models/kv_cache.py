"""Per-sequence KV cache: committed rows, then the pending rows of the last forward, compacted on commit."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from dspark_grpc.runtime.models.batch_invariant import BUCKET
from dspark_grpc.runtime.models.config import ModelConfig
from dspark_grpc.runtime.models.linear_attention import PendingRows, delta_rule


class CacheFullError(ValueError):
    """A forward would take the cache past its max_length."""


def _storage(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device | str | None) -> torch.Tensor:
    """Zeros [H, n, D] as a view of [H, n rounded up to BUCKET, D]: batch-invariant attention reads the rows past
    the written ones, masked, up to its padded key length (runtime/models/batch_invariant.py); they must be finite."""
    h, n, d = shape
    return torch.zeros(h, -(-n // BUCKET) * BUCKET, d, dtype=dtype, device=device)[:, :n]


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
        self.k = [_storage(shape, dtype, device) for _ in range(num_layers)]
        self.v = [_storage(shape, dtype, device) for _ in range(num_layers)]

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
                new = _storage((self.num_kv_heads, capacity, self.head_dim), old.dtype, old.device)
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

    def can_rollback(self, new_length: int) -> bool:
        """Whether `rollback(new_length)` can restore that length (HybridCache keeps only recent states)."""
        return 0 <= new_length <= self.length

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


class LinearState:
    """One linear-attention layer's state for one sequence (runtime/models/linear_attention.py): the committed recurrent
    state [Hv, dk, dv] (float32) and conv window [K-1, C], and the last forward's rows, pending until a commit.

    The pending rows keep every row's state while that costs at most `budget` bytes (drafts and AR steps); above
    it (a large tree, a long chain draft) they keep the delta rule's per-row inputs instead, and a commit runs the
    rule again along the committed path (a few small ops per row, against T states held in memory). A long chain
    run in chunks (a prefill chunk) keeps only its last rows' states: enough to commit it whole."""

    def __init__(self, num_v_heads: int, k_dim: int, v_dim: int, conv_dim: int, kernel: int, dtype: torch.dtype,
                 device: torch.device | str | None, budget: int) -> None:
        self.state = torch.zeros(num_v_heads, k_dim, v_dim, dtype=torch.float32, device=device)
        self.conv = torch.zeros(kernel - 1, conv_dim, dtype=dtype, device=device)
        self.budget = budget
        self.pending: PendingRows | None = None

    def keeps_states(self, rows: int) -> bool:
        return rows * self.state.numel() * self.state.element_size() <= self.budget

    def set_pending(self, pending: PendingRows) -> None:
        T = len(pending.parents)
        assert pending.windows.shape == (T, self.conv.shape[0] + 1), (pending.windows.shape, T)
        assert pending.states is None or pending.states.shape == (T - pending.first_state, *self.state.shape), (
            pending.states.shape, T)
        self.pending = pending

    def path_states(self, path: Sequence[int], last: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(state, conv window) after each of the `last` final rows of `path`, a root-to-node path of the pending
        rows (copies: the pending rows can be freed)."""
        p = self.pending
        assert p is not None
        if any(p.parents[b] != a for a, b in zip([-1, *path], path, strict=False)):
            raise ValueError(f"rows {list(path)} are not a root-to-node path of the pending rows {p.parents}: a "
                             "linear-attention layer can only commit one")
        tail = list(path[len(path) - last :]) if last else []
        if p.states is not None and all(r >= p.first_state for r in tail):
            states = [p.states[r - p.first_state] for r in tail]
        else:
            assert p.rule is not None
            states, S = [], self.state[None]
            for j, r in enumerate(path):
                S, _ = delta_rule(S, *(t[r : r + 1] for t in p.rule))
                if j >= len(path) - len(tail):
                    states.append(S[0])
        windows = p.windows.to(p.inputs.device)
        return [(S.clone(), p.inputs.index_select(0, windows[r, 1:])) for S, r in zip(states, tail, strict=True)]

    def reset(self) -> None:
        self.state, self.conv = torch.zeros_like(self.state), torch.zeros_like(self.conv)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.state, self.conv))


class HybridCache(KVCache):
    """KV rows for the attention layers plus a LinearState per linear-attention layer (Qwen3.5).

    Commit keeps the state of the accepted path's last row. Rollback needs the recurrent state at the earlier
    length: the cache keeps copies at the last `snapshot_window` committed lengths (and length 0 is the zero
    state); `can_rollback` says whether a length is among them, otherwise the caller recomputes from the tokens
    (target_service/engine.py re-prefills). Memory per linear layer: a state per snapshot, and a forward's
    pending rows (their states up to `pending_state_bytes`, see LinearState).
    """

    def __init__(self, config: ModelConfig, max_length: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, initial_capacity: int = 256,
                 snapshot_window: int = 8, pending_state_bytes: int = 16 << 20) -> None:
        attention = [i for i in range(config.num_layers) if not config.is_linear(i)]
        if not attention:
            raise ValueError("a hybrid cache needs at least one attention layer")
        super().__init__(len(attention), config.num_kv_heads, config.head_dim, max_length, dtype, device,
                         initial_capacity)
        self.slots = {layer: j for j, layer in enumerate(attention)}
        c = config
        conv_dim = (2 * c.linear_num_key_heads * c.linear_key_head_dim
                    + c.linear_num_value_heads * c.linear_value_head_dim)
        self.linear = {i: LinearState(c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                                      conv_dim, c.linear_conv_kernel, dtype, device, pending_state_bytes)
                       for i in c.linear_layers}
        self.snapshot_window = snapshot_window
        self.snapshots: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    @property
    def nbytes(self) -> int:
        snapshots = sum(s.numel() * s.element_size() + w.numel() * w.element_size()
                        for snap in self.snapshots.values() for s, w in snap.values())
        return super().nbytes + sum(s.nbytes for s in self.linear.values()) + snapshots

    def layer(self, index: int) -> LayerKV | LinearState:
        return self.linear[index] if index in self.linear else LayerKV(self, self.slots[index])

    def discard(self) -> None:
        super().discard()
        for s in self.linear.values():
            s.pending = None

    def commit(self, rows: Sequence[int] | torch.Tensor) -> None:
        """Keep pending rows `rows` (a root-to-node path of the last forward's tree); the recurrent states become
        those after its last row."""
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        if any(not 0 <= r < self.pending for r in rows):
            raise ValueError(f"commit rows {rows} out of range for {self.pending} pending rows")
        start = self.length
        kept: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        if rows:
            last = min(len(rows), max(1, self.snapshot_window))
            for i, s in self.linear.items():
                for j, pair in enumerate(s.path_states(rows, last), start=len(rows) - last):
                    kept.setdefault(start + j + 1, {})[i] = pair
        super().commit(rows)  # validates the rows before changing anything, then discards the pending rows
        if kept:
            for i, s in self.linear.items():
                s.state, s.conv = kept[self.length][i]
            self.snapshots.update(kept)
            for length in [n for n in self.snapshots if n <= self.length - self.snapshot_window]:
                del self.snapshots[length]

    def can_rollback(self, new_length: int) -> bool:
        return new_length == 0 or new_length == self.length or new_length in self.snapshots

    def rollback(self, new_length: int) -> None:
        if not 0 <= new_length <= self.length:
            raise ValueError(f"rollback to {new_length} outside [0, {self.length}]")
        if not self.can_rollback(new_length):
            raise ValueError(f"no recurrent state kept for length {new_length} (the last {self.snapshot_window} "
                             "committed lengths are kept): recompute it from the tokens")
        if new_length == 0:
            for s in self.linear.values():
                s.reset()
        elif new_length != self.length:
            for i, s in self.linear.items():
                state, conv = self.snapshots[new_length][i]
                s.state, s.conv = state.clone(), conv.clone()
        for length in [n for n in self.snapshots if n > new_length]:
            del self.snapshots[length]
        super().rollback(new_length)
