"""Check every intralayer.tensor_parallel module against its dense twin, on real ranks.

Every rank builds the same dense module (same seed) and the same inputs, runs the dense
module itself, and compares its own shard of the parallel module — outputs, input
gradients and parameter gradients — with the matching piece of the dense run. The
expected pieces are cut here by hand (rows or columns of ``nn.Linear``'s weight) for the
linear layers, and with ``expected_shards`` for the composite modules. It also checks
the collectives each module issues (``comm.accounting``) and that bad input raises a
``ValueError`` that names the rule. With dropout on, the block's masks are placed as
Megatron-LM places them (same seed where activations are replicated, a seed per rank in
the split attention) and the block must still equal its dense twin, with and without
recomputation. Grouped-query attention (``check_grouped_query``) runs with the key/value
heads split (t ≤ a_kv) and shared (t > a_kv, multi-query included), with its collectives
counted; a version whose all-gather keeps only its own chunk of the gradient, as if every
rank's copy of a shared head had the same gradient, must fail the same comparison.

Any mismatch raises, so the rank, and the launch, fail; when every check passed on
every rank, rank 0 prints ``MARKER`` followed by the number of ranks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
import torch.nn as nn
import torch.nn.functional as F

from intralayer import comm, distributed, model
from intralayer.sequence_parallel import ParallelBlock as SequenceParallelBlock
from intralayer.tensor_parallel import (TP_SEED_OFFSET, ColumnParallelLinear, ParallelAttention, ParallelBlock,
                                        ParallelGPT, ParallelMLP, QKVParallelLinear, RNGTracker, RowParallelLinear,
                                        VocabParallelEmbedding, expected_shards, model_parallel_seed,
                                        seed_dense_dropout, seed_dropout, vocab_parallel_cross_entropy,
                                        weights_per_device)
from tests.programs.checks import EXACT, expect, close, raises, dense_run

# Tolerances: shards of dense weights are slices (EXACT); outputs and gradients against the
# dense twin are float32 sums in another order, at assert_close's float32 defaults
# (checks.FLOAT32_REORDERED: longest reduction 4H = 64 terms here, errors ~√n·u).

MARKER = "TP CHECKS PASSED on ranks:"
S, B, H, HEADS, VOCAB = 4, 2, 16, 4, 32     # every split size divisible by 2 and 4
WIDE = 24                                   # a linear layer's other side, ≠ H to catch transposes


def randn(*shape, seed: int) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- linear layers

def check_column(n, r, group):
    for shape in ((S * B, H), (S, B, H)):
        for bias in (True, False):
            for gather in (False, True):
                what = f"column {len(shape)}-D bias={bias} gather_output={gather}"
                torch.manual_seed(1)
                dense = nn.Linear(H, WIDE, bias=bias)
                x = randn(*shape, seed=2)
                up = randn(*shape[:-1], WIDE, seed=3)
                yd, gxd = dense_run(dense, x, up)

                par = ColumnParallelLinear.from_dense(dense, group, gather_output=gather)
                close(par.weight.detach(), dense.weight.detach().chunk(n, 0)[r], f"{what}: weight shard", **EXACT)
                if bias:
                    close(par.bias.detach(), dense.bias.detach().chunk(n, 0)[r], f"{what}: bias shard", **EXACT)
                else:
                    expect(par.bias is None, f"{what}: a bias appeared")
                expect(weights_per_device(par) * n == sum(p.numel() for p in dense.parameters()),
                       f"{what}: {weights_per_device(par)} weights per device")

                xp = x.clone().requires_grad_()
                yp = par(xp)
                if gather:
                    close(yp.detach(), yd, f"{what}: gathered output")
                    yp.backward(up)
                else:
                    expect(yp.shape == (*shape[:-1], WIDE // n), f"{what}: output shape {tuple(yp.shape)}")
                    close(yp.detach(), yd.chunk(n, -1)[r], f"{what}: output slice")
                    yp.backward(up.chunk(n, -1)[r])
                close(par.weight.grad, dense.weight.grad.chunk(n, 0)[r], f"{what}: weight grad")
                if bias:
                    close(par.bias.grad, dense.bias.grad.chunk(n, 0)[r], f"{what}: bias grad")
                close(xp.grad, gxd, f"{what}: input grad")


def check_row(n, r, group):
    for shape in ((S * B, WIDE), (S, B, WIDE)):
        for bias in (True, False):
            for parallel_in in (True, False):
                what = f"row {len(shape)}-D bias={bias} input_is_parallel={parallel_in}"
                torch.manual_seed(4)
                dense = nn.Linear(WIDE, H, bias=bias)
                x = randn(*shape, seed=5)
                up = randn(*shape[:-1], H, seed=6)
                yd, gxd = dense_run(dense, x, up)

                par = RowParallelLinear.from_dense(dense, group, input_is_parallel=parallel_in)
                close(par.weight.detach(), dense.weight.detach().chunk(n, 1)[r], f"{what}: weight shard", **EXACT)
                if bias:
                    close(par.bias.detach(), dense.bias.detach(), f"{what}: replicated bias", **EXACT)

                xp = (x.chunk(n, -1)[r] if parallel_in else x).clone().requires_grad_()
                yp = par(xp)
                close(yp.detach(), yd, f"{what}: output")
                yp.backward(up)
                close(par.weight.grad, dense.weight.grad.chunk(n, 1)[r], f"{what}: weight grad")
                if bias:   # added once, after the sum: the FULL dense bias gradient, not 1/n or n×
                    close(par.bias.grad, dense.bias.grad, f"{what}: bias grad")
                close(xp.grad, gxd.chunk(n, -1)[r] if parallel_in else gxd, f"{what}: input grad")


# ---------------------------------------------------------------------------- composite modules

def check_against_dense(par, dense, x, up, what, input_grad=True):
    """Weights, output, input grad and every parameter grad of ``par`` vs ``dense``."""
    params = dict(par.named_parameters())
    shards = expected_shards(par, dense)
    expect(set(shards) == set(params), f"{what}: names {sorted(params)} vs {sorted(shards)}")
    for name, want in shards.items():
        close(params[name].detach(), want, f"{what}: {name} shard", **EXACT)

    yd, gxd = dense_run(dense, x, up)
    xp = x.clone().requires_grad_() if input_grad else x
    yp = par(xp)
    close(yp.detach(), yd, f"{what}: output")
    yp.backward(up)
    if input_grad:
        close(xp.grad, gxd, f"{what}: input grad")
    grads = expected_shards(par, dense, grads=True)
    for name, want in grads.items():
        expect(params[name].grad is not None, f"{what}: {name} has no gradient")
        close(params[name].grad, want, f"{what}: {name} grad")


class DenseMLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` from two given ``nn.Linear`` (names as ParallelMLP's)."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


def check_mlp(n, r, group):
    torch.manual_seed(7)
    dense = model.MLP(H)                                            # ffn = 4h
    x = randn(S, B, H, seed=8)
    with torch.no_grad():                                           # the dense twin is the formula
        close(dense(x), dense.fc2(F.gelu(dense.fc1(x))), "mlp: dense twin vs fc2(gelu(fc1(x)))", **EXACT)
    par = ParallelMLP.from_dense(dense.fc1, dense.fc2, group)
    fc2_bias = H
    expect(weights_per_device(par) == (sum(p.numel() for p in dense.parameters()) - fc2_bias) // n + fc2_bias,
           f"mlp: {weights_per_device(par)} weights per device")
    check_against_dense(par, dense, x, randn(S, B, H, seed=9), "mlp")
    # The same through plain nn.Linear twins (what from_dense takes), without biases.
    torch.manual_seed(10)
    fc1, fc2 = nn.Linear(H, 4 * H, bias=False), nn.Linear(4 * H, H, bias=False)
    check_against_dense(ParallelMLP.from_dense(fc1, fc2, group), DenseMLP(fc1, fc2), x, randn(S, B, H, seed=11),
                        "mlp without biases")


def check_attention_block_gpt(n, r, group):
    for causal in (True, False):
        torch.manual_seed(12)
        dense = model.Attention(H, HEADS, causal=causal)
        par = ParallelAttention.from_dense(dense, group)
        expect(par.heads == HEADS // n, f"attention: {par.heads} local heads")
        check_against_dense(par, dense, randn(S, B, H, seed=13), randn(S, B, H, seed=14),
                            f"attention causal={causal}")

    torch.manual_seed(15)
    dense = model.Block(H, HEADS)
    check_against_dense(ParallelBlock.from_dense(dense, group), dense, randn(S, B, H, seed=16),
                        randn(S, B, H, seed=17), "block")

    torch.manual_seed(18)
    dense = model.TinyGPT(VOCAB, H, HEADS, layers=2)
    par = ParallelGPT.from_dense(dense, group)
    g = torch.Generator().manual_seed(19)
    ids = torch.randint(0, VOCAB, (S, B), generator=g)
    targets = torch.randint(0, VOCAB, (S, B), generator=g)
    params = dict(par.named_parameters())
    shards = expected_shards(par, dense)
    expect(set(shards) == set(params), f"gpt: names {sorted(params)} vs {sorted(shards)}")
    for name, want in shards.items():
        close(params[name].detach(), want, f"gpt: {name} shard", **EXACT)
    with torch.no_grad():
        close(par(ids), dense(ids).chunk(n, -1)[r], "gpt: logits slice")
    loss_d = dense.loss(ids, targets)
    loss_d.backward()
    loss_p = par.loss(ids, targets)
    close(loss_p.detach(), loss_d.detach(), "gpt: loss")
    loss_p.backward()
    for name, want in expected_shards(par, dense, grads=True).items():
        expect(params[name].grad is not None, f"gpt: {name} has no gradient")
        close(params[name].grad, want, f"gpt: {name} grad")

    # The embedding alone, ids from every rank's slice.
    emb = VocabParallelEmbedding.from_dense(dense.embed, group)
    with torch.no_grad():
        close(emb(ids), dense.embed(ids), "embedding: output", **EXACT)


# ---------------------------------------------------------------------------- grouped-query attention

#: (query heads, key/value heads) with H = 16: on 2 ranks the heads are split for a_kv ∈ {2, 4}
#: and shared for a_kv = 1; on 4 ranks split for a_kv = 4 and shared for a_kv ∈ {1, 2}.
GQA = ((4, 1), (4, 2), (8, 4), (8, 2))


class SplitBackwardAttention(ParallelAttention):
    """Wrong on purpose: gathers the projection with Megatron's *gather* (backward: keep this rank's chunk).

    That backward is right when every rank then uses the gathered tensor identically; here each
    rank uses only its group and its own queries, so a shared key/value head's gradient from the
    other ranks sharing it is lost.
    """

    def gather_qkv(self, mixed):
        return comm.gather_from_group(mixed, -1, self.qkv.group, "wrong gather")


def check_grouped_query(n, r, group):
    for heads, kv in GQA:
        for causal in (True, False):
            what = f"GQA heads={heads} kv_heads={kv} causal={causal} on {n} ranks"
            torch.manual_seed(40 + heads + kv)
            dense = model.Attention(H, heads, causal=causal, kv_heads=kv)
            expect(dense.qkv.out_features == H + 2 * kv * H // heads, f"{what}: dense q|k|v width")
            par = ParallelAttention.from_dense(dense, group)
            expect(isinstance(par.qkv, QKVParallelLinear), f"{what}: {type(par.qkv).__name__}")
            expect(par.heads == heads // n and par.kv_heads == max(kv // n, 1),
                   f"{what}: {par.heads} query heads and {par.kv_heads} key/value heads here")
            expect(weights_per_device(par) == (sum(p.numel() for p in dense.parameters()) - H) // n + H,
                   f"{what}: {weights_per_device(par)} weights per device, not 1/{n} (+ the proj bias)")
            x, up = randn(S, B, H, seed=41), randn(S, B, H, seed=42)
            with comm.accounting() as acc:
                check_against_dense(par, dense, x, up, what)
            width = H + 2 * kv * H // heads
            want = {("forward", "all_reduce"): 1, ("backward", "all_reduce"): 1}
            if n > kv:                                  # shared heads: gather forward, reduce-scatter backward
                want |= {("forward", "all_gather"): 1, ("backward", "reduce_scatter"): 1}
                for rec in acc.records:
                    if rec.op in ("all_gather", "reduce_scatter"):
                        expect(rec.elements == S * B * width,
                               f"{what}: {rec.op} of {rec.elements} elements, want s·b·(a + 2a_kv)·d = {S * B * width}")
            got = {(rec.phase, rec.op): 0 for rec in acc.records}
            for rec in acc.records:
                got[rec.phase, rec.op] += 1
            expect(got == want, f"{what}: collectives {got}, want {want}")
            if n > kv:                                  # the check must catch a lost shared-head gradient
                torch.manual_seed(40 + heads + kv)
                fresh = model.Attention(H, heads, causal=causal, kv_heads=kv)     # the same weights, no gradients yet
                wrong = SplitBackwardAttention.from_dense(fresh, group)
                try:
                    check_against_dense(wrong, fresh, x, up, f"{what} (wrong backward)")
                except AssertionError as err:
                    expect("grad" in str(err), f"{what}: the wrong backward failed, but not on a gradient: {err}")
                else:
                    raise AssertionError(f"{what}: a gather whose backward keeps one chunk passed the gradient checks")

    # Megatron's layout also carries multi-head attention (a_kv = a: q0 k0 v0 | q1 k1 v1 …).
    torch.manual_seed(50)
    dense = model.Attention(H, HEADS)
    proj = ParallelAttention.from_dense(dense, group).proj
    mha = ParallelAttention(QKVParallelLinear.from_dense(dense.qkv, group, HEADS, HEADS, label="attn.qkv"),
                            proj, HEADS // n, dense)
    check_against_dense(mha, dense, randn(S, B, H, seed=51), randn(S, B, H, seed=52), "MHA in the per-group layout")

    # A block and a tiny GPT with grouped-query attention; a block with dropout and recomputation.
    torch.manual_seed(53)
    dense = model.Block(H, 8, kv_heads=2)
    check_against_dense(ParallelBlock.from_dense(dense, group), dense, randn(S, B, H, seed=54),
                        randn(S, B, H, seed=55), "GQA block")
    torch.manual_seed(56)
    dense = model.TinyGPT(VOCAB, H, HEADS, layers=2, kv_heads=1)
    par = ParallelGPT.from_dense(dense, group)
    ids = torch.randint(0, VOCAB, (S, B), generator=torch.Generator().manual_seed(57))
    loss_d = dense.loss(ids, ids.roll(1, 0))
    loss_d.backward()
    loss_p = par.loss(ids, ids.roll(1, 0))
    close(loss_p.detach(), loss_d.detach(), "MQA gpt: loss")
    loss_p.backward()
    params = dict(par.named_parameters())
    for name, want in expected_shards(par, dense, grads=True).items():
        close(params[name].grad, want, f"MQA gpt: {name} grad")
    for recompute in ("selective", "full"):
        torch.manual_seed(58)
        dense = model.Block(H, HEADS, dropout=P_DROP, recompute=recompute, kv_heads=2)
        par = ParallelBlock.from_dense(dense, group)
        seed_dense_dropout(dense, SEED, n)
        seed_dropout(par, model_parallel_seed(SEED, r))
        check_against_dense(par, dense, randn(S, B, H, seed=59), randn(S, B, H, seed=60),
                            f"GQA block, dropout, recompute={recompute}")

    # Layouts that cannot carry grouped-query attention, and degrees Megatron-Core refuses.
    gqa = model.Attention(H, HEADS, kv_heads=2)
    raises(lambda: ParallelAttention(ColumnParallelLinear.from_dense(gqa.qkv, group), proj, HEADS // n, gqa),
           "per-group layout", "QKVParallelLinear", "ColumnParallelLinear", what="GQA with a plain column split")
    if n == 4:
        raises(lambda: ParallelAttention.from_dense(model.Attention(24, 12, kv_heads=6), group),
               "key/value heads 6 is neither a multiple nor a divisor", "t=4", what="6 key/value heads on 4 ranks")
        raises(lambda: ParallelBlock.from_dense(model.Block(12, 4, kv_heads=1), group),
               "fused q|k|v width", "= 18", "t=4", what="MQA block whose fused width 18 does not split 4 ways")


# ---------------------------------------------------------------------------- vocabulary cross-entropy

def check_cross_entropy(n, r, group):
    v_local = VOCAB // n
    g = torch.Generator().manual_seed(20)
    cases = [
        ("targets all on the last rank", 0.0, (n - 1) * v_local, VOCAB),
        ("targets all on rank 0", 0.0, 0, v_local),
        ("targets anywhere", 0.0, 0, VOCAB),
        ("targets all on the last rank, logits +1000", 1000.0, (n - 1) * v_local, VOCAB),
        ("targets anywhere, logits +1000", 1000.0, 0, VOCAB),
    ]
    for what, offset, lo, hi in cases:
        logits = torch.randn(S, B, VOCAB, generator=g) * 3 + offset
        targets = torch.randint(lo, hi, (S, B), generator=g)
        up = torch.rand(S, B, generator=g) + 0.5                    # per-token upstream weights

        full = logits.clone().requires_grad_()
        dense = F.cross_entropy(full.flatten(0, 1), targets.flatten(), reduction="none").view(S, B)
        dense.backward(up)

        mine = logits.chunk(n, -1)[r].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(mine, targets, group)
        expect(loss.shape == (S, B), f"cross-entropy {what}: loss shape {tuple(loss.shape)}")
        expect(bool(torch.isfinite(loss).all()), f"cross-entropy {what}: loss not finite: {loss}")
        # The loss is log Σ e^(z−M) − (z_y − M): float32 tolerances hold even at a +1000 offset.
        close(loss.detach(), dense.detach(), f"cross-entropy {what}: loss")
        loss.backward(up)
        expect(bool(torch.isfinite(mine.grad).all()), f"cross-entropy {what}: gradient not finite")
        close(mine.grad, full.grad.chunk(n, -1)[r], f"cross-entropy {what}: logits grad")


# ---------------------------------------------------------------------------- accounting

def check_accounting(n, r, group):
    torch.manual_seed(21)
    block = ParallelBlock.from_dense(model.Block(H, HEADS), group)
    x = randn(S, B, H, seed=22).requires_grad_()
    with comm.accounting() as acc:
        y = block(x)
        y.backward(randn(S, B, H, seed=23))
    expect(acc.count("all_reduce", "forward") == 2, f"block forward: {acc.records}")
    expect(acc.count("all_reduce", "backward") == 2, f"block backward: {acc.records}")
    expect(len(acc.records) == 4, f"block: {len(acc.records)} collectives, want 4: {acc.records}")
    for rec in acc.records:
        expect(rec.elements == S * B * H, f"block: {rec.label} moves {rec.elements} elements, want {S * B * H}")
        expect(rec.group_size == n, f"block: group size {rec.group_size}")

    torch.manual_seed(24)
    col = ColumnParallelLinear.from_dense(nn.Linear(H, WIDE), group)
    x = randn(S, B, H, seed=25).requires_grad_()
    with comm.accounting() as acc:
        y = col(x)
        expect(acc.count(phase="forward") == 0, f"column forward communicated: {acc.records}")
        y.backward(torch.ones_like(y))
    expect(acc.count() == 1 and acc.count("all_reduce", "backward") == 1, f"column: {acc.records}")
    expect(acc.records[0].elements == S * B * H, f"column backward: {acc.records[0].elements} elements")

    torch.manual_seed(26)
    row = RowParallelLinear.from_dense(nn.Linear(WIDE, H), group)
    x = randn(S, B, WIDE // n, seed=27).requires_grad_()
    with comm.accounting() as acc:
        y = row(x)
        y.backward(torch.ones_like(y))
    expect(acc.count() == 1 and acc.count("all_reduce", "forward") == 1, f"row: {acc.records}")
    expect(acc.records[0].elements == S * B * H, f"row forward: {acc.records[0].elements} elements")


# ---------------------------------------------------------------------------- dropout

P_DROP, SEED = 0.25, 99


def gather(x: torch.Tensor, group) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x.contiguous(), group=group)
    return out


def block_masks(tracker, n):
    """Replay one block's draws: 2 residual-stream masks (s, b, h), then this rank's (b, a/n, s, s)."""
    resid = torch.stack([model.dropout_mask((S, B, H), P_DROP, tracker["default"]) for _ in range(2)])
    return resid, model.dropout_mask((B, HEADS // n, S, S), P_DROP, tracker["tensor-parallel"])


def check_dropout(n, r, group):
    x, up = randn(S, B, H, seed=30), randn(S, B, H, seed=31)
    for causal in (True, False):
        for recompute in model.RECOMPUTE:
            what = f"dropout causal={causal} recompute={recompute}"
            torch.manual_seed(32)
            dense = model.Block(H, HEADS, causal=causal, dropout=P_DROP, recompute=recompute)
            par = ParallelBlock.from_dense(dense, group)
            seed_dense_dropout(dense, SEED, n)
            tracker = model_parallel_seed(SEED, r)
            seed_dropout(par, tracker)
            check_against_dense(par, dense, x, up, what)
            # The generators advanced by exactly one block's draws (recomputation rewinds them).
            replay = model_parallel_seed(SEED, r)
            block_masks(replay, n)
            for name in ("default", "tensor-parallel"):
                expect(torch.equal(tracker[name].get_state(), replay[name].get_state()),
                       f"{what}: the {name!r} generator drew more or less than one block's masks")

    # The masks: the same on every rank where replicated, rank r's own heads in the attention.
    resid, attn = block_masks(model_parallel_seed(SEED, r), n)
    dense_attn = torch.cat([block_masks(model_parallel_seed(SEED, q), n)[1] for q in range(n)], dim=1)   # (B, HEADS, S, S)
    expect(torch.equal(attn, dense_attn[:, r * HEADS // n:(r + 1) * HEADS // n]),
           "dropout: this rank's attention mask is not the dense mask of its heads")
    every_resid, every_attn = gather(resid.to(torch.uint8), group), gather(attn.to(torch.uint8), group)
    expect(all(torch.equal(m, every_resid[0]) for m in every_resid), "dropout: residual masks differ between ranks")
    expect(all(not torch.equal(every_attn[i], every_attn[j]) for i in range(n) for j in range(i)),
           "dropout: two ranks drew the same attention mask")

    # Wrong seedings: per-rank seeds on the residual stream make the copies differ.
    torch.manual_seed(32)
    par = ParallelBlock.from_dense(model.Block(H, HEADS, dropout=P_DROP), group)
    wrong = RNGTracker()
    wrong.add("default", SEED + 1 + r)
    wrong.add("tensor-parallel", SEED + TP_SEED_OFFSET + r)
    seed_dropout(par, wrong)
    with torch.no_grad():
        ys = gather(par(x), group)
    expect(any(not torch.equal(y, ys[0]) for y in ys), "dropout: per-rank residual seeds left every copy equal")
    # Eval mode draws nothing.
    par.eval()
    before = [g.get_state() for g in (wrong["default"], wrong["tensor-parallel"])]
    with torch.no_grad():
        ys = gather(par(x), group)
    expect(all(torch.equal(y, ys[0]) for y in ys), "dropout: eval outputs differ between ranks")
    expect(all(torch.equal(a, g.get_state()) for a, g in zip(before, (wrong["default"], wrong["tensor-parallel"]))),
           "dropout: eval mode drew random numbers")

    # Bad input.
    raises(lambda: seed_dropout(model.Block(H, HEADS), model_parallel_seed(SEED, r)), "ParallelBlock", "Block",
           what="seed_dropout on a dense block")
    raises(lambda: seed_dropout(par, {"default": torch.Generator()}), "RNGTracker", "dict",
           what="seed_dropout with a dict")
    sp = SequenceParallelBlock.from_dense(model.Block(H, HEADS, dropout=P_DROP), group)
    raises(lambda: seed_dropout(sp, model_parallel_seed(SEED, r)), "sequence parallelism",
           what="seed_dropout on a sequence-parallel block")


# ---------------------------------------------------------------------------- bad input

def check_bad_input(n, r, group):
    torch.manual_seed(28)
    col = ColumnParallelLinear.from_dense(nn.Linear(H, WIDE), group)
    row = RowParallelLinear.from_dense(nn.Linear(WIDE, H), group)
    raises(lambda: col(torch.randn(S, B, H + 1)), "ColumnParallelLinear", f"last of size {H}", f"{(S, B, H + 1)}",
           what="column: wrong last dimension")
    raises(lambda: col(torch.randn(H)), "ColumnParallelLinear", "2 dimensions or 3 dimensions",
           what="column: 1-D input")
    raises(lambda: col(torch.ones(S, B, H, dtype=torch.long)), "floating-point", "torch.int64",
           what="column: integer input")
    raises(lambda: col(torch.randn(S, B, H, dtype=torch.float64)), "torch.float64", "torch.float32",
           what="column: float64 input into float32 weights")
    raises(lambda: row(torch.randn(S, B, WIDE)), "this rank's slice", f"last of size {WIDE // n}",
           what="row: the full input where a slice is expected")
    raises(lambda: row(torch.randn(S, B, WIDE // n, dtype=torch.float64)), "torch.float64", "torch.float32",
           what="row: float64 input")
    row_full = RowParallelLinear.from_dense(nn.Linear(WIDE, H), group, input_is_parallel=False)
    raises(lambda: row_full(torch.randn(S, B, WIDE // n)), "RowParallelLinear", f"last of size {WIDE}",
           what="row (input_is_parallel=False): a slice where the full input is expected")
    raises(lambda: row_full(torch.ones(S, B, WIDE, dtype=torch.int32)), "floating-point",
           what="row (input_is_parallel=False): integer input")

    block = ParallelBlock.from_dense(model.Block(H, HEADS), group)
    raises(lambda: block(torch.randn(S * B, H)), "ParallelBlock", f"last of size {H}", what="block: 2-D input")
    raises(lambda: block(torch.randn(S, B, 2 * H)), "ParallelBlock", f"last of size {H}",
           what="block: wrong hidden size")
    raises(lambda: block(torch.randn(S, B, H, dtype=torch.float64)), "torch.float64", "torch.float32",
           what="block: float64 input")
    raises(lambda: model.Attention(H, HEADS)(torch.randn(S * B, H)), "(s, b, h)",
           what="dense attention: 2-D input")
    attn = ParallelAttention.from_dense(model.Attention(H, HEADS), group)
    raises(lambda: attn(torch.randn(S, B, H, dtype=torch.float64)), "torch.float64", "torch.float32",
           what="attention: float64 input")
    raises(lambda: attn(torch.randn(S, B, H + 1)), f"last of size {H}", what="attention: wrong hidden size")

    # Rules checked at construction.
    raises(lambda: ParallelAttention.from_dense(model.Attention(h=12, heads=3), group),
           f"number of heads 3 is not divisible by the tensor-parallel degree t={n}",
           what="attention: 3 heads over the ranks")
    raises(lambda: ParallelBlock.from_dense(model.Block(12, 3), group),
           f"number of heads 3 is not divisible by the tensor-parallel degree t={n}",
           what="block: 3 heads over the ranks")
    raises(lambda: ParallelBlock.from_dense(model.Block(H, HEADS, ffn=17), group),
           f"MLP width 17 is not divisible by the tensor-parallel degree t={n}", what="block: ffn 17")
    raises(lambda: ColumnParallelLinear.from_dense(nn.Linear(H, 17), group),
           f"output features 17 is not divisible by the tensor-parallel degree t={n}", what="column: 17 outputs")
    raises(lambda: RowParallelLinear.from_dense(nn.Linear(17, H), group),
           f"input features 17 is not divisible by the tensor-parallel degree t={n}", what="row: 17 inputs")
    raises(lambda: VocabParallelEmbedding.from_dense(nn.Embedding(33, H), group),
           f"vocabulary size 33 is not divisible by the tensor-parallel degree t={n}", what="embedding: 33 ids")
    raises(lambda: ParallelMLP.from_dense(nn.Linear(H, 64), nn.Linear(32, H), group),
           "fc1 has 64 outputs but fc2 takes 32 inputs", what="mlp: mismatched fc1/fc2")

    emb = VocabParallelEmbedding.from_dense(nn.Embedding(VOCAB, H), group)
    raises(lambda: emb(torch.tensor([[0, VOCAB]])), f"[0, {VOCAB})", f"{VOCAB}", what="embedding: id = vocab")
    raises(lambda: emb(torch.tensor([[-1, 3]])), f"[0, {VOCAB})", "-1", what="embedding: negative id")
    raises(lambda: emb(torch.zeros(S, B)), "integer token ids", "torch.float32", what="embedding: float ids")

    logits = torch.randn(S, B, VOCAB // n)
    raises(lambda: vocab_parallel_cross_entropy(logits, torch.full((S, B), VOCAB), group),
           f"[0, {VOCAB})", what="cross-entropy: target = vocab")
    raises(lambda: vocab_parallel_cross_entropy(logits, torch.zeros(S, dtype=torch.long), group),
           "must match the logits' leading shape", what="cross-entropy: targets of the wrong shape")
    raises(lambda: vocab_parallel_cross_entropy(logits.long(), torch.zeros(S, B, dtype=torch.long), group),
           "floating point", what="cross-entropy: integer logits")


#: Every check, in the order main runs them; each is also a test item of its own (tests.programs.checks.run_check).
CHECKS = (check_column, check_row, check_mlp, check_attention_block_gpt, check_grouped_query, check_cross_entropy,
          check_accounting, check_dropout, check_bad_input)


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
