"""docs/PERFORMANCE.md's current figures against their files, and the tables `make figures` writes.

The current figures: each block between the page's `<!-- figures:NAME begin/end -->` markers is docs/bench/figures.py's
output for that section, with its data files (which exist), its commands, the shipped drafter (its files' sha256 as
recorded when the figures ran) and a full run (not QUICK=1). Reads files only: no model, no bench, nothing timed.
Until the first full run the blocks hold a placeholder and those checks are skipped (saying so).

The tables: figures.py's table, phase and Markdown functions on hand-written bench results, against hand-computed
values."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PERFORMANCE = ROOT / "docs" / "PERFORMANCE.md"
FIGURES_DIR = ROOT / "docs" / "figures"
_spec = importlib.util.spec_from_file_location("docs_bench_figures", ROOT / "docs" / "bench" / "figures.py")
figures = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = figures  # dataclasses look their module up there
_spec.loader.exec_module(figures)
BLOCK = re.compile(r"<!-- figures:(\w+) begin -->\n(.*?)\n<!-- figures:\1 end -->", re.S)


def _blocks() -> dict[str, str]:
    return dict(BLOCK.findall(PERFORMANCE.read_text()))


def _generated(body: str) -> bool:
    return not body.startswith("_Not generated yet")


def _section_or_skip(section: str) -> tuple[str, dict]:
    body = _blocks()[section]
    if not _generated(body):
        pytest.skip(f"docs/PERFORMANCE.md's {section} figures are not generated yet: run `make figures`")
    path = FIGURES_DIR / f"{section}.json"
    assert path.exists(), f"docs/PERFORMANCE.md shows the {section} figures, but docs/figures/{path.name} is missing"
    return body, json.loads(path.read_text())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- the current figures ---------------------------------------------------------------------------------------------

def test_the_current_figures_have_a_block_per_section_and_come_from_one_full_run():
    blocks = _blocks()
    assert list(blocks) == ["run", *figures.SECTIONS]
    generated = {name for name, body in blocks.items() if _generated(body)}
    if not generated:
        pytest.skip("docs/PERFORMANCE.md's current figures are not generated yet: run `make figures`")
    assert generated == set(blocks), f"only {sorted(generated)} generated: one full run writes every block"
    records = [json.loads((FIGURES_DIR / f"{s}.json").read_text()) for s in figures.SECTIONS]
    assert len({r["commit"] for r in records}) == 1, "the sections were measured at different commits"
    assert f"Commit `{records[0]['commit']}`" in blocks["run"]


@pytest.mark.parametrize("section", figures.SECTIONS)
def test_a_current_table_has_its_data_files_and_commands(section):
    body, record = _section_or_skip(section)
    assert record["section"] == section
    assert not record["quick"], "a QUICK=1 run's figures are no current figures"
    linked = set(re.findall(r"\]\(figures/([^)\s#]+)\)", body))
    assert f"{section}.json" in linked
    commands = "\n".join(re.findall(r"```bash\n(.*?)```", body, flags=re.S))
    assert record["runs"], f"{section}: no command recorded"
    for run in record["runs"]:
        assert run["command"].strip(), f"{section}: a run without its command"
        assert run["command"] in commands, f"{section}: the page does not show `{run['command']}`"
        assert run["data"] in linked, f"{section}: the page does not link {run['data']}"
        assert (FIGURES_DIR / run["data"]).exists(), f"{section}: {run['data']} is missing"
    tables = [t for t in record["tables"] if t["rows"]]
    assert tables, f"{section}: an empty table"
    index = (FIGURES_DIR / "README.md").read_text()
    for table in tables:  # the page's table is the record's, and so is the index's
        assert figures.markdown_table(table) in body, f"{section}: the page's table is not {section}.json's"
        assert figures.markdown_table(table) in index, f"{section}: docs/figures/README.md's table is not the same"
    if record.get("plot"):
        assert (FIGURES_DIR / record["plot"]).exists() and record["plot"] in linked


@pytest.mark.parametrize("section", figures.SECTIONS)
def test_a_current_table_was_measured_with_the_shipped_drafter(section):
    _, record = _section_or_skip(section)
    from dspark_grpc.draft_service.engine import EMBEDDED_DRAFTER

    shipped = Path(EMBEDDED_DRAFTER).resolve()
    drafter = record["drafter"]
    assert drafter["path"] == str(shipped.relative_to(ROOT)), f"{section} names the drafter {drafter['path']}"
    for name in ("model.safetensors", "config.json"):
        assert drafter["sha256"][name] == _sha256(shipped / name), \
            f"{section} was measured with another {name} than the shipped one: run `make figures` again"
    for run in record["runs"]:  # and the benches drafted with the draft service's default (the shipped drafter)
        if run["data"].endswith(".bench.json"):
            config = json.loads((FIGURES_DIR / run["data"]).read_text())["config"]
            assert config.get("drafter_checkpoint") in (None, "embedded"), run["data"]


def test_the_readme_status_table_links_the_current_figures():
    readme = (ROOT / "README.md").read_text()
    status = readme.split("## Status", 1)[1].split("\n## ", 1)[0]
    anchors = re.findall(r"\(docs/PERFORMANCE\.md#([\w-]+)\)", status)
    current = {re.sub(r"[^\w\- ]", "", t.lower()).replace(" ", "-") for t in figures.TITLES.values()}
    assert anchors and set(anchors) <= current | {"current-figures", "the-shipped-drafter"}
    table = "\n".join(line for line in status.splitlines() if line.startswith("|"))
    assert not re.search(r"\d(\.\d+)?x\b|tok/s|\d ms\b", table), "the status table carries figures of its own"


# --- the tables, from hand-written bench results ---------------------------------------------------------------------

def _entry(tps: float, acceptance: float, **more) -> dict:
    base = {"tokens_per_s": tps, "acceptance_length": acceptance, "wall_s": 2.0, "prefill_s": 0.2, "steps": 90,
            "speculative_steps": 0, "draft_s": 0.0, "draft_round_s": 0.0, "draft_service_s": 0.0,
            "draft_compute_s": 0.0, "draft_rounds": 0, "verify_s": 0.9, "forward_sessions": 1.0}
    return {**base, **more}


def _c1_result() -> dict:
    return {
        "config": {"concurrency": [1], "prompts_file": "docs/prompts/heldout.jsonl", "num_prompts": 20,
                   "max_new_tokens": 128},
        "results": {
            # AR: (2.0 - 0.2) s / 180 steps = 10 ms a step, its verify 1.26 s / 180 = 7 ms (0.70 of the step)
            "ar": {"1": _entry(100.0, 1.0, steps=180, verify_s=1.26)},
            # 80 speculative steps of 90: wait 0.32 s -> 4 ms each; rounds 0.4 s -> 5 ms, of it the service 3 ms,
            # the proposals 2 ms; verify 0.9 s / 90 steps = 10 ms; 72 rounds / 80 = 0.90
            "speculation": {"1": _entry(125.0, 2.0, speculative_steps=80, draft_s=0.32, draft_round_s=0.4,
                                        draft_service_s=0.24, draft_compute_s=0.16, draft_rounds=72)},
            "adaptive": {"1": _entry(96.0, 1.0)},
        },
        "lossless": {"ar": True, "speculation": True, "adaptive": False},
        "baselines": {"llama-cpp": {"tokens_per_s": 80.0, "runs_tokens_per_s": [78.0, 82.0], "same_as_ar": 3,
                                    "outputs": [[1]] * 20}},
    }


def test_the_concurrency_1_table():
    table = figures.c1_table(_c1_result())
    assert table["columns"] == ["mode", "tok/s", "x our AR", "x llama.cpp AR", "tokens per target forward",
                                "output = AR's"]
    assert table["rows"] == [
        ["AR", "100.0", "1.00x", "1.25x", "1.00", "yes"],
        ["speculation, hybrid chain (the default proposer)", "125.0", "1.25x", "1.56x", "2.00", "yes"],
        ["adaptive (the SDK's default mode)", "96.0", "0.96x", "1.20x", "1.00", "**NO**"],
        ["llama.cpp AR, same GGUF (runs before / after: 78.0 / 82.0)", "80.0", "0.80x", "1.00x", "1.00",
         "3 of 20 prompts"],
    ]


def test_the_concurrency_1_table_without_llama_cpp():
    result = _c1_result()
    del result["baselines"]
    table = figures.c1_table(result)
    assert "x llama.cpp AR" not in table["columns"]
    assert table["rows"][1] == ["speculation, hybrid chain (the default proposer)", "125.0", "1.25x", "2.00", "yes"]


def test_the_round_phases_per_speculative_step_and_against_the_ar_step():
    table = figures.round_table({"held-out": _c1_result()})
    assert table["columns"][:5] == ["prompts", "mode", "tokens per target forward", "speculative steps",
                                    "rounds per speculative step"]
    assert table["rows"] == [  # adaptive took no speculative step: no row
        ["held-out", "AR (step 10.00 ms)", "1.00", "0 %", "-", "-", "-", "-", "-", "7.00 (0.70)"],
        ["held-out", "speculation, hybrid chain (the default proposer)", "2.00", "89 %", "0.90", "4.00 (0.40)",
         "5.00 (0.50)", "3.00 (0.30)", "2.00 (0.20)", "10.00 (1.00)"],
    ]


def test_the_concurrency_table():
    def at(c1: tuple, c4: tuple) -> dict:
        return {"1": _entry(c1[0], c1[1], forward_sessions=c1[2]), "4": _entry(c4[0], c4[1], forward_sessions=c4[2])}

    result = {"config": {"concurrency": [1, 4]}, "results": {
        "ar": at((100.0, 1.0, 1.0), (200.0, 1.0, 3.8)),
        "speculation": at((110.0, 1.8, 1.0), (150.0, 1.7, 3.5)),
        "adaptive": at((100.0, 1.2, 1.0), (190.0, 1.0, 3.9)),
    }}
    table = figures.concurrency_table(result)
    assert table["rows"] == [["1", "100.0", "110.0 (1.10x)", "100.0 (1.00x)", "1.80 / 1.20", "1.0 / 1.0 / 1.0"],
                             ["4", "200.0", "150.0 (0.75x)", "190.0 (0.95x)", "1.70 / 1.00", "3.8 / 3.5 / 3.9"]]


ENGINE_BENCH = """compiled step, verify rows vs AR steps: 0 of 285 rows differ (chains of 2, 3, 4 rows over 48 AR steps)
SmolLM2-135M-Instruct.Q4_1.gguf, 2 threads, 200 committed rows; ms per forward, median of 3 rounds x 5 repeats
| variant | clock | 1 rows | 4 rows | 8 rows |
|---|---|---|---|---|
| fast (torch.bfloat16, gguf-blocks) | wall | 8.0 | 10.0 | 16.0 |
| fast (torch.bfloat16, gguf-blocks) | CPU | 15.0 | 19.0 | 31.0 |
| fast, compile max | wall | 6.0 | 7.5 | 12.0 |
| fast, compile max | CPU | 11.0 | 14.0 | 23.0 |

