"""Ordinary mistakes at the command line: one clear line on stderr and a non-zero exit, never a traceback; launchers
stop their services when they are told to stop, and fail at once when a service dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from dspark_grpc.client import RequestError, TargetClient

BIN = Path(sys.executable).parent
NOBODY = "127.0.0.1:1"  # nothing listens on port 1


def run(*argv: str, timeout: float = 120, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def assert_one_line(out: subprocess.CompletedProcess, code: int, *words: str) -> str:
    assert out.returncode == code, (out.returncode, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("args", "words"), [
    (["--messages", "{not json"], ["--messages", "not valid JSON"]),
    (["--messages", '{"role": "user", "content": "Hi"}'], ["--messages", "JSON list"]),
    (["--messages", '[{"role": "robot", "content": "Hi"}]'], ["robot", "system, user, assistant, tool"]),
    (["Hi", "--max-new-tokens", "0"], ["--max-new-tokens", ">= 1"]),
    (["Hi", "--max-new-tokens", "-1"], ["--max-new-tokens", ">= 1"]),
    (["Hi", "--temperature", "-1"], ["--temperature", ">= 0"]),
    (["Hi", "--top-p", "1.5"], ["--top-p"]),
    (["Hi", "--messages", '[{"role": "user", "content": "Hi"}]'], ["either a prompt or --messages"]),
    ([], ["give a prompt"]),
])
def test_generate_usage_errors_are_one_line(args, words):
    assert_one_line(run("dspark", "generate", "--target", NOBODY, *args), 2, "dspark generate: error:", *words)


def test_generate_against_nothing_says_to_start_the_service():
    out = run("dspark", "generate", "Hi", "--target", NOBODY)
    assert_one_line(out, 1, "UNAVAILABLE", NOBODY.split(":")[0], "dspark-target serve")


def test_a_second_target_on_a_busy_port_is_one_line(target_address):
    port = target_address.rsplit(":", 1)[1]
    out = run("dspark-target", "serve", "--port", port, "--no-cost-profile", "--quiet")
    line = assert_one_line(out, 1, f"cannot listen on 127.0.0.1:{port}", "--port")
    assert "in use" in line


def test_service_tools_in_an_sdk_only_install_say_what_to_install():
    # the package is not on PyPI: the line says how to install from a checkout (tests/test_cli_help.py: --help)
    code = ("import sys; sys.modules['torch'] = None; sys.argv = ['dspark-target', 'serve']; "
            "from dspark_grpc.cli_common import target_main; target_main()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    line = assert_one_line(out, 1, "dspark-target", "torch", "dspark-grpc checkout", "pip install '.[server]'",
                           "the SDK alone: pip install .")
    assert "pip install dspark-grpc" not in line and "pip install 'dspark-grpc[" not in line


def test_a_target_whose_drafter_does_not_answer_says_so_and_serves():
    proc = subprocess.Popen([str(BIN / "dspark-target"), "serve", "--port", "0", "--drafter", NOBODY, "--quiet",
                             "--no-cost-profile", "--precision", "exact"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    errors: list[str] = []
    readers = [threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True),
               threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        _wait_for(lines, proc, "SERVING on", 300)
        address = next(line for line in lines if "SERVING on" in line).split()[-1]
        with TargetClient(address) as client:  # it serves, target-only
            r = client.generate("Hi", max_new_tokens=2)
        assert len(r.token_ids) == 2 and r.stats.speculative_steps == 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        for reader in readers:
            reader.join(60)
    err = "".join(errors)
    warnings = [line for line in err.splitlines() if "warning: drafter" in line]
    assert len(warnings) == 1 and "Traceback" not in err, err
    assert warnings[0].startswith(f"[dspark-target] warning: drafter {NOBODY} is not reachable (UNAVAILABLE: ")
    assert warnings[0].endswith("sessions run target-only until it answers")


def test_a_missing_drafter_fails_before_anything_loads():
    out = run("dspark-draft", "serve", "--drafter", "./no-such-drafter", "--port", "0")
    assert_one_line(out, 2, "--drafter ./no-such-drafter", "no such file")
    assert "listening" not in out.stdout  # refused before the server or the target checkpoint


def test_unknown_chat_roles_are_refused_by_the_target(target_address):
    with TargetClient(target_address) as client, pytest.raises(RequestError) as e:
        client.generate(messages=[{"role": "narrator", "content": "Once"}], max_new_tokens=2)
    assert e.value.code == 3 and "narrator" in e.value.message and "system, user, assistant, tool" in e.value.message


def test_max_new_tokens_has_one_meaning_over_grpc(target_address):
    import grpc
    from dspark_grpc.protos.dspark.v1 import common_pb2, target_pb2, target_pb2_grpc

    with grpc.insecure_channel(target_address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        prompt = common_pb2.Prompt(text="Hi")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(target_pb2.GenerateRequest(prompt=prompt, max_new_tokens=0), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ">= 1" in e.value.details()
        # unset: the documented default, 128 tokens
        out = list(stub.Generate(target_pb2.GenerateRequest(prompt=prompt, ignore_eos=True,
                                                            mode=common_pb2.DECODE_MODE_AR), timeout=300))
        assert sum(len(m.token_ids) for m in out) == 128
    with TargetClient(target_address) as client, pytest.raises(RequestError) as e:
        client.generate("Hi", max_new_tokens=0)
    assert e.value.code == 3 and ">= 1" in e.value.message


def _wait_for(lines: list[str], proc: subprocess.Popen, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in line for line in lines):
        assert proc.poll() is None, "".join(lines)
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_launcher_stops_its_services(sig, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    # as from a terminal: a test runner started in the background has SIGINT ignored, and an ignored signal stays
    # ignored across exec (the launcher rightly leaves it so); reset in a trampoline, not a preexec_fn (which forks,
    # and a fork while this process holds gRPC channels can block in gRPC's atfork handler)
    default_sigint = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                      "os.execv(sys.argv[1], sys.argv[1:])")
    proc = subprocess.Popen([sys.executable, "-c", default_sigint, str(BIN / "dspark"), "bench", "--prompts",
                             str(prompts), "--max-new-tokens", "4", "--modes", "ar", "--json",
                             str(tmp_path / "b.json")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    children: list[psutil.Process] = []
    try:
        _wait_for(lines, proc, "listening on", 120)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children
        proc.send_signal(sig)
        proc.wait(timeout=60)
        reader.join(60)
        err = "".join(lines)
        assert proc.returncode == 130, err
        assert "Traceback" not in err and "dspark bench: error: interrupted" in err
        gone, alive = psutil.wait_procs(children, timeout=60)
        assert not alive
    finally:  # only what this test started: the session's services are children of this process too
        for p in children:
            if p.is_running():
                p.kill()
        if proc.poll() is None:
            proc.kill()


def test_a_launcher_fails_at_once_when_its_service_dies(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["MadeUpForCausalLM"], "model_type": "made_up"}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    out = run("dspark", "bench", "--prompts", str(prompts), "--max-new-tokens", "4", "--modes", "ar", "--json",
              str(tmp_path / "b.json"), "--target-model", str(model), timeout=180)
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("dspark bench: error: the target service exited") and "failed to load" in last
    assert "Traceback" not in out.stderr


def test_the_default_model_is_named_as_users_know_it(target_address):
    from dspark_grpc.target_service.engine import model_display_name

    with TargetClient(target_address) as client:
        assert client.model_info().model_name == "SmolLM2-135M-Instruct (Q4_1 GGUF)"
    assert model_display_name("m/model.gguf", "x") == "model (GGUF)"
    assert model_display_name("m/hf-dir", "Qwen3") == "Qwen3"


def test_bench_against_an_address_where_nothing_answers_fails_instead_of_waiting(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    out = run("dspark", "bench", "--prompts", str(prompts), "--max-new-tokens", "4", "--modes", "ar", "--json",
              str(tmp_path / "b.json"), "--target", NOBODY, "--connect-timeout", "1")
    assert_one_line(out, 1, f"nothing answers at {NOBODY}", "is the service running")


def test_a_killed_launcher_takes_its_services_with_it():
    # the launcher gets SIGKILL (no handler runs): its child must still get SIGTERM from the kernel
    launcher_code = ("import subprocess, time\n"
                     "from dspark_grpc.client.local_stack import child_command\n"
                     "child = subprocess.Popen(child_command(['-c', 'import time; time.sleep(300)']))\n"
                     "print(child.pid, flush=True)\n"
                     "time.sleep(300)\n")
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code], stdout=subprocess.PIPE, text=True)
    try:
        child = psutil.Process(int(launcher.stdout.readline()))
        assert child.ppid() == launcher.pid
        deadline = time.monotonic() + 60
        while len(child.cmdline()) != 3:  # until it has exec'd its real command: python -c CODE
            assert time.monotonic() < deadline
            time.sleep(0.05)
        launcher.kill()
        launcher.wait(timeout=60)
        gone, alive = psutil.wait_procs([child], timeout=60)
        assert not alive  # (not our child: its exit code cannot be read here)
    finally:
        if launcher.poll() is None:
            launcher.kill()
