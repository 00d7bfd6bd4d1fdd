"""Generation through the real target service vs HF transformers as the independent reference."""

from __future__ import annotations

import random
import signal
import subprocess
import sys

import pytest
import torch
from dspark_grpc.client import TargetClient
from dspark_grpc.client.local_stack import local_target
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
from dspark_grpc.runtime.models.config import config_from_hf
from dspark_grpc.serving.tensor_codec import from_proto
from tolerance import chain_length, hidden_tolerance, logit_scale, network_tolerance, unit_roundoff

from tests.service.conftest import concurrently

CHATS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
]
TEXTS = ["The quick brown fox", "def fibonacci(n):\n"]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def tokenizer(smollm2_path) -> TextTokenizer:
    return TextTokenizer.from_gguf(smollm2_path)


def prompt_ids(tokenizer: TextTokenizer) -> list[list[int]]:
    chats = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": c}])) for c in CHATS]
    return chats + [tokenizer.encode(t) for t in TEXTS]


def hf_greedy_check(hf_model, prompt: list[int], generated: list[int]) -> None:
    """Teacher-forced: HF's argmax after every prefix of our output must be our next token."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + generated])).logits[0].float()
    ref = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated)]
    ours = torch.tensor(generated)
    mismatch = (ref.argmax(-1) != ours).nonzero()
    if len(mismatch):
        i = int(mismatch[0])
        top2 = ref[i].topk(2)
        pytest.fail(f"token {i}: ours {generated[i]}, HF {int(ref[i].argmax())} (HF top-2 gap "
                    f"{float(top2.values[0] - top2.values[1]):.2e})")


def test_greedy_generation_matches_hf(client, tokenizer, hf_smollm2):
    # through the service, a chat prompt and a text prompt; more prompts vs HF in tests/runtime/test_smollm2_vs_hf.py
    prompts = prompt_ids(tokenizer)
    chosen = (prompts[1], prompts[-1])
    results = concurrently(lambda ids: client.generate(tokens=ids, max_new_tokens=NEW_TOKENS, ignore_eos=True), chosen)
    for ids, result in zip(chosen, results, strict=True):
        assert len(result.token_ids) == NEW_TOKENS and result.finish_reason == "length"
        assert result.stats.prompt_tokens == len(ids) and result.stats.steps == NEW_TOKENS - 1
        hf_greedy_check(hf_smollm2, ids, result.token_ids)


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_tiny_hf_safetensors_models_match_hf(name, tiny_hf_models, tokenizer):
    from transformers import AutoModelForCausalLM

    directory = tiny_hf_models[name]
    tokenizer.save(directory)
    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    rng = random.Random(7)
    args = ["--model", str(directory), "--quiet", "--no-cost-profile"]
    with local_target(args, echo=False) as address, TargetClient(address) as c:
        c.wait_ready(120)
        assert c.model_info().architecture == name
        for _ in range(5):
            ids = [rng.randrange(3, 49152) for _ in range(rng.randrange(3, 20))]
            result = c.generate(tokens=ids, max_new_tokens=NEW_TOKENS, ignore_eos=True)
            assert len(result.token_ids) == NEW_TOKENS
            hf_greedy_check(hf, ids, result.token_ids)


def test_captures_equal_hf_hidden_states(raw, tokenizer, hf_smollm2):
    layers = [0, 14, 28]
    ids = prompt_ids(tokenizer)[1]
    sid = raw.ok(open=target_pb2.OpenSession(capture_layer_ids=layers)).session_id
    pre = raw.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(
        tokens=common_pb2.TokenIds(ids=ids))))
    # two more committed steps: a chain of 3 drafted tokens (whatever is accepted) and a plain step
    v1 = raw.ok(verify=target_pb2.Verify(session_id=sid, commit=True, tree=common_pb2.TokenTree(
        tokens=[pre.next_token, 11, 12, 13], parents=[-1, 0, 1, 2])))
    v2 = raw.ok(verify=target_pb2.Verify(session_id=sid, commit=True, tree=common_pb2.TokenTree(
        tokens=[v1.next_token], parents=[-1])))
    sequence = ids + [pre.next_token] + [[11, 12, 13][n - 1] for n in v1.accepted_path[1:]] + [v1.next_token]
    assert v2.length == len(sequence)
    with torch.no_grad():
        hidden = hf_smollm2(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    reference = torch.stack([hidden[layer + 1][0] for layer in layers], dim=1)  # [rows, L, H]
    captures = [pre.capture, v1.capture, v2.capture]
    assert [c.start_position for c in captures] == [0, len(ids), len(ids) + len(v1.accepted_path)]
    rows = torch.cat([from_proto(c.rows) for c in captures])
    assert rows.dtype == torch.bfloat16 and list(captures[0].layer_ids) == layers
    assert rows.shape == reference.shape
    # the exact precision's float32 hidden states vs HF's (tests/tolerance.py's bound), sent rounded to bf16
    config = config_from_hf({**hf_smollm2.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    u = unit_roundoff(torch.bfloat16)
    for j, layer in enumerate(layers):
        atol = hidden_tolerance(config, len(sequence), layer + 1, reference[:, j])
        torch.testing.assert_close(rows[:, j].float(), reference[:, j], atol=atol, rtol=u / (1 - u))


def random_tree(rng: random.Random, root: int, branches: int = 3, depth: int = 4) -> tuple[list[int], list[int]]:
    tokens, parents = [root], [-1]
    for _ in range(branches):
        parent = 0
        for _ in range(depth):
            tokens.append(rng.randrange(3, 49152))
            parents.append(parent)
            parent = len(tokens) - 1
        if rng.random() < 0.7:  # a side branch off this chain
            tokens.append(rng.randrange(3, 49152))
            parents.append(rng.randrange(1, len(tokens) - 1))
    return tokens, parents


def path_of(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def test_tree_verify_logits_and_commit(raw, tokenizer, hf_smollm2):
    ids = prompt_ids(tokenizer)[0]
    sid = raw.ok(open=target_pb2.OpenSession()).session_id
    pre = raw.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(
        tokens=common_pb2.TokenIds(ids=ids))))
    tokens, parents = random_tree(random.Random(3), pre.next_token)
    verified = raw.ok(verify=target_pb2.Verify(
        session_id=sid, tree=common_pb2.TokenTree(tokens=tokens, parents=parents),
        return_logits=target_pb2.LOGITS_RETURN_ALL))
    logits = from_proto(verified.logits)
    assert logits.shape == (len(tokens), 49152) and not verified.committed
    # every node's logits == HF run on the plain sequence prompt + root..node (one HF run per leaf), within
    # tests/tolerance.py's bound for the exact precision's float32 model
    config = config_from_hf({**hf_smollm2.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    scale = logit_scale(hf_smollm2.lm_head.weight, hf_smollm2.model.norm.weight)
    checked = set()
    for leaf in set(range(len(tokens))) - set(parents):
        path = path_of(parents, leaf)
        with torch.no_grad():
            ref = hf_smollm2(torch.tensor([ids + [tokens[n] for n in path]])).logits[0, len(ids):]
        atol = network_tolerance(chain_length(config, len(ids) + len(path)), scale)
        torch.testing.assert_close(logits[path], ref, rtol=0, atol=atol)
        checked.update(path)
    assert checked == set(range(len(tokens)))

    # commit a deep path that the target did not choose, then continue with AR
    leaf = max(range(len(tokens)), key=lambda n: len(path_of(parents, n)))
    path = path_of(parents, leaf)
    committed = raw.ok(commit=target_pb2.Commit(session_id=sid, path=path, next_token=42))
    assert committed.length == len(ids) + len(path) and len(committed.token_texts) == len(path)
    continued, pending = [], 42
    for _ in range(10):
        v = raw.ok(verify=target_pb2.Verify(session_id=sid, commit=True, tree=common_pb2.TokenTree(
            tokens=[pending], parents=[-1])))
        pending = v.next_token
        continued.append(pending)
    # plain AR over the same tokens from scratch
    fresh = raw
    sid2 = fresh.ok(open=target_pb2.OpenSession()).session_id
    plain = ids + [tokens[n] for n in path] + [42]
    p2 = fresh.ok(prefill=target_pb2.Prefill(session_id=sid2, prompt=common_pb2.Prompt(
        tokens=common_pb2.TokenIds(ids=plain))))
    expected, pending = [p2.next_token], p2.next_token
    for _ in range(9):
        v = fresh.ok(verify=target_pb2.Verify(session_id=sid2, commit=True, tree=common_pb2.TokenTree(
            tokens=[pending], parents=[-1])))
        pending = v.next_token
        expected.append(pending)
    assert continued == expected


def test_rollback_replays_the_same_greedy_tokens(raw):
    sid = raw.ok(open=target_pb2.OpenSession()).session_id
    pre = raw.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(text="Once upon a time")))
    pending, seq = pre.next_token, []
    for _ in range(8):
        v = raw.ok(verify=target_pb2.Verify(session_id=sid, commit=True,
                                            tree=common_pb2.TokenTree(tokens=[pending], parents=[-1])))
        pending = v.next_token
        seq.append(pending)
    keep = v.length - 4
    back = raw.ok(rollback=target_pb2.Rollback(session_id=sid, length=keep))
    assert back.length == keep and back.pending_token == seq[-5]
    pending, replay = back.pending_token, []
    for _ in range(4):
        v = raw.ok(verify=target_pb2.Verify(session_id=sid, commit=True,
                                            tree=common_pb2.TokenTree(tokens=[pending], parents=[-1])))
        pending = v.next_token
        replay.append(pending)
    assert replay == seq[-4:]


def test_eos_stop_strings_and_max_tokens(client):
    chat = [{"role": "user", "content": CHATS[0]}]
    full = client.generate(messages=chat, max_new_tokens=200)
    assert full.finish_reason == "eos" and 2 not in full.token_ids  # <|im_end|> ends the reply, not shown
    assert 0 < len(full.token_ids) < 200
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    short, cut, streamed = concurrently(lambda run: run(), [  # the three requests at once
        lambda: client.generate(messages=chat, max_new_tokens=3),
        lambda: client.generate(messages=chat, max_new_tokens=200, stop=[stop]),
        lambda: list(client.stream(messages=chat, max_new_tokens=200))])
    assert short.finish_reason == "length" and short.token_ids == full.token_ids[:3]
    assert cut.finish_reason == "stop_string" and cut.text == full.text[: full.text.index(stop)]
    assert "".join(t for t, _, _ in streamed) == full.text and streamed[-1][2] == "eos"


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(prompt="My favourite animal is", max_new_tokens=16, temperature=0.9, top_p=0.95, ignore_eos=True)
    a, again = concurrently(lambda seed: client.generate(seed=seed, **kwargs).token_ids, (1, 1))
    assert a == again
    others = {tuple(t) for t in concurrently(lambda seed: client.generate(seed=seed, **kwargs).token_ids, (2, 3, 4))}
    assert len(others | {tuple(a)}) > 1


def test_graceful_shutdown(tiny_hf_models, smollm2_path):
    directory = tiny_hf_models["qwen3"]
    TextTokenizer.from_gguf(smollm2_path).save(directory)
    cmd = [sys.executable, "-m", "dspark_grpc.target_service.cli", "serve", "--model", str(directory),
           "--port", "0", "--quiet", "--grace", "2", "--no-cost-profile"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "SERVING on" in line:
            break
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, "".join(lines) + out
    assert "shutting down" in out
