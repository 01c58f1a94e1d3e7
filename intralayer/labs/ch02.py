"""Chapter 02's lab and bug hunt: Megatron's MLP on real ranks; greedy decoding over a padded vocabulary.

Lab (``solutions/labs/02_megatron_tp.ipynb``):

- ``shard_mlp(fc1, fc2, group)``: from the dense MLP's two ``nn.Linear`` layers (the same
  on every rank), this rank's parameters as new leaf tensors: ``w1`` (4h/t, h) and
  ``b1`` (4h/t,) — fc1 split by output features; ``w2`` (h, 4h/t) — fc2 split by input
  features; ``b2`` (h,) — fc2's bias, whole.
- ``megatron_mlp(x, p, group)``: the MLP on this rank's parameters ``p`` (as
  ``shard_mlp`` returns them; the check hands over correct ones), equal to the dense MLP
  in its output and in the gradients of x and of every parameter, with exactly one
  all-reduce forward and one backward, each of the (s, b, h) activation.

The library's :mod:`intralayer.tensor_parallel` holds these answers; the learner's code
may not use it (:mod:`intralayer.comm`'s *f* and *g* are allowed: lab 01 wrote them).

Bug hunt: greedy decoding with the LM head split by vocabulary. The vocabulary is padded
to a multiple of t with zero rows (as chapter 02 pads it; Megatron-LM pads to a multiple
of 128·t). The bug (mirage-project/mirage#751, there with a zero-padded LM head on one
GPU): the argmax runs over the padded rows too, whose logits are exactly 0, so whenever
every real logit of a position is negative a padded id wins. The second buggy
implementation masks the padding but places each rank's slice at rank·⌊v/t⌋, the
unpadded share: right when t divides v, wrong ids on the later ranks otherwise.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .parts import Implementation, Param, hunt, lab
from .common import calls_of, differ, group_info, traffic
from .runner import watch

#: float64: the longest reduction is the 4h = 24-term row of fc2 (and the s·b = 6 rows of a
#: weight gradient); 2γ_24·Σ|terms| with Σ|terms| ≲ 24 is ≈ 1.3e-13, so 1e-10 is a wide margin
#: that still sits orders of magnitude below any wrong answer (a missing bias is of order 0.1).
TOL = dict(rtol=1e-10, atol=1e-10)
S_, B_ = 3, 2                                           # (s, b); h is the case's, 6 or 9: t = 2, 3, 4 divide 4h
SEED = {"h": Param(6, (6, 9)), "seed": Param(0, minimum=0)}
WHY = ("intralayer.tensor_parallel is the library's own Megatron MLP, the answer to this lab; "
       "build it from the shards, GeLU and comm's f and g (or your own)")


def dense_mlp(seed: int = 0, h: int = 6) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """fc1 (h → 4h) and fc2 (4h → h) in float64, the same on every rank."""
    torch.manual_seed(seed)
    return torch.nn.Linear(h, 4 * h).double(), torch.nn.Linear(4 * h, h).double()


def shards(fc1, fc2, n: int, r: int) -> dict[str, torch.Tensor]:
    """Rank r's parameters (the reference): fc1 by output rows, fc2 by input columns, b2 whole."""
    f = fc1.out_features // n
    rows = slice(r * f, (r + 1) * f)
    return {"w1": fc1.weight[rows], "b1": fc1.bias[rows], "w2": fc2.weight[:, rows], "b2": fc2.bias}


def _summary_shard(facts: dict) -> str:
    return (f"{facts['n']} ranks: each holds {facts['held']} of the dense MLP's {facts['dense']} parameters "
            f"((8h² + 4h)/t + h of 8h² + 5h, h = {facts['h']})")


