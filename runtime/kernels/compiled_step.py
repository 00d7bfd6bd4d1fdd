"""The fast precision's decode step as one compiled graph (torch.compile, inductor): AR steps and verifies.

A step is R rows of any number of sequences, each sequence in its own slot of a SlotStore
(runtime/models/slot_cache.py).
Per layer the graph writes the rows' K/V into their slots by index and runs attention with every row as its own
batch element: the row's query against its slot's first C keys, masked by its mask row. So a row computes the
same thing whatever the other rows are, and C only adds masked keys. One graph serves every shape (dynamic R and C,
R = 1 not specialized): AR steps and verifies run the same code. Its only sizes are R, C, the logit rows and the
store's slot count and capacity: the model's tensors are marked static and every layer's buffer is tied to the first
layer's (each size is a graph argument, read in Python at every call). Batch invariance (a verify row equals its
1-row AR step bitwise) then rests on the kernels and on the inductor rounding every bf16 intermediate as eager does
(`emulate_precision_casts`; without it, fused kernels keep float32 intermediates and the two graphs fuse
differently). Attention is runtime/kernels/row_attention.cpp's kernel (each row against its slot's keys, read in place)
where
runtime/kernels/cpu_kernels.py builds, else two float32 matmuls over the gathered keys and a softmax; not SDPA: with
the CPU
flash kernel a row of a 5-row step at one position of a SmolLM2 run differed from its AR step (rows of 2-4 did not).
tests/runtime/test_compiled_step.py checks it for 1-row and wider steps, several C and tree masks.

Prompt chunks do not come here: the per-row gather of keys suits a few rows, not hundreds; they run eagerly
(the same for AR and speculation). Hybrid (linear-attention) models are not compiled.

The graph is compiled ahead of time (`aot_compile` of torch.compile: traced once, on a 2-row example so that no
size is specialized to one row) and saved in a cache directory under a key of everything the trace depends on
(torch, the CPU's instruction set, the model's config and tensor shapes, this package's model code): a restart
loads it instead of tracing and compiling again. The weights are not in it: they are read from the model at every
call. Guards are not checked per call (the step's inputs have one fixed structure), which also saves dynamo's
per-call guard evaluation.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from dspark_grpc.runtime.models.batch_invariant import BUCKET
from dspark_grpc.runtime.models.config import ModelConfig
from dspark_grpc.runtime.models.rope import rope_cos_sin, rotate_half
from dspark_grpc.runtime.models.slot_cache import SlotCache, SlotStore
from dspark_grpc.runtime.models.transformer import ForwardOutput, SequenceInput, window_mask
from dspark_grpc.runtime.progress import still_working

if TYPE_CHECKING:
    from dspark_grpc.runtime.models.transformer import Transformer

COMPILE_MODES = ("off", "fast", "max")  # max: inductor's C++ wrapper (a longer compile, a faster step)
WARMUP_ROWS = (2, 1)  # the graph is traced on the first (R = 1 would specialize it); the second checks R = 1


def step_graph(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
               write_rows: torch.Tensor, mask: torch.Tensor, logit_rows: torch.Tensor, rope: torch.Tensor,
               ks: list[torch.Tensor], vs: list[torch.Tensor], local_mask: torch.Tensor | None = None,
               local_rope: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens/positions/slots/write_rows [R]; mask [R, C] bool over the first C rows of each row's slot (its own
    new row included: rows are written before attention); logit_rows [N]; rope [2, max_positions, head_dim] (cos,
    sin: looked up, since a compiled cos differs in its last bits with the row's place in a vector). A model with
    sliding-window layers (Gemma 3) also takes their mask and RoPE table (`local_mask`, `local_rope`). Returns
    the normed rows [N, hidden] for the head, and every layer's output [R, num_layers, hidden]. The head runs
    after the graph: its oneDNN-packed weight (Transformer.lm_head) is faster than any matmul the graph makes."""
    c = model.config
    R, C = mask.shape
    H, KV, D = c.num_heads, c.num_kv_heads, c.head_dim
    assert (local_mask is None) == (local_rope is None) == (not c.sliding_window), c.sliding_window
    x = model.embed(tokens)
    ropes = {False: (rope[0, positions], rope[1, positions])}
    masks = {False: mask}
    if local_mask is not None:
        ropes[True], masks[True] = (local_rope[0, positions], local_rope[1, positions]), local_mask
    own_kernels = step_matmul(model) == "BlockWeight"  # runtime/kernels/cpu_kernels.py built
    biases = None if own_kernels else {  # [R, 1, 1, C]
        k: torch.where(m, 0.0, float("-inf"))[:, None, None, :] for k, m in masks.items()}
    for t in (*ks, *vs):  # one slot count and one capacity for all: two sizes for the step's caller to pass, not 120
        torch._check(t.shape[0] == ks[0].shape[0])
        torch._check(t.shape[2] == ks[0].shape[2])
    hidden = []
    for i, layer in enumerate(model.layers):
        a, sliding = layer.attention, c.is_sliding(i)
        cos, sin = ropes[sliding]
        h = layer.attention_norm(x)  # q/k/v of different block types (a mixed GGUF) stay three projections
        q, k, v = a.qkv(h) if a.qkv is not None else (a.wq(h), a.wk(h), a.wv(h))
        q, k, v = q.view(R, H, D), k.view(R, KV, D), v.view(R, KV, D)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        q, k = (t * cos[:, None] + rotate_half(t) * sin[:, None] for t in (q, k))
        if a.q_scale != 1.0:  # Gemma's query_pre_attn_scalar, as the eager model scales q
            q = q * a.q_scale
        if own_kernels:  # writes the rows' K/V too
            o = torch.ops.dspark.row_attention(q, k, v, ks[i], vs[i], slots, write_rows, masks[sliding])
        else:
            ks[i][slots, :, write_rows] = k
            vs[i][slots, :, write_rows] = v
            keys, values = ks[i][slots, :, :C], vs[i][slots, :, :C]  # [R, KV, C, D]
            scores = torch.matmul(q.view(R, KV, H // KV, D).float(), keys.float().transpose(-1, -2)) * D**-0.5
            o = torch.matmul(torch.softmax(scores + biases[sliding], dim=-1), values.float()).to(x.dtype)
        out = a.wo(o.reshape(R, H * D))
        h = x + (layer.post_attention_norm(out) if layer.post_attention_norm is not None else out)
        out = layer.feed_forward(layer.ffn_norm(h))
        x = h + (layer.post_ffn_norm(out) if layer.post_ffn_norm is not None else out)
        hidden.append(x)
    return model.norm(x[logit_rows]), torch.stack(hidden, dim=1)


def model_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every tensor a model's modules hold: parameters, buffers, and tensor attributes (packed weights, int4
    scales, in dataclasses too)."""
    found: dict[int, torch.Tensor] = {}

    def visit(value: object) -> None:
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), value)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                visit(getattr(value, field.name))
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for m in module.modules():
        for value in (*m._parameters.values(), *m._buffers.values(), *vars(m).values()):
            visit(value)
    return list(found.values())


def uncompiled_architecture(c: ModelConfig) -> str | None:
    """Why models of this shape never take the compiled step, or None."""
    if c.linear_layers:
        return "hybrid (linear-attention) models are not compiled"
    if c.attention_output_gate or (c.rotary_dim or c.head_dim) != c.head_dim:
        return "gated or partial-rotary attention is not compiled"
    return None


def can_compile(model: Transformer) -> str | None:
    """Why this model cannot take the compiled step, or None."""
    if reason := uncompiled_architecture(model.config):
        return reason
    if model.dtype != torch.bfloat16:
        return "only the fast precision (bf16 activations) is compiled"
    if step_matmul(model) not in ("BlockWeight", "Int4Weight"):
        return "the compiled step needs a packed model's matmuls on GGUF or bf16 blocks or torch's int4 kernel " \
               "(without the CPU kernels a float matrix runs row by row)"
    return None


def step_matmul(model: Transformer) -> str:
    """The kind of the q projection's matmul (the first layer's): "BlockWeight" (runtime/kernels/gguf_matmul.cpp),
    "Int4Weight" (torch's int4 kernel), else what it is ("none": not packed yet, or no quantized weight)."""
    a = model.layers[0].attention
    weight = a.qkv.quantized if a.qkv is not None else a.wq.quantized
    return type(weight).__name__ if weight is not None else "none"


def missing_compiler() -> str | None:
    """Why inductor cannot build the compiled step here (it generates C++ for the CPU), or None."""
    from torch._inductor import config, cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        names = " or ".join(c for c in config.cpp.cxx if c) if isinstance(config.cpp.cxx, tuple) else config.cpp.cxx
        return f"no C++ compiler found ({names} on PATH, or $CXX)"
    return None


def resolve_compile_mode(mode: str, precision: str, on_cpu: bool) -> tuple[str, str]:
    """--compile as the services take it -> (mode, why, for a start-up line). "auto": $DSPARK_COMPILE if set, else
    "max" with the fast precision on the CPU, else "off"; without a C++ compiler "auto" is "off" and another mode
    an error (ValueError)."""
    if mode != "auto":
        if mode != "off" and (missing := missing_compiler()):
            raise ValueError(f"--compile {mode} needs a C++ compiler: {missing} (install g++, or --compile off)")
        return mode, ""
    from_env = os.environ.get("DSPARK_COMPILE")
    if from_env is not None and from_env not in COMPILE_MODES:
        raise ValueError(f"DSPARK_COMPILE must be one of {', '.join(COMPILE_MODES)}, got {from_env!r}")
    mode = "off" if precision != "fast" or not on_cpu else (from_env or "max")
    why = "auto: $DSPARK_COMPILE" if from_env and precision == "fast" else "auto"
    if mode != "off" and (missing := missing_compiler()):
        mode, why = "off", f"auto: {missing}; eager, install g++ to compile"
    return mode, why


@functools.cache
def vector_isa() -> str:
    """The vector instruction set inductor writes the graphs' C++ kernels for ("" for none: scalar code, several
    times slower). Part of a saved graph's key: inductor decides it by building and loading a probe in a child
    Python (which, e.g., a module on the path shadowing a standard one breaks), and a graph compiled while that
    failed must not be the one every later start loads."""
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    if not isa and platform.machine() in ("x86_64", "AMD64"):
        print("[dspark] inductor found no usable vector instruction set on this x86 CPU (its probe failed to build or "
              "load): compiled graphs run scalar code, several times slower; check for a module that shadows a "
              "standard one on the Python path", file=sys.stderr, flush=True)
    return str(isa) if isa else ""


def artifact_key(model: Transformer, mode: str = "fast") -> str:
    """What a compiled step depends on besides the weights' values: a saved step with another key is not used."""
    h = hashlib.sha256()
    matmul = step_matmul(model)  # the GGUF block kernel or torch's int4
    parts = [torch.__version__, sys.version, platform.machine(), torch.backends.cpu.get_cpu_capability(),
             vector_isa(), repr(model.config), str(model.dtype), mode, matmul]
    parts += [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in model.state_dict(keep_vars=True).items()]
    # the blocks' types: the graph multiplies (and the embedding decodes) each in its own
    parts += [f"{name}:{m.blocks.qtype.name}" for name, m in model.named_modules()
              if getattr(m, "blocks", None) is not None]
    if matmul == "BlockWeight":  # cpu_kernels.py's signatures (not their code: the graph calls them by name)
        parts += [str(op.default._schema) for op in (torch.ops.dspark.gguf_matmul, torch.ops.dspark.row_attention)]
    for part in parts:
        h.update(part.encode() + b"\0")
    runtime = Path(__file__).parents[1]
    for source in sorted([*runtime.glob("models/*.py"), *runtime.glob("kernels/*.py")]):  # what the graph traces
        h.update(source.read_bytes())
    return h.hexdigest()[:20]


def load_step(path: Path) -> Callable | None:
    """A step saved by `CompiledStep`, or None when the file is missing or unreadable (it is then compiled again)."""
    try:
        with path.open("rb") as f:
            step = torch.compiler.load_compiled_function(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file costs a compile, not the start
        print(f"[dspark] ignoring the saved step graph {path} ({type(e).__name__}: {e})", file=sys.stderr,
              flush=True)
        return None
    step.disable_guard_check()
    return step


def save_step(step, path: Path) -> bool:
    """Save a compiled step (`aot_compile`'s result) for the next start; False when the cache cannot be written
    (read-only, full): this start still serves, the next one compiles again."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        step.save_compiled_function(str(path))  # written to a temporary file, then renamed
    except OSError as e:
        print(f"[dspark] could not save the step graph to {path} ({e}); the next start compiles it again",
              file=sys.stderr, flush=True)
        return False
    return True


def compile_ahead(graph: Callable, args: tuple, mode: str, path: Path | None, options: dict | None = None) -> Callable:
    """`graph(*args)` compiled ahead of time (torch.compile: one full graph, sizes dynamic unless the caller marked
    them static), saved to `path` (None: not saved), its guards off: callers pass inputs of the traced structure.
    mode "max": inductor's C++ wrapper."""
    import torch._dynamo.config as dynamo_config  # (here: importing dynamo takes a second of every start)

    # size_asserts: the inputs have one fixed structure (as for the disabled guards); dynamic_threads: the kernels'
    # parallel regions use the caller's thread count at run time (serving/threads.py), not the count at compile time
    dynamo = torch.compile(graph, fullgraph=True, dynamic=True,
                           options={"size_asserts": False, "cpp_wrapper": mode == "max", "cpp.dynamic_threads": True,
                                    **(options or {})})
    import torch.fx.experimental._config as fx_config

    # specialize_float: the model's float constants (eps, scales) are fixed; no duck shapes: R, C, slots and capacity
    # are unrelated sizes (no equality guards); size-oblivious: R = 1 too (one graph for AR steps and verifies). Set
    # for this trace only: left set, they changed how every later torch.compile in the process traced.
    with dynamo_config.patch(specialize_float=True), fx_config.patch(use_duck_shape=False,
                                                                     backed_size_oblivious=True):
        compiled = dynamo.aot_compile((args, {}))
    if path is not None:
        save_step(compiled, path)
    compiled.disable_guard_check()
    return compiled


class CompiledStep:
    """The model's step graph and the slot store every session's cache lives in. `cache_dir`: where compiled steps
    are saved and looked up (None: compiled at every start). `mode` "max": the graph's Python wrapper (a call per
    kernel) generated as C++ instead."""

    def __init__(self, model: Transformer, cache_dir: Path | None = None, mode: str = "fast") -> None:
        reason = can_compile(model)
        if reason is not None:
            raise ValueError(reason)
        assert mode in COMPILE_MODES[1:], mode
        self.model, self.cache_dir, self.mode = model, cache_dir, mode
        self.store = SlotStore(model.config, model.dtype, model.device)
        positions = torch.arange(model.config.max_position_embeddings, device=model.device)
        self.rope = torch.stack(rope_cos_sin(positions, model.inv_freq, model.attention_scaling, model.dtype))
        self.local_rope = torch.stack(rope_cos_sin(positions, model.local_inv_freq, 1.0, model.dtype)) \
            if model.config.sliding_window else None  # sliding-window layers' (Transformer._eager_layers)
        self.graph: Callable | None = None  # the compiled step_graph (loaded or compiled by the first call)
        self.source = ""  # "loaded" from cache_dir or "compiled" here

    def __getstate__(self) -> dict:
        # Compiling pickles the state of the module it traced (for its guards), this attribute included: a lock and
        # compiled code, which no guard reads.
        return {}

    @functools.cached_property
    def path(self) -> Path | None:
        return None if self.cache_dir is None else self.cache_dir / f"step-{artifact_key(self.model, self.mode)}.bin"

    @property
    def saved(self) -> bool:
        return self.path is not None and self.path.exists()

    def new_cache(self, max_length: int) -> SlotCache:
        return SlotCache(self.store, max_length)

    def accepts(self, b: SequenceInput) -> bool:
        """A step (AR row, chain or tree verify) on a slot of this store; prompt chunks run eagerly."""
        step = b.mask is not None or b.new_rows_mask is not None or b.tokens.shape[0] == 1
        return step and isinstance(b.cache, SlotCache) and b.cache.store is self.store

    @torch.no_grad()
    def warm_up(self, progress: bool = True) -> float:
        """Load or compile the graph now (on a throwaway slot), showing progress; returns the seconds it took."""
        t0 = time.perf_counter()
        cache = self.new_cache(max_length=BUCKET)
        compiling = progress and not self.saved
        if compiling:
            print("[dspark] compiling the step graph (AR steps and verifies; the first start takes minutes on 2 cores, "
                  "a restart loads it from the cache)...", file=sys.stderr, flush=True)
        with still_working("compiling the step graph", every_s=15.0, enabled=compiling):
            for rows in WARMUP_ROWS:
                tokens = torch.zeros(rows, dtype=torch.long)
                self(self.model, [SequenceInput(tokens, torch.arange(rows), cache,
                                                new_rows_mask=torch.ones(rows, rows, dtype=torch.bool).tril())])
                cache.discard()
        seconds = time.perf_counter() - t0
        if progress:
            where = f"loaded from {self.path}" if self.source == "loaded" else (
                f"compiled, saved to {self.path}" if self.saved else "compiled")
            print(f"[dspark] step graph ready ({where}; {seconds:.1f} s)", file=sys.stderr, flush=True)
        return seconds

    def _prepare(self, args: tuple) -> Callable:
        """The saved step if there is one, else the graph compiled on `args` (2 rows or more) and saved."""
        path = self.path
        if path is not None and (step := load_step(path)) is not None:
            self.source = "loaded"
            return step
        assert args[1].shape[0] >= 2, "traced on one row, the graph would be specialized to one row"
        ropes = (self.rope,) if self.local_rope is None else (self.rope, self.local_rope)
        for t in (*model_tensors(self.model), *ropes):  # weights, scales: fixed sizes, not graph arguments
            torch._dynamo.mark_static(t)
        for t in (*self.store.k, *self.store.v):  # only slots and capacity vary: 2 sizes passed per call, not 122
            torch._dynamo.mark_static(t, 1)
            torch._dynamo.mark_static(t, 3)
        step = compile_ahead(step_graph, args, self.mode, path, {"emulate_precision_casts": True})
        self.source = "compiled"
        return step

    @torch.no_grad()
    def __call__(self, model: Transformer, batch: Sequence[SequenceInput]) -> list[ForwardOutput]:
        if self.graph is None and sum(b.tokens.shape[0] for b in batch) < 2 and not self.saved:
            self.warm_up(progress=False)  # traced on its 2-row step first
        masks, local_masks, slots, write_rows, logit_rows, begin = [], [], [], [], [], 0
        window = model.config.sliding_window
        starts = [b.cache.begin(b.tokens.shape[0]) for b in batch]
        C = -(-max(s + b.tokens.shape[0] for s, b in zip(starts, batch, strict=True)) // BUCKET) * BUCKET
        self.store.reserve(C)
        for b, start in zip(batch, starts, strict=True):
            T = b.tokens.shape[0]
            mask = torch.zeros(T, C, dtype=torch.bool)
            if b.mask is not None:
                mask[:, : start + T] = b.mask
            else:
                mask[:, :start] = True
                mask[:, start : start + T] = (b.new_rows_mask if b.new_rows_mask is not None
                                              else torch.ones(T, T, dtype=torch.bool).tril())
            masks.append(mask)
            if window:  # a new tensor, never `mask` itself: the graph was traced on two distinct inputs
                local = torch.zeros(T, C, dtype=torch.bool)
                local[:, : start + T] = window_mask(mask[:, : start + T], start, b.positions.cpu(), window)
                local_masks.append(local)
            slots.append(torch.full((T,), b.cache.slot))
            write_rows.append(torch.arange(start, start + T))
            rows = torch.arange(T) if b.logits_rows is None else b.logits_rows.cpu()
            logit_rows.append(rows + begin)
            begin += T
        args = (model, torch.cat([b.tokens for b in batch]), torch.cat([b.positions for b in batch]),
                torch.cat(slots), torch.cat(write_rows), torch.cat(masks), torch.cat(logit_rows), self.rope,
                self.store.k, self.store.v)
        if window:
            args += (torch.cat(local_masks), self.local_rope)
        if self.graph is None:
            self.graph = self._prepare(args)
        last, hidden = self.graph(*args)
        logits = model.logits(last)
        outputs, row, offset = [], 0, 0
        for b, rows in zip(batch, logit_rows, strict=True):
            T = b.tokens.shape[0]
            captures = hidden[row : row + T].index_select(1, _layer_index(b.capture_layers)) \
                if b.capture_layers else None
            outputs.append(ForwardOutput(logits[offset : offset + len(rows)], captures))
            row, offset = row + T, offset + len(rows)
        return outputs


@functools.lru_cache(maxsize=64)
def _layer_index(layers: tuple[int, ...]) -> torch.Tensor:
    """The capture layers as an index tensor, made once per layer set (index_select: a list index is advanced
    indexing, slower on the few rows of a step)."""
    return torch.tensor(layers, dtype=torch.long)
