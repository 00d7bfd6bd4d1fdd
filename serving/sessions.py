"""The one session store of a service: live sessions by id, a cap on their number (in all and per principal) and
an idle TTL. A session belongs to its owner (the stream that opened it): to anyone else it does not exist."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from dspark_grpc.speculation.errors import InvalidArgument, NotFound, ResourceExhausted

S = TypeVar("S")


@dataclass(frozen=True, eq=False)
class Owner:
    """One stream (compared by identity) of one principal (who is calling: a token, a certificate, an address)."""

    principal: str = ""


@dataclass
class _Entry(Generic[S]):
    state: S
    owner: Hashable
    last_used: float = field(default_factory=time.monotonic)


_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _principal(owner: Hashable) -> str | None:
    return owner.principal if isinstance(owner, Owner) else None


class SessionStore(Generic[S]):
    """Thread-safe. `owner` ties sessions to the stream that opened them, so ending a stream frees them.

    max_per_principal (0 = max_sessions): live sessions the owners of one principal may hold together."""

    def __init__(self, max_sessions: int, idle_ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 max_per_principal: int = 0):
        assert max_sessions > 0 and idle_ttl_s > 0 and max_per_principal >= 0
        self.max_sessions = max_sessions
        self.max_per_principal = max_per_principal or max_sessions
        self.idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._entries: dict[str, _Entry[S]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, session_id: object) -> bool:
        with self._lock:
            return session_id in self._entries

    def create(self, state: S, owner: Hashable = None, session_id: str = "") -> str:
        """A new session under `session_id` if given (1-64 letters, digits, '-' or '_', not in use), else a fresh
        random id."""
        if session_id and not _SESSION_ID.fullmatch(session_id):
            raise InvalidArgument(f"session id {session_id[:80]!r}: use 1-64 letters, digits, '-' or '_'")
        self.evict_idle()
        with self._lock:
            if session_id in self._entries:
                raise InvalidArgument(f"session id {session_id!r} is in use; open under another id or none")
            if len(self._entries) >= self.max_sessions:
                raise ResourceExhausted(
                    f"too many live sessions ({self.max_sessions}); release finished sessions or raise "
                    "--max-sessions")
            principal = _principal(owner)
            if principal is not None and self.max_per_principal < self.max_sessions:
                held = sum(_principal(e.owner) == principal for e in self._entries.values())
                if held >= self.max_per_principal:
                    raise ResourceExhausted(
                        f"this client already holds {held} live sessions, the most one principal may hold "
                        f"(--max-sessions-per-principal {self.max_per_principal}); release finished sessions")
            session_id = session_id or uuid.uuid4().hex
            self._entries[session_id] = _Entry(state, owner, self._clock())
            return session_id

    def get(self, session_id: str, owner: Hashable = None) -> S:
        """The session's state; with `owner`, NOT_FOUND unless that owner opened it."""
        self.evict_idle()
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None or (owner is not None and entry.owner is not owner and entry.owner != owner):
                raise NotFound(f"unknown session {session_id!r}: never opened on this stream, released, or idle "
                               f"for more than {self.idle_ttl_s:g} s")
            entry.last_used = self._clock()
            return entry.state

    def release(self, session_id: str) -> S:
        with self._lock:
            entry = self._entries.pop(session_id, None)
        if entry is None:
            raise NotFound(f"unknown session {session_id!r}")
        return entry.state

    def release_owner(self, owner: Hashable) -> list[str]:
        with self._lock:
            ids = [sid for sid, e in self._entries.items() if e.owner == owner]
            for sid in ids:
                del self._entries[sid]
        return ids

    def evict_idle(self) -> list[str]:
        now = self._clock()
        with self._lock:
            ids = [sid for sid, e in self._entries.items() if now - e.last_used > self.idle_ttl_s]
            for sid in ids:
                del self._entries[sid]
        return ids
