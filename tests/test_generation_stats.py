"""A request's GenerationStats from the steps it ran (speculation/generation.py), on a scripted target: the acceptance
length counts the speculative steps only, so an AR run has none; and what the metrics and the JSON make of it."""

from __future__ import annotations

import pytest
from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2
from dspark_grpc.speculation.generation import GenerationConfig, generate_deltas
from dspark_grpc.speculation.metrics import stats_dict

EOS = 2


class ScriptedTarget:
    """Each step drafts `depth` tokens and accepts `accepted` of them; the last step's new pending token is EOS."""

    def __init__(self, script: list[tuple[int, int]]) -> None:
        self.script = list(script)
        self.last = 100
        self.pending = self._token()

    def _token(self) -> int:
        self.last += 1
        return self.last

    def open(self, m: target_pb2.OpenSession) -> target_pb2.SessionOpened:
        return target_pb2.SessionOpened(session_id="s", max_length=4096)

    def prefill(self, m: target_pb2.Prefill) -> target_pb2.Prefilled:
        return target_pb2.Prefilled(prompt_tokens=[5, 6, 7], next_token=self.pending, text="a")

    def step(self, session_id: str, tokens_left: int) -> target_pb2.Stepped:
        depth, accepted = self.script.pop(0)
        new = [self._token() for _ in range(accepted + 1)]  # the accepted draft tokens, then the next pending one
        if not self.script:
            new[-1] = EOS
        committed, self.pending = [self.pending, *new[:-1]], new[-1]
        return target_pb2.Stepped(tokens=committed, next_token=self.pending, token_texts=["b"] * len(new),
                                  length=10, report=target_pb2.StepReport(draft_depth=depth))

    def release(self, session_id: str) -> None:
        pass


def _run(script: list[tuple[int, int]]) -> common_pb2.GenerationStats:
    stats = common_pb2.GenerationStats()
    deltas = list(generate_deltas(ScriptedTarget(script), common_pb2.Prompt(text="x"), GenerationConfig(),
                                  frozenset({EOS}), stats))
    assert deltas[-1].finish_reason == common_pb2.FINISH_REASON_EOS
    return stats


def test_an_ar_run_has_no_acceptance_length():
    # 6 AR steps, the last one's token EOS: 6 tokens generated; (6 - 1) / 6 = 0.83 "tokens per step" was reported
    stats = _run([(0, 0)] * 6)
    assert (stats.steps, stats.ar_steps, stats.speculative_steps, stats.generated_tokens) == (6, 6, 0, 6)
    assert stats.mode_run == common_pb2.DECODE_MODE_AR
    assert stats.acceptance_length == 0
    assert stats_dict(stats)["acceptance_length"] is None


def test_the_acceptance_length_counts_the_speculative_steps_only():
    # 3 speculative steps accepting 3, 0 and 2 of their drafts, an AR step between them
    stats = _run([(4, 3), (4, 0), (0, 0), (2, 2)])
    assert (stats.steps, stats.ar_steps, stats.speculative_steps) == (4, 1, 3)
    assert stats.acceptance_length == pytest.approx(1 + 5 / 3)  # vLLM's 1 + accepted / drafts
    assert sum(stats.accepted_per_position) == 5
    assert stats_dict(stats)["acceptance_length"] == pytest.approx(1 + 5 / 3)


def test_the_request_acceptance_length_metric_leaves_out_ar_requests():
    pytest.importorskip("prometheus_client")
    from dspark_grpc.speculation.metrics import SpecDecodeMetrics

    m = SpecDecodeMetrics()
    m.observe(_run([(0, 0)] * 6))
    m.observe(_run([(4, 3), (4, 0), (0, 0), (2, 2)]))
    assert m.registry.get_sample_value("dspark:request_acceptance_length_count") == 1
    assert m.registry.get_sample_value("dspark:request_acceptance_length_sum") == pytest.approx(1 + 5 / 3)
