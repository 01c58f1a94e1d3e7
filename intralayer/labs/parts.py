"""Every lab part and bug hunt, by name.

A chapter's module (``chNN.py`` here) registers its parts with :func:`lab` and :func:`hunt`;
:func:`get` imports every ``chNN`` module on first use. A **lab** part runs the learner's
function or class on a group and returns, on each rank, its problems in words (``[]`` when all
is well) and the facts it measured. A **hunt** runs the learner's *test* against
implementations of one function: on a buggy one it must fail (raise on some rank), on the
correct one pass on every rank.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Param:
    """A case parameter: its default, and the values it may take (a fixed set, or whole numbers ≥ minimum)."""

    default: object
    choices: tuple | None = None
    minimum: int | None = None

    def check(self, name: str, value) -> None:
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{name}={value!r} is not one of {list(self.choices)}")
        if self.choices is None and type(self.default) is int and (type(value) is not int or value < (self.minimum or 0)):
            raise ValueError(f"{name}={value!r} must be a whole number ≥ {self.minimum or 0}")


@dataclass(frozen=True)
class Implementation:
    """One implementation a bug hunt's test meets, whether it has the bug, and where the bug was reported."""

    function: Callable
    buggy: bool
    source: str = ""


@dataclass
class Part:
    name: str
    chapter: str
    kind: str                                  # "lab" or "hunt"
    objects: tuple[str, ...]                   # what the learner hands over, by name
    run: Callable                              # rank side: (ns, case, group) -> {"problems": [...], "facts": {...}}
    params: dict[str, Param] = field(default_factory=dict)
    forbid_ops: frozenset = frozenset()        # operations (intralayer.record.OPERATIONS) refused on the rank
    forbid_modules: tuple[str, ...] = ()       # library modules that hold the answer
    why: str = ""                              # why they are refused, in words
    summary: Callable | None = None            # a passing case's facts -> sentence
    implementations: dict[str, Implementation] = field(default_factory=dict)
    hint: str = ""                             # a hunt: what a test that misses the bug overlooks

    def case(self, ranks: int, params: dict) -> dict:
        """One case with defaults filled in; ``ValueError`` naming the rule for bad parameters."""
        if ranks not in (2, 3, 4):
            raise ValueError(f"ranks={ranks!r}: {self.name} runs on groups of 2, 3, 4 ranks")
        if unknown := set(params) - set(self.params):
            raise ValueError(f"{self.name} takes no parameter {', '.join(sorted(unknown))}; "
                             f"its parameters are {', '.join(sorted(self.params)) or 'none'}")
        for name, spec in self.params.items():
            spec.check(name, params.get(name, spec.default))
        return {"ranks": ranks, **{n: params.get(n, p.default) for n, p in self.params.items()}}


_PARTS: dict[str, Part] = {}


def _register(**fields) -> Part:
    """A new part of the chapter whose module called :func:`lab` or :func:`hunt`."""
    part = Part(chapter=sys._getframe(2).f_globals["__name__"].rsplit(".ch", 1)[-1], **fields)
    if part.name in _PARTS:
        raise ValueError(f"two lab parts are named {part.name!r}")
    _PARTS[part.name] = part
    return part


def lab(name: str, objects: tuple[str, ...], *, params=None, forbid_ops=frozenset(), forbid_modules=(), why="",
        summary=None):
    """Register the decorated rank-side check as lab part ``name`` (the fields of :class:`Part`). The
    forbidden operations are refused while the whole check runs: its own code must not use them."""
    def deco(run: Callable) -> Callable:
        _register(name=name, kind="lab", objects=tuple(objects), run=run, params=dict(params or {}),
                  forbid_ops=frozenset(forbid_ops), forbid_modules=tuple(forbid_modules), why=why, summary=summary)
        return run
    return deco


def hunt(name: str, test: str, implementations: dict[str, Implementation], *, hint: str = "") -> Part:
    """Register bug hunt ``name``: the learner's ``test(impl, group)`` runs on every rank against each implementation."""
    if len({i.buggy for i in implementations.values()}) < 2:
        raise ValueError(f"bug hunt {name}: it needs at least one buggy and one correct implementation")

    def run(ns, case, group) -> dict:
        getattr(ns, test)(_disguised(implementations[case["impl"]].function, test.removeprefix("test_")), group)
        return {"problems": [], "facts": {}}                                 # (it raised if the test failed)
    return _register(name=name, kind="hunt", objects=(test,), run=run, implementations=dict(implementations),
                     params={"impl": Param(next(iter(implementations)), tuple(implementations))}, hint=hint)


def _disguised(fn: Callable, name: str) -> Callable:
    """``fn`` as a bug hunt's test meets it: a function called ``name`` (the function under test) with the same
    code, globals and (no) docstring for every implementation, so that only what it does tells them apart."""
    def under_test(*args, **kwargs):
        return fn(*args, **kwargs)
    under_test.__name__ = under_test.__qualname__ = name
    return under_test


def every() -> list[Part]:
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("ch") and info.name[2:].isdigit():
            importlib.import_module(f"{__package__}.{info.name}")
    return sorted(_PARTS.values(), key=lambda p: (p.chapter, p.name))


def get(name: str) -> Part:
    """The part called ``name``; ``ValueError`` listing the names if there is none."""
    if not isinstance(name, str) or name not in _PARTS and name not in {p.name for p in every()}:
        raise ValueError(f"no lab part or bug hunt is called {name!r}; they are: {', '.join(sorted(_PARTS))}")
    return _PARTS[name]
