"""Mutation testing of the labs' visible checks: how often does a check cell reject a slightly wrong answer?

    .venv/bin/python tools/mutants.py --out /tmp/mutants-head.json              # this checkout
    .venv/bin/python tools/mutants.py --root /tmp/pre --out /tmp/mutants-pre.json   # another checkout
    .venv/bin/python tools/mutants.py --labs 00 03 --only 00/ring_all_reduce/4    # a few, to look again
    .venv/bin/python tools/mutants.py --compare /tmp/mutants-pre.json /tmp/mutants-head.json

Another checkout (an older commit, say) is made with ``git worktree add --detach /tmp/pre COMMIT``.

What it does, for each lab ``solutions/labs/NN_*.ipynb``:

1. Mutants. From each answer cell (nbgrader ``solution``) of the notebooks of ``--mutants-from``
   (by default the checkout this file is in), the code between ``### BEGIN SOLUTION`` and
   ``### END SOLUTION`` (the whole cell if it has no markers) is mutated with :mod:`ast`, one
   change per mutant: ``+``/``-`` and ``*``/``/`` swapped (``+=`` and ``-=`` too), ``<``/``<=`` and
   ``>``/``>=`` flipped, an integer constant c made c+1 or c-1 (not inside an f-string or ``%``
   formatting), the two arguments of a call with exactly two positional arguments swapped, a
   statement that is a bare call (``dist.all_reduce(x)``, ``request.wait()``) deleted, and a
   group keyword changed (``group=`` dropped, ``group_peer=``/``group_src=``/``group_dst=`` made the
   process-number ``peer=``/``src=``/``dst=``, ``src=``/``dst=`` set to 0, the group argument of
   ``dist.get_rank``/``get_world_size`` dropped). Mutants that do not compile, or that unparse to
   the original, are skipped; at most ``--cap`` (15) per cell are kept, taken round-robin over
   the kinds of change in an order fixed by ``--seed``, so two runs make the same mutants with
   the same ids (``LAB/CELL/K``).
2. Checks. The mutant's namespace is built as a fresh kernel would: the notebook's set-up cells,
   then every answer cell in order, the mutated one in place of its original (cells are exec'd
   under names registered in :mod:`linecache`, so their source can be read, as IPython's are).
   Each check cell (nbgrader ``grade``) of ``--root``'s notebook whose objects use the mutated
   cell (directly, or through a function or class of another answer cell) is read without its
   hidden cases (``### BEGIN HIDDEN TESTS`` … ``### END HIDDEN TESTS``) by a stand-in for
   ``labs`` that records the part, the objects and the cases, and becomes a real
   ``labs.Check(part, *objects).on(ranks, **params)`` of ``--root``'s own ``intralayer``. One
   cell's mutants run in one ``labs.run_many``; a check whose batch was cut short (a process
   that died, the deadline) runs again on its own, and that verdict counts.
3. Verdict. A mutant is *rejected* if any check that uses it fails (``LabFailure``), *survives* if
   every one passes, and is an *error* if it could not be checked (its cell raised, the check
   could not be built). The unmutated answers run first: every visible check must pass.

A whole run (353 mutants of the 28 answer cells) takes 7 to 9 minutes on two busy cores.

A survivor may be an equivalent mutant (it behaves as the original does): that cannot be told
automatically, so the survivors are listed, one line each, for a person to look at.

``--compare OLD.json NEW.json`` prints the two runs side by side and the regressions: mutants
the old run rejected and the new one lets survive.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import io
import json
import linecache
import os
import random
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SEED, CAP, GROUP_TIMEOUT = 1234, 15, 5.0
KINDS = ("arith", "compare", "const", "swap", "delete", "group")
#: In a failure's first line: the batch was cut short, so the verdict may belong to another mutant.
CUT_SHORT = ("did not finish", "ended a process before the check was done")


# ---------------------------------------------------------------------------- notebooks

def lab_notebooks(root: Path) -> list[Path]:
    return [p for p in sorted((root / "solutions" / "labs").glob("*.ipynb")) if re.match(r"\d\d_", p.name)]


def code_cells(path: Path) -> list[dict]:
    """The code cells: source, nbgrader id (or cell-N), and whether an answer or a check."""
    nb = json.loads(path.read_text())
    cells = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        meta = cell.get("metadata", {}).get("nbgrader", {})
        source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
        cells.append({"id": meta.get("grade_id") or f"cell-{i}", "source": source,
                      "solution": bool(meta.get("solution")), "grade": bool(meta.get("grade"))})
    return cells


def only_labs_calls(source: str) -> bool:
    """A cell that only calls ``labs.show(...)`` or ``labs.progress(...)``: nothing a check needs."""
    body = ast.parse(source).body
    return bool(body) and all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                              and isinstance(s.value.func, ast.Attribute)
                              and isinstance(s.value.func.value, ast.Name) and s.value.func.value.id == "labs"
                              for s in body)


def visible(source: str) -> str:
    """A check cell without nbgrader's hidden cases, as the learner's copy has it."""
    return re.sub(r"^[ \t]*### BEGIN HIDDEN TESTS.*?^[ \t]*### END HIDDEN TESTS[^\n]*\n?", "", source,
                  flags=re.S | re.M)


def defined(source: str) -> set[str]:
    """Top-level names a cell defines."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def used(source: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}


