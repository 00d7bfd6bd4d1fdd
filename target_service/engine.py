"""The target engine: sessions over one loaded target model. Plain Python, no gRPC.

A session's sequence is `tokens`; rows [0, cache.length) are in the KV cache and tokens[cache.length]
is the pending token: decided (emitted to the caller) but not yet run through the model. Prefill
makes the prompt the committed rows and samples the first pending token; each verify runs
[pending, candidates...] as one tree, and committing a root-to-node path moves those rows into the
cache and makes the target's next token pending.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from dspark_grpc.runtime.drafting.acceptance import accept_chain, accept_tree
from dspark_grpc.runtime.drafting.sampling import SamplingParams, make_generator
from dspark_grpc.runtime.formats.checkpoint import inference_model, load_checkpoint, release_freed_memory
from dspark_grpc.runtime.formats.detokenize import IncrementalDecoder
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
from dspark_grpc.runtime.kernels.device import cpu_only_note
from dspark_grpc.runtime.models.decode import commit_path, prefill, verify_tree
from dspark_grpc.runtime.models.kv_cache import KVCache
from dspark_grpc.runtime.models.transformer import ForwardOutput, SequenceInput, Transformer
from dspark_grpc.runtime.models.tree import TreeError, path_to_root, tree_depths, validate_tree
from dspark_grpc.serving.batching import BatchInfo, StepBatcher
from dspark_grpc.serving.sessions import SessionStore
from dspark_grpc.serving.threads import ThreadGovernor, same_outputs_on_one_thread
from dspark_grpc.speculation.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from dspark_grpc.speculation.wire import PROTOCOL_VERSION

from dspark_grpc.cli_common import CHAT_ROLES

# How long a speculative round's forward waits for a session of the round that has not submitted its verify yet
# (only a step thread that never gets to run waits this long: one that fails first says so).
ROUND_WAIT_S = 2.0
# A text or chat prompt is refused before tokenizing when it is longer than this many characters per token of the
# target's context: a token of a byte-level BPE rarely spans more than a few bytes, so this only catches what could
# never fit.
MAX_PROMPT_CHARS_PER_TOKEN = 32
# Rows of a prompt chunk: a slice of its forward is half a layer of it at least, which a neighbour's step may wait
# for; fewer rows cost the prompt some throughput (docs/RELIABILITY.md, "A long prompt beside a short request")
PREFILL_CHUNK_ROWS = 64
LOCK_TURN_S = 0.05  # the longest a prompt chunk waits between two layers for others to take the cache store's lock

Prompt = str | list[dict[str, str]] | Sequence[int]


@dataclass(frozen=True)
class EngineLimits:
    max_sessions: int = 16
    idle_ttl_s: float = 600.0
    max_tree_nodes: int = 256
    # Per-session cap on prompt + generated tokens; None = the model's context length.
    max_length: int | None = None
    # Rows one batched forward may hold (sessions' steps and prefill chunks together); 1 forward per step
    # when it is smaller than one session's step.
    max_batch_rows: int = 1024
    # One client cannot lock the others out (serving/sessions.py): None = max_sessions - reserved_sessions; 0 = no
    # cap of its own. reserved_sessions: the last free sessions, for principals that hold none (None = an eighth, >= 1).
    max_sessions_per_principal: int | None = None
    reserved_sessions: int | None = None
    # Forwards on one thread while that measures faster (another process took a core; serving/threads.py), where
    # the model's outputs do not depend on its thread count.
    adaptive_threads: bool = True


@dataclass
class PendingTree:
    tokens: list[int]
    parents: list[int]
    captures: torch.Tensor | None  # [N, L, H]


@dataclass
class TargetSession:
    cache: KVCache
    capture_layers: tuple[int, ...]
    max_length: int
    tokens: list[int] = field(default_factory=list)
    prompt_length: int = 0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    generator: torch.Generator | None = None
    decoder: IncrementalDecoder | None = None
    pending_tree: PendingTree | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # one operation at a time per session

    @property
    def prefilled(self) -> bool:
        return bool(self.tokens)


@dataclass
class Prefilled:
    prompt_tokens: list[int]
    next_token: int
    captures: torch.Tensor | None  # [T, L, H] for rows [0, T)
    text: str


@dataclass
class Committed:
    start: int  # first newly committed row
    captures: torch.Tensor | None  # [n, L, H] for rows [start, start + n)
    emitted: list[int]  # tokens newly emitted: the accepted path after the root, then next_token
    token_texts: list[str]
    length: int


@dataclass
class Verified:
    path: list[int]
    next_token: int
    logits: torch.Tensor | None
    committed: Committed | None
    batch: BatchInfo | None = None  # the batched forward it ran in


def resident_mib() -> float:
    """This process's resident memory (VmRSS), in MiB; 0 where /proc does not say."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0.0
    line = next((x for x in status.splitlines() if x.startswith("VmRSS:")), "VmRSS: 0 kB")
    return int(line.split()[1]) / 1024


