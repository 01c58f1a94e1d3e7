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

