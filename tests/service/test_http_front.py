"""The OpenAI-compatible HTTP API (`dspark-target serve --http-port`): driven with the official `openai` client and
with plain HTTP against a real target (with a bearer token and a drafter), and compared token for token with the
gRPC Generate RPC; validation, auth and the loading state on the aiohttp app alone (no model)."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestClient, TestServer
from dspark_grpc.client import TargetClient
from dspark_grpc.client.local_stack import local_target
from dspark_grpc.protos.dspark.v1 import target_pb2, target_pb2_grpc
from dspark_grpc.speculation.channel import ChannelSecurity, make_channel
from dspark_grpc.speculation.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from dspark_grpc.target_service.http_front import (
    BadField,
    HttpFront,
    error_response,
    generate_request,
    ssl_context,
)
from dspark_grpc.target_service.servicer import TargetServicer

from tests.service.conftest import MAX_SESSIONS, SLOW_MACHINE_DRAFT_TIMEOUT, concurrently

TOKEN = "http-front-test-token"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
NEW_TOKENS = 24


# -- the app alone: validation, auth, loading, draining (no model) --------------------------------------


@pytest.mark.parametrize(("body", "chat", "param"), [
    ({"messages": CHAT, "n": 2}, True, "n"),
    ({"messages": CHAT, "max_tokens": 0}, True, "max_tokens"),
    ({"messages": CHAT, "max_completion_tokens": -1, "max_tokens": 5}, True, "max_completion_tokens"),
    ({"messages": CHAT, "temperature": 3}, True, "temperature"),
    ({"messages": CHAT, "top_p": 0}, True, "top_p"),
    ({"messages": CHAT, "seed": -1}, True, "seed"),
    ({"messages": CHAT, "stop": [1]}, True, "stop"),
    ({"messages": CHAT, "stream": "yes"}, True, "stream"),
    ({"messages": CHAT, "logprobs": True}, True, "logprobs"),
    ({"messages": CHAT, "dspark": {"mode": "fastest"}}, True, "dspark.mode"),
    ({"messages": CHAT, "dspark": {"modes": "ar"}}, True, "dspark"),
    ({"messages": []}, True, "messages"),
    ({"messages": [{"content": "no role"}]}, True, "messages[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, "messages[0].content"),
    ({"prompt": ["two", "prompts"]}, False, "prompt"),
    ({}, False, "prompt"),
    ([1, 2], False, None),
])
def test_bad_request_fields(body, chat, param):
    with pytest.raises(BadField) as e:
        generate_request(body, chat)
    assert e.value.param == param


def test_request_translation():
    parts = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief"}]
    body = {"messages": [{"role": "system", "content": parts}, *CHAT], "max_tokens": 9, "max_completion_tokens": 7,
            "temperature": 0, "top_p": 0.5, "seed": 3, "stop": "\n", "stream": True,
            "stream_options": {"include_usage": True},
            "dspark": {"mode": "speculation", "proposal": "tree", "budget": 8, "ignore_eos": True}}
    request, stream, usage = generate_request(body, chat=True)
    assert [m.content for m in request.prompt.chat.messages] == ["Be brief", CHAT[0]["content"]]
    assert request.max_new_tokens == 7 and list(request.stop) == ["\n"] and request.ignore_eos
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.seed) == (0.0, 0.5, 3)
    assert request.mode == 2 and request.proposal == 2 and request.budget == 8 and stream and usage
    request, stream, usage = generate_request({"prompt": [[1, 2, 3]]}, chat=False)
    assert list(request.prompt.tokens.ids) == [1, 2, 3] and not request.HasField("max_new_tokens")
    assert request.sampling.temperature == 1.0 and request.mode == 0 and not stream and not usage  # OpenAI defaults


@pytest.mark.parametrize(("error", "status", "kind"), [
    (InvalidArgument("bad"), 400, "invalid_request_error"),
    (FailedPrecondition("no drafter"), 400, "invalid_request_error"),
    (NotFound("gone"), 404, "not_found_error"),
    (ResourceExhausted("too many sessions"), 429, "rate_limit_error"),
    (Unavailable("loading"), 503, "service_unavailable_error"),
    (ServiceError("bug"), 500, "server_error"),
])
def test_statuses_map_to_http(error, status, kind):
    response = error_response(error)
    assert response.status == status
    assert json.loads(response.body)["error"] == {"message": error.message, "type": kind, "param": None,
                                                  "code": error.status.name.lower()}


def app_call(front: HttpFront, method: str, path: str, **kwargs) -> tuple[int, dict]:
    async def call():
        async with TestClient(TestServer(front.app())) as client:
            response = await client.request(method, path, **kwargs)
            return response.status, await response.json()

    return asyncio.run(call())


def assert_error(status: int, body: dict, expected: int, kind: str) -> str:
    assert status == expected, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["type"] == kind
    return body["error"]["message"]


def test_loading_auth_and_draining_without_a_model():
    front = HttpFront(TargetServicer(max_message_bytes=1 << 20), "127.0.0.1", 0, tokens=frozenset({TOKEN}))
    good = {"Authorization": f"Bearer {TOKEN}"}
    body = {"messages": CHAT}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        status, answer = app_call(front, "POST", "/v1/chat/completions", json=body, headers=headers)
        assert "bearer token" in assert_error(status, answer, 401, "authentication_error")
    status, answer = app_call(front, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert_error(status, answer, 401, "authentication_error")
    # the model is not loaded: 503 (health needs no token, as gRPC health does)
    assert "loading" in assert_error(*app_call(front, "GET", "/health"), 503, "service_unavailable_error")
    status, answer = app_call(front, "POST", "/v1/chat/completions", json=body, headers=good)
    assert_error(status, answer, 503, "service_unavailable_error")
    status, answer = app_call(front, "POST", "/v1/completions", data=b"{not json", headers=good)
    assert_error(status, answer, 503, "service_unavailable_error")  # (readiness first, as the gRPC port)
    assert_error(*app_call(front, "GET", "/v1/nothing", headers=good), 404, "not_found_error")
    front.draining = True
    assert "shutting down" in assert_error(*app_call(front, "GET", "/health"), 503, "service_unavailable_error")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_https_with_the_grpc_ports_certificate_and_drain(tmp_path):
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "key.pem", "-out",
                    "cert.pem", "-days", "2", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=60)
    context = ssl_context(str(tmp_path / "cert.pem"), str(tmp_path / "key.pem"))
    front = HttpFront(TargetServicer(max_message_bytes=1 << 20), "127.0.0.1", 0, ssl_context=context)
    trust = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))

    async def run() -> tuple[int, str]:
        await front.start()
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"https://127.0.0.1:{front.port}/health", ssl=trust) as response:
                    answer = response.status, (await response.json())["error"]["type"]
                with pytest.raises(aiohttp.ClientError):  # plaintext HTTP gets no answer
                    await session.get(f"http://127.0.0.1:{front.port}/health")
        finally:
            await front.drain(grace_s=1.0)
        with pytest.raises(aiohttp.ClientError):  # drained: the port is closed
            async with aiohttp.ClientSession() as session:
                await session.get(f"https://127.0.0.1:{front.port}/health", ssl=trust)
        return answer

    assert asyncio.run(run()) == (503, "service_unavailable_error")  # (no model in this test)


class StuckServicer:
    """A servicer whose generations never end (after one token): what `drain` ends at the grace period's end."""

    max_message_bytes = 1 << 20

    def __init__(self) -> None:
        self.closed = 0

    def ready_engine(self) -> SimpleNamespace:
        return SimpleNamespace(name="stuck", max_length=64)

    async def generation_stream(self, request, principal, deadline, what=""):
        try:
            yield target_pb2.GenerateResponse(text="a", token_ids=[1])
            await asyncio.Event().wait()
        finally:
            self.closed += 1


