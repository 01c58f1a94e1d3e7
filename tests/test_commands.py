"""Every torchrun command the course prints would start the program it names, with the
arguments it shows.

After ``-m module`` torchrun's own parser still reads anything that abbreviates one of its
options (``--s`` could be ``--standalone``; ``--h`` is ``--help``), so a command can look right
and fail before a rank starts. Each command in the README, the book's pages, the chapters'
prose and the programs' docstrings is parsed here by torchrun's parser and then by the
program's own, without starting anything.
"""
from __future__ import annotations

import importlib
import inspect
import re
import shlex
from pathlib import Path

import nbformat
import pytest
from torch.distributed.run import get_args_parser

ROOT = Path(__file__).resolve().parent.parent
LAUNCHER = re.compile(r"(?:torchrun|python -m torch\.distributed\.run)\s+-")       # a command, not the word


def sources() -> dict[str, str]:
    texts = {p.relative_to(ROOT).as_posix(): p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "book").glob("*.md"))]}
    for p in sorted((ROOT / "chapters").glob("*.ipynb")):
        nb = nbformat.read(p, as_version=4)
        texts[p.relative_to(ROOT).as_posix()] = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for p in sorted((ROOT / "intralayer" / "programs").glob("*.py")):
        texts[p.relative_to(ROOT).as_posix()] = importlib.import_module(f"intralayer.programs.{p.stem}").__doc__ or ""
    return texts


def commands(text: str) -> list[str]:
    """The torchrun commands in ``text``: backslash continuations joined, cut at a code span's end."""
    text = re.sub(r"\\\\?\n\s*", " ", text)                      # `\` (or `\\` in a docstring) + newline
    parts = text.split("```")                                   # outside fenced blocks, a `code span`
    for i in range(0, len(parts), 2):                           # may break across lines: join it
        parts[i] = re.sub(r"`[^`]*`", lambda m: m.group(0).replace("\n", " "), parts[i])
    text = "```".join(parts)
    found = []
    for line in text.splitlines():
        for m in LAUNCHER.finditer(line):
            rest = line[m.start():]
            rest = re.split(r"`|\s\|\s|\s#\s|\s\(", rest)[0]       # end of code span, table cell, comment
            if " -m " in rest:                                  # not a mention such as `torchrun --standalone`
                found.append(rest.strip().rstrip(".,;:"))
    return found


ALL = [(where, cmd) for where, text in sources().items() for cmd in commands(text)]


def test_the_commands_are_found():
    assert len(ALL) >= 20, f"only {len(ALL)} torchrun commands found: the scanner is broken"
    assert {where.split("/")[0] for where, _ in ALL} >= {"README.md", "book", "chapters", "intralayer"}


@pytest.mark.parametrize("where, command", ALL, ids=[f"{w}:{i}" for i, (w, _) in enumerate(ALL)])
def test_a_printed_command_parses(where, command, monkeypatch):
    words = shlex.split(command)
    start = next(i for i, w in enumerate(words) if w == "torchrun" or w == "torch.distributed.run") + 1
    words = words[start:]
    module = words[words.index("-m") + 1]
    shown = words[words.index("-m") + 2:]
    try:
        parsed = get_args_parser().parse_args(words)
    except SystemExit:
        pytest.fail(f"{where}: torchrun refuses {command!r} (an option of the program abbreviates one of torchrun's?)")
    assert parsed.module and parsed.training_script == module, f"{where}: torchrun would run {parsed.training_script}"
    assert parsed.training_script_args == shown, \
        f"{where}: torchrun hands the program {parsed.training_script_args}, not {shown}"
    if not module.startswith("intralayer.programs.") or not shown:
        return                                                # no arguments: nothing of the program's to parse
    program = importlib.import_module(module)

    class Started(Exception):
        pass

    def stop(*args, **kwargs):
        raise Started

    assert inspect.unwrap(program.main).__code__.co_argcount == 1, f"{where}: {module}.main takes no arguments, yet {shown} are shown"
    monkeypatch.setattr(program.distributed, "setup", stop)
    try:
        program.main(shown)
    except Started:
        pass                                                  # its arguments parsed; it got as far as set-up
    except SystemExit as exc:
        pytest.fail(f"{where}: {module} refuses its arguments {shown}: exit {exc.code}")
