"""Chapter 08's lab and bug hunt: tensor and data parallelism on one device mesh; an honest MFU.

Lab (``solutions/labs/08_planner.ipynb``), a mesh of t × d ranks (t tensor-parallel, d
data-parallel; the 2 × 2 mesh on 4 ranks, and the degenerate meshes 1 × 2, 2 × 1, 1 × 3,
3 × 1, 1 × 4, 4 × 1):

- ``mesh_ranks(ranks, tp)``: from the group's ranks (process numbers, in group order) and
  t, the tensor-parallel groups and the data-parallel groups, as lists of rank lists, in
  Megatron-LM's order: a TP group is t consecutive ranks (``ranks[i·t:(i+1)·t]``, the GPUs
  of one NVLink domain, since TP communicates in every layer), a DP group takes every t-th
  rank (``ranks[j::t]``). Arithmetic only: no communication.
- ``tp_dp_step(fc1, fc2, x, y, tp_group, dp_group)``: one training step's forward and
  backward of the h → 4h → h MLP on this rank's data shard (rows ``dp_rank·m`` to
  ``(dp_rank+1)·m − 1`` of the global batch ``x``) with this rank's tensor-parallel shard of
  the MLP (fc1 by output features, fc2 by input features, fc2's bias whole), the MSE loss
  against ``y``, and the gradients averaged over the data-parallel group; returns the
  output rows and the shard's parameters, their ``.grad`` equal to the dense MLP's
  gradients of the mean loss over the whole batch. The check builds the two groups itself
  (see :func:`mesh_groups`) and counts the collectives of each: one all-reduce of the
  (m, h) partial output in the TP group (g), and all-reduces of the gradients in the DP
  group, as many elements as the shard holds.

Why the check builds the groups: ``dist.new_group`` must be called by every process of the
job in the same order (the name of a group is a counter), and a check's processes run
different cases at once (the pairs 0–1 and 2–3) or sit one out (process 0 in a 3-rank
case). :func:`mesh_groups` calls it on all four processes for every group of every pair
when the case covers all four, and with ``use_local_synchronization=True`` (only the
members call) in the 3-rank case; the learner's part is the placement.

Bug hunt: ``mfu(model, seq_len, tokens_per_second, peak_flops)`` for a
:class:`intralayer.planner.Model`. The bug counts the input embedding as a matrix product
(6 FLOPs per parameter of the ``V × h`` table; a token only looks its row up): torchtitan's
first MFU counted every parameter (pytorch/torchtitan#151 as torchtrain) until
pytorch/torchtitan#280 excluded the embedding. The second buggy implementation counts
every expert of an MoE layer instead of the k a token is routed to, as torchtitan's
transformers backend did (pytorch/torchtitan#4300, 192.9e9 FLOPs per token against 37.6e9
for Qwen3-30B-A3B) and MaxText before AI-Hypercomputer/maxtext#678.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import planner
from .check import GROUP_TIMEOUT_S
from .parts import Implementation, Param, hunt, lab
from .common import calls_of, differ, earlier_part, group_info, traffic
from .runner import layout, watch

#: float64: the longest reduction is fc2's 4h = 24-term row, or a weight gradient's sum over
#: the B ≤ 8 rows; 2γ_24·Σ|terms| with Σ|terms| ≲ 24 is ≈ 1.3e-13: 1e-10 is a wide margin, far
#: below a wrong answer (a gradient d times too large, a missing bias, another shard).
TOL = dict(rtol=1e-10, atol=1e-10)
H_, FFN_, M_ = 6, 24, 2                                 # hidden, MLP width (t = 1…4 divide it), rows per DP rank
PARAMS = {"tp": Param(2, (1, 2, 3, 4)), "seed": Param(0, minimum=0)}
WHY = ("intralayer.tensor_parallel is the library's own tensor-parallel MLP: build the shard and the step from "
       "slices, GeLU and comm's f and g (or your own)")


def reference_ranks(ranks: list[int], tp: int) -> tuple[list[list[int]], list[list[int]]]:
    """Megatron-LM's placement: TP groups of t consecutive ranks, DP groups every t-th rank."""
    if tp < 1 or len(ranks) % tp:
        raise ValueError(f"tp={tp} does not divide the group of {len(ranks)} ranks")
    d = len(ranks) // tp
    return [list(ranks[i * tp:(i + 1) * tp]) for i in range(d)], [list(ranks[j::tp]) for j in range(tp)]


