"""Chapter 07's lab and bug hunt: the all-gather matmul as a ring that multiplies while it sends.

Lab (``solutions/labs/07_overlap.ipynb``), a column-parallel linear layer whose input comes
sequence-parallel (chapter 03): rank r holds the rows ``x_shard`` (n, k) of the input X
(t·n, k) and its own weight ``W_r`` (o, k); the layer is ``Y_r = AllGather(X) W_rᵀ``, the
columns of the dense ``Y = X Wᵀ`` that rank r computes.

- ``ring_allgather_matmul(x_shard, weight, group)`` returns ``(out, gathered)``: ``out`` =
  ``F.linear(all_gather(x_shard), weight)``, (t·n, o), and ``gathered`` = the all-gather,
  (t·n, k). Wang et al.'s decomposition (chapter 07): t−1 steps round the ring; at step i
  rank r holds rank (r−i) mod t's shard, posts the exchange that passes it to r+1 and
  receives the next from r−1, and multiplies the shard it holds while that exchange is in
  flight.
- ``AllGatherMatmul``, a ``torch.autograd.Function`` (``.apply(x_shard, weight, group)``):
  forward the ring above; backward x_shard's gradient as the partial-sum ring of chapter
  07 (the reduce-scatter of ``grad @ W_r``: partial sums travel to r+1, each rank adding
  its product for the rows the sum is collecting, computed while the sum is in flight),
  and the weight's gradient ``gradᵀ · gathered`` (this rank's own, nothing to reduce).

The checks run them in float64 on 2, 3 and 4 ranks against the dense layer, forward and
backward, and follow every message (:mod:`.monitor`): t−1 sends of one shard each to the
right neighbour, (t−1)/t·S bytes in all, the all-gather's bus factor
(:func:`intralayer.comm.bus_factor`), what each send carried, no collective. They also
check the *schedule*: a :class:`TorchDispatchMode` sees every matrix product with the
weight, and the process group's ``send``/``recv`` and ``Work.wait`` are followed while the
learner's code runs, so the check knows, at each product, how many receives were posted
and not yet waited for. A ring that waits for the next shard before multiplying the one it
holds computes the right numbers with nothing overlapped, and is rejected in words.

Bug hunt: ``allgather_matmul(x_shard, weight, group)`` as a ring that writes the product
of step i at row block i (the step) rather than at the block of the shard's owner: right
on rank 0 of 2 ranks, wrong everywhere else. The second buggy implementation places the
shard that came from the left at the rows of the right neighbour: right on 2 ranks, where
r−1 and r+1 are the same rank, wrong on 3 or more. Both are the course's own variants: no
public report of either bug was found.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .parts import Implementation, Param, hunt, lab
from .common import calls_of, differ, earlier_part, group_info
from .runner import COLLECTIVES, FLIGHT, Mode, watch

#: float64: the longest reduction is a k = 5 or o = 4 term dot product, or a t ≤ 4 term sum
#: of such products; 2γ_n·Σ|terms| with n ≤ 20 and Σ|terms| ≲ 20 is ≈ 1e-13, so 1e-10 is
#: a wide margin far below any wrong answer (a missing or misplaced block is of order 1).
TOL = dict(rtol=1e-10, atol=1e-10)
K_ = 5                                                 # in features (out features: the case's "out")
PARAMS = {"rows": Param(2, minimum=1), "out": Param(4, (4, 6)), "seed": Param(0, minimum=0)}
WHY = ("this lab builds the ring from point-to-point sends and receives (dist.P2POp, "
       "dist.batch_isend_irecv); intralayer.overlap holds the answer and intralayer.comm's ring "
       "exchange would do the sending for you")
FORBIDDEN = ("intralayer.overlap", "intralayer.comm")


# ---------------------------------------------------------------------------- inputs

def layer(case: dict, t: int) -> dict:
    """The dense layer, the same on every rank: X (t·n, k), each rank's weight (o, k) and
    upstream gradient (t·n, o), in float64."""
    g = torch.Generator().manual_seed(7000 + 100 * case["seed"] + t)
    n = case["rows"]
    x = torch.randn(t * n, K_, generator=g, dtype=torch.float64)                   # (t·n, k)
    weights = [torch.randn(case["out"], K_, generator=g, dtype=torch.float64) for _ in range(t)]
    grads = [torch.randn(t * n, case["out"], generator=g, dtype=torch.float64) for _ in range(t)]
    return {"x": x, "weights": weights, "grads": grads, "n": n}


# ---------------------------------------------------------------------------- the schedule

class _Products(Mode):
    """Every matrix product with the weight (or a copy of it), and what was in flight then.

    Dispatch-level ops are seen in the backward pass too (the engine runs it on this
    thread). A tensor made from the weight (``.t()``, ``.contiguous()``, ``.clone()``) counts
    as the weight; the product's other operand is recorded with the number of receives
    posted so far and the number posted and not yet waited for.
    """

    PRODUCTS = ("mm", "addmm", "bmm", "baddbmm", "mv", "dot")
    #: What makes a view or copy of the weight (a tensor merely shaped like it, new_empty or zeros_like, is not).
    COPIES = {"t", "transpose", "permute", "view", "_unsafe_view", "reshape", "_reshape_alias", "clone", "contiguous",
              "detach", "alias", "expand", "as_strided", "_to_copy", "copy_", "lift_fresh", "numpy_T", "unsqueeze",
              "squeeze", "lift_fresh_copy"}

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No torch.compile runs here: do not wrap the handler for it (that imports torch._dynamo,
        several seconds per rank)."""
        return False

    def __init__(self, storages: set, flight: dict, base: int = 0):
        super().__init__()
        self.storages, self.flight, self.base = storages, flight, base
        self.products: list[dict] = []
        self.before = dict(flight["pending"])                 # receives left in flight by earlier code (the forward)
        self.seen = dict(flight["sending"])   # sends in flight then, or at an earlier product (kept: ids stay unique)

    def _is_weight(self, a) -> bool:
        return isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self.storages

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if any(self._is_weight(a) for a in tensors):
            if func.overloadpacket.__name__ in self.PRODUCTS:
                operand = next((a for a in tensors[-2:] if not self._is_weight(a)), None)
                if operand is not None:                          # a send counts for the first product it spans
                    self.products.append({"operand": operand.detach().clone(),
                                          "posted": self.flight["posted"] - self.base,
                                          "in_flight": len(self.flight["pending"].keys() - self.before.keys()),
                                          "sending": len(self.flight["sending"].keys() - self.seen.keys())})
                    self.seen.update(self.flight["sending"])
            elif func.overloadpacket.__name__ in self.COPIES:     # a view or copy of the weight
                for o in (out if isinstance(out, (tuple, list)) else (out,)):
                    if isinstance(o, torch.Tensor):
                        self.storages.add(o.untyped_storage().data_ptr())
        return out


