"""A tiny random qwen35 hybrid target (Gated DeltaNet + gated attention) served over gRPC, with a random-weight
DSpark drafter built for it: speculation (chain, tree, hybrid) gives AR's tokens, seeded speculative sampling is
reproducible, concurrent sessions batched get what each gets alone, and a rollback past the kept recurrent-state
snapshots recomputes the state."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from dspark_grpc.client import TargetClient
from dspark_grpc.client.local_stack import local_drafter
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2
from dspark_grpc.runtime.formats.tokenizer import TextTokenizer
from qwen35_models import make_qwen35

from tests.service.conftest import RawSession, target_with_drafter

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time, in a land", "1, 2, 3, 4,"]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def stack(tmp_path_factory, smollm2_path) -> tuple[str, str]:
    """(target address, drafter address): the 'every4' layout at SmolLM2's vocabulary, with its tokenizer, and a
    random drafter built for it, which the target drafts with."""
    directory = make_qwen35(tmp_path_factory.mktemp("qwen35_service"), "every4", 49152, seed=5)
    TextTokenizer.from_gguf(smollm2_path).save(directory)
    quick = ["--no-cost-profile", "--grace", "1", "--quiet"]
    drafter_args = ["--drafter", "random", "--target-model", str(directory), *quick]
    with local_drafter(drafter_args, echo=False) as drafter:
        with TargetClient(drafter) as probe:
            probe.wait_ready(300)
        with target_with_drafter(drafter, "--model", str(directory), "--grace", "1") as target:
            yield target, drafter


def test_model_info_names_the_hybrid(stack):
    with TargetClient(stack[0]) as client:
        assert client.model_info().architecture == "qwen35"


@pytest.fixture(scope="module")
def ar_outputs(stack) -> list:
    """AR's result for the first two PROMPTS (computed once for every speculative variant below)."""
    with TargetClient(stack[0]) as client:
        return [client.generate(p, max_new_tokens=NEW_TOKENS, mode="ar", ignore_eos=True) for p in PROMPTS[:2]]


@pytest.mark.parametrize("proposal,proposer", [("chain", "dspark"), ("tree", "dspark"), ("chain", "hybrid"),
                                               ("tree", "hybrid")])
def test_greedy_speculation_equals_ar(stack, ar_outputs, proposal, proposer):
    with TargetClient(stack[0]) as client:
        for prompt, ar in zip(PROMPTS[:2], ar_outputs, strict=True):
            spec = client.generate(prompt, max_new_tokens=NEW_TOKENS, mode="speculation", proposal=proposal,
                                   proposer=proposer, ignore_eos=True)
            assert spec.token_ids == ar.token_ids and len(ar.token_ids) == NEW_TOKENS
            assert spec.stats.fallback_reason == "" and spec.stats.speculative_steps > 0


def test_a_tree_path_past_side_branches_commits_then_ar_goes_on_as_plain_ar(stack):
    """Greedy tokens placed as later siblings at depths 1 and 2: the accepted path skips the wrong first
    children, commits 4 rows in one step, and decoding on gives plain AR's tokens."""
    raw = RawSession(stack[0])
    try:
        def session() -> tuple[str, int]:
            sid = raw.ok(open=target_pb2.OpenSession()).session_id
            pre = raw.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(text=PROMPTS[1])))
            return sid, pre.next_token

        def verify(sid: str, tokens: list[int], parents: list[int]) -> target_pb2.Verified:
            return raw.ok(verify=target_pb2.Verify(session_id=sid, commit=True,
                                                   tree=common_pb2.TokenTree(tokens=tokens, parents=parents)))

        sid, pending = session()
        seq = [pending]
        for _ in range(12):
            seq.append(verify(sid, [seq[-1]], [-1]).next_token)
        sid, pending = session()
        wrong = [(t + 1) % 49152 for t in seq]
        v = verify(sid, [pending, wrong[1], seq[1], wrong[2], seq[2], seq[3]], [-1, 0, 0, 2, 2, 4])
        assert list(v.accepted_path) == [0, 2, 4, 5] and v.next_token == seq[4]
        got = [v.next_token]
        for _ in range(8):
            got.append(verify(sid, [got[-1]], [-1]).next_token)
        assert got == seq[4:]
    finally:
        raw.close()


@pytest.mark.parametrize("proposal", ["chain", "tree"])
def test_seeded_speculative_sampling_is_reproducible(stack, proposal):
    kwargs = dict(max_new_tokens=24, temperature=0.8, top_p=0.9, mode="speculation", proposal=proposal,
                  proposer="dspark", ignore_eos=True)
    with TargetClient(stack[0]) as client:
        a = client.generate(PROMPTS[0], seed=11, **kwargs)
        b = client.generate(PROMPTS[0], seed=11, **kwargs)
        other = client.generate(PROMPTS[0], seed=12, **kwargs)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24
    assert a.stats.speculative_steps > 0 and a.stats.fallback_reason == ""
    assert other.token_ids != a.token_ids  # the seed matters: a random target's sampled continuations differ


def test_concurrent_sessions_batched_equal_alone(stack):
    def run(client: TargetClient, concurrency: int, **options) -> list[list[int]]:
        def one(prompt: str) -> list[int]:
            return client.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, **options).token_ids

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            return list(pool.map(one, PROMPTS))

    with TargetClient(stack[0]) as client:
        alone = run(client, 1, mode="ar")
        assert len({tuple(t) for t in alone}) == len(PROMPTS)  # different outputs: a mix-up would show
        assert run(client, len(PROMPTS), mode="ar") == alone
        assert run(client, 3, mode="speculation", proposal="tree", proposer="hybrid") == alone


def test_rollback_within_and_past_the_kept_snapshots_replays_the_same_tokens(stack):
    raw = RawSession(stack[0])
    try:
        sid = raw.ok(open=target_pb2.OpenSession()).session_id
        pre = raw.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(text=PROMPTS[2])))
        pending, seq = pre.next_token, [pre.next_token]

        def step(pending: int) -> target_pb2.Verified:
            return raw.ok(verify=target_pb2.Verify(session_id=sid, commit=True,
                                                   tree=common_pb2.TokenTree(tokens=[pending], parents=[-1])))

        for _ in range(16):
            v = step(pending)
            pending = v.next_token
            seq.append(pending)
        end = v.length
        for back in (3, 14):  # the cache keeps the last 8 lengths' states; 14 back is recomputed
            keep = end - back
            rolled = raw.ok(rollback=target_pb2.Rollback(session_id=sid, length=keep))
            assert rolled.length == keep and rolled.pending_token == seq[-1 - back]
            pending, replay = rolled.pending_token, []
            for _ in range(back):
                v = step(pending)
                pending = v.next_token
                replay.append(pending)
            assert replay == seq[-back:] and v.length == end
    finally:
        raw.close()