@lab("shard_mlp", ("shard_mlp",), params=SEED, forbid_modules=("intralayer.tensor_parallel",), why=WHY, summary=_summary_shard)
def check_shard(ns, case, group) -> dict:
    n, me = group_info(group)
    fc1, fc2 = dense_mlp(case["seed"], case["h"])
    with watch() as calls:
        p = ns.shard_mlp(fc1, fc2, group)
    problems = []
    if calls:
        problems.append(f"shard_mlp sent {traffic(calls)}; every rank already holds the dense layers: "
                        "sharding is slicing, no communication")
    if not isinstance(p, dict) or set(p) != {"w1", "b1", "w2", "b2"}:
        got = sorted(p) if isinstance(p, dict) else type(p).__name__
        return {"problems": problems + [f"shard_mlp returned {got}; it should return a dict with the keys "
                                        "'w1', 'b1', 'w2', 'b2'"], "facts": {}}
    want = {k: v.detach() for k, v in shards(fc1, fc2, n, me).items()}
    dense = {"w1": "fc1.weight", "b1": "fc1.bias", "w2": "fc2.weight", "b2": "fc2.bias"}
    for key, ref in want.items():
        got = p[key]
        wrong = differ(got, ref, key)
        if wrong:
            other = next((q for q in range(n) if q != me and isinstance(got, torch.Tensor)
                          and got.shape == ref.shape and torch.equal(got, shards(fc1, fc2, n, q)[key].detach())), None)
            f = fc1.out_features // n
            how = {"w1": f"rows {me * f} to {(me + 1) * f - 1} of fc1.weight (its output features)",
                   "b1": f"entries {me * f} to {(me + 1) * f - 1} of fc1.bias",
                   "w2": f"columns {me * f} to {(me + 1) * f - 1} of fc2.weight (its input features)",
                   "b2": "all of fc2.bias: it is added once, after the sum, so every rank keeps it whole"}[key]
            problems.append(wrong + (f"; it is group rank {other}'s slice" if other is not None else "")
                            + f"; {key} is {how}")
            continue
        if not got.requires_grad or not got.is_leaf:
            problems.append(f"{key} is {'not a leaf' if got.requires_grad else 'not requiring a gradient'}: make "
                            f"it a new leaf tensor (slice, .detach().clone(), .requires_grad_()) so that backward "
                            f"fills {key}.grad")
        elif got._base is not None or any(got.untyped_storage().data_ptr() == w.untyped_storage().data_ptr()
                                          for w in (fc1.weight, fc1.bias, fc2.weight, fc2.bias)):
            problems.append(f"{key} shares memory with the dense {dense[key]}: a rank should keep only its own "
                            "slice (clone it), or tensor parallelism saves no memory")
    held = sum(int(v.numel()) for v in p.values() if isinstance(v, torch.Tensor))
    dense_count = sum(int(t.numel()) for t in (fc1.weight, fc1.bias, fc2.weight, fc2.bias))
    return {"problems": problems, "facts": {"n": n, "held": held, "dense": dense_count, "h": case["h"]}}


def _summary_mlp(facts: dict) -> str:
    return (f"{facts['n']} ranks: output and all gradients equal the dense MLP's; one all-reduce forward and one "
            f"backward, each of S = s·b·h = {facts['elements']} elements ({facts['S']} bytes)")


@lab("megatron_mlp", ("megatron_mlp",), params=SEED, forbid_modules=("intralayer.tensor_parallel",), why=WHY,
     summary=_summary_mlp)
def check_mlp(ns, case, group) -> dict:
    n, me = group_info(group)
    fc1, fc2 = dense_mlp(case["seed"], case["h"])
    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(S_, B_, case["h"], generator=g, dtype=torch.float64)             # (s, b, h), the same on every rank
    upstream = torch.randn(S_, B_, case["h"], generator=g, dtype=torch.float64)       # every rank: the same loss
    xd = x0.clone().requires_grad_()
    yd = fc2(F.gelu(fc1(xd)))                                                   # the dense MLP
    (yd * upstream).sum().backward()
    want = {"w1": fc1.weight.grad, "b1": fc1.bias.grad, "w2": fc2.weight.grad, "b2": fc2.bias.grad}
    mine = shards(fc1, fc2, n, me)
    p = {k: v.detach().clone().requires_grad_() for k, v in mine.items()}
    x = x0.clone().requires_grad_()
    with watch() as forward:
        y = ns.megatron_mlp(x, p, group)
    problems = []
    elements = x0.numel()
    wrong = differ(y, yd.detach(), "the output", **TOL)
    if wrong:
        if isinstance(y, torch.Tensor) and y.shape == yd.shape:
            off = y.detach() - yd.detach()
            if torch.allclose(off, (n - 1) * fc2.bias.detach().expand_as(off), **TOL):
                wrong += f"; it holds {n} times fc2's bias: add the bias once, after the all-reduce"
            elif torch.allclose(off, -fc2.bias.detach().expand_as(off), **TOL):
                wrong += "; fc2's bias is missing"
            else:
                with torch.no_grad():
                    tanh = fc2(F.gelu(fc1(x0), approximate="tanh"))
                if torch.allclose(y.detach(), tanh, **TOL):
                    wrong += ("; it is the MLP with the tanh approximation of GeLU (approximate='tanh'): this "
                              "MLP's GeLU is the exact one, F.gelu(x) with its default approximate='none', as in "
                              "the dense reference")
        problems.append(wrong)
    problems += _collectives(forward, elements, "the forward pass", "g's all-reduce of the partial outputs")
    if isinstance(y, torch.Tensor) and y.requires_grad and y.shape == yd.shape:
        with watch() as backward:
            (y * upstream).sum().backward()
        wrong = differ(x.grad, xd.grad, "x.grad", **TOL)
        if wrong:
            problems.append(wrong + "; the input's gradient is the sum over ranks of each rank's part: f's "
                                    "all-reduce in the backward pass gives it")
        names = {"w1": "fc1's weight (your w1)", "b1": "fc1's bias (b1)", "w2": "fc2's weight (w2)",
                 "b2": "fc2's bias (b2)"}
        for key in ("w1", "b1", "w2", "b2"):
            ref = shards_of_grad(want, key, n, me)
            wrong = differ(p[key].grad, ref, f"the gradient of {names[key]}", **TOL)
            if wrong:
                if p[key].grad is not None and torch.allclose(p[key].grad, n * ref, **TOL):
                    wrong += f"; it is {n} times too large"
                elif p[key].grad is not None and torch.allclose(p[key].grad, ref / n, **TOL):
                    wrong += f"; it is {n} times too small"
                problems.append(wrong)
        problems += _collectives(backward, elements, "the backward pass", "f's all-reduce of the input's gradient")
    return {"problems": problems, "facts": {"n": n, "elements": elements, "S": elements * x0.element_size()}}