def check_objects(source: str) -> list[str]:
    """The names a check cell passes to ``labs.Check(part, *objects)``."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "Check":
            return [a.id for a in node.args[1:] if isinstance(a, ast.Name)]
    return []


def depends(answers: list[dict], names: list[str]) -> set[str]:
    """The answer cells whose code the objects ``names`` run: the cells defining them, and so on."""
    definer = {}
    for cell in answers:
        for name in defined(cell["source"]):
            definer.setdefault(name, cell)
    found, todo = set(), list(names)
    while todo:
        cell = definer.get(todo.pop())
        if cell is not None and cell["id"] not in found:
            found.add(cell["id"])
            todo += list(used(cell["source"]))
    return found


# ---------------------------------------------------------------------------- mutants

def solution_ranges(source: str) -> list[tuple[int, int]]:
    """Lines (1-based, inclusive) between the solution markers; the whole cell without markers."""
    lines, ranges, start = source.splitlines(), [], None
    for i, line in enumerate(lines, 1):
        if line.strip().startswith("### BEGIN SOLUTION"):
            start = i
        elif line.strip().startswith("### END SOLUTION") and start is not None:
            ranges.append((start + 1, i - 1))
            start = None
    return ranges or [(1, len(lines))]


SWAP_OPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult}
FLIP_CMP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">",
          ast.GtE: ">="}
PROCESS_KEYWORD = {"group_peer": "peer", "group_src": "src", "group_dst": "dst"}


def _short(node: ast.AST, width: int = 70) -> str:
    text = ast.unparse(node).replace("\n", " ")
    return text if len(text) <= width else text[:width - 1] + "…"


def _candidates(tree: ast.Module, ranges) -> list[tuple]:
    """Every single change: (index of the node in ast.walk order, kind, detail)."""
    nodes = list(ast.walk(tree))
    quiet = set()                    # inside string formatting: f-strings, "..." % args
    for node in nodes:
        if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod)
                                               and isinstance(node.left, ast.Constant)
                                               and isinstance(node.left.value, str)):
            quiet |= {id(n) for n in ast.walk(node)}

    def inside(node) -> bool:
        return hasattr(node, "lineno") and any(a <= node.lineno and node.end_lineno <= b for a, b in ranges)

    found = []
    for i, node in enumerate(nodes):
        if not inside(node) or id(node) in quiet:
            continue
        if isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in SWAP_OPS:
            found.append((i, "arith", None))
        elif isinstance(node, ast.Compare):
            found += [(i, "compare", j) for j, op in enumerate(node.ops) if type(op) in FLIP_CMP]
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            found += [(i, "const", +1), (i, "const", -1)]
        if isinstance(node, ast.Call):
            if len(node.args) == 2 and not any(isinstance(a, ast.Starred) for a in node.args):
                found.append((i, "swap", None))
            found += [(i, "group", k) for k, kw in enumerate(node.keywords)
                      if kw.arg in ("group", "src", "dst", *PROCESS_KEYWORD)]
            if isinstance(node.func, ast.Attribute) and node.func.attr in ("get_rank", "get_world_size") \
                    and len(node.args) == 1:
                found.append((i, "group", "arg"))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            found.append((i, "delete", None))
    return found


def _apply(tree: ast.Module, where: tuple, lines: list[str] = ()) -> tuple[ast.Module, str]:
    """``tree`` with one change, made in place, and that change in words (``lines``: the cell's source lines)."""
    index, kind, detail = where
    nodes = list(ast.walk(tree))
    node = nodes[index]
    parent = {id(c): p for p in nodes for c in ast.iter_child_nodes(p)}
    before = _short(node)
    if kind == "arith":
        old = type(node.op)
        node.op = SWAP_OPS[old]()
        eq = "=" if isinstance(node, ast.AugAssign) else ""
        said = f"{SYMBOL[old]}{eq} -> {SYMBOL[type(node.op)]}{eq} in `{before}`"
    elif kind == "compare":
        old = type(node.ops[detail])
        node.ops[detail] = FLIP_CMP[old]()
        said = f"{SYMBOL[old]} -> {SYMBOL[type(node.ops[detail])]} in `{before}`"
    elif kind == "const":
        context = _short(parent[id(node)])
        if len(context) < 16 and lines:             # `-1`, `(2, 3)`: the cell's line says more
            context = re.sub(r"\s+#.*$", "", lines[node.lineno - 1]).strip()
        node.value += detail
        said = f"{node.value - detail} -> {node.value} in `{context}`"
    elif kind == "swap":
        node.args.reverse()
        said = f"arguments swapped in `{before}`"
    elif kind == "delete":
        holder = parent[id(node)]
        for field in ("body", "orelse", "finalbody"):
            block = getattr(holder, field, None)
            if isinstance(block, list) and node in block:
                block.remove(node)
                if not block:
                    block.append(ast.Pass())
        said = f"deleted `{before}`"
    else:                                                   # group
        if detail == "arg":
            node.args = []
            said = f"group argument dropped in `{before}`"
        else:
            kw = node.keywords[detail]
            if kw.arg == "group":
                node.keywords.pop(detail)
                said = f"group= dropped in `{before}`"
            elif kw.arg in PROCESS_KEYWORD:
                said = f"{kw.arg}= -> {PROCESS_KEYWORD[kw.arg]}= in `{before}`"
                kw.arg = PROCESS_KEYWORD[kw.arg]
            else:
                kw.value = ast.Constant(1 if isinstance(kw.value, ast.Constant) and kw.value.value == 0 else 0)
                said = f"{kw.arg}= -> {kw.arg}={kw.value.value} in `{before}`"
    ast.fix_missing_locations(tree)
    return tree, said


def _enclosing(tree: ast.Module) -> dict[int, str]:
    """For each node, the qualified name of the function (or class) it is in."""
    names: dict[int, str] = {}

    def visit(node, name):
        for child in ast.iter_child_nodes(node):
            here = name
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                here = f"{name}.{child.name}" if name else child.name
            names[id(child)] = here
            visit(child, here)
    visit(tree, "")
    return names


def mutants(lab: str, cell: dict, seed: int = SEED, cap: int = CAP) -> list[dict]:
    """At most ``cap`` mutants of an answer cell: id, kind, where, what changed, the cell's new source."""
    tree = ast.parse(cell["source"])
    original = ast.unparse(tree)
    nodes, names = list(ast.walk(tree)), _enclosing(tree)
    by_kind: dict[str, list[dict]] = {k: [] for k in KINDS}
    seen = {original}
    for where in _candidates(tree, solution_ranges(cell["source"])):
        # a tree of its own for each mutant: parsing again is several times cheaper than copy.deepcopy
        changed, said = _apply(ast.parse(cell["source"]), where, cell["source"].splitlines())
        text = ast.unparse(changed)
        if text in seen:
            continue
        try:
            compile(text, "<mutant>", "exec")
        except SyntaxError:
            continue
        seen.add(text)
        node = nodes[where[0]]
        by_kind[where[1]].append({"kind": where[1], "line": node.lineno, "function": names.get(id(node), ""),
                                  "change": said, "source": text + "\n",
                                  "order": (node.lineno, where[0], where[1], str(where[2]))})
    rng = random.Random(zlib.crc32(f"{seed}:{lab}:{cell['id']}".encode()))
    for kind in KINDS:
        rng.shuffle(by_kind[kind])
    chosen = []
    while len(chosen) < cap and any(by_kind.values()):
        for kind in KINDS:
            if by_kind[kind] and len(chosen) < cap:
                chosen.append(by_kind[kind].pop())
    chosen.sort(key=lambda m: m.pop("order"))
    for k, m in enumerate(chosen):
        m["id"] = f"{lab}/{cell['id']}/{k}"
        m["cell"] = cell["id"]
        m["describe"] = f"{m['function'] or cell['id']} (cell line {m['line']}, {m['kind']}): {m['change']}"
    return chosen


# ---------------------------------------------------------------------------- running the checks

class _Recorder:
    """Stands in for ``labs`` while a check cell runs: the part, the objects and the cases. (The headless
    checker has its own; this one stays here because ``--root`` may be a checkout from before it.)"""

    def __init__(self):
        self.found = []

    def Check(self, part, *objects):                      # noqa: N802 (the name the cell calls)
        found = {"part": part, "objects": objects, "cases": []}
        self.found.append(found)

        class _Check:
            def on(self, ranks, **params):
                found["cases"].append((ranks, params))
                return self

            def run(self, *args, **kwargs):
                pass

        return _Check()

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def _exec(source: str, filename: str, ns: dict) -> None:
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), ns)  # noqa: S102 (the course's own notebooks, mutated)