| variant | aten calls per eager 1-row forward | top ops |
|---|---|---|
| fast (torch.bfloat16, gguf-blocks) | 1000 | mm 200 |
"""


def test_the_engine_bench_printout_and_its_table():
    parsed = figures.parse_engine_bench(ENGINE_BENCH)
    assert parsed["rows"] == [1, 4, 8]
    assert parsed["invariance"].startswith("0 of 285 rows differ")
    assert parsed["header"].startswith("SmolLM2-135M-Instruct.Q4_1.gguf, 2 threads")
    assert [(v["variant"], v["clock"]) for v in parsed["variants"]] == [
        ("fast (torch.bfloat16, gguf-blocks)", "wall"), ("fast (torch.bfloat16, gguf-blocks)", "CPU"),
        ("fast, compile max", "wall"), ("fast, compile max", "CPU")]
    table = figures.rows_table(parsed)
    assert table["columns"][1:] == ["1 row", "4 rows", "8 rows"]
    assert table["rows"] == [["fast (torch.bfloat16, gguf-blocks)", "8.0 (1.00x)", "10.0 (1.25x)", "16.0 (2.00x)"],
                             ["fast, compile max", "6.0 (1.00x)", "7.5 (1.25x)", "12.0 (2.00x)"]]


def test_the_startup_plan_and_table():
    fresh = figures.startup_plan(True)
    assert [(s, c) for s, _, c in fresh] == [
        ("draft service", figures.FRESH), ("target service", figures.FRESH),
        ("draft service", figures.WARM), ("target service", figures.WARM)]
    assert [c for _, _, c in figures.startup_plan(False)] == [figures.SUITE_CACHES] * 2
    table = figures.startup_table([{"service": "draft service", "caches": "fresh", "seconds": 61.84},
                                   {"service": "target service", "caches": "fresh", "seconds": None,
                                    "note": "not measured"}])
    assert table["rows"] == [["draft service", "fresh", "61.8"], ["target service", "fresh", "not measured"]]


def test_the_host_names_the_cpu_and_its_flags():
    host = figures.cpu_host("processor\t: 0\nmodel name\t: Some CPU @ 2.0GHz\n"
                            "flags\t\t: fpu sse2 avx2 avx512f avx512_vnni amx_tile amx_int8\n")
    assert host["cpu_model"] == "Some CPU @ 2.0GHz"
    assert host["cpu_flags"] == {"avx2": True, "avx512f": True, "avx512_vnni": True, "avx512_bf16": False,
                                 "amx": True}
    assert host["amx_flags"] == ["amx_int8", "amx_tile"]
    assert figures.cpu_host("")["cpu_flags"] == dict.fromkeys(figures.CPU_FLAGS, False)


PROVENANCE = {"host": {"cpu_model": "Some CPU", "cpu_count": 2, "cpu_flags": {"avx2": True, "avx512f": False}},
              "commit": "abc1234", "date": "2026-12-06 10:00 UTC", "quick": False, "suite_command": "make figures",
              "drafter": {"name": "d", "path": "draft_service/drafters/d",
                          "sha256": {"model.safetensors": "0123456789abcdef" * 4,
                                     "config.json": "fedcba9876543210" * 4}}}


def test_a_section_names_host_commit_drafter_date_data_and_command():
    record = {**PROVENANCE, "section": "exact", "title": "The exact precision", "notes": ["Twenty prompts"],
              "tables": [{"caption": "", "columns": ["mode", "tok/s"], "rows": [["AR", "15.0"]]}],
              "runs": [{"command": ".venv/bin/dspark bench --prompts p", "data": "exact.bench.json"}],
              "plot": "exact.png"}
    md = figures.section_markdown(record, "figures/")
    assert md.startswith("Twenty prompts.\n\n| mode | tok/s |\n|---|---|\n| AR | 15.0 |\n\n")
    assert ("Host: Some CPU, 2 CPUs (avx2 yes, avx512f no, avx512_vnni no, avx512_bf16 no, amx no). Commit "
            "`abc1234`. Drafter `draft_service/drafters/d`, sha256 model.safetensors `0123456789abcdef`, config.json "
            "`fedcba9876543210`. Date: 2026-12-06 10:00 UTC.") in md
    assert "Data: [exact.json](figures/exact.json), [exact.bench.json](figures/exact.bench.json)." in md
    assert "```bash\n.venv/bin/dspark bench --prompts p\n```" in md
    assert md.endswith("![The exact precision](figures/exact.png)")
    assert "Quick run" in figures.provenance_line({**PROVENANCE, "quick": True})


def test_the_blocks_between_markers_are_replaced_and_the_rest_kept():
    text = ("# Page\n\n<!-- figures:a begin -->\nold a\n<!-- figures:a end -->\n\nkept\n\n"
            "<!-- figures:b begin -->\nold b\n<!-- figures:b end -->\n")
    assert figures.replace_blocks(text, {"a": "new a\n", "b": "new b"}) == (
        "# Page\n\n<!-- figures:a begin -->\nnew a\n<!-- figures:a end -->\n\nkept\n\n"
        "<!-- figures:b begin -->\nnew b\n<!-- figures:b end -->\n")
    with pytest.raises(ValueError, match="figures:c"):
        figures.replace_blocks(text, {"c": "x"})


def test_an_engine_bench_printout_without_its_table_says_so():
    with pytest.raises(ValueError, match=re.escape("no '| variant | clock |' table")):
        figures.parse_engine_bench("Traceback (most recent call last):\n")
