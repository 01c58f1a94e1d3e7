"""Chapter 00's lab and bug hunt: a ring from send and recv; an all-gather's backward.

Lab (``solutions/labs/00_collectives.ipynb``):

- ``ring_reduce_scatter(x, group)``: x is this rank's (n·c,) tensor; return this rank's
  chunk (chunk number = its rank in the group) of the sum over the group, using only
  point-to-point sends and receives to the neighbours on the ring.
- ``ring_all_reduce(x, group)``: the whole sum on every rank: the reduce-scatter phase,
  then an all-gather phase, again from sends and receives only.

The checks give every rank integer-valued inputs (so every sum is exact in float32 and
float64, in any order), and follow every message: n−1 sends (2(n−1) for the
all-reduce) to the right neighbour only, one chunk each, n−1 receives from the left,
(n−1)/n·S (2(n−1)/n·S) bytes in all — :func:`intralayer.comm.bus_factor` — and in the
reduce-scatter phase the j-th send carries a chunk summed over the j ranks that end at
the sender, in the all-gather phase a finished chunk. Collectives are forbidden while the
learner's code runs.

Bug hunt: ``all_gather(x, group)`` concatenates every rank's x; its backward must return
to each rank the *sum* over ranks of the gradient of its own rows (a reduce-scatter),
because each rank computes a different loss from the gathered tensor. The bug, from
lightly's ``GatherLayer`` (lightly-ai/lightly#1528): backward keeps only this rank's own
gradient — right only when every rank computes the same loss. Its fix went through a
version that all-reduces with an average, 1/n of the right gradient
(cellarium-ai/cellarium-ml#184), the second buggy implementation here.
"""
from __future__ import annotations

from itertools import combinations

import torch
import torch.distributed as dist

from .. import comm
from .parts import Implementation, Param, hunt, lab
from .common import calls_of, differ, earlier_part, group_info
from .runner import COLLECTIVES, watch

RING_WHY = ("this lab builds the collective from point-to-point sends and receives "
            "(dist.send/recv, isend/irecv, batch_isend_irecv), not from a collective or the library's own ring")
DTYPES = {"float32": torch.float32, "float64": torch.float64}
RING_PARAMS = {"chunk": Param(4, minimum=1), "dtype": Param("float32", tuple(DTYPES)), "seed": Param(0, minimum=0)}


def inputs(case: dict, n: int) -> list[torch.Tensor]:
    """Every rank's (n·c,) input, integers from −8 to 8 (exact sums); the same list on every rank."""
    g = torch.Generator().manual_seed(1000 * case["seed"] + n)
    return [torch.randint(-8, 9, (n * case["chunk"],), generator=g).to(DTYPES[case["dtype"]]) for _ in range(n)]


def explain(values: torch.Tensor, xs: list[torch.Tensor], c: int) -> str | None:
    """'chunk 2 summed over ranks [1, 2]' if ``values`` is that, else None."""
    n = len(xs)
    if values.numel() != c:
        return None
    for k in range(n):
        for size in range(n, 0, -1):
            for ranks in combinations(range(n), size):
                if torch.equal(values, sum(xs[q][k * c:(k + 1) * c] for q in ranks)):
                    return f"chunk {k} of {_ranks(ranks)} only" if size < n else f"chunk {k} summed over all {n} ranks"
    return None


