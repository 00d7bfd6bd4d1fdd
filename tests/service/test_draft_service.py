"""The draft service over gRPC: same drafts as in-process, clear statuses for bad input, lossless speculation."""

from __future__ import annotations

import grpc
import pytest
import torch
from dspark_grpc.client import TargetClient
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2
from dspark_grpc.serving.tensor_codec import from_proto, to_proto
from dspark_grpc.speculation.channel import SessionStream
from tolerance import gamma, softmax_error

from tests.service.conftest import DRAFT_MAX_SESSIONS, RawSession, concurrently, health_status

INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, FAILED_PRECONDITION = 3, 5, 8, 9
PROMPT = [1, 9690, 198, 23409, 253, 2143, 1202, 338, 14855, 2, 198, 1, 520, 9531, 198]


class DraftSession:
    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = draft_pb2_grpc.DraftServiceStub(self.channel)
        self.stream = SessionStream(self.stub.DraftSession, timeout=300)
        self.next_id = 0

    def call(self, **op) -> draft_pb2.DraftSessionResponse:
        self.next_id += 1
        return self.stream.call(draft_pb2.DraftSessionRequest(request_id=self.next_id, **op))

    def ok(self, **op):
        r = self.call(**op)
        assert r.status.code == 0, r.status.message
        return getattr(r, r.WhichOneof("result"))

    def expect(self, code: int, words: str, **op) -> None:
        r = self.call(**op)
        assert (r.status.code, r.WhichOneof("result")) == (code, None), r.status
        assert words in r.status.message, r.status.message

    def close(self) -> None:
        self.stream.close()
        self.channel.close()


@pytest.fixture()
def draft(draft_address):
    s = DraftSession(draft_address)
    yield s
    s.close()


@pytest.fixture(scope="module")
def target_rows(target_address, draft_address):
    """The real target's prefill of PROMPT: its pending token and the capture at the drafter's layers."""
    info = DraftSession(draft_address).stub.GetDrafterInfo(draft_pb2.GetDrafterInfoRequest())
    raw = RawSession(target_address)
    sid = raw.ok(open=target_pb2.OpenSession(capture_layer_ids=info.target_layer_ids,
                                             drafter_target=info.target)).session_id
    pre = raw.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(
        tokens=common_pb2.TokenIds(ids=PROMPT))))
    fingerprint = raw.ok(open=target_pb2.OpenSession()).fingerprint
    raw.close()
    return info, pre, fingerprint


def opened(draft: DraftSession, fingerprint) -> str:
    return draft.ok(open=draft_pb2.OpenDraft(target=fingerprint)).session_id


def append_prompt(draft: DraftSession, sid: str, pre) -> None:
    assert draft.ok(append=draft_pb2.AppendContext(session_id=sid, start_position=0, tokens=PROMPT,
                                                   capture=pre.capture)).length == len(PROMPT)


@pytest.fixture(scope="module")
def in_process_engine():
    from dspark_grpc.draft_service.engine import DraftEngine

    return DraftEngine.load("random", seed=0, progress=False)


