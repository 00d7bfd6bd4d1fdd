"""The draft engine: per-session drafter context over one loaded DSpark drafter. Plain Python, no gRPC.

A session holds the committed rows of its sequence that the target has sent: token ids and the target's
hidden-state captures at the drafter's `target_layer_ids`, projected into the drafter's context K/V. A
proposal drafts after the anchor (the target's pending token, at position = context length).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
from dspark_grpc.runtime.checkpoint import default_model_path, load_checkpoint
from dspark_grpc.runtime.ddtree import build_ddtree
from dspark_grpc.runtime.drafter import DraftContext, Drafter
from dspark_grpc.runtime.drafter_formats import init_random_drafter, load_drafter
from dspark_grpc.runtime.errors import FailedPrecondition, InvalidArgument
from dspark_grpc.runtime.markov import draft_chain
from dspark_grpc.runtime.markov_triton import triton_runnable
from dspark_grpc.runtime.sessions import SessionStore
from dspark_grpc.runtime.tokenizer import TextTokenizer

PROTOCOL_VERSION = 1
KERNELS = ("auto", "fused", "torch")


@dataclass(frozen=True)
class DraftLimits:
    max_sessions: int = 16
    idle_ttl_s: float = 600.0
    max_tree_budget: int = 64
    default_tree_budget: int = 16
    tree_top_k: int = 8
    default_kernel: str = "auto"  # for requests that do not choose


@dataclass
class DraftSession:
    context: DraftContext
    tokens: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclass
class ProposalResult:
    tokens: list[int]  # node 0 = the anchor
    parents: list[int]
    logprobs: list[float]
    confidences: torch.Tensor | None  # [depth] along the main chain


class DraftEngine:
    def __init__(self, drafter: Drafter, target_fingerprint: tuple[str, str], name: str, limits: DraftLimits):
        self.drafter = drafter
        self.config = drafter.config
        self.target_fingerprint = target_fingerprint
        self.name = name
        self.limits = limits
        self.sessions: SessionStore[DraftSession] = SessionStore(limits.max_sessions, limits.idle_ttl_s)
        self._compute = threading.Lock()

    @classmethod
    def load(cls, drafter_path: str | Path, target_path: str | Path | None = None, dtype: torch.dtype = torch.float32,
             limits: DraftLimits | None = None, progress: bool = True, seed: int = 0) -> DraftEngine:
        """`drafter_path` "random" builds a seeded random drafter for the target (for tests and demos)."""
        target_path = Path(target_path) if target_path else default_model_path()
        ckpt = load_checkpoint(target_path, progress=progress)
        if ckpt.gguf_metadata is not None:
            tokenizer = TextTokenizer.from_gguf_metadata(ckpt.gguf_metadata)
        else:
            tokenizer = TextTokenizer.from_hf_dir(ckpt.hf_dir)
        fingerprint = (ckpt.config.fingerprint(), tokenizer.fingerprint())
        if str(drafter_path) == "random":
            lm_head = ckpt.weights.get("output.weight", ckpt.weights["tok_embeddings.weight"])
            drafter = init_random_drafter(ckpt.config, seed=seed, target_embed=ckpt.weights["tok_embeddings.weight"],
                                          target_lm_head=lm_head)
            name = f"random drafter (seed {seed}) for {ckpt.config.name}"
        else:
            drafter = load_drafter(drafter_path, target_path=target_path, dtype=dtype)
            name = Path(drafter_path).name
        check_drafter_fits_target(drafter, ckpt.config)
        return cls(drafter.to(dtype).eval().requires_grad_(False), fingerprint, name, limits or DraftLimits())

    # -- sessions ---------------------------------------------------------------------------------

    def open_session(self, target: tuple[str, str] | None, protocol_version: int = PROTOCOL_VERSION,
                     owner: object = None) -> str:
        if protocol_version not in (0, PROTOCOL_VERSION):
            raise FailedPrecondition(f"protocol version {protocol_version} is not supported; this drafter speaks "
                                     f"version {PROTOCOL_VERSION}")
        if target is None or not all(target):
            raise InvalidArgument("open.target must carry the target's model and tokenizer fingerprints "
                                  "(TargetService.GetModelInfo.fingerprint)")
        if target != self.target_fingerprint:
            raise FailedPrecondition(
                f"this drafter was built for another target (model {self.target_fingerprint[0][:12]}…, tokenizer "
                f"{self.target_fingerprint[1][:12]}…), not model {target[0][:12]}…, tokenizer {target[1][:12]}…")
        return self.sessions.create(DraftSession(self.drafter.new_context()), owner)

    def release(self, session_id: str) -> None:
        self.sessions.release(session_id)

    def release_owner(self, owner: object) -> list[str]:
        return self.sessions.release_owner(owner)

    # -- context ------------------------------------------------------------------------------------

    def append(self, session_id: str, start: int, tokens: list[int], layer_ids: list[int],
               features: torch.Tensor | None) -> int:
        """Rows [start, start + n). Rows already held must be identical (idempotent); a gap is refused."""
        s = self.sessions.get(session_id)
        n = len(tokens)
        if start < 0:
            raise InvalidArgument(f"start_position must be >= 0, got {start}")
        if start > s.length:
            raise FailedPrecondition(f"gap: the context holds rows [0, {s.length}) and these rows start at {start}; "
                                     f"send rows from {s.length} on")
        vocab = self.config.vocab_size
        bad = [t for t in tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(f"token ids {bad[:5]} out of range [0, {vocab})")
        if features is None:
            raise InvalidArgument("append.capture is missing: the DSpark drafter needs the target's hidden states")
        expected_layers = list(self.config.target_layer_ids)
        if list(layer_ids) != expected_layers:
            raise InvalidArgument(f"capture layer ids {list(layer_ids)} differ from the drafter's target_layer_ids "
                                  f"{expected_layers}")
        width = (len(expected_layers), self.config.target_hidden_size)
        if features.dim() != 3 or tuple(features.shape[1:]) != width or features.shape[0] != n:
            raise InvalidArgument(f"capture rows have shape {list(features.shape)}; expected [{n}, {width[0]}, "
                                  f"{width[1]}] (rows, layers, target hidden size)")
        if not features.is_floating_point():
            raise InvalidArgument(f"capture rows must be bfloat16 (or float16/float32), not {features.dtype}")
        overlap = min(s.length - start, n)
        if tokens[:overlap] != s.tokens[start : start + overlap]:
            raise FailedPrecondition(f"rows [{start}, {start + overlap}) differ from the rows already held; "
                                     "truncate the context first")
        if overlap < n:
            with self._compute:
                s.context.append(features[overlap:].to(self.drafter.dtype), start + overlap)
            s.tokens.extend(tokens[overlap:])
        return s.length

    def truncate(self, session_id: str, length: int) -> int:
        s = self.sessions.get(session_id)
        if not 0 <= length <= s.length:
            raise InvalidArgument(f"truncate length must be in [0, {s.length}], got {length}")
        s.context.truncate(length)
        del s.tokens[length:]
        return s.length

    # -- proposals ----------------------------------------------------------------------------------

    def propose(self, session_id: str, anchor_token: int, anchor_position: int, tree: bool = False,
                budget: int = 0, kernel: str = "", temperature: float = 0.0,
                generator: torch.Generator | None = None) -> ProposalResult:
        s = self.sessions.get(session_id)
        if not 0 <= anchor_token < self.config.vocab_size:
            raise InvalidArgument(f"anchor token {anchor_token} out of range [0, {self.config.vocab_size})")
        if anchor_position != s.length:
            raise FailedPrecondition(f"the anchor must sit right after the context: the context has {s.length} rows, "
                                     f"the anchor is at {anchor_position}")
        if s.length == 0:
            raise FailedPrecondition("the context is empty: append the prompt's rows first")
        kernel = kernel or self.limits.default_kernel
        if kernel not in KERNELS:
            raise InvalidArgument(f"kernel must be one of {KERNELS}, got {kernel!r}")
        depth = self.config.num_drafts
        limit = self.limits.max_tree_budget if tree else depth
        budget = budget or (self.limits.default_tree_budget if tree else depth)
        if not 1 <= budget <= limit:
            raise InvalidArgument(f"budget {budget} out of range: 1..{limit} for a {'tree' if tree else 'chain'}")
        d = self.drafter
        if kernel == "fused" and (d.markov is not None and d.markov.kind != "vanilla" or temperature > 0):
            raise InvalidArgument("the fused kernel runs the greedy chain of a vanilla Markov head; ask for the torch "
                                  "kernel (or auto)")
        if kernel == "fused" and not triton_runnable(d.device):
            raise FailedPrecondition("the fused Triton kernel cannot run here (no CUDA device, and the service was not "
                                     "started with TRITON_INTERPRET=1); ask for the torch kernel (or auto)")
        with self._compute:
            out = d.forward_block(s.context, anchor_token)
            if tree:
                t = build_ddtree(out.base_logits, anchor_token, budget, self.limits.tree_top_k, markov=d.markov,
                                 hidden_post=out.hidden_post_norm, d2t=d.d2t, chain_seed=True)
                chain = draft_chain(out.base_logits, out.hidden_pre_norm, out.hidden_post_norm, anchor_token,
                                    d.markov, d.confidence, d.d2t, kernel=kernel)
                return ProposalResult(t.tokens, t.parents, t.logprobs, chain.confidences)
            chain = draft_chain(out.base_logits[:budget], out.hidden_pre_norm[:budget], out.hidden_post_norm[:budget],
                                anchor_token, d.markov, d.confidence, d.d2t, kernel=kernel, temperature=temperature,
                                generator=generator)
        tokens = [anchor_token, *chain.tokens]
        return ProposalResult(tokens, list(range(-1, len(tokens) - 1)), [0.0, *chain.logprobs.tolist()],
                              chain.confidences)


def check_drafter_fits_target(drafter: Drafter, target) -> None:
    c = drafter.config
    problems = []
    if c.vocab_size != target.vocab_size:
        problems.append(f"vocab {c.vocab_size} vs the target's {target.vocab_size}")
    if c.target_hidden_size != target.hidden_size:
        problems.append(f"target hidden size {c.target_hidden_size} vs {target.hidden_size}")
    if max(c.target_layer_ids) >= target.num_layers:
        problems.append(f"target_layer_ids {list(c.target_layer_ids)} beyond the target's {target.num_layers} layers")
    if problems:
        raise ValueError("the drafter does not fit this target: " + "; ".join(problems))
