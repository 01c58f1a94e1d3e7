"""Chapter 04: context parallelism composed with tensor parallelism, one attention layer, checked against the dense one.

t·P ranks form one grid, ``(cp, tp)``: rank = t·cp_index + tp_index, built with
``torch.distributed.device_mesh.init_device_mesh``. Tensor parallelism runs along each row
(consecutive ranks, the GPUs of one node), context parallelism down each column.

The layer is causal self-attention with grouped-query attention: ``x`` (s, b, h) →
``q = x W_qᵀ`` (a heads of d), ``k = x W_kᵀ`` and ``v = x W_vᵀ`` (a_kv heads) → attention →
``o W_oᵀ``.

- Tensor parallelism splits the heads (Megatron-LM): tp rank j holds query heads
  j·a/t … and key/value heads j·a_kv/t …, the rows of W_q, W_k, W_v that make them
  (column-parallel) and the columns of W_o that read them (row-parallel); *f* before,
  *g* after (``comm.copy_to_group``, ``comm.reduce_from_group``).
- Context parallelism splits the sequence (zigzag) within each column: the ring moves
  only this rank's a_kv/t key/value heads (``context_parallel.ring_attention``); or
  Ulysses trades the P sequence shards for a head split of the a/t and a_kv/t heads,
  so P must divide both (``context_parallel.check_ulysses``).
- The weight gradients: each rank's shard has seen only its own tokens, so it is summed
  down its column, over the data- × context-parallel group (data parallelism is 1 here),
  never along the row: the tp ranks hold different shards.

Every rank checks its output shard, the gradient of its input shard and of its four
weight shards against the dense layer run on the whole sequence in one process, and
that its ring sent exactly ``context_parallel.cp_costs`` with the a/t and a_kv/t heads:
(P−1)·2·b·(s/P)·(a_kv/t)·d numbers forward. Rank 0 prints the table.

Laptop (gloo, CPU), the 2 × 2 grid::

    torchrun --standalone --nproc-per-node 4 -m intralayer.programs.cp_tp

One GPU node (NCCL), TP 4 × CP 2 (the grid is t × world/t)::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.cp_tp --tp 4 --seq-len 1024 --heads 16 --kv-heads 8
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.device_mesh import init_device_mesh

from intralayer import comm, distributed, rules
from intralayer import context_parallel as cp
from intralayer.model import attend_heads, check_kv_heads
from intralayer.programs.common import error_label

METHODS = ("ring", "Ulysses")
SHAPE = dict(s=16, b=2, h=16, heads=8, kv_heads=4, dh=4)    # the demo's layer: GQA, 2 query heads per kv head
LAYOUT = "zigzag"           # the ring's layout; Ulysses takes contiguous shards


def check_grid(heads: int, kv_heads: int, t: int, P: int, method: str, s: int) -> None:
    """``ValueError`` unless the grid can split this layer: t divides the heads and the key/value
    heads; Ulysses needs P to divide each rank's a/t and a_kv/t; the ring, s divisible by 2P."""
    kv_heads = check_kv_heads(heads, kv_heads)
    for n, what in ((heads, "heads"), (kv_heads, "key/value heads")):
        if n % t:
            raise ValueError(f"tensor parallelism gives each rank whole heads: {n} {what} are not divisible "
                             f"by the tensor-parallel degree t={t}")
    if method == "Ulysses":
        cp.check_ulysses(heads // t, P, s, kv_heads=kv_heads // t)
    elif method == "ring":
        cp.check_sequence(s, P, LAYOUT)
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")


def weights(h: int, heads: int, kv_heads: int, dh: int, seed: int):
    """W_q (a·d, h), W_k, W_v (a_kv·d, h), W_o (h, a·d): the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((heads * dh, h), (kv_heads * dh, h), (kv_heads * dh, h), (h, heads * dh))
    return [torch.randn(*shape, generator=g) / h ** 0.5 for shape in shapes]


def dense(x, ws, heads, kv_heads):
    """The dense layer on the whole sequence: (s, b, h) → (s, b, h)."""
    wq, wk, wv, wo = ws
    o = attend_heads(x @ wq.T, x @ wk.T, x @ wv.T, heads, kv_heads, causal=True)    # (s, b, a·d)
    return o @ wo.T


def shards(ws, heads, kv_heads, dh, t, j):
    """Tensor-parallel rank j's rows of W_q, W_k, W_v (its heads) and columns of W_o."""
    wq, wk, wv, wo = ws
    q_rows, kv_rows = heads // t * dh, kv_heads // t * dh
    return [wq.narrow(0, j * q_rows, q_rows), wk.narrow(0, j * kv_rows, kv_rows),
            wv.narrow(0, j * kv_rows, kv_rows), wo.narrow(1, j * q_rows, q_rows)]


def parallel(x_local, ws_local, heads_local, kv_local, dh, tp, cpg, method):
    """This rank's part of the layer: (s/P, b, h) → (s/P, b, h)."""
    wq, wk, wv, wo = ws_local
    sl, b = x_local.shape[:2]
    x_in = comm.copy_to_group(x_local, tp, "f")                                      # (s/P, b, h)

    def by_head(y, n):
        return y.reshape(sl, b, n, dh).permute(1, 2, 0, 3)                           # (b, n, s/P, d)

    q, k, v = by_head(x_in @ wq.T, heads_local), by_head(x_in @ wk.T, kv_local), by_head(x_in @ wv.T, kv_local)
    if method == "ring":
        o = cp.ring_attention(q, k, v, cpg, causal=True, layout=LAYOUT)              # (b, a/t, s/P, d)
    else:
        o = cp.ulysses_attention(q, k, v, cpg, causal=True)
    o = o.permute(2, 0, 1, 3).reshape(sl, b, heads_local * dh)                       # (s/P, b, a/t·d)
    return comm.reduce_from_group(o @ wo.T, tp, "g")                                 # (s/P, b, h)


def check_layer(device, t: int, P: int, method: str, s: int = SHAPE["s"], b: int = SHAPE["b"], h: int = SHAPE["h"],
                heads: int = SHAPE["heads"], kv_heads: int = SHAPE["kv_heads"], dh: int = SHAPE["dh"],
                seed: int = 0) -> dict:
    """The layer on a P × t grid against the dense layer; raises on any mismatch.

    Returns this rank's grid position, largest differences, and its ring's (or Ulysses')
    bytes sent forward and backward with the formula's.
    """
    check_grid(heads, kv_heads, t, P, method, s)
    rules.check_mesh(dist.get_world_size(), exact=True, cp=P, tp=t)
    mesh = init_device_mesh(device.type, (P, t), mesh_dim_names=("cp", "tp"))
    tp, cpg = mesh.get_group("tp"), mesh.get_group("cp")
    ci, ti = mesh.get_local_rank("cp"), mesh.get_local_rank("tp")
    layout = LAYOUT if method == "ring" else "contiguous"

    ws = [w.to(device).requires_grad_() for w in weights(h, heads, kv_heads, dh, seed)]
    g = torch.Generator().manual_seed(seed + 1)
    x, dy = (torch.randn(s, b, h, generator=g).to(device) for _ in range(2))
    x.requires_grad_()
    y = dense(x, ws, heads, kv_heads)
    y.backward(dy)

    mine = [w.detach().clone().requires_grad_() for w in shards(ws, heads, kv_heads, dh, t, ti)]
    x_local = cp.shard_sequence(x.detach(), 0, cpg, layout).requires_grad_()      # (s/P, b, h)
    with comm.accounting() as acc:
        y_local = parallel(x_local, mine, heads // t, kv_heads // t, dh, tp, cpg, method)
        y_local.backward(cp.shard_sequence(dy, 0, cpg, layout))
        grads = [comm.raw_all_reduce(w.grad, cpg, "backward", "dp×cp grads") for w in mine]   # down the column
    want = {"output": cp.shard_sequence(y.detach(), 0, cpg, layout), "dx": cp.shard_sequence(x.grad, 0, cpg, layout)}
    want.update(zip(("dW_q", "dW_k", "dW_v", "dW_o"), shards([w.grad for w in ws], heads, kv_heads, dh, t, ti)))
    got = {"output": y_local.detach(), "dx": x_local.grad, **dict(zip(("dW_q", "dW_k", "dW_v", "dW_o"), grads))}
    diffs = {}
    for key, expect in want.items():
        torch.testing.assert_close(got[key], expect, msg=lambda m, key=key: f"{method} on P={P} × t={t}, {key}: {m}")
        diffs[key] = float((got[key] - expect).abs().max())

    attention = [r for r in acc.records if r.label.startswith(("ring", "ulysses"))]
    costs = cp.cp_costs(s, b, heads // t, dh, P, method.lower(), True, layout, itemsize=4, kv_heads=kv_heads // t)
    sent = {phase: sum(r.sent for r in attention if r.phase == phase) for phase in ("forward", "backward")}
    if (sent["forward"], sent["backward"]) != (costs["forward"], costs["backward"]):
        raise AssertionError(f"{method} on P={P} × t={t}: attention sent {sent}, cp_costs with heads/t="
                             f"{heads // t} and kv_heads/t={kv_heads // t} says {costs['forward']}/{costs['backward']}")
    if any(r.group_size != P for r in attention):
        raise AssertionError(f"{method}: an attention exchange left the context-parallel column: "
                             f"{[(r.label, r.group_size) for r in attention]}")
    tp_ops = [r for r in acc.records if r.label in ("f", "g")]
    if any(r.group_size != t for r in tp_ops) or len(tp_ops) != 2:
        raise AssertionError(f"tensor parallelism's f and g should be one all-reduce each over the t={t} ranks "
                             f"of the row: {[(r.label, r.phase, r.group_size) for r in tp_ops]}")
    kv_fwd = sum(r.sent for r in attention if r.phase == "forward" and r.label == "ring k,v")
    return dict(cp=ci, tp=ti, diffs=diffs, forward=sent["forward"], backward=sent["backward"], kv_forward=kv_fwd,
                ops=sorted({(r.phase, r.label, r.op, r.group_size) for r in acc.records}))


@record
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel degree t; P = ranks / t")
    ap.add_argument("--seq-len", dest="s", type=int, default=SHAPE["s"], help="sequence length (divisible by 2P)")
    ap.add_argument("--batch", dest="b", type=int, default=SHAPE["b"])
    ap.add_argument("--hidden", dest="h", type=int, default=SHAPE["h"])
    ap.add_argument("--heads", type=int, default=SHAPE["heads"])
    ap.add_argument("--kv-heads", type=int, default=SHAPE["kv_heads"])
    ap.add_argument("--head-dim", dest="d", type=int, default=SHAPE["dh"])
    a = ap.parse_args(argv)
    with distributed.setup() as d:
        shape = dict(s=a.s, b=a.b, h=a.h, heads=a.heads, kv_heads=a.kv_heads, dh=a.d)
        rows = run_grid(d, a.tp, shape)
        if d.is_main:
            report(rows, a.tp, d.world_size // a.tp, **shape)
            print("\nall checks passed on every rank")


def run_grid(d, t: int, shape: dict) -> list:
    """:func:`check_layer` for each method on the grid of t columns; every rank's results, on every rank."""
    P = d.world_size // rules.whole(t, "the tensor-parallel degree t")
    rows = []
    for method in METHODS:
        every = [None] * d.world_size
        dist.all_gather_object(every, check_layer(d.device, t, P, method, **shape))
        rows.append((method, every))
    return rows


def report(rows, t, P, s, b, h, heads, kv_heads, dh) -> None:
    print(f"grid (cp, tp) = {P} × {t}: rank = {t}·cp + tp; a = {heads} query heads, a_kv = {kv_heads} "
          f"key/value heads, d = {dh}; float32")
    print(f"each tp rank holds a/t = {heads // t} query heads and a_kv/t = {kv_heads // t} key/value heads")
    for method, every in rows:
        keys = list(every[0]["diffs"])
        print(f"\n{method}: largest difference from the dense layer")
        print(f"{'rank':>4} {'(cp, tp)':>8} " + " ".join(f"{k:>7}" for k in keys)
              + f" {'sent fwd':>9} {'sent bwd':>9}")
        for r, res in enumerate(every):
            print(f"{r:4d} {str((res['cp'], res['tp'])):>8} "
                  + " ".join(f"{error_label(res['diffs'][k]):>7}" for k in keys)
                  + f" {res['forward']:9.0f} {res['backward']:9.0f}")
        if method == "ring":
            one = 2 * b * (s // P) * (kv_heads // t) * dh * 4
            print(f"ring k,v forward, every rank: {every[0]['kv_forward']:.0f} bytes = (P−1)·2·b·(s/P)·(a_kv/t)·d·4 "
                  f"= {(P - 1) * one} (all a/t heads' k, v would be {(P - 1) * one * heads // kv_heads})")
    print("\ncollectives on rank 0, ring (phase, label, op, group size):")
    for phase, label, op, n in rows[0][1][0]["ops"]:
        print(f"   {phase:9} {label:12} {op:11} over {n} ranks")


if __name__ == "__main__":
    main()
