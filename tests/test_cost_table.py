"""The cost model: tables monotone by construction, interpolation/extrapolation, JSON, the disk cache, and the
target profiler on a tiny random model (the drafter's: tests/service/test_draft_batching.py)."""

from __future__ import annotations

import json

import pytest
from dspark_grpc.protos.dspark.v1 import common_pb2
from dspark_grpc.serving.cost_profile import profile_target, target_cost_tables, target_key, time_sizes
from dspark_grpc.speculation.cost_table import (
    CostKey,
    CostTable,
    VerifyCosts,
    lanes_problem,
    load_or_profile,
    spot_check_problem,
)

KEY = CostKey(kind="verify", model="m" * 64, dtype="float32", threads=2, device="cpu test", context=128)


def _nondecreasing(values: list[float]) -> bool:
    return all(a <= b for a, b in zip(values, values[1:], strict=False))


def test_noisy_medians_are_forced_monotone():
    t = CostTable(KEY, [1, 2, 4, 8, 16], [1.0, 0.9, 1.2, 1.1, 2.0])
    assert t.seconds == [1.0, 1.0, 1.2, 1.2, 2.0]
    assert t.measured == [1.0, 0.9, 1.2, 1.1, 2.0]
    assert _nondecreasing([t.predict(s / 4) for s in range(0, 200)])


@pytest.mark.parametrize("sizes, seconds", [([1, 2], [1.0]), ([2, 1], [1.0, 2.0]), ([0, 1], [1.0, 2.0]),
                                            ([1, 2], [1.0, float("nan")]), ([], [])])
def test_bad_tables_are_refused(sizes, seconds):
    with pytest.raises(ValueError):
        CostTable(KEY, sizes, seconds)


def test_interpolation_and_extrapolation():
    t = CostTable(KEY, [1, 2, 4, 8], [1.0, 2.0, 2.0, 4.0])
    assert t.predict(1) == 1.0 and t.predict(8) == 4.0
    assert t.predict(0.5) == 1.0  # flat below the first size
    assert t.predict(3) == pytest.approx(2.0)
    assert t.predict(6) == pytest.approx(3.0)
    assert t.predict(16) == pytest.approx(8.0)  # the last segment's slope: 0.5 s per row
    single = CostTable(KEY, [1], [0.25])
    assert single.predict(1) == single.predict(64) == 0.25


def test_json_round_trip(tmp_path):
    t = CostTable(KEY, [1, 2, 4], [1e-3, 0.9e-3, 2e-3], info={"repeats": 5})
    path = tmp_path / "t.json"
    t.save(path)
    back = CostTable.load(path)
    assert back == t
    assert back.predict(3) == t.predict(3)
    assert back.measured == [1e-3, 0.9e-3, 2e-3] and back.seconds == [1e-3, 1e-3, 2e-3]
    assert json.loads(path.read_text())["key"]["threads"] == 2 and back.info == {"repeats": 5}
    # a table cached by an earlier version, with its online correction, still loads
    old = {**t.to_dict(), "alpha": 0.2, "ratio_bounds": [0.25, 4.0], "corrections": {"2": [1.5, 3]}}
    assert CostTable.from_dict(old) == t


def test_cache_reloads_on_second_start_and_reprofiles_on_another_key(tmp_path):
    calls = []

    def profiler(key):
        def run():
            calls.append(key)
            return CostTable(key, [1, 2], [1.0, 2.0 + len(calls)])
        return run

    first = load_or_profile(tmp_path, KEY, profiler(KEY))
    second = load_or_profile(tmp_path, KEY, profiler(KEY))  # "second start": read from disk
    assert len(calls) == 1 and second == first
    other = CostKey(**{**KEY.__dict__, "threads": 4})
    third = load_or_profile(tmp_path, other, profiler(other))
    assert len(calls) == 2 and third.key == other and third.seconds != first.seconds
    assert load_or_profile(tmp_path, KEY, profiler(KEY)) == first and len(calls) == 2
    assert len(list(tmp_path.glob("*.json"))) == 2
    # a damaged file is profiled again and overwritten
    (tmp_path / KEY.file_name()).write_text("{not json")
    load_or_profile(tmp_path, KEY, profiler(KEY))
    assert len(calls) == 3
    assert load_or_profile(tmp_path, KEY, profiler(KEY)).key == KEY and len(calls) == 3
    # no directory: always profile
    load_or_profile(None, KEY, profiler(KEY))
    assert len(calls) == 4
    with pytest.raises(ValueError, match="not for"):
        load_or_profile(tmp_path / "x", KEY, profiler(other))


@pytest.fixture(scope="module")
def tiny_model():
    import torch
    from dspark_grpc.runtime.models.config import ModelConfig
    from dspark_grpc.runtime.models.transformer import Transformer

    torch.manual_seed(0)
    config = ModelConfig(architecture="llama", name="tiny", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6,
                         rope_theta=10000.0, rope_scaling=None, max_position_embeddings=512,
                         tie_word_embeddings=True)
    return Transformer(config).eval()


def test_profile_target_on_a_tiny_model(tiny_model, tmp_path):
    table = profile_target(tiny_model, sizes=(2, 4, 8), repeats=2, context=16)
    assert table.sizes == [1, 2, 4, 8]  # the AR step (size 1) is always measured
    assert _nondecreasing(table.seconds) and all(s > 0 for s in table.seconds)
    key = table.key
    assert key == target_key(tiny_model, context=16)
    assert key.kind == "verify" and key.lanes == 1 and key.dtype == "float32" and key.device.startswith("cpu")
    assert key.model == tiny_model.config.fingerprint()

    calls = []

    def profile():
        calls.append(1)
        return profile_target(tiny_model, sizes=(2,), repeats=1, context=16)

    loaded = [load_or_profile(tmp_path, key, profile) for _ in range(2)]
    assert len(calls) == 1 and loaded[0] == loaded[1]


