"""The learner's functions and classes, from the notebook to the ranks, by value (cloudpickle).

cloudpickle sends a function or class defined in the notebook by value (code, helpers, classes
and constants it uses, aliases included) and one from an importable module by reference.
:func:`pack` first follows the global names the code reads, as cloudpickle does, and refuses in
words what should not travel: a notebook tensor or model (the check builds every input on the
rank), a lambda, and what the lab forbids (its answer from the library). It also finds the bodies
that start with ``raise NotImplementedError`` (a blank exercise); :meth:`Package.at` maps a
rank's traceback to "at line 3 of ring_all_reduce: `its code`".
"""
from __future__ import annotations

import builtins
import contextlib
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
    """The pickled objects, where the learner's functions are, and which are blank. Plain data only, so
    that a process that runs none of the learner's code can hold it (the headless checker)."""

    payload: bytes
    spans: list[tuple[str, int, int, int, str]] = field(default_factory=list)   # file, first, last, def, name
    lines: dict[str, list[str]] = field(default_factory=dict)                   # each file's source lines
    blank: list[str] = field(default_factory=list)                              # functions not written yet

    @property
    def files(self) -> list[str]:
        return sorted(self.lines)

    def at(self, frames, code: bool = True) -> str:
        """' at line 3 of f: `its code` (called from line 9 of g)' for the learner's innermost frame among
        ``frames`` (file, line, ...; outermost first), line 1 being the def line; '' if none is the learner's."""
        places = []
        for file, line, *_ in frames:
            if inside := [s for s in self.spans if s[0] == file and s[1] <= line <= s[2]]:
                *_, start, name = max(inside, key=lambda s: s[1])
                places.append((f"line {line - start + 1} of {name}", file, line))
        if not places:
            return ""
        (place, file, line), callers = places[-1], [p[0] for p in places[:-1]][-3:]
        text = self.lines[file][line - 1].strip() if 0 < line <= len(self.lines[file]) else ""
        return f" at {place}" + (f": `{text if len(text) <= 90 else text[:89] + '…'}`" if code else "") + \
            (f" (called from {', '.join(reversed(callers))})" if callers and code else "")


def _codes(code: types.CodeType):
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _span(fn: types.FunctionType) -> tuple[str, int, int, int, str]:
    code = fn.__code__
    last = max((line for c in _codes(code) for _, line in dis.findlinestarts(c) if line), default=code.co_firstlineno)
    start = next((i for i in range(code.co_firstlineno, last + 1)           # its def line: after any decorators
                  if linecache.getline(code.co_filename, i).lstrip().startswith(("def ", "async def "))), code.co_firstlineno)
    return code.co_filename, code.co_firstlineno, last, start, fn.__qualname__


def functions_of(obj) -> list[types.FunctionType]:
    """A function itself, or a class's own methods (static, class, property getters too)."""
    found = [obj] if isinstance(obj, types.FunctionType) else \
        [getattr(v, "__func__", getattr(v, "fget", v)) for v in vars(obj).values()]
    return [fn for fn in found if isinstance(fn, types.FunctionType)]


def by_value(obj) -> bool:
    """cloudpickle's rule, in short: what no importable module holds under its name travels by value."""
    target = sys.modules.get(getattr(obj, "__module__", None) or "")
    if target is None or target.__name__ == "__main__":
        return True
    for part in getattr(obj, "__qualname__", "?").split("."):
        target = getattr(target, part, None)
    return target is not obj


def _constant(value) -> bool:
    if isinstance(value, dict):
        return all(_constant(k) and _constant(v) for k, v in value.items())
    return isinstance(value, (bool, int, float, str, type(None), torch.dtype)) or \
        isinstance(value, (tuple, list, frozenset, set)) and all(_constant(v) for v in value)


def read_globals(fn: types.FunctionType) -> list[tuple[str, object]]:
    """The globals and closure cells a function's code reads, with their values."""
    names = dict.fromkeys(ins.argval for code in _codes(fn.__code__) for ins in dis.get_instructions(code)
                          if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"))
    found = [(n, fn.__globals__[n]) for n in names if n in fn.__globals__]
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        with contextlib.suppress(ValueError):                   # a cell not filled yet
            found.append((name, cell.cell_contents))
    return found


def _blank(fn: types.FunctionType) -> bool:
    """Its body starts with ``raise NotImplementedError`` (after a docstring, if any)."""
    ins = [i for i in dis.get_instructions(fn) if i.opname not in
           ("RESUME", "NOP", "COPY_FREE_VARS", "MAKE_CELL", "PUSH_NULL", "PRECALL", "CALL", "CACHE")]
    return len(ins) >= 2 and ins[0].opname == "LOAD_GLOBAL" and ins[0].argval == "NotImplementedError" \
        and ins[1].opname == "RAISE_VARARGS"


def pack(objects: dict[str, object], forbid_modules: tuple[str, ...] = (), why: str = "") -> Package:
    """The package of ``objects`` (``{name the check uses: object}``) and of the learner's functions and
    classes they use (those of the notebook, or of the objects' own modules), each under the name its
    caller uses (an alias too). :class:`SourceError` for what comes from ``forbid_modules`` (saying
    ``why``), a lambda, and a notebook variable that is not a constant."""
    def forbidden(value) -> bool:
        module = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", "") or ""
        return any(module == m or module.startswith(m + ".") for m in forbid_modules)

    for shown, obj in objects.items():
        if not isinstance(obj, (types.FunctionType, type)):
            raise SourceError(f"{shown} is a {type(obj).__name__}, not a function or class defined in the notebook")
        if forbidden(obj):
            raise SourceError(f"{obj.__name__} comes from {obj.__module__}: {why}")
    own, uses, functions = {getattr(obj, "__module__", None) for obj in objects.values()}, {}, []
    todo, seen = list(objects.items()), set()
    while todo:                                                 # breadth first, as the objects use them
        name, obj = todo.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        uses.setdefault(name, obj)
        uses.setdefault(obj.__name__, obj)
        if obj.__name__ == "<lambda>":
            raise SourceError(f"{obj.__qualname__} is a lambda, which cannot be sent to the ranks: write it as a def")
        todo += [(b.__name__, b) for b in getattr(obj, "__bases__", ()) if b is not object and by_value(b)]
        for fn in functions_of(obj):
            functions.append(fn)
            for used, value in read_globals(fn):
                if forbidden(value):
                    raise SourceError(f"{obj.__qualname__} uses {used}: {why}")
                if isinstance(value, (types.FunctionType, type)) and (by_value(value) or value.__module__ in own):
                    todo.append((used, value))
                elif not (isinstance(value, (types.ModuleType, types.BuiltinFunctionType, types.FunctionType, type))
                          or _constant(value) or getattr(builtins, used, None) is value):
                    raise SourceError(
                        f"{obj.__qualname__} uses the notebook variable {used} (a {type(value).__name__}), which "
                        "cannot be sent to the ranks: only functions, classes, modules and constants travel. Create "
                        "it inside the function, or pass it in as an argument.")
    spans = [_span(fn) for fn in functions]
    return Package(cloudpickle.dumps({**uses, **objects}), spans, {f: linecache.getlines(f) for f, *_ in spans},
                   list(dict.fromkeys(fn.__qualname__ for fn in functions if _blank(fn))))
