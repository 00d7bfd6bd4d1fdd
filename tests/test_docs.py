"""The docs as a reference: a README that says what this is before its Quick start, docs/bench/ pruned to what the
docs link, every relative link live, the README's secrets ignored by git, and bench plots that name the machine and
commit they were measured on with ratio labels that do not overlap. Fast, no model."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]
BENCH = ROOT / "docs" / "bench"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(path: Path) -> str:
    """The Markdown without its fenced code blocks (a link there is text)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def _links(path: Path) -> list[tuple[Path, str]]:
    """Each relative link of a doc: the file it points at (resolved) and its anchor ('' if none)."""
    out = []
    for target in LINK.findall(_prose(path)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        out.append(((path.parent / file).resolve() if file else path.resolve(), anchor))
    return out


def _slugs(path: Path) -> set[str]:
    """GitHub's anchors of a doc's headings: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+\s+(.*?)\s*$", _prose(path), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def _ignored(path: str) -> bool:
    git = shutil.which("git")
    if git:
        out = subprocess.run([git, "-C", str(ROOT), "check-ignore", "-q", "--no-index", path], capture_output=True)
        if out.returncode in (0, 1):
            return out.returncode == 0
    # no git or no checkout (an sdist): the top directory's own line in .gitignore
    lines = {line.strip() for line in (ROOT / ".gitignore").read_text().splitlines()}
    return f"{path.split('/')[0]}/" in lines


def test_the_readme_says_what_and_why_in_at_most_150_words_before_the_quick_start():
    head, quick, _ = README.read_text().partition("## Quick start")
    assert quick, "the README has a '## Quick start'"
    assert len(head.split()) <= 150, f"{len(head.split())} words before the Quick start"
    assert "the issues" not in head  # a user cannot see them


def test_the_readme_installs_from_a_checkout_not_from_pypi():
    text = README.read_text()
    assert not re.search(r"pip install\s+['\"]?dspark-grpc", text)  # not published on PyPI
    assert "pip install ." in text and "'.[server]'" in text


def test_every_relative_link_of_the_docs_resolves_and_its_anchor_exists():
    for doc in DOCS:
        for file, anchor in _links(doc):
            assert file.exists(), f"{doc.name} links {file.relative_to(ROOT)}, which does not exist"
            if anchor and file.suffix == ".md":
                assert anchor in _slugs(file), f"{doc.name} links {file.name}#{anchor}: no such heading"


def test_docs_bench_holds_only_what_the_docs_link_and_at_most_5_mb():
    files = [p for p in BENCH.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert sum(p.stat().st_size for p in files) <= 5 * 2**20
    linked = {file for doc in DOCS for file, _ in _links(doc)}
    named = "".join(doc.read_text() for doc in DOCS)
    for p in files:
        if p.suffix in (".png", ".json"):  # plots and results: linked, so a reader can open them
            assert p.resolve() in linked, f"{p.relative_to(ROOT)} is linked from no doc (git history keeps it)"
        else:  # measurement scripts: their command is in a doc
            assert str(p.relative_to(ROOT)) in named, f"{p.relative_to(ROOT)} is named in no doc"


def test_every_bench_result_kept_names_its_machine_and_commit():
    for p in BENCH.rglob("*.json"):
        result = json.loads(p.read_text())
        assert result["machine"].get("cpu_vector") in ("avx512", "avx2", "other"), p.name
        assert result["config"].get("commit"), p.name
        assert p.with_suffix(".png").exists(), p.name  # and its plot, which prints both


def test_the_readmes_certificate_recipe_writes_only_into_an_ignored_directory():
    [recipe] = [b for b in re.findall(r"```sh\n(.*?)```", README.read_text(), flags=re.S) if "openssl" in b]
    [directory] = re.findall(r"mkdir -p (\S+) && cd \1\b", recipe)
    written = re.findall(r"-(?:keyout|out) (\S+)|> (\S+)", recipe)
    keys = [a or b for a, b in written]
    assert any(k.endswith(".key") for k in keys)
    for name in keys:
        assert _ignored(f"{directory}/{name}"), f"{directory}/{name} (written by the README's recipe) is not ignored"
    assert _ignored("secrets/")


def _result(concurrency: list[int], **machine) -> dict:
    def entry(tps: float) -> dict:
        return {"tokens_per_s": tps, "per_position_acceptance": [0.4, 0.2]}

    # speculation, adaptive and a tree mode within 2 % of AR at every concurrency: their labels would sit on top
    # of each other
    results = {mode: {str(c): entry(100.0 * c * f) for c in concurrency}
               for mode, f in [("ar", 1.0), ("speculation", 0.99), ("adaptive", 1.01), ("tree", 0.98)]}
    config = {"concurrency": concurrency, "max_new_tokens": 64, "num_prompts": 20,
              "target_info": {"model_name": "SmolLM2-135M-Instruct (Q4_1 GGUF)"}}
    if "commit" in machine:
        config["commit"] = machine.pop("commit")
    return {"machine": machine, "config": config, "results": results}


def test_a_bench_plot_names_its_machine_and_commit_and_its_ratio_labels_do_not_overlap(tmp_path):
    pytest.importorskip("matplotlib")
    from dspark_grpc.bench.plot import plot_bench
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    result = _result([1, 2, 4, 8, 16], cpu_count=2, cpu_model="AMD EPYC 9B14", cpu_vector="avx2", commit="abc1234")
    fig = plot_bench(result, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    title = fig.get_suptitle()
    for part in ("SmolLM2-135M-Instruct", "AMD EPYC 9B14", "AVX2, no AVX-512", "2 CPUs", "commit abc1234"):
        assert part in title

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    speed = fig.axes[0]
    labels = [t for t in speed.texts if t.get_text().endswith("x")]
    assert len(labels) == 3 * 5  # every non-AR mode at every concurrency
    boxes = [Text.get_window_extent(t, renderer) for t in labels]  # the text's own box, not its leader line
    area = speed.get_window_extent(renderer)
    for i, box in enumerate(boxes):
        assert area.x0 <= box.x0 and box.x1 <= area.x1 and area.y0 <= box.y0 and box.y1 <= area.y1, labels[i]
        for j in range(i):
            assert not box.overlaps(boxes[j]), (labels[i].get_text(), labels[j].get_text())


def test_a_bench_plot_says_what_it_does_not_know():
    pytest.importorskip("matplotlib")
    from dspark_grpc.bench.plot import bench_figure

    title = bench_figure(_result([1])).get_suptitle()
    assert "CPU model not recorded" in title and "commit not recorded" in title


def test_the_bench_records_the_commit_of_the_checkout_it_runs_from():
    from dspark_grpc.bench.machine import git_commit

    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert re.fullmatch(re.escape(head) + r"(-dirty)?", git_commit())
