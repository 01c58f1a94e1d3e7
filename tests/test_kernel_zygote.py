"""The suite's kernels (tests/kernel_zygote.py, started by conftest.py): a notebook's kernel is forked
from this worker's zygote and behaves as one started afresh — its folder, its environment, an interrupt
that reaches the running cell, no process left after it; where no zygote answers, the kernelspec's
program becomes an ordinary kernel."""
from __future__ import annotations

import os
import signal
import time

import nbformat
import psutil
import pytest
from jupyter_client import KernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from tests import kernel_zygote

PROBE = ("import os, sys, psutil\n"
         "print(psutil.Process(os.getppid()).cmdline()[-2])\n"
         "print(os.getcwd())\n"
         "print(os.environ.get('ZYGOTE_PROBE'))\n"
         "print(sys.modules.get('torch') is not None)")


def run(tmp_path, *cells: str, timeout: int = 60):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(nb, kernel_name="python3", timeout=timeout, interrupt_on_timeout=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except CellExecutionError:
        pass
    return [o for c in nb.cells for o in c.outputs]


@pytest.fixture
def zygote() -> psutil.Process:
    """This worker's zygote (conftest.py starts one in every process that runs tests)."""
    path = os.environ.get(kernel_zygote.SOCKET_ENV)
    assert path, "conftest.py started no zygote for this worker"
    return next(p for p in psutil.process_iter(["cmdline"]) if path in (p.info["cmdline"] or []))


def test_a_kernel_is_forked_from_the_zygote_with_its_clients_folder_and_environment(tmp_path, zygote, monkeypatch):
    monkeypatch.setenv("ZYGOTE_PROBE", "set after the zygote started")
    out = run(tmp_path, PROBE)[0]["text"].splitlines()
    assert out == ["--serve", str(tmp_path), "set after the zygote started", "True"], out


def test_an_interrupt_reaches_the_running_cell_and_no_kernel_is_left(tmp_path, zygote):
    before = {c.pid for c in zygote.children()}
    start = time.monotonic()
    outputs = run(tmp_path, "import time\ntime.sleep(60)", timeout=3)
    assert time.monotonic() - start < 30
    assert [o.get("ename") for o in outputs if o.output_type == "error"] == ["KeyboardInterrupt"], outputs
    _, alive = psutil.wait_procs([c for c in zygote.children() if c.pid not in before], timeout=10)
    assert not alive, "a kernel outlived its notebook"


def test_a_killed_client_takes_its_kernel_down(zygote):
    before = {c.pid for c in zygote.children()}
    km = KernelManager(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        [kernel] = [c for c in zygote.children() if c.pid not in before]
        os.kill(km.provisioner.process.pid, signal.SIGKILL)      # what jupyter_client's kill does
        _, alive = psutil.wait_procs([kernel], timeout=10)
        assert not alive, "the kernel outlived its killed client"
    finally:
        kc.stop_channels()
        km.cleanup_resources()


def test_without_a_zygote_the_program_is_an_ordinary_kernel(tmp_path, monkeypatch):
    monkeypatch.delenv(kernel_zygote.SOCKET_ENV, raising=False)
    out = run(tmp_path, PROBE)[0]["text"].splitlines()
    assert out[0] != "--serve" and out[1] == str(tmp_path), out
