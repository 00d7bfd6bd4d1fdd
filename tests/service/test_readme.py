"""The README's commands work as written from the repository root after the Quick start.

Every command line in a ```bash block is checked: its program exists, its tool's own parser accepts its flags, and
every repository file it reads exists. The cheap ones run for real: `--help` of every tool, `dspark health` and
`grpcurl ... list` against a live target (the README's address swapped for the test target's).
"""

from __future__ import annotations

import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
BIN = Path(sys.executable).parent
PARSERS = {  # program -> the module whose parser() it runs
    ".venv/bin/dspark": "dspark_grpc.client.cli",
    ".venv/bin/dspark-target": "dspark_grpc.target_service.cli",
    ".venv/bin/dspark-draft": "dspark_grpc.draft_service.cli",
    ".venv/bin/dspark-train": "dspark_grpc.train.cli",
    ".venv/bin/dspark-convert": "dspark_grpc.runtime.formats.drafter_formats",
}
README_TARGET = "127.0.0.1:50051"


def _load_protos() -> None:
    from dspark_grpc.protos.dspark.v1 import draft_pb2, target_pb2  # noqa: F401  (registers the services)


def readme_commands() -> list[list[str]]:
    """Each command of the README's bash blocks as argv (continuation lines joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S):
        pending = ""
        for line in block.replace("\\\n", " ").splitlines():
            pending += line + "\n"
            try:
                argv = shlex.split(pending, comments=True)
            except ValueError:  # a quoted string goes on on the next line, as in bash
                continue
            pending = ""
            if argv:
                commands.append(argv)
        assert not pending, f"unterminated quote in the README: {pending!r}"
    return commands


COMMANDS = readme_commands()
_load_protos()


def test_the_readme_has_the_quick_start_and_the_tools():
    programs = {argv[0] for argv in COMMANDS}
    assert ["make", "demo"] in COMMANDS and ["make", "test"] in COMMANDS
    assert set(PARSERS) | {".venv/bin/grpcurl"} <= programs | {".venv/bin/dspark-convert"}
    unknown = programs - set(PARSERS) - {"make", ".venv/bin/grpcurl"}
    assert not unknown, f"README runs programs this test does not know: {unknown}"


@pytest.mark.parametrize("argv", COMMANDS, ids=[" ".join(a)[:60] for a in COMMANDS])
def test_readme_command_is_accepted_as_written(argv):
    program = argv[0]
    if program == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M)
        assert argv[1] in targets
        return
    # after the Quick start every program lives in .venv/bin (the test runs from that venv)
    assert (BIN / Path(program).name).is_file(), f"{program} is not installed"
    for arg in argv[1:]:
        if re.fullmatch(r"(docs|tests|protos)/\S+", arg):
            assert (ROOT / arg).exists(), f"{' '.join(argv)}: {arg} does not exist"
    if program.endswith("grpcurl"):
        assert argv[1] == "-plaintext" and README_TARGET in argv
        if argv[-1] != "list":  # a method call: the method exists and the JSON body is a valid request of it
            from google.protobuf import json_format, message_factory
            from google.protobuf.descriptor_pool import Default

            method = Default().FindMethodByName(argv[-1].replace("/", "."))
            body = argv[argv.index("-d") + 1]
            json_format.Parse(body, message_factory.GetMessageClass(method.input_type)())
        return
    module = PARSERS[program]
    if program.endswith("/dspark") and argv[1:2] == ["bench"]:  # the bench package's program (cli_common.dspark_main)
        module, argv = "dspark_grpc.bench.cli", argv[1:]
    parser = importlib.import_module(module).parser()
    parser.parse_args(argv[1:])  # an unknown flag or a bad value exits (SystemExit fails the test)


@pytest.mark.parametrize("program", [".venv/bin/dspark", ".venv/bin/dspark-target"])  # torch-free, and a service
def test_installed_entry_points_print_their_help(program):
    out = subprocess.run([str(BIN / Path(program).name), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


def test_cheap_readme_commands_run_against_a_live_target(target_address):
    ran = 0
    for argv in COMMANDS:
        if any(a.startswith("--tls") for a in argv):
            continue  # the Security section's commands need its certificates (tests/reliability/test_security.py)
        if argv[0].endswith("grpcurl") and argv[-1] == "list" or argv[:2] == [".venv/bin/dspark", "health"]:
            live = [str(BIN / Path(argv[0]).name)] + [a.replace(README_TARGET, target_address) for a in argv[1:]]
            out = subprocess.run(live, capture_output=True, text=True, timeout=60, cwd=ROOT)
            assert out.returncode == 0, (argv, out.stderr)
            ran += 1
            if argv[0].endswith("grpcurl"):
                assert "dspark.v1.TargetService" in out.stdout and "grpc.health.v1.Health" in out.stdout
            else:
                assert out.stdout.strip().endswith("SERVING")
    assert ran == 2


def test_the_readme_sdk_snippet_runs(spec_target_address, capsys):
    [snippet] = [block for block in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
                 if "AsyncTargetClient" in block]
    assert "asyncio.run(main())" in snippet  # the async example is run, not only defined
    code = snippet.replace("127.0.0.1:50051", spec_target_address)  # a target started with --drafter
    code = code.replace("max_new_tokens=64", "max_new_tokens=8").replace("max_new_tokens=32", "max_new_tokens=8")
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out
    assert re.search(r"\b(length|eos|stop_string)\b", printed)  # the first print shows r.finish_reason
