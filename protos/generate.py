"""Regenerate the committed Python stubs from protos/dspark/v1/*.proto.

    python -m dspark_grpc.protos.generate          # rewrite the stubs
    python -m dspark_grpc.protos.generate --check  # exit 1 if they are stale

protoc writes imports as `from dspark.v1 import ...`; they are rewritten to the installed package
path `dspark_grpc.protos.dspark.v1` so no bare top-level `dspark` module is needed.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_DIR = PROTO_ROOT / "dspark" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_root: Path) -> dict[str, str]:
    """Run protoc into out_root; return {file name: rewritten source} for dspark/v1."""
    from grpc_tools import protoc  # dev dependency only

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_DIR.glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    sources = {}
    for path in sorted((out_root / "dspark" / "v1").iterdir()):
        if path.name.endswith(GENERATED_SUFFIXES):
            text = re.sub(r"^from dspark\.v1 import", "from dspark_grpc.protos.dspark.v1 import",
                          path.read_text(), flags=re.M)
            sources[path.name] = text
    return sources


def stale_files() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
    current = {p.name: p.read_text() for p in PROTO_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
    return sorted(name for name in fresh.keys() | current.keys() if fresh.get(name) != current.get(name))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report stale stubs")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        print("stale: " + ", ".join(stale) if stale else "stubs are current")
        sys.exit(1 if stale else 0)
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in generate(Path(tmp)).items():
            (PROTO_DIR / name).write_text(text)
            print(f"wrote protos/dspark/v1/{name}")


if __name__ == "__main__":
    main()
