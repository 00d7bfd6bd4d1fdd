"""`dspark bench --baseline transformers` (bench/transformers_baseline.py, issue 57 point 3): HF's generate on
the embedded GGUF through transformers' own GGUF loader, run as the bench runs it (a child process, its JSON on
stdout). Its greedy tokens are our exact precision's AR tokens for the same prompt ids: the reference line runs the
same model; EOS is honoured or ignored as the bench's modes do (a tiny random Llama, in process)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from dspark_grpc.bench.transformers_baseline import generate
from dspark_grpc.runtime.formats.checkpoint import default_model_path, inference_model, load_checkpoint
from dspark_grpc.runtime.formats.gguf_reader import open_gguf, read_gguf_metadata
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
from dspark_grpc.target_service.engine import encode_prompt
from runtime_helpers import greedy_decode

PROMPTS = [{"prompt": "The three primary colours are"},
           {"messages": [{"role": "user", "content": "Hi!"}]}]
TOKENS = 20


def baseline(tmp_path, *extra: str) -> dict:
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(PROMPTS))
    run = subprocess.run([sys.executable, "-m", "dspark_grpc.bench.transformers_baseline", "--prompts-json",
                          str(path), "--max-new-tokens", str(TOKENS), "--device", "cpu", *extra],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


def test_the_transformers_baseline_generates_our_exact_precisions_tokens(tmp_path):
    path = default_model_path()
    tokenizer = TextTokenizer.from_gguf_metadata(read_gguf_metadata(open_gguf(path)))
    model = inference_model(load_checkpoint(path, progress=False), "exact")
    ours = [greedy_decode(model, encode_prompt(tokenizer, p.get("prompt") or p["messages"], 1 << 31), TOKENS)[0]
            for p in PROMPTS]
    result = baseline(tmp_path, "--ignore-eos")
    assert result["outputs"] == ours and result["generated_tokens"] == TOKENS * len(PROMPTS)
    assert result["tokens_per_s"] > 0 and "eager" in result["engine"]
    assert any(t in tokenizer.eos_token_ids for t in ours[1]), ours[1]  # ignored: the greeting's reply went on


def test_the_baseline_stops_at_the_first_eos_unless_told_to_ignore_it():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)).eval()
    full = generate(model, [1, 5, 9, 13], 12, [], static_cache=False)
    assert len(full) == 12
    eos = full[4]
    assert generate(model, [1, 5, 9, 13], 12, [eos], static_cache=False) == full[: full.index(eos)]
    assert generate(model, [1, 5, 9, 13], 12, [], static_cache=True) == full  # the static cache: the same tokens
