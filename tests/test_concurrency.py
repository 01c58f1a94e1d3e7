"""Two launches at the same time — as two notebooks, or pytest's two workers, do — do not collide."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from intralayer import launch

ROOT = Path(__file__).resolve().parents[1]


def test_two_launches_at_once_both_succeed():
    jobs = [("intralayer.programs.collectives", 2), ("intralayer.programs.tp_block", 2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(launch.run, module, n, (), 120, False) for module, n in jobs]
        results = [f.result(timeout=180) for f in futures]
    assert "all correct" in results[0].output
    assert "all checks passed" in results[1].output
