"""The target's drafters: one draft service, or a pool of them (`--drafter A,B` or a `dns:///NAME:PORT` whose name
resolves to several, e.g. a headless Kubernetes Service, looked up again every RESOLVE_INTERVAL_S).

Each member is one DrafterLink (its health probe) and one DraftRounds (its stream). A session drafts on one member
(`pick`: rendezvous hashing of its id over the members that answer, so a session's choice moves only when its
drafter goes away); when its drafter fails, the session re-opens on another (`pick(..., besides=...)`) with its
context (speculation/steps.SessionDrafting.reopen) or, with none left, continues target-only.
"""

from __future__ import annotations

import socket
import sys
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from dspark_grpc.protos.dspark.v1 import draft_pb2
from dspark_grpc.target_service.draft_rounds import DraftRounds
from dspark_grpc.target_service.drafter_link import DrafterLink

RESOLVE_INTERVAL_S = 10.0
DNS_SCHEME = "dns:"


@dataclass
class Drafter:
    link: DrafterLink
    rounds: DraftRounds

    @property
    def address(self) -> str:
        return self.link.address

    def close(self) -> None:
        self.link.stop()
        self.rounds.close()


def dns_host_port(spec: str) -> tuple[str, int]:
    """`dns:///host:port` or `dns://authority/host:port` -> (host, port)."""
    rest = spec[len(DNS_SCHEME):]
    if rest.startswith("//"):
        rest = rest[2:].split("/", 1)[1] if "/" in rest[2:] else ""
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--drafter {spec}: a dns name needs a port (dns:///NAME:PORT)")
    return host.strip("[]"), int(port)


def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to, as gRPC targets (sorted; [] when the name does not resolve now)."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    addresses = {f"[{a[4][0]}]:{a[4][1]}" if a[0] == socket.AF_INET6 else f"{a[4][0]}:{a[4][1]}" for a in found}
    return sorted(addresses)


class DrafterPool:
    def __init__(self, spec: str, make_drafter: Callable[[str, str | None], Drafter],
                 resolve_addresses: Callable[[str, int], list[str]] = resolve,
                 resolve_interval_s: float = RESOLVE_INTERVAL_S) -> None:
        """`spec`: "host:port[,host:port...]" or "dns:///NAME:PORT"; `make_drafter(address, server_name)` starts a
        member (`server_name`: the name its TLS certificate carries when `address` is one of a name's IPs)."""
        self.spec, self._make = spec, make_drafter
        self.members: list[Drafter] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._dns: tuple[str, int] | None = None
        if spec.startswith(DNS_SCHEME):
            self._dns = dns_host_port(spec)
            self._resolve, self._interval = resolve_addresses, resolve_interval_s
            self.refresh()
            threading.Thread(target=self._keep_resolving, name="drafter-dns", daemon=True).start()
        else:
            self.members = [make_drafter(a.strip(), None) for a in spec.split(",") if a.strip()]

    def refresh(self) -> None:
        """Look the dns name up again: new addresses join; members gone from the name and down leave."""
        assert self._dns is not None
        host, port = self._dns
        found = self._resolve(host, port)
        if not found:
            return  # (a name that does not resolve for a moment keeps the members it had)
        with self._lock:
            known = {d.address for d in self.members}
            joined = [self._make(a, host) for a in found if a not in known]
            left = [d for d in self.members if d.address not in found and d.link.info is None]
            self.members = [d for d in self.members if d not in left] + joined
        for d in left:
            d.close()
        if joined:
            print(f"drafter pool {self.spec}: {', '.join(d.address for d in joined)} joined", file=sys.stderr,
                  flush=True)

    def _keep_resolving(self) -> None:
        while not self._stop.wait(self._interval):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        for d in self.members:
            d.close()

    @property
    def several(self) -> bool:
        """Whether a session may have another drafter to move to."""
        return self._dns is not None or len(self.members) > 1

    def up(self) -> list[Drafter]:
        return [d for d in self.members if d.link.info is not None]

    def info(self) -> draft_pb2.GetDrafterInfoResponse | None:
        """The info of a member that answers (all serve one drafter), None while none does."""
        return next((d.link.info for d in self.up()), None)

    def down_reason(self) -> str:
        reasons = [d.link.down_reason for d in self.members if d.link.down_reason]
        return "; ".join(reasons) or f"no drafter found at {self.spec} yet"

    def pick(self, session_id: str, besides: DraftRounds | None = None) -> Drafter | None:
        """The drafter a session drafts on: of the members that answer (other than the one whose rounds are
        `besides`), the one its id hashes highest with; None if none answers."""
        up = [d for d in self.up() if d.rounds is not besides]
        if len(up) <= 1:
            return up[0] if up else None
        return max(up, key=lambda d: zlib.crc32(f"{session_id}@{d.address}".encode()))
