"""The thread governor (serving/threads.py): a worker's forwards move to one thread when that measures faster (a
fake clock and fake forward costs per thread count: no timing of this machine), and the fast precision's outputs do
not depend on the thread count (so a verify on one thread still equals AR steps run on two, bitwise)."""

from __future__ import annotations

import pytest
import torch
from dspark_grpc.bench.engine_bench import ar_steps
from dspark_grpc.runtime.formats.checkpoint import inference_model, load_checkpoint
from dspark_grpc.runtime.models.decode import commit_path, prefill, verify_tree
from dspark_grpc.serving.threads import ThreadGovernor, same_outputs_on_one_thread
from runtime_helpers import random_tokens


class FakeMachine:
    """Forward seconds per thread count (what the machine's load makes them), on a fake clock."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.now, self.seconds, self.threads, self.calls = 0.0, seconds, 2, []

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.calls.append(n)

    def forward(self) -> int:
        self.now += self.seconds[self.threads]
        return self.threads


def governed(machine: FakeMachine, **kw) -> ThreadGovernor:
    return ThreadGovernor(2, machine.set_threads, clock=lambda: machine.now, **kw)


def run(governor: ThreadGovernor, machine: FakeMachine, forwards: int, rows: int = 1) -> list[int]:
    return [governor.run(machine.forward, rows) for _ in range(forwards)]


def test_an_idle_machine_stays_on_every_thread_and_probes_less_and_less():
    machine = FakeMachine({2: 0.010, 1: 0.017})
    governor = governed(machine, min_interval_s=1.0, max_interval_s=8.0)
    counts = run(governor, machine, 3000)  # 30 s of forwards
    assert governor.current == 2 and governor.switches == 0
    assert counts.count(1) < 0.01 * len(counts)
    assert 1 in machine.calls and machine.calls[-1] == 2  # probed, and back
    assert 3 <= governor.probes <= 6  # after 1, 2, 4, 8, 8, ... s


def test_a_busy_core_moves_the_forwards_to_one_thread():
    machine = FakeMachine({2: 0.150, 1: 0.016})
    governor = governed(machine, min_interval_s=1.0, max_interval_s=8.0)
    run(governor, machine, 400)
    assert governor.current == 1 and governor.switches == 1
    probes = governor.probes
    counts = run(governor, machine, 2000)  # 32 s: two threads probed again, and still losing
    assert governor.current == 1 and governor.probes > probes
    assert counts.count(2) < 0.02 * len(counts)


def test_the_machine_turning_busy_probes_at_once_and_idle_again_moves_back():
    machine = FakeMachine({2: 0.010, 1: 0.017})
    governor = governed(machine, min_interval_s=1.0, max_interval_s=60.0)
    run(governor, machine, 3000)  # probes now 8 s apart and more
    probes = governor.probes
    machine.seconds = {2: 0.150, 1: 0.016}  # another process takes a core
    run(governor, machine, 12)  # well before the next probe would be due
    assert governor.probes == probes + 1 and governor.current == 1
    machine.seconds = {2: 0.010, 1: 0.017}  # it ends
    run(governor, machine, 8000)  # 136 s: the next probes of two threads win
    assert governor.current == 2 and governor.switches == 2


def test_probes_compare_forwards_of_the_same_rows():
    """A 1-row step costs less than a 16-row verify on any thread count: a probe of 1-row steps is not compared with
    16-row forwards (it would win for its rows, not for its threads)."""
    machine = FakeMachine({2: 0.030, 1: 0.050})
    governor = governed(machine, min_interval_s=1.0)
    run(governor, machine, 33, rows=16)  # 0.99 s: no probe yet
    machine.seconds = {2: 0.010, 1: 0.017}
    run(governor, machine, 13, rows=1)  # the probe falls on the first 1-row step: no 1-row level of 2 threads yet
    assert governor.probes == 1 and governor.switches == 0 and governor.current == 2
    run(governor, machine, 1000, rows=1)
    assert governor.probes > 1 and governor.switches == 0  # later probes compare 1 row with 1 row, and lose


def test_a_burst_of_slow_forwards_before_a_probe_does_not_move_the_forwards():
    """A few slow forwards (another process's burst) raise the level of every thread count's recent forwards and
    start a probe; the probe's forwards are paired with forwards of the other count run next to them, after the
    burst, so two threads, still faster, stay."""
    machine = FakeMachine({2: 0.010, 1: 0.012})
    governor = governed(machine, min_interval_s=1.0, max_interval_s=60.0)
    run(governor, machine, 3000)  # 30 s: probes now 8 s and more apart
    probes = governor.probes
    machine.seconds = {2: 0.030, 1: 0.036}  # a burst of three forwards
    run(governor, machine, 3)
    machine.seconds = {2: 0.010, 1: 0.012}
    counts = run(governor, machine, 20)
    assert governor.probes == probes + 1  # the burst probed one thread at once
    assert governor.current == 2 and governor.switches == 0 and counts[-1] == 2


def test_probe_forwards_alternate_between_the_counts():
    machine = FakeMachine({2: 0.010, 1: 0.017})
    governor = governed(machine, min_interval_s=1.0, probe_forwards=4)
    run(governor, machine, 100)  # 1 s: the probe starts on the next forward
    machine.calls.clear()
    assert run(governor, machine, 9) == [1, 2, 1, 2, 1, 2, 1, 2, 2]  # four pairs, lost: back on two threads
    assert governor.probes == 1 and governor.switches == 0


def test_a_regular_mix_of_row_counts_still_pairs_every_bucket():
    """Forwards of 1 and 4 rows in turn (two sessions, one verifying chains): a probe that took turns forward by
    forward would run every 1-row forward on one count and every 4-row forward on the other, and never compare
    them; pairs by bucket do, and a busy core still moves the forwards to one thread."""
    machine = FakeMachine({2: 0.150, 1: 0.016})  # one core taken
    governor = governed(machine, min_interval_s=1.0, probe_forwards=4)
    for i in range(7):  # 1.05 s on two threads: the probe is due
        governor.run(machine.forward, 1 + 3 * (i % 2))
    assert governor.probes == 0
    counts = [governor.run(machine.forward, 1 + 3 * (i % 2)) for i in range(8)]
    assert counts == [1, 1, 2, 2, 1, 1, 2, 2]  # each bucket: its probed forward, then its current one
    assert governor.current == 1 and governor.switches == 1


def test_one_thread_or_disabled_never_changes_the_count():
    machine = FakeMachine({2: 0.150, 1: 0.016})
    for governor in (ThreadGovernor(1, machine.set_threads, clock=lambda: machine.now), governed(machine)):
        if governor.threads == 2:
            governor.enabled = False
        run(governor, machine, 500)
        assert governor.probes == 0 and machine.calls == []


@pytest.fixture(scope="module")
def fast_model(smollm2_path):
    return inference_model(load_checkpoint(smollm2_path, progress=False, precision="fast"), "fast")


def test_fast_rows_on_one_thread_equal_ar_steps_on_two(fast_model):
    """Lossless under the governor: AR steps on two threads, the same tokens verified as 4-row chains on one thread
    (and the other way round): bitwise the same logits rows."""
    before = torch.get_num_threads()
    try:
        assert same_outputs_on_one_thread(fast_model, 2)
        prompt = random_tokens(120, seed=5)
        for ar_threads, verify_threads in ((2, 1), (1, 2)):
            torch.set_num_threads(ar_threads)
            tokens, rows = ar_steps(fast_model, prompt, 12)
            torch.set_num_threads(verify_threads)
            cache = fast_model.new_cache()
            prefill(fast_model, cache, prompt)
            for lo in range(0, 12, 4):
                out, _ = verify_tree(fast_model, cache, tokens[lo : lo + 4], [-1, 0, 1, 2])
                commit_path(cache, [0, 1, 2, 3])
                assert all(torch.equal(out[j], rows[lo + j]) for j in range(4)), (ar_threads, lo)
    finally:
        torch.set_num_threads(before)
