"""The draft engine in-process: concurrent sessions share drafter passes without cross-talk, a session's own
operations never interleave, and the start-up proposal cost tables are profiled once and then loaded."""

from __future__ import annotations

import math
import os
import queue
import re
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
import torch
from dspark_grpc.draft_service.engine import DraftEngine, DraftLimits
from dspark_grpc.protos.dspark.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from dspark_grpc.runtime.formats.drafter_formats import init_random_drafter
from dspark_grpc.serving import cost_profile
from dspark_grpc.serving.tensor_codec import to_proto
from dspark_grpc.speculation.cost_table import CostTable
from dspark_grpc.speculation.errors import FailedPrecondition, InvalidArgument

from tests.drafter.helpers import chain_tolerances_of_block, random_features, run_block
from tests.drafter.test_drafter_forward import TARGET
from tests.service.test_draft_service import DraftSession

FINGERPRINT = ("m" * 64, "t" * 64)


def tiny_engine(**limits) -> DraftEngine:
    drafter = init_random_drafter(TARGET, num_layers=2, block_size=5, target_layer_ids=(1, 4), seed=9,
                                  layer_types=("sliding_attention", "full_attention"), sliding_window=6)
    return DraftEngine(drafter.eval().requires_grad_(False), TARGET.vocab_size, FINGERPRINT, "tiny",
                       DraftLimits(max_sessions=8, **limits))


def open_with_context(engine: DraftEngine, n: int, seed: int) -> str:
    sid = engine.open_session(FINGERPRINT)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(TARGET.vocab_size, (n,), generator=g).tolist()
    tokens[n // 2:] = tokens[: n - n // 2]  # a repeat, so prompt lookup has something to match
    features = random_features(engine.config, n, seed=seed)
    assert engine.append(sid, 0, tokens, list(engine.config.target_layer_ids), features) == n
    return sid


# (context rows, anchor, propose kwargs): different lengths, chains, trees, hybrid and a seeded sampled chain
REQUESTS = [
    (4, 7, dict(proposer="dspark")),
    (19, 300, dict(proposer="dspark", tree=True, budget=6)),
    (11, 7, dict(proposer="hybrid", tree=True, budget=9)),
    (8, 42, dict(proposer="dspark", temperature=0.8, seed=5)),
]


def propose(engine: DraftEngine, sid: str, anchor: int, position: int, kwargs: dict):
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", None)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return engine.propose(sid, anchor, position, kernel="torch", generator=generator, **kwargs)


class Gate:
    """Holds the first drafter pass until `waiting` more proposals are in it or queued behind it (so the queued
    ones share the next pass), and logs when passes end. Under load two proposals can reach the first pass
    together, so it may hold more than one."""

    def __init__(self, engine: DraftEngine, waiting: int, release: threading.Event | None = None) -> None:
        self.batcher, self.run, self.waiting = engine._passes, engine._passes.run_batch, waiting
        self.release, self.first, self.log = release, True, []
        self.batcher.run_batch = self

    def __call__(self, jobs):
        if self.first:
            self.first = False
            deadline = time.monotonic() + 120
            while len(jobs) - 1 + len(self.batcher._queue) < self.waiting:
                assert time.monotonic() < deadline, "the other proposals never queued"
                time.sleep(0.005)
            if self.release is not None:
                assert self.release.wait(120)
        out = self.run(jobs)
        self.log.append(("pass", len(jobs)))
        return out


def run_threads(targets) -> list:
    results, errors = [None] * len(targets), []

    def call(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i, fn)) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def test_concurrent_sessions_share_a_pass_and_propose_what_each_proposes_alone():
    engine = tiny_engine()
    sids = [open_with_context(engine, n, seed) for seed, (n, _, _) in enumerate(REQUESTS)]
    alone = [propose(engine, sid, anchor, n, kw) for sid, (n, anchor, kw) in zip(sids, REQUESTS, strict=True)]
    assert [r.batch_sessions for r in alone] == [1, 1, 1, 1]
    gate = Gate(engine, waiting=len(REQUESTS) - 1)
    together = run_threads([lambda sid=sid, n=n, a=anchor, kw=kw: propose(engine, sid, a, n, kw)
                            for sid, (n, anchor, kw) in zip(sids, REQUESTS, strict=True)])
    first = gate.log[0][1]  # usually 1; more when several proposals reached the worker before it woke
    assert gate.log == [("pass", first)] + ([("pass", 4 - first)] if first < 4 else [])  # the rest shared a pass
    assert sorted(r.batch_sessions for r in together) == sorted([first] * first + [4 - first] * (4 - first))
    # tests/drafter/helpers.py's bounds for the longest context, T >= 0.8, tree paths of up to block_size depths
    rows = max(n for n, _, _ in REQUESTS)
    probe = run_block(engine.drafter, random_features(engine.config, rows), 7)
    logprob_atol, confidence_atol = chain_tolerances_of_block(engine.drafter, rows, probe, temperature=0.8,
                                                              depths=engine.config.block_size)
    for a, b in zip(alone, together, strict=True):
        assert (b.tokens, b.parents, b.sources) == (a.tokens, a.parents, a.sources)
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), rtol=0, atol=logprob_atol)
        torch.testing.assert_close(b.confidences, a.confidences, rtol=0, atol=confidence_atol)
    assert together[3].draft_ids is not None and torch.equal(together[3].draft_ids, alone[3].draft_ids)
    assert len({tuple(r.tokens[1:]) for r in together}) == 4  # each session drafted from its own context
    assert {r.proposer for r in together} == {"dspark", "hybrid"}
    engine.close()