class Lab:
    """One lab of ``--root``: its set-up and check cells, with the answer cells of ``--mutants-from``."""

    def __init__(self, path: Path, answers_from: Path):
        self.name, self.path = path.name[:2], path
        self.cells = code_cells(path)
        theirs = {c["id"]: c for c in code_cells(answers_from) if c["solution"]}
        self.answers = [theirs.get(c["id"], {**c, "missing": True}) for c in self.cells if c["solution"]]
        self.same = {c["id"]: c["id"] in theirs and c["source"] == theirs[c["id"]]["source"]
                     for c in self.cells if c["solution"]}
        self.checks = [{**c, "visible": visible(c["source"]), "uses": depends(self.answers, check_objects(c["source"]))}
                       for c in self.cells if c["grade"]]

    def namespace(self, mutant: dict | None = None) -> dict:
        """A fresh kernel's globals after the set-up and answer cells (one answer mutated)."""
        ns = {"__name__": "__main__", "__builtins__": __builtins__}
        answers = {c["id"]: c for c in self.answers}
        for c in self.cells:
            if c["grade"] or (not c["solution"] and only_labs_calls(c["source"])):
                continue
            source = answers[c["id"]]["source"] if c["solution"] else c["source"]
            name = f"<lab {self.name} cell {c['id']}>"
            if mutant is not None and c["id"] == mutant["cell"]:
                source, name = mutant["source"], f"<lab {self.name} mutant {mutant['id']}>"
            _exec(source, name, ns)
        return ns

    def build(self, labs, ns: dict, check: dict):
        """The real check of one check cell, visible cases only, on the objects in ``ns``."""
        recorder = _Recorder()
        exec(compile(check["visible"], f"<lab {self.name} check {check['id']}>", "exec"),  # noqa: S102
             {**ns, "labs": recorder})
        [found] = recorder.found
        real = labs.Check(found["part"], *found["objects"])
        for ranks, params in found["cases"]:
            real.on(ranks, **dict(params))
        return real