@pytest.mark.parametrize("kind,kernel", [
    (draft_pb2.PROPOSAL_KIND_CHAIN, draft_pb2.KERNEL_CHOICE_TORCH),
    (draft_pb2.PROPOSAL_KIND_CHAIN, draft_pb2.KERNEL_CHOICE_FUSED),
    (draft_pb2.PROPOSAL_KIND_TREE, draft_pb2.KERNEL_CHOICE_TORCH),
])
def test_drafting_over_grpc_equals_in_process(draft, target_rows, in_process_engine, kind, kernel):
    info, pre, fingerprint = target_rows
    sid = opened(draft, fingerprint)
    append_prompt(draft, sid, pre)
    tree = kind == draft_pb2.PROPOSAL_KIND_TREE
    budget = 6 if tree else 0  # a chain: the drafter's whole block
    proposal = draft.ok(propose=draft_pb2.Propose(session_id=sid, anchor_token=pre.next_token,
                                                  anchor_position=len(PROMPT), kind=kind, kernel=kernel, budget=budget,
                                                  proposer=draft_pb2.PROPOSER_DSPARK))
    engine = in_process_engine
    local = engine.open_session(engine.target_fingerprint)
    engine.append(local, 0, PROMPT, list(pre.capture.layer_ids), from_proto(pre.capture.rows))
    expected = engine.propose(local, pre.next_token, len(PROMPT), tree=tree, budget=budget, kernel="torch",
                              proposer="dspark")
    assert list(proposal.tree.tokens) == expected.tokens and list(proposal.tree.parents) == expected.parents
    assert proposal.tree.tokens[0] == pre.next_token
    assert not proposal.tree.HasField("child_token_ids")  # greedy: no distributions to carry
    assert from_proto(proposal.confidences).shape == (info.block_size,)
    if tree:
        assert len(proposal.tree.tokens) == 7  # budget 6 + the root
    else:
        assert proposal.tree.parents == list(range(-1, info.block_size))


def test_a_round_answers_each_op_as_alone_and_drafts_its_proposals_in_one_pass(draft, target_rows):
    """DraftRound, what a target sends for its sessions: opens under the target's ids, appends, proposals; each op
    answers as it would alone, and the round's proposals share one drafter pass."""
    info, pre, fingerprint = target_rows

    def propose(sid: str) -> draft_pb2.DraftSessionRequest:
        return draft_pb2.DraftSessionRequest(propose=draft_pb2.Propose(
            session_id=sid, anchor_token=pre.next_token, anchor_position=len(PROMPT),
            proposer=draft_pb2.PROPOSER_DSPARK, kernel=draft_pb2.KERNEL_CHOICE_TORCH))

    sid = opened(draft, fingerprint)
    append_prompt(draft, sid, pre)
    alone = draft.ok(propose=propose(sid).propose)
    ops = []
    for name in ("round-a", "round-b"):
        ops += [draft_pb2.DraftSessionRequest(open=draft_pb2.OpenDraft(target=fingerprint, session_id=name)),
                draft_pb2.DraftSessionRequest(append=draft_pb2.AppendContext(
                    session_id=name, start_position=0, tokens=PROMPT, capture=pre.capture)),
                propose(name)]
    results = draft.ok(round=draft_pb2.DraftRound(ops=ops)).results
    assert [r.status.code for r in results] == [0] * 6
    assert [r.opened.session_id for r in results[0::3]] == ["round-a", "round-b"]
    assert [r.appended.length for r in results[1::3]] == [len(PROMPT)] * 2
    for r in results[2::3]:
        assert (list(r.proposal.tree.tokens), list(r.proposal.tree.parents)) == (list(alone.tree.tokens),
                                                                                list(alone.tree.parents))
    assert alone.batch_sessions == 1 and [r.proposal.batch_sessions for r in results[2::3]] == [2, 2]
    draft.expect(INVALID_ARGUMENT, "in use", open=draft_pb2.OpenDraft(target=fingerprint, session_id="round-a"))
    draft.expect(INVALID_ARGUMENT, "round", round=draft_pb2.DraftRound(ops=[
        draft_pb2.DraftSessionRequest(round=draft_pb2.DraftRound())]))