def mesh_groups(case_ranks: list[int], tp: int):
    """This process's (TP group, DP group) of the mesh over ``case_ranks``, created safely.

    Where the case's groups cover every process (2- and 4-rank cases), every process
    creates every group of every concurrent case in the same order, as ``dist.new_group``
    requires; where they do not (the 3-rank case), the members alone create theirs with
    ``use_local_synchronization=True`` (its hashed names stay equal on the members, whose
    histories of groups are the same).
    """
    me = dist.get_rank()
    timeout = timedelta(seconds=GROUP_TIMEOUT_S)
    world = dist.get_world_size()
    cases = layout(len(case_ranks), world)
    everyone = sorted(r for ranks in cases for r in ranks) == list(range(world))
    mine = {}
    for ranks in (cases if everyone else [case_ranks]):
        tps, dps = reference_ranks(ranks, tp)
        for dim, lists in (("tp", tps), ("dp", dps)):
            for members in lists:
                if not everyone and me not in members:
                    continue
                g = dist.new_group(members, timeout=timeout, use_local_synchronization=not everyone)
                if me in members:
                    mine[dim] = g
    return mine["tp"], mine["dp"]


# ---------------------------------------------------------------------------- part 1: placement

def _summary_place(facts: dict) -> str:
    return f"{facts['n']} ranks, t = {facts['tp']}: TP groups {facts['tps']}, DP groups {facts['dps']}"


def _as_lists(value, what: str) -> tuple[list[list[int]] | None, str | None]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(g, (list, tuple)) for g in value):
        return None, f"the {what} are a {type(value).__name__}; return a list of lists of ranks"
    try:
        return [[int(r) for r in g] for g in value], None
    except (TypeError, ValueError):
        return None, f"the {what} hold something that is not a rank number"


@lab("mesh_ranks", ("mesh_ranks",), params=PARAMS, summary=_summary_place)
def check_place(ns, case, group) -> dict:
    n, me = group_info(group)
    ranks = dist.get_process_group_ranks(group)
    tp = case["tp"]
    want_tp, want_dp = reference_ranks(ranks, tp)
    with watch() as calls:
        result = ns.mesh_ranks(list(ranks), tp)
    problems = []
    if calls:
        problems.append(f"mesh_ranks sent {traffic(calls)}: placing the groups is arithmetic on the ranks, every "
                        "process computes the same lists")
    if not (isinstance(result, tuple) and len(result) == 2):
        return {"problems": problems + [f"mesh_ranks returned {type(result).__name__}; it should return the pair "
                                        "(tp_groups, dp_groups)"], "facts": {}}
    d = n // tp
    for value, want, what, size, count in ((result[0], want_tp, "TP groups", tp, d),
                                           (result[1], want_dp, "DP groups", d, tp)):
        got, wrong = _as_lists(value, what)
        if wrong:
            problems.append(wrong)
            continue
        strangers = sorted({r for g in got for r in g} - set(ranks))
        if strangers:
            problems.append(f"the {what} hold rank{'s' if len(strangers) > 1 else ''} {strangers}, which "
                            f"{'are' if len(strangers) > 1 else 'is'} not in this group {list(ranks)}: place the "
                            "ranks you are given (process numbers), not 0 … n−1")
            continue
        if len(got) != count or any(len(g) != size for g in got):
            problems.append(f"the {what} are {got}: with {n} ranks and t = {tp} there "
                            f"{'is 1 ' + what[:-1] if count == 1 else f'are {count} ' + what}, of {size} "
                            f"rank{'s' if size > 1 else ''} each")
            continue
        if sorted(r for g in got for r in g) != sorted(ranks):
            problems.append(f"the {what} {got} do not hold every rank exactly once")
            continue
        if got != want:
            if what == "TP groups" and tp > 1 and d > 1 and sorted(map(sorted, got)) == sorted(map(sorted, want_dp)):
                problems.append(f"the TP groups {got} are strided (ranks {d} apart): tensor parallelism "
                                f"communicates in every layer, so its groups are t consecutive ranks (one server's "
                                f"fast links), {want}; the DP groups are the strided ones")
            elif sorted(map(sorted, got)) == sorted(map(sorted, want)):
                problems.append(f"the {what} {got} hold the right ranks in another order; list them as Megatron-LM "
                                f"does: {want}")
            else:
                problems.append(f"the {what} are {got}; they should be {want}")
    return {"problems": problems, "facts": {"n": n, "tp": tp, "tps": want_tp, "dps": want_dp}}