def _ranks(ranks) -> str:
    """'rank 2' or 'ranks 0, 1'."""
    ranks = list(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def behind(me: int, j: int, n: int) -> list[int]:
    """The j ranks that end at ``me`` going round the ring: me−j+1, …, me (mod n), sorted."""
    return sorted((me - i) % n for i in range(j))


def ring_traffic(calls, n: int, me: int, c: int, steps: int, S: int, op: str) -> list[str]:
    """Problems with the messages of a ring of ``steps`` steps, in words."""
    problems = []
    sends, recvs = calls_of(calls, "send"), calls_of(calls, "recv")
    right, left = (me + 1) % n, (me - 1) % n
    if len(sends) != steps:
        problems.append(f"it sent {len(sends)} message{'s' if len(sends) != 1 else ''}; a ring {op} on {n} ranks "
                        f"takes {steps} step{'s' if steps != 1 else ''}, one send each")
    if len(recvs) != steps:
        problems.append(f"it received {len(recvs)} message{'s' if len(recvs) != 1 else ''}; it should receive "
                        f"{steps}, one per step")
    others = sorted({s.peer for s in sends if s.peer != right})
    if others:
        problems.append(f"it sent to group rank{'s' if len(others) > 1 else ''} {others}: on a ring each rank sends "
                        f"only to its right neighbour, group rank {right}")
    sources = sorted({-1 if r.peer is None else r.peer for r in recvs if r.peer != left})
    if sources:
        said = ", ".join("any source" if s == -1 else str(s) for s in sources)
        problems.append(f"it received from {said}: on a ring each rank receives only from its left neighbour, "
                        f"group rank {left}")
    sizes = sorted({s.elements for s in sends})
    if sends and sizes != [c]:
        problems.append(f"its messages held {', '.join(map(str, sizes))} elements; each step passes one chunk "
                        f"of {c} (the input's n·c elements split into n chunks)")
    sent = sum(s.bytes for s in sends)
    want = comm.bus_factor("all_reduce" if op == "all-reduce" else "reduce_scatter", n) * S
    if sends and sent != want:
        factor = "2(n−1)/n" if op == "all-reduce" else "(n−1)/n"
        problems.append(f"it sent {sent} bytes; a ring {op} sends {factor}·S = {want:.0f} bytes "
                        f"(n = {n}, S = {S} bytes)")
    return problems


def partial_sums(sends, xs, me: int, c: int, first: int, count: int) -> list[str]:
    """Problems with the reduce-scatter phase's sends ``first … first+count−1`` (0-based)."""
    n = len(xs)
    problems = []
    for j in range(1, count + 1):
        i = first + j - 1
        if i >= len(sends) or sends[i].data is None or sends[i].data.numel() != c:
            continue
        ranks = behind(me, j, n)
        ok = any(torch.equal(sends[i].data, sum(xs[q][k * c:(k + 1) * c] for q in ranks)) for k in range(n))
        if not ok:
            held = explain(sends[i].data, xs, c) or "values that are no sum of one chunk over any ranks"
            problems.append(f"send {i + 1} carried {held}; at step {j} of the reduce-scatter a rank passes on one "
                            f"chunk summed over {_ranks(ranks)} (itself and the {j - 1} before it on the ring)")
    return problems


def _summary_ring(op: str, factor: str):
    def summary(facts: dict) -> str:
        return (f"{facts['n']} ranks: each sent {facts['sends']} chunk{'s' if facts['sends'] > 1 else ''} of {facts['chunk_bytes']} bytes to its right "
                f"neighbour, {facts['sent']} bytes = {factor}·S for S = {facts['S']} bytes")
    return summary


@lab("ring_reduce_scatter", ("ring_reduce_scatter",), params=RING_PARAMS, forbid_ops=COLLECTIVES, why=RING_WHY,
     forbid_modules=("intralayer.collectives",),
     summary=_summary_ring("reduce-scatter", "(n−1)/n"))
def check_reduce_scatter(ns, case, group) -> dict:
    n, me = group_info(group)
    c = case["chunk"]
    xs = inputs(case, n)
    with watch() as calls:                 # collectives are refused (forbid_ops)
        out = ns.ring_reduce_scatter(xs[me].clone(), group)
    want = sum(xs)[me * c:(me + 1) * c]
    problems = []
    wrong = differ(out, want, "the returned chunk")
    if wrong:
        held = explain(out, xs, c) if isinstance(out, torch.Tensor) and out.shape == want.shape else None
        problems.append(wrong + (f"; it holds {held}; it should hold chunk {me} summed over all {n} ranks"
                                 if held else ""))
    S = xs[0].numel() * xs[0].element_size()
    problems += ring_traffic(calls, n, me, c, n - 1, S, "reduce-scatter")
    problems += partial_sums(calls_of(calls, "send"), xs, me, c, 0, n - 1)
    sends = calls_of(calls, "send")
    return {"problems": problems, "facts": {"n": n, "sends": len(sends), "chunk_bytes": c * xs[0].element_size(),
                                            "sent": sum(s.bytes for s in sends), "S": S}}


@lab("ring_all_reduce", ("ring_all_reduce",), params=RING_PARAMS, forbid_ops=COLLECTIVES, why=RING_WHY,
     forbid_modules=("intralayer.collectives",),
     summary=_summary_ring("all-reduce", "2(n−1)/n"))
def check_all_reduce(ns, case, group) -> dict:
    n, me = group_info(group)
    c = case["chunk"]
    xs = inputs(case, n)
    earlier = earlier_part(ns, "ring_reduce_scatter", 1, check_reduce_scatter, case, group)
    with watch() as calls:                 # collectives are refused (forbid_ops)
        out = ns.ring_all_reduce(xs[me].clone(), group)
    if earlier:                            # what follows would only repeat it
        return {"problems": earlier, "facts": {}}
    problems = []
    total = sum(xs)
    wrong = differ(out, total, "the result")
    if wrong and isinstance(out, torch.Tensor) and out.shape == total.shape:
        for k in range(n):
            piece = out[k * c:(k + 1) * c]
            if not torch.equal(piece, total[k * c:(k + 1) * c]):
                held = explain(piece, xs, c)
                wrong += f"; its chunk {k} holds " + (held if held else "values that are no sum of that chunk")
                break
    if wrong:
        problems.append(wrong)
    S = xs[0].numel() * xs[0].element_size()
    problems += ring_traffic(calls, n, me, c, 2 * (n - 1), S, "all-reduce")
    sends = calls_of(calls, "send")
    problems += partial_sums(sends, xs, me, c, 0, n - 1)
    for i in range(n - 1, min(len(sends), 2 * (n - 1))):
        data = sends[i].data
        if data is None or data.numel() != c:
            continue
        if not any(torch.equal(data, total[k * c:(k + 1) * c]) for k in range(n)):
            held = explain(data, xs, c) or "values that are no sum of one chunk"
            problems.append(f"send {i + 1} (step {i - n + 2} of the all-gather phase) carried {held}; in the "
                            f"all-gather phase a rank passes on finished chunks, summed over all {n} ranks")
    return {"problems": problems, "facts": {"n": n, "sends": len(sends), "chunk_bytes": c * xs[0].element_size(),
                                            "sent": sum(s.bytes for s in sends), "S": S}}


# ---------------------------------------------------------------------------- bug hunt: all-gather backward

def _gather(x: torch.Tensor, group) -> torch.Tensor:
    n = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=0)                                   # (n·b, ...)


