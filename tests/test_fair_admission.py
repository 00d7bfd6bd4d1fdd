"""Fair admission (issue 37): with default limits one client cannot lock the others out of either service, and a
stranger who floods the draft service leaves a target with default flags all its draft sessions. The session store
and the draft engine without gRPC (principals as serving/security.py `principal_of` names them); the services end
to end: tests/reliability/test_fair_serving.py."""

from __future__ import annotations

import pytest
from dspark_grpc.draft_service import cli as draft_cli
from dspark_grpc.draft_service.engine import DraftEngine, DraftLimits
from dspark_grpc.serving.sessions import Owner, SessionStore, limits_problem
from dspark_grpc.speculation.errors import ResourceExhausted
from dspark_grpc.target_service import cli as target_cli
from dspark_grpc.target_service.engine import EngineLimits

FINGERPRINT = ("model-fingerprint", "tokenizer-fingerprint")


def fill(open_one, owner: Owner) -> int:
    """Open sessions for `owner` until one is refused: how many it got."""
    n = 0
    while True:
        try:
            open_one(owner)
        except ResourceExhausted:
            return n
        n += 1


def test_by_default_one_principal_holds_all_but_a_reserve_that_only_newcomers_get():
    store: SessionStore[str] = SessionStore(max_sessions=16, idle_ttl_s=60)
    assert (store.reserved, store.max_per_principal) == (2, 14)
    hog, hog_again = Owner("peer:ipv4:127.0.0.1:40001"), Owner("peer:ipv4:127.0.0.1:40001")  # one connection
    assert fill(lambda o: store.create("s", o), hog) == 14
    assert fill(lambda o: store.create("s", o), hog_again) == 0  # another stream of the same principal
    # a client that holds nothing gets one of the reserved sessions, but not a second one
    newcomer = Owner("peer:ipv4:127.0.0.1:40002")
    store.create("s", newcomer)
    with pytest.raises(ResourceExhausted, match="kept for clients that hold none .--reserved-sessions 2"):
        store.create("s", newcomer)
    store.create("s", Owner("token:0123456789abcdef"))  # a third principal takes the last one
    with pytest.raises(ResourceExhausted, match="too many live sessions"):
        store.create("s", Owner("peer:ipv4:127.0.0.1:40003"))
    # the hog's sessions freed: its cap again, not the reserve, is what holds it
    store.release_owner(hog)
    assert fill(lambda o: store.create("s", o), hog) == 12  # 16 - 2 held by others - 2 reserved
    assert len(store) == 14


@pytest.mark.parametrize("max_sessions", [2, 3, 4, 7])
def test_below_eight_sessions_one_is_still_kept_for_a_newcomer(max_sessions):
    """An eighth rounds down to none below 8: one client holding every session it could open (4 streams of one
    channel against --max-sessions 4) locked a second client out."""
    store: SessionStore[str] = SessionStore(max_sessions=max_sessions, idle_ttl_s=60)
    assert (store.reserved, store.max_per_principal) == (1, max_sessions - 1)
    assert fill(lambda o: store.create("s", o), Owner("peer:ipv4:127.0.0.1:40001")) == max_sessions - 1
    store.create("s", Owner("peer:ipv4:127.0.0.1:40002"))
    assert len(store) == max_sessions


def test_a_single_session_service_keeps_no_reserve():
    store: SessionStore[str] = SessionStore(max_sessions=1, idle_ttl_s=60)
    assert store.reserved == 0
    assert fill(lambda o: store.create("s", o), Owner("peer:ipv4:127.0.0.1:40001")) == 1


def test_the_draft_engine_keeps_one_for_a_newcomer_below_eight_sessions():
    engine = prompt_lookup_engine(max_sessions=4)
    assert (engine.sessions.reserved, engine.sessions.max_per_principal) == (1, 4)

    def open_draft(owner: Owner) -> str:
        return engine.open_session(FINGERPRINT, owner=owner)

    assert [fill(open_draft, Owner("peer:ipv4:127.0.0.1:51000")) for _ in range(4)] == [3, 0, 0, 0]
    open_draft(Owner("peer:ipv4:127.0.0.1:52000"))
    assert len(engine.sessions) == 4


