"""Transport security and authentication of both services: TLS / mutual TLS credentials, bearer tokens checked by a
server interceptor on every RPC except health, and the principal a session belongs to."""

from __future__ import annotations

import hashlib
import hmac
import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from dspark_grpc.speculation.channel import is_loopback

HEALTH_PREFIX = "/grpc.health.v1.Health/"
log = logging.getLogger("dspark.security")


@dataclass(frozen=True)
class ServerSecurity:
    cert_chain: bytes | None = None  # PEM
    private_key: bytes | None = None
    client_ca: bytes | None = None  # PEM: require client certificates signed by it
    tokens: frozenset[str] = field(default_factory=frozenset)

    @property
    def protected(self) -> bool:
        return self.cert_chain is not None or bool(self.tokens)

    def credentials(self) -> grpc.ServerCredentials | None:
        if self.cert_chain is None:
            return None
        return grpc.ssl_server_credentials([(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
                                           require_client_auth=self.client_ca is not None)


def read_tokens(path: str | Path) -> frozenset[str]:
    """One token per line; blank lines and '#' comments are ignored."""
    lines = (line.split("#", 1)[0].strip() for line in Path(path).read_text().splitlines())
    tokens = frozenset(t for t in lines if t)
    if not tokens:
        raise ValueError(f"{path} holds no token (one per line)")
    return tokens


def server_security(args) -> ServerSecurity:
    """From the serve flags (--tls-cert, --tls-key, --tls-client-ca, --auth-token-file); SystemExit with the reason
    when they do not fit together or a file cannot be read."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise SystemExit("give --tls-cert and --tls-key together")
    if args.tls_client_ca and not args.tls_cert:
        raise SystemExit("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
    try:
        read = lambda p: Path(p).read_bytes() if p else None  # noqa: E731
        tokens = read_tokens(args.auth_token_file) if args.auth_token_file else frozenset()
        return ServerSecurity(read(args.tls_cert), read(args.tls_key), read(args.tls_client_ca), tokens)
    except (OSError, ValueError) as e:
        raise SystemExit(f"cannot read the security files: {e}") from e


def exposure_warning(host: str, security: ServerSecurity) -> str | None:
    """What a server listening on `host` exposes, said at start-up; None on loopback or with TLS."""
    if is_loopback(host) or security.cert_chain is not None:
        return None
    if not security.tokens:
        return (f"listening on {host} without TLS or a token: anyone who can reach the port can use the service "
                "(see --tls-cert/--tls-key, --tls-client-ca, --auth-token-file)")
    return (f"listening on {host} with bearer tokens but without TLS: the tokens travel unencrypted, so anyone on "
            "the path can read them and use the service (add --tls-cert/--tls-key)")


def bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str) and value[:7].lower() == "bearer ":
            return value[7:].strip()
    return None


def principal_of(context: grpc.aio.ServicerContext) -> str:
    """Who is calling: the bearer token (hashed), else the client certificate's common name, else the stream's peer
    (its connection: address and port; clients on one host are not one principal, a client's channel is one)."""
    token = bearer_token(context.invocation_metadata())
    if token:
        return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]
    names = (context.auth_context() or {}).get("x509_common_name")
    if names:
        return "cert:" + names[0].decode(errors="replace")
    return "peer:" + (context.peer() or "")


class _Undecodable:
    def __init__(self, error: Exception) -> None:
        self.error = error

    @property
    def message(self) -> str:
        return f"the request is not a valid protobuf message ({type(self.error).__name__}: {self.error})"


class Guard(grpc.aio.ServerInterceptor):
    """Every RPC: bytes that do not decode are INVALID_ARGUMENT (gRPC's own answer is UNKNOWN); when tokens are
    configured, a call without a valid bearer token is UNAUTHENTICATED, except health (probes)."""

    def __init__(self, tokens: frozenset[str] = frozenset()) -> None:
        self.tokens = tuple(t.encode() for t in tokens)

    def authorized(self, metadata) -> bool:
        token = (bearer_token(metadata) or "").encode()
        # compare with every token, so the time taken does not tell which one nearly matched
        return bool(sum(hmac.compare_digest(token, t) for t in self.tokens))

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        if self.tokens and not details.method.startswith(HEALTH_PREFIX) and \
                not self.authorized(details.invocation_metadata):
            return _wrap(handler, details.method, refuse=(
                grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token: send the metadata 'authorization: "
                "Bearer TOKEN' with a token of the server's --auth-token-file"))
        return _wrap(handler, details.method)


def _wrap(handler: grpc.RpcMethodHandler, method: str,
          refuse: tuple[grpc.StatusCode, str] | None = None) -> grpc.RpcMethodHandler:
    """The same handler with a deserializer that never raises, refusing undecodable requests (or every call); each
    refusal is one log line."""
    decode = handler.request_deserializer

    def safe_decode(data: bytes):
        try:
            return decode(data) if decode is not None else data
        except Exception as e:  # noqa: BLE001 - any decoding failure is the caller's bad bytes
            return _Undecodable(e)

    async def check(request, context) -> None:
        if refuse is not None:
            log.info("%s refused: %s (peer %s)", method, refuse[0].name, context.peer())
            await context.abort(*refuse)
        if isinstance(request, _Undecodable):
            log.info("%s refused: INVALID_ARGUMENT: %s", method, request.message[:300])
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)

    async def checked_stream(requests, context):
        async for request in requests:
            await check(request, context)
            yield request

    kind = ("stream" if handler.request_streaming else "unary") + "_" + \
        ("stream" if handler.response_streaming else "unary")
    behavior = getattr(handler, kind)
    if handler.request_streaming:
        async def prepare(request, context):
            await check(None, context)
            return checked_stream(request, context)
    else:
        async def prepare(request, context):
            await check(request, context)
            return request

    if inspect.isasyncgenfunction(behavior):
        async def wrapped(request, context):
            async for response in behavior(await prepare(request, context), context):
                yield response
    else:
        async def wrapped(request, context):
            return await behavior(await prepare(request, context), context)

    make = getattr(grpc, f"{kind}_rpc_method_handler")
    return make(wrapped, request_deserializer=safe_decode, response_serializer=handler.response_serializer)
