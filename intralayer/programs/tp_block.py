"""Chapter 02: Megatron tensor parallelism — MLP, attention, a GPT block, a whole tiny GPT.

Every rank builds the same dense model (same seed), runs it whole, then runs its shard
and checks with ``torch.testing.assert_close`` (float32 defaults, widened at larger sizes:
:func:`tolerance`) that the output, the input gradient and every parameter gradient equal
the matching slice of the dense result. The collectives of one block are counted with
:func:`intralayer.comm.accounting` and checked against Megatron's count: 2 all-reduces
forward and 2 backward, each of s·b·h elements. The tiny GPT uses a vocabulary-parallel
embedding and cross-entropy, so the (s, b, v) logits are never gathered. Rank 0 prints
the tables.

Then grouped-query attention (``--kv-heads``, the key/value heads of each case; none to
skip): attention with fewer key/value heads than query heads, and a block with the first
of them, checked the same way. Where t exceeds the key/value heads the ranks sharing one
all-gather the q|k|v projection forward and reduce-scatter its gradient backward
(Megatron-Core's layout, :class:`~intralayer.tensor_parallel.QKVParallelLinear`); the
gathers' sizes are checked against s·b·(a + 2·a_kv)·d, and a gather whose backward keeps
each rank's own chunk (right only when every rank uses the gathered tensor alike) must get
the gradients wrong.

Then the block again with dropout on (``--dropout``, 0 to skip), its masks drawn as
Megatron-LM draws them (:func:`~intralayer.tensor_parallel.model_parallel_seed`): the two
dropouts on the replicated residual stream from a seed shared by every rank, the
attention dropout of this rank's heads from ``seed + 2718 + rank``. The dense block draws
its head group r's mask from rank r's generator, so output and gradients must match
again. The masks are replayed from fresh generators and compared across ranks; the
generators must have advanced by exactly those draws. Last, two wrong seedings, to show
what each rule prevents.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 4 -m intralayer.programs.tp_block

One GPU node (NCCL), a larger layer::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.tp_block \
        --seq-len 512 --batch 2 --hidden 1024 --heads 16 --vocab 32768

A cluster: the same with ``--nnodes`` and a c10d rendezvous (see the book's setup page);
keep the tensor-parallel group inside a node.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from intralayer import comm, distributed
from intralayer.comm import bus_factor, gather_from_group
from intralayer.model import MLP, Attention, Block, TinyGPT, dropout_mask
from intralayer.programs.common import error_label
from intralayer.tensor_parallel import (TP_SEED_OFFSET, ParallelAttention, ParallelBlock, ParallelGPT, ParallelMLP,
                                        RNGTracker, check_degrees, expected_shards, model_parallel_seed,
                                        seed_dense_dropout, seed_dropout, weights_per_device)

#: The lines that start the grouped-query and the dropout parts of the report (the chapter shows each
#: part in its own section).
GQA_HEADER = "Grouped-query attention under tensor parallelism"
DROPOUT_HEADER = "Dropout under tensor parallelism"


#: The longest sum up to which ``assert_close``'s float32 defaults (rtol 1.3e-6 ≈ 22u, atol 1e-5)
#: hold a float32 parallel result against its float32 dense twin (tests/programs/checks.py).
DEFAULT_TOL_TERMS = 96


def tolerance(s: int, b: int, h: int, vocab: int) -> dict:
    """``assert_close``'s float32 tolerances for these sizes: the defaults, widened past 96 terms.

    Dense and parallel add the same terms in another order; the longest sum here is n =
    max(4h, s·b, v) terms (fc2's inputs, a weight gradient's tokens, the softmax over the
    vocabulary). Rounding errors of both signs grow like √n·u (Higham 2002, §2.8), so past
    96 terms both tolerances grow by √(n/96). At the default sizes (n = 64) they are the
    defaults; at ``--hidden 1024 --seq-len 512 --batch 2`` the defaults are too tight.
    """
    scale = max(1.0, (max(4 * h, s * b, vocab) / DEFAULT_TOL_TERMS) ** 0.5)
    return dict(rtol=1.3e-6 * scale, atol=1e-5 * scale)


def check_module(d, dense, parallel, x, dy, tol: dict) -> dict:
    """Run ``dense`` and ``parallel`` on the same input; compare output and every gradient."""
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = dense(xd)
    y.backward(dy)
    with comm.accounting() as acc:
        out = parallel(xp)
        out.backward(dy)
    return dict(out=_diff(out, y, tol), dx=_diff(xp.grad, xd.grad, tol), grads=_grads(parallel, dense, tol), acc=acc,
                weights=weights_per_device(parallel), dense_weights=sum(p.numel() for p in dense.parameters()))


def _diff(got, want, tol: dict) -> float:
    got, want = got.detach(), want.detach()
    torch.testing.assert_close(got, want, **tol)             # see tolerance()
    return float((got - want).abs().max())


def _grads(parallel, dense, tol: dict) -> float:
    want = expected_shards(parallel, dense, grads=True)
    return max(_diff(p.grad, want[name], tol) for name, p in parallel.named_parameters())


def block_checks(d, s, b, h, heads, vocab):
    dev, g = d.device, d.group
    tol = tolerance(s, b, h, vocab)
    torch.manual_seed(0)
    x = torch.randn(s, b, h, device=dev)                     # (s, b, h), the same on every rank
    dy = torch.randn(s, b, h, device=dev)
    mlp, attn, block = MLP(h).to(dev), Attention(h, heads).to(dev), Block(h, heads).to(dev)
    results = {
        "MLP": check_module(d, mlp, ParallelMLP.from_dense(mlp.fc1, mlp.fc2, g), x, dy, tol),
        "attention": check_module(d, attn, ParallelAttention.from_dense(attn, g), x, dy, tol),
        "block": check_module(d, block, ParallelBlock.from_dense(block, g), x, dy, tol),
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
    results["tiny GPT (loss)"] = dict(out=_diff(loss, loss_dense, tol), dx=None, grads=_grads(pgpt, gpt, tol), acc=acc,
                                      weights=weights_per_device(pgpt),
                                      dense_weights=sum(p.numel() for p in gpt.parameters()))
    return results


class SplitBackwardAttention(ParallelAttention):
    """Wrong on purpose: the gather's backward keeps this rank's chunk of its own gradient.

    That is Megatron's *gather* (``gather_from_group``), right when every rank then uses the
    gathered tensor alike. Here each rank uses only its group and its own queries, so the
    gradient the other ranks sharing a key/value head computed for it never arrives.
    """

    def gather_qkv(self, mixed):
        return gather_from_group(mixed, -1, self.qkv.group, "wrong gather")


def gqa_checks(d, s, b, h, heads, kv_list, vocab) -> dict:
    """Attention for each number of key/value heads, and a block with the first, against the dense twins."""
    dev, g, t = d.device, d.group, d.world_size
    tol = tolerance(s, b, h, vocab)
    torch.manual_seed(0)
    x = torch.randn(s, b, h, device=dev)                     # (s, b, h), the same on every rank
    dy = torch.randn(s, b, h, device=dev)
    results = {}
    for kv in kv_list:
        torch.manual_seed(kv)
        attn = Attention(h, heads, kv_heads=kv).to(dev)
        par = ParallelAttention.from_dense(attn, g)
        res = check_module(d, attn, par, x, dy, tol)
        res.update(local=(par.heads, par.kv_heads), wrong=None)
        if t > kv:                                           # shared heads: what the wrong backward would do
            torch.manual_seed(kv)
            fresh = Attention(h, heads, kv_heads=kv).to(dev)
            wrong = SplitBackwardAttention.from_dense(fresh, g)
            xd = x.clone().requires_grad_()
            fresh(xd).backward(dy)
            wrong(x).backward(dy)
            want = expected_shards(wrong, fresh, grads=True)["qkv.weight"]
            res["wrong"] = float((wrong.qkv.weight.grad - want).abs().max())
        results[f"attention a_kv={kv}"] = res
    torch.manual_seed(0)
    block = Block(h, heads, kv_heads=kv_list[0]).to(dev)
    res = check_module(d, block, ParallelBlock.from_dense(block, g), x, dy, tol)
    res.update(local=(heads // t, max(kv_list[0] // t, 1)), wrong=None)
    results[f"block a_kv={kv_list[0]}"] = res
    return results


def verify_gqa(every: list[dict], res: dict, t: int, s: int, b: int, h: int, heads: int) -> None:
    """The collectives of each case, and the wrong backward visibly wrong on every rank."""
    d = h // heads
    for name, r in res.items():
        kv = int(name.rpartition("=")[2])
        gathers = [rec for rec in r["acc"].records if rec.op in ("all_gather", "reduce_scatter")]
        want = [("forward", "all_gather"), ("backward", "reduce_scatter")] if t > kv else []
        if [(rec.phase, rec.op) for rec in gathers] != want:
            raise AssertionError(f"{name}: gathers {[(rec.phase, rec.op) for rec in gathers]}, expected {want}")
        for rec in gathers:
            if rec.elements != s * b * (heads + 2 * kv) * d:
                raise AssertionError(f"{name}: {rec.op} of {rec.elements} elements, Megatron-Core's "
                                     f"s·b·(a + 2·a_kv)·d is {s * b * (heads + 2 * kv) * d}")
    for rank, mine in enumerate(every):
        for name, r in mine.items():
            if r["wrong"] is not None and not r["wrong"] > 1e-3:
                raise AssertionError(f"rank {rank}, {name}: the wrong backward left the q|k|v gradient right")


def report_gqa(d, a, res, every) -> None:
    t = d.world_size
    print(f"\n{GQA_HEADER}: t = {t}; s={a.s}, b={a.b}, h={a.h}, {a.heads} query heads of d = {a.h // a.heads}")
    print(f"{'module':16} {'heads here: q / kv':>18} {'weights/rank':>12} {'of dense':>8}  {'output':>6} {'dX':>6} "
          f"{'grads':>6}   collectives forward / backward")
    for name, r in res.items():
        kv = int(name.rpartition("=")[2])
        worst = {f: max(rank[name][f] for rank in every) for f in ("out", "dx", "grads")}
        fb = [", ".join(f"{r['acc'].count(op, ph)} {op}" for op in ("all_reduce", "all_gather", "reduce_scatter")
                        if r["acc"].count(op, ph)) for ph in ("forward", "backward")]
        here = f"{r['local'][0]} / {r['local'][1]}" + (f", shared by {t // kv}" if t > kv else "")
        print(f"{name:16} {here:>18} {r['weights']:12d} {r['dense_weights']:8d}  {error_label(worst['out']):>6} "
              f"{error_label(worst['dx']):>6} {error_label(worst['grads']):>6}   {fb[0]} / {fb[1]}")
    for name, r in res.items():
        gathers = [rec for rec in r["acc"].records if rec.op in ("all_gather", "reduce_scatter")]
        if gathers and name.startswith("attention"):         # the block's are the same as its attention's
            kv = int(name.rpartition("=")[2])
            print(f"{name}: the all-gather and the reduce-scatter each of S = {gathers[0].bytes} bytes recorded = "
                  f"s·b·(a + 2·a_kv)·d × 4 = {a.s}·{a.b}·({a.heads} + 2·{kv})·{a.h // a.heads} × 4; "
                  f"ring model: each rank sends (t−1)/t·S = {gathers[0].sent:.0f}")
    for name, r in res.items():
        if r["wrong"] is not None:
            worst = max(rank[name]["wrong"] for rank in every)
            print(f"wrong: {name}, the gather's backward keeping each rank's own chunk → the q|k|v weight "
                  f"gradient is off by up to {worst:.2f}")
    print("\ngrouped-query checks passed on every rank")


def _gather(d, x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``x`` (same shape on each), in rank order."""
    out = [torch.empty_like(x) for _ in range(d.world_size)]
    dist.all_gather(out, x.contiguous(), group=d.group)
    return out


