"""Check intralayer.sequence_parallel against the dense block, on real ranks.

Every rank builds the same dense GPT block (same seed) and the same input, runs the
dense block itself, and compares its own :class:`ParallelBlock` — tensor parallel alone
(TP), and TP + sequence parallel (SP) keeping its slice of each gathered input or the
gathered input itself — output, input gradient and every parameter gradient (after
``sync_grads``), for each of the dense block's recomputation choices. It also checks the
collectives each layout issues (``comm.accounting``), the bytes autograd saves on each
rank against :func:`intralayer.memory.activation_terms`, and that bad input raises a
``ValueError`` that names the rule.

Any mismatch raises, so the rank, and the launch, fail; when every check passed on every
rank, rank 0 prints ``MARKER`` followed by the number of ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
import torch.nn as nn

from intralayer import comm, distributed, memory, model
from intralayer.sequence_parallel import (ParallelBlock, SequenceParallelColumnLinear, SequenceParallelEmbedding,
                                          SequenceParallelGPT, SequenceParallelRowLinear, seed_dense_sequence_dropout,
                                          seed_sequence_parallel_dropout, sequence_dropout)
from intralayer.tensor_parallel import RNGTracker, expected_shards, model_parallel_seed
from tests.programs.checks import EXACT, expect, close, raises, dense_run

# Tolerances: shards are slices and recomputation repeats the same operations (EXACT);
# outputs and gradients against the dense block are float32 sums in another order, at
# assert_close's float32 defaults (checks.FLOAT32_REORDERED: longest reduction 4H = 64).

MARKER = "SP CHECKS PASSED on ranks:"
S, B, H, HEADS = 8, 2, 16, 4      # s, heads and h divisible by 2 and by 4
SBH = S * B * H
VOCAB, LAYERS, SEED, P_DROP = 64, 2, 1234, 0.1   # the GPT's vocabulary (divisible by 4), depth, dropout
LAYOUTS = [  # (sequence_parallel, keep_gathered)
    (False, False), (False, True), (True, False), (True, True),
]


def randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def piece_of(sp: bool, n: int, r: int):
    """This rank's input/output: its (s/t, b, h) slice under SP, the whole (s, b, h) otherwise."""
    return (lambda z: z.chunk(n, 0)[r]) if sp else (lambda z: z)


# ---------------------------------------------------------------------------- correctness + collectives

def check_layouts(n, r, group):
    """Every layout and recomputation choice against the dense block; collectives per layout."""
    x, up = randn(S, B, H, seed=1), randn(S, B, H, seed=2)
    reference = None
    for recompute in model.RECOMPUTE:
        torch.manual_seed(3)
        dense = model.Block(H, HEADS, recompute=recompute)
        yd, gxd = dense_run(dense, x, up)
        if reference is None:
            reference = (yd, gxd)
        else:   # dropout 0: recomputation changes nothing in the dense block either
            close(yd, reference[0], f"dense recompute={recompute}: output vs none", **EXACT)
            close(gxd, reference[1], f"dense recompute={recompute}: input grad vs none", **EXACT)
        sent = {}
        for sp, keep in LAYOUTS:
            what = f"recompute={recompute} sequence_parallel={sp} keep_gathered={keep}"
            par = ParallelBlock.from_dense(dense, group, sequence_parallel=sp, keep_gathered=keep)
            expect(par.recompute == recompute, f"{what}: recompute {par.recompute!r} not copied")
            params = dict(par.named_parameters())
            shards = expected_shards(par, dense)
            expect(set(shards) == set(params), f"{what}: names {sorted(params)} vs {sorted(shards)}")
            for name, want in shards.items():
                close(params[name].detach(), want, f"{what}: {name} shard", **EXACT)

            piece = piece_of(sp, n, r)
            xin = piece(x).clone().requires_grad_()
            with comm.accounting() as fwd:
                y = par(xin)
            expect(y.shape == piece(x).shape, f"{what}: output shape {tuple(y.shape)}")
            close(y.detach(), piece(yd), f"{what}: output")
            with comm.accounting() as bwd:
                y.backward(piece(up))
            close(xin.grad, piece(gxd), f"{what}: input grad")
            before = {name: p.grad.clone() for name, p in params.items()}
            with comm.accounting() as sync:
                par.sync_grads()
            grads = expected_shards(par, dense, grads=True)
            for name, want in grads.items():
                expect(params[name].grad is not None, f"{what}: {name} has no gradient")
                close(params[name].grad, want, f"{what}: {name} grad after sync_grads")
            check_sync(par, sync, before, sp, n, what)
            check_collectives(fwd, bwd, sp, keep, recompute, n, what)
            sent[(sp, keep)] = (fwd.sent(), bwd.sent())

        # An all-reduce is a reduce-scatter plus an all-gather: the same bytes forward.
        tp_fwd, tp_bwd = sent[(False, False)]
        expect(tp_fwd > 0 and tp_bwd > 0, f"recompute={recompute}: TP sent nothing")
        for keep in (False, True):
            sp_fwd, sp_bwd = sent[(True, keep)]
            expect(abs(sp_fwd - tp_fwd) < 1e-6, f"recompute={recompute} keep={keep}: SP forward sent {sp_fwd} "
                                                f"bytes, TP {tp_fwd}")
        if recompute != "full":
            expect(abs(sent[(True, True)][1] - tp_bwd) < 1e-6,
                   f"recompute={recompute}: SP (keep gathered) backward sent {sent[(True, True)][1]}, TP {tp_bwd}")
            expect(abs(sent[(True, False)][1] - 1.5 * tp_bwd) < 1e-6,
                   f"recompute={recompute}: SP backward sent {sent[(True, False)][1]}, want 1.5 × TP {tp_bwd}")


