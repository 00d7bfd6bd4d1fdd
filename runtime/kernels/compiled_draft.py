"""The fast drafter's greedy chain as one compiled graph (torch.compile, inductor): one session's new context rows
projected to K/V, its block [anchor, MASK x (B-1)] through the draft layers against the context, the head, the Markov
chain and the confidences, in one call.

Eager, that pass is a few hundred small torch calls for a few hundred microseconds of arithmetic; the served drafter
round mostly paid their overhead (docs/PERFORMANCE.md). The graph computes what `project_waiting`,
`Drafter.forward_blocks` and `markov.draft_chains` compute, through the same functions (`Drafter.context_kv`,
`Drafter.draft_rows`, `greedy_chains`, `chain_confidences`), with the Markov biases computed rather than looked up in
the head's cache; fused kernels round differently, so a token may differ from the eager chain's where two logits
nearly tie. A draft is only a guess: the target's output never depends on it.

Only a lone session's greedy chain runs here, once its context holds projected rows and new ones wait (several
sessions' blocks in one pass, trees, sampled chains, a first round's prompt stay eager). Like the target's step
(runtime/kernels/compiled_step.py), the graph is compiled ahead of time with every size but the context lengths
fixed, saved under a key of what the trace depends on, and loaded at the next start.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from dspark_grpc.runtime.drafting.markov import Chain, chain_confidences, greedy_chains
from dspark_grpc.runtime.kernels.compiled_step import (
    COMPILE_MODES,
    compile_ahead,
    load_step,
    model_tensors,
    vector_isa,
)
from dspark_grpc.runtime.models.drafter import BlockKV
from dspark_grpc.runtime.models.linear import Linear
from dspark_grpc.runtime.models.transformer import Segment
from dspark_grpc.runtime.progress import still_working

if TYPE_CHECKING:
    from dspark_grpc.runtime.models.drafter import DraftContext, Drafter

# the example the graph is traced on: projected and new context rows (not 0 or 1, nor equal: those get specialized)
TRACE_CONTEXT, TRACE_NEW = 16, 3


def chain_graph(drafter: Drafter, ks: list[torch.Tensor], vs: list[torch.Tensor], new_rows: torch.Tensor,
                anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """ks/vs: each draft layer's projected context K/V [num_kv_heads, n, head_dim] (RoPE at 0..n-1); new_rows
    [m, m_layers * target_hidden] the context rows n..n+m-1 not projected yet; anchor [1] target id at position
    n + m -> the greedy chain's target ids [K], log-probs [K], confidences [K] (empty without a confidence head),
    and the new rows' K and V [num_layers, num_kv_heads, m, head_dim] for the cache."""
    c = drafter.config
    B, n, m = c.block_size, ks[0].shape[1], new_rows.shape[0]
    new = drafter.context_kv(new_rows, torch.arange(n, n + m, device=anchor.device))
    ks = [torch.cat([k, nk], dim=1) for k, (nk, _) in zip(ks, new, strict=True)]
    vs = [torch.cat([v, nv], dim=1) for v, (_, nv) in zip(vs, new, strict=True)]
    tokens = torch.cat([anchor, anchor.new_full((B - 1,), c.mask_token_id)])[None]
    positions = torch.arange(B, device=anchor.device) + n + m
    rows, post, logits = drafter.draft_rows(tokens, positions,
                                            lambda i: [Segment(0, B, None, BlockKV(ks[i], vs[i]))])
    g = greedy_chains(logits, anchor, drafter.markov, post, drafter.d2t, cached=False)
    conf = chain_confidences(drafter.confidence, rows, post, g.embeddings)
    return (g.tokens[0], g.logprobs[0], conf[0] if conf is not None else logits.new_zeros(0),
            torch.stack([k for k, _ in new]), torch.stack([v for _, v in new]))


def can_compile_drafter(drafter: Drafter) -> str | None:
    """Why this drafter's chain cannot be compiled, or None."""
    if drafter.device.type != "cpu":
        return "the compiled chain is built for the CPU"
    if any(t != "full_attention" for t in drafter.config.layer_types):
        return "sliding-window draft layers are not compiled"
    if any(isinstance(m, Linear) and m.packed is not None for m in drafter.modules()):
        return "oneDNN-packed projections are not compiled (the fast precision's Q8_0 blocks are)"
    return None


def artifact_key(drafter: Drafter, mode: str) -> str:
    """What a compiled chain depends on besides the weights' values."""
    h = hashlib.sha256()
    parts = [torch.__version__, sys.version, platform.machine(), torch.backends.cpu.get_cpu_capability(),
             vector_isa(), repr(drafter.config), str(drafter.dtype), mode]
    parts += [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in drafter.state_dict(keep_vars=True).items()]
    parts += [f"{type(t).__name__}:{tuple(t.shape)}:{t.dtype}" for t in model_tensors(drafter)]  # packed, quantized
    for part in parts:
        h.update(part.encode() + b"\0")
    runtime = Path(__file__).parents[1]
    for source in sorted([*runtime.glob("models/*.py"), *runtime.glob("kernels/*.py"), runtime / "drafting/markov.py"]):
        h.update(source.read_bytes())
    return h.hexdigest()[:20]