def test_drain_ends_running_requests_with_503():
    servicer = StuckServicer()
    front = HttpFront(servicer, "127.0.0.1", 0)
    body = {"prompt": "x", "max_tokens": 5}

    async def run() -> tuple[tuple[int, dict], list[bytes]]:
        await front.start()
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{front.port}/v1/completions"
            whole = asyncio.ensure_future(session.post(url, json=body))
            streamed = await session.post(url, json={**body, "stream": True})
            events = [await streamed.content.readline()]  # the first token: both requests are running
            deadline = time.monotonic() + 60  # (the other request may not have reached the servicer yet)
            while len(front.tasks) != 2:
                assert time.monotonic() < deadline, f"{len(front.tasks)} requests running, not 2"
                await asyncio.sleep(0.01)
            await front.drain(grace_s=0.0)
            events += [line async for line in streamed.content if line.strip()]
            response = await whole
            return (response.status, await response.json()), events

    (status, answer), events = asyncio.run(run())
    assert "shut down" in assert_error(status, answer, 503, "service_unavailable_error")
    assert json.loads(events[0].removeprefix(b"data: "))["choices"][0]["text"] == "a"
    assert json.loads(events[-1].removeprefix(b"data: "))["error"]["code"] == "unavailable"
    assert servicer.closed == 2  # both generations were closed (their sessions freed)


