"""Chapter 02: Megatron tensor parallelism — MLP, attention, a GPT block, a whole tiny GPT.

Every rank builds the same dense model (same seed), runs it whole, then runs its shard
and checks with ``torch.testing.assert_close`` (float32 defaults) that the output, the
input gradient and every parameter gradient equal the matching slice of the dense
result. The collectives of one block are counted with :func:`intralayer.comm.accounting`
and checked against Megatron's count: 2 all-reduces forward and 2 backward, each of
s·b·h elements. The tiny GPT uses a vocabulary-parallel embedding and cross-entropy, so
the (s, b, v) logits are never gathered. Rank 0 prints the tables.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 4 -m intralayer.programs.tp_block

One GPU node (NCCL), a larger layer::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.tp_block --s 512 --b 2 --h 1024 --heads 16 --vocab 32768

A cluster: the same with ``--nnodes`` and a c10d rendezvous (see the book's setup page);
keep the tensor-parallel group inside a node.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from intralayer import comm, distributed
from intralayer.comm import bus_factor
from intralayer.model import MLP, Attention, Block, TinyGPT
from intralayer.programs.tp_linear import error_label
from intralayer.tensor_parallel import (ParallelAttention, ParallelBlock, ParallelGPT, ParallelMLP, check_degrees,
                                        expected_shards, weights_per_device)


def check_module(d, dense, parallel, x, dy) -> dict:
    """Run ``dense`` and ``parallel`` on the same input; compare output and every gradient."""
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = dense(xd)
    y.backward(dy)
    with comm.accounting() as acc:
        out = parallel(xp)
        out.backward(dy)
    return dict(out=_diff(out, y), dx=_diff(xp.grad, xd.grad), grads=_grads(parallel, dense), acc=acc,
                weights=weights_per_device(parallel), dense_weights=sum(p.numel() for p in dense.parameters()))


def _diff(got, want) -> float:
    torch.testing.assert_close(got, want)                    # float32: rtol 1.3e-6, atol 1e-5
    return float((got - want).abs().max())


def _grads(parallel, dense) -> float:
    want = expected_shards(parallel, dense, grads=True)
    return max(_diff(p.grad, want[name]) for name, p in parallel.named_parameters())


def block_checks(d, s, b, h, heads, vocab):
    dev, g = d.device, d.group
    torch.manual_seed(0)
    x = torch.randn(s, b, h, device=dev)                     # (s, b, h), the same on every rank
    dy = torch.randn(s, b, h, device=dev)
    mlp, attn, block = MLP(h).to(dev), Attention(h, heads).to(dev), Block(h, heads).to(dev)
    results = {
        "MLP": check_module(d, mlp, ParallelMLP.from_dense(mlp.fc1, mlp.fc2, g), x, dy),
        "attention": check_module(d, attn, ParallelAttention.from_dense(attn, g), x, dy),
        "block": check_module(d, block, ParallelBlock.from_dense(block, g), x, dy),
    }
    # A whole model: vocabulary-parallel embedding, a block, column-parallel head, parallel loss.
    gpt = TinyGPT(vocab, h, heads, layers=1).to(dev)
    ids = torch.randint(0, vocab, (s, b), device=dev)
    targets = torch.randint(0, vocab, (s, b), device=dev)
    pgpt = ParallelGPT.from_dense(gpt, g)
    loss_dense = gpt.loss(ids, targets)
    loss_dense.backward()
    with comm.accounting() as acc:
        loss = pgpt.loss(ids, targets)
        loss.backward()
    results["tiny GPT (loss)"] = dict(out=_diff(loss, loss_dense), dx=None, grads=_grads(pgpt, gpt), acc=acc,
                                      weights=weights_per_device(pgpt),
                                      dense_weights=sum(p.numel() for p in gpt.parameters()))
    return results


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--s", type=int, default=8, help="sequence length")
    p.add_argument("--b", type=int, default=2, help="micro-batch")
    p.add_argument("--h", type=int, default=16, help="hidden size")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    a = p.parse_args(argv)
    with distributed.setup() as d:
        check_degrees(d.world_size, h=a.h, heads=a.heads, ffn=4 * a.h, vocab=a.vocab)
        res = block_checks(d, a.s, a.b, a.h, a.heads, a.vocab)
        mine = {k: {f: v[f] for f in ("out", "dx", "grads")} for k, v in res.items()}
        every = [None] * d.world_size
        dist.all_gather_object(every, mine)
        verify_counts(res["block"]["acc"], d.world_size, a.s * a.b * a.h)
        if d.is_main:
            report(d, a, res, every)


def verify_counts(acc: comm.Accounting, t: int, sbh: int) -> None:
    """Megatron's count for one block: 2 all-reduces forward, 2 backward, each of s·b·h elements."""
    for phase in ("forward", "backward"):
        recs = acc.select(phase=phase)
        ops = [(r.op, r.elements) for r in recs]
        if ops != [("all_reduce", sbh)] * 2:
            raise AssertionError(f"{phase}: expected 2 all-reduces of s·b·h = {sbh} elements, got {ops}")


def report(d, a, res, every) -> None:
    t = d.world_size
    print(f"t = {t} ranks ({d.backend}, {d.device.type}); s={a.s}, b={a.b}, h={a.h}, heads={a.heads}, "
          f"vocab={a.vocab}; float32")
    print(f"\n{'module':16} {'weights/rank':>12} {'of dense':>8}  {'output':>6} {'dX':>6} {'grads':>6}   "
          "collectives forward / backward")
    for name, r in res.items():
        worst = {f: max(rank[name][f] or 0.0 for rank in every) for f in ("out", "dx", "grads")}
        fb = [", ".join(f"{r['acc'].count(op, ph)} {op}" for op in ("all_reduce", "all_gather")
                        if r["acc"].count(op, ph)) or "none" for ph in ("forward", "backward")]
        print(f"{name:16} {r['weights']:12d} {r['dense_weights']:8d}  {error_label(worst['out']):>6} "
              f"{'—' if r['dx'] is None else error_label(worst['dx']):>6} {error_label(worst['grads']):>6}   "
              f"{fb[0]} / {fb[1]}")

    sbh, item = a.s * a.b * a.h, 4
    print(f"\nOne block's collectives on rank 0, next to Megatron's formula (S = s·b·h = {sbh} elements, "
          f"{item} bytes each):")
    print(f"{'phase':9} {'label':16} {'op':10} {'S bytes':>8} {'sent by this rank':>17}   formula 2(t−1)/t·S")
    for rec in res["block"]["acc"].records:
        print(f"{rec.phase:9} {rec.label:16} {rec.op:10} {rec.bytes:8d} {rec.sent:17.0f}   "
              f"{bus_factor('all_reduce', t) * sbh * item:.0f}")
    acc = res["tiny GPT (loss)"]["acc"]
    ce = [r for r in acc.records if r.label.startswith("ce")]
    gather = bus_factor("all_gather", t) * a.s * a.b * a.vocab * item
    print(f"\nTiny GPT, one step: {acc.count()} collectives, {acc.sent():.0f} bytes sent by rank 0. "
          f"The cross-entropy's share: {len(ce)} all-reduces of s·b = {a.s * a.b} numbers, "
          f"{sum(r.sent for r in ce):.0f} bytes;\ngathering the (s, b, v) logits instead would send "
          f"{gather:.0f} bytes ({gather / sum(r.sent for r in ce):.0f}× more).")
    print("\nall checks passed on every rank (torch.testing.assert_close, float32 tolerances)")


if __name__ == "__main__":
    main()
