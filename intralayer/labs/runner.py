"""The processes behind a lab check: ``python -m intralayer.labs.runner JOBDIR``.

:class:`intralayer.labs.Check` writes the learner's code (``learner*.py``) and a job file
(``job.json``: which parts, which cases) into a fresh folder and starts this module on
it. It hosts the rendezvous store and starts the ranks, each a child process; each rank
joins one gloo process group of all of them through :func:`intralayer.distributed.setup`
(the environment torchrun would give it, the store already up, as torchrun's agent
hosts it), then, job by job and case by case, makes the case's groups and runs the
part's check on its group: a 2-rank case runs on the pairs (0, 1) and (2, 3) at once, a
4-rank case on all four, a 3-rank case on ranks 1–3 (where group ranks differ from global
ranks). Every rank writes what it found to ``rank<r>.json`` after each job; its standard
output and error go to ``rank<r>.out`` and ``rank<r>.err``.

Why child processes of one interpreter and not ``torchrun`` (:mod:`intralayer.launch`):
each torchrun launch imports torch once per rank and once for its agent, and a lab
notebook's checks start ranks several times. Here torch is imported once and the ranks are
forked from this interpreter. On the 2-core machine of the tests, with other jobs keeping
its load average near 5, a 4-rank torchrun launch of the smallest program took 10–14 s, a
check of three cases here 4.6 s, and the same check with ``spawn`` 23 s; less loaded, a
check cell took 2.4–3.8 s, most of it importing torch, which :func:`serve` now does once per
kernel (a passing check forked from it: about 0.6 s). Forking is safe here because this process has run no tensor
operation and has one thread when it forks (``OMP_NUM_THREADS=1``, which the check sets:
torch's OpenMP pool would add a second; and the rendezvous store, whose server runs a
thread, is started only after the fork, its port sent to the ranks through a pipe).
Where either is not so (not Linux, or more threads), the children are started with
``spawn``, which imports torch again in each. The learner's code runs only in the ranks,
never here.

Safety: every process group has a timeout (``group_timeout`` for the cases' groups, so
a send that no one receives fails in seconds, not minutes); after each case all ranks
meet on the world group, so a rank stuck in its case holds the others only until its
group's timeout. A rank whose group timed out leaves without tearing its groups down
(``os._exit``), once its results are written. The caller stops the whole process tree
if this takes longer than its own deadline (SIGTERM to the runner's session); that makes each
rank print its Python stack first (:func:`intralayer.distributed.setup`), which says
where the learner's code was.

Labs run on CPU ranks with gloo (``CUDA_VISIBLE_DEVICES`` is emptied): they are exercises
for a laptop; their checks were never meant for NCCL.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import re
import sys
import traceback
import types
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from .. import distributed
from . import monitor, parts

WORLD = 4


def layout(ranks: int, world: int = WORLD) -> list[list[int]]:
    """The groups a case of ``ranks`` ranks runs on, each as sorted process numbers.

    Two ranks run on the pairs [1, 2] and [0, 3] at once, three on [1, 2, 3], four on all:
    in every case but the last, some group rank differs from its process number, so code
    that uses ``dist.get_rank()`` (the process number) where it needs ``dist.get_rank(group)``
    fails in the visible cases too.
    """
    if not 1 <= ranks <= world:
        raise ValueError(f"a case needs 1 to {world} ranks, not {ranks}")
    if ranks == world:
        return [list(range(world))]
    if 2 * ranks == world:
        return [list(range(1, ranks + 1)), sorted({0, *range(ranks + 1, world)})]
    return [list(range(world - ranks, world))]


def _threads() -> int | None:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def start_method() -> str:
    """'fork' on Linux when this process has a single thread, else 'spawn'."""
    return "fork" if sys.platform.startswith("linux") and _threads() == 1 else "spawn"


# ---------------------------------------------------------------------------- inside a rank

def error_info(exc: BaseException, files: set[str]) -> dict:
    """An exception as the notebook side reports it: type, first line, the learner's frames."""
    frames = [[f.filename, f.lineno, f.name] for f in traceback.extract_tb(exc.__traceback__) if f.filename in files]
    text = str(exc).strip()
    first = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0]) if text else ""
    timed_out = isinstance(exc, (RuntimeError, dist.DistError)) and bool(re.search(r"timed out|timeout", text, re.I))
    lost = isinstance(exc, (RuntimeError, dist.DistError)) and bool(
        re.search(r"closed by peer|reset by peer|broken pipe", text, re.I))
    return {"type": type(exc).__name__, "message": first[:400], "frames": frames, "timed_out": timed_out,
            "lost_peer": lost}


