"""Chapter 03: sequence parallelism — correctness, collectives and activation memory per rank.

Part 1. Every rank builds the same dense GPT block (no dropout) and checks three parallel
versions against it — tensor parallel (TP), TP + sequence parallel (SP) keeping only its
slice of each gathered input, and TP + SP keeping the gathered inputs — output, input
gradient and every parameter gradient (``torch.testing.assert_close``, float32
defaults). It records each version's collectives and prints the bytes each sends, forward
and backward, as a multiple of TP's.

Part 2. With dropout on and the attention written out (so that every tensor Korthikanti
et al. 2022 count is really kept), each rank measures the bytes autograd saves for one
block (``intralayer.memory.saved_bytes``) for each layout and recomputation choice, in
float32 and bfloat16, and checks them against ``intralayer.memory.activation_terms``
with the measurement's own assumptions (LayerNorm statistics: the activations' type on a
CPU, float32 on a GPU). The fused-attention row keeps the two dropouts on the residual
stream but not the one on the attention probabilities: ``scaled_dot_product_attention``
serves as the fused kernel only without it. Rank 0 prints the tables and, with ``--out``,
writes them as JSON.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 4 -m intralayer.programs.sp_block

One GPU node (NCCL)::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.sp_block --seq-len 512 --hidden 1024 --heads 16
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from intralayer import comm, distributed, memory
from intralayer.model import Block
from intralayer.programs.common import error_label
from intralayer.sequence_parallel import ParallelBlock
from intralayer.tensor_parallel import check_degrees, expected_shards

LAYOUTS = {"TP": dict(sequence_parallel=False), "TP+SP": dict(sequence_parallel=True),
           "TP+SP, keep gathered": dict(sequence_parallel=True, keep_gathered=True)}


def _diff(got, want) -> float:
    torch.testing.assert_close(got, want)                     # float32: rtol 1.3e-6, atol 1e-5
    return float((got - want).detach().abs().max())


def correctness(d, s, b, h, heads) -> dict:
    t, r, dev = d.world_size, d.rank, d.device
    torch.manual_seed(0)
    dense = Block(h, heads).to(dev)
    x = torch.randn(s, b, h, device=dev)                      # (s, b, h), the same on every rank
    dy = torch.randn(s, b, h, device=dev)
    xd = x.clone().requires_grad_()
    y = dense(xd)
    y.backward(dy)
    out = {}
    for name, kw in LAYOUTS.items():
        block = ParallelBlock.from_dense(dense, d.group, **kw)
        split = kw["sequence_parallel"]
        piece = (lambda z: z.chunk(t, 0)[r]) if split else (lambda z: z)   # (s/t, b, h) or (s, b, h)
        xin = piece(x).clone().requires_grad_()
        with comm.accounting() as acc:
            got = block(xin)
            got.backward(piece(dy))
        with comm.accounting() as sync:
            block.sync_grads()
        want = expected_shards(block, dense, grads=True)
        errs = dict(out=_diff(got, piece(y)), dx=_diff(xin.grad, piece(xd.grad)),
                    grads=max(_diff(p.grad, want[n]) for n, p in block.named_parameters()))
        out[name] = dict(errs=errs, records=[(rec.phase, rec.op, rec.label, rec.bytes, rec.sent)
                                             for rec in acc.records],
                         sync=sync.sent(), in_shape=tuple(xin.shape))
    return out


CONFIGS = [  # label, layout kwargs, recompute, fused
    ("TP", dict(sequence_parallel=False), "none", False),
    ("TP+SP", dict(sequence_parallel=True), "none", False),
    ("TP+SP, keep gathered", dict(sequence_parallel=True, keep_gathered=True), "none", False),
    ("TP + selective", dict(sequence_parallel=False), "selective", False),
    ("TP+SP + selective", dict(sequence_parallel=True), "selective", False),
    ("TP+SP + full (2sbh/t)", dict(sequence_parallel=True), "full", False),
    ("TP+SP, fused attention", dict(sequence_parallel=True), "none", True),
]
# Full recomputation keeps the layer's input. Table 2 of the paper prints 2sbh for it; with
# sequence parallelism that input arrives split by sequence, and Megatron-LM keeps it so:
# 2sbh/t. The "paper" column of that row is the latter (memory.activation_bytes_per_layer).


def stats_bytes(device: torch.device, itemsize: int) -> int:
    """Bytes per LayerNorm statistic (mean, 1/σ): PyTorch's CUDA kernel keeps them in float32
    (its accumulation type), its CPU kernel in the activations' own type."""
    return 4 if device.type == "cuda" else itemsize


