"""--device (issue 40) on `dspark-target serve`, `dspark-draft serve` and `dspark bench`: auto, cpu, cuda or cuda:N;
without a CUDA device a service asked for one exits with one line (no traceback), auto is the CPU."""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys

import pytest
import torch
from dspark_grpc.bench import cli as bench_cli
from dspark_grpc.bench import served as bench
from dspark_grpc.runtime.kernels.device import DeviceUnavailable, resolve_device
from dspark_grpc.target_service import cli as target_cli

from dspark_grpc.cli_common import device_choice

without_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA device")


def test_device_values():
    assert [device_choice(v) for v in ("auto", "cpu", "cuda", "CUDA:1", " cuda:0")] == \
        ["auto", "cpu", "cuda", "cuda:1", "cuda:0"]
    for bad in ("gpu", "cuda:", "cuda:x", "mps", "cpu:0", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="expected auto, cpu, cuda or cuda:N"):
            device_choice(bad)


def test_an_unknown_device_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        target_cli.parser().parse_args(["serve", "--device", "gpu"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "dspark-target serve: error: argument --device: expected auto, cpu, cuda or cuda:N, got 'gpu' (see "
        "dspark-target serve --help)"]


@without_cuda
def test_auto_is_the_cpu_and_cuda_is_refused():
    assert resolve_device("auto") == resolve_device("cpu") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(DeviceUnavailable, match=rf"^--device {name}: torch sees no CUDA device \(torch "
                                                    r"\S+ is a CPU-only build\); use --device cpu or auto$"):
            resolve_device(name)


@without_cuda
@pytest.mark.parametrize("service", ["target", "draft"])
def test_a_service_asked_for_cuda_exits_with_one_line(service):
    run = subprocess.run([sys.executable, "-m", f"dspark_grpc.{service}_service.cli", "serve", "--device", "cuda",
                          "--port", "0"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.splitlines() == [f"dspark-{service}: error: --device cuda: torch sees no CUDA device (torch "
                                       f"{torch.__version__} is a CPU-only build); use --device cpu or auto"]


def test_bench_passes_device_to_the_services_it_starts(monkeypatch):
    started: dict[str, list[str]] = {}

    class Started(Exception):
        pass

    def service(name: str):
        @contextlib.contextmanager
        def start(args, **kwargs):
            started[name] = list(args)
            if name == "target":
                raise Started
            yield "127.0.0.1:1"
        return start

    monkeypatch.setattr(bench, "local_drafter", service("draft"))
    monkeypatch.setattr(bench, "local_target", service("target"))
    with pytest.raises(Started):
        bench.run_bench([{"prompt": "Hi"}], ["ar", "speculation"], 4, [1], device="cuda:1", log=lambda line: None)
    assert sorted(started) == ["draft", "target"]
    for args in started.values():
        assert args[args.index("--device") + 1] == "cuda:1"


def test_bench_refuses_device_for_a_running_target(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_cli.main(["--prompts", "x.jsonl", "--max-new-tokens", "4", "--json", str(tmp_path / "b.json"),
                        "--target", "127.0.0.1:1", "--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device is for the services bench starts" in capsys.readouterr().err
