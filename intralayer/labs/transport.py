"""The learner's functions and classes, from the notebook to the ranks, by value (cloudpickle).

cloudpickle sends a function or class defined in the notebook by value (code, helpers, classes
and constants it uses, aliases included) and one from an importable module by reference.
:func:`pack` first follows the global names the code reads, as cloudpickle does, and refuses in
words what should not travel: a notebook tensor or model (the check builds every input on the
rank), a lambda, and what the lab forbids (its answer from the library). :func:`unwritten` finds
a body that starts with ``raise NotImplementedError`` (a blank exercise); :meth:`Package.where`
maps a frame of a rank's traceback to "line 3 of ring_all_reduce".
"""
from __future__ import annotations

import builtins
import dis
import linecache
import sys
import types
from dataclasses import dataclass, field

import cloudpickle
import torch


class SourceError(AssertionError):
    """The learner's code cannot be sent to the ranks (an ``AssertionError``: a failed check)."""


@dataclass
class Package:
    """The pickled objects, and where the learner's functions are. Plain data only, so that a process
    that runs none of the learner's code can hold it (the headless checker)."""

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


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _span(fn: types.FunctionType) -> tuple[str, int, int, int, str]:
    code = fn.__code__
    last = max((line for c in _codes(code) for _, line in dis.findlinestarts(c) if line), default=code.co_firstlineno)
    lines = range(code.co_firstlineno, last + 1)      # its def line: after any decorators
    start = next((i for i in lines if linecache.getline(code.co_filename, i).lstrip().startswith(("def ", "async def "))),
                 code.co_firstlineno)
    return code.co_filename, code.co_firstlineno, last, start, fn.__qualname__


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


def by_value(obj) -> bool:
    """cloudpickle's rule, in short: what no importable module holds under its name travels by value."""
    target = sys.modules.get(getattr(obj, "__module__", None) or "")
    if target is None or target.__name__ == "__main__":
        return True
    for part in getattr(obj, "__qualname__", "?").split("."):
        target = getattr(target, part, None)
    return target is not obj


def _constant(value) -> bool:
    if isinstance(value, (bool, int, float, str, type(None), torch.dtype)):
        return True
    if isinstance(value, dict):
        return all(_constant(k) and _constant(v) for k, v in value.items())
    return isinstance(value, (tuple, list, frozenset, set)) and all(_constant(v) for v in value)


def read_globals(fn: types.FunctionType) -> list[tuple[str, object]]:
    """The globals and closure cells a function's code reads, with their values."""
    names = dict.fromkeys(ins.argval for code in _codes(fn.__code__) for ins in dis.get_instructions(code)
                          if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"))
    found = [(n, fn.__globals__[n]) for n in names if n in fn.__globals__]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            found.append((name, cell.cell_contents))
        except ValueError:                                      # a cell not filled yet
            pass
    return found


def _learners(objects: dict[str, object]):
    """Every function and class of the learner's that ``objects`` use: (name it is used by, object, who uses it)."""
    own = {getattr(obj, "__module__", None) for obj in objects.values()}
    todo, seen = [(name, obj, obj.__qualname__) for name, obj in objects.items()], set()
    while todo:
        name, obj, shown = todo.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        yield name, obj, shown
        for fn in functions_of(obj):
            for used, value in read_globals(fn):
                if isinstance(value, (types.FunctionType, type)) and (by_value(value) or value.__module__ in own):
                    todo.append((used, value, value.__qualname__))
        todo += [(b.__name__, b, b.__qualname__) for b in getattr(obj, "__bases__", ()) if b is not object and by_value(b)]


def pack(objects: dict[str, object], forbidden=None) -> Package:
    """The package of ``objects`` (``{name the check uses: object}``) and of the learner's functions and
    classes they use, each under the name its caller uses (an alias too). ``forbidden(name, value)``
    may return why a global cannot be used; it is raised as :class:`SourceError`."""
    for shown, obj in objects.items():
        if not isinstance(obj, (types.FunctionType, type)):
            raise SourceError(f"{shown} is a {type(obj).__name__}, not a function or class defined in the notebook")
        if forbidden is not None and (why := forbidden(shown, obj)):
            raise SourceError(f"{obj.__name__} comes from {obj.__module__}: {why}")
    uses, functions = {}, []
    for name, obj, shown in _learners(objects):
        uses.setdefault(name, obj)
        uses.setdefault(obj.__name__, obj)
        if obj.__name__ == "<lambda>":
            raise SourceError(f"{shown} is a lambda, which cannot be sent to the ranks: write it as a def")
        for fn in functions_of(obj):
            functions.append(fn)
            for used, value in read_globals(fn):
                if forbidden is not None and (why := forbidden(used, value)):
                    raise SourceError(f"{shown} uses {used}: {why}")
                if not (isinstance(value, (types.ModuleType, types.BuiltinFunctionType, types.FunctionType, type))
                        or _constant(value) or getattr(builtins, used, None) is value):
                    raise SourceError(
                        f"{shown} uses the notebook variable {used} (a {type(value).__name__}), which cannot be "
                        "sent to the ranks: only functions, classes, modules and constants travel. Create it "
                        "inside the function, or pass it in as an argument.")
    spans = [_span(fn) for fn in functions]
    lines = {file: linecache.getlines(file) for file in {span[0] for span in spans}}
    return Package(cloudpickle.dumps({**uses, **objects}), spans, lines)


def _blank(fn: types.FunctionType) -> bool:
    """Its body starts with ``raise NotImplementedError`` (after a docstring, if any)."""
    ins = [i for i in dis.get_instructions(fn) if i.opname not in
           ("RESUME", "NOP", "COPY_FREE_VARS", "MAKE_CELL", "PUSH_NULL", "PRECALL", "CALL", "CACHE")]
    return len(ins) >= 2 and ins[0].opname == "LOAD_GLOBAL" and ins[0].argval == "NotImplementedError" \
        and ins[1].opname == "RAISE_VARARGS"


def unwritten(objects: dict[str, object]) -> list[str]:
    """Qualified names of the functions and methods (the handed ones and the learner's they use) whose
    body starts with ``raise NotImplementedError``."""
    found = [fn.__qualname__ for _, obj, _ in _learners(objects) for fn in functions_of(obj) if _blank(fn)]
    return list(dict.fromkeys(found))