def test_duplicate_rows_are_idempotent_and_gaps_refused(draft, target_rows):
    info, pre, fingerprint = target_rows
    sid = opened(draft, fingerprint)
    append_prompt(draft, sid, pre)
    append_prompt(draft, sid, pre)  # the same rows again: accepted, nothing added
    rows = from_proto(pre.capture.rows)
    partial = common_pb2.HiddenCapture(layer_ids=pre.capture.layer_ids, start_position=5, rows=to_proto(rows[5:9]))
    assert draft.ok(append=draft_pb2.AppendContext(session_id=sid, start_position=5, tokens=PROMPT[5:9],
                                                   capture=partial)).length == len(PROMPT)
    gap = common_pb2.HiddenCapture(layer_ids=pre.capture.layer_ids, start_position=len(PROMPT) + 2,
                                   rows=to_proto(rows[:1]))
    draft.expect(FAILED_PRECONDITION, "gap", append=draft_pb2.AppendContext(
        session_id=sid, start_position=len(PROMPT) + 2, tokens=[5], capture=gap))
    conflict = list(PROMPT[5:9])
    conflict[1] += 1
    draft.expect(FAILED_PRECONDITION, "differ", append=draft_pb2.AppendContext(
        session_id=sid, start_position=5, tokens=conflict, capture=partial))
    assert draft.ok(truncate=draft_pb2.TruncateContext(session_id=sid, length=5)).length == 5
    assert draft.ok(append=draft_pb2.AppendContext(session_id=sid, start_position=5, tokens=conflict,
                                                   capture=partial)).length == 9


def test_bad_feature_rows(draft, target_rows):
    info, pre, fingerprint = target_rows
    sid = opened(draft, fingerprint)
    rows = from_proto(pre.capture.rows)
    layers = pre.capture.layer_ids

    def append(capture, tokens=PROMPT):
        return dict(append=draft_pb2.AppendContext(session_id=sid, start_position=0, tokens=tokens, capture=capture))

    narrow = common_pb2.HiddenCapture(layer_ids=layers, start_position=0, rows=to_proto(rows[:, :, :100]))
    draft.expect(INVALID_ARGUMENT, "expected", **append(narrow))
    as_int = common_pb2.HiddenCapture(layer_ids=layers, start_position=0, rows=to_proto(rows.to(torch.int32)))
    draft.expect(INVALID_ARGUMENT, "bfloat16", **append(as_int))
    short = to_proto(rows)
    short.data = short.data[:-2]
    draft.expect(INVALID_ARGUMENT, "bytes but shape", **append(
        common_pb2.HiddenCapture(layer_ids=layers, start_position=0, rows=short)))
    draft.expect(INVALID_ARGUMENT, "target_layer_ids", **append(
        common_pb2.HiddenCapture(layer_ids=[i + 1 for i in layers], start_position=0, rows=to_proto(rows))))
    draft.expect(INVALID_ARGUMENT, "expected", **append(
        common_pb2.HiddenCapture(layer_ids=layers, start_position=0, rows=to_proto(rows)), tokens=PROMPT[:-1]))
    draft.expect(INVALID_ARGUMENT, "capture is missing", append=draft_pb2.AppendContext(
        session_id=sid, start_position=0, tokens=PROMPT))


def test_the_drafter_says_how_its_prompt_lookup_matches(target_rows):
    """A target finds the same lookup candidates in its own tokens with these (target_service/step_engine.py
    `_lookup`): the draft service's defaults, as `dspark-draft serve --help` gives them."""
    from dspark_grpc.draft_service.engine import DraftLimits

    info = target_rows[0]
    limits = DraftLimits()
    assert (info.prompt_lookup.min_ngram, info.prompt_lookup.max_ngram, info.prompt_lookup.chain_tokens,
            info.prompt_lookup.hybrid_min_match) == (limits.ngram_min, limits.ngram_max, limits.ngram_chain,
                                                     limits.hybrid_min_match)
    assert info.prompt_lookup.min_ngram >= 1