class CompiledChain:
    """A drafter's compiled greedy chain. `cache_dir`: where it is saved and looked up (None: compiled at every
    start); `mode` "max": inductor's C++ wrapper."""

    def __init__(self, drafter: Drafter, cache_dir: Path | None = None, mode: str = "max") -> None:
        reason = can_compile_drafter(drafter)
        if reason is not None:
            raise ValueError(reason)
        assert mode in COMPILE_MODES[1:], mode
        self.drafter, self.cache_dir, self.mode = drafter, cache_dir, mode
        self.graph = None
        self.source = ""  # "loaded" from cache_dir or "compiled" here

    def __getstate__(self) -> dict:
        return {}  # compiling pickles the traced module's state (see CompiledStep.__getstate__)

    @functools.cached_property
    def path(self) -> Path | None:
        key = artifact_key(self.drafter, self.mode)
        return None if self.cache_dir is None else self.cache_dir / f"draft-chain-{key}.bin"

    @torch.no_grad()
    def warm_up(self, progress: bool = True) -> float:
        """Load or compile the graph now, showing progress; returns the seconds it took."""
        t0 = time.perf_counter()
        compiling = progress and not (self.path is not None and self.path.exists())
        if compiling:
            print("[dspark] compiling the drafter's chain graph (once; a restart loads it from the cache)...",
                  file=sys.stderr, flush=True)
        with still_working("compiling the drafter's chain graph", every_s=15.0, enabled=compiling):
            c = self.drafter.config
            # one tensor per K and V: the graph must not be traced on aliased inputs
            context = [torch.zeros(c.num_kv_heads, TRACE_CONTEXT, c.head_dim, dtype=self.drafter.dtype)
                       for _ in range(2 * c.num_layers)]
            new_rows = torch.zeros(TRACE_NEW, c.fc_in_features, dtype=self.drafter.dtype)
            self._call(context[::2], context[1::2], new_rows, 0)
        seconds = time.perf_counter() - t0
        if progress:
            where = f"loaded from {self.path}" if self.source == "loaded" else (
                f"compiled, saved to {self.path}" if self.path is not None and self.path.exists() else "compiled")
            print(f"[dspark] drafter chain graph ready ({where}; {seconds:.1f} s)", file=sys.stderr, flush=True)
        return seconds

    @staticmethod
    def takes(context: DraftContext) -> bool:
        """Whether the graph drafts after `context`: some rows projected and some waiting."""
        return context.cache.length > 0 and bool(context.waiting)

    @torch.no_grad()
    def __call__(self, context: DraftContext, anchor_token: int) -> Chain:
        """The greedy chain of the block after `context` (`takes(context)`); its waiting rows are projected."""
        assert self.takes(context)
        n, dtype = context.cache.length, self.drafter.dtype
        cache = context.cache  # (its projected rows: DraftContext.layer_kv would project the waiting ones)
        # contiguous: the graph runs without guards, traced on contiguous K/V
        tokens, logprobs, conf, k_new, v_new = self._call(
            [k[:, :n].contiguous() for k in cache.k], [v[:, :n].contiguous() for v in cache.v],
            context.waiting_rows().to(dtype).contiguous(), anchor_token)
        context.store(list(zip(k_new, v_new, strict=True)))
        assert tokens.shape[0] == self.drafter.config.num_drafts
        return Chain(tokens.tolist(), logprobs, conf if conf.numel() else None)

    def _call(self, ks: list[torch.Tensor], vs: list[torch.Tensor], new_rows: torch.Tensor, anchor_token: int):
        args = (self.drafter, ks, vs, new_rows, torch.tensor([anchor_token]))
        if self.graph is None:
            self.graph = self._prepare(args)
        return self.graph(*args)

    def _prepare(self, args: tuple):
        chain_graph(*args)  # eagerly first: the Linears build their block weights on their first call
        path = self.path
        if path is not None and (graph := load_step(path)) is not None:
            self.source = "loaded"
            return graph
        for t in model_tensors(self.drafter):
            torch._dynamo.mark_static(t)
        for t in (*args[1], *args[2]):  # only the context lengths vary
            torch._dynamo.mark_static(t, 0)
            torch._dynamo.mark_static(t, 2)
        torch._dynamo.mark_static(args[3], 1)
        graph = compile_ahead(chain_graph, args, self.mode, path)
        self.source = "compiled"
        return graph
