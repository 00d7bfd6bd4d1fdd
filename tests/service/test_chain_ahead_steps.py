"""The target's Step op verifying the rest of a chain without a drafter round (SessionDrafting.chain_ahead), on the
real engine (the embedded SmolLM2, fast precision) without gRPC: the drafter is a scripted link that proposes the
engine's own greedy continuation (an oracle, so every draft token is accepted), and a fake cost table makes the
round's plan verify one draft token per step. So the rest of every chain holds, decided by the table, not timing."""

from __future__ import annotations

import asyncio

import pytest
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, target_pb2
from dspark_grpc.serving.sessions import Owner
from dspark_grpc.speculation.cost_table import CostKey, CostTable
from dspark_grpc.speculation.tensors import float32_tensor
from dspark_grpc.target_service.draft_rounds import DraftRounds
from dspark_grpc.target_service.drafter_pool import Drafter, DrafterPool
from dspark_grpc.target_service.servicer import TargetServicer

from tests.test_draft_rounds import FakeStream

PROMPT = common_pb2.Prompt(text="The capital of France is")
NEW_TOKENS = 24
CHAIN = 4  # draft tokens per proposal


def oracle(greedy: dict[int, int]):
    """Proposals of the next CHAIN tokens of `greedy` (the engine's own AR continuation, by position), confident."""

    def proposal(p: draft_pb2.Propose) -> draft_pb2.Proposal:
        chain = [greedy[p.anchor_position + i] for i in range(1, CHAIN + 1)]
        return draft_pb2.Proposal(
            tree=common_pb2.TokenTree(tokens=[p.anchor_token, *chain], parents=list(range(-1, CHAIN))),
            confidences=float32_tensor([0.9] * CHAIN), node_proposers=[0] + [draft_pb2.PROPOSER_DSPARK] * CHAIN)

    return proposal


class OracleLink:
    down_reason = ""
    address = "oracle"

    def __init__(self, stream: FakeStream) -> None:
        self.stream = stream
        self.info = draft_pb2.GetDrafterInfoResponse(name="oracle", target_layer_ids=[1, 28],
                                                     default_proposer=draft_pb2.PROPOSER_DSPARK)

    def open_stream(self) -> FakeStream:
        return self.stream


def run(servicer: TargetServicer, mode: int, prompt: common_pb2.Prompt = PROMPT
        ) -> tuple[list[int], list[target_pb2.StepReport], list[int], int]:
    """Open, prefill and step a session: (the tokens after the prompt, each step's report and the position of its
    pending token, the prompt's length)."""
    owner, ids = Owner("test"), iter(range(1, 1000))

    def ok(**op):
        response = servicer.handle(target_pb2.TargetSessionRequest(request_id=next(ids), **op), owner)
        assert response.status.code == 0, response.status.message
        return getattr(response, response.WhichOneof("result"))

    sid = ok(open=target_pb2.OpenSession(step_options=target_pb2.StepOptions(mode=mode))).session_id
    prefilled = ok(prefill=target_pb2.Prefill(session_id=sid, prompt=prompt))
    prompt_length = len(prefilled.prompt_tokens)
    tokens, reports, positions = [prefilled.next_token], [], []
    while len(tokens) < NEW_TOKENS:
        positions.append(prompt_length + len(tokens) - 1)
        stepped = ok(step=target_pb2.Step(session_id=sid))
        tokens += [*stepped.tokens[1:], stepped.next_token]
        reports.append(stepped.report)
    ok(release=target_pb2.Release(session_id=sid))
    return tokens[:NEW_TOKENS], reports, positions, prompt_length


def ar_continuation(engine, prompt: common_pb2.Prompt = PROMPT) -> tuple[list[int], dict[int, int]]:
    """The engine's greedy AR tokens after `prompt`, and the same by position (zeros past them) for the oracle."""
    ar_servicer = TargetServicer(64 << 20)
    ar_servicer.engine = engine
    ar, _, _, prompt_length = run(ar_servicer, common_pb2.DECODE_MODE_AR, prompt)
    greedy = {prompt_length + i: t for i, t in enumerate(ar)}
    greedy.update({prompt_length + len(ar) + i: 0 for i in range(CHAIN + 2)})  # past what the tests compare
    return ar, greedy


def oracle_servicer(engine, greedy: dict[int, int]) -> tuple[TargetServicer, FakeStream, Drafter]:
    """A servicer on `engine` whose drafter is the oracle of `greedy` (close its `rounds` after)."""
    servicer = TargetServicer(64 << 20)
    servicer.engine, stream = engine, FakeStream(proposal=oracle(greedy))
    link = OracleLink(stream)
    drafter = Drafter(link, DraftRounds(link, None, servicer.steps._round_drafted, servicer.steps._plan_round))
    servicer.steps.drafters = DrafterPool("oracle", lambda address, _: drafter)
    return servicer, stream, drafter


# a 2nd draft token never pays
A_TOKEN_A_STEP = [CostTable(CostKey(kind="verify", model="test", lanes=1), [1, 2, 3, 16], [1.0, 1.0, 10.0, 20.0])]