@contextmanager
def schedule(weight: torch.Tensor, storages: set | None = None):
    """Follow the learner's receives and waits, and its products with ``weight`` (and with the
    tensors in ``storages``, copies of it seen before; the set grows with new copies)."""
    storages = {weight.untyped_storage().data_ptr()} if storages is None else storages
    mode = _Products(storages, FLIGHT, FLIGHT["posted"])
    with mode:
        yield mode


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` equals ``b`` or its transpose (``W @ xᵀ`` multiplies the same rows as ``x @ Wᵀ``); a batch
    of one (what ``einsum`` may hand ``bmm``) counts as its matrix."""
    while a.dim() > 2 and a.shape[0] == 1:
        a = a[0]
    return any(c.shape == b.shape and torch.allclose(c, b, **TOL) for c in ((a, a.mT) if a.dim() == 2 else (a,)))


def _which(operand: torch.Tensor, blocks: list[torch.Tensor]) -> int | None:
    return next((q for q, b in enumerate(blocks) if _same(operand, b)), None)


def product_order(products: list[dict], blocks: list[torch.Tensor], whole: torch.Tensor, what: str,
                  order: list[int] | None) -> list[str]:
    """Problems with the products: t of them, one block of rows each (in ``order`` if given),
    and t−1 with a receive in flight (posted and not yet waited for).

    Forward (``order`` given) the products of steps 0 … t−2 overlap the exchange that brings
    the next shard; backward the products of steps 1 … t−1 overlap the partial sum that is
    travelling (step 0's product is what the first sum starts from).
    """
    t = len(blocks)
    if not products:
        return [f"no product with the weight was seen in the {what}: multiply with the weight you were given "
                "(F.linear, @ or torch.matmul)"]
    which = [_which(p["operand"], blocks) for p in products]
    for p, q in zip(products, which):
        if q is None:
            if _same(p["operand"], whole):
                return [f"the {what} multiplied all t·n = {whole.shape[0]} rows in one product, outside the ring: "
                        "nothing overlaps; multiply each block of n rows as you hold it"]
            return [f"the {what} multiplied a tensor of shape {tuple(p['operand'].shape)} with the weight, which "
                    f"is no block of n = {blocks[0].shape[0]} rows: multiply one block per step"]
    if len(products) != t:
        return [f"the {what} made {len(products)} product{'s' if len(products) != 1 else ''} with the weight; a "
                f"ring of {t} ranks makes {t}, one per block of rows"]
    problems = []
    if order is not None and which != order:
        i = next(i for i, (a, b) in enumerate(zip(which, order)) if a != b)
        problems.append(f"at step {i} the {what} multiplied rank {which[i]}'s shard; at step i a rank holds, and "
                        f"multiplies, the shard of rank (r − i) mod t = {order[i]}")
    lead = 1 if order is not None else 0                  # receives a product needs posted before it
    should = range(t - 1) if order is not None else range(1, t)
    alone = [i for i in should if products[i]["in_flight"] == 0]
    overlapped = sum(1 for p in products if p["in_flight"] > 0)
    if overlapped < t - 1 and alone:
        i = alone[0]
        if products[i]["posted"] < i + lead:
            why = "the receive it should overlap was not posted yet: post the exchange first, then multiply, then wait"
        else:
            why = ("it had already waited for the receive it posted: wait only after the product, so that the "
                   "transfer runs while the rank multiplies")
        problems.append(f"the {what}'s product of step {i} ran with no receive in flight: {why}. "
                        f"Only {overlapped} of {t} products overlapped a transfer; the ring overlaps {t - 1}")
    elif unsent := [i for i in should if products[i]["sending"] == 0]:
        problems.append(f"the {what}'s product of step {unsent[0]} ran after this rank's send of that step had been "
                        "waited for (or made with the blocking dist.send): the transfer a product overlaps is the "
                        "whole exchange, the send as well as the receive — post both (dist.isend and dist.irecv, "
                        "or batch_isend_irecv), multiply, then wait for both")
    return problems


# ---------------------------------------------------------------------------- messages

def ring_messages(calls, t: int, me: int, elements: int, what: str) -> list[str]:
    """t−1 sends of ``elements`` each to the right, t−1 receives from the left, nothing else."""
    problems = []
    sends, recvs = calls_of(calls, "send"), calls_of(calls, "recv")
    right, left = (me + 1) % t, (me - 1) % t
    others = [c for c in calls if c.op not in ("send", "recv")]
    if others:
        problems.append(f"the {what} also used {others[0].op.replace('_', '-')}: a ring moves everything with "
                        "sends and receives")
    if len(sends) != t - 1:
        problems.append(f"the {what} sent {len(sends)} message{'s' if len(sends) != 1 else ''}; a ring of {t} "
                        f"ranks takes {t - 1} step{'s' if t != 2 else ''}, one send each")
    if len(recvs) != t - 1:
        problems.append(f"the {what} received {len(recvs)} message{'s' if len(recvs) != 1 else ''}; it should "
                        f"receive {t - 1}, one per step")
    wrong_peer = sorted({s.peer for s in sends if s.peer != right})
    if wrong_peer:
        problems.append(f"the {what} sent to group rank {wrong_peer[0]}: on the ring each rank sends only to "
                        f"its right neighbour, group rank {right}")
    wrong_src = sorted({-1 if r.peer is None else r.peer for r in recvs if r.peer != left})
    if wrong_src:
        problems.append(f"the {what} received from {'any source' if wrong_src[0] == -1 else wrong_src[0]}: each "
                        f"rank receives only from its left neighbour, group rank {left}")
    sizes = sorted({s.elements for s in sends})
    if sends and sizes != [elements]:
        problems.append(f"the {what}'s messages held {', '.join(map(str, sizes))} elements; each step passes one "
                        f"block of n rows, {elements} elements")
    return problems


def _summary_forward(facts: dict) -> str:
    sends = f"{facts['sends']} send{'s' if facts['sends'] != 1 else ''}"
    return (f"{facts['n']} ranks (n = {facts['shape'][0]}, o = {facts['shape'][1]}): out and gathered equal the "
            f"dense layer's; {sends} of "
            f"{facts['bytes']} bytes to the right, {facts['sent']} bytes = (t−1)/t·S for S = {facts['S']} bytes; "
            f"{facts['overlapped']} of {facts['products']} products with a receive in flight")


@lab("ring_allgather_matmul", ("ring_allgather_matmul",), params=PARAMS, forbid_ops=COLLECTIVES,
     forbid_modules=FORBIDDEN, why=WHY, summary=_summary_forward)
def check_forward(ns, case, group) -> dict:
    t, me = group_info(group)
    d = layer(case, t)
    n, x, w = d["n"], d["x"], d["weights"][me]
    shards = list(x.split(n))                                                     # t × (n, k)
    w = w.clone()
    with watch() as calls, schedule(w) as seen:
        result = ns.ring_allgather_matmul(shards[me].clone(), w, group)
    products = seen.products
    if not (isinstance(result, tuple) and len(result) == 2):
        return {"problems": [f"ring_allgather_matmul returned {type(result).__name__}; it should return the pair "
                             "(out, gathered)"], "facts": {}}
    out, gathered = result
    problems = []
    for got, want, name in ((out, F.linear(x, w), "out"), (gathered, x, "gathered")):
        wrong = differ(got, want, name, **TOL)
        if wrong and isinstance(got, torch.Tensor) and got.shape == want.shape:
            block = [want[q * n:(q + 1) * n] for q in range(t)]
            bad = [q for q in range(t) if not torch.allclose(got[q * n:(q + 1) * n], block[q], **TOL)]
            plural = len(bad) > 1
            wrong += f"; row block{'s' if plural else ''} {bad} {'are' if plural else 'is'} wrong"
            moved = [(q, p) for q in bad for p in range(t) if p != q and
                     torch.allclose(got[q * n:(q + 1) * n], block[p], **TOL)]
            if moved:
                q, p = moved[0]
                wrong += (f": block {q} holds rank {p}'s rows. Rank q's shard, and its product, belong at rows q·n "
                          "to (q+1)·n − 1, whichever step it arrives at")
        if wrong:
            problems.append(wrong)
    sends = calls_of(calls, "send")
    problems += ring_messages(calls, t, me, n * K_, "ring")
    for i, s in enumerate(sends[:t - 1]):
        want = shards[(me - i) % t]
        if s.data is not None and s.data.numel() == want.numel() and not torch.equal(s.data.reshape(want.shape), want):
            q = _which(s.data.reshape(want.shape), shards)
            held = f"rank {q}'s shard" if q is not None else "something that is no rank's shard"
            problems.append(f"send {i + 1} carried {held}; at step {i} a rank passes on the shard it holds, rank "
                            f"{(me - i) % t}'s (its own first, then each one it received)")
            break
    order = [(me - i) % t for i in range(t)]
    problems += product_order(products, shards, x, "forward pass", order)
    S = x.numel() * x.element_size()
    return {"problems": problems,
            "facts": {"n": t, "shape": (n, case["out"]), "sends": len(sends), "bytes": n * K_ * x.element_size(),
                      "sent": sum(s.bytes for s in sends), "S": S,
                      "overlapped": sum(1 for p in products if p["in_flight"] > 0), "products": len(products)}}


def _summary_autograd(facts: dict) -> str:
    return (f"{facts['n']} ranks (n = {facts['shape'][0]}, o = {facts['shape'][1]}): out, x_shard.grad and "
            "weight.grad equal the dense layer's; backward "
            f"{facts['sends']} send{'s' if facts['sends'] != 1 else ''} of partial sums, {facts['sent']} bytes = "
            f"(t−1)/t·S for S = {facts['S']} bytes; {facts['overlapped']} of {facts['products']} backward products "
            "with a receive in flight")


@lab("allgather_matmul_backward", ("AllGatherMatmul",), params=PARAMS, forbid_ops=COLLECTIVES,
     forbid_modules=FORBIDDEN, why=WHY, summary=_summary_autograd)
def check_autograd(ns, case, group) -> dict:
    earlier = earlier_part(ns, "ring_allgather_matmul", 1, check_forward, case, group)
    t, me = group_info(group)
    d = layer(case, t)
    n, x = d["n"], d["x"]
    shards = list(x.split(n))
    w0, dy = d["weights"][me], d["grads"][me]
    x_shard = shards[me].clone().requires_grad_()
    w = w0.clone().requires_grad_()
    with watch() as forward, schedule(w) as seen:
        out = ns.AllGatherMatmul.apply(x_shard, w, group)
    storages = seen.storages
    problems = []
    wrong = differ(out, F.linear(x, w0), "the output", **TOL)
    if wrong:
        problems.append(wrong)
    problems += ring_messages(forward, t, me, n * K_, "forward pass")
    problems += product_order(seen.products, shards, x, "forward pass", [(me - i) % t for i in range(t)])
    if not (isinstance(out, torch.Tensor) and out.requires_grad and out.shape == (t * n, w0.shape[0])):
        problems.append("the output does not carry a gradient: return the tensor the ring computed from forward")
        return {"problems": earlier or problems, "facts": {}}
    with watch() as backward, schedule(w, storages) as seen:
        (out * dy).sum().backward()                    # upstream gradient dy; out.backward(dy) would import sympy
    products = seen.products
    contributions = [d["grads"][p] @ d["weights"][p] for p in range(t)]           # each rank's (t·n, k) part
    dx = sum(contributions)                                                          # the dense dX
    wrong = differ(x_shard.grad, dx[me * n:(me + 1) * n], "x_shard.grad", **TOL)
    if wrong:
        mine = contributions[me][me * n:(me + 1) * n]
        if isinstance(x_shard.grad, torch.Tensor) and torch.allclose(x_shard.grad, mine, **TOL):
            wrong += (f"; it is this rank's own product only: the gradient of rank {me}'s rows sums the products "
                      f"of all {t} ranks (a reduce-scatter)")
        problems.append(wrong)
    wrong = differ(w.grad, dy.T @ x, "weight.grad", **TOL)
    if wrong:
        problems.append(wrong + "; the weight's gradient is gradᵀ · gathered, every row of the gathered input")
    problems += ring_messages(backward, t, me, n * K_, "backward pass")
    sends = calls_of(backward, "send")
    for i, s in enumerate(sends[:t - 1]):
        ranks = sorted((me - j) % t for j in range(i + 1))                           # the i+1 ranks ending at me
        data = s.data.reshape(n, K_) if s.data is not None and s.data.numel() == n * K_ else None
        if data is not None and not any(torch.allclose(data, sum(contributions[p][q * n:(q + 1) * n] for p in ranks),
                                                       **TOL) for q in range(t)):
            problems.append(f"backward send {i + 1} carried no partial sum of rows over ranks {ranks}: at step {i} "
                            f"a rank passes on the sum for one rank's rows collected by the {i + 1} rank"
                            f"{'s' if i else ''} ending at it, its own product added last")
            break
    blocks = list(dy.split(n))                                                       # t × (n, o)
    problems += product_order(products, blocks, dy, "backward pass", None)
    return {"problems": earlier or problems,
            "facts": {"n": t, "shape": (n, case["out"]), "sends": len(sends), "sent": sum(s.bytes for s in sends),
                      "S": dx.numel() * dx.element_size(), "products": len(products),
                      "overlapped": sum(1 for p in products if p["in_flight"] > 0)}}


# ---------------------------------------------------------------------------- bug hunt: where the rows go

def _pass_on(held: torch.Tensor, group) -> tuple[torch.Tensor, list]:
    """Post the exchange: ``held`` to rank r+1, the next shard from r−1. Returns (buffer, requests)."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    incoming = torch.empty_like(held)
    ops = [dist.P2POp(dist.isend, held, group=group, group_peer=(r + 1) % t),
           dist.P2POp(dist.irecv, incoming, group=group, group_peer=(r - 1) % t)]
    return incoming, dist.batch_isend_irecv(ops)


def allgather_matmul(x_shard, weight, group):
    """All-gather matmul round a ring, each product written at its shard's rows."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = x_shard.shape[0]
    out = x_shard.new_empty(t * n, weight.shape[0])                     # (t·n, o)
    held = x_shard.contiguous()
    for i in range(t):
        if i < t - 1:
            incoming, requests = _pass_on(held, group)                  # in flight during the product
        q = (r - i) % t                                                  # whose shard this rank holds
        out[q * n:(q + 1) * n] = F.linear(held, weight)                  # (n, o)
        if i < t - 1:
            for request in requests:
                request.wait()
            held = incoming
    return out


def allgather_matmul_step_rows(x_shard, weight, group):
    """All-gather matmul round a ring, each product written at the rows of its step."""
    t = dist.get_world_size(group)
    n = x_shard.shape[0]
    out = x_shard.new_empty(t * n, weight.shape[0])                     # (t·n, o)
    held = x_shard.contiguous()
    for i in range(t):
        if i < t - 1:
            incoming, requests = _pass_on(held, group)                  # in flight during the product
        out[i * n:(i + 1) * n] = F.linear(held, weight)                  # (n, o)
        if i < t - 1:
            for request in requests:
                request.wait()
            held = incoming
    return out


def allgather_matmul_mirrored(x_shard, weight, group):
    """All-gather matmul round a ring, each shard placed as if it came from the right neighbour."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = x_shard.shape[0]
    out = x_shard.new_empty(t * n, weight.shape[0])                     # (t·n, o)
    held = x_shard.contiguous()
    for i in range(t):
        if i < t - 1:
            incoming, requests = _pass_on(held, group)                  # in flight during the product
        q = (r + i) % t                                                  # the right neighbour's, i steps on
        out[q * n:(q + 1) * n] = F.linear(held, weight)                  # (n, o)
        if i < t - 1:
            for request in requests:
                request.wait()
            held = incoming
    return out


hunt("ring_output_rows", "test_allgather_matmul", {
    "step_rows": Implementation(allgather_matmul_step_rows, True),
    "correct": Implementation(allgather_matmul, False),
    "mirrored": Implementation(allgather_matmul_mirrored, True),
}, hint="compare the whole (t·n, o) output with the unfused all-gather and matmul on every rank, not on rank 0 "
        "only, and give every rank a different shard: the misplaced blocks show on the ranks other than 0, and "
        "a shard placed as if it came from the other side only on 3 or more ranks")
