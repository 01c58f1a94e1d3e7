"""Suite-wide: the time each notebook took, slowest first; and the order files start in."""
import os
from collections import defaultdict

import pytest

from intralayer import launch, ranks


def pytest_terminal_summary(terminalreporter):
    per_file = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for rep in reports:
            nodeid = getattr(rep, "nodeid", "")
            if ".ipynb" in nodeid:
                per_file[nodeid.split("::")[0]] += getattr(rep, "duration", 0.0)
    if per_file:
        terminalreporter.write_sep("=", "notebooks, slowest first (seconds, all cells)")
        for path, secs in sorted(per_file.items(), key=lambda kv: -kv[1]):
            terminalreporter.write_line(f"{secs:7.1f}  {path}")



#: Files that take minutes on one worker: started first, so that no worker is left with one of
#: them at the end while the other idles. pytest-xdist hands out files in collection order
#: because pyproject's addopts pass ``--no-loadscope-reorder`` (by default it reorders files by
#: their number of tests, which would undo this order).
LONG_POLES = ("tests/test_nbgrader.py", "tests/test_book.py", "chapters/")


def pytest_collection_modifyitems(items):
    def rank(item):
        return next((i for i, prefix in enumerate(LONG_POLES) if item.nodeid.startswith(prefix)), len(LONG_POLES))
    items.sort(key=rank)           # stable: within a file, and among the rest, the order is kept


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test here sees the environment without chapters/conftest.py's launch.POOL_ENV (a worker runs
    notebooks too), so a test of launch.run tests torchrun."""
    os.environ.pop(launch.POOL_ENV, None)


@pytest.fixture
def pool():
    """Run ``python -m module`` on N ranks of this worker's warm pool (:mod:`intralayer.ranks`):
    ``launch.run``'s contract without torchrun's cost (torch is imported once, by the fork server)."""
    return launch._in_pool


@pytest.fixture
def on_ranks():
    """Run one check function of a check program on N pool ranks; fail with each failed rank's error."""
    from tests.programs import checks

    def run(program, check, nproc: int, env: dict | None = None, timeout: float = 120.0) -> None:
        outcomes = ranks.run(checks.run_check, nproc, (program.__name__, check.__name__), deadline=timeout,
                             env=env, stop_on_failure=True)
        bad = [o for o in outcomes if not o.ok]
        if bad:
            late = any(o.exitcode is None for o in outcomes)
            pytest.fail(f"{check.__name__} on {nproc} ranks " + ("did not finish in time" if late else "failed") +
                        "".join(f"\nrank {o.rank}: " + (o.error["traceback"] if o.error else o.stderr[-3000:])
                                for o in bad[:2]), pytrace=False)
    return run