def test_time_sizes_interleaves_sizes_after_a_warmup_round():
    sizes = []
    seconds, info = time_sizes(sizes.append, [1, 2, 4], repeats=3)
    assert len(seconds) == 3 and sizes == [1, 2, 4] * 4  # one warm-up round, then three timed rounds
    assert info["repeats"] == 3 and info["warmup"] == 1
    sizes.clear()
    _, quick = time_sizes(sizes.append, [1, 2], repeats=5, max_seconds=0.0)
    assert sizes == [1, 2] * 2 and quick["repeats"] == 1  # out of time: warm-up and one timed round
    with pytest.raises(ValueError, match="repeats"):
        time_sizes(sizes.append, [1], repeats=0)


def _lane_tables(per_lane: dict[int, list[float]], sizes=(1, 2)) -> list[CostTable]:
    return [CostTable(CostKey(**{**KEY.__dict__, "lanes": n}), list(sizes), secs) for n, secs in per_lane.items()]


def test_tables_cheaper_for_more_sessions_are_flagged():
    # the table, profiled while the machine was busy: 1 session 137 ms, 8 sessions 52 ms
    bad = _lane_tables({1: [0.137, 0.140], 2: [0.090, 0.095], 8: [0.052, 0.060]})
    assert "2 sessions x 1 rows cost 90.0 ms but 1 x 1 cost 137.0 ms" in lanes_problem(bad)
    assert lanes_problem(_lane_tables({1: [0.036, 0.037], 2: [0.035, 0.038], 8: [0.040, 0.045]})) is None  # noise


def test_spot_check_flags_a_table_far_from_a_fresh_measurement():
    table = _lane_tables({1: [0.137, 0.140]})[0]
    assert "measures 36.0 ms now, the table says 137.0 ms" in spot_check_problem(table, 0.036)
    assert spot_check_problem(table, 0.120) is None


def _cached_target_tables(tiny_model, cache, spot_seconds=None):
    said = []
    tables = target_cost_tables(tiny_model, cache, lanes=(1, 2), sizes=(1, 2), repeats=1, max_seconds=1.0,
                                progress=said.append, spot_check=None if spot_seconds is None else
                                (lambda: spot_seconds))
    return tables, said


def test_a_bad_cached_table_is_profiled_again_and_the_result_is_monotone_in_sessions(tiny_model, tmp_path):
    tables, said = _cached_target_tables(tiny_model, tmp_path)
    assert sum("profiling" in line for line in said) == 2
    # replace the cache with the kind of table: more sessions cheaper than one
    one, two = tables
    CostTable(one.key, one.sizes, [1.0, 1.1]).save(tmp_path / one.key.file_name())
    CostTable(two.key, two.sizes, [0.2, 0.3]).save(tmp_path / two.key.file_name())
    tables, said = _cached_target_tables(tiny_model, tmp_path, spot_seconds=1.0)
    assert "look wrong (2 sessions x 1 rows cost 200.0 ms but 1 x 1 cost 1000.0 ms)" in said[0]
    assert sum("profiling target forwards" in line for line in said) == 2
    assert lanes_problem(tables) is None and tables[0].seconds != [1.0, 1.1]  # measured, not the bad table
    assert CostTable.load(tmp_path / one.key.file_name()).seconds == tables[0].seconds  # overwritten


def test_a_cached_table_is_reused_while_a_spot_check_agrees_and_profiled_again_when_it_does_not(tiny_model,
                                                                                                tmp_path):
    first, _ = _cached_target_tables(tiny_model, tmp_path)
    monotone = [CostTable(t.key, t.sizes, [0.010 * t.key.lanes, 0.011 * t.key.lanes]) for t in first]
    for t in monotone:
        t.save(tmp_path / t.key.file_name())
    tables, said = _cached_target_tables(tiny_model, tmp_path, spot_seconds=0.0105)
    assert said == [] and [t.seconds for t in tables] == [t.seconds for t in monotone]
    tables, said = _cached_target_tables(tiny_model, tmp_path, spot_seconds=0.100)  # 10x slower than the table
    assert "look wrong (a 1-row forward of 1 session(s) measures 100.0 ms now, the table says 10.0 ms)" in said[0]
    assert lanes_problem(tables) is None


def test_fresh_tables_that_contradict_each_other_are_made_monotone_in_sessions():
    from dspark_grpc.serving.cost_profile import _monotone_in_lanes

    fixed = _monotone_in_lanes(_lane_tables({1: [0.137, 0.140], 2: [0.090, 0.095], 8: [0.052, 0.200]}))
    assert [t.seconds for t in fixed] == [[0.137, 0.140], [0.137, 0.140], [0.137, 0.200]]
    assert lanes_problem(fixed) is None


def test_verify_costs_interpolate_rows_and_lanes():
    tables = [common_pb2.CostTable(lanes=1, sizes=[1, 2, 4, 8, 16], seconds=[0.050, 0.070, 0.072, 0.075, 0.090]),
              common_pb2.CostTable(lanes=8, sizes=[1, 2, 4, 8, 16], seconds=[0.090, 0.110, 0.150, 0.220, 0.350])]
    costs = VerifyCosts(tables)
    assert costs.seconds(1, 1) == pytest.approx(0.050)
    assert costs.seconds(1, 3) == pytest.approx(0.071)
    assert costs.seconds(8, 4) == pytest.approx(0.150)
    assert costs.seconds(4.5, 1) == pytest.approx((0.050 + 0.090) / 2)  # halfway between the 1- and 8-lane tables
    assert not VerifyCosts([])