def test_bad_sessions_budgets_and_handshakes(draft, target_rows, draft_address):
    info, pre, fingerprint = target_rows
    draft.expect(NOT_FOUND, "unknown session", propose=draft_pb2.Propose(session_id="nope", anchor_token=1))
    draft.expect(FAILED_PRECONDITION, "another target", open=draft_pb2.OpenDraft(
        target=common_pb2.Fingerprint(model="a" * 64, tokenizer=fingerprint.tokenizer)))
    draft.expect(INVALID_ARGUMENT, "fingerprints", open=draft_pb2.OpenDraft())
    draft.expect(FAILED_PRECONDITION, "protocol version", open=draft_pb2.OpenDraft(protocol_version=9,
                                                                                   target=fingerprint))
    sid = opened(draft, fingerprint)
    draft.expect(FAILED_PRECONDITION, "empty", propose=draft_pb2.Propose(session_id=sid, anchor_token=5))
    append_prompt(draft, sid, pre)
    position = len(PROMPT)
    for kind, budget in [(draft_pb2.PROPOSAL_KIND_CHAIN, info.block_size + 1),
                         (draft_pb2.PROPOSAL_KIND_TREE, info.max_tree_budget + 1),
                         (draft_pb2.PROPOSAL_KIND_CHAIN, -1)]:
        draft.expect(INVALID_ARGUMENT, "budget", propose=draft_pb2.Propose(
            session_id=sid, anchor_token=pre.next_token, anchor_position=position, kind=kind, budget=budget,
            proposer=draft_pb2.PROPOSER_DSPARK))
    draft.expect(FAILED_PRECONDITION, "anchor", propose=draft_pb2.Propose(
        session_id=sid, anchor_token=pre.next_token, anchor_position=position + 3))
    draft.expect(INVALID_ARGUMENT, "out of range", propose=draft_pb2.Propose(
        session_id=sid, anchor_token=10**6, anchor_position=position))
    opened_ids = [sid]
    for _ in range(DRAFT_MAX_SESSIONS + 1):  # one stream, one principal: it may hold all but the reserve
        r = draft.call(open=draft_pb2.OpenDraft(target=fingerprint))
        if r.status.code:
            assert r.status.code == RESOURCE_EXHAUSTED, r.status
            assert f"this client already holds {DRAFT_MAX_SESSIONS - 1} live session" in r.status.message
            break
        opened_ids.append(r.opened.session_id)
    else:
        pytest.fail("the session limit was not enforced")
    assert len(opened_ids) == DRAFT_MAX_SESSIONS - 1
    assert health_status(draft_address, "dspark.v1.DraftService") == 1  # SERVING


LOSSLESS_PROMPTS = [[{"role": "user", "content": q}] for q in
                    ("What is the capital of France?", "List three prime numbers.", "Say hello in French.")]


@pytest.fixture(scope="module")
def ar_outputs(target_address) -> list:
    """AR's result for each of LOSSLESS_PROMPTS (computed once for every speculative variant; the prompts at once)."""
    with TargetClient(target_address) as client:
        return concurrently(lambda m: client.generate(messages=m, max_new_tokens=24, mode="ar"), LOSSLESS_PROMPTS)


@pytest.mark.parametrize("proposal,proposer,kernel", [
    ("chain", "dspark", "torch"), ("chain", "dspark", "fused"), ("tree", "dspark", "torch"),
    ("chain", "ngram", "auto"), ("tree", "ngram", "auto"), ("chain", "hybrid", "auto"), ("tree", "hybrid", "auto"),
])
def test_speculation_is_lossless(spec_target_address, ar_outputs, proposal, proposer, kernel):
    # the fused kernel runs in Triton's interpreter here (slow): one prompt shows the wiring; tests/heads compares
    # the kernel with the torch path token for token. The prompts run at once (fewer than the drafter's sessions for
    # one principal, DRAFT_MAX_SESSIONS - 1): the target verifies them in one forward a step.
    prompts = 1 if kernel == "fused" else len(LOSSLESS_PROMPTS)
    with TargetClient(spec_target_address) as client:
        specs = concurrently(lambda messages: client.generate(
            messages=messages, max_new_tokens=24, mode="speculation", proposal=proposal, proposer=proposer,
            kernel=kernel), LOSSLESS_PROMPTS[:prompts])
        for spec, ar in zip(specs, ar_outputs[:prompts], strict=True):
            assert spec.token_ids == ar.token_ids and spec.text == ar.text
            assert spec.stats.fallback_reason == ""
            assert spec.stats.mode_run == common_pb2.DECODE_MODE_SPECULATION or proposer == "ngram"


