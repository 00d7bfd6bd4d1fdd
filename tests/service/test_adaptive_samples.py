"""Which load a step's sample of its arm is filed under (the target's ModeChooser), on the real engine without gRPC:
the sessions live when the step ended, not the most of the last second (which decides the arm). Otherwise the fast
steps of a run's tail, with fewer sessions left, would raise the rate of the arm that ran them at the load before."""

from __future__ import annotations

from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2
from dspark_grpc.serving.sessions import Owner
from dspark_grpc.speculation.mode_chooser import AR
from dspark_grpc.target_service.servicer import TargetServicer

PROMPT = common_pb2.Prompt(text="The capital of France is")
AR_MODE = target_pb2.StepOptions(mode=common_pb2.DECODE_MODE_AR)


def test_a_step_after_the_other_session_left_is_a_sample_at_one_session(fast_engine):
    servicer = TargetServicer(64 << 20)
    servicer.engine = fast_engine
    owner, ids = Owner("test"), iter(range(1, 1000))

    def ok(**op):
        response = servicer.handle(target_pb2.TargetSessionRequest(request_id=next(ids), **op), owner)
        assert response.status.code == 0, response.status.message
        return getattr(response, response.WhichOneof("result"))

    a, b = (ok(open=target_pb2.OpenSession(step_options=AR_MODE)).session_id for _ in range(2))
    for sid in (a, b):
        ok(prefill=target_pb2.Prefill(session_id=sid, prompt=PROMPT))
    for sid in (a, b, a, b):  # both live: samples at 2 sessions (but a's first step, which waited for b's prompt)
        ok(step=target_pb2.Step(session_id=sid))
    ok(release=target_pb2.Release(session_id=b))
    for _ in range(3):  # alone now, however recently the other one stepped
        ok(step=target_pb2.Step(session_id=a))
    ok(release=target_pb2.Release(session_id=a))
    rates = {load: bucket.rates[AR].steps for load, bucket in servicer.steps.chooser.buckets.items()}
    assert rates == {2: 3, 1: 3}, rates