def _masks(tracker: RNGTracker, s, b, h, local_heads, p):
    """Replay the block's draws: 2 residual-stream masks from "default", the attention mask from "tensor-parallel"."""
    resid = torch.stack([dropout_mask((s, b, h), p, tracker["default"]) for _ in range(2)])     # (2, s, b, h)
    attn = dropout_mask((b, local_heads, s, s), p, tracker["tensor-parallel"])                  # (b, a/t, s, s)
    return resid, attn


def _drew_exactly(used: RNGTracker, replayed: RNGTracker) -> bool:
    return all(torch.equal(used[n].get_state(), replayed[n].get_state()) for n in ("default", "tensor-parallel"))


def dropout_checks(d, s, b, h, heads, p, seed) -> dict:
    """A block with dropout against its dense twin, with the masks placed as Megatron-LM places them."""
    dev, t, r = d.device, d.world_size, d.rank
    local = heads // t
    torch.manual_seed(0)
    x = torch.randn(s, b, h, device=dev)                     # (s, b, h), the same on every rank
    dy = torch.randn(s, b, h, device=dev)
    dense = Block(h, heads, dropout=p).to(dev)
    par = ParallelBlock.from_dense(dense, d.group)
    seed_dense_dropout(dense, seed, t)                       # head group q draws from rank q's generator
    tracker = model_parallel_seed(seed, r, dev)
    seed_dropout(par, tracker)
    res = check_module(d, dense, par, x, dy, tolerance(s, b, h, vocab=0))   # no vocabulary in a block

    # The masks this rank drew, replayed; and the dense block's, group by group.
    replay = model_parallel_seed(seed, r, dev)
    resid, attn = _masks(replay, s, b, h, local, p)
    dense_replay = [model_parallel_seed(seed, q, dev) for q in range(t)]
    dense_resid = torch.stack([dropout_mask((s, b, h), p, dense_replay[0]["default"]) for _ in range(2)])
    dense_attn = torch.cat([dropout_mask((b, local, s, s), p, tr["tensor-parallel"])
                            for tr in dense_replay], dim=1)                                    # (b, a, s, s)
    dense_drew = (torch.equal(dense.generator.get_state(), dense_replay[0]["default"].get_state())
                  and all(torch.equal(g.get_state(), tr["tensor-parallel"].get_state())
                          for g, tr in zip(dense.attn.generators, dense_replay)))
    every_resid = _gather(d, resid.to(torch.uint8))
    every_attn = _gather(d, attn.to(torch.uint8))
    res.update(
        resid_same=all(torch.equal(m, every_resid[0]) for m in every_resid),
        resid_dense=torch.equal(resid, dense_resid),
        attn_is_dense_slice=torch.equal(attn, dense_attn[:, r * local:(r + 1) * local]),
        attn_differ=all(not torch.equal(every_attn[i], every_attn[j]) for i in range(t) for j in range(i)),
        agree01=float((every_attn[0] == every_attn[-1]).float().mean()),    # ranks 0 and 1 (0 and 0 at t = 1)
        drew_exactly=_drew_exactly(tracker, replay) and dense_drew,
    )

    # Wrong 1: a different seed per rank on the residual stream. The copies drift apart.
    wrong = RNGTracker(dev)
    wrong.add("default", seed + 1 + r)
    wrong.add("tensor-parallel", seed + TP_SEED_OFFSET + r)
    seed_dropout(par, wrong)
    with torch.no_grad():
        y = par(x)                                           # (s, b, h)
    ys = _gather(d, y)
    res["diverge"] = max(float((yr - ys[0]).abs().max()) for yr in ys)
    # Wrong 2: one seed for the split attention on every rank. Every rank draws one mask.
    same = model_parallel_seed(seed, 0, dev)                 # rank 0's seeds, on every rank
    every_same = _gather(d, _masks(same, s, b, h, local, p)[1].to(torch.uint8))
    res["same_attn"] = all(torch.equal(m, every_same[0]) for m in every_same)
    return res