def test_sampled_chain_carries_the_distributions_it_was_drawn_from(draft, target_rows):
    info, pre, fingerprint = target_rows
    sid = opened(draft, fingerprint)
    append_prompt(draft, sid, pre)
    proposal = draft.ok(propose=draft_pb2.Propose(
        session_id=sid, anchor_token=pre.next_token, anchor_position=len(PROMPT), proposer=draft_pb2.PROPOSER_DSPARK,
        sampling=common_pb2.SamplingParams(temperature=0.9, seed=3)))
    tokens = list(proposal.tree.tokens)
    ids, lps = from_proto(proposal.tree.child_token_ids), from_proto(proposal.tree.child_logprobs)
    assert ids.shape == lps.shape == (len(tokens), 32) and ids.dtype == torch.int32
    for k in range(1, len(tokens)):  # row k-1: the distribution token k was drawn from
        assert tokens[k] in ids[k - 1].tolist()
        # a log-softmax over the row's ids, exp'd and summed: 1 whatever its input's errors (an identity in them),
        # within float32's bound of the log-softmax itself (shift-invariant: the log-probs' size bounds its terms)
        row = lps[k - 1][torch.isfinite(lps[k - 1])]
        atol = softmax_error(row.numel(), float(row.abs().max())) + gamma(1) + gamma(row.numel())
        torch.testing.assert_close(lps[k - 1].exp().sum(), torch.tensor(1.0), rtol=0, atol=atol)
    assert (ids[-1] == -1).all()  # the last node has no drafted child
    again = draft.ok(propose=draft_pb2.Propose(
        session_id=sid, anchor_token=pre.next_token, anchor_position=len(PROMPT), proposer=draft_pb2.PROPOSER_DSPARK,
        sampling=common_pb2.SamplingParams(temperature=0.9, seed=3)))
    assert list(again.tree.tokens) == tokens  # seeded


def test_seeded_speculative_sampling_is_reproducible(spec_target_address):
    kwargs = dict(messages=[{"role": "user", "content": "Tell me a fact about cats."}], max_new_tokens=24,
                  temperature=0.8, top_p=0.9, mode="speculation", proposer="dspark", ignore_eos=True)
    with TargetClient(spec_target_address) as client:
        a, b = concurrently(lambda seed: client.generate(seed=seed, **kwargs), (11, 11))
        assert a.token_ids == b.token_ids and len(a.token_ids) == 24
        assert a.stats.speculative_steps > 0 and a.stats.fallback_reason == ""


def test_eos_stop_strings_and_max_tokens_match_ar_when_speculating(spec_target_address):
    """Steps that commit several tokens must end exactly where AR ends: at EOS, a stop string or max tokens."""
    chat = [{"role": "user", "content": "Repeat after me: one two three, one two three, one two three."}]
    with TargetClient(spec_target_address) as client:
        full_ar = client.generate(messages=chat, max_new_tokens=120, mode="ar")
        assert full_ar.finish_reason == "eos"
        text = full_ar.text
        cases = [dict(max_new_tokens=120), dict(max_new_tokens=5), dict(max_new_tokens=11),
                 dict(max_new_tokens=120, stop=[text[len(text) // 2: len(text) // 2 + 4]]),
                 dict(max_new_tokens=120, stop=["zzz-never", text[-6:-2]])]
        runs = [dict(mode="ar"), *(dict(mode="speculation", proposer=p, proposal="tree") for p in ("ngram", "hybrid"))]
        for kwargs in cases:  # a case's three requests at once
            ar, *specs = concurrently(lambda run, kwargs=kwargs: client.generate(messages=chat, **run, **kwargs), runs)
            for spec in specs:
                assert (spec.text, spec.token_ids, spec.finish_reason) == (ar.text, ar.token_ids, ar.finish_reason)
                assert spec.stats.generated_tokens == len(spec.token_ids)
        # this prompt repeats itself, so multi-token steps really happened
        spec = client.generate(messages=chat, mode="speculation", proposer="ngram", max_new_tokens=120)
        assert max(spec.stats.committed_per_step) > 1
