"""The learner's functions and classes, from the notebook to the ranks, by value.

A rank is another process: it cannot see the notebook's variables. :func:`pack` hands the
objects a check names to ``cloudpickle``, which sends a function or class defined in the
notebook by value (its code, and the helpers, classes and constants it uses, aliases
included) and one from an importable module by reference. Before that, :func:`pack`
follows the global names the code reads (``LOAD_GLOBAL``, as cloudpickle does) and refuses,
in words, what should not travel: a notebook tensor or model (the check builds every
input on the rank; an object that happens to be in the kernel would make the check
depend on it), a lambda, and anything the lab forbids (its answer from the library).

:func:`unwritten` finds a function whose body starts with ``raise NotImplementedError`` —
what nbgrader leaves in a blank exercise — so that a check says "not written yet" at once.
:meth:`Package.where` maps a frame of a rank's traceback back to "line 3 of ring_all_reduce".
"""
from __future__ import annotations

import builtins
import dis
import linecache
import math
import sys
import types
from dataclasses import dataclass, field

import cloudpickle
import torch


class SourceError(AssertionError):
    """The learner's code cannot be sent to the ranks. An ``AssertionError``, so that it reads as a
    failed check (nbgrader scores any error in a graded cell as zero)."""


@dataclass
class Package:
    """The pickled objects, and where the learner's functions are, to name the lines of a traceback.

    Plain data only (no function objects), so that a process that runs none of the learner's code
    can hold it: the headless checker (:mod:`intralayer.labs.__main__`)."""

    payload: bytes
    spans: list[tuple[str, int, int, int, str]] = field(default_factory=list)   # file, first, last, def, name
    lines: dict[str, list[str]] = field(default_factory=dict)                   # each file's source lines

    @property
    def files(self) -> list[str]:
        return sorted({span[0] for span in self.spans})

    def where(self, file: str, line: int) -> str | None:
        """'line 3 of ring_all_reduce' (1 = its def line) for a frame in the learner's code, else None."""
        inside = [s for s in self.spans if s[0] == file and s[1] <= line <= s[2]]
        if not inside:
            return None
        _, _, _, start, name = max(inside, key=lambda s: s[1])
        return f"line {line - start + 1} of {name}"

    def line(self, file: str, line: int, width: int = 90) -> str:
        lines = self.lines.get(file, [])
        text = lines[line - 1].strip() if 0 < line <= len(lines) else ""
        return text if len(text) <= width else text[:width - 1] + "…"


def _def_line(fn: types.FunctionType) -> int:
    """The line of its ``def`` (``co_firstlineno`` is that of its first decorator)."""
    code = fn.__code__
    for line in range(code.co_firstlineno, _last_line(code) + 1):
        if linecache.getline(code.co_filename, line).lstrip().startswith(("def ", "async def ")):
            return line
    return code.co_firstlineno


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _last_line(code: types.CodeType) -> int:
    return max((line for c in _codes(code) for _, line in dis.findlinestarts(c) if line), default=code.co_firstlineno)


def functions_of(obj) -> list[types.FunctionType]:
    """A function itself, or a class's own methods (static, class, property getters too)."""
    if isinstance(obj, types.FunctionType):
        return [obj]
    found = []
    for value in vars(obj).values():
        fn = getattr(value, "__func__", value)
        fn = fn.fget if isinstance(fn, property) else fn
        if isinstance(fn, types.FunctionType):
            found.append(fn)
    return found


