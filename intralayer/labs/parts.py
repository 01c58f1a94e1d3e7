"""Every lab part and bug hunt, by name, and the rank-side helpers their checks share.

A *part* is one graded check of a lab notebook. Each chapter's module (``chNN.py`` in this
package) registers its parts with :func:`lab` and :func:`hunt`; :func:`get` finds them,
importing every ``chNN`` module on first use, so a new chapter's module needs no list to
be edited.

- A **lab** part runs the learner's function (or class) on a group of ranks and returns,
  on each rank, the problems it found in words (``[]`` when all is well) and the facts
  it measured (for the success line the notebook prints).
- A **hunt** runs the learner's *test* against implementations of one function: some
  with the bug (the test must fail: raise on at least one rank), one without (the test
  must pass on every rank). Which is which is in ``implementations``.

Rank side, each check gets the learner's module (``ns``), the case's parameters and its
process group; :mod:`.monitor` records what the learner's code sends. The helpers every
chapter's checks share are here too: :func:`differ`, :func:`traffic`, :func:`in_group_words`
(a failure that comes from counting with the process number, said in words) and
:func:`earlier_part` (a later part checks the learner's earlier part first).
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from . import monitor


@dataclass(frozen=True)
class Param:
    """A case parameter a check accepts: its default and the values it may take."""

    default: object
    choices: tuple | None = None          # allowed values, if a fixed set
    minimum: int | None = None            # for whole numbers

    def check(self, name: str, value) -> None:
        if self.choices is not None:
            if value not in self.choices:
                raise ValueError(f"{name}={value!r} is not one of {list(self.choices)}")
        elif isinstance(self.default, int) and not isinstance(self.default, bool):
            if isinstance(value, bool) or not isinstance(value, int) or (self.minimum is not None
                                                                         and value < self.minimum):
                floor = f" ≥ {self.minimum}" if self.minimum is not None else ""
                raise ValueError(f"{name}={value!r} must be a whole number{floor}")


@dataclass(frozen=True)
class Implementation:
    """One implementation a bug hunt's test is run against, and what the test must do on it."""

    function: Callable
    buggy: bool
    source: str = ""                      # where the bug comes from (shown in messages)


@dataclass
class Part:
    name: str
    chapter: str
    kind: str                                             # "lab" or "hunt"
    objects: tuple[str, ...]                              # what the learner hands over, by name
    run: Callable                                         # rank side: (ns, case, group) -> dict
    params: dict[str, Param] = field(default_factory=dict)
    forbid_ops: frozenset = frozenset()                   # operations the learner's code may not call
    forbid_modules: tuple[str, ...] = ()                  # library modules that hold the answer
    why: str = ""                                         # why they are forbidden, in words
    summary: Callable | None = None                       # facts of a passing case -> sentence
    implementations: dict[str, Implementation] = field(default_factory=dict)
    hint: str = ""                                        # hunts: what a test that misses the bug overlooks
    ranks: tuple[int, ...] = (2, 3, 4)                    # the group sizes it may run on

    def case(self, ranks: int, params: dict) -> dict:
        """One case, with defaults filled in; ``ValueError`` naming the rule for bad parameters."""
        if ranks not in self.ranks:
            raise ValueError(f"ranks={ranks!r}: {self.name} runs on groups of {', '.join(map(str, self.ranks))} ranks")
        unknown = set(params) - set(self.params)
        if unknown:
            raise ValueError(f"{self.name} takes no parameter {', '.join(sorted(unknown))}; "
                             f"its parameters are {', '.join(sorted(self.params)) or 'none'}")
        case = {"ranks": ranks}
        for name, spec in self.params.items():
            value = params.get(name, spec.default)
            spec.check(name, value)
            case[name] = value
        return case


_PARTS: dict[str, Part] = {}
_loaded = False


def _register(part: Part) -> Part:
    if part.name in _PARTS:
        raise ValueError(f"two lab parts are named {part.name!r}")
    _PARTS[part.name] = part
    return part


def lab(name: str, objects: tuple[str, ...], *, params: dict | None = None, forbid_ops=frozenset(),
        forbid_modules: tuple[str, ...] = (), why: str = "", summary: Callable | None = None):
    """Register the decorated rank-side check as the lab part ``name``.

    ``objects`` names what the learner hands over; ``params`` the case parameters (each a
    :class:`Param`); ``forbid_ops`` the operations (:data:`.monitor.OPERATIONS`) refused on
    the rank while the check runs — the check's own code too, so it must not use them —
    and ``forbid_modules`` the library modules refused, both explained by ``why``;
    ``summary`` turns a passing case's facts into the line the notebook prints.
    """
    chapter = _chapter(sys._getframe(1))

    def deco(run: Callable) -> Callable:
        _register(Part(name, chapter, "lab", tuple(objects), run, dict(params or {}), frozenset(forbid_ops),
                       tuple(forbid_modules), why, summary))
        return run

    return deco


