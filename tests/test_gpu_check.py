"""make gpu-check on a machine without GPUs, and the torchrun rendezvous path of the setup page."""
from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: make gpu-check runs for real")
def test_gpu_check_without_a_gpu_says_so_and_exits_0():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "No GPU here" in done.stdout


@pytest.mark.parametrize("gpus, exact, want", [(8, None, 4), (4, None, 4), (2, None, 2), (1, None, 1),
                                               (8, 4, 4), (2, 4, None)])
def test_ranks_for(gpus, exact, want):
    assert gpu_check.ranks_for(gpus, exact) == want


def test_every_program_is_checked_or_excused():
    listed = {m for m, _, _ in gpu_check.PROGRAMS} | set(gpu_check.GLOO_ONLY)
    present = {f"intralayer.programs.{p.stem}" for p in (ROOT / "intralayer" / "programs").glob("*.py")
               if "\ndef main(" in p.read_text()}                    # a program, not a shared helper module
    assert listed == present


def test_a_c10d_rendezvous_launch_works():
    """The multi-node form of the setup page (--rdzv-backend c10d), on one node."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "intralayer-test",
           "-m", "intralayer.programs.collectives"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "all correct" in done.stdout
