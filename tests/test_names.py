"""The names of modes, proposers, proposal shapes and kernels are derived from the proto's enums in one module
(speculation/wire.py); every other module uses its constants, never the literal (a renamed enum value then changes
every use, and a typo is a NameError, not a silently unknown name)."""

from __future__ import annotations

import ast
from pathlib import Path

from dspark_grpc.speculation import wire

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("speculation", "runtime", "serving", "client", "target_service", "draft_service", "train")
HOME = Path("speculation/wire.py")
NAMES = {wire.AR, wire.SPECULATION, wire.ADAPTIVE, wire.DSPARK, wire.NGRAM, wire.HYBRID, wire.CHAIN, wire.TREE,
         wire.FUSED, wire.TORCH}
# The same spelling with another meaning, file by file.
OTHER_MEANINGS = {
    ("client/cli.py", "dspark"): "the program's name",
    ("target_service/http_front.py", "dspark"): "the HTTP API's extension key",
    ("speculation/metrics.py", "dspark"): "the metrics prefix",
    ("serving/service_metrics.py", "dspark"): "the metrics prefix",
    ("runtime/formats/drafter_config.py", "dspark"): "the drafter's slot convention and checkpoint kind",
    ("runtime/formats/drafter_formats.py", "dspark"): "the checkpoint kind (speculators' algorithm name)",
    ("runtime/models/drafter.py", "dspark"): "the drafter's slot convention",
    ("train/loop.py", "dspark"): "the drafter's slot convention",
    ("draft_service/servicer.py", "dspark"): "the drafter's slot convention on the wire",
    ("serving/openmp.py", "torch"): "the module's name",
    ("target_service/servicer.py", "tree"): "a proto field's name (HasField)",
    ("speculation/metrics.py", "chain"): "a metric label: the draft was the rest of the previous chain",
}


def name_literals() -> list[tuple[str, int, str]]:
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "_pb2" in path.name or rel == HOME:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES:
                    found.append((str(rel), node.lineno, node.value))
    return found


def test_the_names_are_the_protos():
    assert (wire.AR, wire.SPECULATION, wire.ADAPTIVE) == ("ar", "speculation", "adaptive")
    assert (wire.DSPARK, wire.NGRAM, wire.HYBRID) == ("dspark", "ngram", "hybrid")
    assert set(wire.MODES) == {"", wire.AR, wire.SPECULATION, wire.ADAPTIVE}
    assert set(wire.PROPOSERS) == {"", wire.DSPARK, wire.NGRAM, wire.HYBRID}
    assert set(wire.PROPOSALS) == {"", wire.CHAIN, wire.TREE} and set(wire.KERNELS) == {"", wire.FUSED, wire.TORCH}


def test_name_literals_live_in_one_module():
    stray = [(f, line, name) for f, line, name in name_literals() if (f, name) not in OTHER_MEANINGS]
    assert not stray, f"use speculation/wire.py's constants instead of these literals: {stray}"


def test_every_other_meaning_is_still_there():
    seen = {(f, name) for f, _, name in name_literals()}
    assert set(OTHER_MEANINGS) <= seen, f"exemptions no longer needed: {set(OTHER_MEANINGS) - seen}"