def test_the_rest_of_an_accepted_chain_is_verified_without_a_round_and_the_output_is_ars(fast_engine):
    engine = fast_engine
    ar, greedy = ar_continuation(engine)
    engine.cost_tables = A_TOKEN_A_STEP
    servicer, stream, drafter = oracle_servicer(engine, greedy)
    try:
        spec, reports, positions, _ = run(servicer, common_pb2.DECODE_MODE_SPECULATION)
    finally:
        engine.cost_tables = []
        drafter.rounds.close()
    assert spec[: len(ar)] == ar
    assert all(r.draft_depth == 1 and len(r.accepted_proposers) == 1 for r in reports), reports  # the plan: 1 token
    from_chain = [r.draft_from_chain for r in reports]
    # a round's chain [t1..t4] verifies t1; t2 is the bonus, so [t2, t3, t4] follows without a round and verifies
    # t3; its rest [t4] has no draft after the bonus: a round again
    assert from_chain[:4] == [False, True, False, True], from_chain
    assert all(r.draft_ready for r, chained in zip(reports, from_chain, strict=True) if chained)
    asked = {op.propose.anchor_position for rnd in stream.rounds for op in rnd.ops if op.WhichOneof("op") == "propose"}
    # the drafter was asked for exactly the steps not from a chain (and maybe, ahead, for one after the last)
    assert asked & set(positions) == {p for p, chained in zip(positions, from_chain, strict=True) if not chained}


def test_generate_calls_the_step_engine_itself_and_its_output_is_ars(fast_engine, monkeypatch):
    """Generate's loop steps through the step engine directly: no session op goes through the servicer's `handle`
    (forbidden here), and its greedy speculative output is AR's."""
    engine = fast_engine
    ar, greedy = ar_continuation(engine)
    servicer, stream, drafter = oracle_servicer(engine, greedy)
    monkeypatch.setattr(servicer, "handle", lambda *args: pytest.fail("a session op went through handle"))

    async def generate() -> tuple[list[int], common_pb2.GenerationStats]:
        ids, stats = [], None
        request = target_pb2.GenerateRequest(prompt=PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                                             mode=common_pb2.DECODE_MODE_SPECULATION)
        async for reply in servicer.generation_stream(request, "test", None):
            ids += reply.token_ids
            stats = reply.stats if reply.HasField("stats") else stats
        return ids, stats

    try:
        ids, stats = asyncio.run(generate())
    finally:
        drafter.rounds.close()
    assert ids == ar and stats.speculative_steps > 0 and stats.draft_rounds > 0, stats
    assert stats.acceptance_length > 1.5  # the oracle's drafts are accepted


LOOKUP = draft_pb2.PromptLookupSettings(min_ngram=2, max_ngram=4, chain_tokens=8, hybrid_min_match=2)
REPEATING = common_pb2.Prompt(text="red green blue yellow red green blue yellow red green blue yellow red green")


def test_a_hybrid_step_that_is_a_lookup_chain_asks_no_round_and_the_output_is_ars(fast_engine):
    """The drafter's prompt lookup done by the target (its settings from GetDrafterInfo): a hybrid step whose
    context has a match of the drafter's minimum length or more verifies the lookup's chain without a round; the
    others ask the drafter (here an oracle DSpark chain). Which steps are which follows from the tokens, recomputed
    here by a scan of the whole context (runtime/drafting/ngram.py `ngram_candidates`, not the target's index)."""
    from dspark_grpc.runtime.drafting.ngram import ngram_candidates

    engine = fast_engine
    ar, greedy = ar_continuation(engine, REPEATING)
    servicer, stream, drafter = oracle_servicer(engine, greedy)
    drafter.link.info.default_proposer = draft_pb2.PROPOSER_HYBRID
    drafter.link.info.max_tree_budget = 64
    drafter.link.info.prompt_lookup.CopyFrom(LOOKUP)
    try:
        spec, reports, positions, _ = run(servicer, common_pb2.DECODE_MODE_SPECULATION, REPEATING)
    finally:
        drafter.rounds.close()
    prompt_ids = engine.encode_prompt(REPEATING.text, 512)
    assert spec[: len(ar)] == ar
    committed = [*prompt_ids, *ar]
    expected = []
    for p in positions:  # the context before the step's pending token, then that token (the anchor)
        found = ngram_candidates(committed[: p + 1], max_ngram=LOOKUP.max_ngram, min_ngram=LOOKUP.min_ngram,
                                 max_tokens=LOOKUP.chain_tokens)
        expected.append(bool(found) and found[0].match_length >= LOOKUP.hybrid_min_match)
    from_lookup = [r.draft_from_lookup for r in reports]
    assert from_lookup == expected and any(from_lookup) and not all(from_lookup), (from_lookup, expected)
    for r, looked_up in zip(reports, from_lookup, strict=True):
        if looked_up:
            assert r.draft_ready and r.round_seconds == 0 and r.draft_depth >= 1
            assert set(r.accepted_proposers) <= {draft_pb2.PROPOSER_NGRAM}
    asked = {op.propose.anchor_position for rnd in stream.rounds for op in rnd.ops if op.WhichOneof("op") == "propose"}
    assert asked & set(positions) == {p for p, looked in zip(positions, from_lookup, strict=True) if not looked}