def _by_value(obj) -> bool:
    """cloudpickle's rule, in short: what no importable module holds under its name travels by value."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None or module.__name__ == "__main__":
        return True
    target = module
    for part in getattr(obj, "__qualname__", "?").split("."):
        target = getattr(target, part, None)
    return target is not obj


def _constant(value) -> bool:
    if isinstance(value, (bool, int, str, type(None), torch.dtype)):
        return True
    if isinstance(value, float):
        return math.isfinite(value) or math.isinf(value) or math.isnan(value)
    if isinstance(value, (tuple, list, frozenset, set)):
        return all(_constant(v) for v in value)
    if isinstance(value, dict):
        return all(_constant(k) and _constant(v) for k, v in value.items())
    return False


def _travels(name: str, value) -> bool:
    """A module, a constant, a builtin, or a function or class an importable module holds (by reference)."""
    if isinstance(value, (types.ModuleType, types.BuiltinFunctionType)) or _constant(value) \
            or getattr(builtins, name, None) is value:
        return True
    return isinstance(value, (types.FunctionType, type)) and not _by_value(value)


def read_globals(fn: types.FunctionType) -> list[tuple[str, object]]:
    names = dict.fromkeys(ins.argval for code in _codes(fn.__code__) for ins in dis.get_instructions(code)
                          if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"))
    found = [(n, fn.__globals__[n]) for n in names if n in fn.__globals__]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            found.append((name, cell.cell_contents))
        except ValueError:                                      # a cell not filled yet
            pass
    return found


def pack(objects: dict[str, object], forbidden=None) -> Package:
    """The package of ``objects`` (``{name the check uses: object}``) and of the learner's functions
    and classes their code uses, each under its own name.

    ``forbidden(name, value)`` may return a sentence saying why a global cannot be used (the
    lab's answer from the library, say); it is raised as :class:`SourceError`.
    """
    functions: list[types.FunctionType] = []
    seen: set[int] = set()
    own = {getattr(obj, "__module__", None) for obj in objects.values()}     # the learner's module(s)
    uses: dict[str, object] = {}                     # every function and class of the learner's, by name

    def visit(obj, shown: str) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        uses.setdefault(obj.__name__, obj)
        if isinstance(obj, types.FunctionType) and obj.__name__ == "<lambda>":
            raise SourceError(f"{shown} is a lambda, which cannot be sent to the ranks: write it as a def")
        for fn in functions_of(obj):
            functions.append(fn)
            for name, value in read_globals(fn):
                if forbidden is not None and (why := forbidden(name, value)):
                    raise SourceError(f"{shown} uses {name}: {why}")
                if isinstance(value, (types.FunctionType, type)) and (_by_value(value) or value.__module__ in own):
                    uses.setdefault(name, value)                 # under the name the code uses (an alias)
                    visit(value, value.__qualname__)
                elif not _travels(name, value):
                    raise SourceError(
                        f"{shown} uses the notebook variable {name} (a {type(value).__name__}), which cannot be "
                        "sent to the ranks: only functions, classes, modules and constants travel. Create it "
                        "inside the function, or pass it in as an argument.")
        for base in getattr(obj, "__bases__", ()):
            if _by_value(base) and base is not object:
                visit(base, base.__qualname__)

    for shown, obj in objects.items():
        if not isinstance(obj, (types.FunctionType, type)):
            raise SourceError(f"{shown} is a {type(obj).__name__}, not a function or class defined in the notebook")
        if forbidden is not None and (why := forbidden(shown, obj)):
            raise SourceError(f"{getattr(obj, '__name__', shown)} comes from {getattr(obj, '__module__', '?')}: {why}")
        visit(obj, obj.__qualname__)
    # The rank sees the helpers too, by name (a later part's check looks for the earlier part's function).
    spans = [(fn.__code__.co_filename, fn.__code__.co_firstlineno, _last_line(fn.__code__), _def_line(fn),
              fn.__qualname__) for fn in functions]
    lines = {file: linecache.getlines(file) for file in {span[0] for span in spans}}
    return Package(cloudpickle.dumps({**uses, **objects}), spans, lines)


def _blank(fn: types.FunctionType) -> bool:
    """Its body starts with ``raise NotImplementedError`` (after a docstring, if any)."""
    ins = [i for i in dis.get_instructions(fn) if i.opname not in
           ("RESUME", "NOP", "COPY_FREE_VARS", "MAKE_CELL", "PUSH_NULL", "PRECALL", "CALL", "CACHE")]
    return len(ins) >= 2 and ins[0].opname == "LOAD_GLOBAL" and ins[0].argval == "NotImplementedError" \
        and ins[1].opname == "RAISE_VARARGS"


def unwritten(objects: dict[str, object]) -> list[str]:
    """Qualified names of the handed functions and methods, and the learner's functions they use, whose
    body starts with ``raise NotImplementedError``."""
    found: list[str] = []
    seen: set[int] = set()

    def visit(obj) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for fn in functions_of(obj):
            if _blank(fn) and fn.__qualname__ not in found:
                found.append(fn.__qualname__)
            for _, value in read_globals(fn):
                if isinstance(value, (types.FunctionType, type)) and _by_value(value):
                    visit(value)

    for obj in objects.values():
        visit(obj)
    return found
