"""What `dspark generate` prints of a finished request, on a fake client: the mode that actually ran, the stats JSON
in the HTTP API's shape (int64 fields as numbers), and a connection hint that names what the user can do."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from dspark_grpc.client import cli as client_cli
from dspark_grpc.client.sdk import GenerationResult
from dspark_grpc.protos.dspark.v1 import common_pb2

REFUSED = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Connection refused"


def _stats(speculative: int, ar: int, **fields) -> common_pb2.GenerationStats:
    mode = common_pb2.DECODE_MODE_SPECULATION if speculative else common_pb2.DECODE_MODE_AR
    return common_pb2.GenerationStats(prompt_tokens=3, generated_tokens=speculative * 3 + ar + 1,
                                      steps=speculative + ar, speculative_steps=speculative, ar_steps=ar,
                                      mode_run=mode, prefill_seconds=0.01, **fields)


class FakeClient:
    """Answers every request with `stats`, one token."""

    def __init__(self, stats: common_pb2.GenerationStats) -> None:
        self.stats = stats

    def generate(self, **kwargs) -> GenerationResult:
        return GenerationResult("Hi", [7], "length", self.stats)

    def stream(self, *, stats: common_pb2.GenerationStats, **kwargs):
        stats.CopyFrom(self.stats)
        yield "Hi", [7], "length"


def _generate(capsys, stats: common_pb2.GenerationStats, *argv: str) -> str:
    args = client_cli.parser().parse_args(["generate", "Hello", *argv])
    client_cli._print_result(FakeClient(stats), args, prompt=args.prompt)
    return capsys.readouterr().out


@pytest.mark.parametrize(("mode", "speculative", "ar", "said"), [
    ("adaptive", 0, 15, "mode adaptive (ran AR);"),  # it said "mode ar": neither what was asked nor what it did
    ("adaptive", 1, 14, "mode adaptive (1 speculative + 14 AR steps);"),  # it said "mode speculation"
    ("speculation", 12, 1, "mode speculation (12 speculative + 1 AR steps);"),
    ("ar", 0, 15, "mode ar;"),
])
def test_the_summary_says_the_mode_asked_for_and_what_ran(capsys, mode, speculative, ar, said):
    out = _generate(capsys, _stats(speculative, ar, acceptance_length=2.5 if speculative else 0.0), "--mode", mode)
    assert said in out
    assert ("acceptance length 2.50 tokens per speculative step" in out) == bool(speculative)


def test_the_json_stats_are_the_http_apis_with_int64_fields_as_numbers(capsys):
    stats = _stats(3, 2, acceptance_length=2.0, session_bytes=123456, capture_bytes=0)
    printed = json.loads(_generate(capsys, stats, "--json"))["stats"]
    assert printed["session_bytes"] == 123456 and printed["capture_bytes"] == 0  # protobuf's JSON says "123456"
    assert printed["mode_run"] == "speculation" and printed["acceptance_length"] == 2.0
    pytest.importorskip("aiohttp")
    from dspark_grpc.target_service.http_front import stats_extension

    assert stats_extension(stats, [7]) == {**printed, "token_ids": [7]}
    ar = json.loads(_generate(capsys, _stats(0, 5), "--json"))["stats"]
    assert ar["acceptance_length"] is None and ar["mode_run"] == "ar"


def test_the_unreachable_target_hint_names_only_what_dspark_generate_takes():
    hint = client_cli._request_failure(14, REFUSED).split(" -- ", 1)[1]
    commands = re.findall(r"`([^`]*)`", hint)
    assert "dspark-target serve" in commands
    generate = client_cli.parser().commands["generate"]
    taken = {flag for action in generate._actions for flag in action.option_strings}
    for flag in re.findall(r"--[\w-]+", re.sub(r"`[^`]*`", "", hint)):  # flags outside a quoted command: ours
        assert flag in taken, f"{flag} in {hint!r}"
    from dspark_grpc.draft_service import cli as draft_cli
    from dspark_grpc.target_service import cli as target_cli

    parsers = {"dspark-target": target_cli.parser, "dspark-draft": draft_cli.parser}
    for command in commands:  # and each quoted command is accepted as written
        argv = shlex.split(command)
        parsers[argv[0]]().parse_args(argv[1:])
