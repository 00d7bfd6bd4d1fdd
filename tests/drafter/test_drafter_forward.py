"""Drafter.forward_block vs a slow float64 reference of KV injection; DraftContext append/truncate semantics."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from dspark_grpc.runtime.formats.drafter_formats import build_drafter, init_random_drafter
from dspark_grpc.runtime.models.config import ModelConfig, RopeScaling
from tolerance import assert_within, linear_error_bound
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from .helpers import assert_same_output, block_tolerances, kv_tolerance, random_features, run_block

TARGET = ModelConfig(
    architecture="qwen3",
    name="tiny",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_layers=6,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    qk_norm=True,
)
YARN = RopeScaling("yarn", 4.0, original_max_position_embeddings=256, attention_factor=None)


def hf_rope_tables(drafter) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling as transformers computes them for the drafter's rope config."""
    c = drafter.config
    params = {"rope_type": "default", "rope_theta": c.rope_theta}
    if c.rope_scaling is not None:
        s = c.rope_scaling
        params.update(rope_type="yarn", factor=s.factor)
        params["original_max_position_embeddings"] = s.original_max_position_embeddings
    hf = Qwen3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_heads, head_dim=c.head_dim,
                     max_position_embeddings=c.max_position_embeddings, rope_parameters=params)
    if c.rope_scaling is None:
        inv_freq, scale = Qwen3RotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    return inv_freq.double(), float(scale)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, scale: float) -> torch.Tensor:
    """x [T, heads, hd] rotated (rotate-half) at absolute positions pos [T]."""
    angles = pos.double()[:, None] * inv_freq[None, :]
    cos = (torch.cat([angles, angles], -1).cos() * scale)[:, None, :]
    sin = (torch.cat([angles, angles], -1).sin() * scale)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def reference_block(drafter, features: torch.Tensor, anchor: int) -> tuple[torch.Tensor, ...]:
    """Every block row (pre-norm hidden, post-norm hidden, logits) in float64, written from the spec (§1.4):
    context rows = hidden_norm(fc(features)), no queries, only k/v through each layer's weights; per-head softmax
    over [context ; block] keys, all of them for full layers, a window (causal in the block) for sliding ones."""
    c = drafter.config
    W = {k: v.double() for k, v in drafter.state_dict().items()}
    eps, nh, nkv, hd, B = c.rms_norm_eps, c.num_heads, c.num_kv_heads, c.head_dim, c.block_size
    n = features.shape[0]
    context = rms(features.reshape(n, -1).double() @ W["fc.weight"].T, W["hidden_norm.weight"], eps)
    inv_freq, scale = hf_rope_tables(drafter)
    q_pos = torch.arange(n, n + B)
    k_pos = torch.arange(0, n + B)
    h = W["embed.weight"][torch.tensor([anchor] + [c.mask_token_id] * (B - 1))]
    for i in range(c.num_layers):
        p = f"layers.{i}."
        hn = rms(h, W[p + "attention_norm.weight"], eps)
        q = rms((hn @ W[p + "attention.wq.weight"].T).view(B, nh, hd), W[p + "attention.q_norm.weight"], eps)
        q = rope(q, q_pos, inv_freq, scale)
        rows = torch.cat([context, hn])  # context rows get no input norm
        k = rms((rows @ W[p + "attention.wk.weight"].T).view(-1, nkv, hd), W[p + "attention.k_norm.weight"], eps)
        k = rope(k, k_pos, inv_freq, scale)
        v = (rows @ W[p + "attention.wv.weight"].T).view(-1, nkv, hd)
        out = torch.zeros(B, nh, hd, dtype=torch.float64)
        for head in range(nh):
            g = head // (nh // nkv)
            for qi in range(B):
                if c.layer_types[i] == "sliding_attention":
                    delta = q_pos[qi] - k_pos
                    inside = (delta >= 0) if c.causal_sliding else (-delta < c.sliding_window)
                    seen = (delta < c.sliding_window) & inside
                else:
                    seen = torch.ones(n + B, dtype=torch.bool)
                scores = k[seen, g] @ q[qi, head] / math.sqrt(hd)
                out[qi, head] = torch.softmax(scores, dim=0) @ v[seen, g]
        h = h + out.reshape(B, nh * hd) @ W[p + "attention.wo.weight"].T
        hn = rms(h, W[p + "ffn_norm.weight"], eps)
        up = F.silu(hn @ W[p + "feed_forward.w1.weight"].T) * (hn @ W[p + "feed_forward.w3.weight"].T)
        h = h + up @ W[p + "feed_forward.w2.weight"].T
    post = rms(h, W["norm.weight"], eps)
    return h, post, post @ W["lm_head.weight"].T


