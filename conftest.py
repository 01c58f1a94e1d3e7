"""For every pytest run in this repository: the warm kernels (tests/kernel_zygote.py) of the notebooks
a process that runs tests executes — nbval's chapters, and nbgrader's autograde, a child process."""
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests import kernel_zygote

_zygote: dict = {}


def pytest_configure(config):
    """In each process that runs tests (an xdist worker, or pytest without -n): start the zygote of the
    kernels and put its kernelspec first on JUPYTER_PATH, for nbval's kernels and nbgrader's (a child
    process, which inherits the environment)."""
    if getattr(config, "workerinput", None) is None and config.getoption("numprocesses", None):
        return                                              # the xdist controller runs no test
    folder = tempfile.mkdtemp(prefix="intralayer-kernels-")
    kernel_zygote.install(folder)
    path = os.path.join(folder, "zygote.sock")
    proc = subprocess.Popen([sys.executable, kernel_zygote.__file__, "--serve", path], stdin=subprocess.PIPE,
                            cwd=Path(__file__).resolve().parent)
    deadline = time.monotonic() + 60
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    _zygote.update(proc=proc, folder=folder, env={k: os.environ.get(k) for k in ("JUPYTER_PATH", kernel_zygote.SOCKET_ENV)})
    # The kernelspec "python3" (pyproject's --nbval-kernel-name) is this environment's Python either way;
    # without a zygote its program starts the kernel afresh.
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [folder, os.environ.get("JUPYTER_PATH")]))
    if os.path.exists(path):
        os.environ[kernel_zygote.SOCKET_ENV] = path


def pytest_unconfigure(config):
    if not _zygote:
        return
    _zygote["proc"].stdin.close()                          # the zygote ends when its stdin closes
    try:
        _zygote["proc"].wait(10)
    except subprocess.TimeoutExpired:
        _zygote["proc"].kill()
    for key, value in _zygote["env"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    shutil.rmtree(_zygote["folder"], ignore_errors=True)
    _zygote.clear()