def parse_args(argv=None) -> argparse.Namespace:
    """The program's options (``argv``: the words after the program's name)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Long names first: after the program, torchrun still reads --s as an ambiguous abbreviation of its own
    # options (--standalone, --start-method …) and stops with an error; --s, --b, --h stay as aliases for runs
    # without torchrun.
    p.add_argument("--seq-len", "--s", dest="s", type=int, default=8, help="sequence length s")
    p.add_argument("--batch", "--b", dest="b", type=int, default=2, help="micro-batch b")
    p.add_argument("--hidden", "--h", dest="h", type=int, default=16, help="hidden size h")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--vocab", type=int, default=64, help="vocabulary size")
    p.add_argument("--kv-heads", type=int, nargs="*", default=[2, 1],
                   help="key/value heads of each grouped-query case (none: skip them)")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout probability of the second part (0: skip it)")
    p.add_argument("--seed", type=int, default=1234, help="the default dropout seed")
    return p.parse_args(argv)


@record
def main(argv=None) -> None:
    a = parse_args(argv)
    with distributed.setup() as d:
        check_degrees(d.world_size, h=a.h, heads=a.heads, ffn=4 * a.h, vocab=a.vocab)
        for kv in a.kv_heads:
            check_degrees(d.world_size, h=a.h, heads=a.heads, kv_heads=kv)
        res = block_checks(d, a.s, a.b, a.h, a.heads, a.vocab)
        mine = {k: {f: v[f] for f in ("out", "dx", "grads")} for k, v in res.items()}
        every = [None] * d.world_size
        dist.all_gather_object(every, mine)
        verify_counts(res["block"]["acc"], d.world_size, a.s * a.b * a.h)
        if d.is_main:
            report(d, a, res, every)
        if a.kv_heads:
            gqa = gqa_checks(d, a.s, a.b, a.h, a.heads, a.kv_heads, a.vocab)
            every = [None] * d.world_size
            dist.all_gather_object(every, {k: {f: v[f] for f in ("out", "dx", "grads", "wrong")} for k, v in gqa.items()})
            verify_gqa(every, gqa, d.world_size, a.s, a.b, a.h, a.heads)
            if d.is_main:
                report_gqa(d, a, gqa, every)
        if a.dropout > 0:
            drop = dropout_checks(d, a.s, a.b, a.h, a.heads, a.dropout, a.seed)
            every = [None] * d.world_size
            dist.all_gather_object(every, {k: v for k, v in drop.items() if k != "acc"})
            verify_dropout(every)
            if d.is_main:
                report_dropout(d, a, every)


def verify_dropout(every: list[dict]) -> None:
    """Megatron-LM's rules, held on every rank; and the two wrong seedings visibly wrong."""
    for r, res in enumerate(every):
        for key, want in (("resid_same", True), ("resid_dense", True), ("attn_is_dense_slice", True),
                          ("attn_differ", True), ("drew_exactly", True), ("same_attn", True)):
            if res[key] is not want:
                raise AssertionError(f"rank {r}: {key} is {res[key]}, expected {want}")
        if not res["diverge"] > 0:
            raise AssertionError(f"rank {r}: per-rank seeds on the residual stream left the copies equal")