@pytest.mark.parametrize(
    "variant",
    ["full", "sliding_causal", "sliding_bidirectional", "yarn", "dflash_slots"],
)
def test_forward_block_matches_slow_reference(variant):
    target = dataclasses.replace(TARGET, rope_scaling=YARN) if variant == "yarn" else TARGET
    sliding = variant.startswith("sliding") or variant == "dflash_slots"
    drafter = init_random_drafter(
        target,
        num_layers=2,
        block_size=5,
        target_layer_ids=(0, 2, 4),
        layer_types=("full_attention", "sliding_attention") if sliding else None,
        sliding_window=6 if sliding else None,
        causal_sliding=variant != "sliding_bidirectional",
        slot_convention="dflash" if variant == "dflash_slots" else "dspark",
        seed=3,
    )
    features = random_features(drafter.config, 13, seed=1)  # longer than the window
    anchor = 77
    ctx = drafter.new_context()
    ctx.append(features[:9], 0)
    ctx.append(features[9:], 9)
    out = drafter.forward_block(ctx, anchor)
    pre, post, logits = reference_block(drafter, features, anchor)
    rows = slice(1, None) if variant == "dflash_slots" else slice(None)
    n_drafts = drafter.config.num_drafts
    assert out.hidden_pre_norm.shape == out.hidden_post_norm.shape == (n_drafts, 64)
    assert out.base_logits.shape == (n_drafts, 512) and out.base_logits.dtype == torch.float32
    # float32 against float64: one side's bound
    atol = block_tolerances(drafter, ctx.length, out, sides=1)
    torch.testing.assert_close(out.hidden_pre_norm.double(), pre[rows], rtol=0, atol=atol["hidden_pre_norm"])
    torch.testing.assert_close(out.hidden_post_norm.double(), post[rows], rtol=0, atol=atol["hidden_post_norm"])
    torch.testing.assert_close(out.base_logits.double(), logits[rows], rtol=0, atol=atol["base_logits"])
    # the block's own K/V never enter the context
    assert ctx.length == 13
    assert_same_output(drafter.forward_block(ctx, anchor), out)


def test_window_and_causality_change_the_output():
    base = dict(num_layers=2, block_size=4, target_layer_ids=(1,), seed=5, layer_types=("full_attention",) * 2)
    full = init_random_drafter(TARGET, **base)
    features = random_features(full.config, 12)
    out_full = run_block(full, features, 3)
    weights = full.state_dict()
    for layer_types, window, causal in ((("full_attention", "sliding_attention"), 4, True),
                                        (("full_attention", "sliding_attention"), 64, True),
                                        (("full_attention", "sliding_attention"), 64, False)):
        config = dataclasses.replace(full.config, layer_types=layer_types, sliding_window=window, causal_sliding=causal)
        out = run_block(build_drafter(config, weights), features, 3)
        atol = block_tolerances(full, 12, out_full)["base_logits"]
        same = torch.allclose(out.base_logits, out_full.base_logits, rtol=0, atol=atol)
        # a window wider than the context, non-causal in the block, is full attention
        assert same == (window == 64 and not causal)


def test_dflash_drops_slot_zero():
    dspark = init_random_drafter(TARGET, block_size=4, target_layer_ids=(2,), seed=2)
    dflash = build_drafter(dataclasses.replace(dspark.config, slot_convention="dflash"), dspark.state_dict())
    assert (dspark.config.num_drafts, dflash.config.num_drafts) == (4, 3)
    features = random_features(dspark.config, 7)
    a, b = run_block(dspark, features, 9), run_block(dflash, features, 9)
    torch.testing.assert_close(b.hidden_pre_norm, a.hidden_pre_norm[1:], rtol=0, atol=0)
    # the same normed rows through the head, a matmul over fewer rows: each side within gamma_d |x| |W|^T
    assert_within(b.base_logits, a.base_logits[1:], 2 * linear_error_bound(b.hidden_post_norm, dflash.lm_head.weight))


def test_context_append_in_pieces_equals_at_once():
    drafter = init_random_drafter(TARGET, num_layers=2, target_layer_ids=(0, 5), seed=1)
    features = random_features(drafter.config, 20)
    whole = drafter.new_context()
    whole.append(features, 0)
    pieces = drafter.new_context(initial_capacity=2)  # grows while appending
    for start, end in ((0, 1), (1, 8), (8, 20)):
        pieces.append(features[start:end].reshape(end - start, -1), start)  # flat [n, m*hidden] works too
    assert whole.length == pieces.length == 20
    for i in range(2):
        for x, y in zip(whole.layer_kv(i), pieces.layer_kv(i), strict=True):
            assert x.shape == (2, 20, 16)
            torch.testing.assert_close(x, y, rtol=0, atol=kv_tolerance(drafter, y))
    expected = drafter.forward_block(pieces, 11)
    assert_same_output(drafter.forward_block(whole, 11), expected, block_tolerances(drafter, 20, expected))


