"""A frozen service fails its calls through keepalive, not at their deadline; a bearer token bound for another
machine without TLS is warned about (the SDK's and the target->drafter link's channels)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import warnings

import grpc
import pytest
from dspark_grpc.speculation import channel
from dspark_grpc.speculation.channel import ChannelSecurity, address_host, make_channel, token_in_the_clear
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVER = textwrap.dedent("""
    from concurrent import futures
    import grpc, sys
    from grpc_health.v1 import health, health_pb2_grpc
    from dspark_grpc.serving.server import server_options
    server = grpc.server(futures.ThreadPoolExecutor(4), options=server_options(1 << 20))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    server.start()
    server.wait_for_termination()
""")


def test_a_frozen_service_fails_an_open_call_with_unavailable(monkeypatch):
    # pings after 1 s of silence, 1 s to answer (the shipped 30 s + 20 s would make the test slow; same mechanism)
    fast = {"grpc.keepalive_time_ms": 1000, "grpc.keepalive_timeout_ms": 1000, "grpc.http2.ping_timeout_ms": 1000}
    options = [(k, fast.get(k, v)) for k, v in channel.CHANNEL_OPTIONS]
    assert len(set(fast) & dict(options).keys()) == 3
    monkeypatch.setattr(channel, "CHANNEL_OPTIONS", options)
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        with make_channel(f"127.0.0.1:{port}") as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(), timeout=300)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            os.kill(server.pid, signal.SIGSTOP)  # frozen: the TCP connection stays open, nothing answers
            with pytest.raises(grpc.RpcError) as failed:
                next(watch)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value  # not DEADLINE_EXCEEDED
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait()


def test_the_shipped_channels_ping_and_the_servers_accept_their_pings():
    from dspark_grpc.serving.server import server_options

    sent = dict(channel.CHANNEL_OPTIONS)
    accepted = dict(server_options(1 << 20))
    assert 0 < sent["grpc.keepalive_time_ms"] and 0 < sent["grpc.keepalive_timeout_ms"]
    assert sent["grpc.http2.ping_timeout_ms"] == sent["grpc.keepalive_timeout_ms"]
    assert accepted["grpc.http2.min_recv_ping_interval_without_data_ms"] <= sent["grpc.keepalive_time_ms"]


def test_the_targets_link_retries_a_drafter_that_went_away_at_least_once_a_second(monkeypatch):
    """Why a target speculates again soon after its drafter is back (tests/reliability/test_lifecycle.py waits for
    that with a bound only a hang reaches): the channel of its link to the drafter caps gRPC's reconnect backoff
    (2 minutes by default) at a second, and the link probes the drafter twice a second."""
    from dspark_grpc.target_service import drafter_link
    from dspark_grpc.target_service.step_engine import StepEngine

    made, insecure_channel = [], grpc.insecure_channel

    def recorded(address, options=None):
        made.append(dict(options or ()))
        return insecure_channel(address, options=options)

    monkeypatch.setattr(grpc, "insecure_channel", recorded)
    StepEngine(drafter_address="127.0.0.1:1").drafters.close()
    (options,) = made
    assert options["grpc.initial_reconnect_backoff_ms"] <= 1000 and options["grpc.max_reconnect_backoff_ms"] <= 1000
    assert drafter_link.PROBE_INTERVAL_S <= 0.5


def test_a_token_without_tls_to_another_machine_is_warned_about():
    token = ChannelSecurity(token="secret")
    assert token_in_the_clear("10.0.0.7:50051", token) is not None
    assert token_in_the_clear("dns:///target.example:50051", token) is not None
    for quiet in ("127.0.0.1:50051", "localhost:1", "[::1]:50051", "unix:/tmp/dspark.sock"):
        assert token_in_the_clear(quiet, token) is None, quiet
    assert token_in_the_clear("10.0.0.7:50051", ChannelSecurity(root_ca=b"pem", token="secret")) is None
    assert token_in_the_clear("10.0.0.7:50051", None) is None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_channel("10.0.0.7:50051", token).close()  # a channel connects lazily: nothing is sent here
    assert any("sent without TLS" in str(w.message) for w in caught)
    assert address_host("[::1]:5") == "[::1]" and address_host("dns:example.com:443") == "example.com"


def test_a_server_off_loopback_says_what_it_exposes():
    from dspark_grpc.serving.security import ServerSecurity, exposure_warning

    assert exposure_warning("127.0.0.1", ServerSecurity()) is None
    assert exposure_warning("0.0.0.0", ServerSecurity(cert_chain=b"pem", private_key=b"key")) is None
    assert "without TLS or a token" in exposure_warning("0.0.0.0", ServerSecurity())
    tokens_only = exposure_warning("0.0.0.0", ServerSecurity(tokens=frozenset({"t"})))
    assert "tokens travel unencrypted" in tokens_only
