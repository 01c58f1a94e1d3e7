"""Chapter 01: column- and row-parallel linear layers on real ranks, checked three ways.

Every rank builds the same dense ``nn.Linear`` and the same input (same seed), runs it
whole, then runs its own shard of the layer and checks, with
``torch.testing.assert_close`` at float32's default tolerances, that its output and every
gradient equal the matching piece of the dense result. Then it builds the same layers
with PyTorch's DTensor (``ColwiseParallel`` / ``RowwiseParallel``) and checks that they
agree with ours — outputs, gradients and the number of collectives. Rank 0 gathers every
rank's verdict and prints one table.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 4 -m intralayer.programs.tp_linear

One GPU node (NCCL)::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.tp_linear --tokens 64 --d-in 1024 --d-out 4096

A cluster: the same with ``--nnodes``, ``--rdzv-backend c10d --rdzv-endpoint $HEAD:29500``
(tensor parallelism belongs inside a node; chapter 02 says why).
"""
from __future__ import annotations

import argparse
import json
import copy

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
import torch.nn as nn

from intralayer import comm, distributed
from intralayer.programs.common import error_label
from intralayer.tensor_parallel import ColumnParallelLinear, ParallelMLP, RowParallelLinear, check_degrees


def compare(got: torch.Tensor, want: torch.Tensor) -> float:
    """Fail loudly unless equal to float32 tolerance; return the largest absolute difference."""
    torch.testing.assert_close(got, want)      # float32 defaults: rtol 1.3e-6, atol 1e-5
    return float((got - want).abs().max()) if got.numel() else 0.0


def collectives(acc: comm.Accounting, phase: str) -> str:
    recs = acc.select(phase=phase)
    if not recs:
        return "none"
    ops = sorted({r.op for r in recs})
    return ", ".join(f"{sum(r.op == op for r in recs)} {op} S={sum(r.bytes for r in recs if r.op == op)} B"
                     for op in ops)


def linear_cases(d: distributed.Dist, tokens: int, h_in: int, h_out: int) -> list[dict]:
    """The four ways to use a split linear layer, each checked against the dense layer."""
    t, r, dev = d.world_size, d.rank, d.device
    torch.manual_seed(0)
    dense = nn.Linear(h_in, h_out).to(dev)
    x = torch.randn(tokens, h_in, device=dev)                        # (m, h_in), the same on every rank
    dy = torch.randn(tokens, h_out, device=dev)                      # upstream gradient (m, h_out)
    xd = x.clone().requires_grad_()
    y = dense(xd)                                                    # (m, h_out)
    y.backward(dy)
    cases = [
        ("column, output split", dict(cls=ColumnParallelLinear, gather_output=False), x, y.chunk(t, -1)[r],
         dy.chunk(t, -1)[r], xd.grad),
        ("column, gather_output", dict(cls=ColumnParallelLinear, gather_output=True), x, y, dy, xd.grad),
        ("row, input split", dict(cls=RowParallelLinear, input_is_parallel=True), x.chunk(t, -1)[r], y, dy,
         xd.grad.chunk(t, -1)[r]),
        ("row, input whole", dict(cls=RowParallelLinear, input_is_parallel=False), x, y, dy, xd.grad),
    ]
    rows = []
    for name, kw, x_in, y_want, dy_in, dx_want in cases:
        cls = kw.pop("cls")
        layer = cls.from_dense(dense, d.group, **kw)
        x_in = x_in.detach().clone().requires_grad_()                # this rank's input: a leaf
        with comm.accounting() as acc:
            out = layer(x_in)
            out.backward(dy_in)
        errs = {"output": compare(out, y_want),
                "dW": compare(layer.weight.grad, layer.shard(dense.weight.grad, "weight")),
                "db": compare(layer.bias.grad, layer.shard(dense.bias.grad, "bias")),
                "dX": compare(x_in.grad, dx_want)}
        rows.append(dict(name=name, errs=errs, fwd=collectives(acc, "forward"), bwd=collectives(acc, "backward"),
                         measured={ph: (sum(r.bytes for r in acc.select(phase=ph)), acc.sent(phase=ph))
                                   for ph in ("forward", "backward")},
                         weights=layer.weight.numel() + layer.bias.numel(), shape=tuple(out.shape)))
    return rows


