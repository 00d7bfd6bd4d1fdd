"""The target's and the drafter's forwards are device-clean, checked without a GPU: the model on the `meta` device
(shapes and devices, no data), the inputs from the host as the engines give them, and every aten op checked to take
its tensors from one device, as CUDA requires. A factory call in a forward that forgets its `device=` (a
`torch.ones(n)` beside the model's tensors) makes a CPU tensor and fails here.

`OneDevice` is stricter than meta alone, which forgives some mixes that CUDA refuses (an index_select with a CPU
index). Data-dependent steps (sampling, acceptance, the Markov chain: host syncs) cannot run on meta; the CUDA tests
(tests/runtime/test_cuda.py, `make gpu-check`) run those.
"""

from __future__ import annotations

import pytest
import torch
from dspark_grpc.runtime.formats.checkpoint import Checkpoint, inference_model
from dspark_grpc.runtime.formats.drafter_formats import init_random_drafter
from dspark_grpc.runtime.kernels.device import cpu_only_note
from dspark_grpc.runtime.models.config import ModelConfig
from dspark_grpc.runtime.models.decode import commit_path, prefill, tree_input, verify_tree
from dspark_grpc.runtime.models.transformer import Transformer, causal_mask
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
# ops that take tensors from two devices on CUDA too: a copy between devices, and indexing with host indices
CROSS_DEVICE = {aten.copy_, aten._to_copy, aten.index, aten.index_put_, aten.index_put, aten._index_put_impl_}


class OneDevice(TorchDispatchMode):
    """Every aten op's tensors on one device (a 0-dim CPU tensor is a scalar: CUDA takes it beside its own)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket not in CROSS_DEVICE:
            devices = {str(t.device) for t in pytree.tree_leaves((args, kwargs))
                       if isinstance(t, torch.Tensor) and not (t.dim() == 0 and t.device.type == "cpu")}
            assert len(devices) <= 1, f"{func} mixes tensors on {sorted(devices)}"
        return func(*args, **kwargs)


LLAMA = ModelConfig(architecture="llama", name="tiny", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                    rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=True)
QWEN35 = ModelConfig(architecture="qwen35", name="tiny-hybrid", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                     rope_scaling=None, max_position_embeddings=512, tie_word_embeddings=False, qk_norm=True,
                     layer_types=("linear_attention", "attention", "linear_attention"), rotary_dim=4,
                     attention_output_gate=True, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel=4)


def test_the_check_catches_a_host_tensor_in_a_meta_forward():
    with OneDevice(), pytest.raises(AssertionError, match="index_select.* mixes tensors on .'cpu', 'meta'"):
        torch.ones(3, device="meta").index_select(0, torch.tensor([0]))  # meta alone lets this one through
    with OneDevice():
        torch.ones(3, device="meta")[torch.tensor([0])] = 1.0  # host indices: CUDA takes them too
        assert causal_mask(2, 3, torch.device("meta")).device.type == "meta"


@pytest.mark.parametrize("config, precision", [(LLAMA, "exact"), (LLAMA, "fast"), (QWEN35, "exact")],
                         ids=["llama-exact", "llama-fast", "qwen35-exact"])
def test_target_forwards_on_meta(config, precision):
    """As the target engine runs its model: loaded on the CPU, moved (inference_model), then prefill in chunks, a
    tree verify, a compacting commit, two sessions in one forward, an explicit mask, rollback."""
    torch.manual_seed(0)
    ckpt = Checkpoint(config, Transformer(config).state_dict())
    with OneDevice():
        model = inference_model(ckpt, precision, device="meta")  # "fast": the batch-invariant attention as well
        assert model.device.type == "meta" and model.batch_invariant == (precision == "fast")
        a, b = model.new_cache(initial_capacity=8), model.new_cache()
        logits, captures = prefill(model, a, list(range(1, 12)), capture_layers=(0, 1), chunk_size=6)  # a resize
        assert logits.device.type == "meta" and captures.shape == (11, 2, config.hidden_size)
        logits, _ = verify_tree(model, a, [5, 6, 7, 8, 9], [-1, 0, 0, 1, 2], capture_layers=(1,))
        assert logits.shape == (5, config.vocab_size)
        commit_path(a, [0, 2, 4])
        prefill(model, b, [3, 4, 5])
        outs = model.forward_batch([tree_input(a, [9, 10, 11], [-1, 0, 0]), tree_input(b, [12], [-1])])
        assert [o.logits.shape[0] for o in outs] == [3, 1]
        a.pending_parents, b.pending_parents = [-1, 0, 0], [-1]
        commit_path(a, [0, 2])
        commit_path(b, [0])
        n = a.length
        mask = torch.ones(2, n + 2, dtype=torch.bool)
        mask[0, n + 1] = False  # a chain given as an explicit mask
        out = model(torch.tensor([1, 2]), torch.tensor([n, n + 1]), a, mask=mask, logits_rows=torch.tensor([1]))
        assert out.logits.shape == (1, config.vocab_size)
        commit_path(a, [0, 1])
        assert a.can_rollback(a.length - 1)
        a.rollback(a.length - 1)
        prefill(model, a, [7])


@pytest.mark.parametrize("sliding", [False, True], ids=["full", "sliding"])
def test_drafter_forward_on_meta(sliding):
    """As the draft engine runs its drafter: built on the CPU, moved, packed; context rows appended from the wire
    (bf16 on the host), projected in a pass, two sessions' blocks in one pass, a truncate."""
    target = ModelConfig(**{**LLAMA.__dict__, "num_layers": 4})
    drafter = init_random_drafter(target, num_layers=2, block_size=4, target_layer_ids=(0, 3),
                                  layer_types=("sliding_attention", "full_attention") if sliding else None,
                                  sliding_window=4 if sliding else None, seed=1)
    with OneDevice():
        drafter = drafter.to("meta").eval().requires_grad_(False).pack()
        contexts = [drafter.new_context(), drafter.new_context()]
        for i, ctx in enumerate(contexts):
            ctx.append(torch.randn(6 + 3 * i, 2, target.hidden_size).to(torch.bfloat16), 0)
        outs = drafter.forward_blocks([(contexts[0], 3), (contexts[1], 4)])
        assert outs[1].base_logits.device.type == "meta" and outs[1].base_logits.shape == (4, target.vocab_size)
        contexts[0].truncate(4)
        contexts[0].append(torch.randn(2, 2, target.hidden_size), 4)
        drafter.forward_block(contexts[0], 5)


def test_what_falls_back_off_the_cpu_is_said_in_one_line():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert cpu_only_note(cpu, "fast", "max") is None
    assert cpu_only_note(gpu, "exact", "off") is None
    note = cpu_only_note(gpu, "fast", "max")
    assert "\n" not in note and note.startswith("cuda:0: ") and "compile max is off" in note
    assert "bf16 on torch's matmuls" in note and "eager" in note


def test_a_checkpoint_with_blocks_stays_on_the_cpu():
    from dspark_grpc.runtime.kernels.quant import QuantBlocks

    ckpt = Checkpoint(LLAMA, Transformer(LLAMA).state_dict(), blocks={"layers.0.attention.wq.weight": QuantBlocks})
    with pytest.raises(ValueError, match="CPU-only"):
        inference_model(ckpt, "fast", device="meta")
    with pytest.raises(ValueError, match="CPU-only"):
        inference_model(Checkpoint(LLAMA, Transformer(LLAMA).state_dict()), "fast", compile="fast", device="meta")
