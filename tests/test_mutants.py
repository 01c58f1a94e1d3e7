"""tools/mutants.py, the measure of how often the labs' visible checks reject a slightly wrong answer
(book/instructors.md): its mutants are the same on every run, each compiles and differs from its
answer, and a run checks them for real — the unmutated answers pass and a known mutant is rejected."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import mutants

ROOT = Path(__file__).resolve().parents[1]


def test_mutants_are_reproducible_compile_and_change_the_answer():
    kinds = set()
    for path in mutants.lab_notebooks(ROOT):
        lab = mutants.Lab(path, path)
        for cell in lab.answers:
            made = mutants.mutants(lab.name, cell)
            assert made == mutants.mutants(lab.name, cell), f"{cell['id']}: two runs made different mutants"
            assert 0 < len(made) <= mutants.CAP, f"{cell['id']}: {len(made)} mutants"
            original = ast.unparse(ast.parse(cell["source"]))
            for m in made:
                compile(m["source"], m["id"], "exec")
                assert ast.unparse(ast.parse(m["source"])) != original, f"{m['id']} is the answer itself"
                kinds.add(m["kind"])
    assert kinds == set(mutants.KINDS), f"kinds never made: {set(mutants.KINDS) - kinds}"


def test_a_run_passes_the_answers_and_rejects_a_mutant_that_loses_its_group(tmp_path):
    """Lab 07's ring with ``dist.get_world_size()`` for the group's size: the visible pair [1, 2] rejects it."""
    lab07 = next(mutants.Lab(p, p) for p in mutants.lab_notebooks(ROOT) if p.name.startswith("07_"))
    ring = next(c for c in lab07.answers if c["id"] == "ring_allgather_matmul")
    [which] = [m["id"] for m in mutants.mutants("07", ring) if "dist.get_world_size(group)" in m["change"]]
    out = tmp_path / "run.json"
    assert mutants.main(["--labs", "07", "--only", which, "--out", str(out)]) == 0
    lab = json.loads(out.read_text())["labs"]["07"]
    assert {v["verdict"] for v in lab["baseline"].values()} == {"pass"}, lab["baseline"]
    [mutant] = lab["mutants"]
    assert "dist.get_world_size()" in mutant["source"] and mutant["status"] == "rejected", mutant
    assert "global rank" in mutant["checks"]["ring_allgather_matmul_check"]["said"], mutant
