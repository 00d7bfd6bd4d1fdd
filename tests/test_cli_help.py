"""The command-line tools' help and their messages for ordinary mistakes (issue 34): every option has help and shows
its default (a store_false flag never reads "(default: True)"); ports are checked; --help works in an SDK-only
install; a TLS mismatch between client and service is named as one; a target whose --drafter does not answer says so.
No model is loaded: the gRPC servers here are bare health services on loopback."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from dspark_grpc.bench import cli as bench_cli
from dspark_grpc.client import cli as client_cli
from dspark_grpc.client.sdk import TargetClient
from dspark_grpc.draft_service import cli as draft_cli
from dspark_grpc.speculation.channel import ChannelSecurity, make_channel, tls_mismatch
from dspark_grpc.target_service import cli as target_cli
from dspark_grpc.target_service.drafter_link import DrafterLink, warn_if_unreachable
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dspark_grpc.cli_common import SERVER_PACKAGES, DefaultsHelpFormatter

NOBODY = "127.0.0.1:1"  # nothing listens on port 1
HANG_S = 60.0  # a health check's answer (the link's own probe timeout is for a drafter under load, not this test)
PARSERS = {"dspark": client_cli.parser, "dspark bench": bench_cli.parser, "dspark-target": target_cli.parser,
           "dspark-draft": draft_cli.parser}
# what grpcio 1.85 said, observed once against the servers below (speculation/channel.py, tls_mismatch)
PLAINTEXT_TO_TLS = "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:42491: Socket closed"
TLS_TO_PLAINTEXT = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:36639: Tls handshake "
                    "failed (TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:"
                    "WRONG_VERSION_NUMBER: Invalid certificate verification context: OK")
ANOTHER_CA = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:46127: Tls handshake failed "
              "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1000007d:SSL routines:OPENSSL_internal:"
              "CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate: OK")
REFUSED = ("failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Failed to connect to remote "
           "host: Connection refused")


def sub_parsers(prog: str) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    p = PARSERS[prog]()
    if " " in prog:  # a sub-command that is a program of its own
        yield prog, p
        return
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prog} {name}", sub


# `dspark bench` in `dspark`'s parser only lists it (the bench package's own parser has its options)
ALL = [pair for prog in PARSERS for pair in sub_parsers(prog) if pair[0] != "dspark bench" or prog == "dspark bench"]


@pytest.mark.parametrize(("name", "parser"), ALL, ids=[name for name, _ in ALL])
def test_every_option_has_help_that_states_its_default(name, parser):
    assert {n.split()[1] for n, _ in ALL} >= {"generate", "bench", "demo", "health", "serve"}
    formatter = DefaultsHelpFormatter(name)
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        what = f"{name} {'/'.join(action.option_strings) or action.dest}"
        assert action.help and action.help.strip(), f"{what} has no help"
        shown = formatter._get_help_string(action) % vars(action)  # as argparse expands it
        if action.nargs == 0:  # a flag: its help says what it changes, no "(default: True/False)"
            assert "(default: True)" not in shown and "(default: False)" not in shown, what
        elif action.default not in (None, [], "") and not action.required:
            assert "default" in shown.lower(), f"{what}: {shown!r} does not state its default {action.default!r}"
        assert "(default: None)" not in shown and "(default: [])" not in shown, what


@pytest.mark.parametrize(("argv", "words"), [
    (["dspark bench", "--help"], ["--max-new-tokens", "(default: ar,speculation)", "(default: 15.0)"]),
    (["dspark", "generate", "--help"], ["(default: 128)", "(default: adaptive)", "(default: 127.0.0.1:50051)"]),
    (["dspark-target", "serve", "--help"], ["--no-draft-ahead", "by default it drafts", "(default: 50051)",
                                            "(default: 16)", "--max-message-bytes"]),
    (["dspark-draft", "serve", "--help"], ["(default: 50052)", "(default: 64)", "--host"]),
])
def test_help_prints_the_defaults(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        PARSERS[argv[0]]().parse_args(argv[1:])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # as read, whatever the terminal's width
    for w in words:
        assert w in out, (w, out)
    assert "(default: True)" not in out and "(default: False)" not in out and "(default: None)" not in out


@pytest.mark.parametrize("prog", ["dspark-target", "dspark-draft"])
@pytest.mark.parametrize(("flag", "value"), [("--port", "-3"), ("--port", "65536"), ("--port", "x"),
                                             ("--metrics-port", "-1")])
def test_a_port_out_of_range_is_a_usage_error(prog, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        PARSERS[prog]().parse_args(["serve", flag, value])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"{prog} serve: error: argument {flag}:"), err
    assert "in use" not in err and ("0..65535" in err or "an integer" in err), err
    assert PARSERS[prog]().parse_args(["serve", "--port", "0", "--metrics-port", "65535"]).port == 0


def _sdk_only(code: str, *argv: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter where the service dependencies cannot be imported (an SDK-only install)."""
    block = f"import sys\nfor name in {SERVER_PACKAGES!r}:\n    sys.modules[name] = None\nsys.argv = {list(argv)!r}\n"
    return subprocess.run([sys.executable, "-c", block + code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("prog", "entry"), [("dspark-target", "target_main"), ("dspark-draft", "draft_main"),
                                             ("dspark-convert", "convert_main"), ("dspark-train", "train_main")])
@pytest.mark.parametrize("args", [["--help"], ["serve", "-h"]])
def test_service_help_in_an_sdk_only_install_says_what_to_install(prog, entry, args):
    out = _sdk_only(f"from dspark_grpc.cli_common import {entry}\n{entry}()", prog, *args)
    assert out.returncode == 0 and not out.stderr, out.stderr
    assert out.stdout.startswith(f"usage: {prog}")
    assert "pip install '.[server]'" in out.stdout and "dspark-grpc checkout" in out.stdout
    assert "whl[server]'" in out.stdout and "pip install ." in out.stdout


@pytest.mark.parametrize("command", ["generate", "bench", "demo", "health"])
def test_the_client_help_needs_no_service_dependency(command):
    out = _sdk_only("from dspark_grpc.cli_common import dspark_main\ndspark_main()", "dspark", command, "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"usage: dspark {command}") and "(default: " in " ".join(out.stdout.split())


def test_the_observed_tls_mismatches_are_named():
    assert "may require TLS" in tls_mismatch(PLAINTEXT_TO_TLS) and "--tls-ca" in tls_mismatch(PLAINTEXT_TO_TLS)
    assert "does not seem to serve TLS" in tls_mismatch(TLS_TO_PLAINTEXT)
    assert "not from the CA given" in tls_mismatch(ANOTHER_CA)
    assert tls_mismatch(REFUSED) is None
    assert "is the service running" in client_cli._request_failure(14, REFUSED)
    assert "may require TLS" in client_cli._request_failure(14, PLAINTEXT_TO_TLS)


# -- the same against real servers on loopback ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI")
    from tests.reliability.test_security import make_cert

    d = tmp_path_factory.mktemp("pki")
    make_cert(d, "ca", None, "dspark test CA")
    make_cert(d, "server", "ca", "localhost", san="IP:127.0.0.1,DNS:localhost")
    make_cert(d, "rogue-ca", None, "someone else's CA")
    return d


def _health_server(credentials: grpc.ServerCredentials | None = None,
                   status=health_pb2.HealthCheckResponse.SERVING) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", credentials) if credentials else \
        server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def tls_server(pki: Path) -> Iterator[str]:
    credentials = grpc.ssl_server_credentials([((pki / "server.key").read_bytes(), (pki / "server.pem").read_bytes())])
    server, address = _health_server(credentials)
    yield address
    server.stop(0)


@pytest.fixture(scope="module")
def plain_server() -> Iterator[str]:
    server, address = _health_server()
    yield address
    server.stop(0)


def _dspark(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        client_cli.main(list(argv))
    assert e.value.code == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_a_plaintext_client_to_a_tls_service_hears_that_it_may_need_tls(tls_server, capsys):
    err = _dspark(capsys, "generate", "Hi", "--target", tls_server)
    assert err.startswith("dspark: error: UNAVAILABLE: ") and "Socket closed" in err, err
    assert "may require TLS" in err and "--tls-ca" in err and "is the service running" not in err
    assert not client_cli.health_check(tls_server)
    assert "may require TLS" in capsys.readouterr().err
    with TargetClient(tls_server) as client, pytest.raises(ConnectionError) as e:
        client.wait_ready(unreachable_after=0.5)
    assert "may require TLS" in str(e.value) and "security=" in str(e.value)


def test_a_tls_client_to_a_plaintext_service_or_another_ca_is_told_so(pki, plain_server, tls_server, capsys):
    err = _dspark(capsys, "generate", "Hi", "--target", plain_server, "--tls-ca", str(pki / "ca.pem"))
    assert "does not seem to serve TLS" in err, err
    err = _dspark(capsys, "generate", "Hi", "--target", tls_server, "--tls-ca", str(pki / "rogue-ca.pem"))
    assert "not from the CA given" in err, err


def test_nothing_listening_is_still_a_service_that_is_not_running(capsys):
    err = _dspark(capsys, "generate", "Hi", "--target", NOBODY)
    assert "is the service running" in err and "TLS" not in err


def test_the_drafter_check_at_target_start_up(tls_server, pki, capsys):
    nobody = DrafterLink(make_channel(NOBODY), NOBODY, 10.0, probe_timeout_s=HANG_S)
    warning = nobody.unreachable()
    assert warning.startswith(f"drafter {NOBODY} is not reachable (UNAVAILABLE: ")
    assert warning.endswith("sessions run target-only until it answers")
    warn_if_unreachable(nobody, "[dspark-target]").join(HANG_S)
    assert capsys.readouterr().err == f"[dspark-target] warning: {warning}\n"

    plaintext = DrafterLink(make_channel(tls_server), tls_server, 10.0, probe_timeout_s=HANG_S)  # to a TLS drafter
    assert "may require TLS" in plaintext.unreachable() and "--drafter-tls-ca" in plaintext.unreachable()
    ca = (pki / "ca.pem").read_bytes()
    assert DrafterLink(make_channel(tls_server, ChannelSecurity(root_ca=ca)), tls_server, 10.0,
                       probe_timeout_s=HANG_S).unreachable() is None
    loading, address = _health_server(status=health_pb2.HealthCheckResponse.NOT_SERVING)
    try:  # a drafter still loading answers: no warning
        assert DrafterLink(make_channel(address), address, 10.0, probe_timeout_s=HANG_S).unreachable() is None
    finally:
        loading.stop(0)
    for link in (nobody, plaintext):
        link.channel.close()

