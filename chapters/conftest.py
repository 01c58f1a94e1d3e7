"""The chapters' launches run on the rank pool while nbval executes them.

``launch.run`` in a notebook reads :data:`intralayer.launch.POOL_ENV`: set here, the same program runs
with torchrun's environment on ranks of :mod:`intralayer.ranks`' warm pool (about 0.2 s a launch,
against torchrun's 6 s, measured here). A reader's notebook always uses torchrun, and torchrun is
tested where it is the subject (tests/test_launch.py, test_faults.py, test_concurrency.py,
test_gpu_check.py). The kernel of a notebook starts, with this environment, when its first cell is
set up; tests/conftest.py removes the variable again for the tests.
"""
import os

import pytest

from intralayer import launch


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    os.environ[launch.POOL_ENV] = "1"
