"""Chapter 03: a GPT with tensor and sequence parallelism from the embedding to the loss, checked against the dense model.

Every rank builds the same dense :class:`~intralayer.model.TinyGPT` and its
:class:`~intralayer.sequence_parallel.SequenceParallelGPT` shard, as Megatron-Core places
the model's edges:

- entering the sequence-parallel region, the vocabulary-parallel embedding's partial sums
  are **reduce-scattered** along the sequence (``reduce_scatter_embeddings``), where
  tensor parallelism all-reduces them; its backward is an all-gather;
- leaving it, the LM head **all-gathers** the final LayerNorm's ``s/t`` tokens (backward: a
  reduce-scatter) and its ``(s, b, v/t)`` logits go to the vocabulary-parallel
  cross-entropy, three all-reduces of one number per token.

Part 1 compares loss, logits and every parameter's gradient (after the replicated
parameters' gradients are summed) with the dense model, without dropout and with it. With
dropout every mask — after the embedding, on the attention probabilities, on the residual
stream — is drawn from the rank's tensor-parallel generator, ``seed + 2718 + rank``, as
Megatron-LM draws them under sequence parallelism; the dense model replays the same masks
(``seed_dense_sequence_dropout``). Block 1 recomputes in full, so the generators are
rewound and replayed in the backward pass as well. It prints the edges' collectives.

Part 2 seeds every rank with the *same* generator: each rank's chunk of the sequence then
gets the same mask, which a dense model never draws. It prints how often two chunks'
masks agree (independent masks agree at a fraction (1 − p)² + p² of positions) and the
loss it gives.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 4 -m intralayer.programs.sp_gpt

One GPU node (NCCL)::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.sp_gpt --seq-len 512 --hidden 1024 --heads 16
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from intralayer import comm, distributed
from intralayer.model import TinyGPT, dropout_mask
from intralayer.programs.common import error_label
from intralayer.sequence_parallel import (SequenceParallelGPT, check_sequence, seed_dense_sequence_dropout,
                                          seed_sequence_parallel_dropout)
from intralayer.tensor_parallel import ParallelGPT, check_degrees, expected_shards, model_parallel_seed

SEED = 1234
EDGES = ("embed", "head")
MASKS = 16          # part 2 compares this many masks of (s/t, b, h) from each rank's generator


def _diff(got, want) -> float:
    torch.testing.assert_close(got, want)                     # float32: rtol 1.3e-6, atol 1e-5
    return float((got - want).detach().abs().max())


def build(d, a, p: float, shared_seed: bool = False):
    """The dense GPT (block 1 recomputes in full) and this rank's sequence-parallel shard of it."""
    torch.manual_seed(0)
    dense = TinyGPT(a.vocab, a.h, a.heads, layers=a.layers).to(d.device)
    dense.blocks[-1].recompute = "full"
    par = SequenceParallelGPT.from_dense(dense, d.group, dropout=p)
    if p:
        seed_dense_sequence_dropout(dense, SEED, d.world_size, p)
        seed_sequence_parallel_dropout(par, model_parallel_seed(SEED, 0 if shared_seed else d.rank, d.device))
    return dense, par


def tokens(d, a):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, a.vocab, (a.s, a.b), generator=g)
    return ids.to(d.device), torch.randint(0, a.vocab, (a.s, a.b), generator=g).to(d.device)


def correctness(d, a, p: float) -> dict:
    """Loss, logits (without dropout) and every gradient against the dense model; the collectives."""
    t, r = d.world_size, d.rank
    dense, par = build(d, a, p)
    ids, targets = tokens(d, a)
    errs = {}
    if not p:
        with torch.no_grad():
            errs["logits"] = _diff(par(ids), dense(ids).chunk(t, -1)[r])
    with comm.accounting() as acc:
        loss = par.loss(ids, targets)
        loss.backward()
    want = dense.loss(ids, targets)
    want.backward()
    par.sync_grads()
    errs["loss"] = _diff(loss.detach(), want.detach())
    shards = expected_shards(par, dense, grads=True)
    errs["grads"] = max(_diff(q.grad, shards[name]) for name, q in par.named_parameters())
    return dict(errs=errs, loss=float(loss.detach()), dense_loss=float(want.detach()),
                records=[(rec.phase, rec.op, rec.label, rec.elements) for rec in acc.records])


def tensor_parallel_edges(d, a) -> list:
    """The same step with tensor parallelism alone (chapter 02's ParallelGPT): its edges' collectives."""
    dense, _ = build(d, a, 0.0)
    par = ParallelGPT.from_dense(dense, d.group)
    ids, targets = tokens(d, a)
    with comm.accounting() as acc:
        par.loss(ids, targets).backward()
    return [(rec.phase, rec.op, rec.label, rec.elements) for rec in acc.records if edge(rec.label) in EDGES]