# -- a real target with --http-port, a bearer token and a drafter -------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def http_target(draft_address, tmp_path_factory) -> tuple[str, str]:
    """(gRPC address, HTTP base URL) of a target that speculates with the random drafter and wants TOKEN."""
    token_file = tmp_path_factory.mktemp("http") / "tokens"
    token_file.write_text(f"# test\n{TOKEN}\n")
    port = free_port()
    args = ["--http-port", str(port), "--auth-token-file", str(token_file), "--drafter", draft_address,
            "--draft-timeout", str(SLOW_MACHINE_DRAFT_TIMEOUT), "--max-sessions", str(MAX_SESSIONS), "--quiet",
            "--no-cost-profile", "--precision", "exact"]
    with local_target(args, echo=False) as address:
        with TargetClient(address) as probe:
            probe.wait_ready(timeout=300)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60  # until the target's link has found the drafter (probed twice a second)
        while post(url, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0,
                                            "dspark": {"mode": "speculation"}})[1]["dspark"]["speculative_steps"] == 0:
            assert time.monotonic() < deadline, "the target found no drafter"
            time.sleep(0.2)
        yield address, url


@pytest.fixture(scope="module")
def grpc_client(http_target):
    with TargetClient(http_target[0], mode="ar", timeout=300, security=ChannelSecurity(token=TOKEN)) as client:
        yield client


@pytest.fixture(scope="module")
def chat_ar(grpc_client):
    """Generate's AR reply to CHAT (NEW_TOKENS at most), which the tests below compare the HTTP replies with."""
    return grpc_client.generate(messages=CHAT, max_new_tokens=NEW_TOKENS)


@pytest.fixture()
def oai(http_target) -> openai.OpenAI:
    with openai.OpenAI(base_url=http_target[1] + "/v1", api_key=TOKEN, max_retries=0, timeout=300) as client:
        yield client


def post(url: str, path: str, body: dict, token: str = TOKEN) -> tuple[int, dict]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    return read(request)