# ---------------------------------------------------------------------------- part 2: one step

def dense_mlp(seed: int) -> tuple[torch.nn.Linear, torch.nn.Linear]:
    """fc1 (h → 4h) and fc2 (4h → h) in float64, the same on every rank."""
    torch.manual_seed(seed)
    return torch.nn.Linear(H_, FFN_).double(), torch.nn.Linear(FFN_, H_).double()


def shard_of(tensors: dict, tp: int, i: int) -> dict:
    """TP rank i's shard of the MLP's tensors (parameters or gradients)."""
    f = FFN_ // tp
    rows = slice(i * f, (i + 1) * f)
    return {"w1": tensors["w1"][rows], "b1": tensors["b1"][rows], "w2": tensors["w2"][:, rows], "b2": tensors["b2"]}


def _summary_step(facts: dict) -> str:
    return (f"{facts['n']} ranks as t × d = {facts['tp']} × {facts['dp']}: output and gradients equal the dense "
            f"MLP's; TP group: {facts['tp_traffic']}; DP group: {facts['dp_traffic']}")


@lab("tp_dp_step", ("tp_dp_step",), params=PARAMS, forbid_modules=("intralayer.tensor_parallel",), why=WHY,
     summary=_summary_step)
def check_step(ns, case, group) -> dict:
    earlier = earlier_part(ns, "mesh_ranks", 1, check_place, case, group)
    n, _ = group_info(group)
    tp = case["tp"]
    dp = n // tp
    tp_group, dp_group = mesh_groups(dist.get_process_group_ranks(group), tp)
    ti, di = dist.get_rank(tp_group), dist.get_rank(dp_group)
    fc1, fc2 = dense_mlp(case["seed"])
    g = torch.Generator().manual_seed(900 + case["seed"])
    x = torch.randn(dp * M_, H_, generator=g, dtype=torch.float64)                 # (B, h): the global batch
    y = torch.randn(dp * M_, H_, generator=g, dtype=torch.float64)
    out_d = fc2(F.gelu(fc1(x)))                                                      # the dense MLP
    F.mse_loss(out_d, y).backward()                                                  # mean over the whole batch
    dense = {"w1": fc1.weight, "b1": fc1.bias, "w2": fc2.weight, "b2": fc2.bias}
    want = shard_of({k: v.detach() for k, v in dense.items()}, tp, ti)
    want_grad = shard_of({k: v.grad for k, v in dense.items()}, tp, ti)
    for p in (fc1.weight, fc1.bias, fc2.weight, fc2.bias):
        p.grad = None                                                                # hand over clean layers
    with watch() as calls:
        result = ns.tp_dp_step(fc1, fc2, x.clone(), y.clone(), tp_group, dp_group)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
        return {"problems": ["tp_dp_step returned something else than the pair (out, p): this rank's output rows "
                             "and the dict of its parameters 'w1', 'b1', 'w2', 'b2'"], "facts": {}}
    out, p = result
    problems = []
    rows = slice(di * M_, (di + 1) * M_)
    wrong = differ(out, out_d.detach()[rows], "the output", **TOL)
    if wrong:
        other = next((q for q in range(dp) if q != di and isinstance(out, torch.Tensor) and out.shape == (M_, H_)
                      and torch.allclose(out, out_d.detach()[q * M_:(q + 1) * M_], **TOL)), None)
        if other is not None:
            wrong += (f"; it is the output of DP rank {other}'s rows: this rank's data are rows {di * M_} to "
                      f"{(di + 1) * M_ - 1} (its rank in the DP group times m)")
        elif isinstance(out, torch.Tensor) and out.shape == (M_, H_) and tp > 1 and torch.allclose(
                out - out_d.detach()[rows], (tp - 1) * fc2.bias.detach().expand(M_, H_), **TOL):
            wrong += f"; it holds {tp} times fc2's bias: add the bias once, after g"
        elif isinstance(out, torch.Tensor) and out.shape == (M_, H_):
            with torch.no_grad():
                tanh = fc2(F.gelu(fc1(x[rows]), approximate="tanh"))
            if torch.allclose(out.detach(), tanh, **TOL):
                wrong += ("; it is the MLP with the tanh approximation of GeLU (approximate='tanh'): this MLP's GeLU "
                          "is the exact one, F.gelu(x) with its default approximate='none', as in the dense reference")
        problems.append(wrong)
    if set(p) != {"w1", "b1", "w2", "b2"}:
        problems.append(f"p has the keys {sorted(p)}; it should hold 'w1', 'b1', 'w2', 'b2'")
        return {"problems": earlier or problems, "facts": {}}
    names = {"w1": "fc1's weight (w1)", "b1": "fc1's bias (b1)", "w2": "fc2's weight (w2)", "b2": "fc2's bias (b2)"}
    for key in ("w1", "b1", "w2", "b2"):
        wrong = differ(p[key], want[key], names[key])
        if wrong:
            problems.append(wrong + f"; this rank keeps TP rank {ti}'s shard (its rank in the TP group)")
            continue
        grad = p[key].grad
        wrong = differ(grad, want_grad[key], f"the gradient of {names[key]}", **TOL)
        if wrong and isinstance(grad, torch.Tensor) and grad.shape == want_grad[key].shape:
            for factor, words in ((dp, f"{dp} times too large: average over the DP group (divide the sum by d)"),
                                  (tp, f"{tp} times too large: the TP ranks hold different shards; only the DP "
                                       "group's replicas are reduced"),
                                  (1 / dp, f"{dp} times too small")):
                if factor != 1 and torch.allclose(grad, factor * want_grad[key], **TOL):
                    wrong += f"; it is {words}"
                    break
            else:
                local = _local_grad(fc1, fc2, x[rows], y[rows], tp, ti, key)
                if torch.allclose(grad, local, **TOL):
                    wrong += ("; it is this rank's own batch's gradient: all-reduce the gradients over the DP group "
                              "and divide by d")
        if wrong:
            problems.append(wrong)
    held = sum(int(want[k].numel()) for k in want)
    problems += _traffic(calls, tp_group, dp_group, group, tp, dp, M_ * H_, held)
    itemsize = x.element_size()
    tp_calls = [c for c in calls if c.group == tuple(dist.get_process_group_ranks(tp_group))]
    dp_calls = [c for c in calls if c.group == tuple(dist.get_process_group_ranks(dp_group))]
    return {"problems": earlier or problems,
            "facts": {"n": n, "tp": tp, "dp": dp,
                      "tp_traffic": _bytes(tp_calls, itemsize), "dp_traffic": _bytes(dp_calls, itemsize)}}


