"""The prose and the printed numbers cannot drift apart.

Each chapter has ``tests/claims/<chapter>.toml``: the numbers its prose quotes, each beside the
stored output that proves it::

    [[claim]]
    prose = "24 of 128 assignments go over capacity"     # text of one markdown cell
    output = "assignments over capacity: 24 of 128"       # text output of one code cell

nbval re-executes every chapter and compares the stored outputs (strict), so an output a claim
quotes is what the code prints today; this test ties the prose to it. A claim holds when

* ``prose`` is in a markdown cell and ``output`` in the text output of a code cell that nbval
  checks (not tagged ``nbval-ignore-output``: a varying output cannot back a sentence);
* every number in ``prose`` is a number in ``output`` (so a changed result, or an edited
  sentence, breaks the claim rather than leaving a stale number behind).

Whitespace runs count as one space on both sides. Learner-facing text also never calls the
opening example by its internal name, and every chapter links the notation and glossary pages.
"""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
CLAIMS = ROOT / "tests" / "claims"
IGNORED = ("nbval-ignore-output", "nbval-skip")
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")


def squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def numbers(text: str) -> list[float]:
    """The numbers written in ``text``: 1,277 → 1277; 2(t−1) gives 2 and 1."""
    return [float(m.replace(",", "")) for m in NUMBER.findall(text) if any(c.isdigit() for c in m)]


def cell_text(cell) -> str:
    """The text a code cell printed or returned (what nbval compares)."""
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif "data" in out and "text/plain" in out.data:
            parts.append(out.data["text/plain"])
    return squash("".join(parts))


def checked(cell) -> bool:
    tags = cell.get("metadata", {}).get("tags", [])
    return not any(t in tags for t in IGNORED) and "NBVAL_IGNORE_OUTPUT" not in cell.source


def load(chapter: Path) -> list[dict]:
    path = CLAIMS / f"{chapter.stem}.toml"
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: list the numbers the chapter's prose quotes"
    claims = tomllib.loads(path.read_text()).get("claim", [])
    for i, claim in enumerate(claims):
        unknown = set(claim) - {"prose", "output", "why"}
        assert not unknown, f"claim {i} of {path.name}: unknown keys {sorted(unknown)}"
        assert {"prose", "output"} <= set(claim), f"claim {i} of {path.name} needs prose and output"
    return claims


def problems(nb, claims: list[dict]) -> list[str]:
    """What is wrong with ``claims`` against the notebook ``nb``: one sentence per broken rule."""
    prose = [squash(c.source) for c in nb.cells if c.cell_type == "markdown"]
    outputs = [cell_text(c) for c in nb.cells if c.cell_type == "code" and checked(c)]
    unchecked = [cell_text(c) for c in nb.cells if c.cell_type == "code" and not checked(c)]
    found = []
    for claim in claims:
        said, shown = squash(claim["prose"]), squash(claim["output"])
        if not numbers(said):
            found.append(f"no number in the prose quote {said!r}")
        if not any(said in p for p in prose):
            found.append(f"the prose no longer says {said!r}")
        if not any(shown in o for o in outputs):
            where = " (it is in a cell nbval does not check)" if any(shown in o for o in unchecked) else ""
            found.append(f"no checked output prints {shown!r}{where}")
        missing = [n for n in numbers(said) if n not in numbers(shown)]
        if missing:
            found.append(f"{said!r} states {missing}, which {shown!r} does not print")
    return found


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_every_quoted_number_is_printed(chapter):
    claims = load(chapter)
    assert len(claims) >= 3, f"{chapter.stem}: only {len(claims)} claims; quote what the chapter computes"
    found = problems(nbformat.read(chapter, as_version=4), claims)
    assert not found, f"{chapter.stem}:\n  " + "\n  ".join(found)


def test_numbers_are_read_as_written():
    assert numbers("24 of 128, loss 1.277, 1,024 tokens, 2(t-1)/t, H100, GPT-3") == [24, 128, 1.277, 1024, 2, 1, 3]


def test_a_drifted_claim_is_caught():
    md = nbformat.v4.new_markdown_cell("The router sends 39 assignments to the last expert.")
    code = nbformat.v4.new_code_cell("print(counts)", outputs=[nbformat.v4.new_output("stream", text="counts: [6, 39]\n")])
    ignored = nbformat.v4.new_code_cell("print(t)", metadata={"tags": ["nbval-ignore-output"]},
                                        outputs=[nbformat.v4.new_output("stream", text="took 3.5 s\n")])
    nb = nbformat.v4.new_notebook(cells=[md, code, ignored])
    assert problems(nb, [{"prose": "sends 39 assignments", "output": "counts: [6, 39]"}]) == []
    assert "states [38.0]" in problems(nb, [{"prose": "sends 38", "output": "counts: [6, 39]"}])[-1]
    assert "no longer says" in problems(nb, [{"prose": "sends 40 assignments", "output": "39"}])[0]
    assert "does not check" in problems(nb, [{"prose": "The router sends 39", "output": "took 3.5 s"}])[0]
    assert "no number" in problems(nb, [{"prose": "The router", "output": "counts"}])[0]


def test_every_claims_file_belongs_to_a_chapter():
    stems = {c.stem for c in CHAPTERS}
    strays = [p.name for p in CLAIMS.glob("*.toml") if p.stem not in stems]
    assert not strays, f"claims for no chapter: {strays}"


LEARNER_FACING = CHAPTERS + sorted((ROOT / "solutions").glob("**/*.ipynb")) + sorted((ROOT / "book").glob("*.md")) \
    + [ROOT / "README.md"]


@pytest.mark.parametrize("page", LEARNER_FACING, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_opening_example_is_called_so(page):
    if page.suffix == ".ipynb":
        nb = nbformat.read(page, as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
        text += "\n".join(line for c in nb.cells if c.cell_type == "code"
                          for line in c.source.splitlines() if "#" in line or "print" in line)
    else:
        text = page.read_text()
    assert not re.search(r"\bseed (lesson|example)", text, re.I), \
        f"{page.name} calls it the seed lesson/example; learners know it as the opening example"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda p: p.stem)
def test_every_chapter_links_notation_and_glossary(chapter):
    nb = nbformat.read(chapter, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for page in ("notation", "glossary"):
        assert re.search(rf"\]\(\.\./book/{page}(\.md)?\)", text), f"{chapter.stem} does not link book/{page}.md"
