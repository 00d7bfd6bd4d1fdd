"""The one session store of a service: live sessions by id, a cap on their number (in all and per principal) and
an idle TTL. A session belongs to its owner (the stream that opened it): to anyone else it does not exist.

Admission, so that one client cannot lock the others out: a principal (serving/security.py `principal_of`: its
bearer token, else its client certificate, else its connection) holds at most `max_per_principal` sessions, and the
last `reserved` free sessions go only to principals that hold none, so a new client can open one while others hold
all they may. Defaults (`default_reserved`): an eighth of the sessions reserved, at least one, the rest the most one
principal may hold (16 sessions: 2 and 14; 4 sessions: 1 and 3)."""

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
    """One stream (compared by identity) of one principal (who is calling: a token, a certificate, a connection)."""

    principal: str = ""


@dataclass
class _Entry(Generic[S]):
    state: S
    owner: Hashable
    last_used: float = field(default_factory=time.monotonic)


_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _principal(owner: Hashable) -> str | None:
    return owner.principal if isinstance(owner, Owner) else None


def default_reserved(max_sessions: int) -> int:
    """Sessions kept for principals that hold none, unless configured: an eighth, rounded down, and at least one
    where there are two or more (with fewer than 8 an eighth would be none: one client could lock the rest out)."""
    return max(max_sessions // 8, 1) if max_sessions >= 2 else 0


def limits_problem(max_sessions: int, max_per_principal: int | None, reserved: int | None) -> str | None:
    """What is wrong with these limits (the serve flags' words), or None."""
    if reserved is not None and reserved >= max_sessions:
        return (f"--reserved-sessions {reserved} must be below --max-sessions {max_sessions} (a client that holds one "
                "session could never open another)")
    if max_per_principal is not None and max_per_principal < 0:
        return f"--max-sessions-per-principal must be >= 0, got {max_per_principal}"
    return None


class SessionStore(Generic[S]):
    """Thread-safe. `owner` ties sessions to the stream that opened them, so ending a stream frees them.

    For owners that are an `Owner` (a principal's stream): `max_per_principal` (None = max_sessions - reserved;
    0 = no cap of its own) is the most live sessions the owners of one principal may hold together; the last
    `reserved` free sessions (None = `default_reserved`) are only for principals that hold none. Sessions of other
    owners (the engines' own callers, tests) count towards max_sessions only."""

    def __init__(self, max_sessions: int, idle_ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 max_per_principal: int | None = None, reserved: int | None = None):
        problem = limits_problem(max_sessions, max_per_principal, reserved)
        if problem or max_sessions <= 0 or idle_ttl_s <= 0:
            raise ValueError(problem or f"max_sessions ({max_sessions}) and idle_ttl_s ({idle_ttl_s}) must be > 0")
        self.max_sessions = max_sessions
        self.reserved = default_reserved(max_sessions) if reserved is None else reserved
        if max_per_principal is None:
            max_per_principal = max_sessions - self.reserved
        self.max_per_principal = min(max_per_principal or max_sessions, max_sessions)
        self.idle_ttl_s = idle_ttl_s
        self._clock = clock
        self._entries: dict[str, _Entry[S]] = {}
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self.freed = 0  # sessions released or evicted so far (`wait_freed`)

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
            if principal is not None:
                self._admit(principal)
            session_id = session_id or uuid.uuid4().hex
            self._entries[session_id] = _Entry(state, owner, self._clock())
            return session_id

    def _admit(self, principal: str) -> None:
        """Refuses (RESOURCE_EXHAUSTED) a session to a principal at its cap, or to one that holds sessions when
        only the reserved ones are free. Called with the lock held, the store not full."""
        held = sum(_principal(e.owner) == principal for e in self._entries.values())
        if held >= self.max_per_principal:
            raise ResourceExhausted(
                f"this client already holds {held} live sessions, the most one principal may hold "
                f"(--max-sessions-per-principal {self.max_per_principal}); release finished sessions")
        free = self.max_sessions - len(self._entries)
        if held and free <= self.reserved:
            raise ResourceExhausted(
                f"this client already holds {held} live session(s), and the last {free} free session(s) are kept "
                f"for clients that hold none (--reserved-sessions {self.reserved} of --max-sessions "
                f"{self.max_sessions}); release finished sessions or retry later")

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
            self._count_freed(0 if entry is None else 1)
        if entry is None:
            raise NotFound(f"unknown session {session_id!r}")
        return entry.state

    def release_owner(self, owner: Hashable) -> list[str]:
        with self._lock:
            ids = [sid for sid, e in self._entries.items() if e.owner == owner]
            for sid in ids:
                del self._entries[sid]
            self._count_freed(len(ids))
        return ids

    def evict_idle(self) -> list[str]:
        now = self._clock()
        with self._lock:
            ids = [sid for sid, e in self._entries.items() if now - e.last_used > self.idle_ttl_s]
            for sid in ids:
                del self._entries[sid]
            self._count_freed(len(ids))
        return ids

    def _count_freed(self, n: int) -> None:
        if n:
            self.freed += n
            self._freed.notify_all()

    def wait_freed(self, seen: int, timeout: float) -> None:
        """Until a session is freed after `seen` (a value of `freed`), at most `timeout` seconds."""
        with self._freed:
            self._freed.wait_for(lambda: self.freed != seen, timeout)