def get(url: str, path: str, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return read(urllib.request.Request(url + path, headers=headers))


def read(request: urllib.request.Request) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_chat_matches_grpc_generate(oai, grpc_client, chat_ar):
    reply = oai.chat.completions.create(model="any", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0,
                                        extra_body={"dspark": {"mode": "ar"}})
    ours = chat_ar
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == ours.text
    assert reply.dspark["token_ids"] == ours.token_ids
    assert choice.finish_reason == ("length" if ours.finish_reason == "length" else "stop")
    assert reply.usage.prompt_tokens == ours.stats.prompt_tokens
    assert reply.usage.completion_tokens == len(ours.token_ids) == ours.stats.generated_tokens
    assert reply.object == "chat.completion" and reply.model == grpc_client.model_info().model_name
    assert reply.dspark["mode_run"] == "ar" and reply.dspark["speculative_steps"] == 0


def test_completion_matches_grpc_generate(oai, grpc_client):
    prompt = "The quick brown fox"
    reply, ours = concurrently(lambda run: run(), [  # the HTTP request and Generate at once
        lambda: oai.completions.create(model="any", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                       extra_body={"dspark": {"mode": "ar", "ignore_eos": True}}),
        lambda: grpc_client.generate(prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True)])
    assert reply.object == "text_completion" and reply.choices[0].text == ours.text
    assert reply.dspark["token_ids"] == ours.token_ids and len(ours.token_ids) == NEW_TOKENS
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == NEW_TOKENS
    # a stop string cuts the text as Generate does
    stop = ours.text.split()[2]
    cut = oai.completions.create(model="any", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stop=[stop],
                                 extra_body={"dspark": {"mode": "ar"}})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == ours.text[:ours.text.index(stop)]


def test_speculation_is_lossless_and_reported(oai, chat_ar):
    reply = oai.chat.completions.create(model="any", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0,
                                        extra_body={"dspark": {"mode": "speculation"}})
    ar = chat_ar
    stats = reply.dspark
    assert stats["token_ids"] == ar.token_ids and reply.choices[0].message.content == ar.text
    assert stats["mode_run"] == "speculation" and stats["speculative_steps"] > 0 and stats["fallback_reason"] == ""
    # tokens committed per speculative step: 1 + accepted draft tokens / drafts
    assert stats["acceptance_length"] == pytest.approx(1 + sum(stats["accepted_per_position"]) /
                                                       stats["speculative_steps"])
    assert isinstance(stats["session_bytes"], int)


def test_streaming_chat_and_completion(oai, grpc_client, chat_ar):
    ours = chat_ar
    chunks = list(oai.chat.completions.create(model="any", messages=CHAT, max_tokens=NEW_TOKENS, temperature=0,
                                              stream=True, stream_options={"include_usage": True},
                                              extra_body={"dspark": {"mode": "ar"}}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ours.text
    ids = [i for c in chunks for i in (getattr(c, "dspark", None) or {}).get("token_ids", [])]
    assert ids == ours.token_ids
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].dspark["mode_run"] == "ar"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ours.token_ids)
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1

    prompt = "def fibonacci(n):\n"
    ours, chunks = concurrently(lambda run: run(), [  # Generate and the HTTP stream at once
        lambda: grpc_client.generate(prompt, max_new_tokens=NEW_TOKENS),
        lambda: list(oai.completions.create(model="any", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                            stream=True, extra_body={"dspark": {"mode": "ar"}}))])
    assert "".join(c.choices[0].text for c in chunks) == ours.text
    assert chunks[-1].choices[0].finish_reason in ("length", "stop") and chunks[-1].usage is None


def test_bad_request_and_wrong_token(oai, http_target):
    for kwargs, param in (({"n": 2}, "n"), ({"max_tokens": 0}, "max_tokens")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model="any", messages=CHAT, **kwargs)
        assert e.value.status_code == 400 and e.value.body["param"] == param
        assert e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:  # refused by the target, not by the HTTP front: same shape
        oai.completions.create(model="any", prompt=[49152 + 5], max_tokens=2)
    assert str(49152) in e.value.body["message"]
    with openai.OpenAI(base_url=http_target[1] + "/v1", api_key="wrong", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError) as e:
            wrong.chat.completions.create(model="any", messages=CHAT, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"


def test_plain_http(http_target, grpc_client):
    url = http_target[1]
    assert get(url, "/health", token=None) == (200, {"status": "ok"})
    status, models = get(url, "/v1/models")
    assert status == 200 and [m["id"] for m in models["data"]] == [grpc_client.model_info().model_name]
    assert get(url, "/v1/models", token="wrong")[0] == 401
    status, reply = post(url, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8,
                                                  "temperature": 0})
    ours = grpc_client.generate("The capital of France is", max_new_tokens=8, mode="adaptive")
    assert status == 200 and reply["choices"][0]["text"] == ours.text
    status, error = post(url, "/v1/completions", {"prompt": "x", "n": 3})
    assert status == 400 and error["error"]["param"] == "n"


def live_sessions(address: str) -> int:
    with make_channel(address, ChannelSecurity(token=TOKEN)) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        return stub.GetModelInfo(target_pb2.GetModelInfoRequest(), timeout=60).live_sessions


def wait_live_sessions(address: str, wanted: int) -> None:
    deadline = time.monotonic() + 60  # 4000 tokens take minutes: a session left running would not go in time
    while live_sessions(address) != wanted:
        assert time.monotonic() < deadline, f"live sessions never became {wanted}"
        time.sleep(0.1)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_the_session(http_target, stream):
    address, url = http_target
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    body = {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "stream": stream,
            "dspark": {"mode": "ar", "ignore_eos": True}}
    connection.request("POST", "/v1/completions", json.dumps(body), {"Authorization": f"Bearer {TOKEN}"})
    sock = connection.sock
    if stream:  # a few tokens in
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
        texts = 0
        while texts < 3:
            texts += response.readline().startswith(b"data: {")
        assert live_sessions(address) == 1
    else:  # no reply before the end: the generation has begun when its session is live
        wait_live_sessions(address, 1)
    sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    wait_live_sessions(address, 0)
    with TargetClient(address, timeout=300, security=ChannelSecurity(token=TOKEN)) as client:  # still serving
        assert client.generate("Hi", max_new_tokens=2).token_ids