def shards_of_grad(grads: dict, key: str, n: int, r: int) -> torch.Tensor:
    f = grads["w1"].shape[0] // n
    rows = slice(r * f, (r + 1) * f)
    return {"w1": grads["w1"][rows], "b1": grads["b1"][rows], "w2": grads["w2"][:, rows], "b2": grads["b2"]}[key]


def _collectives(calls, elements: int, what: str, which: str) -> list[str]:
    ars = calls_of(calls, "all_reduce")
    others = [c for c in calls if c.op != "all_reduce"]
    problems = []
    if others:
        problems.append(f"{what} also sent {traffic(others)}: Megatron's MLP moves nothing but one all-reduce each "
                        "way (the 4h-wide activation never travels)")
    if len(ars) != 1:
        problems.append(f"{what} sent {traffic(ars) if ars else 'no all-reduce'}; it needs exactly one, {which}")
    elif ars[0].elements != elements or ars[0].reduce != "SUM":
        problems.append(f"{what}'s all-reduce was a {ars[0].reduce} of {ars[0].elements} elements; it should sum "
                        f"the (s, b, h) = {elements} elements")
    return problems


# ---------------------------------------------------------------------------- bug hunt: padded vocabulary

def _largest_across(best: torch.Tensor, ids: torch.Tensor, group) -> torch.Tensor:
    """Across the ranks, the id of the largest logit (the smallest id on a tie): (m,) int64."""
    n = dist.get_world_size(group)
    mine = torch.stack([best.to(torch.float64), ids.to(torch.float64)], dim=1)      # (m, 2): value, id
    every = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(every, mine, group=group)
    both = torch.stack(every)                                                        # (t, m, 2)
    top = both[..., 0].max(dim=0).values                                             # (m,)
    ids_of_top = torch.where(both[..., 0] == top, both[..., 1], torch.inf)
    return ids_of_top.min(dim=0).values.to(torch.int64)


def greedy_token(hidden, weight, vocab, group):
    """Greedy token ids with the LM head split by vocabulary, the padding rows masked."""
    start = dist.get_rank(group) * weight.shape[0]          # this rank's first row of the padded vocabulary
    logits = hidden @ weight.T                              # (m, v_p/t)
    ids = start + torch.arange(weight.shape[0])
    logits = logits.masked_fill(ids >= vocab, -torch.inf)   # padding rows never win
    best, local = logits.max(dim=-1)                        # (m,): this rank's largest logit, and where
    return _largest_across(best, local + start, group)


def greedy_token_unmasked(hidden, weight, vocab, group):
    """Greedy token ids with the LM head split by vocabulary, the zero padding rows left in."""
    start = dist.get_rank(group) * weight.shape[0]          # this rank's first row of the padded vocabulary
    logits = hidden @ weight.T                              # (m, v_p/t), padding rows included
    best, local = logits.max(dim=-1)                        # (m,): this rank's largest logit, and where
    return _largest_across(best, local + start, group)


def greedy_token_floor_offset(hidden, weight, vocab, group):
    """Greedy token ids with the LM head split by vocabulary, each slice placed at rank·⌊v/t⌋."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    start = r * (vocab // t)                                # the unpadded share: wrong unless t divides v
    logits = hidden @ weight.T                              # (m, v_p/t)
    ids = start + torch.arange(weight.shape[0])
    logits = logits.masked_fill(ids >= vocab, -torch.inf)
    best, local = logits.max(dim=-1)
    return _largest_across(best, local + start, group)


hunt("padded_vocab_argmax", "test_greedy_token", {
    "unmasked": Implementation(greedy_token_unmasked, True, "mirage-project/mirage#751"),
    "correct": Implementation(greedy_token, False),
    "floor_offset": Implementation(greedy_token_floor_offset, True),
}, hint="the bug needs padding rows (a vocabulary that t does not divide) and a position whose real logits are "
        "all negative; compare every id with the argmax of the unsplit, unpadded logits — a test that only asks "
        "for ids below the vocabulary size misses a slice placed at the wrong offset, whose ids are real but "
        "wrong")
