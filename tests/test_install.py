"""What a clean machine needs to install and start the project (issue: an install that failed only off this
workplace): CI resolves the declared dependencies against the public index; CPU users get the CPU torch; the image
brings a C++ compiler; a target without one falls back and says so in one line; long builds show progress."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

from dspark_grpc.runtime.progress import still_working

ROOT = Path(__file__).resolve().parents[1]


def test_ci_resolves_the_declared_dependencies_against_the_public_index():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "check-dependencies" in ci
    check = (ROOT / ".ci" / "check-dependencies").read_text()
    for switched_off in ("-u PIP_FIND_LINKS", "-u PIP_EXTRA_INDEX_URL", "-u PIP_CONSTRAINT",
                         "PIP_CONFIG_FILE=/dev/null"):
        assert switched_off in check
    assert "[server,dev]" in check and "--dry-run" in check


def test_the_makefile_installs_the_cpu_torch_and_shows_pip_progress():
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH_INDEX \?= https://download\.pytorch\.org/whl/cpu$", make, flags=re.M)
    assert "--progress-bar off" not in make
    pinned = subprocess.run(["make", "-s", "--no-print-directory", "print-TORCH_PIN"], cwd=ROOT, text=True,
                            capture_output=True, check=True).stdout.strip()
    assert pinned == "torch==2.13.0"


def _install_commands(*make_args: str) -> list[list[str]]:
    """The pip commands `make` runs to build the venv, as argv (make -n: printed, not run)."""
    stamp = subprocess.run(["make", "-s", "--no-print-directory", "print-STAMP"], cwd=ROOT, text=True,
                           capture_output=True, check=True).stdout.strip()
    lines = subprocess.run(["make", "-n", "-B", "--no-print-directory", *make_args, stamp], cwd=ROOT, text=True,
                           capture_output=True, check=True).stdout.splitlines()
    commands = [shlex.split(line, comments=True) for line in lines]
    return [argv for argv in commands if argv[:1] and argv[0].endswith("/pip")]


def test_an_unreachable_torch_index_costs_one_warning():
    """pip asks every index for every package it resolves, so the index may be named only where torch alone is
    fetched, with one retry; torch's dependencies come with the project's install (torch installed by then)."""
    commands = _install_commands()
    [torch] = [argv for argv in commands if "--extra-index-url" in argv]
    assert torch[torch.index("--extra-index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    assert "--no-deps" in torch and torch[torch.index("--retries") + 1] == "1"
    assert [a for a in torch if a.startswith("torch")] == ["torch==2.13.0"]
    later = commands[commands.index(torch) + 1:]
    assert ["install", "-e", ".[dev]"] in [argv[1:] for argv in later]  # what brings torch's dependencies
    assert not any("index-url" in a for argv in _install_commands("TORCH_INDEX=") for a in argv)


def test_every_directory_that_ships_is_a_listed_package():
    """setuptools warns ("Package ... is absent from the `packages` configuration") about a directory with an
    importable name under a listed package that is not listed itself, such as draft_service/drafters (data only)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages, dirs = set(config["packages"]), config["package-dir"]

    def directory(package: str) -> Path:
        parent = max((p for p in dirs if package == p or package.startswith(p + ".")), key=len)
        return ROOT / dirs[parent] / package.removeprefix(parent).lstrip(".").replace(".", "/")

    for package in packages:
        for sub in directory(package).iterdir():
            files = [f for f in sub.rglob("*") if f.is_file() and "__pycache__" not in f.parts] if sub.is_dir() else []
            if sub.name.isidentifier() and files:
                assert f"{package}.{sub.name}" in packages, f"{sub.relative_to(ROOT)} is not in `packages`"
    for package, patterns in config["package-data"].items():  # and the data still ships
        assert package in packages
        for pattern in patterns:
            assert list(directory(package).glob(pattern)), f"{package}: {pattern} matches nothing"


def test_the_image_brings_a_compiler_before_installing():
    docker = (ROOT / "Dockerfile").read_text()
    assert docker.index("apt-get install -y --no-install-recommends g++") < docker.index("pip install")


def _resolve_without_a_compiler(tmp_path: Path, compile_mode: str) -> subprocess.CompletedProcess:
    """target_service.cli's precision/compile resolution in a process whose PATH has no g++ (and an empty kernel
    cache, so the C++ kernels would have to be built)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DSPARK_COMPILE", "CXX")}
    env.update(PATH=str(tmp_path), DSPARK_COMPILE_CACHE=str(tmp_path / "cache"))
    code = ("from dspark_grpc.runtime.formats.checkpoint import default_model_path\n"
            "from dspark_grpc.target_service.cli import _precision_and_compile\n"
            f"print(_precision_and_compile(default_model_path(), 'auto', {compile_mode!r}, quiet=False))")
    return subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True, timeout=300)


def test_a_target_without_a_compiler_falls_back_and_says_so_in_one_line(tmp_path):
    done = _resolve_without_a_compiler(tmp_path, "auto")
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stdout.splitlines() if line.startswith("[dspark-target]")]
    assert len(said) == 1, done.stdout
    assert "precision fast" in said[0] and "compile off (auto: no C++ compiler found" in said[0]
    assert "torch's int4 kernel" in said[0] and "no g++ on PATH" in said[0]
    assert done.stdout.splitlines()[-1] == "('fast', 'off')"


def test_an_explicit_compile_without_a_compiler_is_one_clear_error(tmp_path):
    done = _resolve_without_a_compiler(tmp_path, "max")
    assert done.returncode != 0
    assert "ValueError: --compile max needs a C++ compiler" in done.stderr and "--compile off" in done.stderr


def test_long_work_says_every_interval_that_it_is_still_at_it():
    lines, two_said = [], threading.Event()
    ticks = iter([100.0, 115.0, 130.0, 145.0])

    def say(line: str) -> None:
        lines.append(line)
        if len(lines) == 2:
            two_said.set()

    with still_working("compiling the step graph", every_s=0.001, clock=lambda: next(ticks), say=say):
        assert two_said.wait(60)
    assert lines[:2] == ["[dspark] still compiling the step graph: 15 s so far",
                         "[dspark] still compiling the step graph: 30 s so far"]
    quiet = []
    with still_working("x", every_s=0.001, enabled=False, say=quiet.append):
        pass
    assert quiet == []
