"""The RL loop example end to end: after each update from the trainer's process, troupe's
greedy tokens equal transformers' on the trainer's weights, and sleeping returns memory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import fixture

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "python" / "rl_loop.py"


@pytest.mark.parametrize("tp", [1, 2])
def test_rl_loop(tp):
    pytest.importorskip("torch", reason="PyTorch is not installed in this venv")
    pytest.importorskip("transformers", reason="transformers is not installed in this venv")
    run = subprocess.run([sys.executable, str(EXAMPLE), "--model", fixture("llama-gqa"),
                          "--iterations", "3", "--tensor-parallel-size", str(tp)],
                         capture_output=True, text=True, timeout=600)
    lines = [json.loads(l) for l in run.stdout.splitlines() if l.startswith("{")]
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert [l["iteration"] for l in lines] == [0, 1, 2]
    assert all(l["tokens_equal_transformers"] for l in lines)
    assert [l["weight_version"] for l in lines] == [1, 2, 3]
    # The policy moved (the updates were not no-ops), and a sleep after the cache was
    # touched gave its 64 MiB back.
    assert any(l["tokens_changed"] for l in lines)
    assert lines[-1]["rss_awake_mb"] - lines[-1]["rss_asleep_mb"] > 32
