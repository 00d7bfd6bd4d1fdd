"""`dspark demo`, the README's first Quick start command, run end to end in its short form (`--quick`: the same
path, both services started on the embedded model and drafter, one timed round of 16 tokens)."""

from __future__ import annotations

import subprocess
import sys


def test_the_quick_demo_runs_every_mode_and_outputs_match():
    run = subprocess.run([sys.executable, "-m", "dspark_grpc.client.cli", "demo", "--quick"], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    for mode in ("ar", "speculation", "adaptive"):
        assert f"=== {mode} ===" in run.stdout
    assert "=== timing: 1 rounds of the three modes in turn (16 new tokens each" in run.stdout
    assert "outputs identical in every mode and round: yes" in run.stdout
    assert "Traceback" not in run.stderr