def hunt(name: str, test: str, implementations: dict[str, Implementation], *, hint: str = "") -> Part:
    """Register the bug hunt ``name``: the learner's function ``test(impl, group)`` is run, on
    every rank of a group, against each of ``implementations``."""
    chapter = _chapter(sys._getframe(1))
    if not any(i.buggy for i in implementations.values()) or all(i.buggy for i in implementations.values()):
        raise ValueError(f"bug hunt {name}: it needs at least one buggy and one correct implementation")

    def run(ns, case, group) -> dict:
        getattr(ns, test)(implementations[case["impl"]].function, group)   # raises if the test fails
        return {"problems": [], "facts": {}}

    spec = {"impl": Param(next(iter(implementations)), tuple(implementations))}
    return _register(Part(name, chapter, "hunt", (test,), run, spec, implementations=dict(implementations),
                          hint=hint))


def _chapter(frame) -> str:
    """'00' for a part registered by intralayer.labs.ch00."""
    module = frame.f_globals.get("__name__", "").rsplit(".", 1)[-1]
    return module[2:] if module.startswith("ch") else ""


def _load() -> None:
    global _loaded
    if _loaded:
        return
    package = importlib.import_module(__package__)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("ch") and info.name[2:].isdigit():
            importlib.import_module(f"{__package__}.{info.name}")
    _loaded = True


def get(name: str) -> Part:
    """The part called ``name``; ``ValueError`` listing the names if there is none."""
    _load()
    if not isinstance(name, str) or name not in _PARTS:
        raise ValueError(f"no lab part or bug hunt is called {name!r}; they are: {', '.join(sorted(_PARTS))}")
    return _PARTS[name]


def every() -> list[Part]:
    _load()
    return sorted(_PARTS.values(), key=lambda p: (p.chapter, p.name))


# ---------------------------------------------------------------------------- rank-side helpers

def group_info(group) -> tuple[int, int]:
    """(n, this rank's rank in the group)."""

    return dist.get_world_size(group), dist.get_rank(group)


def differ(got, want: torch.Tensor, what: str, rtol: float = 0.0, atol: float = 0.0) -> str | None:
    """None if ``got`` equals ``want`` within ``atol + rtol·|want|`` (exact by default), else
    a sentence saying how far off it is and where."""
    if not isinstance(got, torch.Tensor):
        return f"{what} is a {type(got).__name__}, not a tensor"
    if tuple(got.shape) != tuple(want.shape):
        return f"{what} has shape {tuple(got.shape)}; it should have shape {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"{what} has dtype {got.dtype}; it should keep the input's dtype {want.dtype}"
    diff = (got.detach() - want).abs()
    bad = ~((diff <= atol + rtol * want.abs()) | (got.detach() == want))   # NaN is never close; equal infs are
    if not bool(bad.any()):
        return None
    flat = int(torch.argmax(diff.reshape(-1)))
    index = []
    for size in reversed(tuple(want.shape)):          # not torch.unravel_index: it imports sympy (1 s a rank)
        flat, i = divmod(flat, size)
        index.insert(0, i)
    index = tuple(index)
    at = index[0] if len(index) == 1 else index
    return (f"{what} is off by up to {float(diff.max()):.3g}: at index {at} it is {float(got.detach()[index]):.6g}, "
            f"it should be {float(want[index]):.6g} ({int(bad.sum())} of {want.numel()} elements wrong)")


def calls_of(calls: list[monitor.Call], op: str) -> list[monitor.Call]:
    return [c for c in calls if c.op == op]


def traffic(calls: list[monitor.Call]) -> str:
    """'2 all-reduces (12 elements each)'; 'nothing' for no calls."""
    if not calls:
        return "nothing"
    by_op: dict[str, list[int]] = {}
    for c in calls:
        by_op.setdefault(c.op, []).append(c.elements)
    parts = []
    for op, sizes in by_op.items():
        word = op.replace("_", "-")
        plural = word if len(sizes) == 1 else (word + "es" if word.endswith("h") else word + "s")
        each = f"{sizes[0]} elements" + (" each" if len(sizes) > 1 else "") if len(set(sizes)) == 1 \
            else f"{', '.join(map(str, sizes))} elements"
        parts.append(f"{len(sizes)} {plural} ({each})")
    return ", ".join(parts)


# ---------------------------------------------------------------------------- process numbers, in words
#
# Every lab's check runs the learner's code on groups whose ranks differ from the process
# numbers (:func:`.runner.layout`). Code that counts with dist.get_rank() — the process number —
# where it needs dist.get_rank(group) fails there, but with gloo's or torch's words
# ("Pair is not connected", "Global rank 3 is not part of group"). :func:`in_group_words`
# wraps a rank-side check so that such a failure says what the learner did.