class TargetEngine:
    def __init__(self, model: Transformer, tokenizer: TextTokenizer, name: str, limits: EngineLimits):
        cfg = model.config
        if tokenizer.vocab_size > cfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only {cfg.vocab_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.limits = limits
        self.max_length = min(limits.max_length or cfg.max_position_embeddings, cfg.max_position_embeddings)
        self.sessions: SessionStore[TargetSession] = SessionStore(
            limits.max_sessions, limits.idle_ttl_s, max_per_principal=limits.max_sessions_per_principal,
            reserved=limits.reserved_sessions)
        self.fingerprint = (cfg.fingerprint(), tokenizer.fingerprint())
        # Every forward goes through one worker: steps of concurrent sessions share a forward (continuous batching).
        self.threads = ThreadGovernor(torch.get_num_threads())
        self.batcher: StepBatcher[SequenceInput, ForwardOutput] = StepBatcher(
            self._forward_batch, rows=lambda inp: inp.tokens.shape[0], max_rows=limits.max_batch_rows,
            name="target-forward", on_batch=self._on_batch, session=lambda inp: id(inp.cache))
        self.threads.enabled = limits.adaptive_threads and self.threads.enabled and model.device.type == "cpu" and \
            self.batcher.call(lambda: same_outputs_on_one_thread(model, self.threads.threads))
        self.on_forward = None  # optional callable(BatchInfo), e.g. Prometheus metrics
        self.cost_tables: list = []  # client.cost_table.CostTable per lanes, when profiled
        # prefills started + ended, and running: a step whose wait saw neither change nor a running prefill did not
        # wait for another session's prompt (the adaptive mode's samples)
        self.prefill_epoch, self.prefills_running = 0, 0
        self.prefill_slices = 0  # times a prompt chunk stopped for other sessions' steps
        self._prefill_lock = threading.Lock()

    def _forward_batch(self, batch: list[SequenceInput]) -> list[ForwardOutput]:
        return self.threads.run(lambda: self.model.forward_batch(batch), sum(b.tokens.shape[0] for b in batch))

    def _on_batch(self, info: BatchInfo) -> None:
        if self.on_forward is not None:
            self.on_forward(info)

    def close(self) -> None:
        self.batcher.close()

    def profile_costs(self, cache_dir: str | Path | None, progress: Callable[[str], None] | None = None,
                      **sizes: object) -> list:
        """The start-up cost tables (serving/cost_profile.py `target_cost_tables`; `sizes`: its lanes, sizes,
        repeats, max_seconds), kept in `cost_tables`. Timed on the batcher's worker, where the forwards they price
        run: from the calling (load) thread the forwards would have an OpenMP team of their own beside the worker's,
        and with more OpenMP threads than cores every barrier sleeps: the tables priced steps far slower than the
        steps served (docs/PERFORMANCE.md)."""
        from dspark_grpc.serving.cost_profile import target_cost_tables

        self.cost_tables = self.batcher.call(
            lambda: target_cost_tables(self.model, cache_dir, progress=progress, **sizes))  # type: ignore[arg-type]
        return self.cost_tables

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32, limits: EngineLimits | None = None,
             progress: bool = True, precision: str = "exact", compile: str = "off",
             compile_cache: Path | None = None, device: torch.device | str = "cpu") -> TargetEngine:
        """precision "exact": float32 (or `dtype`); "fast": int4 weights from a GGUF's Q4 blocks, bf16 activations;
        compile "fast": the fast precision's steps as compiled graphs (runtime/checkpoint.inference_model), saved in
        and loaded from `compile_cache`. `device`: where the model runs; off the CPU the CPU-only parts fall back to
        torch, said in one line (runtime/kernels/device.py)."""
        t0 = time.perf_counter()
        device = torch.device(device)
        on_cpu = device.type == "cpu"
        if progress and (note := cpu_only_note(device, precision, compile)):
            print(f"[dspark-target] {note}", flush=True)
        ckpt = load_checkpoint(path, progress=progress, precision=precision if on_cpu else "exact")
        if ckpt.gguf_metadata is not None:
            tokenizer = TextTokenizer.from_gguf_metadata(ckpt.gguf_metadata)
        else:
            tokenizer = TextTokenizer.from_hf_dir(ckpt.hf_dir)
        model = inference_model(ckpt, precision, dtype, compile=compile if on_cpu else "off", progress=progress,
                                compile_cache=compile_cache, device=device)
        name = model_display_name(path, ckpt.config.name)
        del ckpt  # the file's blocks the model re-laid out, and its float tensors: their pages go back to the OS
        release_freed_memory()
        if progress:
            size = Path(path).stat().st_size if Path(path).is_file() else None
            print(f"[dspark-target] model ready in {time.perf_counter() - t0:.1f} s; resident memory "
                  f"{resident_mib():.0f} MiB" + (f" (the file: {size / 2**20:.0f} MiB)" if size else ""), flush=True)
        return cls(model, tokenizer, name, limits or EngineLimits())

    # -- sessions -------------------------------------------------------------------------------

    def open_session(self, capture_layers: list[int] = (), drafter_target: tuple[str, str] | None = None,
                     protocol_version: int = PROTOCOL_VERSION, max_length: int = 0, owner: object = None) -> str:
        if protocol_version not in (0, PROTOCOL_VERSION):
            raise FailedPrecondition(f"protocol version {protocol_version} is not supported; this target speaks "
                                     f"version {PROTOCOL_VERSION}")
        if drafter_target is not None and any(drafter_target):
            model_fp, tok_fp = self.fingerprint
            if drafter_target[1] and drafter_target[1] != tok_fp:
                raise FailedPrecondition(
                    f"the drafter was built for a target with another tokenizer (fingerprint "
                    f"{drafter_target[1][:12]}…, this target's is {tok_fp[:12]}…); use a drafter made for this model")
            if drafter_target[0] and drafter_target[0] != model_fp:
                raise FailedPrecondition(
                    f"the drafter was built for another target model (fingerprint {drafter_target[0][:12]}…, "
                    f"this target is {model_fp[:12]}…); use a drafter made for this model")
        n_layers = self.model.config.num_layers
        layers = tuple(int(layer) for layer in capture_layers)
        bad = [layer for layer in layers if not 0 <= layer < n_layers]
        if bad:
            raise InvalidArgument(f"capture layer ids {bad} out of range: this target has layers 0..{n_layers - 1}")
        if len(set(layers)) != len(layers):
            raise InvalidArgument(f"capture layer ids {list(layers)} contain duplicates")
        if max_length < 0:
            raise InvalidArgument(f"max_length must be >= 0, got {max_length}")
        length = min(max_length, self.max_length) if max_length else self.max_length
        # zeros of a new cache fill in parallel: on the batcher's worker (serving/batching.py), or this request
        # thread gets an OpenMP team of its own and every later forward slows down
        cache = self.batcher.call(lambda: self.model.new_cache(max_length=length + self.limits.max_tree_nodes))
        return self.sessions.create(TargetSession(cache, layers, length), owner)

    def release(self, session_id: str) -> None:
        self.sessions.release(session_id)

    def release_owner(self, owner: object) -> list[str]:
        return self.sessions.release_owner(owner)

    # -- prompt -----------------------------------------------------------------------------------

    def encode_prompt(self, prompt: Prompt, max_length: int | None = None) -> list[int]:
        """The prompt's ids, fewer than `max_length` (a session's); text or chat longer than MAX_PROMPT_CHARS_PER_TOKEN
        characters per token of this target's context is refused before tokenizing."""
        return encode_prompt(self.tokenizer, prompt, self.model.config.vocab_size, max_length,
                             self.max_length * MAX_PROMPT_CHARS_PER_TOKEN)

    def check_tokens(self, ids: list[int], what: str) -> None:
        check_tokens(ids, what, self.model.config.vocab_size)

    # -- model steps --------------------------------------------------------------------------------

    def prefill(self, session_id: str, prompt: Prompt, sampling: SamplingParams | None = None,
                max_capture_bytes: int | None = None) -> Prefilled:
        """max_capture_bytes: refuse (RESOURCE_EXHAUSTED) before the forward when the captures would be larger."""
        s = self.sessions.get(session_id)
        if s.prefilled:
            raise FailedPrecondition("this session is already prefilled; open a new session or Rollback")
        ids = self.encode_prompt(prompt, s.max_length)
        self._check_capture_size(s, len(ids), max_capture_bytes, "a prefill")
        s.sampling = sampling or SamplingParams()
        s.generator = None if s.sampling.is_greedy else make_generator(s.sampling.seed)
        def forward(inp: SequenceInput) -> ForwardOutput:
            self.sessions.get(session_id)  # released meanwhile (its stream ended): no further chunk is run
            return self._forward_in_slices(inp)

        self._count_prefill(+1)
        try:
            with s.lock:
                logits, captures = prefill(self.model, s.cache, ids, s.capture_layers, PREFILL_CHUNK_ROWS, forward)
                next_token = int(self.batcher.call(lambda: accept_tree(logits[None], [0], [-1], s.sampling,
                                                                       s.generator))[1])
        finally:
            self._count_prefill(-1)
        s.tokens = [*ids, next_token]
        s.prompt_length = len(ids)
        s.decoder = IncrementalDecoder(self.tokenizer)
        return Prefilled(ids, next_token, captures, s.decoder.add(next_token))

    def _forward_in_slices(self, inp: SequenceInput) -> ForwardOutput:
        """A prompt chunk on the worker, a slice of its layers at a time while other sessions' steps are queued: the
        worker runs them between two slices, so a neighbour's step waits for about one slice (`slice_seconds`: the
        last batch's, about one step) rather than for the whole chunk. Decode steps first: a session that has just
        stepped gets up to a quarter step to queue its next step before a slice starts (`wait_for_return`), every
        other slice. However it is sliced, the chunk computes the same numbers (the same ops on the same tensors, in
        the same order); alone, it runs in one slice."""
        layers = self.model.forward_by_layers([inp])
        out: list[ForwardOutput] = []
        t_start = time.perf_counter()
        lock = self.model.step_lock()
        yielded = [False]

        def run_slice() -> bool:
            # decode steps first: a session that just stepped is let in before the slice, unless the slice before
            # this one already let one in (the prompt advances at least a slice per step)
            if not yielded[0] and self.batcher.wait_for_return(self.batcher.gather * self.batcher.last_seconds):
                yielded[0] = True
                return False
            yielded[0] = False
            t0, budget = time.perf_counter(), self.slice_seconds()
            while True:
                if getattr(lock, "waiting", 0):  # a session's commit: before the next layer
                    lock.let_waiters_in(LOCK_TURN_S)
                with lock:
                    try:
                        next(layers)
                    except StopIteration as done:
                        out.append(wire_captures(done.value[0]))
                        return True
                if self.batcher.queued() and time.perf_counter() - t0 >= budget:
                    return False

        while not self.batcher.call(run_slice):
            self.prefill_slices += 1
        self._on_batch(BatchInfo(1, inp.tokens.shape[0], time.perf_counter() - t_start))
        return out[0]

    def slice_seconds(self) -> float:
        """How long a slice of a prompt chunk runs before the steps queued meanwhile: half a step (a slice is at
        least half a layer), so a neighbour's step waits for about half its own time."""
        return 0.5 * self.batcher.last_seconds

    def _count_prefill(self, change: int) -> None:
        with self._prefill_lock:
            self.prefill_epoch += 1
            self.prefills_running += change

    def prefill_state(self) -> tuple[int, int]:
        """(prefill_epoch, prefills_running)."""
        with self._prefill_lock:
            return self.prefill_epoch, self.prefills_running

    def verify(self, session_id: str, tokens: list[int], parents: list[int], commit: bool = False,
               return_logits: bool = False, draft_ids: torch.Tensor | None = None,
               draft_logprobs: torch.Tensor | None = None, max_capture_bytes: int | None = None) -> Verified:
        """draft_ids/draft_logprobs [N, k]: for a sampled chain, row i = the sparse distribution node i + 1 was
        drawn from; with them a chain is accepted by rejection sampling, otherwise by sample-and-match."""
        s = self.sessions.get(session_id)
        if not s.prefilled:
            raise FailedPrecondition("prefill the session before verifying")
        try:
            validate_tree(tokens, parents, self.model.config.vocab_size, self.limits.max_tree_nodes + 1)
        except TreeError as e:
            raise InvalidArgument(f"bad token tree: {e}") from e
        pending = s.tokens[s.cache.length]
        if tokens[0] != pending:
            raise InvalidArgument(f"the tree root must be the session's pending token {pending}, got {tokens[0]}")
        depth = max(tree_depths(parents))
        if s.cache.length + depth + 1 > s.max_length:
            raise ResourceExhausted(f"context full: {s.cache.length} rows committed, a tree of depth {depth} "
                                    f"does not fit in max_length {s.max_length}")
        self._check_capture_size(s, depth + 1, max_capture_bytes, "committing a path of this tree")
        batches: list[BatchInfo] = []
        accepted: list[tuple[list[int], int]] = []

        def accept(out: ForwardOutput) -> ForwardOutput:  # on the batcher's worker (serving/batching.py)
            n = len(tokens) - 1
            if draft_ids is not None and n and not s.sampling.is_greedy and parents == list(range(-1, n)):
                try:
                    accepted.append(accept_chain(out.logits, tokens, draft_ids[:n], draft_logprobs[:n], s.sampling,
                                                 s.generator))
                except ValueError as e:
                    raise InvalidArgument(f"draft distributions: {e}") from e
            else:
                accepted.append(accept_tree(out.logits, tokens, parents, s.sampling, s.generator))
            return wire_captures(out)

        with s.lock:
            s.cache.discard()
            logits, captures = verify_tree(self.model, s.cache, tokens, parents, s.capture_layers,
                                           forward=lambda inp: self._forward(inp, batches, then=accept))
        path, next_token = accepted[0]
        s.pending_tree = PendingTree(list(tokens), list(parents), captures)
        committed = self._commit(s, path, next_token) if commit else None
        return Verified(path, next_token, logits if return_logits else None, committed, batches[-1])

    def step_state(self, session_id: str) -> tuple[int, int, int]:
        """(pending token, committed rows, max_length) of a prefilled session."""
        s = self.sessions.get(session_id)
        if not s.prefilled:
            raise FailedPrecondition("prefill the session before stepping")
        return s.tokens[s.cache.length], s.cache.length, s.max_length

    def _batch_key(self, session_id: str) -> int | None:
        """The session's key in the batcher (its cache's id), None once it is gone."""
        try:
            return id(self.sessions.get(session_id).cache)
        except NotFound:
            return None

    def expect_steps(self, session_ids: list[str], within_s: float = ROUND_WAIT_S) -> None:
        """These sessions are about to verify, each from its own thread (a speculative round): one forward."""
        keys = [self._batch_key(sid) for sid in session_ids]
        self.batcher.expect([k for k in keys if k is not None], within_s)

    def step_away(self, session_id: str) -> None:
        """The session waits for its drafter before its next verify: forwards do not wait for it meanwhile."""
        if (key := self._batch_key(session_id)) is not None:
            self.batcher.away(key)

    def unexpect_step(self, session_id: str) -> None:
        """The session's verify of the round is not coming (or has run): do not wait for it."""
        if (key := self._batch_key(session_id)) is not None:
            self.batcher.unexpect(key)

    def _check_capture_size(self, s: TargetSession, rows: int, max_bytes: int | None, what: str) -> None:
        size = rows * len(s.capture_layers) * self.model.config.hidden_size * 2  # bf16 on the wire
        if max_bytes is not None and size > max_bytes:
            raise ResourceExhausted(
                f"{what} would capture {rows} rows x {len(s.capture_layers)} layers = {size} bytes, over the reply "
                f"limit of {max_bytes} bytes (--max-message-bytes); capture fewer layers, send fewer tokens, or "
                "raise --max-message-bytes on both ends")

    def _forward(self, inp: SequenceInput, batches: list[BatchInfo] | None = None,
                 then: Callable[[ForwardOutput], ForwardOutput] | None = None) -> ForwardOutput:
        out, info = self.batcher.submit(inp, then)
        if batches is not None:
            batches.append(info)
        return out

    def commit(self, session_id: str, path: list[int], next_token: int) -> Committed:
        s = self.sessions.get(session_id)
        if s.pending_tree is None:
            raise FailedPrecondition("nothing to commit: Verify a tree first (each tree can be committed once)")
        self.check_tokens([next_token], "next_token")
        tree = s.pending_tree
        if not path or any(not 0 <= n < len(tree.tokens) for n in path) or path != path_to_root(tree.parents, path[-1]):
            raise InvalidArgument(f"path {list(path)} is not a root-to-node path of the last verified tree")
        return self._commit(s, list(path), int(next_token))

    def _commit(self, s: TargetSession, path: list[int], next_token: int) -> Committed:
        tree = s.pending_tree
        assert tree is not None
        start = s.cache.length
        with s.lock:
            commit_path(s.cache, path)
        s.pending_tree = None
        emitted = [tree.tokens[n] for n in path[1:]] + [next_token]
        s.tokens = s.tokens[:start] + [tree.tokens[n] for n in path] + [next_token]
        assert len(s.tokens) == s.cache.length + 1
        # index_select, not captures[path]: advanced indexing opens an OpenMP team even on a few rows; an AR step's
        # path is its one row, kept as it is
        captures = tree.captures
        if captures is not None and path != list(range(captures.shape[0])):
            captures = captures.index_select(0, torch.tensor(path, device=captures.device))
        texts = [s.decoder.add(t) for t in emitted]
        return Committed(start, captures, emitted, texts, s.cache.length)

    def rollback(self, session_id: str, length: int) -> tuple[int, int]:
        s = self.sessions.get(session_id)
        if not s.prefilled:
            raise FailedPrecondition("nothing to roll back: the session is not prefilled")
        if not 0 < length <= s.cache.length:
            raise InvalidArgument(f"rollback length must be in [1, {s.cache.length}], got {length}")
        with s.lock:
            s.cache.discard()
            if s.cache.can_rollback(length):
                s.cache.rollback(length)
            else:  # a hybrid model's recurrent state older than its kept snapshots: recompute it from the tokens
                s.cache.rollback(0)
                prefill(self.model, s.cache, s.tokens[:length], forward=self._forward)
        s.pending_tree = None
        s.tokens = s.tokens[: length + 1]
        s.prompt_length = min(s.prompt_length, length)
        s.decoder = IncrementalDecoder(self.tokenizer)
        s.decoder.add(s.tokens[s.prompt_length :])
        return length, s.tokens[length]