def report_dropout(d, a, every) -> None:
    t, r0 = d.world_size, every[0]
    worst = {f: max(rank[f] for rank in every) for f in ("out", "dx", "grads")}
    print(f"\n{DROPOUT_HEADER}: p = {a.dropout}; seeds: 'default' {a.seed} on every rank, "
          f"'tensor-parallel' {a.seed} + {TP_SEED_OFFSET} + rank")
    print(f"block with dropout vs the dense block (head group r drawing from rank r's generator): "
          f"output {error_label(worst['out'])}, dX {error_label(worst['dx'])}, grads {error_label(worst['grads'])}")
    print(f"residual-stream masks, 2 × (s, b, h): identical on all {t} ranks: {r0['resid_same']}; "
          f"equal to the dense block's: {r0['resid_dense']}")
    print(f"attention masks, (b, a/t, s, s) = ({a.b}, {a.heads // t}, {a.s}, {a.s}): "
          f"rank r's = the dense mask's heads of group r on every rank: "
          f"{all(rank['attn_is_dense_slice'] for rank in every)}; any two ranks' equal: {not r0['attn_differ']}")
    if t > 1:
        print(f"ranks 0 and {t - 1} draw the same keep/drop decision at {r0['agree01']:.0%} of the attention "
              f"positions (two independent masks: p² + (1 − p)² = {a.dropout ** 2 + (1 - a.dropout) ** 2:.0%})")
    print(f"every generator advanced by exactly these draws: {all(rank['drew_exactly'] for rank in every)}")
    print(f"\nwrong: seed {a.seed} + 1 + rank on the residual stream → the ranks' copies of the block's output "
          f"differ by up to {max(rank['diverge'] for rank in every):.2f}")
    print(f"wrong: seed {a.seed} + {TP_SEED_OFFSET} on every rank for the attention → every rank draws the same "
          f"attention mask: {r0['same_attn']}")
    print("\ndropout checks passed on every rank")


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
    print(f"\nOne block's collectives on rank 0, next to Megatron's formula (S = s·b·h × {item} bytes = "
          f"{sbh} × {item} = {sbh * item} bytes):")
    # S is what the recorder saw the collective carry; the bytes sent are the ring model's 2(t−1)/t·S (gloo's
    # and NCCL's own messages inside a collective are not visible to it), so they are labelled as a model.
    print(f"{'phase':9} {'label':16} {'op':10} {'S recorded':>10} {'S formula':>9}   ring model: sent 2(t−1)/t·S")
    for rec in res["block"]["acc"].records:
        if rec.bytes != sbh * item:
            raise AssertionError(f"{rec.label}: the recorder saw S = {rec.bytes} bytes, Megatron's formula says {sbh * item}")
        print(f"{rec.phase:9} {rec.label:16} {rec.op:10} {rec.bytes:10d} {sbh * item:9d}   {rec.sent:.0f}")
    acc = res["tiny GPT (loss)"]["acc"]
    ce = [r for r in acc.records if r.label.startswith("ce")]
    gather = bus_factor("all_gather", t) * a.s * a.b * a.vocab * item
    print(f"\nTiny GPT, one step: {acc.count()} collectives, {acc.sent():.0f} bytes sent by rank 0 (ring model). "
          f"The cross-entropy's share: {len(ce)} all-reduces of s·b = {a.s * a.b} numbers, "
          f"{sum(r.sent for r in ce):.0f} bytes;\ngathering the (s, b, v) logits instead would send "
          f"{gather:.0f} bytes ({gather / sum(r.sent for r in ce):.0f}× more).")
    print("\nall checks passed on every rank (torch.testing.assert_close, float32 tolerances)")


if __name__ == "__main__":
    main()
