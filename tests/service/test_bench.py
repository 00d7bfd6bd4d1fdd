"""`dspark bench` end to end (it starts its own target and random-drafter services), and its pieces."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from dspark_grpc.bench.prompts import load_prompts
from dspark_grpc.bench.served import bracketed, format_table, per_position_acceptance

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "docs" / "prompts" / "smoke.jsonl"
RESULT_KEYS = {"tokens_per_s", "acceptance_length", "per_position_acceptance", "outputs", "fallbacks", "wall_s"}


def dspark(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_grpc.client.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


TREE = "speculation/proposal=tree/proposer=ngram"


def test_parse_mode():
    from dspark_grpc.bench.served import parse_mode

    assert parse_mode("ar") == ("ar", {})
    assert parse_mode(TREE + "/budget=8") == ("speculation", {"proposal": "tree", "proposer": "ngram", "budget": 8})
    for bad in ("fast", "speculation/colour=red", "speculation/proposal="):
        with pytest.raises(ValueError):
            parse_mode(bad)


@pytest.mark.slow
def test_bench_ar_vs_speculation(tmp_path):
    out, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    args = ["bench", "--prompts", str(SMOKE), "--max-new-tokens", "8", "--modes", f"ar,speculation,{TREE}",
            "--concurrency", "1,2", "--repeat", "2", "--json", str(out), "--plot", str(plot),
            "--draft-timeout", "300",  # a busy CI machine must not make a drafter call fall back (asserted below)
            "--no-cost-profile"]
    run = dspark(*args, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(out.read_text())

    assert set(result) == {"command", "machine", "config", "results", "lossless"}
    assert result["command"][-len(args):] == args
    assert {"cpu_count", "python", "platform"} <= set(result["machine"])
    config = result["config"]
    assert config["modes"] == ["ar", "speculation", TREE] and config["concurrency"] == [1, 2]
    assert config["max_new_tokens"] == 8 and config["num_prompts"] == len(load_prompts(SMOKE)) == 3
    assert config["repeat"] == 2
    assert config["started_services"] == ["target", "draft"]

    results = result["results"]
    assert set(results) == {"ar", "speculation", TREE}
    for mode, by_c in results.items():
        assert set(by_c) == {"1", "2"}
        for c, entry in by_c.items():
            assert RESULT_KEYS <= set(entry), mode
            assert entry["tokens_per_s"] > 0 and entry["wall_s"] > 0 and entry["acceptance_length"] > 0
            assert len(entry["outputs"]) == 3 * (2 if c == "2" else 1)  # --repeat 2 at concurrency 2
            assert all(0 < len(ids) <= 8 and all(isinstance(t, int) for t in ids) for ids in entry["outputs"])
            assert all(0.0 <= r <= 1.0 for r in entry["per_position_acceptance"])
    for c in ("1", "2"):
        ar, spec = results["ar"][c], results["speculation"][c]
        assert spec["outputs"] == ar["outputs"]  # greedy speculation is lossless
        assert ar["per_position_acceptance"] == [] and ar["speculative_steps"] == 0
        assert spec["speculative_steps"] > 0 and spec["per_position_acceptance"]
        assert spec["fallbacks"] == []
        assert results[TREE][c]["outputs"] == ar["outputs"]
        # each of the two runs at concurrency 2 has its own rate; the entry's is their harmonic mean (equal tokens)
        for entry in (results[mode][c] for mode in results if c == "2"):
            runs = entry["runs_tokens_per_s"]
            assert len(runs) == 2 and min(runs) <= entry["tokens_per_s"] * (1 + 1e-9)
            assert entry["tokens_per_s"] <= max(runs) * (1 + 1e-9)
    assert results["ar"]["1"]["outputs"] * 2 == results["ar"]["2"]["outputs"]
    assert result["lossless"] == {"ar": True, "speculation": True, TREE: True}

    assert "speculation" in run.stdout and "vs AR" in run.stdout
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_refuses_a_bad_prompt_line(tmp_path):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"prompt": "fine"}\n\n{"messages": "not a list"}\n')
    run = dspark("bench", "--prompts", str(prompts), "--max-new-tokens", "4", "--json", str(tmp_path / "o.json"),
                 timeout=60)
    assert run.returncode == 2
    assert f"{prompts}:3:" in run.stderr and "messages" in run.stderr


@pytest.mark.parametrize(("line", "words"), [
    ("{not json", "Expecting property name"),
    ('["a list"]', "exactly one of"),
    ('{"prompt": "a", "messages": []}', "exactly one of"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"messages": [{"role": "user"}]}', '"messages" must be'),
])
def test_load_prompts_errors_name_the_line(tmp_path, line, words):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf":2: .*{words}"):
        load_prompts(path)


def test_load_prompts_keeps_prompts_and_messages(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "Once"}\n\n{"messages": [{"role": "user", "content": "Hi", "extra": 1}]}\n')
    assert load_prompts(path) == [{"prompt": "Once"}, {"messages": [{"role": "user", "content": "Hi"}]}]
    assert len(load_prompts(ROOT / "docs" / "prompts" / "heldout.jsonl")) >= 20


def test_per_position_acceptance_pools_the_per_depth_counts():
    # request a: 10 speculative steps, accepted 8 at depth 1, 4 at depth 2; b: 30 steps, 6 and 0; c: AR only
    a = SimpleNamespace(drafted_per_position=[10, 10], accepted_per_position=[8, 4])
    b = SimpleNamespace(drafted_per_position=[30, 20, 5], accepted_per_position=[6, 0, 0])
    c = SimpleNamespace(drafted_per_position=[], accepted_per_position=[])
    assert per_position_acceptance([a, b, c]) == pytest.approx([14 / 40, 4 / 30, 0.0])
    assert per_position_acceptance([c]) == []


def test_format_table_ratio_vs_ar():
    entry = {"tokens_per_s": 10.0, "acceptance_length": 1.0, "wall_s": 1.0}
    result = {"config": {"concurrency": [1]}, "lossless": {"ar": True, "speculation": False},
              "results": {"ar": {"1": entry}, "speculation": {"1": {**entry, "tokens_per_s": 25.0,
                                                                     "acceptance_length": 2.5}}}}
    rows = format_table(result).splitlines()
    assert rows[2].split() == ["speculation", "1", "25.0", "2.50", "2.50", "1.00", "NO"]


def test_humaneval_prompts_are_the_164_problems_as_completion_prompts():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164
    assert all(set(p) == {"prompt"} and "def " in p["prompt"] for p in prompts)
    # each ends inside the function, where the model continues with the body
    assert sum(p["prompt"].rstrip().endswith(('"""', "'''")) for p in prompts) >= 150