def _verdict(labs, result) -> dict:
    text = str(result).strip()
    if isinstance(result, labs.Report):
        return {"verdict": "pass", "said": text.splitlines()[0] if text else ""}
    lines = text.splitlines()
    said = " / ".join(line.strip() for line in lines[:4])
    said = said if len(said) <= 400 else said[:399] + "…"
    if isinstance(result, labs.LabFailure):
        return {"verdict": "fail", "said": said}
    return {"verdict": "error", "said": f"{type(result).__name__}: {said}"}


def run_checks(labs, checks: list, deadline: float, group_timeout: float) -> list:
    """``labs.run_many`` over ``checks``; one that a cut-short batch may have failed runs again alone."""
    results = labs.run_many(checks, deadline=deadline, group_timeout=group_timeout) if checks else []
    for i, (check, result) in enumerate(zip(checks, results)):
        if len(checks) > 1 and isinstance(result, labs.LabFailure) and \
                any(w in str(result).split("\n")[0] for w in CUT_SHORT):
            results[i] = labs.run_many([check], deadline=max(60.0, group_timeout * 8),
                                       group_timeout=group_timeout)[0]
    return results


def run_lab(labs, lab: Lab, args) -> dict:
    start = time.monotonic()
    out = {"lab": lab.path.name, "answers_identical": lab.same, "baseline": {}, "mutants": []}
    if any(not same for same in lab.same.values()):
        print(f"  note: answer cells that differ from --root's: {[k for k, v in lab.same.items() if not v]}")
    # The unmutated answers: every visible check must pass.
    ns = lab.namespace()
    base = run_checks(labs, [lab.build(labs, ns, c) for c in lab.checks], 120.0, args.group_timeout)
    out["baseline"] = {c["id"]: _verdict(labs, r) for c, r in zip(lab.checks, base)}
    bad = {k: v for k, v in out["baseline"].items() if v["verdict"] != "pass"}
    if bad:
        print(f"  WARNING: the unmutated answers fail {sorted(bad)}: {bad}")
    for cell in lab.answers:
        todo = [m for m in mutants(lab.name, cell, args.seed, args.cap)
                if not args.only or m["id"] in args.only]
        checks_of_cell = [c for c in lab.checks if cell["id"] in c["uses"]]
        built, where = [], []                         # the Check objects, and (mutant, check cell) of each
        for m in todo:
            m["checks"] = {}
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    ns = lab.namespace(m)
            except Exception as exc:                  # noqa: BLE001 (the mutated cell raised: the kernel would)
                m["status"], m["error"] = "error", f"the cell raised {type(exc).__name__}: {exc}"
                continue
            for c in checks_of_cell:
                try:
                    built.append(lab.build(labs, ns, c))
                    where.append((m, c))
                except Exception as exc:              # noqa: BLE001
                    m["checks"][c["id"]] = {"verdict": "error", "said": f"{type(exc).__name__}: {exc}"}
        cases = sum(len(b.cases) for b in built)
        results = run_checks(labs, built, 60.0 + (args.group_timeout + 2.0) * cases, args.group_timeout)
        for (m, c), r in zip(where, results):
            m["checks"][c["id"]] = _verdict(labs, r)
        for m in todo:
            if "status" not in m:
                verdicts = [v["verdict"] for v in m["checks"].values()]
                m["status"] = ("rejected" if "fail" in verdicts else "error" if "error" in verdicts or not verdicts
                               else "survived")
            out["mutants"].append(m)
    counts = {s: sum(m["status"] == s for m in out["mutants"]) for s in ("rejected", "survived", "error")}
    out.update(total=len(out["mutants"]), **counts, seconds=round(time.monotonic() - start, 1))
    return out