def _bytes(calls, itemsize: int) -> str:
    if not calls:
        return "nothing"
    return f"{traffic(calls)}, {sum(c.elements for c in calls) * itemsize} bytes"


def _local_grad(fc1, fc2, x, y, tp, ti, key) -> torch.Tensor:
    """The gradient of this DP rank's own mean loss, not averaged over the DP group."""
    a, b = torch.nn.Linear(H_, FFN_).double(), torch.nn.Linear(FFN_, H_).double()
    a.load_state_dict(fc1.state_dict())
    b.load_state_dict(fc2.state_dict())
    F.mse_loss(b(F.gelu(a(x))), y).backward()
    return shard_of({"w1": a.weight.grad, "b1": a.bias.grad, "w2": b.weight.grad, "b2": b.bias.grad}, tp, ti)[key]


def _traffic(calls, tp_group, dp_group, group, tp, dp, activation: int, held: int) -> list[str]:
    """One all-reduce of the (m, h) partial output in the TP group; the gradients' all-reduces in the DP group."""
    problems = []
    tp_ranks = tuple(dist.get_process_group_ranks(tp_group))
    dp_ranks = tuple(dist.get_process_group_ranks(dp_group))
    whole = tuple(dist.get_process_group_ranks(group))
    elsewhere = [c for c in calls if c.group not in (tp_ranks, dp_ranks)]
    if elsewhere:
        where = "the whole group" if elsewhere[0].group == whole else f"the group {list(elsewhere[0].group)}"
        problems.append(f"it sent {traffic(elsewhere)} in {where}: tensor parallelism communicates in the TP group "
                        f"{list(tp_ranks)}, data parallelism in the DP group {list(dp_ranks)}, nothing else")
    tp_calls = [c for c in calls if c.group == tp_ranks and tp_ranks != dp_ranks]
    dp_calls = [c for c in calls if c.group == dp_ranks]
    if tp > 1:
        ars = calls_of(tp_calls, "all_reduce")
        if len(ars) != 1 or len(tp_calls) != 1 or ars[0].elements != activation:
            problems.append(f"the TP group carried {traffic(tp_calls)}; the MLP needs one all-reduce of the (m, h) "
                            f"partial output, {activation} elements (g); the input x needs no gradient, so f sends "
                            "nothing backward")
    if dp > 1:
        others = [c for c in dp_calls if c.op != "all_reduce"]
        total = sum(c.elements for c in calls_of(dp_calls, "all_reduce"))
        if others or total != held:
            ddp = ("; torch's DistributedDataParallel broadcasts the parameters when it is built, which this step "
                   "does not need (every rank already holds its shard): pass init_sync=False"
                   if any(c.op == "broadcast" for c in others) else "")
            problems.append(f"the DP group carried {traffic(dp_calls)}; data parallelism all-reduces every gradient "
                            f"of the shard once, {held} elements in all{ddp}")
    return problems