def test_a_cap_refusal_names_the_flag_and_the_engines_own_sessions_are_not_principals():
    store: SessionStore[str] = SessionStore(max_sessions=8, idle_ttl_s=60)
    assert (store.reserved, store.max_per_principal) == (1, 7)
    hog = Owner("peer:ipv4:10.0.0.5:5000")
    assert fill(lambda o: store.create("s", o), hog) == 7
    with pytest.raises(ResourceExhausted, match="--max-sessions-per-principal 7"):
        store.create("s", hog)
    store.create("s", owner="not an Owner")  # a session of the engine's own caller: only --max-sessions holds it
    assert len(store) == 8


@pytest.mark.parametrize(("max_sessions", "per_principal", "reserved", "expected"), [
    (4, None, None, (1, 3)),  # below 8 sessions an eighth is none: one is kept all the same
    (1, None, None, (0, 1)),
    (32, None, None, (4, 28)),
    (16, 0, None, (2, 16)),  # 0: no cap of its own; the reserve still holds a principal at 14
    (16, 0, 0, (0, 16)),  # the old behaviour
    (16, 3, 5, (5, 3)),
    (8, 20, None, (1, 8)),  # a cap above --max-sessions is --max-sessions
])
def test_limits_as_configured(max_sessions, per_principal, reserved, expected):
    store: SessionStore[str] = SessionStore(max_sessions, 60, max_per_principal=per_principal, reserved=reserved)
    assert (store.reserved, store.max_per_principal) == expected
    got = fill(lambda o: store.create("s", o), Owner("peer:a"))
    assert got == min(expected[1], max_sessions - expected[0])


def test_a_reserve_as_large_as_the_store_is_refused():
    assert "below --max-sessions 4" in limits_problem(4, None, 4)
    assert limits_problem(4, None, 3) is None
    with pytest.raises(ValueError, match="--reserved-sessions 16"):
        SessionStore(16, 60, reserved=16)


def test_serve_flags_default_to_these_limits():
    target = target_cli.parser().parse_args(["serve"])
    draft = draft_cli.parser().parse_args(["serve"])
    assert (target.max_sessions, target.max_sessions_per_principal, target.reserved_sessions) == (16, None, None)
    assert (draft.max_sessions, draft.max_sessions_per_principal, draft.reserved_sessions) == (36, 16, None)
    assert EngineLimits().max_sessions_per_principal is None and EngineLimits().max_sessions == 16
    assert (DraftLimits().max_sessions, DraftLimits().max_sessions_per_principal) == (36, 16)


def prompt_lookup_engine(**limits) -> DraftEngine:
    return DraftEngine(None, vocab_size=100, target_fingerprint=FINGERPRINT, name="prompt lookup",
                       limits=DraftLimits(**limits))


def test_a_stranger_flooding_the_draft_service_leaves_a_default_target_all_its_draft_sessions():
    """A target (default flags: --max-sessions 16) drafts all its sessions on one stream, one principal. A stranger
    on one connection, over several streams, gets a target's worth and no more; the target then still opens all 16
    of its draft sessions, and a third client gets one of the reserved ones."""
    engine = prompt_lookup_engine()
    assert (engine.sessions.max_sessions, engine.sessions.max_per_principal, engine.sessions.reserved) == (36, 16, 4)

    def open_draft(owner: Owner) -> str:
        return engine.open_session(FINGERPRINT, owner=owner)

    stranger = "peer:ipv4:127.0.0.1:51000"
    streams = [Owner(stranger) for _ in range(3)]
    assert [fill(open_draft, s) for s in streams] == [16, 0, 0]
    target = Owner("peer:ipv4:127.0.0.1:52000")
    sids = [open_draft(target) for _ in range(16)]
    for sid in sids:  # the target's sessions work as ever
        assert engine.append(sid, 0, [1, 2, 3, 1, 2], [], None) == 5
        assert engine.propose(sid, 3, 5, proposer="ngram").tokens[:2] == [3, 1]
    open_draft(Owner("peer:ipv4:127.0.0.1:53000"))
    assert len(engine.sessions) == 16 + 16 + 1