def report(result: dict) -> None:
    """Per lab: mutants, rejected, survived (one line each), errors; then the totals."""
    for name, lab in result["labs"].items():
        print(f"lab {name}: {lab['total']} mutants, {lab['rejected']} rejected, {lab['survived']} survived, "
              f"{lab['error']} errors ({lab['seconds']} s)")
        for m in lab["mutants"]:
            if m["status"] == "survived":
                print(f"  survived {m['id']}: {m['describe']}")
            elif m["status"] == "error":
                why = m.get("error") or "; ".join(v["said"] for v in m["checks"].values() if v["verdict"] == "error")
                print(f"  error    {m['id']}: {m['describe']} -- {why[:200]}")
    t = result["totals"]
    print(f"total: {t['total']} mutants, {t['rejected']} rejected, {t['survived']} survived, {t['error']} errors "
          f"in {result['seconds']} s ({result['root']} at {result['commit']})")


# ---------------------------------------------------------------------------- comparing two runs

def _order(mutant_id: str) -> tuple:
    lab, cell, k = mutant_id.split("/")
    return lab, cell, int(k)


def compare(old_path: Path, new_path: Path) -> None:
    old, new = (json.loads(Path(p).read_text()) for p in (old_path, new_path))
    print(f"old: {old['root']} at {old['commit']}; new: {new['root']} at {new['commit']}")
    print(f"{'lab':<4} {'old rejected/total':>19} {'new rejected/total':>19}  (survived, errors old -> new)")
    for name in sorted(set(old["labs"]) | set(new["labs"])):
        o, n = old["labs"].get(name, {}), new["labs"].get(name, {})
        print(f"{name:<4} {o.get('rejected', 0):>10}/{o.get('total', 0):<8} {n.get('rejected', 0):>10}/"
              f"{n.get('total', 0):<8}  ({o.get('survived', 0)} -> {n.get('survived', 0)}, "
              f"{o.get('error', 0)} -> {n.get('error', 0)})")
    to, tn = old["totals"], new["totals"]
    print(f"all  {to['rejected']:>10}/{to['total']:<8} {tn['rejected']:>10}/{tn['total']:<8}  "
          f"({to['survived']} -> {tn['survived']}, {to['error']} -> {tn['error']})")
    # The same mutant is the same mutated cell (ids are stable too, but the code is what matters).
    after = {m["id"]: m for lab in new["labs"].values() for m in lab["mutants"]}
    same = {(m["cell"], m["source"]): i for i, m in after.items()}
    before = {same[(m["cell"], m["source"])]: m for lab in old["labs"].values() for m in lab["mutants"]
              if (m["cell"], m["source"]) in same}
    unmatched = sum(len(lab["mutants"]) for lab in old["labs"].values()) - len(before)
    if unmatched or len(before) != len(after):
        print(f"WARNING: {unmatched} old mutants have no new twin; {len(after) - len(before)} new ones no old one")

    def changed(title: str, was: str, now: str, shown: dict, who: str) -> None:
        ids = sorted((i for i in before.keys() & after.keys()
                      if before[i]["status"] == was and after[i]["status"] == now), key=_order)
        print(f"\n{title}: {len(ids)}")
        for i in ids:
            print(f"  {i}: {after[i]['describe']}")
            for cid, v in shown[i]["checks"].items():
                if v["verdict"] == "fail":
                    print(f"      {who} {cid}: {v['said'][:300]}")

    changed("Regressions (rejected by the old checks, survive the new)", "rejected", "survived", before, "old")
    changed("Improvements (survived the old checks, rejected by the new)", "survived", "rejected", after, "new")
    both = sorted((i for i in before.keys() & after.keys()
                   if before[i]["status"] == "survived" and after[i]["status"] == "survived"), key=_order)
    print(f"\nSurvive in both: {len(both)}")
    for i in both:
        print(f"  {i}: {after[i]['describe']}")


