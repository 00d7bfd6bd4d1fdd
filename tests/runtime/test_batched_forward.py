"""A ragged batched forward (several sessions' rows in one pass) against HF on each sequence alone, and the
StepBatcher that builds such batches from concurrent callers."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from dspark_grpc.runtime.formats.checkpoint import load_checkpoint
from dspark_grpc.runtime.models.decode import commit_path, prefill, tree_input, verify_tree
from dspark_grpc.runtime.models.kv_cache import CacheFullError
from dspark_grpc.runtime.models.transformer import SequenceInput, Transformer
from dspark_grpc.serving.batching import StepBatcher
from runtime_helpers import hf_logits, random_tokens
from tolerance import hidden_tolerance, logits_tolerance
from transformers import AutoModelForCausalLM

HANG_S = 60.0  # a wait for another thread that only a hang reaches


@pytest.fixture(scope="module", params=["qwen3", "llama_yarn"])
def pair(request, tiny_hf_models):
    path = tiny_hf_models[request.param]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return hf, Transformer.from_checkpoint(load_checkpoint(path, progress=False))


# (context length, tree tokens' parents): an AR step, a chain, a branching tree, and a fresh 6-token prefill chunk
CASES = [(30, [-1]), (7, [-1, 0, 1, 2]), (19, [-1, 0, 0, 1, 2, 2]), (0, None)]


def test_batched_forward_matches_hf_per_sequence(pair):
    hf, ours = pair
    caches, inputs, expected = [], [], []
    for i, (context, parents) in enumerate(CASES):
        prompt = random_tokens(context, seed=10 + i)
        cache = ours.new_cache()
        if context:
            prefill(ours, cache, prompt)
        if parents is None:  # a prefill chunk: causal rows, logits of the last row only
            new = random_tokens(6, seed=20 + i)
            inputs.append(SequenceInput(torch.tensor(new), torch.arange(6), cache, logits_rows=torch.tensor([5]),
                                        capture_layers=(0,)))
            full, out = hf_logits(hf, new, output_hidden_states=True)
            expected.append((full[-1:], out.hidden_states[1][0]))
        else:
            new = random_tokens(len(parents), seed=30 + i)
            inputs.append(tree_input(cache, new, parents, capture_layers=(0,)))
            rows, hidden = [], []
            for node in range(len(parents)):  # HF on each root-to-node path, alone
                path = [node]
                while parents[path[-1]] >= 0:
                    path.append(parents[path[-1]])
                seq = prompt + [new[n] for n in reversed(path)]
                full, out = hf_logits(hf, seq, output_hidden_states=True)
                rows.append(full[-1])
                hidden.append(out.hidden_states[1][0, -1])
            expected.append((torch.stack(rows), torch.stack(hidden)))
        caches.append(cache)
    outputs = ours.forward_batch(inputs)
    context = max(c.length + c.pending for c in caches)
    for out, (logits, hidden) in zip(outputs, expected, strict=True):
        torch.testing.assert_close(out.logits, logits, atol=logits_tolerance(ours, context), rtol=0)
        atol = hidden_tolerance(ours.config, context, 1, hidden)
        torch.testing.assert_close(out.captures[:, 0], hidden, atol=atol, rtol=0)
    # each cache holds exactly its own new rows, pending
    for cache, (_, parents) in zip(caches, CASES, strict=True):
        assert cache.pending == (6 if parents is None else len(parents))


def test_batched_decode_equals_each_session_alone(pair):
    _, ours = pair
    prompts = [random_tokens(n, seed=n) for n in (5, 23, 11)]

    def alone(prompt: list[int], steps: int) -> list[int]:
        cache = ours.new_cache()
        logits, _ = prefill(ours, cache, prompt)
        out = [int(logits.argmax())]
        for _ in range(steps):
            step, _ = verify_tree(ours, cache, [out[-1]], [-1])
            commit_path(cache, [0])
            out.append(int(step[0].argmax()))
        return out

    caches = [ours.new_cache() for _ in prompts]
    outs = [[int(prefill(ours, c, p)[0].argmax())] for c, p in zip(caches, prompts, strict=True)]
    for _ in range(12):
        results = ours.forward_batch([tree_input(c, [o[-1]], [-1]) for c, o in zip(caches, outs, strict=True)])
        for c, o, r in zip(caches, outs, results, strict=True):
            c.commit([0])
            o.append(int(r.logits[0].argmax()))
    assert outs == [alone(p, 12) for p in prompts]


def test_forward_batch_refuses_a_shared_cache_and_bad_input_before_touching_any_cache(pair):
    _, ours = pair
    a, b = ours.new_cache(), ours.new_cache()
    prefill(ours, a, [1, 2, 3])
    with pytest.raises(ValueError, match="own cache"):
        ours.forward_batch([tree_input(a, [4], [-1]), tree_input(a, [5], [-1])])
    full = ours.new_cache(max_length=1)
    with pytest.raises(CacheFullError, match="max_length 1"):
        ours.forward_batch([tree_input(a, [4], [-1]), tree_input(b, [5], [-1]), tree_input(full, [6, 7], [-1, 0])])
    bad_rows_mask = SequenceInput(torch.tensor([4, 5]), torch.tensor([3, 4]), a, new_rows_mask=torch.ones(3, 3).bool())
    with pytest.raises(AssertionError):
        ours.forward_batch([tree_input(b, [5], [-1]), bad_rows_mask])
    assert a.pending == 0 and b.pending == 0 and full.pending == 0 and a.length == 3


def _blocked_batcher():
    """A batcher whose first batch waits for `release`, so the next callers queue up behind it; `running` is set once
    that first batch has left the queue (an explicit gate: no sleep stands for "the worker has taken it")."""
    release, running, batches = threading.Event(), threading.Event(), []

    def run_batch(jobs: list[int]) -> list[int]:
        if not batches and not running.is_set():
            running.set()
            release.wait(HANG_S)
        if any(j < 0 for j in jobs):
            raise ValueError(f"negative job in {jobs}")
        batches.append(list(jobs))
        return [j * 10 for j in jobs]

    return StepBatcher(run_batch, rows=lambda j: 1, max_rows=3), release, running, batches


def _submit_all(batcher: StepBatcher, jobs: list[int]) -> tuple[dict, list[threading.Thread]]:
    results: dict[int, object] = {}

    def go(j: int) -> None:
        try:
            results[j] = batcher.submit(j)
        except ValueError as e:
            results[j] = e

    threads = [threading.Thread(target=go, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    return results, threads


def _wait_queued(batcher: StepBatcher, n: int) -> None:
    deadline = time.monotonic() + HANG_S
    while True:
        with batcher._cv:
            if len(batcher._queue) >= n:
                return
        assert time.monotonic() < deadline, "jobs never queued"
        threading.Event().wait(0.005)


def test_step_batcher_runs_queued_jobs_together_up_to_max_rows():
    batcher, release, running, batches = _blocked_batcher()
    first, t1 = _submit_all(batcher, [1])
    assert running.wait(HANG_S)  # job 1 is running (blocked)
    rest, t2 = _submit_all(batcher, [2, 3, 4, 5])
    _wait_queued(batcher, 4)
    release.set()
    for t in t1 + t2:
        t.join(HANG_S)
    assert batches[0] == [1]
    assert len(batches[1]) == 3 and len(batches[2]) == 1  # max_rows 3
    assert sorted(j for b in batches[1:] for j in b) == [2, 3, 4, 5]
    for j, (value, info) in {**first, **rest}.items():
        assert value == j * 10
        assert info.jobs == next(len(b) for b in batches if j in b)
    batcher.close()


def test_step_batcher_fails_only_the_bad_job():
    batcher, release, running, batches = _blocked_batcher()
    first, t1 = _submit_all(batcher, [1])
    assert running.wait(HANG_S)
    rest, t2 = _submit_all(batcher, [2, -3, 4])
    _wait_queued(batcher, 3)
    release.set()
    for t in t1 + t2:
        t.join(HANG_S)
    assert isinstance(rest[-3], ValueError)
    assert rest[2][0] == 20 and rest[4][0] == 40 and first[1][0] == 10
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(1)


def test_step_batcher_runs_then_and_calls_on_its_worker():
    """Post-processing (`then`) and side computations (`call`) run on the one worker thread, in queue order,
    never inside a batch; a failing `then` fails only its own job."""
    threads: list[str] = []

    def run_batch(jobs: list[int]) -> list[int]:
        threads.append(threading.current_thread().name)
        return [j * 10 for j in jobs]

    batcher = StepBatcher(run_batch, name="the-worker")

    def then(value: int) -> int:
        threads.append(threading.current_thread().name)
        if value == 30:
            raise KeyError("then failed")
        return value + 1

    assert batcher.submit(2, then=then)[0] == 21
    with pytest.raises(KeyError, match="then failed"):
        batcher.submit(3, then=then)
    assert batcher.submit(4)[0] == 40  # the batcher goes on
    assert batcher.call(lambda: threading.current_thread().name) == "the-worker"
    with pytest.raises(ZeroDivisionError):
        batcher.call(lambda: 1 / 0)
    assert set(threads) == {"the-worker"} and len(threads) == 5
    batcher.close()


def test_an_idle_inline_batcher_runs_a_lone_job_on_the_caller_and_queues_the_rest():
    """inline(): a job submitted while nothing is queued, running or expected from another session runs on the
    submitting thread (its `then` too, its error raised there); otherwise it goes to the worker as before. Jobs
    are "session:name"."""
    ran_on: list[str] = []
    release, running = threading.Event(), threading.Event()

    def run_batch(jobs: list[str]) -> list[str]:
        ran_on.append(threading.current_thread().name)
        if "x:block" in jobs:
            running.set()
            release.wait(HANG_S)
        if "x:bad" in jobs:
            raise ValueError("bad job")
        return [j.upper() for j in jobs]

    allowed = [True]
    batcher = StepBatcher(run_batch, name="the-worker", session=lambda job: job.split(":")[0],
                          inline=lambda: allowed[0])
    caller = threading.current_thread().name
    assert batcher.submit("x:a", then=lambda r: r + "!")[0] == "X:A!"
    with pytest.raises(ValueError, match="bad job"):
        batcher.submit("x:bad")
    assert ran_on == [caller, caller] and batcher.inlined == 2

    blocked, t1 = _submit_all_named(batcher, ["x:block"])  # a batch runs: the next job waits for the worker
    assert running.wait(HANG_S)
    queued, t2 = _submit_all_named(batcher, ["x:b"])
    _wait_queued(batcher, 1)
    release.set()
    for t in t1 + t2:
        t.join(HANG_S)
    assert queued["x:b"][0] == "X:B" and ran_on[-1] == "the-worker"
    assert blocked["x:block"][0] == "X:BLOCK" and ran_on[-2] != "the-worker"  # it had found the batcher idle

    batcher.expect(["y"], within_s=1000.0)  # another session of the round is coming: batch with it
    waiting, t3 = _submit_all_named(batcher, ["x:c"])
    _wait_queued(batcher, 1)
    batcher.unexpect("y")
    t3[0].join(HANG_S)
    assert waiting["x:c"][0] == "X:C" and ran_on[-1] == "the-worker"
    assert batcher.submit("y:d")[0] == "Y:D" and ran_on[-1] == "the-worker"  # "x" was in the last two batches

    allowed[0] = False
    assert batcher.submit("x:e")[0] == "X:E" and ran_on[-1] == "the-worker"
    allowed[0] = True
    assert batcher.submit("x:f")[0] == "X:F" and ran_on[-1] == "the-worker"  # "y" was in the last two batches
    assert batcher.submit("x:g")[0] == "X:G" and ran_on[-1] == caller and batcher.inlined == 4
    batcher.close()


def _submit_all_named(batcher: StepBatcher, jobs: list[str]) -> tuple[dict, list[threading.Thread]]:
    results: dict[str, object] = {}
    threads = [threading.Thread(target=lambda j=j: results.__setitem__(j, batcher.submit(j))) for j in jobs]
    for t in threads:
        t.start()
    return results, threads


def _batcher_on_a_slow_fake_clock() -> tuple[StepBatcher, list[list[str]]]:
    """A batcher of (session, step) jobs whose every forward "takes" 1000 s on a fake clock, so the gather window
    (0.25 x the last forward) is far longer than any scheduling delay of this machine, and what the batches hold does
    not depend on its speed; and the sessions of each batch it ran."""
    now = [0.0]
    batches: list[list[str]] = []

    def run_batch(jobs: list[tuple[str, int]]) -> list[int]:
        batches.append(sorted(name for name, _ in jobs))
        now[0] += 1000.0
        return [0] * len(jobs)

    return StepBatcher(run_batch, max_rows=8, session=lambda job: job[0], clock=lambda: now[0]), batches


def _start_while_held(batcher: StepBatcher, threads: list[threading.Thread], queued: int) -> None:
    """Start `threads` while the worker is held, and let it go once `queued` jobs wait: they run as one batch."""
    release = threading.Event()
    blocker = threading.Thread(target=batcher.call, args=(lambda: release.wait(HANG_S),))
    blocker.start()
    for t in threads:
        t.start()
    _wait_queued(batcher, queued)
    release.set()
    blocker.join(HANG_S)


def test_step_batcher_waits_for_a_late_session_instead_of_splitting_the_batch():
    batcher, batches = _batcher_on_a_slow_fake_clock()

    def session(name: str, delay: float) -> None:
        for step in range(3):
            batcher.submit((name, step))
            threading.Event().wait(delay)  # "c" answers its client later than the others

    threads = [threading.Thread(target=session, args=(n, d)) for n, d in (("a", 0), ("b", 0), ("c", 0.05))]
    _start_while_held(batcher, threads, 3)
    for t in threads:
        t.join(HANG_S)
    batcher.close()
    assert batches == [["a", "b", "c"]] * 3


def test_step_batcher_does_not_wait_for_a_session_that_is_away():
    # "b" stepped in the last batch, so the next one would wait up to 0.25 x 1000 s (fake clock) for it; marked away
    # (waiting for its drafter) it is not waited for, until it queues again
    batcher, batches = _batcher_on_a_slow_fake_clock()
    first = [threading.Thread(target=batcher.submit, args=((n, 0),)) for n in "ab"]
    _start_while_held(batcher, first, 2)
    for t in first:
        t.join(HANG_S)
    assert batches == [["a", "b"]]
    batcher.away("b")
    alone = threading.Thread(target=batcher.submit, args=(("a", 1),))
    alone.start()
    alone.join(HANG_S)
    assert not alone.is_alive() and batches[-1] == ["a"]
    batcher.away("a")  # (else "b" alone would now wait for "a", of the last batch)
    batcher.submit(("b", 1))  # back: away no more
    assert batches[-1] == ["b"] and "b" not in batcher._away
    batcher.close()


def test_a_long_computation_on_the_worker_lets_a_session_that_just_stepped_in_first():
    # `wait_for_return` between two slices of a prompt chunk: a session of the last batch that queues its next job
    # within the bound ends the wait (True: the chunk lets it run first). Fake clock: each batch "takes" 1000 s.
    now = [0.0]

    def run_batch(jobs: list[str]) -> list[int]:
        now[0] += 1000.0
        return [0] * len(jobs)

    batcher = StepBatcher(run_batch, session=lambda job: job, clock=lambda: now[0])
    batcher.submit("a")
    came_back = threading.Thread(target=batcher.submit, args=("a",))

    def slice_start() -> bool:
        came_back.start()  # queued behind this call: the worker is busy with it
        return batcher.wait_for_return(within_s=600.0)

    assert batcher.call(slice_start) is True
    came_back.join(HANG_S)
    assert batcher.call(lambda: batcher.wait_for_return(0.05)) is False  # nobody came back within the bound
    now[0] += 5000.0  # the last batch ended longer ago than it took: no wait at all
    waited = threading.Thread(target=lambda: batcher.call(lambda: batcher.wait_for_return(600.0)))
    waited.start()
    waited.join(60)
    assert not waited.is_alive()
    batcher.close()


def test_step_batcher_waits_for_expected_sessions_and_not_for_one_unexpected():
    # `expect` names the sessions of a round that will submit from their own threads: the first to arrive waits for
    # the others (fake clock: the bound is far beyond any scheduling delay), and a session that will not come after
    # all (`unexpect`) releases the wait at once, without waiting for the bound.
    now = [0.0]
    batches = []

    def run_batch(jobs: list[str]) -> list[int]:
        batches.append(sorted(jobs))
        return [0] * len(jobs)

    batcher = StepBatcher(run_batch, max_rows=8, session=lambda job: job, clock=lambda: now[0])
    batcher.expect(["a", "b", "c"], within_s=1000.0)
    done = []

    def submit(name: str, delay: float) -> None:
        threading.Event().wait(delay)
        done.append(batcher.submit(name))

    threads = [threading.Thread(target=submit, args=(n, d)) for n, d in (("a", 0), ("b", 0.1), ("c", 0.2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S)
    assert batches == [["a", "b", "c"]] and all(info.jobs == 3 for _, info in done)

    batcher.expect(["d", "e"], within_s=1000.0)
    late = threading.Thread(target=submit, args=("d", 0))
    late.start()
    threading.Event().wait(0.1)
    assert batches == [["a", "b", "c"]]  # "d" waits for "e"
    batcher.unexpect("e")  # e's step failed before it submitted
    late.join(HANG_S)
    assert batches[-1] == ["d"]

    batcher.expect(["f"], within_s=5.0)
    now[0] += 10.0  # past the bound: "g" does not wait for "f"
    submit("g", 0)
    assert batches[-1] == ["g"]
    batcher.close()


def test_step_batcher_futures_share_the_batch_of_waiting_callers_and_carry_errors():
    """submit_future queues a job without a waiting thread (a draft-ahead round): it joins the batch of the callers
    queued with it, and its future holds the result, or the job's own error."""
    batcher, release, running, batches = _blocked_batcher()
    first, t1 = _submit_all(batcher, [1])
    assert running.wait(HANG_S)
    waiting, t2 = _submit_all(batcher, [2])
    ok, bad = batcher.submit_future(3), batcher.submit_future(-4)
    _wait_queued(batcher, 3)
    assert not ok.done()
    release.set()
    for t in t1 + t2:
        t.join(HANG_S)
    assert ok.result(HANG_S) == 30 and waiting[2][0] == 20
    with pytest.raises(ValueError):
        bad.result(HANG_S)
    # the caller and the futures ran as one batch, which the bad job failed: each was then run alone
    assert sorted(batches[1:]) == [[2], [3]]
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit_future(5)
