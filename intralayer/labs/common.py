"""What the chapters' rank-side checks share: comparing tensors and counting messages in words, and
checking a later part's call of an earlier part (chapter content, not the labs' machinery)."""
from __future__ import annotations

import torch
import torch.distributed as dist

def group_info(group) -> tuple[int, int]:
    """(n, this rank's rank in the group)."""
    return dist.get_world_size(group), dist.get_rank(group)


def differ(got, want: torch.Tensor, what: str, rtol: float = 0.0, atol: float = 0.0) -> str | None:
    """None if ``got`` equals ``want`` within ``atol + rtol·|want|`` (exact by default), else how far off and where."""
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
    flat, index = int(torch.argmax(diff.reshape(-1))), []
    for size in reversed(tuple(want.shape)):          # not torch.unravel_index: it imports sympy (1 s a rank)
        flat, i = divmod(flat, size)
        index.insert(0, i)
    at = index[0] if len(index) == 1 else tuple(index)
    return (f"{what} is off by up to {float(diff.max()):.3g}: at index {at} it is {float(got.detach()[tuple(index)]):.6g}, "
            f"it should be {float(want[tuple(index)]):.6g} ({int(bad.sum())} of {want.numel()} elements wrong)")


def calls_of(calls: list, op: str) -> list:
    return [c for c in calls if c.op == op]


def traffic(calls: list) -> str:
    """'2 all-reduces (12 elements each)'; 'nothing' for no calls."""
    by_op: dict[str, list[int]] = {}
    for c in calls:
        by_op.setdefault(c.op.replace("_", "-"), []).append(c.elements)
    said = []
    for word, sizes in by_op.items():
        plural = word if len(sizes) == 1 else word + ("es" if word.endswith("h") else "s")
        each = f"{sizes[0]} elements" + (" each" if len(sizes) > 1 else "") if len(set(sizes)) == 1 \
            else f"{', '.join(map(str, sizes))} elements"
        said.append(f"{len(sizes)} {plural} ({each})")
    return ", ".join(said) or "nothing"


def earlier_part(ns, name: str, part: int, run, case: dict, group) -> list[str]:
    """Check the learner's ``name`` from part ``part`` first with that part's check ``run`` (on every rank, so
    the ranks stay in step): a later part that calls it cannot be right while it is wrong."""
    if not callable(getattr(ns, name, None)):
        return []
    said = f"your {name} from part {part} fails its check"
    try:
        outcome = run(ns, case, group)
    except Exception as exc:
        text = str(exc).strip()
        exc.args = (f"{said}: it raised {type(exc).__name__}" + (f": {text.splitlines()[0]}" if text else "")
                    + "; fix it first: this part calls it",)
        raise
    return [f"{said} (fix it first: this part calls it): {p}" for p in outcome.get("problems", [])]


class SumOverGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (Megatron's f; a replicated parameter's
    sync). The bug hunts' implementations use it."""

    @staticmethod
    def forward(ctx, w, group):
        ctx.group = group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None