# ---------------------------------------------------------------------------- main

def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=HERE, help="the checkout whose checks run (default: this one)")
    parser.add_argument("--mutants-from", type=Path, default=HERE,
                        help="the checkout whose answer cells are mutated (default: this one)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--labs", nargs="*", default=[], help="only these labs (by number: 00 04)")
    parser.add_argument("--only", nargs="*", default=[], help="only these mutant ids (LAB/CELL/K)")
    parser.add_argument("--cap", type=int, default=CAP, help="mutants per answer cell")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--group-timeout", type=float, default=GROUP_TIMEOUT,
                        help="seconds a case's group waits for a peer (a deadlocked mutant costs this per case)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD.json", "NEW.json"),
                        help="compare two runs' JSON instead of running")
    args = parser.parse_args(argv)
    if args.compare:
        compare(*args.compare)
        return 0
    root, source = args.root.resolve(), args.mutants_from.resolve()
    os.chdir(root)                                      # as the notebook's kernel: in the checkout
    sys.path.insert(0, str(root))                       # its intralayer, not the installed one
    os.environ["PYTHONPATH"] = str(root) + (os.pathsep + os.environ["PYTHONPATH"]
                                            if os.environ.get("PYTHONPATH") else "")
    from intralayer import labs
    if Path(labs.__file__).resolve().parents[2] != root:
        raise SystemExit(f"imported {labs.__file__}, not the labs of {root}")
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    start = time.monotonic()
    result = {"root": str(root), "commit": commit, "mutants_from": str(source), "seed": args.seed, "cap": args.cap,
              "group_timeout": args.group_timeout, "labs": {}}
    for path in lab_notebooks(root):
        if args.labs and path.name[:2] not in args.labs:
            continue
        theirs = source / "solutions" / "labs" / path.name
        if not theirs.is_file():
            print(f"lab {path.name[:2]}: {theirs} missing, skipped")
            continue
        print(f"lab {path.name}…", flush=True)
        result["labs"][path.name[:2]] = run_lab(labs, Lab(path, theirs), args)
        result["seconds"] = round(time.monotonic() - start, 1)
        if args.out:                                  # after each lab: a long run leaves what it has
            args.out.write_text(json.dumps(result, indent=1))
    result["seconds"] = round(time.monotonic() - start, 1)
    result["totals"] = {k: sum(lab[k] for lab in result["labs"].values())
                        for k in ("total", "rejected", "survived", "error")}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    report(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
