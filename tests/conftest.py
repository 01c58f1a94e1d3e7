"""Suite-wide reporting: the time each notebook took, slowest first."""
from collections import defaultdict


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


#: The suite's long poles, slowest first (seconds measured on the 2-core machine, quiet): with
#: ``--dist loadfile`` a file runs whole on one worker, so a long file started last leaves the
#: other worker idle at the end (nbgrader's round trip alone takes about 270 s). Starting the
#: longest first (the LPT rule) lets the short ones fill in beside them.
LONG_POLES = ("tests/test_nbgrader.py", "chapters/00_", "tests/test_book.py", "chapters/08_", "chapters/01_",
              "chapters/07_", "chapters/06_", "chapters/02_", "chapters/03_", "tests/test_labs.py",
              "tests/test_overlap.py", "chapters/04_", "tests/test_faults.py", "tests/test_launch.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item):
        path = item.nodeid.split("::")[0]
        return next((i for i, pole in enumerate(LONG_POLES) if path.startswith(pole)), len(LONG_POLES))
    items.sort(key=rank)          # stable: each file's own order is kept
