"""docs/ARCHITECTURE.md traces one speculative step through files, classes and functions by name: every name it
gives must exist in the code, so that the trace cannot drift from it unnoticed. Checked from the source (ast), not by
importing it."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("client", "speculation", "serving", "target_service", "draft_service", "runtime", "protos", "tests",
            "docs")

PATH = re.compile(r"`((?:[\w-]+/)*[\w-]+\.(?:py|cpp|proto))(?::([\w.]+))?")  # `dir/file.py` or `file.py:Name.attr`
DOTTED = re.compile(r"`([A-Z]\w*)\.(\w+)`")  # `Class.method` on its own


@cache
def sources() -> dict[str, Path]:
    """Every project source by its path from the root."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*"):
            if path.suffix in (".py", ".cpp", ".proto") and "_pb2" not in path.name:
                found[str(path.relative_to(ROOT))] = path
    return found


def resolve(name: str) -> list[Path]:
    """A path from the root, or a file's path by its last parts (`step_engine.py`, `kernels/quant.py`)."""
    if name in sources():
        return [sources()[name]]
    return [p for rel, p in sources().items() if rel.endswith("/" + name)]


@cache
def definitions(path: Path) -> dict[str, tuple[set[str], list[str]]]:
    """Top-level names of a Python file -> (the names defined in it: a class's methods, class attributes and the
    attributes its methods assign to self; its bases' names)."""
    tree = ast.parse(path.read_text())
    names: dict[str, tuple[set[str], list[str]]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            defs = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
            members = {n.name for n in node.body if isinstance(n, defs)}
            members |= {t.id for n in node.body if isinstance(n, ast.AnnAssign | ast.Assign)
                        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
            members |= {t.attr for n in ast.walk(node) if isinstance(n, ast.Assign | ast.AnnAssign)
                        for target in (n.targets if isinstance(n, ast.Assign) else [n.target])
                        for t in ast.walk(target) if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                        and t.value.id == "self"}
            names[node.name] = (members, [b.id for b in node.bases if isinstance(b, ast.Name)])
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names[node.name] = (set(), [])
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(t, ast.Name):
                    names[t.id] = (set(), [])
    return names


def has_member(cls: str, member: str, seen: frozenset[str] = frozenset()) -> bool:
    """The class (found by name in the project, the first of that name that has it) or one of its bases defines it."""
    for path in classes().get(cls, []):
        members, bases = definitions(path)[cls]
        if member in members or any(has_member(b, member, seen | {cls}) for b in bases if b not in seen):
            return True
    return False


def defines(path: Path, dotted: str) -> bool:
    if path.suffix != ".py":
        return dotted in path.read_text()
    head, *rest = dotted.split(".")
    return head in definitions(path) and (not rest or has_member(head, rest[0]))


@cache
def classes() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in sources().values():
        if path.suffix == ".py":
            for name in definitions(path):
                found.setdefault(name, []).append(path)
    return found


def test_every_file_and_name_the_architecture_names_exists():
    text = DOC.read_text()
    missing = []
    for name, attr in PATH.findall(text):
        paths = resolve(name)
        if not paths:
            missing.append(name)
        elif attr and not any(defines(p, attr) for p in paths):
            missing.append(f"{name}:{attr}")
    for cls, member in DOTTED.findall(text):
        if cls in classes() and not has_member(cls, member):
            missing.append(f"{cls}.{member}")
    assert not missing, f"docs/ARCHITECTURE.md names what the code does not have: {sorted(set(missing))}"


def test_the_check_catches_a_name_that_is_gone():
    assert resolve("target_service/step_engine.py") and not resolve("target_service/no_such_file.py")
    step_engine = resolve("step_engine.py")[0]
    assert defines(step_engine, "StepEngine._run_step") and not defines(step_engine, "StepEngine._no_such_step")
    assert defines(resolve("draft_rounds.py")[0], "RoundSettlement")