def test_format_table_has_a_reference_line_per_baseline():
    entry = {"tokens_per_s": 20.0, "acceptance_length": 1.0, "wall_s": 1.0}
    base = {"tokens_per_s": 50.0, "wall_s": 3.0, "outputs": [[1], [2]], "same_as_ar": 1, "generated_tokens": 2}
    result = {"config": {"concurrency": [1]}, "lossless": {"ar": True}, "results": {"ar": {"1": entry}},
              "baselines": {"llama-cpp": base}}
    assert format_table(result).splitlines()[-1].split() == ["llama-cpp", "(AR)", "1", "50.0", "2.50", "1.00",
                                                             "3.00", "1/2", "same"]


def test_a_baseline_run_before_and_after_the_modes_counts_as_one():
    before = {"tokens_per_s": 40.0, "generated_tokens": 8, "wall_s": 0.2, "outputs": [[1, 2]]}
    after = {"tokens_per_s": 80.0, "generated_tokens": 8, "wall_s": 0.1, "outputs": [[1, 2]], "threads": 2}
    both = bracketed(before, after)
    assert both["generated_tokens"] == 16 and both["wall_s"] == pytest.approx(0.3)
    assert both["tokens_per_s"] == pytest.approx(16 / 0.3)  # not the mean of 40 and 80: seconds weigh
    assert both["runs_tokens_per_s"] == [40.0, 80.0] and both["same_in_both_runs"] and both["threads"] == 2
    assert not bracketed(before, {**after, "outputs": [[1, 3]]})["same_in_both_runs"]


