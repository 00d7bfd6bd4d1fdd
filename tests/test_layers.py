"""Layers point one way, read from every import statement in the tree (module level and inside functions):

    protos, dspark_grpc.cli_common  <-  speculation (torch-free: generation loop, cost model, planner, channels, errors)
    speculation  <-  runtime (model math)  <-  serving (batcher, sessions, codec, gRPC skeleton, profilers)
        <-  target_service, draft_service
    speculation  <-  client (the SDK: torch-free)

No service imports the other or the SDK; the SDK imports neither a service, nor runtime, nor torch; nothing below
the SDK imports it.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("protos", "dspark_grpc", "speculation", "runtime", "serving", "client", "target_service", "draft_service")
ALLOWED = {  # folder -> what it may import of ours (itself always)
    "protos": set(),
    "dspark_grpc": set(),
    "speculation": {"protos", "cli_common"},
    "client": {"protos", "cli_common", "speculation"},
    "runtime": {"speculation"},  # model math: no protos, no serving
    "serving": {"protos", "cli_common", "speculation", "runtime"},
    "target_service": {"protos", "cli_common", "speculation", "runtime", "serving"},
    "draft_service": {"protos", "cli_common", "speculation", "runtime", "serving"},
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