def test_appended_rows_wait_for_the_next_pass_which_projects_every_session_at_once():
    """An append only queues its rows (no torch work in the caller's thread, beside the drafter's worker); the next
    pass projects the waiting rows of all its sessions in one context_kv call, and drafts from them what a session
    whose rows were projected on their own drafts."""
    engine = tiny_engine()
    sids = [open_with_context(engine, n, seed) for seed, n in enumerate((6, 9))]
    ref = [open_with_context(engine, n, seed) for seed, n in enumerate((6, 9))]
    layers = list(engine.config.target_layer_ids)
    more = [random_features(engine.config, k, seed=7 + k) for k in (3, 2)]
    for group in (sids, ref):
        for sid, n, rows in zip(group, (6, 9), more, strict=True):
            assert engine.append(sid, n, list(range(10, 10 + rows.shape[0])), layers, rows) == n + rows.shape[0]
    projected, real = [], engine.drafter.context_kv

    def spy(rows, positions):
        projected.append(positions.tolist())
        return real(rows, positions)

    engine.drafter.context_kv = spy
    assert projected == []  # the appends projected nothing
    alone = [propose(engine, sid, 3, n, {"proposer": "dspark"}) for sid, n in zip(ref, (9, 11), strict=True)]
    assert projected == [list(range(9)), list(range(11))]  # one call per pass: its one session's 6 + 3, 9 + 2 rows
    projected.clear()
    engine.expect_proposals(sids, within_s=120)  # as a DraftRound does: their pass waits for both
    together = run_threads([lambda sid=sid, n=n: propose(engine, sid, 3, n, {"proposer": "dspark"})
                            for sid, n in zip(sids, (9, 11), strict=True)])
    assert [r.batch_sessions for r in together] == [2, 2]
    assert len(projected) == 1 and sorted(projected[0]) == sorted([*range(9), *range(11)])  # in either order
    for a, b in zip(alone, together, strict=True):
        assert b.tokens == a.tokens
    engine.close()


def test_prompt_lookup_proposals_run_no_drafter_pass():
    engine = tiny_engine()
    sid = open_with_context(engine, 12, 3)
    out = engine.propose(sid, 5, 12, proposer="ngram")
    assert out.batch_sessions == 0 and out.proposer == "ngram" and set(out.sources[1:]) <= {"ngram"}
    engine.close()


def _nondecreasing(values) -> bool:
    return all(x <= y for x, y in zip(values, values[1:], strict=False))


def test_cost_tables_are_profiled_once_then_loaded(tmp_path, monkeypatch):
    calls = []

    def counting_time_sizes(*args, **kwargs):
        calls.append(list(args[1]))
        return real(*args, **kwargs)

    real = cost_profile.time_sizes
    monkeypatch.setattr(cost_profile, "time_sizes", counting_time_sizes)
    first = tiny_engine(max_tree_budget=16).profile_costs(tmp_path, repeats=1, max_seconds=0.5)
    assert calls == [[1, 2, 4], [4, 5, 8, 16]]  # drafter passes by lanes, then proposals by budget
    files = sorted(tmp_path.iterdir())
    assert len(files) == 3 and all(f.name.startswith("draft-lanes") for f in files)
    stamps = {f: os.stat(f).st_mtime_ns for f in files}

    calls.clear()
    second = tiny_engine(max_tree_budget=16)
    assert second.profile_costs(tmp_path) == second.propose_costs
    assert calls == []  # loaded, not profiled
    assert {f: os.stat(f).st_mtime_ns for f in tmp_path.iterdir()} == stamps
    assert [(t.key, t.sizes, t.seconds) for t in second.propose_costs] == [(t.key, t.sizes, t.seconds)
                                                                           for t in first]
    assert [t.key.lanes for t in first] == [1, 2, 4]
    for t in first:
        assert t.sizes == [4, 5, 8, 16] and t.key.kind == "draft" and _nondecreasing(t.seconds)
        assert t.key.drafter.startswith("dspark:") and t.key.model == FINGERPRINT[0]
    for i in range(4):  # more sessions per pass never make a round cheaper
        assert _nondecreasing([t.seconds[i] for t in first])

    tiny_engine(max_tree_budget=16, tree_top_k=4).profile_costs(tmp_path, repeats=1, max_seconds=0.5)
    assert len(calls) == 2 and len(list(tmp_path.iterdir())) == 6  # another key: profiled again


