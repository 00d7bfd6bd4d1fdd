"""The DSpark drafter shipped for the embedded SmolLM2 (`dspark-draft serve --drafter embedded`), through both
services: lossless against AR, and a trained drafter — its own DSpark tokens get accepted, which a random drafter's
never are — that merged with prompt lookup accepts at least as much per step as prompt lookup alone."""

from __future__ import annotations

import pytest
from dspark_grpc.client import TargetClient
from dspark_grpc.client.local_stack import local_drafter
from dspark_grpc.client.sdk import drafter_info
from dspark_grpc.draft_service.engine import EMBEDDED_DRAFTER

from tests.service.conftest import concurrently, target_with_drafter

PROMPTS = [
    [{"role": "user", "content": "Explain in three sentences why the sky is blue."}],
    [{"role": "user", "content": "Write a Python function that returns the factorial of n."}],
]


@pytest.fixture(scope="module")
def embedded_stack() -> tuple[str, str]:
    """(target address, drafter address): the shipped drafter, and a target that drafts with it."""
    if not (EMBEDDED_DRAFTER / "model.safetensors").is_file():
        pytest.fail(f"the shipped drafter is missing: {EMBEDDED_DRAFTER}")
    with local_drafter(["--drafter", "embedded", "--quiet", "--no-cost-profile"], echo=False) as drafter:
        with TargetClient(drafter) as probe:
            probe.wait_ready(timeout=300)
        with target_with_drafter(drafter) as target:
            yield target, drafter


def test_the_shipped_drafter_is_lossless_and_its_drafts_are_accepted(embedded_stack):
    target, drafter = embedded_stack
    assert drafter_info(drafter).name == EMBEDDED_DRAFTER.name
    with TargetClient(target) as client:
        dspark_accepted, per_step = 0, {}
        # a configuration's requests (one a prompt) at once: the target verifies them in one forward a step
        ars = concurrently(lambda messages: client.generate(messages=messages, max_new_tokens=32, mode="ar"), PROMPTS)
        for proposer, proposal in (("dspark", "chain"), ("ngram", "tree"), ("hybrid", "tree")):
            specs = concurrently(lambda messages, proposer=proposer, proposal=proposal: client.generate(
                messages=messages, max_new_tokens=32, mode="speculation", proposer=proposer, proposal=proposal),
                PROMPTS)
            for ar, spec in zip(ars, specs, strict=True):
                assert spec.token_ids == ar.token_ids, (proposer, proposal)
                assert spec.stats.fallback_reason == "", spec.stats.fallback_reason
                steps, tokens = per_step.get(proposer, (0, 0))
                per_step[proposer] = (steps + spec.stats.steps, tokens + len(spec.token_ids))
                if proposer == "dspark":
                    dspark_accepted += spec.stats.accepted_by_proposer["dspark"]
        assert dspark_accepted > 0  # a random drafter's DSpark tokens are never accepted
        rate = {p: tokens / steps for p, (steps, tokens) in per_step.items()}
        assert rate["hybrid"] >= rate["ngram"], rate