def wire_captures(out: ForwardOutput) -> ForwardOutput:
    """Captures in bf16, their wire format, on the host, converted on the batcher's worker: a large conversion on a
    request thread would give that thread an OpenMP team of its own and slow every later forward
    (serving/batching.py). On a GPU that is one copy to the host per forward output (not yet into pinned buffers)."""
    if out.captures is not None:
        out.captures = out.captures.to(device="cpu", dtype=torch.bfloat16)
    return out


def model_display_name(path: str | Path, name: str) -> str:
    """"SmolLM2-135M-Instruct (Q4_1 GGUF)" for SmolLM2-135M-Instruct.Q4_1.gguf: a GGUF's general.name is often a
    build label ("Smollm2 135M 8k Lc100K Mix1 Ep2"); the file name is what the user chose."""
    path = Path(path)
    if path.suffix == ".gguf":
        stem, _, quant = path.stem.rpartition(".")
        return f"{stem} ({quant} GGUF)" if stem else f"{path.stem} (GGUF)"
    return name or path.name


def encode_prompt(tokenizer: TextTokenizer, prompt: Prompt, vocab_size: int, max_length: int | None = None,
                  max_chars: int | None = None) -> list[int]:
    """Prompt ids: text (special tokens added), chat messages (the model's chat template) or token ids; fewer than
    `max_length` of them (None: any number). Sizes are checked before any work: text or chat over `max_chars` is not
    tokenized, token ids past `max_length` are not converted."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgument("the prompt is empty")
        _check_prompt_chars(len(prompt), max_chars)  # chars <= bytes: no encoding needed
        ids = tokenizer.encode(prompt, add_special_tokens=True)
        _check_prompt_length(len(ids), max_length)
    elif prompt and isinstance(prompt[0], dict):
        for i, m in enumerate(prompt):
            if m.get("role") not in CHAT_ROLES:
                raise InvalidArgument(f"chat message {i} has role {m.get('role')!r}; roles are "
                                      f"{', '.join(CHAT_ROLES)}")
        _check_prompt_chars(sum(len(m["role"]) + len(m.get("content") or "") for m in prompt), max_chars)
        try:
            text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        except ValueError as e:
            raise InvalidArgument(f"cannot render the chat messages: {e}") from e
        ids = tokenizer.encode(text, add_special_tokens=False)
        _check_prompt_length(len(ids), max_length)
    else:
        _check_prompt_length(len(prompt), max_length)
        ids = [int(t) for t in prompt]
        check_tokens(ids, "prompt", vocab_size)
    if not ids:
        raise InvalidArgument("the prompt is empty")
    return ids


def _check_prompt_chars(n: int, max_chars: int | None) -> None:
    if max_chars is not None and n > max_chars:
        raise InvalidArgument(f"the prompt has {n} characters; this target takes at most {max_chars} "
                              f"({max_chars // MAX_PROMPT_CHARS_PER_TOKEN} tokens of context)")


def _check_prompt_length(n: int, max_length: int | None) -> None:
    if max_length is not None and n >= max_length:
        raise InvalidArgument(f"the prompt has {n} tokens; this session holds at most {max_length - 1} prompt "
                              f"tokens (max_length {max_length})")


def check_tokens(ids: list[int], what: str, vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"{what}: token ids {bad[:5]} out of range [0, {vocab_size})")