def test_the_engine_refuses_bad_requests_and_the_session_goes_on():
    """DraftEngine checks what a request brings once, where it enters (the drafter's context and forward only assert
    it): each refusal says what to fix and leaves the session as it was."""
    engine = tiny_engine()
    sid = open_with_context(engine, 8, seed=3)
    layers, vocab = list(engine.config.target_layer_ids), TARGET.vocab_size
    appends = [(FailedPrecondition, "gap", 10, [1]), (InvalidArgument, "start_position", -1, [1]),
               (InvalidArgument, "out of range", 8, [vocab])]
    for error, words, start, tokens in appends:
        with pytest.raises(error, match=words):
            engine.append(sid, start, tokens, layers, random_features(engine.config, len(tokens)))
    with pytest.raises(InvalidArgument, match="expected"):
        engine.append(sid, 8, [1, 2], layers, torch.zeros(2, len(layers), 7))
    with pytest.raises(InvalidArgument, match="truncate length"):
        engine.truncate(sid, 9)
    proposals = [(dict(anchor_token=vocab), "out of range"), (dict(anchor_token=-1), "out of range"),
                 (dict(temperature=math.nan), "temperature"), (dict(temperature=1e-30), "temperature"),
                 (dict(temperature=-1.0), "temperature"), (dict(budget=-1), "budget must be >= 0"),
                 (dict(kernel="cuda"), "kernel must be one of")]
    for fields, words in proposals:
        with pytest.raises(InvalidArgument, match=words):
            engine.propose(sid, **{"anchor_token": 7, "anchor_position": 8, "proposer": "dspark", **fields})
    assert engine.sessions.get(sid).length == 8
    assert engine.propose(sid, 7, 8, proposer="dspark", kernel="torch").tokens[0] == 7
    engine.close()


def test_prompt_lookup_only_publishes_no_cost_table(tmp_path):
    engine = DraftEngine(None, TARGET.vocab_size, FINGERPRINT, "ngram", DraftLimits())
    assert engine.profile_costs(tmp_path) == [] and engine.propose_costs == []
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("proposer", ["dspark", "ngram"])
def test_metrics_count_proposals_and_passes(proposer):
    pytest.importorskip("prometheus_client")
    from dspark_grpc.serving.service_metrics import DraftServiceMetrics

    engine = tiny_engine()
    engine.metrics = metrics = DraftServiceMetrics()
    sid = open_with_context(engine, 10, 4)
    out = engine.propose(sid, 9, 10, proposer=proposer, tree=True, budget=5)
    engine.propose(sid, 9, 10, proposer=proposer)
    r = metrics.registry
    labels = {"proposer": proposer, "kind": "tree"}
    assert r.get_sample_value("dspark:draft_proposals_total", labels) == 1
    assert r.get_sample_value("dspark:draft_proposed_tokens_total", labels) == len(out.tokens) - 1
    assert r.get_sample_value("dspark:draft_proposal_seconds_count", labels) == 1
    assert r.get_sample_value("dspark:draft_proposals_total", {"proposer": proposer, "kind": "chain"}) == 1
    passes = 2 if proposer == "dspark" else None  # prompt lookup runs no drafter pass
    assert r.get_sample_value("dspark:drafter_forward_sessions_count") == (passes or 0)
    if passes:
        assert r.get_sample_value("dspark:drafter_forward_sessions_sum") == 2
        assert r.get_sample_value("dspark:drafter_forward_rows_sum") == 2 * engine.config.block_size
    engine.close()