# ---------------------------------------------------------------------------- bug hunt: MFU

def mfu(model, seq_len, tokens_per_second, peak_flops):
    """Model FLOPs utilization, as chapter 08's planner counts model FLOPs."""
    flops = planner.flops_per_token(model, seq_len)["model"]             # per token, forward and backward
    return flops * tokens_per_second / peak_flops


def mfu_counting_embedding(model, seq_len, tokens_per_second, peak_flops):
    """Model FLOPs utilization with 6 FLOPs per parameter of every weight matrix, the embedding's included."""
    lp, moe_layers = planner.layer_params(model), model.moe_layers
    expert, shared, router = (lp.get(part, 0) for part in ("expert", "shared", "router"))   # 0: a dense model
    routed = lp["attention"] + model.top_k * expert + shared + router              # an MoE layer's active ones
    weights = (model.layers - moe_layers) * (lp["attention"] + lp["mlp"]) + moe_layers * routed
    weights += 2 * model.vocab * model.hidden                                       # embedding and LM head
    d_qk, d_v = model.head_dims
    scores = model.layers * seq_len * model.heads * (d_qk + d_v)                    # q·k and p·v, per token
    return 6 * (weights + scores) * tokens_per_second / peak_flops


def mfu_counting_all_experts(model, seq_len, tokens_per_second, peak_flops):
    """Model FLOPs utilization with every expert of an MoE layer counted."""
    lp, moe_layers = planner.layer_params(model), model.moe_layers
    expert, shared, router = (lp.get(part, 0) for part in ("expert", "shared", "router"))   # 0: a dense model
    routed = lp["attention"] + model.experts * expert + shared + router            # every expert
    weights = (model.layers - moe_layers) * (lp["attention"] + lp["mlp"]) + moe_layers * routed
    weights += model.vocab * model.hidden                                           # LM head
    d_qk, d_v = model.head_dims
    scores = model.layers * seq_len * model.heads * (d_qk + d_v)                    # q·k and p·v, per token
    return 6 * (weights + scores) * tokens_per_second / peak_flops


hunt("mfu_counts", "test_mfu", {
    "embedding": Implementation(mfu_counting_embedding, True, "pytorch/torchtitan#274, fixed in #280"),
    "correct": Implementation(mfu, False),
    "all_experts": Implementation(mfu_counting_all_experts, True,
                                  "pytorch/torchtitan#4300 and AI-Hypercomputer/maxtext#678"),
}, hint="compare with chapter 08's count of model FLOPs (planner.flops_per_token(model, seq_len)['model']) on a "
        "dense model whose vocabulary is large against its layers, and on an MoE model with top_k smaller than "
        "the number of experts")