def _load(path: str, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _Refused(type):
    """The type of a stand-in class: calling it, or reading any attribute it lacks, raises."""

    def __call__(cls, *args, **kwargs):
        raise monitor.Forbidden(cls._refusal)

    def __getattr__(cls, attr):
        raise monitor.Forbidden(cls._refusal)


def _stub(qualified: str, why: str, original):
    """A stand-in for a forbidden function or class that raises :class:`monitor.Forbidden` when used."""
    refusal = f"{qualified} is not allowed here: {why}"
    if isinstance(original, type):
        return _Refused(original.__name__, (), {"_refusal": refusal, "__module__": original.__module__})

    def stub(*args, **kwargs):
        raise monitor.Forbidden(refusal)
    stub.__name__ = original.__name__
    return stub


class _Guard:
    """Replace the public functions and classes of the forbidden modules by stubs that raise, for one job."""

    def __init__(self, modules: tuple[str, ...], why: str):
        self.saved: list[tuple[types.ModuleType, str, object]] = []
        for name in modules:
            module = importlib.import_module(name)
            for attr, value in list(vars(module).items()):
                if not attr.startswith("_") and isinstance(value, (types.FunctionType, type)) \
                        and getattr(value, "__module__", None) == name:
                    self.saved.append((module, attr, value))
                    setattr(module, attr, _stub(f"{name}.{attr}", why, value))

    def restore(self) -> None:
        for module, attr, value in self.saved:
            setattr(module, attr, value)


def _run_case(part, module, case, group, files) -> dict:
    """One case on this rank: the part's check, with the operations it forbids refused."""
    try:
        with monitor.watch(part.forbid_ops, part.why) as calls:
            outcome = part.run(module, case, group)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:                      # the learner's code may raise anything, SystemExit too
        return {"error": error_info(exc, files)}
    mine = tuple(dist.get_process_group_ranks(group))
    strays = sorted({c.group for c in calls if not set(c.group) <= set(mine)})     # sub-groups of it are fine
    if strays:
        outcome.setdefault("problems", []).append(
            f"it communicated in a group of ranks {list(strays[0])}, not in the group it was given "
            f"(ranks {list(mine)}): pass group=group to every call")
    return outcome


def run_job(index: int, job: dict, d: distributed.Dist, spec: dict) -> tuple[dict, bool]:
    """This rank's outcome of every case of one job, and whether a group timed out (or failed)."""
    part = parts.get(job["part"])
    files = {job["module"]}
    guard = _Guard(part.forbid_modules, part.why)
    try:
        try:
            module, load_error = _load(job["module"], f"intralayer_lab_learner_{index}"), None
        except Exception as exc:
            module, load_error = None, error_info(exc, files)
        cases, broken = [], False
        for case in job["cases"]:
            groups = [(ranks, distributed.new_group(ranks, timeout_s=spec["group_timeout"]))
                      for ranks in layout(case["ranks"], d.world_size)]
            mine = [(ranks, g) for ranks, g in groups if d.rank in ranks]
            outcome = None
            if mine:
                ranks, group = mine[0]
                outcome = {"error": load_error} if load_error else _run_case(part, module, case, group, files)
                outcome.update(group=ranks, group_rank=ranks.index(d.rank))
            failed = torch.tensor([1.0 if outcome and outcome.get("error") else 0.0])
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)     # wait for every group; did any rank fail?
            broken = broken or bool(failed.item())
            cases.append(outcome)
        return {"cases": cases}, broken
    finally:
        guard.restore()