# -- the service over gRPC ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def metered_drafter(tmp_path_factory):
    """`dspark-draft serve --drafter random --metrics-port 0` with its cost cache in a tmp dir: (gRPC address,
    metrics URL, cost cache dir)."""
    cache = tmp_path_factory.mktemp("cost-cache")
    cmd = [sys.executable, "-m", "dspark_grpc.draft_service.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--drafter", "random", "--seed", "0", "--max-sessions", "4", "--metrics-port", "0", "--cost-cache",
           str(cache), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:  # keeps the pipe drained while the service runs
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    found: dict[str, str] = {}
    try:
        while "serving" not in found:
            line = lines.get(timeout=300)
            assert line is not None, f"the draft service exited with {proc.wait()}"
            for name, pattern in (("metrics", r"metrics at (http://\S+/metrics)"), ("serving", r"SERVING on (\S+)")):
                if m := re.search(pattern, line):
                    found[name] = m.group(1)
        yield found["serving"], found["metrics"], cache
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=60) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def grpc_session(address: str, info, n: int, seed: int):
    s = DraftSession(address)
    sid = s.ok(open=draft_pb2.OpenDraft(target=info.target)).session_id
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, len(info.target_layer_ids), 576, generator=g)
    capture = common_pb2.HiddenCapture(layer_ids=info.target_layer_ids, start_position=0, rows=to_proto(rows))
    tokens = torch.randint(info.vocab_size, (n,), generator=g).tolist()
    assert s.ok(append=draft_pb2.AppendContext(session_id=sid, start_position=0, tokens=tokens,
                                               capture=capture)).length == n
    return s, sid


def test_service_profiles_cost_tables_and_batches_sessions_without_cross_talk(metered_drafter):
    address, _, cache = metered_drafter
    with grpc.insecure_channel(address) as channel:
        info = draft_pb2_grpc.DraftServiceStub(channel).GetDrafterInfo(draft_pb2.GetDrafterInfoRequest(), timeout=60)
    tables = sorted((CostTable.load(f) for f in cache.iterdir()), key=lambda t: t.key.lanes)
    assert [t.key.lanes for t in tables] == [1, 2, 4]  # profiled at start-up, saved in the cache dir it was given
    for t in tables:
        assert info.block_size in t.sizes and _nondecreasing(t.seconds)

    sessions = [grpc_session(address, info, n, seed) for seed, n in enumerate((5, 23, 12))]
    kinds = [draft_pb2.PROPOSAL_KIND_CHAIN, draft_pb2.PROPOSAL_KIND_TREE, draft_pb2.PROPOSAL_KIND_CHAIN]

    def propose(i: int):
        s, sid = sessions[i]
        n = (5, 23, 12)[i]
        return s.ok(propose=draft_pb2.Propose(session_id=sid, anchor_token=100 + i, anchor_position=n, kind=kinds[i],
                                              budget=7 if kinds[i] == draft_pb2.PROPOSAL_KIND_TREE else 0,
                                              proposer=draft_pb2.PROPOSER_DSPARK,
                                              kernel=draft_pb2.KERNEL_CHOICE_TORCH))

    together = run_threads([lambda i=i: propose(i) for i in range(3)])
    alone = [propose(i) for i in range(3)]
    for a, b in zip(alone, together, strict=True):
        assert list(b.tree.tokens) == list(a.tree.tokens) and list(b.tree.parents) == list(a.tree.parents)
        assert a.batch_sessions == 1 and 1 <= b.batch_sessions <= 3
    for s, _ in sessions:
        s.close()


def test_service_metrics_count_proposals_and_passes(metered_drafter):
    address, url, _ = metered_drafter
    with grpc.insecure_channel(address) as channel:
        info = draft_pb2_grpc.DraftServiceStub(channel).GetDrafterInfo(draft_pb2.GetDrafterInfoRequest(), timeout=60)
    before = scrape(url)
    s, sid = grpc_session(address, info, 9, 4)
    chain = s.ok(propose=draft_pb2.Propose(session_id=sid, anchor_token=3, anchor_position=9,
                                           proposer=draft_pb2.PROPOSER_DSPARK))
    ngram = s.ok(propose=draft_pb2.Propose(session_id=sid, anchor_token=3, anchor_position=9,
                                           proposer=draft_pb2.PROPOSER_NGRAM, kind=draft_pb2.PROPOSAL_KIND_TREE))
    s.close()
    assert chain.batch_sessions == 1 and ngram.batch_sessions == 0
    after = scrape(url)

    def moved(name: str, **labels) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("dspark:draft_proposals_total", proposer="dspark", kind="chain") == 1
    assert moved("dspark:draft_proposals_total", proposer="ngram", kind="tree") == 1
    assert moved("dspark:draft_proposed_tokens_total", proposer="dspark", kind="chain") == len(chain.tree.tokens) - 1
    assert moved("dspark:draft_proposal_seconds_count", proposer="dspark", kind="chain") == 1
    assert moved("dspark:drafter_forward_sessions_count") == 1  # the n-gram proposal ran no drafter pass
    assert moved("dspark:drafter_forward_rows_sum") == info.block_size
    assert moved("dspark:drafter_forward_seconds_sum") > 0