def test_what_the_default_does_not_cover_a_stranger_on_several_connections():
    """Without tokens or client certificates a principal is a connection: a stranger who opens connections takes
    what the target has not opened yet (each new connection also gets a reserved session). What the target already
    holds is never taken from it, and it keeps speculating on those; tokens or mutual TLS (--auth-token-file,
    --tls-client-ca) keep strangers out altogether (UNAUTHENTICATED, tests/reliability/test_security.py)."""
    engine = prompt_lookup_engine()

    def open_draft(owner: Owner) -> str:
        return engine.open_session(FINGERPRINT, owner=owner)

    target = Owner("peer:ipv4:127.0.0.1:52000")
    held = [open_draft(target) for _ in range(4)]
    connections = [Owner(f"peer:ipv4:127.0.0.1:{60000 + i}") for i in range(8)]
    taken = [fill(open_draft, c) for c in connections]
    assert taken == [16, 12, 1, 1, 1, 1, 0, 0]  # 16, then down to the reserve, then one each while it lasts
    assert fill(open_draft, target) == 0
    assert all(engine.sessions.get(sid, target) is not None for sid in held)


def test_a_generate_that_finds_no_session_waits_for_one_to_be_freed():
    """Generate's session operations (target_service/servicer.GenerateSteps) on a store whose one client holds its
    share: the open waits for a release (an explicit gate, no clock) instead of failing, then succeeds."""
    import threading
    from types import SimpleNamespace

    from dspark_grpc.protos.dspark.v1 import target_pb2
    from dspark_grpc.target_service.servicer import GenerateSteps

    store = SessionStore(4, 600.0, max_per_principal=2, reserved=1)
    client = Owner("peer:ipv4:10.0.0.1:5000")
    held = [store.create("held", client) for _ in range(2)]
    tried = threading.Event()

    def open_session(m, owner):
        try:
            return target_pb2.SessionOpened(session_id=store.create("new", owner))
        finally:
            tried.set()

    steps = SimpleNamespace(ready_engine=lambda: SimpleNamespace(sessions=store), open=open_session)
    target = GenerateSteps(steps, client, deadline=None, stop=threading.Event())
    opened: list = []
    waiting = threading.Thread(target=lambda: opened.append(target.open(target_pb2.OpenSession())))
    waiting.start()
    assert tried.wait(60)  # refused (the client holds its 2): it waits, no reply yet
    assert not opened
    store.release(held[0])  # a session of the client's ends
    waiting.join(60)
    assert not waiting.is_alive() and opened[0].session_id


def test_a_waiting_generate_gives_up_at_its_deadline_with_the_refusal():
    import time
    from types import SimpleNamespace

    from dspark_grpc.protos.dspark.v1 import target_pb2
    from dspark_grpc.speculation.errors import ResourceExhausted
    from dspark_grpc.target_service.servicer import GenerateSteps

    store = SessionStore(1, 600.0)
    store.create("held", Owner("peer:a"))
    steps = SimpleNamespace(ready_engine=lambda: SimpleNamespace(sessions=store),
                            open=lambda m, owner: target_pb2.SessionOpened(session_id=store.create("new", owner)))
    target = GenerateSteps(steps, Owner("peer:b"), deadline=time.monotonic() - 1)  # already past
    with pytest.raises(ResourceExhausted) as refused:
        target.open(target_pb2.OpenSession())
    assert "too many live sessions" in refused.value.message
