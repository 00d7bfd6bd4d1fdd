"""A drafter that dies mid-request never changes the output; cancelled requests free their sessions."""

from __future__ import annotations

import socket
import time

import grpc
from dspark_grpc.client import TargetClient
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2

from tests.service.conftest import DRAFT_MAX_SESSIONS, HANG_S, concurrently, target_with_drafter

MESSAGES = [{"role": "user", "content": "Write a short poem about the sea."}]
NO_PROFILE_RANDOM = ["--drafter", "random", "--quiet", "--no-cost-profile"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A drafter killed mid-request (every request finishes with AR's tokens, new requests speculate again once it is
# back): tests/reliability/test_lifecycle.py::test_drafter_sigkill_costs_no_tokens_and_speculation_resumes, under 8
# concurrent requests.


def test_cancelled_request_frees_its_sessions_on_both_services(spec_target_address, draft_address):
    def drafter_info() -> draft_pb2.GetDrafterInfoResponse:
        with grpc.insecure_channel(draft_address) as channel:
            return draft_pb2_grpc.DraftServiceStub(channel).GetDrafterInfo(draft_pb2.GetDrafterInfoRequest(),
                                                                           timeout=HANG_S)

    # more requests than the drafter has session slots: a request whose draft session was not freed would make a
    # later request's drafter open fail, and that request would not speculate
    assert drafter_info().max_sessions == DRAFT_MAX_SESSIONS
    with TargetClient(spec_target_address) as client:
        for _ in range(DRAFT_MAX_SESSIONS + 1):
            stream = client.stream(messages=MESSAGES, max_new_tokens=200, ignore_eos=True, mode="speculation")
            for _ in range(3):  # the prefill's token, then two steps
                next(stream)
            opened_by = time.monotonic() + HANG_S
            while drafter_info().live_sessions != 1:  # this request's draft session (the ones before it are freed)
                assert time.monotonic() < opened_by, "the request's draft session never opened"
                time.sleep(0.05)
            stream.close()  # the caller walks away mid-generation
    deadline = time.monotonic() + HANG_S
    while True:
        with TargetClient(spec_target_address) as target:
            target_live = target.model_info().live_sessions
        draft_live = drafter_info().live_sessions
        if target_live == draft_live == 0:
            break
        assert time.monotonic() < deadline, (target_live, draft_live)
        time.sleep(0.5)


def test_generate_rpc_speculates_server_side(spec_target_address):
    import grpc
    from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2_grpc

    with grpc.insecure_channel(spec_target_address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        prompt = common_pb2.Prompt(chat=common_pb2.ChatMessages(messages=[
            common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]))

        def run(mode_proposal: tuple[int, int]) -> tuple[list[int], str, common_pb2.GenerationStats]:
            mode, proposal = mode_proposal
            out = list(stub.Generate(target_pb2.GenerateRequest(
                prompt=prompt, max_new_tokens=24, mode=mode, proposal=proposal), timeout=120))
            return [t for m in out for t in m.token_ids], "".join(m.text for m in out), out[-1].stats

        keys = [(mode, proposal) for mode in (common_pb2.DECODE_MODE_AR, common_pb2.DECODE_MODE_SPECULATION)
                for proposal in (draft_pb2.PROPOSAL_KIND_CHAIN, draft_pb2.PROPOSAL_KIND_TREE)]
        runs = dict(zip(keys, concurrently(run, keys), strict=True))  # the four requests at once
        ar = runs[common_pb2.DECODE_MODE_AR, draft_pb2.PROPOSAL_KIND_CHAIN]
        for (mode, _), (ids, text, stats) in runs.items():
            assert (ids, text) == ar[:2]
            assert stats.mode_run == mode and stats.fallback_reason == ""


def test_drafter_for_another_target_is_refused_and_the_request_goes_on(draft_address, tiny_hf_models,
                                                                       smollm2_path):
    """A tiny target (SmolLM2's tokenizer, another model) started with the random drafter built for SmolLM2."""
    from dspark_grpc.runtime.formats.tokenizer import TextTokenizer

    other = tiny_hf_models["qwen3"]
    TextTokenizer.from_gguf(smollm2_path).save(other)  # same tokenizer, another model
    with target_with_drafter(draft_address, "--model", str(other)) as target, TargetClient(target) as client:
        reference = client.generate(messages=MESSAGES, max_new_tokens=16, mode="ar")
        result = client.generate(messages=MESSAGES, max_new_tokens=16, mode="speculation")
    assert result.token_ids == reference.token_ids
    assert "refused the drafter" in result.stats.fallback_reason and "another target" in result.stats.fallback_reason
    assert result.stats.speculative_steps == 0 and result.stats.mode_run == common_pb2.DECODE_MODE_AR


def test_adaptive_mode_with_a_drafter_that_is_never_right_is_lossless_and_accounts_for_every_step(
        spec_target_address):
    """A random DSpark drafter never gets a token accepted. How often adaptive decoding still probes it depends on
    measured times, so this test asserts no count of them: that decision is tested without a clock in
    tests/test_mode_chooser.py. Here: the output is AR's, and every step is accounted for: a step speculated, or ran
    AR because the target's chooser said so (it keeps its estimates across requests; other tests use this target)."""
    with TargetClient(spec_target_address) as client:
        ar = client.generate(messages=MESSAGES, max_new_tokens=64, ignore_eos=True, mode="ar")
        adaptive = client.generate(messages=MESSAGES, max_new_tokens=64, ignore_eos=True, mode="adaptive",
                                   proposer="dspark")
    assert adaptive.token_ids == ar.token_ids
    s = adaptive.stats
    assert s.speculative_steps + s.ar_steps == s.steps
    assert s.planned_ar_steps == s.ar_steps  # no drafter failure, no round cut: every AR step was chosen


def test_generate_exports_spec_decode_metrics(spec_target):
    import re
    import urllib.request

    import grpc
    from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2_grpc

    address, url = spec_target
    with grpc.insecure_channel(address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        out = list(stub.Generate(target_pb2.GenerateRequest(
            prompt=common_pb2.Prompt(text="Repeat: a b c, a b c, a b c,"), max_new_tokens=16,
            mode=common_pb2.DECODE_MODE_SPECULATION), timeout=120))
    stats = out[-1].stats
    text = urllib.request.urlopen(url, timeout=HANG_S).read().decode()

    def value(name: str) -> float:
        found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, flags=re.M)
        assert found, name
        return sum(float(v) for v in found)

    assert value("dspark:spec_decode_num_drafts_total") >= stats.speculative_steps > 0
    assert value("dspark:spec_decode_num_accepted_tokens_total") >= sum(stats.accepted_per_position)
    # the target's batched forwards (prefill, verifies, AR steps) on the same endpoint
    assert value("dspark:target_forward_seconds_count") >= stats.steps > 0
    assert value("dspark:target_forward_rows_sum") >= stats.prompt_tokens + stats.steps
    assert value("dspark:target_forward_sessions_count") == value("dspark:target_forward_seconds_count")
    # the adaptive mode's view, read at the scrape: the steps of every mode are its samples
    assert re.search(r'^dspark:adaptive\{load="\d+",value="speculation"\} [0-9.e+-]+$', text, flags=re.M), text