def rank_main(rank: int, world: int, port, jobdir: str) -> None:
    """One rank: join the job's process group and run every job's cases; write ``rank<r>.json``.

    ``port`` is the rendezvous store's port, or a connection that will receive it (the
    store is started after the fork: its server thread would make forking unsafe).
    """
    folder = Path(jobdir)
    if not isinstance(port, int):
        port = port.recv()
    for fd, name in ((1, "out"), (2, "err")):
        f = open(folder / f"rank{rank}.{name}", "w")
        os.dup2(f.fileno(), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    spec = json.loads((folder / "job.json").read_text())
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT="0")
    monitor.install()
    results: dict = {"jobs": []}
    out = folder / f"rank{rank}.json"
    broken = False
    with distributed.setup(timeout_s=spec["world_timeout"]) as d:
        for index, job in enumerate(spec["jobs"]):
            result, failed = run_job(index, job, d, spec)
            broken = broken or failed
            results["jobs"].append(result)
            tmp = out.with_suffix(".tmp")
            tmp.write_text(json.dumps(results))
            tmp.replace(out)
        if broken:                 # a group may hold a send that no one will receive: leave without teardown
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0], "job.json").is_file():
        print("usage: python -m intralayer.labs.runner JOBDIR  (JOBDIR holds job.json; see intralayer.labs)",
              file=sys.stderr)
        return 2
    import multiprocessing

    folder = Path(argv[0])
    spec = json.loads((folder / "job.json").read_text())
    world = int(spec.get("world", WORLD))
    ctx = multiprocessing.get_context(start_method())
    sys.stdout.flush()
    sys.stderr.flush()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [ctx.Process(target=rank_main, args=(r, world, pipes[r][0], str(folder))) for r in range(world)]
    for p in procs:
        p.start()
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=spec["world_timeout"]),
                          wait_for_workers=False)           # after the fork: its server runs a thread
    for _, send in pipes:
        send.send(store.port)
    for p in procs:
        p.join()
    (folder / "exit.json").write_text(json.dumps({"exits": [p.exitcode for p in procs],
                                                 "start_method": ctx.get_start_method()}))
    return 0 if all(p.exitcode == 0 for p in procs) else 1


def serve() -> int:
    """``python -m intralayer.labs.runner --serve``: a warm runner for one notebook kernel.

    Importing torch takes this machine about 2.4 s, most of a passing check's time, and a
    lab notebook runs several checks. This process imports it once, then, for each line
    ``JOBDIR DEADLINE`` it reads, forks a runner for that job in a session of its own (its
    output to ``JOBDIR/runner.log``), answers ``pid N``, and ``exit C`` when the runner has
    ended. The caller stops a late job itself (SIGTERM to the session, so the ranks print
    their stacks); as a watchdog, this process kills the session DEADLINE + 10 s after the
    start, should the caller be gone. It ends when its input closes: its kernel has ended.
    """
    for line in sys.stdin:
        jobdir, deadline = line.rsplit(maxsplit=1)

        def job(jobdir=jobdir) -> int:
            log = os.open(Path(jobdir, "runner.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            for fd, to in ((0, os.open(os.devnull, os.O_RDONLY)), (1, log), (2, log)):
                os.dup2(to, fd)
            return main([jobdir])

        fork_and_wait(job, float(deadline) + 10.0)
    return 0


def fork_and_wait(job, give_up_s: float) -> None:
    """Fork ``job()`` in a session of its own (its return value is the child's exit code), write
    ``pid N``, wait for it, and write ``exit C``. The caller stops a late job itself; as a watchdog,
    its session is killed ``give_up_s`` seconds after the fork, should the caller be gone. Safe
    while this process has one thread and has run no tensor operation (see :func:`start_method`)."""
    import signal
    import time

    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setsid()
            code = job()
        finally:
            os._exit(code)
    print(f"pid {pid}", flush=True)
    give_up = time.monotonic() + give_up_s
    while not (ended := os.waitpid(pid, os.WNOHANG))[0]:
        if time.monotonic() > give_up:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        time.sleep(0.01)
    print(f"exit {os.waitstatus_to_exitcode(ended[1])}", flush=True)


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main(sys.argv[1:]))
