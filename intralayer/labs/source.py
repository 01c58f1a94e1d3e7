"""The learner's functions and classes, from the notebook into a module file the ranks import.

A rank is another process: it cannot see the notebook's variables. So a lab hands the
ranks *source*: :func:`module_text` takes the objects a check names (functions or classes
defined in notebook cells), reads each one's source from the cell that defined it, and
follows the global names that source uses, in the notebook's namespace:

- a module (``torch``, ``dist`` for ``torch.distributed``) becomes an import;
- another function or class of the notebook comes along, source and all (helpers work);
- a function or class of an importable module becomes ``from module import name``;
- a constant (a number, a string, a dtype, a tuple of them) is written out;
- anything else (a tensor, a model) cannot travel, and the check says so in words.

Python's ``inspect.getsource`` finds a function's cell through ``linecache``, where
IPython registers every cell it runs; for a class it needs the module's file, which the
notebook's ``__main__`` does not have, so a class is found in the cell of one of its
methods instead. Outside a notebook (the tests), objects come from a real file.

:func:`unwritten` finds a function whose body still starts with
``raise NotImplementedError`` — what nbgrader leaves in a blank exercise — so that a check
can say "not written yet" at once, without starting any process.
"""
from __future__ import annotations

import ast
import builtins
import dis
import importlib
import inspect
import linecache
import math
import textwrap
import types
from dataclasses import dataclass, field

import torch


class SourceError(AssertionError):
    """The learner's code cannot be sent to the ranks (a name that cannot travel, a
    forbidden import). An ``AssertionError``, so that nbgrader counts the check as failed."""


@dataclass
class Piece:
    """One object's source in the module file, and where it came from."""

    name: str
    text: str
    first_line: int = 0          # line of the module file where it starts (1-based)


@dataclass
class Module:
    """The text of the module file the ranks import, and how to map its lines back."""

    text: str
    pieces: list[Piece] = field(default_factory=list)

    def where(self, line: int) -> str | None:
        """'line 3 of ring_all_reduce' for a line of the module file, or None (a header line)."""
        for p in self.pieces:
            n = p.text.count("\n") + 1
            if p.first_line <= line < p.first_line + n:
                return f"line {line - p.first_line + 1} of {p.name}"
        return None

    def line(self, line: int, width: int = 90) -> str:
        """The statement at ``line`` of the module file, on one line (shortened to ``width``)."""
        lines = self.text.splitlines()
        if not 0 < line <= len(lines):
            return ""
        start = end = line
        for p in self.pieces:
            offset = p.first_line - 1
            if p.first_line <= line <= offset + p.text.count("\n") + 1:
                for node in ast.walk(ast.parse(p.text)):
                    if isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.ClassDef,
                                                                            ast.AsyncFunctionDef, ast.For,
                                                                            ast.While, ast.If, ast.With, ast.Try)) \
                            and node.lineno + offset <= line <= node.end_lineno + offset:
                        start, end = node.lineno + offset, node.end_lineno + offset
        text = " ".join(l.strip().rstrip("\\").strip() for l in lines[start - 1:end])
        return text if len(text) <= width else text[:width - 1] + "…"


# ---------------------------------------------------------------------------- finding source

def _methods(cls: type) -> list[types.FunctionType]:
    found = []
    for value in vars(cls).values():
        fn = getattr(value, "__func__", value)          # staticmethod, classmethod
        if isinstance(fn, property):
            fn = fn.fget
        if isinstance(fn, types.FunctionType) and fn.__qualname__.startswith(cls.__qualname__ + "."):
            found.append(fn)
    return found


def _class_source(cls: type) -> str:
    """A class's source: from its module file, else from the notebook cell of one of its methods."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        pass
    for fn in _methods(cls):
        lines = linecache.getlines(fn.__code__.co_filename)
        if not lines:
            continue
        text = "".join(lines)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.name == cls.__name__ and \
                    node.lineno <= fn.__code__.co_firstlineno <= node.end_lineno:
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                return "".join(lines[start - 1:node.end_lineno])
    raise SourceError(f"the source of class {cls.__name__} cannot be found: define it in a notebook cell "
                      "(with at least one method) and run that cell")


def source_of(obj) -> str:
    """The dedented source of a function or class defined in a notebook cell or a file."""
    if isinstance(obj, type):
        text = _class_source(obj)
    elif isinstance(obj, types.FunctionType):
        if obj.__name__ == "<lambda>":
            raise SourceError("a lambda cannot be sent to the ranks: write it as a def")
        if obj.__code__.co_freevars:
            raise SourceError(f"{obj.__name__} uses {', '.join(obj.__code__.co_freevars)}, a variable of the function "
                              "it was defined in, which cannot be sent to the ranks: define it at the top level "
                              "of a cell")
        try:
            text = inspect.getsource(obj)
        except (OSError, TypeError):
            raise SourceError(f"the source of {obj.__name__} cannot be found: define it in a notebook cell "
                              "and run that cell") from None
    else:
        raise SourceError(f"{obj!r} is a {type(obj).__name__}, not a function or class defined in the notebook")
    return textwrap.dedent(text)


def _namespace(obj) -> dict:
    """The global namespace the object's code runs in (the notebook's, for a notebook object)."""
    if isinstance(obj, types.FunctionType):
        return obj.__globals__
    for fn in _methods(obj):
        return fn.__globals__
    module = importlib.import_module(obj.__module__)
    return vars(module)


def global_names(text: str) -> list[str]:
    """The global names a piece of source reads, in order of first use.

    Compiled as a module: its own top-level names (``LOAD_NAME`` at module level, in class
    bodies) and every function's ``LOAD_GLOBAL``; local variables and the names it defines
    at top level are not global reads.
    """
    code = compile(text, "<lab source>", "exec")
    defined = {n for node in ast.parse(text).body if isinstance(node, (ast.FunctionDef, ast.ClassDef,
                                                                     ast.AsyncFunctionDef))
               for n in [node.name]}
    seen: dict[str, None] = {}

    def walk(c: types.CodeType) -> None:
        for ins in dis.get_instructions(c):
            if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval not in defined \
                    and not (ins.argval.startswith("__") and ins.argval.endswith("__")):   # a class body's __name__
                seen.setdefault(ins.argval, None)
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                walk(const)

    walk(code)
    return list(seen)


# ---------------------------------------------------------------------------- travelling names

_SCALARS = (bool, int, float, str, type(None))


def _literal(value) -> str | None:
    """Python source that rebuilds ``value``, if it is a plain constant; else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"float({str(value)!r})"
    if isinstance(value, _SCALARS):
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value)                                     # 'torch.float64'
    if isinstance(value, (tuple, list)):
        parts = [_literal(v) for v in value]
        if any(p is None for p in parts):
            return None
        inner = ", ".join(parts) + ("," if isinstance(value, tuple) and len(parts) == 1 else "")
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return None