@pytest.mark.parametrize("projected", [True, False], ids=["projected", "waiting"])
def test_truncate_then_reappend_equals_never_appending_the_dropped_rows(projected):
    """Truncating rows whose K/V a pass already projected, or rows still waiting for one."""
    drafter = init_random_drafter(TARGET, num_layers=2, target_layer_ids=(3,), seed=4)
    old, new = random_features(drafter.config, 10, seed=1), random_features(drafter.config, 12, seed=2)
    rewound = drafter.new_context()
    rewound.append(old[:4], 0)
    rewound.append(old[4:], 4)
    if projected:
        rewound.layer_kv(0)
    assert bool(rewound.waiting) != projected
    rewound.truncate(6)
    assert rewound.length == 6
    rewound.append(new[6:], 6)
    fresh = drafter.new_context()
    fresh.append(old[:6], 0)
    fresh.append(new[6:], 6)
    for i in range(2):
        for x, y in zip(rewound.layer_kv(i), fresh.layer_kv(i), strict=True):
            assert x.shape == y.shape == (2, 12, 16)
            torch.testing.assert_close(x[:, :6], y[:, :6], rtol=0, atol=kv_tolerance(drafter, y))  # fc: 10 rows vs 6
            torch.testing.assert_close(x[:, 6:], y[:, 6:], rtol=0, atol=0)
    expected = drafter.forward_block(fresh, 5)
    assert_same_output(drafter.forward_block(rewound, 5), expected, block_tolerances(drafter, 12, expected))


def test_one_pass_projects_the_waiting_rows_of_every_session_as_each_alone():
    """forward_blocks projects the rows its sessions' appends left waiting in one call; each session's K/V is what
    projecting it alone gives (the same per-row math, up to a matmul over more rows)."""
    drafter = init_random_drafter(TARGET, num_layers=2, target_layer_ids=(1, 4), seed=3)
    lengths = [(5, 3), (1, 7), (9, 1)]  # per session: rows appended in two pieces
    together, alone = [], []
    for seed, (a, b) in enumerate(lengths):
        features = random_features(drafter.config, a + b, seed=seed)
        ctx, ref = drafter.new_context(), drafter.new_context()
        for c in (ctx, ref):
            c.append(features[:a], 0)
            c.append(features[a:], a)
        together.append(ctx)
        alone.append(ref)
    outs = drafter.forward_blocks([(ctx, 7) for ctx in together])
    assert not any(ctx.waiting for ctx in together)
    for ctx, ref, out, (a, b) in zip(together, alone, outs, lengths, strict=True):
        assert ctx.length == ref.length == a + b
        for i in range(2):
            for x, y in zip(ctx.layer_kv(i), ref.layer_kv(i), strict=True):
                torch.testing.assert_close(x, y, rtol=0, atol=kv_tolerance(drafter, y))
        expected = drafter.forward_block(ref, 7)
        assert_same_output(out, expected, block_tolerances(drafter, ref.length, expected))


def test_context_asserts_positions_and_shapes():
    """The context asserts what it relies on; a request's rows and anchor are validated by DraftEngine
    (tests/service/test_draft_batching.py: test_the_engine_refuses_bad_requests_and_the_session_goes_on)."""
    drafter = init_random_drafter(TARGET, target_layer_ids=(3,))
    ctx = drafter.new_context()
    ctx.append(random_features(drafter.config, 4), 0)
    for bad in (lambda: ctx.append(random_features(drafter.config, 2), 3), lambda: ctx.append(torch.zeros(2, 2, 64), 4),
                lambda: ctx.truncate(5), lambda: drafter.forward_block(ctx, 512)):
        with pytest.raises(AssertionError):
            bad()
    assert ctx.length == 4


def test_random_drafter_for_smollm2(smollm2_path):
    from dspark_grpc.runtime.drafting.markov import draft_chain
    from dspark_grpc.runtime.formats.gguf_reader import open_gguf, read_gguf_metadata
    from dspark_grpc.runtime.models.config import config_from_gguf

    target = config_from_gguf(read_gguf_metadata(open_gguf(smollm2_path)))
    drafter = init_random_drafter(target, seed=7)
    c = drafter.config
    assert (c.vocab_size, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (49152, 576, 9, 3, 64)
    assert c.target_layer_ids == (15,) and c.num_target_layers == 30 and c.num_drafts == 4
    ctx = drafter.new_context()
    ctx.append(random_features(c, 8), 0)
    out = drafter.forward_block(ctx, 1)
    assert out.base_logits.shape == (4, 49152) and torch.isfinite(out.base_logits).all()
    chain = draft_chain(out.base_logits, out.hidden_pre_norm, out.hidden_post_norm, 1, drafter.markov,
                        drafter.confidence, drafter.d2t, kernel="torch")
    assert len(chain.tokens) == 4 and chain.confidences is not None and chain.confidences.shape == (4,)
    again = init_random_drafter(target, seed=7)
    state = again.state_dict()
    assert all(torch.equal(v, state[k]) for k, v in drafter.state_dict().items())