def test_bench_refuses_an_uninstalled_baseline_before_running(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is not None:
        pytest.skip("llama-cpp-python is installed here")
    run = dspark("bench", "--prompts", str(SMOKE), "--max-new-tokens", "4", "--json", str(tmp_path / "o.json"),
                 "--baseline", "llama-cpp", timeout=60)
    assert run.returncode == 2 and "make llama-cpp" in run.stderr
    assert not (tmp_path / "o.json").exists()


def test_the_llama_cpp_baseline_runs_on_this_cpu(tmp_path):
    """`make llama-cpp` builds llama.cpp for the CPU it runs on (native, without AMX, which a VM may trap): its AR on
    a tiny prompt, where it is installed."""
    import importlib.util

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed (make llama-cpp)")
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps([{"prompt": "Say hello."}]))
    run = subprocess.run([sys.executable, "-m", "dspark_grpc.bench.llama_cpp_baseline", "--prompts-json",
                          str(prompts), "--max-new-tokens", "4", "--ignore-eos"], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["generated_tokens"] == 4 and len(result["outputs"][0]) == 4


def test_a_baseline_killed_by_an_illegal_instruction_says_how_to_rebuild(monkeypatch, tmp_path):
    from dspark_grpc.bench import served as bench

    dies = tmp_path / "dies.sh"
    dies.write_text("#!/bin/sh\nkill -ILL $$\n")
    dies.chmod(0o755)
    monkeypatch.setattr(bench.sys, "executable", str(dies))
    with pytest.raises(RuntimeError, match="illegal instruction.*make llama-cpp"):
        bench.BASELINES["llama-cpp"]([{"prompt": "hi"}], 4, True, None)


def _bench_result(concurrency: list[int], block: int = 4) -> dict:
    def entry(tps: float, ppa: list[float]) -> dict:
        return {"tokens_per_s": tps, "per_position_acceptance": ppa}

    results = {"ar": {str(c): entry(10.0 * c, []) for c in concurrency},
               "speculation": {str(c): entry(14.4 * c, [0.3, 0.1, 0.05, 0.02, 0.3, 0.3]) for c in concurrency}}
    config = {"concurrency": concurrency, "max_new_tokens": 64, "num_prompts": 2,
              "drafter_info": {"block_size": block}}
    return {"results": results, "config": config, "baselines": {"llama-cpp": {"tokens_per_s": 40.0}}}


def test_plot_of_one_concurrency_is_labelled_bars_and_explains_the_hybrid_jump(tmp_path):
    from dspark_grpc.bench.plot import plot_bench

    fig = plot_bench(_bench_result([1]), tmp_path / "one.png")
    speed, accept = fig.axes[:2]
    assert len(speed.patches) == 3 and not speed.lines  # ar, speculation, the llama.cpp reference: bars
    labels = [t.get_text() for t in speed.texts]
    assert labels == [" 10.0 tok/s, 1.00x AR", " 14.4 tok/s, 1.44x AR", " 40.0 tok/s, 4.00x AR"]
    assert [t.get_text() for t in speed.get_yticklabels()] == ["ar", "speculation", "llama-cpp AR (reference)"]
    assert any("past the DSpark block (4)" in t.get_text() for t in accept.texts)
    assert accept.get_legend() is not None and (tmp_path / "one.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_of_several_concurrencies_is_lines_with_ratios():
    from dspark_grpc.bench.plot import plot_bench

    fig = plot_bench(_bench_result([1, 4], block=8), "/dev/null")
    speed, accept = fig.axes[:2]
    assert [line.get_label() for line in speed.lines] == ["ar", "speculation", "llama-cpp AR (reference)"]
    assert [t.get_text() for t in speed.texts] == ["1.44x", "1.44x"]
    assert not accept.texts  # no position past this drafter's block


def test_lossless_compares_repeated_runs_prompt_by_prompt():
    from dspark_grpc.bench.served import _lossless

    one, twice = {"outputs": [[1, 2], [3]]}, {"outputs": [[1, 2], [3], [1, 2], [3]]}
    other = {"outputs": [[1, 2], [3], [1, 2], [4]]}
    results = {"ar": {"1": one, "4": twice}, "adaptive": {"1": one, "4": twice}, "speculation": {"1": one, "4": other}}
    assert _lossless(results, [1, 4]) == {"ar": True, "adaptive": True, "speculation": False}
    results["ar"]["4"] = other
    assert _lossless(results, [1, 4])["ar"] is False


def test_plot_shows_each_repeated_runs_spread_as_a_bar():
    from dspark_grpc.bench.plot import plot_bench

    result = _bench_result([1, 4])
    result["results"]["ar"]["4"]["runs_tokens_per_s"] = [30.0, 50.0]  # two runs at C = 4; C = 1 ran once
    fig = plot_bench(result, "/dev/null")
    speed = fig.axes[0]
    segments = [seg for coll in speed.collections for seg in coll.get_segments()]
    assert [[tuple(p) for p in seg] for seg in segments] == [[(4.0, 30.0), (4.0, 50.0)]]
    assert speed.get_title().endswith("bars: each run")
