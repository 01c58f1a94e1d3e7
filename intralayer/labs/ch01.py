"""Chapter 01's lab and bug hunt: Megatron's f and g; a row-parallel layer's bias.

Lab (``solutions/labs/01_split_matmul.ipynb``): the learner writes the two conjugate
operators of Megatron-LM's tensor parallelism as ``torch.autograd.Function`` classes that
take the process group, ``CopyToGroup.apply(x, group)`` (*f*: identity forward,
all-reduce of the gradient backward) and ``ReduceFromGroup.apply(x, group)`` (*g*:
all-reduce forward, identity backward). The checks run them on 2, 3 and 4 ranks in
float64, give every rank a different upstream gradient (so summing and not summing
differ), and count the collectives of each pass: f sends nothing forward and one
all-reduce backward; g one all-reduce forward and nothing backward, and leaves its input
unchanged (``dist.all_reduce`` works in place).

Bug hunt: a row-parallel linear layer adds its bias before the partial products are
summed, so the output holds t times the bias — reported in the MinivLLM teaching engine
(Wenyueh/MinivLLM#80), fixed in PaddlePaddle (PaddlePaddle/Paddle#35186) and in
torchtitan's GPT-OSS experts (pytorch/torchtitan#4245). The second buggy implementation
adds bias/t on every rank by a plain division: the output is right, but the bias's
gradient is t times too small wherever nothing sums the replicated bias's gradient over
the ranks (here nothing does). torchtitan's GPT-OSS experts scale the bias with an
autograd function of their own to keep its gradient unscaled (``ScaleBiasForward``), and
a torchtitan pull request (pytorch/torchtitan#4332, closed without merging) reports the
plain division in its rowwise linear layer. Only a test of the gradients catches it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .parts import Implementation, Param, hunt, lab
from .common import SumOverGroup, calls_of, differ, group_info, traffic
from .runner import watch

#: float64 throughout: a reordered sum of n ≤ 64 terms of order 1 differs from the dense one
#: by at most 2γ_n·Σ|terms| ≈ 2·64·2⁻⁵³·64 ≈ 9e-13; 1e-10 leaves a hundredfold margin and is
#: far below the smallest error of a wrong answer (a missing or extra term of order 1e-2).
TOL = dict(rtol=1e-10, atol=1e-10)
SHAPES = ((3, 5), (2, 4, 6))                           # (m, h), or (s, b, h): small activations of any shape
PARAMS = {"shape": Param(SHAPES[0], SHAPES)}


def _rand(seed: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _which(got: torch.Tensor, candidates: dict[str, torch.Tensor]) -> str | None:
    for words, value in candidates.items():
        if isinstance(got, torch.Tensor) and got.shape == value.shape and torch.allclose(got, value, **TOL):
            return words
    return None


def _only_all_reduces(calls, count: int, elements: int, what: str) -> list[str]:
    ars = calls_of(calls, "all_reduce")
    others = [c for c in calls if c.op != "all_reduce"]
    problems = []
    if len(ars) != count or others:
        want = "nothing" if count == 0 else f"{'one all-reduce' if count == 1 else f'{count} all-reduces'} " \
                                              f"of the {elements} elements"
        problems.append(f"{what} sent {traffic(calls)}; it should send {want}")
    bad = [c for c in ars if c.elements != elements or c.reduce != "SUM"]
    if len(ars) == count and bad:
        problems.append(f"{what}'s all-reduce was a {bad[0].reduce} of {bad[0].elements} elements; it should be a "
                        f"SUM of the {elements} elements")
    return problems


def _summary_f(facts: dict) -> str:
    return (f"{facts['n']} ranks: forward sends nothing; backward one all-reduce of S = {facts['S']} bytes "
            f"(x.grad = the sum of the {facts['n']} upstream gradients)")


def _summary_g(facts: dict) -> str:
    return (f"{facts['n']} ranks: forward one all-reduce of S = {facts['S']} bytes (the sum of the partials); "
            f"backward sends nothing")


@lab("copy_to_group", ("CopyToGroup",), params=PARAMS, summary=_summary_f)
def check_f(ns, case, group) -> dict:
    n, me = group_info(group)
    x0 = _rand(7, case["shape"])                       # replicated: the same input on every rank
    x = x0.clone().requires_grad_()
    with watch() as forward:
        y = ns.CopyToGroup.apply(x, group)
    problems = []
    wrong = differ(y, x0, "f's output")
    if wrong:
        problems.append(wrong + "; f is the identity in the forward pass")
    problems += _only_all_reduces(forward, 0, x0.numel(), "f's forward pass")
    grads = [_rand(100 + q, case["shape"]) for q in range(n)]         # each rank's upstream gradient differs
    if isinstance(y, torch.Tensor) and y.requires_grad:
        total = sum(grads)
        upstream = grads[me].clone()
        with watch() as backward:
            y.backward(upstream)
        if not torch.equal(upstream, grads[me]):
            problems.append("f's backward wrote into the gradient it was given (dist.all_reduce works in place): "
                            "all-reduce a copy. That tensor is not backward's to change: y.sum().backward(), say, "
                            "hands it one number expanded to x's shape, and an all-reduce in place reads and writes "
                            "past that number's memory (gloo stops with 'Bad address', or memory is corrupted)")
        wrong = differ(x.grad, total, "x.grad", **TOL)
        if wrong:
            seen = _which(x.grad, {"this rank's own upstream gradient": grads[me],
                                   "the average of the upstream gradients": total / n})
            problems.append(wrong + (f"; it is {seen}: f's backward must sum the upstream gradients of all {n} "
                                     "ranks (each rank's copy of x fed a different part of the computation)"
                                     if seen else ""))
        problems += _only_all_reduces(backward, 1, x0.numel(), "f's backward pass")
    else:
        problems.append("f's output does not require a gradient: return a tensor computed in forward, "
                        "as torch.autograd.Function.apply does")
    return {"problems": problems, "facts": {"n": n, "S": x0.numel() * x0.element_size()}}


@lab("reduce_from_group", ("ReduceFromGroup",), params=PARAMS, summary=_summary_g)
def check_g(ns, case, group) -> dict:
    n, me = group_info(group)
    parts = [_rand(200 + q, case["shape"]) for q in range(n)]         # each rank's partial sum differs
    x = parts[me].clone().requires_grad_()
    with watch() as forward:
        y = ns.ReduceFromGroup.apply(x, group)
    total = sum(parts)
    problems = []
    wrong = differ(y, total, "g's output", **TOL)
    if wrong:
        seen = _which(y, {"this rank's own partial": parts[me], "the average of the partials": total / n})
        problems.append(wrong + (f"; it is {seen}: g sums the partials of all {n} ranks" if seen else ""))
    changed = differ(x.detach(), parts[me], "g's input after the call")
    if changed:
        problems.append("g changed its input in place (dist.all_reduce writes its result into the tensor it "
                        "is given): all-reduce a copy, and leave the caller's tensor as it was")
    problems += _only_all_reduces(forward, 1, x.numel(), "g's forward pass")
    grads = [_rand(300 + q, case["shape"]) for q in range(n)]
    if isinstance(y, torch.Tensor) and y.requires_grad:
        with watch() as backward:
            y.backward(grads[me].clone())
        wrong = differ(x.grad, grads[me], "x.grad")
        if wrong:
            seen = _which(x.grad, {"the sum of the upstream gradients": sum(grads),
                                   "the average of the upstream gradients": sum(grads) / n})
            problems.append(wrong + (f"; it is {seen}: g's backward is the identity (the gradient of a sum with "
                                     "respect to each term is the sum's own gradient)" if seen else ""))
        problems += _only_all_reduces(backward, 0, x.numel(), "g's backward pass")
    else:
        problems.append("g's output does not require a gradient: return a tensor computed in forward")
    return {"problems": problems, "facts": {"n": n, "S": x.numel() * x.element_size()}}


# ---------------------------------------------------------------------------- bug hunt: the bias of a row split

class _Sum(torch.autograd.Function):
    """Megatron's g: all-reduce (sum) forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SumBothWays(torch.autograd.Function):
    """All-reduce (sum) forward and backward: g with f's backward too."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def row_linear(x, weight, bias, group):
    """Row-parallel ``x @ W.T + b``: the partial products summed by g, then the bias, once."""
    return _Sum.apply(x @ weight.T, group) + bias                    # (m, h_out)


def row_linear_bias_before_sum(x, weight, bias, group):
    """Row-parallel ``x @ W.T + b`` with the bias added on every rank before the sum."""
    return _Sum.apply(x @ weight.T + bias, group)                    # t·b in the output


def row_linear_bias_over_t(x, weight, bias, group):
    """Row-parallel ``x @ W.T + b`` adding bias/t on every rank before the sum."""
    t = dist.get_world_size(group)
    return _Sum.apply(x @ weight.T + bias / t, group)                # right output; bias.grad / t


def row_linear_sum_backward(x, weight, bias, group):
    """Row-parallel ``x @ W.T + b`` whose g all-reduces the gradient in the backward pass too."""
    return _SumBothWays.apply(x @ weight.T, group) + bias            # x.grad and weight.grad t times too large


def row_linear_bias_through_f(x, weight, bias, group):
    """Row-parallel ``x @ W.T + b`` whose bias passes through f, which sums its gradient over the ranks."""
    return _Sum.apply(x @ weight.T, group) + SumOverGroup.apply(bias, group)   # bias.grad t times too large


hunt("row_parallel_bias", "test_row_linear", {
    "bias_before_sum": Implementation(row_linear_bias_before_sum, True,
                                      "Wenyueh/MinivLLM#80 and PaddlePaddle/Paddle#35186"),
    "correct": Implementation(row_linear, False),
    "bias_over_t": Implementation(row_linear_bias_over_t, True, "pytorch/torchtitan#4332"),
    "sum_backward": Implementation(row_linear_sum_backward, True),
    "bias_through_f": Implementation(row_linear_bias_through_f, True),
}, hint="compare everything the layer promises with a dense nn.Linear: the output and every gradient, "
        "the bias's included")
