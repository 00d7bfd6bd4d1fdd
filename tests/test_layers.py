"""Layers point one way, read from every import statement in the tree (module level and inside functions):

    protos, dspark_grpc.cli_common  <-  speculation (torch-free: generation loop, cost model, planner, channels, errors)
    speculation  <-  runtime (model math)  <-  serving (batcher, sessions, codec, gRPC skeleton, profilers)
        <-  target_service, draft_service
    speculation  <-  client (the SDK: torch-free)
    client, serving, target_service  <-  bench (the measuring tools on top: `dspark bench`, the engine bench, other
        engines' baselines; the `dspark` entry point runs `dspark bench` by name, so the SDK never imports it)
    runtime, client, bench  <-  train (the drafter's trainer: a tool on top, which records its runs as the bench does)

No service imports the other or the SDK; the SDK imports neither a service, nor runtime, nor torch; nothing below
the SDK imports it. And no module imports itself through others (no import cycle, imports inside functions
included: a cycle hidden in a function is still a cycle of design).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("protos", "dspark_grpc", "speculation", "runtime", "serving", "client", "target_service", "draft_service",
           "bench", "train")
ALLOWED = {  # folder -> what it may import of ours (itself always)
    "protos": set(),
    "dspark_grpc": set(),
    "speculation": {"protos", "cli_common"},
    "client": {"protos", "cli_common", "speculation"},
    "runtime": {"speculation"},  # model math: no protos, no serving
    "serving": {"protos", "cli_common", "speculation", "runtime"},
    "target_service": {"protos", "cli_common", "speculation", "runtime", "serving"},
    "draft_service": {"protos", "cli_common", "speculation", "runtime", "serving"},
    # the measuring tools: `dspark bench` over the SDK, the engine bench over serving, baselines over the target's
    # prompt encoding
    "bench": {"protos", "cli_common", "speculation", "runtime", "serving", "client", "target_service"},
    "train": {"speculation", "runtime", "client", "bench"},  # a tool over the model math; the bench's machine record
}
NO_TORCH = ("protos", "dspark_grpc", "speculation", "client")
FOLDER_OF = {"cli_common": "dspark_grpc"}


def imports(folder: str) -> list[tuple[str, str]]:
    """(file, imported top-level name of ours or 'torch') for every import under `folder`."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        if "_pb2" in path.name:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "dspark_grpc" and len(parts) > 1:
                    found.append((str(path.relative_to(ROOT)), parts[1]))
                elif parts[0] == "torch":
                    found.append((str(path.relative_to(ROOT)), "torch"))
    return found


@pytest.mark.parametrize("folder", FOLDERS)
def test_imports_point_one_way(folder):
    bad = []
    for file, name in imports(folder):
        if name == "torch":
            if folder in NO_TORCH:
                bad.append((file, name))
            continue
        if FOLDER_OF.get(name, name) == folder or name in ALLOWED[folder]:
            continue
        bad.append((file, name))
    assert not bad, f"{folder} imports what it must not: {bad}"


def test_every_package_folder_has_a_layer():
    folders = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert folders == set(FOLDERS), f"pyproject.toml's packages {sorted(folders)} != this test's layers {FOLDERS}"


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def type_checking_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (never executed)."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (module level or in a function; not TYPE_CHECKING-only)."""
    files = {module_of(p): p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if "_pb2" not in p.name}
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip, package = type_checking_only(tree), module.split(".")[: None if path.name == "__init__.py" else -1]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else node.module or ""
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                parts = name.removeprefix("dspark_grpc.").split(".")
                found = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in files),
                             None)
                if found is not None and found != module:
                    graph[module].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []
    graph = import_graph()
    assert "runtime.models.transformer" in graph["runtime.kernels.compiled_step"]
    assert "runtime.kernels.markov_triton" in graph["runtime.drafting.markov"]  # an import inside a function counts


def test_no_import_cycles():
    assert not cycles(import_graph()), "modules that import each other (through others)"