def check_sync(par, sync, before, sp, n, what):
    """One all-reduce of the replicated parameters' gradients under SP; nothing without."""
    names = {name for name, p in par.named_parameters()
             if any(p is q for q in par.replicated_parameters())}
    expect(names == {"ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias", "attn.proj.bias", "mlp.fc2.bias"},
           f"{what}: replicated parameters {sorted(names)}")
    if not sp:
        expect(sync.count() == 0, f"{what}: sync_grads communicated without sequence parallelism: {sync.records}")
        for name, p in par.named_parameters():
            expect(torch.equal(p.grad, before[name]), f"{what}: sync_grads changed {name} without SP")
        return
    expect(sync.count() == 1 and sync.count("all_reduce", "backward") == 1,
           f"{what}: sync_grads issued {sync.records}")
    rec = sync.records[0]
    expect(rec.elements == 4 * H + 2 * H, f"{what}: sync_grads all-reduced {rec.elements} elements, want {6 * H}")
    expect(rec.group_size == n, f"{what}: sync group size {rec.group_size}")
    for name, p in par.named_parameters():      # the sharded parameters are left alone
        if name not in names:
            expect(torch.equal(p.grad, before[name]), f"{what}: sync_grads changed the sharded {name}")


def check_collectives(fwd, bwd, sp, keep, recompute, n, what):
    for rec in fwd.records + bwd.records:
        expect(rec.group_size == n, f"{what}: {rec.label} on a group of {rec.group_size}")
        expect(rec.elements == SBH, f"{what}: {rec.op} {rec.label} moves {rec.elements} elements, want {SBH}")
        expect(rec.itemsize == 4, f"{what}: {rec.label} itemsize {rec.itemsize}")
    # Forward: what the block's forward call issues (phase "forward" throughout).
    if sp:
        want_fwd = {"all_gather": 2, "reduce_scatter": 2}
    else:
        want_fwd = {"all_reduce": 2}
    got_fwd = {op: fwd.count(op) for op in ("all_reduce", "all_gather", "reduce_scatter")}
    expect(got_fwd == {**dict.fromkeys(got_fwd, 0), **want_fwd}, f"{what}: forward collectives {got_fwd}")
    expect(fwd.count(phase="forward") == len(fwd.records), f"{what}: forward records {fwd.records}")
    if recompute == "full":     # backward runs the forward again, its collectives included
        expect(bwd.count(phase="forward") == sum(want_fwd.values()),
               f"{what}: full recomputation re-ran {bwd.count(phase='forward')} forward collectives")
    else:
        expect(bwd.count(phase="forward") == 0, f"{what}: forward collectives during backward: {bwd.records}")
    if sp:
        want_bwd = {"all_gather": 2 if keep else 4, "reduce_scatter": 2}
    else:
        want_bwd = {"all_reduce": 2}
    got_bwd = {op: bwd.count(op, "backward") for op in ("all_reduce", "all_gather", "reduce_scatter")}
    expect(got_bwd == {**dict.fromkeys(got_bwd, 0), **want_bwd}, f"{what}: backward collectives {got_bwd}")
    t = n
    ring = (t - 1) / t * SBH * 4
    expect(abs(fwd.sent() - 4 * ring) < 1e-6, f"{what}: forward sent {fwd.sent()} bytes, want {4 * ring}")


