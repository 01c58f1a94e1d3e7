"""Chapter 03's lab and bug hunt: the sequence-parallel boundary; the LayerNorm gradients it needs summed.

Lab (``solutions/labs/03_sequence_parallel.ipynb``), with the sequence first, ``(s, b, h)``,
and each of the t ranks holding ``s/t`` consecutive tokens outside the tensor-parallel
regions:

- ``GatherSequence.apply(x, group)``: an autograd function, this rank's ``(s/t, b, h)``
  slice in, the whole ``(s, b, h)`` out — one all-gather along the sequence; its backward
  is one reduce-scatter, because each rank multiplies the gathered tensor by weights of its
  own, so every rank's gradient has a part for every token (Korthikanti et al.'s *g*).
- ``sp_mlp(x, p, group)``: ``x + fc2(gelu(fc1(ln(x))))`` on this rank's slice of the
  sequence, with fc1 column-parallel and fc2 row-parallel: the LayerNorm on the slice, the
  all-gather into fc1, and a reduce-scatter out of fc2 (its backward an all-gather) — one
  all-gather and one reduce-scatter of the (s, b, h) activation each way, the bytes of
  tensor parallelism's all-reduce. The replicated parameters (the LayerNorm's and fc2's
  bias) are left with this rank's share of their gradients.
- ``sync_grads(p, group)``: after backward, sum those shares over the group (one all-reduce
  of the 3h replicated numbers, flattened together, as Megatron-LM coalesces them), leaving
  the sharded parameters' gradients alone.

Every check compares with the dense module in float64 (outputs and every gradient) and
counts the collectives of each pass. The library's own answers (:mod:`intralayer.comm`'s
autograd collectives, :mod:`intralayer.sequence_parallel`, :mod:`intralayer.tensor_parallel`)
are refused while the learner's code runs.

Bug hunt: ``sp_norm_linear(x, ln_w, ln_b, weight, group)``, the entrance of a sequence-
parallel block — LayerNorm on this rank's tokens, all-gather, column-parallel linear. Its
LayerNorm parameters are replicated but each rank's gradient for them covers only its own
tokens, so they must be summed over the group. The bug: nothing sums them, as in GPT-NeoX's
Megatron-style sequence parallelism while it was developed, whose LayerNorm gradient hook
did not take effect until it was registered after DeepSpeed's initialisation; the fix
(EleutherAI/gpt-neox#1259, merged into #1257) also made the hook sum instead of average —
the second buggy implementation here averages. A third sums them twice (t times too large), so
that a test that only asks whether the gradients changed from this rank's own share catches
nothing. The output is right in all four; only the LayerNorm's gradients differ.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .parts import Implementation, Param, hunt, lab
from .common import SumOverGroup, calls_of, differ, earlier_part, group_info, traffic
from .runner import watch

#: float64 throughout: the longest sums are fc2's 24 terms and a weight gradient's s·b = 24 rows
#: of order 1, whose reordering costs ≲ 2γ₂₄·24 ≈ 1.3e-13; 1e-10 leaves a wide margin and sits
#: orders of magnitude below any wrong answer (a missing rank's share is of order 0.1).
TOL = dict(rtol=1e-10, atol=1e-10)
S_, B_ = 12, 2                              # (s, b); h is the case's, 6 or 9: t = 2, 3, 4 divide s and 4h
SEED = {"h": Param(6, (6, 9)), "seed": Param(0, minimum=0)}
REPLICATED = ("ln_w", "ln_b", "b2")
NAMES = {"ln_w": "the LayerNorm's weight (ln_w)", "ln_b": "the LayerNorm's bias (ln_b)",
         "w1": "fc1's weight (w1)", "b1": "fc1's bias (b1)", "w2": "fc2's weight (w2)", "b2": "fc2's bias (b2)"}
WHY_GATHER = ("intralayer.comm and intralayer.sequence_parallel hold the library's own all-gather along the "
              "sequence, and torch.distributed.nn.functional torch's differentiable one (its backward a "
              "reduce-scatter): the answer to this part; build it from torch.distributed's collectives")
WHY_MLP = ("intralayer.comm, intralayer.sequence_parallel and intralayer.tensor_parallel hold the library's own "
           "sequence-parallel layers, and torch.distributed.nn.functional torch's differentiable collectives: the "
           "answer to this lab; use your GatherSequence and torch.distributed")
#: torch's differentiable collectives: an all-gather whose backward reduce-scatters is GatherSequence itself.
TORCH_AUTOGRAD = ("torch.distributed.nn.functional", "torch.distributed._functional_collectives")


def _rand(g: torch.Generator, *shape) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def _rows(n: int, r: int) -> slice:
    """Rank r's tokens: rows r·s/t to (r+1)·s/t − 1 of the sequence."""
    return slice(r * S_ // n, (r + 1) * S_ // n)


def _one(calls, op: str, elements: int, what: str, why: str) -> list[str]:
    """Problems unless ``calls`` is exactly one ``op`` (a sum) of ``elements`` elements."""
    word = op.replace("_", "-")
    if len(calls) != 1 or calls[0].op != op:
        return [f"{what} sent {traffic(calls)}; it should send one {word} of the {elements} elements: {why}"]
    c = calls[0]
    if c.elements != elements or (c.reduce is not None and c.reduce != "SUM"):
        return [f"{what}'s {word} was {f'a {c.reduce} ' if c.reduce else ''}of {c.elements} elements; it should "
                f"{'sum ' if c.reduce else 'gather '}the (s, b, h) = {elements} elements"]
    return []


# ---------------------------------------------------------------------------- part 1: the all-gather

def _summary_gather(facts: dict) -> str:
    return (f"{facts['n']} ranks: forward one all-gather, backward one reduce-scatter, each of S = s·b·h = "
            f"{facts['elements']} elements ({facts['S']} bytes; each rank sends (t−1)/t·S = {facts['sent']} bytes); "
            f"x.grad = this rank's rows of the sum of the {facts['n']} ranks' gradients")


@lab("gather_sequence", ("GatherSequence",), params=SEED, forbid_modules=("intralayer.comm",
                                                                          "intralayer.sequence_parallel",
                                                                          *TORCH_AUTOGRAD),
     why=WHY_GATHER, summary=_summary_gather)
def check_gather(ns, case, group) -> dict:
    n, me = group_info(group)
    g = torch.Generator().manual_seed(1000 * case["seed"] + n)
    h = case["h"]
    xs = [_rand(g, S_ // n, B_, h) for _ in range(n)]               # every rank's (s/t, b, h) slice
    grads = [_rand(g, S_, B_, h) for _ in range(n)]                 # every rank's own gradient of the gather
    x = xs[me].clone().requires_grad_()
    with watch() as forward:
        y = ns.GatherSequence.apply(x, group)
    whole = torch.cat(xs)                                            # (s, b, h)
    problems = []
    wrong = differ(y, whole, "the gathered output")
    if wrong:
        if isinstance(y, torch.Tensor) and y.numel() == whole.numel() and y.shape != whole.shape:
            wrong += "; gather along dim 0, the sequence: the slices stack into (s, b, h)"
        elif isinstance(y, torch.Tensor) and y.shape == whole.shape:
            rows = S_ // n
            for c in range(n):
                if not torch.equal(y.detach()[c * rows:(c + 1) * rows], xs[c]):
                    held = next((q for q in range(n) if torch.equal(y.detach()[c * rows:(c + 1) * rows], xs[q])), None)
                    wrong += (f"; its rows {c * rows} to {(c + 1) * rows - 1} hold group rank {held}'s slice, not "
                              f"group rank {c}'s" if held is not None else "") + ": the slices go in group-rank order"
                    break
        problems.append(wrong)
    elements = whole.numel()
    problems += _one(forward, "all_gather", elements, "the forward pass",
                     "every rank's slice, stacked along the sequence")
    if isinstance(y, torch.Tensor) and y.requires_grad and y.shape == whole.shape:
        with watch() as backward:
            y.backward(grads[me].clone())
        want = sum(grads)[_rows(n, me)]
        wrong = differ(x.grad, want, "x.grad", **TOL)
        if wrong:
            own = grads[me][_rows(n, me)]
            if x.grad is not None and x.grad.shape == want.shape and torch.allclose(x.grad, own, **TOL):
                wrong += ("; it is this rank's own gradient of its rows only: each rank multiplied the gathered "
                          f"tensor by weights of its own, so the gradient of x sums the {n} ranks' gradients of "
                          "its rows (a reduce-scatter)")
            elif x.grad is not None and x.grad.shape == want.shape and torch.allclose(x.grad, want / n, **TOL):
                wrong += f"; it is the average, {n} times too small: the ranks' gradients add up"
            problems.append(wrong)
        problems += _one(backward, "reduce_scatter", elements, "the backward pass",
                         "the sum of every rank's gradient, each rank keeping its own rows (an all-reduce would "
                         "send twice the bytes)")
    elif isinstance(y, torch.Tensor) and not y.requires_grad:
        problems.append("the gathered output does not require a gradient: return a tensor computed in forward, "
                        "as torch.autograd.Function.apply does")
    S = elements * whole.element_size()
    return {"problems": problems, "facts": {"n": n, "elements": elements, "S": S, "sent": (n - 1) * S // n}}


# ---------------------------------------------------------------------------- part 2: the MLP

def dense_mlp(seed: int, h: int):
    """A LayerNorm and the MLP's fc1 (h → 4h), fc2 (4h → h) in float64, the same on every rank."""
    torch.manual_seed(seed)
    ln = torch.nn.LayerNorm(h, dtype=torch.float64)
    with torch.no_grad():                           # not ones and zeros: a swapped or missing term shows
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.normal_()
    return ln, torch.nn.Linear(h, 4 * h, dtype=torch.float64), torch.nn.Linear(4 * h, h, dtype=torch.float64)


def reference(seed: int, n: int, me: int, h: int) -> dict:
    """The dense module's input, output and gradients, and this rank's view of them.

    ``shares``: the replicated parameters' gradients from this rank's tokens only (what each
    rank holds after backward under sequence parallelism, before they are summed).
    """
    ln, fc1, fc2 = dense_mlp(seed, h)
    g = torch.Generator().manual_seed(77 + seed)
    X, U = _rand(g, S_, B_, h), _rand(g, S_, B_, h)                # input and upstream gradient, (s, b, h)
    params = {"ln_w": ln.weight, "ln_b": ln.bias, "w1": fc1.weight, "b1": fc1.bias, "w2": fc2.weight,
              "b2": fc2.bias}

    def run(upstream):
        for p in params.values():
            p.grad = None
        Xl = X.clone().requires_grad_()
        Y = Xl + fc2(F.gelu(fc1(ln(Xl))))
        (Y * upstream).sum().backward()
        return Y.detach(), Xl.grad, {k: p.grad.clone() for k, p in params.items()}

    mine = torch.zeros_like(U)
    mine[_rows(n, me)] = U[_rows(n, me)]                             # the loss of this rank's tokens only
    _, _, shares = run(mine)
    Y, dX, grads = run(U)
    with torch.no_grad():                                            # a common slip, to name it
        Y_tanh = X + fc2(F.gelu(fc1(ln(X)), approximate="tanh"))
    f = 4 * h // n
    cols = slice(me * f, (me + 1) * f)
    cut = {"ln_w": slice(None), "ln_b": slice(None), "w1": cols, "b1": cols, "w2": (slice(None), cols),
           "b2": slice(None)}
    return {"X": X, "U": U, "Y": Y, "Y_tanh": Y_tanh, "dX": dX, "full": grads,
            "weights": {k: params[k].detach()[cut[k]] for k in params},
            "grads": {k: grads[k][cut[k]] for k in params}, "shares": {k: shares[k] for k in REPLICATED}}


def _leaves(tensors: dict) -> dict:
    return {k: v.detach().clone().requires_grad_() for k, v in tensors.items()}


def _summary_mlp(facts: dict) -> str:
    return (f"{facts['n']} ranks: output, x.grad and the sharded gradients equal the dense module's; forward and "
            f"backward each one all-gather and one reduce-scatter of S = s·b·h = {facts['elements']} elements "
            f"({facts['S']} bytes), 2(t−1)/t·S = {facts['sent']} bytes sent per rank each way, as one all-reduce")


@lab("sp_mlp", ("sp_mlp",), params=SEED, forbid_modules=("intralayer.comm", "intralayer.sequence_parallel",
                                                         "intralayer.tensor_parallel", *TORCH_AUTOGRAD), why=WHY_MLP,
     summary=_summary_mlp)
def check_mlp(ns, case, group) -> dict:
    n, me = group_info(group)
    earlier = earlier_part(ns, "GatherSequence", 1, check_gather, case, group)
    ref = reference(case["seed"], n, me, case["h"])
    rows = _rows(n, me)
    p = _leaves(ref["weights"])
    x = ref["X"][rows].clone().requires_grad_()
    with watch() as forward:
        y = ns.sp_mlp(x, p, group)
    problems = []
    wrong = differ(y, ref["Y"][rows], "the output", **TOL)
    if wrong:
        if isinstance(y, torch.Tensor) and y.shape == ref["Y"].shape:
            wrong += " (the whole sequence): return only this rank's s/t tokens — the reduce-scatter's share"
        elif isinstance(y, torch.Tensor) and y.shape == ref["Y"][rows].shape:
            off = y.detach() - ref["Y"][rows]
            b2 = ref["weights"]["b2"].expand_as(off)
            if torch.allclose(off, (n - 1) * b2, **TOL):
                wrong += f"; it holds {n} times fc2's bias: add the bias once, after the reduce-scatter"
            elif torch.allclose(off, -ref["X"][rows], **TOL):
                wrong += "; the residual x is missing"
            elif torch.allclose(y.detach(), ref["Y_tanh"][rows], **TOL):
                wrong += ("; it is the MLP with the tanh approximation of GeLU (approximate='tanh'): this MLP's "
                          "GeLU is the exact one, F.gelu(x) with its default approximate='none', as in the dense "
                          "reference")
        problems.append(wrong)
    elements = ref["X"].numel()
    problems += _boundary(forward, elements, "the forward pass",
                          "the all-gather into fc1 and the reduce-scatter out of fc2")
    if isinstance(y, torch.Tensor) and y.requires_grad and y.shape == ref["Y"][rows].shape:
        with watch() as backward:
            (y * ref["U"][rows]).sum().backward()
        wrong = differ(x.grad, ref["dX"][rows], "x.grad", **TOL)
        if wrong:
            problems.append(wrong)
        for key in ("w1", "b1", "w2"):
            wrong = differ(p[key].grad, ref["grads"][key], f"the gradient of {NAMES[key]}", **TOL)
            if wrong:
                problems.append(wrong + _scaled(p[key].grad, ref["grads"][key], n))
        for key in REPLICATED:
            got, share = p[key].grad, ref["shares"][key]
            wrong = differ(got, share, f"the gradient of {NAMES[key]}", **TOL)
            if wrong:
                if got is not None and got.shape == share.shape and torch.allclose(got, ref["full"][key], **TOL):
                    wrong += (f"; it is already summed over the {n} ranks: leave each rank's share (its own tokens') "
                              "to sync_grads, part 3, run once after the whole backward pass")
                else:
                    wrong += "; after backward it should hold this rank's share: the gradient from its own tokens"
                problems.append(wrong)
        problems += _boundary(backward, elements, "the backward pass",
                              "the reduce-scatter's backward (an all-gather) and the all-gather's (a reduce-scatter)")
    elif isinstance(y, torch.Tensor) and not y.requires_grad:
        problems.append("the output does not require a gradient: build it from x and p with torch operations")
    S = elements * ref["X"].element_size()
    if earlier:                              # what the rest found would only repeat it
        return {"problems": earlier, "facts": {}}
    return {"problems": problems, "facts": {"n": n, "elements": elements, "S": S, "sent": 2 * (n - 1) * S // n}}


def _scaled(got, want: torch.Tensor, n: int) -> str:
    if got is None or got.shape != want.shape:
        return ""
    if torch.allclose(got, n * want, **TOL):
        return f"; it is {n} times too large"
    if torch.allclose(got, want / n, **TOL):
        return f"; it is {n} times too small"
    return ""


def _boundary(calls, elements: int, what: str, which: str) -> list[str]:
    """Exactly one all-gather and one reduce-scatter (a sum), each of the (s, b, h) elements."""
    gathers, scatters = calls_of(calls, "all_gather"), calls_of(calls, "reduce_scatter")
    others = [c for c in calls if c.op not in ("all_gather", "reduce_scatter")]
    problems = []
    if others:
        ar = " (tensor parallelism's all-reduce of the activation: under sequence parallelism it becomes a " \
             "reduce-scatter and an all-gather, the same bytes)" \
            if any(c.elements == elements for c in calls_of(others, "all_reduce")) else ""
        problems.append(f"{what} also sent {traffic(others)}{ar}")
    if len(gathers) != 1 or len(scatters) != 1:
        sent = traffic(gathers + scatters) if gathers or scatters else "no all-gather or reduce-scatter"
        problems.append(f"{what} sent {sent}; it needs one all-gather and one reduce-scatter: {which}")
    else:
        for c in gathers + scatters:
            if c.elements != elements or (c.reduce is not None and c.reduce != "SUM"):
                word = c.op.replace("_", "-")
                problems.append(f"{what}'s {word} was {f'a {c.reduce} ' if c.reduce else ''}of {c.elements} "
                                f"elements; it should move the (s, b, h) = {elements} elements")
    return problems


# ---------------------------------------------------------------------------- part 3: the sync

def _summary_sync(facts: dict) -> str:
    return (f"{facts['n']} ranks: the LayerNorm's and fc2's bias gradients are the dense ones, the sharded ones "
            f"untouched; one all-reduce of 3h = {facts['elements']} elements ({facts['S']} bytes)")


@lab("sync_grads", ("sync_grads",), params=SEED, forbid_modules=("intralayer.comm", "intralayer.sequence_parallel",
                                                                 "intralayer.tensor_parallel"), why=WHY_MLP,
     summary=_summary_sync)
def check_sync(ns, case, group) -> dict:
    n, me = group_info(group)
    ref = reference(case["seed"], n, me, case["h"])
    p = _leaves(ref["weights"])
    for key in p:                                   # as sp_mlp's backward leaves them
        p[key].grad = (ref["shares"][key] if key in REPLICATED else ref["grads"][key]).clone()
    with watch() as calls:
        ns.sync_grads(p, group)
    problems = []
    for key in p:
        want = ref["grads"][key]
        wrong = differ(p[key].grad, want, f"the gradient of {NAMES[key]}", **TOL)
        if not wrong:
            continue
        got = p[key].grad
        same = got is not None and got.shape == want.shape
        if key not in REPLICATED:
            wrong += _scaled(got, want, n) + (f": {key} is this rank's own shard, whose gradient is complete after "
                                              "backward; sum only the replicated parameters")
        elif same and torch.allclose(got, ref["shares"][key], **TOL):
            wrong += (f"; it is still this rank's share: {key} is replicated, and each rank's gradient covers only "
                      f"its own tokens; sum the {n} shares")
        elif same and torch.allclose(got, want / n, **TOL):
            wrong += (f"; it is the average of the shares, {n} times too small: the shares come from different "
                      "tokens, and the gradient is their sum")
        problems.append(wrong)
    elements = 3 * case["h"]
    ars = calls_of(calls, "all_reduce")
    others = [c for c in calls if c.op != "all_reduce"]
    if others or len(ars) != 1:
        problems.append(f"sync_grads sent {traffic(calls)}; it should send one all-reduce of the {elements} "
                        "replicated numbers (ln_w, ln_b and b2 flattened into one tensor, as Megatron-LM coalesces "
                        "them)")
    elif ars[0].elements != elements or ars[0].reduce != "SUM":
        problems.append(f"sync_grads's all-reduce was a {ars[0].reduce} of {ars[0].elements} elements; it should "
                        f"sum the {elements} elements of ln_w, ln_b and b2's gradients")
    return {"problems": problems, "facts": {"n": n, "elements": elements, "S": elements * 8}}


# ---------------------------------------------------------------------------- bug hunt: LayerNorm gradients

class _GatherSequence(torch.autograd.Function):
    """All-gather along the sequence (dim 0) forward; reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out                                                     # (s, b, h)

    @staticmethod
    def backward(ctx, grad):
        n = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // n, *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad.contiguous(), group=ctx.group)
        return out, None                                               # (s/t, b, h)


class _AverageOverGroup(torch.autograd.Function):
    """Identity forward; backward averages the gradient over the group."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total / dist.get_world_size(ctx.group), None           # an average: 1/t of the sum


def sp_norm_linear_unsynced(x, ln_w, ln_b, weight, group):
    """Sequence-parallel LayerNorm and column-parallel linear, whose LayerNorm gradients nothing sums."""
    z = F.layer_norm(x, x.shape[-1:], ln_w, ln_b)                     # (s/t, b, h): this rank's tokens
    return _GatherSequence.apply(z, group) @ weight.T                 # (s, b, out/t)


def sp_norm_linear(x, ln_w, ln_b, weight, group):
    """Sequence-parallel LayerNorm and column-parallel linear, its LayerNorm gradients summed over the group."""
    ln_w, ln_b = SumOverGroup.apply(ln_w, group), SumOverGroup.apply(ln_b, group)
    z = F.layer_norm(x, x.shape[-1:], ln_w, ln_b)                     # (s/t, b, h)
    return _GatherSequence.apply(z, group) @ weight.T                 # (s, b, out/t)


def sp_norm_linear_averaged(x, ln_w, ln_b, weight, group):
    """Sequence-parallel LayerNorm and column-parallel linear, its LayerNorm gradients averaged over the group."""
    ln_w, ln_b = _AverageOverGroup.apply(ln_w, group), _AverageOverGroup.apply(ln_b, group)
    z = F.layer_norm(x, x.shape[-1:], ln_w, ln_b)                     # (s/t, b, h)
    return _GatherSequence.apply(z, group) @ weight.T                 # (s, b, out/t)


def sp_norm_linear_synced_twice(x, ln_w, ln_b, weight, group):
    """Sequence-parallel LayerNorm and column-parallel linear, its LayerNorm gradients summed over the group twice."""
    ln_w, ln_b = (SumOverGroup.apply(SumOverGroup.apply(w, group), group) for w in (ln_w, ln_b))
    z = F.layer_norm(x, x.shape[-1:], ln_w, ln_b)                     # (s/t, b, h)
    return _GatherSequence.apply(z, group) @ weight.T                 # (s, b, out/t)


def sp_norm_linear_bias_unsynced(x, ln_w, ln_b, weight, group):
    """Sequence-parallel LayerNorm and column-parallel linear, which sums ln_w's gradient over the group but not ln_b's."""
    ln_w = SumOverGroup.apply(ln_w, group)
    z = F.layer_norm(x, x.shape[-1:], ln_w, ln_b)                     # (s/t, b, h)
    return _GatherSequence.apply(z, group) @ weight.T                 # (s, b, out/t)


hunt("sp_layernorm_grads", "test_sp_norm_linear", {
    "unsynced": Implementation(sp_norm_linear_unsynced, True, "EleutherAI/gpt-neox#1259"),
    "correct": Implementation(sp_norm_linear, False),
    "averaged": Implementation(sp_norm_linear_averaged, True, "EleutherAI/gpt-neox#1259"),
    "synced_twice": Implementation(sp_norm_linear_synced_twice, True),
    "bias_unsynced": Implementation(sp_norm_linear_bias_unsynced, True),
}, hint="the output and the gradients of x and weight are right in every version: compare the LayerNorm's "
        "gradients, ln_w.grad and ln_b.grad, with those of a dense nn.LayerNorm over the whole sequence, on every "
        "rank")