def shared_seed(d, a) -> dict:
    """Every rank on rank 0's generator: how often chunks' masks agree, and the loss that gives."""
    def masks(rank):                                  # the first MASKS masks of (s/t, b, h) the generator draws
        g = model_parallel_seed(SEED, rank, d.device)["tensor-parallel"]
        return torch.stack([dropout_mask((a.s // d.world_size, a.b, a.h), a.dropout, g) for _ in range(MASKS)])
    own, shared = masks(d.rank), masks(0)
    every = [None] * d.world_size
    dist.all_gather_object(every, (own.cpu(), shared.cpu()))
    agree = lambda i: sum(float((m[i] == every[0][i]).float().mean()) for m in every[1:]) / (d.world_size - 1)
    q = (1 - a.dropout) ** 2 + a.dropout ** 2        # two independent masks agree at a fraction q of positions
    n = (d.world_size - 1) * own.numel()
    out = dict(own_agree=agree(0), shared_agree=agree(1), independent=q, sigma=(q * (1 - q) / n) ** 0.5, positions=n)
    if out["shared_agree"] != 1.0:
        raise AssertionError(f"one seed shared by the ranks gave chunks different masks ({out['shared_agree']:.3f})")
    if abs(out["own_agree"] - q) > 5 * out["sigma"]:
        raise AssertionError(f"the ranks' own seeds agree at {out['own_agree']:.4f} of positions, not at the "
                             f"{q:.4f} ± {out['sigma']:.4f} of independent masks")
    dense, par = build(d, a, a.dropout, shared_seed=True)
    ids, targets = tokens(d, a)
    with torch.no_grad():
        return dict(out, loss=float(par.loss(ids, targets)), dense_loss=float(dense.loss(ids, targets)))


def edge(label: str) -> str:
    return next((e for e in EDGES if label.startswith(e)), "loss" if label.startswith("ce") else "blocks")


@record
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", dest="s", type=int, default=32, help="sequence length (divisible by the ranks)")
    ap.add_argument("--batch", dest="b", type=int, default=2, help="micro-batch")
    ap.add_argument("--hidden", dest="h", type=int, default=64, help="hidden size")
    ap.add_argument("--heads", type=int, default=8, help="attention heads")
    ap.add_argument("--layers", type=int, default=2, help="blocks (the last one recomputes in full)")
    ap.add_argument("--vocab", type=int, default=128, help="vocabulary size (divisible by the ranks)")
    ap.add_argument("--dropout", type=float, default=0.1, help="dropout probability of every dropout")
    ap.add_argument("--out", help="write rank 0's results to this JSON file")
    a = ap.parse_args(argv)
    with distributed.setup() as d:
        check_degrees(d.world_size, h=a.h, heads=a.heads, ffn=4 * a.h, vocab=a.vocab)
        check_sequence(a.s, d.world_size)
        runs = {p: correctness(d, a, p) for p in (0.0, a.dropout)}
        runs[0.0]["tp_edges"] = tensor_parallel_edges(d, a)
        wrong = shared_seed(d, a) if d.world_size > 1 else None     # part 2 compares ranks' masks
        every = [None] * d.world_size
        dist.all_gather_object(every, {p: run["errs"] for p, run in runs.items()})
        if d.is_main:
            report(d, a, runs, every, wrong)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(dict(config=vars(a), t=d.world_size, runs={str(p): r for p, r in runs.items()},
                                   shared_seed=wrong), f, indent=1)


def report(d, a, runs, every, wrong) -> None:
    t, sbh = d.world_size, a.s * a.b * a.h
    print(f"t = {t} ranks ({d.backend}, {d.device.type}); GPT s={a.s}, b={a.b}, h={a.h}, heads={a.heads}, "
          f"layers={a.layers}, v={a.vocab}; each rank holds (s/t, b, h) = ({a.s // t}, {a.b}, {a.h}) between the edges")
    print(f"\n1. Against the dense model (largest difference over {t} ranks):")
    print(f"{'dropout':>8} {'loss (SP)':>10} {'loss (dense)':>12} {'logits':>7} {'loss':>7} {'grads':>7}")
    for p, run in runs.items():
        worst = {k: max(rank[p].get(k, 0.0) for rank in every) for k in ("logits", "loss", "grads")}
        logits = error_label(worst["logits"]) if not p else "—"
        print(f"{p:8.2f} {run['loss']:10.5f} {run['dense_loss']:12.5f} {logits:>7} "
              f"{error_label(worst['loss']):>7} {error_label(worst['grads']):>7}")
    print(f"\nCollectives of one step on rank 0 (numbers moved; s·b·h = {sbh}, s·b = {a.s * a.b}):")
    print(f"{'where':7} {'phase':9} collectives")
    recs = runs[0.0]["records"]
    for where in ("embed", "blocks", "head", "loss"):
        for phase in ("forward", "backward"):
            ops = {}
            for ph, op, label, elements in recs:
                if ph == phase and edge(label) == where:
                    key = f"{op} of {elements}"
                    ops[key] = ops.get(key, 0) + 1
            text = ", ".join(f"{n}× {k}" for k, n in ops.items()) or "nothing"
            print(f"{where:7} {phase:9} {text}")
    print(f"(block {a.layers - 1} recomputes in full: its forward collectives run again in the backward pass, "
          f"counted there as forward)")
    print("The edges with tensor parallelism alone (chapter 02's ParallelGPT), the same step:")
    for where in EDGES:
        for phase in ("forward", "backward"):
            ops = [f"{op} of {elements} ({label})" for ph, op, label, elements in runs[0.0]["tp_edges"]
                   if ph == phase and edge(label) == where]
            print(f"{where:7} {phase:9} {', '.join(ops) or 'nothing'}")
    if wrong is None:
        print("\n2. (one rank: no other rank's mask to compare with)\n\nall checks passed on every rank")
        return
    print(f"\n2. One generator shared by the ranks (dropout {a.dropout}): how often rank i's first {MASKS} masks "
          f"of (s/t, b, h) equal rank 0's, over {wrong['positions']} positions")
    print(f"   own seeds (seed + 2718 + rank): {wrong['own_agree']:.3f} of positions "
          f"(independent masks: (1 − p)² + p² = {wrong['independent']:.3f} ± {wrong['sigma']:.3f})")
    print(f"   one shared seed:                {wrong['shared_agree']:.3f} — every chunk of the sequence gets the "
          f"same mask")
    print(f"   loss with the shared seed {wrong['loss']:.5f}, the dense model's (independent masks) "
          f"{wrong['dense_loss']:.5f}: not the dense model's dropout")
    print("\nall checks passed on every rank")


if __name__ == "__main__":
    main()