# ---------------------------------------------------------------------------- memory

def check_memory(n, r, group):
    """Bytes autograd keeps for one block on this rank = the adjusted formula (float32, dropout 0.1).

    With and without keep_gathered; the difference is also checked by hand.
    """
    for sp in (False, True):
        for recompute in ("none", "selective", "full"):
            measured = {}
            for keep in (False, True):
                what = f"memory sp={sp} recompute={recompute} keep_gathered={keep}"
                torch.manual_seed(4)
                dense = model.Block(H, HEADS, dropout=0.1, fused=False, recompute=recompute)
                par = ParallelBlock.from_dense(dense, group, sequence_parallel=sp, keep_gathered=keep)
                x = randn(S // n if sp else S, B, H, seed=5).requires_grad_()
                with memory.saved_bytes(exclude=par.parameters()) as report:
                    y = par(x)
                y.sum().backward()                  # the saved tensors must do their job
                measured[keep] = report.total
                expect(x.grad is not None and bool(torch.isfinite(x.grad).all()), f"{what}: input grad")
            for keep in (False, True):
                want = sum(memory.activation_terms(S, B, H, HEADS, t=n, sp=sp, recompute=recompute, itemsize=4,
                                                   ln_stats=recompute != "full", stats_bytes=4,
                                                   keep_gathered=keep and sp).values())
                expect(measured[keep] == want, f"rank {r}, sp={sp} recompute={recompute} keep_gathered={keep}: "
                                               f"measured {measured[keep]} bytes, the formula says {want}")
            # keep_gathered keeps the gathered (s, b, h) inputs of q|k|v and fc1 instead of
            # this rank's (s/t, b, h) slices: 2 · (t−1)/t · s·b·h numbers more.
            extra = 2 * (n - 1) * SBH // n * 4 if sp and recompute != "full" else 0
            expect(measured[True] - measured[False] == extra,
                   f"rank {r}, sp={sp} recompute={recompute}: keep_gathered keeps "
                   f"{measured[True] - measured[False]} bytes more, want {extra}")


# ---------------------------------------------------------------------------- the whole model

def gpt_draws(tracker: RNGTracker, n: int) -> None:
    """Replay, from ``tracker``, every mask one forward pass of the SP GPT draws on this rank.

    The embedding's (s/t, b, h); per block the attention's (b, a/t, s, s), then the two
    residual-stream masks (s/t, b, h) — all from the tensor-parallel generator.
    """
    g = tracker["tensor-parallel"]
    model.dropout_mask((S // n, B, H), P_DROP, g)
    for _ in range(LAYERS):
        model.dropout_mask((B, HEADS // n, S, S), P_DROP, g)
        model.dropout_mask((S // n, B, H), P_DROP, g)
        model.dropout_mask((S // n, B, H), P_DROP, g)


def dense_gpt(p: float, n: int) -> model.TinyGPT:
    """The dense twin: block 0 keeps its activations, block 1 recomputes in full (generators rewound)."""
    torch.manual_seed(41)
    dense = model.TinyGPT(VOCAB, H, HEADS, layers=LAYERS)
    dense.blocks[1].recompute = "full"
    if p:
        seed_dense_sequence_dropout(dense, SEED, n, p)
    return dense


def check_gpt(n, r, group):
    """A TinyGPT with TP + SP from the embedding to the loss, against the dense model.

    Entering: the vocabulary-parallel lookup's partial sums are reduce-scattered along the
    sequence (no all-reduce); leaving: the LM head all-gathers the final LayerNorm's
    ``s/t`` tokens; the loss is the vocabulary-parallel cross-entropy. Dropout 0 and 0.1,
    the latter seeded as Megatron-LM seeds it under SP and replayed in the dense model.
    """
    g = torch.Generator().manual_seed(40)
    ids = torch.randint(0, VOCAB, (S, B), generator=g)
    targets = torch.randint(0, VOCAB, (S, B), generator=g)
    for p in (0.0, P_DROP):
        what = f"SP GPT dropout={p} on {n} ranks"
        dense = dense_gpt(p, n)
        par = SequenceParallelGPT.from_dense(dense, group, dropout=p)
        expect([b.recompute for b in par.blocks] == ["none", "full"], f"{what}: recompute not copied")
        tracker = model_parallel_seed(SEED, r)
        if p:
            seed_sequence_parallel_dropout(par, tracker)
        params = dict(par.named_parameters())
        shards = expected_shards(par, dense)
        expect(set(shards) == set(params), f"{what}: names {sorted(params)} vs {sorted(shards)}")
        for name, want in shards.items():
            close(params[name].detach(), want, f"{what}: {name} shard", **EXACT)
        if not p:
            with torch.no_grad():
                close(par(ids), dense(ids).chunk(n, -1)[r], f"{what}: logits, this rank's vocabulary slice")

        with comm.accounting() as fwd:
            loss_p = par.loss(ids, targets)
        loss_d = dense.loss(ids, targets)
        close(loss_p.detach(), loss_d.detach(), f"{what}: loss")
        with comm.accounting() as bwd:
            loss_p.backward()
        loss_d.backward()
        par.sync_grads()
        for name, want in expected_shards(par, dense, grads=True).items():
            expect(params[name].grad is not None, f"{what}: {name} has no gradient")
            close(params[name].grad, want, f"{what}: {name} grad")
        if p:   # the generator advanced by exactly one forward's masks (block 1's recomputation rewound it)
            replay = model_parallel_seed(SEED, r)
            gpt_draws(replay, n)
            expect(torch.equal(tracker["tensor-parallel"].get_state(), replay["tensor-parallel"].get_state()),
                   f"{what}: the tensor-parallel generator drew more or less than one forward's masks")
            expect(torch.equal(tracker["default"].get_state(), model_parallel_seed(SEED, r)["default"].get_state()),
                   f"{what}: a mask was drawn from the default generator, which every rank shares")
        check_gpt_collectives(fwd, bwd, n, what)


def check_gpt_collectives(fwd, bwd, n, what):
    """The edges' collectives: reduce-scatter in, all-gather out, three per-token all-reduces for the loss."""
    layers_fwd = {"all_gather": 2 * LAYERS, "reduce_scatter": 2 * LAYERS}
    want_fwd = {"all_gather": layers_fwd["all_gather"] + 1 + 2,          # + the head's, + block 1 re-run (full)
                "reduce_scatter": layers_fwd["reduce_scatter"] + 1 + 2,  # + the embedding's, + block 1 re-run
                "all_reduce": 3}                                         # the loss: max, sum-exp, target logit
    got = {op: fwd.count(op) + bwd.count(op, "forward") for op in want_fwd}
    expect(got == want_fwd, f"{what}: forward collectives (with block 1's recomputation) {got}, want {want_fwd}")
    embed = [rec for rec in fwd.records if rec.label == "embed reduce-scatter"]
    expect(len(embed) == 1 and embed[0].op == "reduce_scatter" and embed[0].elements == SBH,
           f"{what}: the embedding's collective {embed}: want one reduce-scatter of s·b·h = {SBH} numbers")
    head = [rec for rec in fwd.records if rec.label == "head all-gather"]
    expect(len(head) == 1 and head[0].elements == SBH,
           f"{what}: the LM head's gather {head}: want one all-gather of s·b·h = {SBH} numbers")
    loss = fwd.select("all_reduce")
    expect(all(rec.elements == S * B for rec in loss), f"{what}: the loss's all-reduces {loss}: one number per token")
    # Backward: the embedding's reduce-scatter turns into an all-gather; the head's gather into a
    # reduce-scatter (and, its input kept sliced, a re-gather); the loss sends nothing.
    back = [rec for rec in bwd.select(phase="backward") if rec.label.startswith(("embed", "head"))]
    expect(sorted((rec.label, rec.op) for rec in back) ==
           [("embed reduce-scatter", "all_gather"), ("head re-gather", "all_gather"),
            ("head reduce-scatter", "reduce_scatter")], f"{what}: the edges' backward collectives {back}")
    expect(bwd.count("all_reduce", "backward") == 0, f"{what}: all-reduces in backward: {bwd.select('all_reduce')}")


def check_gpt_dropout_seeds(n, r, group):
    """Why each rank needs its own seed under SP: a shared one repeats the same mask on every chunk."""
    mask = lambda tracker: model.dropout_mask((S // n, B, H), P_DROP, tracker["tensor-parallel"]).to(torch.uint8)
    own = gather(mask(model_parallel_seed(SEED, r)), group)          # Megatron's: seed + 2718 + rank
    shared = gather(mask(model_parallel_seed(SEED, 0)), group)       # wrong: rank 0's seed on every rank
    expect(all(not torch.equal(own[i], own[j]) for i in range(n) for j in range(i)),
           "two ranks' chunks drew the same embedding-dropout mask from their own seeds")
    expect(all(torch.equal(m, shared[0]) for m in shared), "one shared seed did not repeat the mask on every chunk")
    # The dense view of the seeded masks is sequence_dropout's: chunk r from rank r's generator.
    x = torch.ones(S, B, H)
    dense_mask = sequence_dropout(x, P_DROP, [model_parallel_seed(SEED, q)["tensor-parallel"] for q in range(n)]) > 0
    expect(torch.equal(dense_mask.chunk(n, 0)[r].to(torch.uint8), own[r]), "sequence_dropout: chunk r is not rank r's")

    # A model seeded the shared way runs, and is wrong: its loss is not the dense model's.
    g = torch.Generator().manual_seed(40)
    ids, targets = torch.randint(0, VOCAB, (S, B), generator=g), torch.randint(0, VOCAB, (S, B), generator=g)
    dense = dense_gpt(P_DROP, n)
    wrong = SequenceParallelGPT.from_dense(dense, group, dropout=P_DROP)
    seed_sequence_parallel_dropout(wrong, model_parallel_seed(SEED, 0))
    with torch.no_grad():
        gap = float((wrong.loss(ids, targets) - dense.loss(ids, targets)).abs())
    expect(gap > 1e-4, f"one seed shared by the ranks gave the dense model's loss (difference {gap:.2g})")

    # Bad input at the edges.
    emb = SequenceParallelEmbedding.from_dense(dense.embed, group)
    raises(lambda: emb(torch.zeros(S * B, dtype=torch.long)), "(s, b)", what="SP embedding: 1-D ids")
    raises(lambda: emb(torch.zeros(S + 1, B, dtype=torch.long)), f"sequence length s={S + 1}",
           f"tensor-parallel degree t={n}", what="SP embedding: s not divisible by t")
    raises(lambda: emb(torch.full((S, B), VOCAB, dtype=torch.long)), f"[0, {VOCAB})", what="SP embedding: id = v")
    raises(lambda: emb(torch.zeros(S, B)), "integer token ids", what="SP embedding: float ids")
    raises(lambda: SequenceParallelGPT.from_dense(dense.blocks[0], group), "TinyGPT", "Block",
           what="SP GPT from a block")
    raises(lambda: SequenceParallelGPT.from_dense(dense, group, dropout=1.0), "[0, 1)", what="SP GPT dropout 1")
    raises(lambda: seed_sequence_parallel_dropout(wrong, {"tensor-parallel": torch.Generator()}), "RNGTracker",
           what="seed_sequence_parallel_dropout with a dict")
    raises(lambda: seed_dense_sequence_dropout(dense, SEED, n, P_DROP), "seeded already",
           what="seeding the dense twin twice")


def gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x.contiguous(), group=group)
    return out


# ---------------------------------------------------------------------------- bad input

def check_bad_input(n, r, group):
    torch.manual_seed(6)
    dense = model.Block(H, HEADS)
    block = ParallelBlock.from_dense(dense, group, sequence_parallel=True)
    rows = S // n

    raises(lambda: block(randn(rows, B, H + 1, seed=7)), "ParallelBlock", f"last of size {H}",
           f"{(rows, B, H + 1)}", what="SP block: wrong hidden size")
    raises(lambda: block(randn(rows * B, H, seed=7)), "ParallelBlock", "3 dimensions", what="SP block: 2-D input")
    raises(lambda: block(randn(rows, B, H, seed=7, dtype=torch.float64)), "torch.float64", "torch.float32",
           what="SP block: float64 input into float32 weights")
    raises(lambda: block(randn(rows, B, H, seed=7, dtype=torch.bfloat16)), "torch.bfloat16", "torch.float32",
           what="SP block: bfloat16 input into float32 weights")
    raises(lambda: block(torch.ones(rows, B, H, dtype=torch.long)), "floating-point", "torch.int64",
           what="SP block: integer input")
    raises(lambda: block.sync_grads(), "no gradients yet", what="sync_grads before any backward")

    # The layers alone.
    col = SequenceParallelColumnLinear.from_dense(nn.Linear(H, 2 * H), group, label="col")
    row = SequenceParallelRowLinear.from_dense(nn.Linear(2 * H, H), group, label="row")
    raises(lambda: col(randn(rows, B, H + 1, seed=8)), "SequenceParallelColumnLinear", f"last of size {H}",
           what="SP column: wrong width")
    raises(lambda: col(randn(rows * B, H, seed=8)), "SequenceParallelColumnLinear", "3 dimensions",
           what="SP column: 2-D input (the sequence must be dimension 0 of (s/t, b, h))")
    raises(lambda: col(randn(rows, B, H, seed=8, dtype=torch.float64)), "torch.float64", "torch.float32",
           what="SP column: float64 input")
    raises(lambda: row(randn(S, B, 2 * H, seed=9)), "SequenceParallelRowLinear", f"last of size {2 * H // n}",
           what="SP row: the full width where this rank's slice is expected")
    raises(lambda: row(randn(S, B, 2 * H // n, seed=9, dtype=torch.float64)), "torch.float64", "torch.float32",
           what="SP row: float64 input")
    # A row layer's reduce-scatter splits dimension 0 (the sequence) t ways: a length
    # that does not divide is refused before any rank communicates.
    raises(lambda: row(randn(S + 1, B, 2 * H // n, seed=9)), "reduce_scatter", f"size {S + 1}",
           f"group size {n}", what="SP row: a sequence not divisible by t")

    # Rules checked at construction.
    raises(lambda: ParallelBlock.from_dense(model.Block(12, 3), group, sequence_parallel=True),
           f"number of heads 3 is not divisible by the tensor-parallel degree t={n}", what="SP block: 3 heads")
    raises(lambda: ParallelBlock.from_dense(model.Block(H, HEADS, ffn=17), group, sequence_parallel=True),
           f"MLP width 17 is not divisible by the tensor-parallel degree t={n}", what="SP block: ffn 17")

    # Every rank holding s/t + 1 tokens is no error: the block then runs on a sequence of
    # t·(s/t + 1) tokens, each rank's reduce-scatter splits t·(s/t + 1) rows evenly, and
    # the result is that longer sequence's dense output, sliced.
    longer = n * (rows + 1)
    x = randn(longer, B, H, seed=10)
    with torch.no_grad():
        want = dense(x).chunk(n, 0)[r]
        got = block(x.chunk(n, 0)[r])
    expect(got.shape == (rows + 1, B, H), f"SP block on s/t + 1 tokens: shape {tuple(got.shape)}")
    close(got, want, "SP block on s/t + 1 tokens per rank vs the dense block on the longer sequence")


#: Every check, in the order main runs them; each is also a test item of its own (tests.programs.checks.run_check).
CHECKS = (check_layouts, check_memory, check_gpt, check_gpt_dropout_seeds, check_bad_input)


@record
def main(argv=None) -> None:
    with distributed.setup() as d:
        n, r, group = d.world_size, d.rank, d.group
        for check in CHECKS:
            check(n, r, group)
        dist.barrier()
        if d.is_main:
            print(f"{MARKER} {n}")


if __name__ == "__main__":
    main()