def dtensor_cases(d: distributed.Dist, tokens: int, h_in: int, h_out: int) -> list[dict]:
    """PyTorch's own tensor parallelism (DTensor) on the same weights: does it agree with ours?"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    t, r, dev = d.world_size, d.rank, d.device
    mesh = init_device_mesh(dev.type, (t,))
    torch.manual_seed(1)
    mlp = nn.Sequential()
    mlp.fc1, mlp.act, mlp.fc2 = nn.Linear(h_in, h_out), nn.GELU(), nn.Linear(h_out, h_in)
    mlp = mlp.to(dev)
    x = torch.randn(tokens, h_in, device=dev)
    dy = torch.randn(tokens, h_in, device=dev)
    specs = {"fc1 alone (Colwise)": ({"fc1": ColwiseParallel()}, "fc1"),
             "fc2 alone (Rowwise)": ({"fc2": RowwiseParallel()}, "fc2"),
             "MLP (Colwise, Rowwise)": ({"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}, "mlp")}
    rows = []
    for name, (plan, which) in specs.items():
        theirs = parallelize_module(copy.deepcopy(mlp), mesh, plan)
        if which == "fc1":
            ours, a, b = ColumnParallelLinear.from_dense(mlp.fc1, d.group), theirs.fc1, x
            upstream = dy.new_ones(tokens, h_out // t) * (r + 1)     # any gradient for our slice
        elif which == "fc2":
            ours, a, b = RowParallelLinear.from_dense(mlp.fc2, d.group), theirs.fc2, torch.randn(
                tokens, h_out // t, device=dev, generator=torch.Generator(dev).manual_seed(2 + r))
            upstream = dy
        else:
            ours, a, b = ParallelMLP.from_dense(mlp.fc1, mlp.fc2, d.group), theirs, x
            upstream = dy
        xo, xt = b.clone().requires_grad_(), b.clone().requires_grad_()
        with comm.accounting() as acc:
            out_ours = ours(xo)
            out_ours.backward(upstream)
        fwd_mode, bwd_mode = CommDebugMode(), CommDebugMode()
        with fwd_mode:
            out_theirs = a(xt)
        with bwd_mode:
            out_theirs.backward(upstream)
        kinds = {str(op).rsplit(".", 1)[-1] for mode in (fwd_mode, bwd_mode) for op in mode.get_comm_counts()}
        if kinds - {"all_reduce"}:                     # ours are all-reduces (f and g); DTensor's must be too
            raise AssertionError(f"{name}: DTensor issued {sorted(kinds)}, expected all-reduces only")
        errs = {"output": compare(out_ours, out_theirs),
                "input grad": compare(xo.grad, xt.grad)}
        grads = []
        for pname, p in ours.named_parameters():
            q = a.get_parameter(pname)
            grads.append(compare(p.grad, q.grad.to_local()))
        errs["weight grads"] = max(grads)
        rows.append(dict(name=name, errs=errs,
                         ours=(acc.count(phase="forward"), acc.count(phase="backward")),
                         theirs=(fwd_mode.get_total_counts(), bwd_mode.get_total_counts())))
    return rows


@record
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=6, help="rows of X (tokens)")
    p.add_argument("--d-in", dest="h_in", type=int, default=8, help="input features (divisible by the number of ranks)")
    p.add_argument("--d-out", dest="h_out", type=int, default=12, help="output features (divisible by the number of ranks)")
    p.add_argument("--out", help="write rank 0's measured bytes per case to this JSON file")
    args = p.parse_args(argv)
    with distributed.setup() as d:
        check_degrees(d.world_size, ffn=args.h_out, h=args.h_in)
        lin = linear_cases(d, args.tokens, args.h_in, args.h_out)
        dt = dtensor_cases(d, args.tokens, args.h_in, args.h_out)
        every = [None] * d.world_size
        dist.all_gather_object(every, (lin, dt))
        if d.is_main:
            report(d, args, every)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({row["name"]: row["measured"] for row in lin}, f, indent=1)


def report(d: distributed.Dist, args, every) -> None:
    t = d.world_size
    print(f"{t} ranks ({d.backend}, {d.device.type}); dense layer nn.Linear({args.h_in}, {args.h_out}), "
          f"X of shape ({args.tokens}, {args.h_in}), float32")
    print(f"\n{'layer':22} {'out shape':>10} {'weights':>7}  {'output':>6} {'dW':>6} {'db':>6} {'dX':>6}   "
          f"forward / backward collectives (rank 0)")
    for i, row in enumerate(every[0][0]):
        worst = {k: max(rank[0][i]["errs"][k] for rank in every) for k in row["errs"]}
        print(f"{row['name']:22} {str(row['shape']):>10} {row['weights']:7d}  "
              + " ".join(f"{error_label(worst[k]):>6}" for k in ("output", "dW", "db", "dX"))
              + f"   {row['fwd']} / {row['bwd']}")
    print(f"\nPyTorch DTensor vs intralayer, same weights and inputs (largest difference over {t} ranks):")
    print(f"{'plan':24} {'output':>7} {'dX':>7} {'dW, db':>7}   collectives fwd/bwd: DTensor | ours")
    for i, row in enumerate(every[0][1]):
        worst = {k: max(rank[1][i]["errs"][k] for rank in every) for k in row["errs"]}
        print(f"{row['name']:24} " + " ".join(f"{error_label(worst[k]):>7}" for k in
                                                ("output", "input grad", "weight grads"))
              + f"   {row['theirs'][0]}/{row['theirs'][1]} | {row['ours'][0]}/{row['ours'][1]}")
    print("\nall checks passed on every rank (torch.testing.assert_close, float32 tolerances)")


if __name__ == "__main__":
    main()