def measure(d, s, b, h, heads, p) -> list[dict]:
    """Saved bytes per rank for no parallelism and each CONFIG, in float32 and bfloat16."""
    t, r, dev = d.world_size, d.rank, d.device
    rows = []
    for label, kw, recompute, fused in [("none (t = 1)", None, "none", False)] + CONFIGS:
        row = dict(label=label, sp=bool(kw and kw["sequence_parallel"]), recompute=recompute, fused=fused,
                   keep_gathered=bool(kw and kw.get("keep_gathered")), t=1 if kw is None else t)
        for dtype, e in ((torch.float32, 4), (torch.bfloat16, 2)):
            torch.manual_seed(0)
            dense = Block(h, heads, dropout=p, fused=fused, recompute=recompute)
            if fused:
                dense.attn.p = 0.0                            # the fused kernel runs without attention dropout
            dense = dense.to(device=dev, dtype=dtype)
            block = dense if kw is None else ParallelBlock.from_dense(dense, d.group, **kw)
            rows_in = s // t if row["sp"] else s
            x = torch.randn(rows_in, b, h, device=dev, dtype=dtype, requires_grad=True)
            with memory.saved_bytes(exclude=block.parameters()) as report:
                y = block(x)
            y.float().sum().backward()                        # the saved tensors must do their job
            want = sum(memory.activation_terms(
                s, b, h, heads, t=row["t"], sp=row["sp"], recompute=recompute, itemsize=e,
                ln_stats=recompute != "full", stats_bytes=stats_bytes(dev, e), fused=fused,
                keep_gathered=row["keep_gathered"]).values())
            if report.total != want:
                raise AssertionError(f"rank {r}, {label}, {dtype}: measured {report.total} bytes, "
                                     f"the adjusted formula says {want}\n{report.table()}")
            row[str(dtype).removeprefix("torch.")] = report.total
        row["paper"] = None if fused or row["keep_gathered"] else memory.activation_bytes_per_layer(
            s, b, h, heads, t=row["t"], sp=row["sp"], recompute=recompute)
        rows.append(row)
    return rows


@record
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Long names: after ``-m module`` torchrun still reads an abbreviation of one of its own
    # options (--s, --h for --help), so the short forms work only without torchrun.
    ap.add_argument("--seq-len", "--s", dest="s", type=int, default=32,
                    help="sequence length (divisible by the number of ranks)")
    ap.add_argument("--batch", "--b", dest="b", type=int, default=2, help="micro-batch")
    ap.add_argument("--hidden", "--h", dest="h", type=int, default=64, help="hidden size")
    ap.add_argument("--heads", type=int, default=8, help="attention heads")
    ap.add_argument("--dropout", type=float, default=0.1, help="dropout probability for part 2")
    ap.add_argument("--out", help="write rank 0's tables to this JSON file")
    a = ap.parse_args(argv)
    with distributed.setup() as d:
        check_degrees(d.world_size, h=a.h, heads=a.heads, ffn=4 * a.h)
        if a.s % d.world_size:
            raise ValueError(f"sequence parallelism needs the sequence length {a.s} divisible by "
                             f"the {d.world_size} ranks")
        checks = correctness(d, a.s, a.b, a.h, a.heads)
        rows = measure(d, a.s, a.b, a.h, a.heads, a.dropout)
        every = [None] * d.world_size
        dist.all_gather_object(every, ({k: v["errs"] for k, v in checks.items()}, rows))
        if d.is_main:
            report(d, a, checks, every)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(dict(config=vars(a), t=d.world_size, checks=checks,
                                   memory=[rank[1] for rank in every]), f, indent=1)


