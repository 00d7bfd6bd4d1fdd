"""The drafter's compiled greedy chain (runtime/kernels/compiled_draft.py) drafts what the eager pass drafts: the same
tokens, and log-probs and confidences to float32 rounding, at context lengths other than the one it was traced on;
saved, it loads and drafts the same; the draft engine takes it for a lone session's chain, and only there."""

from __future__ import annotations

import pytest
import torch
from drafter.helpers import chain_tolerances_of_block, kv_tolerance, random_features, run_block
from dspark_grpc.draft_service.engine import DraftEngine, DraftLimits
from dspark_grpc.draft_service.proposers import PassJob, drafter_pass
from dspark_grpc.runtime.formats.drafter_formats import init_random_drafter
from dspark_grpc.runtime.kernels.compiled_draft import TRACE_CONTEXT, CompiledChain, can_compile_drafter
from dspark_grpc.runtime.kernels.compiled_step import missing_compiler
from dspark_grpc.runtime.models.config import ModelConfig
from dspark_grpc.runtime.models.drafter import project_waiting

pytestmark = pytest.mark.skipif(missing_compiler() is not None, reason="inductor needs a C++ compiler")

TARGET = ModelConfig(architecture="llama", name="tiny", vocab_size=256, hidden_size=64, intermediate_size=128,
                     num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                     rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=True)
CONTEXTS = (1, TRACE_CONTEXT, 61)


def tiny_drafter():
    """One layer (the compile costs per layer; the graph loops over them as the eager pass does), a draft vocabulary
    smaller than the target's (d2t), a Markov head with its bias cache (the eager chain looks biases up, the graph
    computes them) and a confidence head."""
    drafter = init_random_drafter(TARGET, num_layers=1, block_size=4, target_layer_ids=(0, 3), markov_rank=8,
                                  draft_vocab_size=96, seed=3, confidence_temperatures=(1.0, 1.5, 2.0))
    drafter = drafter.eval().requires_grad_(False)
    drafter.markov.cache_biases(64)  # as `pack` does (whose oneDNN packing the graph does not take)
    return drafter


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    drafter = tiny_drafter()
    cache_dir = tmp_path_factory.mktemp("compiled-draft")
    chain = CompiledChain(drafter, cache_dir, mode="fast")
    chain.warm_up(progress=False)
    assert chain.source == "compiled" and chain.path.exists()
    return chain


def context_of(drafter, projected: int, waiting: int, seed: int):
    """A context of `projected` rows already in its K/V cache and `waiting` rows appended since."""
    ctx = drafter.new_context()
    g = torch.Generator().manual_seed(seed)
    ctx.append(torch.randn(projected, 2, TARGET.hidden_size, generator=g), 0)
    project_waiting([ctx])
    ctx.append(torch.randn(waiting, 2, TARGET.hidden_size, generator=g), projected)
    return ctx


def assert_chains_equal(eager, compiled_chain, drafter, context: int):
    """The same tokens; log-probs and confidences within tests/drafter/helpers.py's bounds for a block over `context`
    rows (the graph computes the eager pass's float32 arithmetic in its own order)."""
    assert compiled_chain.tokens == eager.tokens
    probe = run_block(drafter, random_features(drafter.config, context), 17)
    logprob, confidence = chain_tolerances_of_block(drafter, context, probe)
    torch.testing.assert_close(compiled_chain.logprobs, eager.logprobs, rtol=0, atol=logprob)
    torch.testing.assert_close(compiled_chain.confidences, eager.confidences, rtol=0, atol=confidence)


@pytest.mark.parametrize("projected", CONTEXTS)
@pytest.mark.parametrize("waiting", (1, 20))
def test_the_compiled_chain_drafts_what_the_eager_pass_drafts(compiled, projected, waiting):
    drafter = compiled.drafter
    for anchor in (0, 17, TARGET.vocab_size - 2):
        seed = projected * 100 + waiting
        eager_ctx, ctx = context_of(drafter, projected, waiting, seed), context_of(drafter, projected, waiting, seed)
        assert compiled.takes(ctx)
        (_, eager), = drafter_pass(drafter, [PassJob(eager_ctx, anchor, greedy_chain=True)])
        assert_chains_equal(eager, compiled(ctx, anchor), drafter, projected + waiting)
        assert not ctx.waiting and ctx.length == eager_ctx.length == projected + waiting  # projected, as eagerly
        for i in range(drafter.config.num_layers):
            for ours, theirs in zip(ctx.layer_kv(i), eager_ctx.layer_kv(i), strict=True):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=kv_tolerance(drafter, theirs))


def test_a_saved_chain_loads_and_drafts_the_same(compiled):
    again = CompiledChain(compiled.drafter, compiled.cache_dir, mode="fast")
    again.warm_up(progress=False)
    assert again.source == "loaded"
    a, b = (context_of(compiled.drafter, 9, 2, seed=1) for _ in range(2))
    assert_chains_equal(compiled(a, 5), again(b, 5), compiled.drafter, 11)


class Counted:
    def __init__(self, compiled: CompiledChain) -> None:
        self.compiled, self.calls = compiled, []

    def takes(self, ctx) -> bool:
        return self.compiled.takes(ctx)

    def __call__(self, ctx, anchor):
        self.calls.append(anchor)
        return self.compiled(ctx, anchor)


def test_the_engine_takes_the_graph_for_a_lone_greedy_chain_only(compiled):
    drafter = compiled.drafter
    engine = DraftEngine(drafter, TARGET.vocab_size, ("model", "tokenizer"), "tiny", DraftLimits())
    engine.compiled = counted = Counted(compiled)
    features = torch.randn(16, 2, TARGET.hidden_size, generator=torch.Generator().manual_seed(2))
    try:
        sid = engine.open_session(("model", "tokenizer"))
        engine.append(sid, 0, list(range(12)), [0, 3], features[:12])
        first = engine.propose(sid, 7, 12, proposer="dspark")  # the prompt's rows: projected eagerly
        assert counted.calls == [] and len(first.tokens) == 5
        engine.append(sid, 12, [7, 8], [0, 3], features[12:14])
        chain = engine.propose(sid, 9, 14, proposer="dspark")
        assert counted.calls == [9]
        reference = drafter.new_context()
        reference.append(features[:14], 0)
        (_, eager), = drafter_pass(drafter, [PassJob(reference, 9, greedy_chain=True)])
        assert chain.tokens == [9, *eager.tokens]
        engine.append(sid, 14, [9], [0, 3], features[14:15])
        tree = engine.propose(sid, 7, 15, tree=True, budget=6, proposer="dspark")  # a tree: the eager pass
        engine.append(sid, 15, [7], [0, 3], features[15:16])
        sampled = engine.propose(sid, 7, 16, proposer="dspark", temperature=1.0,
                                 generator=torch.Generator().manual_seed(0))
        assert counted.calls == [9] and len(tree.tokens) == 7 and len(sampled.tokens) == 5
    finally:
        engine.close()


def test_what_is_not_compiled_says_why():
    sliding = init_random_drafter(TARGET, num_layers=1, layer_types=("sliding_attention",), sliding_window=8)
    assert "sliding" in can_compile_drafter(sliding)
    assert can_compile_drafter(tiny_drafter()) is None
    with pytest.raises(ValueError, match="sliding"):
        CompiledChain(sliding)
    if tiny_drafter().pack().fc.packed is not None:  # where torch has oneDNN's packed linear
        assert "oneDNN" in can_compile_drafter(tiny_drafter().pack())