#: The files of the learner's code in the job being run (:func:`.runner.run_job` sets them).
LEARNER_FILES: set[str] = set()


def _learner_frame(depth: int = 2) -> bool:
    """Whether the caller's caller is the learner's code (a file of the job's learner code)."""
    return sys._getframe(depth).f_code.co_filename in LEARNER_FILES


@contextmanager
def _no_group_calls():
    """Record the learner's calls of dist.get_rank() / dist.get_world_size() without a group."""
    seen: list[str] = []
    originals = dist.get_rank, dist.get_world_size

    def wrap(original, name):
        @functools.wraps(original)
        def wrapper(group=None, *args, **kwargs):
            if (group is None or group is dist.group.WORLD) and _learner_frame():
                seen.append(name)
            return original(group, *args, **kwargs)
        return wrapper

    dist.get_rank, dist.get_world_size = wrap(originals[0], "get_rank"), wrap(originals[1], "get_world_size")
    try:
        yield seen
    finally:
        dist.get_rank, dist.get_world_size = originals


def process_number_words(seen: list[str], group) -> str | None:
    """The sentence for code that called dist.get_rank() (or get_world_size()) without its group."""
    if not seen:
        return None
    n, me = group_info(group)
    ranks = dist.get_process_group_ranks(group)
    differ_here = [f"process {p} is rank {j}" for j, p in enumerate(ranks) if p != j]
    said = []
    if "get_rank" in seen and differ_here:
        said.append(f"dist.get_rank() without its group is the process number, not the rank in the group (in this "
                    f"group of processes {ranks}, {', '.join(differ_here)})")
    if "get_world_size" in seen and dist.get_world_size() != n:
        said.append(f"dist.get_world_size() without its group counts every process ({dist.get_world_size()}), "
                    f"not the group's {n} ranks")
    if not said:
        return None                        # right here by chance: this group's ranks are the process numbers
    return ("it used the global rank (the process number) where the group rank is needed: " + "; ".join(said)
            + ". Use dist.get_rank(group) and dist.get_world_size(group)")


def _reworded(exc: BaseException, seen: list[str], group) -> str | None:
    """A learner-readable first line for an error that a peer from the process number causes, or None."""
    text = str(exc)
    ranks = dist.get_process_group_ranks(group)
    n = len(ranks)
    said = process_number_words(seen, group)
    guess = " — a peer computed from dist.get_rank() (the process number) instead of dist.get_rank(group)?"
    m = re.search(r"Global rank (\d+) is not part of group", text)
    if m:
        return (f"torch read peer {m[1]} as a process number (dst=, src= and a P2POp's peer are global ranks, even "
                f"with group=), and process {m[1]} is not in this group (processes {ranks}): name the peer by its "
                f"rank in the group with group_dst=, group_src= or group_peer=" + (f". Also, {said}" if said else ""))
    m = re.search(r"Group rank (\d+) is not part of group", text)
    if m:
        what = f"it named group rank {m[1]} as a peer, but the group has only ranks 0 to {n - 1}"
    elif "Pair is not connected" in text:
        what = "a rank sent to or received from itself (gloo says 'Pair is not connected')"
    elif said:
        return said
    else:
        return None
    return f"{said}; so {what}" if said else what + guess


def in_group_words(run):
    """Wrap a rank-side check ``run(ns, case, group)``: a failure that comes from counting with the
    process number says so, in words (an error's message is reworded; a wrong result gets a problem)."""
    @functools.wraps(run)
    def wrapped(ns, case, group):
        with _no_group_calls() as seen:
            try:
                outcome = run(ns, case, group)
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                words = _reworded(exc, seen, group)
                if words:
                    exc.args = (words,)
                raise
        said = process_number_words(seen, group)
        if said and outcome.get("problems"):
            outcome["problems"].append(said)
        return outcome
    return wrapped


def earlier_part(ns, name: str, part: int, run, case: dict, group) -> list[str]:
    """Check the learner's ``name`` from part ``part`` first, with that part's rank-side check ``run``
    (on every rank, so the ranks stay in step): its problems, each said as such — a later part that
    reuses it cannot be right while it is wrong. An error it raises is re-raised with the same words."""
    if not callable(getattr(ns, name, None)):
        return []
    said = f"your {name} from part {part} fails its check"
    try:
        outcome = run(ns, case, group)
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            raise
        text = str(exc).strip()
        exc.args = (f"{said}: it raised {type(exc).__name__}" + (f": {text.splitlines()[0]}" if text else "")
                    + "; fix it first: this part calls it",)
        raise
    return [f"{said} (fix it first: this part calls it): {p}" for p in outcome.get("problems", [])]


def in_group_words_hunt(part):
    """The same for a bug hunt's part (its run is built by :func:`.parts.hunt`)."""
    part.run = in_group_words(part.run)
    return part