def report(d, a, checks, every) -> None:
    t, sbh = d.world_size, a.s * a.b * a.h
    print(f"t = {t} ranks ({d.backend}, {d.device.type}); block s={a.s}, b={a.b}, h={a.h}, heads={a.heads}")
    print(f"\n1. Each layout against the dense block (largest difference over {t} ranks):")
    print(f"{'layout':22} {'input/rank':>12} {'output':>7} {'dX':>7} {'grads':>7}")
    for name, c in checks.items():
        worst = {k: max(rank[0][name][k] for rank in every) for k in ("out", "dx", "grads")}
        print(f"{name:22} {str(c['in_shape']):>12} " + " ".join(f"{error_label(worst[k]):>7}"
                                                           for k in ("out", "dx", "grads")))
    print(f"\nCollectives of one block on rank 0 (S in bytes, float32; s·b·h = {sbh} numbers):")
    print(f"{'layout':22} {'phase':9} {'collectives':56} {'sent bytes':>10}")
    for name, c in checks.items():
        for phase in ("forward", "backward"):
            recs = [rec for rec in c["records"] if rec[0] == phase]
            ops = {}
            for _, op, label, nbytes, _ in recs:
                key = f"{op} S={nbytes} B"
                ops[key] = ops.get(key, 0) + 1
            text = ", ".join(f"{n}× {k}" for k, n in ops.items())
            print(f"{name:22} {phase:9} {text:56} {sum(rec[4] for rec in recs):10.0f}")
    print(f"(after backward, TP+SP adds one all-reduce of the replicated parameters' gradients: "
          f"{checks['TP+SP']['sync']:.0f} bytes sent per rank, once per step)")
    sent = {name: {phase: sum(rec[4] for rec in c["records"] if rec[0] == phase) for phase in ("forward", "backward")}
            for name, c in checks.items()}
    tp = sent["TP"]
    for name in ("TP+SP", "TP+SP, keep gathered"):
        fwd, bwd = sent[name]["forward"] / tp["forward"], sent[name]["backward"] / tp["backward"]
        step = sum(sent[name].values()) / sum(tp.values())
        print(f"bytes sent, {name} ÷ TP: forward {fwd:.2f}×, backward {bwd:.2f}× ({bwd - 1:+.0%}), "
              f"forward + backward {step:.2f}×")

    print("\n2. Bytes saved for backward by one block, per rank, measured = the adjusted formula on every rank")
    print(f"{'configuration':26} {'float32':>9} {'bfloat16':>9} {'paper':>8}   bf16 − paper   ÷ s·b·h (bf16, paper)")
    per = stats_bytes(d.device, 2)                     # bytes per statistic with bf16 activations
    stats = 2 * 2 * a.s * a.b * per                    # two LayerNorms × (mean, 1/σ) × s·b × bytes
    for row in every[0][1]:
        paper = row["paper"]
        extra = "" if paper is None else f"{row['bfloat16'] - paper:13d}"
        ratio = f"{row['bfloat16'] / sbh:7.3f}" + ("" if paper is None else f" {paper / sbh:7.3f}")
        print(f"{row['label']:26} {row['float32']:9d} {row['bfloat16']:9d} "
              f"{'—' if paper is None else paper:>8}   {extra:>13}   {ratio}")
    kept = "bf16" if per == 2 else "float32"
    print(f"(LayerNorm statistics in {kept}: 2 × 2 × s·b × {per} bytes = {stats} bytes, divided by t under SP)")
    print(f"(TP+SP + full: Table 2 prints 2sbh = {2 * sbh} bytes; 2sbh/t = {2 * sbh // t} is what Megatron-LM "
          f"keeps, the layer's input split by sequence)")
    print("\nall checks passed on every rank")


if __name__ == "__main__":
    main()