def _import_line(name: str, value) -> str | None:
    """``import x as name`` / ``from m import y as name`` for a module or an importable object."""
    if isinstance(value, types.ModuleType):
        full = value.__name__
        if full == name:
            return f"import {full}"
        return f"import {full} as {name}"
    module, attr = getattr(value, "__module__", None), getattr(value, "__name__", None)
    if module and attr and module != "__main__":
        try:
            if getattr(importlib.import_module(module), attr) is value:
                return f"from {module} import {attr}" + (f" as {name}" if attr != name else "")
        except (ImportError, AttributeError):
            pass
    return None


def _user_object(value, namespace: dict) -> bool:
    """A function or class defined in the notebook (or the learner's file) itself."""
    own = namespace.get("__name__")
    return isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == own


def module_text(objects: dict[str, object], forbidden=None) -> Module:
    """The module file for ``objects`` (``{name the check uses: object}``) and their dependencies.

    ``forbidden(name, value)`` may return a sentence saying why a global cannot be used
    (the lab's answer from the library, say); it is raised as :class:`SourceError`.
    """
    imports: dict[str, str] = {}
    constants: dict[str, str] = {}
    pieces: list[Piece] = []
    done: set[int] = set()

    def visit(obj, shown: str) -> None:
        if id(obj) in done:
            return
        done.add(id(obj))
        text = source_of(obj)
        namespace = _namespace(obj)
        for name in global_names(text):
            if name not in namespace:
                continue                          # a builtin, or a name the notebook lacks too
            value = namespace[name]
            if forbidden is not None and (why := forbidden(name, value)):
                raise SourceError(f"{shown} uses {name}: {why}")
            if _user_object(value, namespace):
                visit(value, value.__name__)
                if value.__name__ != name:
                    constants[name] = value.__name__
                continue
            line = _import_line(name, value)
            if line is not None:
                imports[name] = line
                continue
            literal = _literal(value)
            if literal is not None:
                if isinstance(value, torch.dtype):
                    imports.setdefault("torch", "import torch")
                constants[name] = literal
                continue
            if getattr(builtins, name, None) is value:
                continue
            raise SourceError(
                f"{shown} uses the notebook variable {name} (a {type(value).__name__}), which cannot be sent "
                "to the ranks: only functions, classes, modules and constants travel. Create it inside the "
                "function, or pass it in as an argument.")
        pieces.append(Piece(obj.__name__, text.rstrip("\n")))

    for shown, obj in objects.items():
        if forbidden is not None and (why := forbidden(shown, obj)):
            raise SourceError(f"{getattr(obj, '__name__', shown)} comes from {getattr(obj, '__module__', '?')}: {why}")
        visit(obj, getattr(obj, "__name__", shown))
    header = ["# Written by intralayer.labs for the ranks: the learner's code and what it uses."]
    header += sorted(set(imports.values()))
    body: list[str] = []
    line = len(header) + 1
    for p in pieces:
        body.append("")
        body.append("")
        line += 2
        p.first_line = line
        body.append(p.text)
        line += p.text.count("\n") + 1
    tail = [""]
    tail += [f"{name} = {value}" for name, value in constants.items()]
    for shown, obj in objects.items():                 # the names the check looks up
        if getattr(obj, "__name__", shown) != shown:
            tail.append(f"{shown} = {obj.__name__}")
    text = "\n".join(header + body + tail) + "\n"
    compile(text, "<lab module>", "exec")
    return Module(text, pieces)


# ---------------------------------------------------------------------------- blank exercises

def _starts_unwritten(body: list[ast.stmt]) -> bool:
    stmts = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                     and isinstance(s.value.value, str))]     # a docstring
    if not stmts or not isinstance(stmts[0], ast.Raise) or stmts[0].exc is None:
        return False
    exc = stmts[0].exc.func if isinstance(stmts[0].exc, ast.Call) else stmts[0].exc
    return isinstance(exc, ast.Name) and exc.id == "NotImplementedError"


def unwritten(module: Module) -> list[str]:
    """Names of the functions and methods whose body starts with ``raise NotImplementedError``."""
    found = []
    for p in module.pieces:
        for node in ast.walk(ast.parse(p.text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _starts_unwritten(node.body):
                found.append(node.name if node.name == p.name else f"{p.name}.{node.name}")
    return found
