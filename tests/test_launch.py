"""Multi-process tests through intralayer.launch.run, and the set-up they rely on.

Each launch costs a few seconds on a small machine, so there are few of them: the
chapter program and a comm-checking program on 2 and 4 ranks, a rank that raises
(twice: alone, and while its peer waits in a collective), and a job that hangs.
"""
from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from intralayer import comm, distributed, launch

ROOT = Path(__file__).resolve().parents[1]
from tests.programs import comm_checks, misbehave
ENV = {"PYTHONPATH": str(ROOT)}
MISBEHAVE = "tests.programs.misbehave"


def processes_running(module: str) -> list[psutil.Process]:
    """Live processes (not zombies) whose command line names ``module``."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            if any(module in part for part in (p.info["cmdline"] or [])):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def assert_no_leftovers(module: str, within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while (left := processes_running(module)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes outlived the launch: {[(p.pid, p.info['cmdline']) for p in left]}"


# ------------------------------------------------------------------ (a) the chapter program

ROW = re.compile(r"^(?P<name>\S.*?)\s+(?P<ok>ok|WRONG)\s+(?P<S>\d+)\s+(?P<sent>\d+)\s+(?P<ratio>[\d.]+)\s+"
                 r"(?P<bus>[\d.]+)\s+(?P<how>ring model|counted)$")


# On 4 ranks here; chapter 00 launches the same program on 2 and 4 ranks, asserts "all correct"
# and nbval holds its table (the rows checked below) to the stored one.
@pytest.mark.parametrize("nproc", [4])
def test_chapter_program_is_all_correct(nproc, capsys):
    result = launch.run("intralayer.programs.collectives", nproc, env=ENV, timeout=60)
    out = result.output
    assert f"{nproc} ranks, gloo on cpu; every rank's results checked: all correct" in out
    assert "WRONG" not in out and "MISMATCH" not in out
    assert capsys.readouterr().out.strip() == out.strip()        # show=True printed rank 0's output
    assert sorted(result.stdout) == list(range(nproc))            # one log per rank
    assert all(result.stdout[r] == "" for r in range(1, nproc))   # only rank 0 prints
    assert result.nproc == nproc and result.seconds > 0
    rows = {m["name"]: m for line in out.splitlines() if (m := ROW.match(line))}
    assert set(rows) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all",
                         "ring all-reduce (send/recv)"}
    # Where the traffic is the ring's (modelled or counted on an even ring), sent/S is
    # exactly the bus factor.
    for name in ("all_reduce", "all_gather", "reduce_scatter", "ring all-reduce (send/recv)"):
        assert float(rows[name]["ratio"]) == pytest.approx(float(rows[name]["bus"]), abs=1e-3), name
    assert float(rows["all_reduce"]["bus"]) == pytest.approx(2 * (nproc - 1) / nproc, abs=1e-3)
    assert "backward of all_gather" in out and "backward of reduce_scatter" in out


# ------------------------------------------------------------------ (b) every comm function

@pytest.mark.parametrize("nproc", [2, 4])
def test_comm_forward_backward_and_accounting(pool, nproc):
    result = pool("tests.programs.comm_checks", nproc, env=ENV, timeout=60)
    assert f"{comm_checks.MARKER} {nproc}" in result.output
    assert all("Traceback" not in text for text in result.stderr.values())


# ------------------------------------------------------------------ (c) a rank that raises

def test_a_rank_that_raises_fails_the_launch_with_its_message():
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as info:
        launch.run(MISBEHAVE, 2, args=["raise"], env=ENV, timeout=60)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert elapsed < 20, f"the failure took {elapsed:.1f} s to report"
    assert "failed (torchrun exit code" in message
    assert "Rank 1 failed" in message
    assert misbehave.FAILURE_TEXT in message
    assert "rank 0 started (raise)" in message                   # rank 0's output so far
    assert_no_leftovers(MISBEHAVE)


def test_the_reported_rank_is_the_one_that_raised_first():
    with pytest.raises(launch.LaunchError) as info:
        launch.run(MISBEHAVE, 2, args=["raise-in-barrier"], env=ENV, timeout=60)
    try:
        assert misbehave.FAILURE_TEXT in str(info.value)
    finally:
        assert_no_leftovers(MISBEHAVE)


# ------------------------------------------------------------------ (d) a rank that hangs

def test_a_hanging_job_is_stopped_at_the_timeout():
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as info:
        launch.run(MISBEHAVE, 2, args=["hang"], env=ENV, timeout=8)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert 8 <= elapsed < 15, f"returned after {elapsed:.1f} s"
    assert "did not finish within its 8 s timeout" in message
    assert "every rank was stopped" in message
    assert_no_leftovers(MISBEHAVE)


# ------------------------------------------------------------------ (e) bad arguments

@pytest.fixture
def no_processes(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args}")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize("kwargs, rule", [
    (dict(nproc=0), r"nproc=0 must be a whole number from 1 to 8"),
    (dict(nproc=99), r"nproc=99 must be a whole number from 1 to 8"),
    (dict(nproc=2.0), r"nproc=2.0 must be a whole number"),
    (dict(module="foo.py"), r"module 'foo.py' must be a dotted module name"),
    (dict(module="tests/programs/misbehave"), r"must be a dotted module name"),
    (dict(module=""), r"must be a dotted module name"),
    (dict(timeout=0), r"timeout=0 must be a positive, finite number of seconds"),
    (dict(timeout=-5.0), r"timeout=-5.0 must be a positive, finite number of seconds"),
    (dict(timeout=float("nan")), r"must be a positive, finite number of seconds"),
    (dict(timeout=float("inf")), r"must be a positive, finite number of seconds"),
])
def test_bad_arguments_raise_before_anything_starts(kwargs, rule, no_processes):
    args = dict(module=MISBEHAVE, nproc=2, timeout=10.0) | kwargs
    with pytest.raises(ValueError, match=rule):
        launch.run(args["module"], args["nproc"], args=["raise"], timeout=args["timeout"], env=ENV)


def test_command_line():
    cmd = launch.command("pkg.mod", 3, args=(1, "--x"))
    assert cmd[1:] == ["-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                       "--nproc-per-node=3", "-m", "pkg.mod", "1", "--x"]
    assert Path(cmd[0]).name.startswith("python")


def test_launch_result_output_is_rank_0_stdout():
    r = launch.LaunchResult("m", 2, 1.0, stdout={0: "zero\n", 1: "one\n"})
    assert r.output == "zero\n"
    assert launch.LaunchResult("m", 2, 1.0).output == ""


# ------------------------------------------------------------------ (f) set-up and its timeout

@pytest.fixture
def outside_torchrun(monkeypatch):
    for key in distributed._REQUIRED:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv(distributed.TIMEOUT_ENV, raising=False)
    return monkeypatch


def test_setup_outside_torchrun_says_to_use_torchrun(outside_torchrun):
    with pytest.raises(RuntimeError, match="torchrun") as info:
        with distributed.setup():
            pass
    assert "RANK" in str(info.value) and "MASTER_PORT" in str(info.value)
    assert not dist.is_initialized()


def test_setup_names_only_the_missing_variables(outside_torchrun):
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1").items():
        outside_torchrun.setenv(key, value)
    with pytest.raises(RuntimeError, match="MASTER_ADDR, MASTER_PORT are not set"):
        with distributed.setup():
            pass


def test_setup_rejects_a_non_positive_timeout(outside_torchrun):
    with pytest.raises(ValueError, match="must be a positive, finite number of seconds"):
        distributed.setup(timeout_s=0)
    assert distributed.setup(timeout_s=2.5).timeout_s == 2.5
    assert distributed.setup().timeout_s == distributed.DEFAULT_TIMEOUT_S


@pytest.mark.parametrize("raw, seconds", [("", 60.0), ("12.5", 12.5), ("3", 3.0), (" 7 ", 7.0)])
def test_timeout_seconds_reads_the_environment(raw, seconds, monkeypatch):
    monkeypatch.setenv(distributed.TIMEOUT_ENV, raw)
    assert distributed.timeout_seconds() == seconds


def test_timeout_seconds_default_when_unset(monkeypatch):
    monkeypatch.delenv(distributed.TIMEOUT_ENV, raising=False)
    assert distributed.timeout_seconds() == distributed.DEFAULT_TIMEOUT_S == 60.0


@pytest.mark.parametrize("raw, rule", [
    ("abc", "is not a number of seconds"),
    ("10s", "is not a number of seconds"),
    ("0", "must be a positive, finite number of seconds"),
    ("-3", "must be a positive, finite number of seconds"),
    ("-inf", "must be a positive, finite number of seconds"),
])
def test_timeout_seconds_rejects_bad_values(raw, rule, monkeypatch):
    monkeypatch.setenv(distributed.TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=rule) as info:
        distributed.timeout_seconds()
    assert distributed.TIMEOUT_ENV in str(info.value)


@pytest.mark.parametrize("raw", ["nan", "inf"])
def test_timeout_seconds_rejects_nan_and_inf(raw, monkeypatch):
    monkeypatch.setenv(distributed.TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match="positive, finite number of seconds"):
        distributed.timeout_seconds()


def test_choose_backend(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.choose_backend(1) == ("gloo", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert distributed.choose_backend(4) == ("nccl", "cuda")
    assert distributed.choose_backend(8) == ("gloo", "cpu")      # not a GPU for every rank


def test_new_group_needs_the_default_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="inside setup"):
        distributed.new_group([0])


# ------------------------------------------------------------------ comm on a one-rank group

@pytest.fixture
def solo_group(tmp_path, monkeypatch):
    """A one-rank gloo group in this process (no launch needed)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_all_to_all_on_one_rank_with_rows_and_accounting(solo_group):
    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    with comm.accounting() as acc:
        y = comm.all_to_all(x, in_splits=[2], out_splits=[2])
        (y * 2).sum().backward()
    torch.testing.assert_close(y.detach(), x.detach(), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, torch.full((2, 3), 2.0), rtol=0, atol=0)
    assert [(r.op, r.phase, r.sent, r.peers) for r in acc.records] == [
        ("all_to_all", "forward", 0.0, (0,)), ("all_to_all", "backward", 0.0, (0,))]
    empty = comm.all_to_all(torch.zeros(0), in_splits=[0], out_splits=[0])   # 1-D: fine
    assert empty.shape == (0,)


def test_all_to_all_of_no_rows_of_a_2d_tensor(solo_group):
    y = comm.all_to_all(torch.zeros(0, 3), in_splits=[0], out_splits=[0])
    assert y.shape == (0, 3)


def test_the_notebooks_pool_launch_keeps_launch_runs_contract(monkeypatch, capsys):
    """What nbval's notebooks get (chapters/conftest.py sets launch.POOL_ENV): the same program on pool
    ranks, rank 0's output shown and returned, one log per rank; a failing rank still raises LaunchError."""
    monkeypatch.setenv(launch.POOL_ENV, "1")
    result = launch.run("intralayer.programs.collectives", 2, timeout=60)
    assert "2 ranks, gloo on cpu; every rank's results checked: all correct" in result.output
    assert capsys.readouterr().out.strip() == result.output.strip()
    assert sorted(result.stdout) == [0, 1] and result.stdout[1] == ""
    with pytest.raises(launch.LaunchError, match="failed"):
        launch.run("intralayer.programs.collectives", 2, args=["--no-such-option"], timeout=60, show=False)