class GatherKeepOwnGradient(torch.autograd.Function):
    """All-gather along dim 0; backward hands back only this rank's own rows of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        n, me = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(n, dim=0)[me].contiguous(), None          # the other ranks' gradients are lost


class GatherSumGradient(torch.autograd.Function):
    """All-gather along dim 0; backward sums every rank's gradient and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        n, me = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)                     # a reduce-scatter, as all-reduce + slice
        return total.chunk(n, dim=0)[me].contiguous(), None


class GatherAverageGradient(torch.autograd.Function):
    """All-gather along dim 0; backward averages every rank's gradient and keeps this rank's rows."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        n, me = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return (total / n).chunk(n, dim=0)[me].contiguous(), None   # an average: 1/n of the sum


class GatherOwnTimesN(torch.autograd.Function):
    """All-gather along dim 0; backward hands back n times this rank's own rows of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        n, me = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return n * grad.chunk(n, dim=0)[me].contiguous(), None      # right only if every rank's loss is the same


def all_gather_keep_own(x, group):
    """All-gather whose backward keeps only this rank's own gradient."""
    return GatherKeepOwnGradient.apply(x, group)


def all_gather_sum(x, group):
    """All-gather whose backward sums every rank's gradient (a reduce-scatter)."""
    return GatherSumGradient.apply(x, group)


def all_gather_own_times_n(x, group):
    """All-gather whose backward scales this rank's own gradient by n (right only when every rank's loss is the same)."""
    return GatherOwnTimesN.apply(x, group)


def all_gather_average(x, group):
    """All-gather whose backward averages the ranks' gradients."""
    return GatherAverageGradient.apply(x, group)


hunt("gather_backward", "test_all_gather", {
    "keep_own": Implementation(all_gather_keep_own, True, "lightly-ai/lightly#1528"),
    "correct": Implementation(all_gather_sum, False),
    "average": Implementation(all_gather_average, True, "cellarium-ai/cellarium-ml#184"),
    "own_times_n": Implementation(all_gather_own_times_n, True),
}, hint="give each rank a loss of its own (weights that depend on the rank, say) and expect, for each rank's "
        "x, the gradient of the sum of all the ranks' losses: when every rank's loss is the same, keeping "
        "one's own gradient differs from the right answer only by the factor n, which a test can overlook")
