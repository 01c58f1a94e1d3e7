"""Tests of intralayer.tensor_parallel and the dense twins in intralayer.model.

(a) Every parallel module against its dense twin, forward and backward, on 2 and 4 ranks
    (tests/programs/tp_checks.py, launched like the comm checks).
(b) The divisibility rules, checked before any process starts.
(c) Building a parallel module outside a process group.
(d) The dense twins on one process: shapes, attention against its formula, bad sizes.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from intralayer import model
from intralayer import tensor_parallel as tp

ROOT = Path(__file__).resolve().parents[1]
from tests.programs import tp_checks
ENV = {"PYTHONPATH": str(ROOT)}

S, B, H, HEADS, VOCAB = 4, 2, 16, 4, 32


# ------------------------------------------------------------------ (a) on real ranks

@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("check", tp_checks.CHECKS, ids=lambda c: c.__name__)
def test_parallel_modules_match_their_dense_twins(on_ranks, nproc, check):
    on_ranks(tp_checks, check, nproc, env=ENV, timeout=90)


# ------------------------------------------------------------------ (b) the rules

@pytest.mark.parametrize("t, dims", [
    (1, dict(h=10, heads=5, ffn=7, vocab=11)),          # one device: anything goes
    (2, dict(h=16, heads=4, ffn=64, vocab=32)),
    (4, dict(h=16, heads=4, ffn=64, vocab=32)),
    (8, dict(h=64, heads=8, ffn=256, vocab=50304)),
    (4, dict(h=16)),                                    # any subset of the dimensions
    (4, dict(heads=4, vocab=32)),
    (2, dict(ffn=6)),
    (4, dict(h=16, heads=16)),                          # one-wide heads
    (8, dict(h=8192, heads=64, kv_heads=8)),            # Llama 3 70B's attention: one key/value head per rank
    (4, dict(h=8192, heads=64, kv_heads=8)),            # two whole groups per rank
    (16, dict(h=8192, heads=64, kv_heads=8)),           # each group shared by 2 ranks
    (8, dict(h=4096, heads=32, kv_heads=1)),            # multi-query: one head shared by all 8
    (2, dict(h=16, heads=4, kv_heads=4)),               # as many key/value heads as heads
    (1, dict(h=24, heads=12, kv_heads=6)),
])
def test_check_degrees_accepts_valid_combinations(t, dims):
    assert tp.check_degrees(t, **dims) is None


@pytest.mark.parametrize("t, dims, message", [
    (4, dict(h=10), "hidden size 10 is not divisible by the tensor-parallel degree t=4"),
    (4, dict(h=16, heads=6), "hidden size 16 is not divisible by the number of heads 6"),
    (4, dict(h=24, heads=6), "number of heads 6 is not divisible by the tensor-parallel degree t=4"),
    (2, dict(h=12, heads=3), "number of heads 3 is not divisible by the tensor-parallel degree t=2"),
    (4, dict(h=16, heads=4, ffn=30), "MLP width 30 is not divisible by the tensor-parallel degree t=4"),
    (2, dict(vocab=50257), "vocabulary size 50257 is not divisible by the tensor-parallel degree t=2"),
    (8, dict(h=64, heads=8, ffn=256, vocab=50257),
     "vocabulary size 50257 is not divisible by the tensor-parallel degree t=8"),
    (4, dict(h=6144, heads=48, kv_heads=6), "the number of key/value heads 6 is neither a multiple nor a divisor "
                                            "of the tensor-parallel degree t=4"),
    (8, dict(h=6144, heads=48, kv_heads=12), "key/value heads 12 is neither a multiple nor a divisor"),
    (2, dict(h=16, heads=4, kv_heads=3), "the number of heads 4 is not divisible by the number of key/value heads 3"),
    (4, dict(h=12, heads=4, kv_heads=1), "the fused q|k|v width (heads + 2·kv_heads)·d = (4 + 2·1)·3 = 18 is not "
                                         "divisible by the tensor-parallel degree t=4"),
    (16, dict(h=4096, heads=8, kv_heads=8), "number of heads 8 is not divisible by the tensor-parallel degree t=16"),
    (2, dict(h=16, kv_heads=2), "the number of key/value heads is checked against the number of heads"),
])
def test_check_degrees_names_the_broken_rule(t, dims, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tp.check_degrees(t, **dims)


@pytest.mark.parametrize("t", [0, -1, 2.5, True, "2"])
def test_check_degrees_rejects_a_bad_degree_even_without_dimensions(t):
    with pytest.raises(ValueError, match="tensor-parallel degree t must be a whole number"):
        tp.check_degrees(t)


@pytest.mark.parametrize("t, dims, message", [
    (0, dict(h=16), "the tensor-parallel degree t must be a whole number ≥ 1, got 0"),
    (-2, dict(h=16), "the tensor-parallel degree t must be a whole number ≥ 1, got -2"),
    (2.0, dict(h=16), "the tensor-parallel degree t must be a whole number ≥ 1, got 2.0"),
    (True, dict(h=16), "the tensor-parallel degree t must be a whole number ≥ 1, got True"),
    ("2", dict(vocab=32), "the tensor-parallel degree t must be a whole number ≥ 1, got '2'"),
    (2, dict(h=0), "hidden size must be a whole number ≥ 1, got 0"),
    (2, dict(h=16.0), "hidden size must be a whole number ≥ 1, got 16.0"),
    (2, dict(h=16, heads=0), "number of heads must be a whole number ≥ 1, got 0"),
    (2, dict(ffn=-64), "MLP width must be a whole number ≥ 1, got -64"),
    (2, dict(vocab=32.5), "vocabulary size must be a whole number ≥ 1, got 32.5"),
    (2, dict(h=16, heads=4, kv_heads=0), "number of key/value heads must be a whole number ≥ 1, got 0"),
    (2, dict(h=16, heads=4, kv_heads=2.0), "number of key/value heads must be a whole number ≥ 1, got 2.0"),
])
def test_check_degrees_rejects_non_whole_or_zero_values(t, dims, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tp.check_degrees(t, **dims)


@pytest.mark.parametrize("value, t", [(16, 1), (16, 2), (16, 4), (16, 16), (50304, 8), (7, 7)])
def test_check_divisible_accepts(value, t):
    assert tp.check_divisible(value, t, "hidden size") is None


@pytest.mark.parametrize("value, t, what, message", [
    (10, 4, "hidden size", "hidden size 10 is not divisible by the tensor-parallel degree t=4"),
    (17, 2, "output features", "output features 17 is not divisible by the tensor-parallel degree t=2"),
    (4, 8, "number of heads", "number of heads 4 is not divisible by the tensor-parallel degree t=8"),
    (0, 2, "MLP width", "MLP width must be a whole number ≥ 1, got 0"),
    (16.0, 2, "MLP width", "MLP width must be a whole number ≥ 1, got 16.0"),
    (False, 2, "MLP width", "MLP width must be a whole number ≥ 1, got False"),
    (16, 0, "hidden size", "the tensor-parallel degree t must be a whole number ≥ 1, got 0"),
    (16, 2.5, "hidden size", "the tensor-parallel degree t must be a whole number ≥ 1, got 2.5"),
    (16, None, "hidden size", "the tensor-parallel degree t must be a whole number ≥ 1, got None"),
])
def test_check_divisible_names_the_numbers(value, t, what, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tp.check_divisible(value, t, what)


# ------------------------------------------------------------------ (c) outside a process group

def _dense_gpt():
    torch.manual_seed(0)
    return model.TinyGPT(VOCAB, H, HEADS)


@pytest.mark.parametrize("build", [
    pytest.param(lambda: tp.ColumnParallelLinear.from_dense(nn.Linear(H, 2 * H), None), id="column"),
    pytest.param(lambda: tp.RowParallelLinear.from_dense(nn.Linear(2 * H, H), None), id="row"),
    pytest.param(lambda: tp.ParallelMLP.from_dense(nn.Linear(H, 4 * H), nn.Linear(4 * H, H), None), id="mlp"),
    pytest.param(lambda: tp.ParallelAttention.from_dense(model.Attention(H, HEADS), None), id="attention"),
    pytest.param(lambda: tp.ParallelBlock.from_dense(model.Block(H, HEADS), None), id="block"),
    pytest.param(lambda: tp.VocabParallelEmbedding.from_dense(nn.Embedding(VOCAB, H), None), id="embedding"),
    pytest.param(lambda: tp.ParallelGPT.from_dense(_dense_gpt(), None), id="gpt"),
    pytest.param(lambda: tp.ColumnParallelLinear(torch.zeros(H, H), None, None), id="column-init"),
    pytest.param(lambda: tp.vocab_parallel_cross_entropy(torch.zeros(S, B, VOCAB),
                                                         torch.zeros(S, B, dtype=torch.long), None),
                 id="cross-entropy"),
])
def test_building_outside_a_process_group_says_to_use_setup(build):
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match=r"process group.*distributed\.setup\(\)"):
        build()


# ------------------------------------------------------------------ (d) the dense twins
#
# Tolerances: float32 at assert_close's defaults (tests/programs/checks.FLOAT32_REORDERED):
# the formulas written out here sum the same terms as the modules, maybe grouped otherwise
# (≤ 4H = 64 terms), and rounding errors of such sums grow like √n·u.

def _reference_attention(qkv: torch.Tensor, heads: int, causal: bool) -> torch.Tensor:
    """softmax(q kᵀ/√d + mask) v, head by head, written out."""
    s, b, width = qkv.shape
    d = width // 3 // heads
    q, k, v = (t.reshape(s, b, heads, d) for t in qkv.chunk(3, dim=-1))
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(d)          # (b, heads, s, s)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v)              # (s, b, heads, d)
    return o.reshape(s, b, heads * d)


@pytest.mark.parametrize("heads", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
def test_attend_shape_and_formula(heads, causal):
    qkv = torch.randn(S, B, 3 * H, generator=torch.Generator().manual_seed(heads))
    out = model.attend(qkv, heads, causal)
    assert out.shape == (S, B, H)
    torch.testing.assert_close(out, _reference_attention(qkv, heads, causal))


def test_attend_is_causal_and_heads_do_not_mix():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(S, B, 3 * H, generator=g)
    later = qkv.clone()
    later[-1] += torch.randn(B, 3 * H, generator=g)                    # change only the last position
    torch.testing.assert_close(model.attend(later, HEADS)[:-1], model.attend(qkv, HEADS)[:-1])
    # Attention on a subset of heads is that subset of the output (what lets ranks split heads).
    d = H // HEADS
    q, k, v = qkv.chunk(3, dim=-1)
    first_two = torch.cat([q[..., :2 * d], k[..., :2 * d], v[..., :2 * d]], dim=-1)
    torch.testing.assert_close(model.attend(first_two, 2), model.attend(qkv, HEADS)[..., :2 * d])


def test_attend_rejects_a_width_that_does_not_split_into_heads():
    with pytest.raises(ValueError, match=re.escape("a fused q|k|v width 48 is not divisible by 3 × 5 heads")):
        model.attend(torch.zeros(S, B, 3 * H), 5)


@pytest.mark.parametrize("heads, kv_heads", [(4, 1), (4, 2), (8, 2), (4, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_grouped_query_attend_is_attention_with_each_kv_head_repeated_for_its_group(heads, kv_heads, causal):
    d = H // heads
    qkv = torch.randn(S, B, (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(heads + kv_heads))
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    group = heads // kv_heads                     # query head j uses key/value head j // group
    k_all, v_all = (t.reshape(S, B, kv_heads, d).repeat_interleave(group, dim=2).reshape(S, B, H) for t in (k, v))
    want = _reference_attention(torch.cat([q, k_all, v_all], dim=-1), heads, causal)
    torch.testing.assert_close(model.attend(qkv, heads, causal, kv_heads=kv_heads), want)
    for fused in (True, False):                   # the written-out core and recomputation give the same
        for recompute in (False, True):
            got = model.attend(qkv, heads, causal, fused=fused, recompute=recompute, kv_heads=kv_heads)
            torch.testing.assert_close(got, want)


def test_attention_kv_heads_default_keeps_the_multi_head_layout_and_its_weights():
    torch.manual_seed(3)
    mha = model.Attention(H, HEADS)
    torch.manual_seed(3)
    same = model.Attention(H, HEADS, kv_heads=HEADS)
    assert mha.kv_heads == HEADS and mha.qkv.out_features == 3 * H
    assert torch.equal(mha.qkv.weight, same.qkv.weight)
    gqa = model.Attention(H, 8, kv_heads=2)
    assert gqa.qkv.out_features == H + 2 * 2 * (H // 8)            # [q | k | v]: 16 + 4 + 4
    assert model.Block(H, 8, kv_heads=2).attn.kv_heads == 2
    assert model.TinyGPT(VOCAB, H, HEADS, layers=2, kv_heads=1).blocks[1].attn.kv_heads == 1
    x = torch.randn(S, B, H)
    assert gqa(x).shape == (S, B, H)


@pytest.mark.parametrize("heads, kv_heads, message", [
    (4, 3, "the number of heads 4 is not divisible by the number of key/value heads 3"),
    (4, 0, "the number of key/value heads must be a whole number ≥ 1, got 0"),
    (4, 8, "the number of heads 4 is not divisible by the number of key/value heads 8"),
    (4, 2.0, "the number of key/value heads must be a whole number ≥ 1, got 2.0"),
])
def test_attention_refuses_key_value_heads_that_do_not_group_the_heads(heads, kv_heads, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        model.Attention(H, heads, kv_heads=kv_heads)
    with pytest.raises(ValueError, match=re.escape(message)):
        model.attend(torch.zeros(S, B, 3 * H), heads, kv_heads=kv_heads)


def test_attend_rejects_a_grouped_width_that_does_not_split_into_heads():
    with pytest.raises(ValueError, match=re.escape("a fused q|k|v width 25 is not divisible by 4 + 2 × 2 heads")):
        model.attend(torch.zeros(S, B, 25), 4, kv_heads=2)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (8, 2), (4, 1), (4, 4), (6, 3)])
def test_megatron_qkv_order_is_the_checkpoint_converters_per_group_concatenation(heads, kv_heads):
    """Megatron-LM's converters build linear_qkv as cat([q (ng, np/ng·d, h), k (ng, d, h), v (ng, d, h)], dim=1)."""
    d, h = 3, 5
    w = torch.randn((heads + 2 * kv_heads) * d, h)
    q, k, v = w.split([heads * d, kv_heads * d, kv_heads * d])
    want = torch.cat([q.reshape(kv_heads, heads // kv_heads * d, h), k.reshape(kv_heads, d, h),
                      v.reshape(kv_heads, d, h)], dim=1).reshape(-1, h)
    order = tp.megatron_qkv_order(heads, kv_heads, d)
    assert sorted(order.tolist()) == list(range(len(w)))             # a permutation of the rows
    assert torch.equal(w[order], want)


def test_megatron_qkv_order_of_four_heads_in_two_groups_reads_q0_q1_k0_v0_q2_q3_k1_v1():
    order = tp.megatron_qkv_order(4, 2, 1)                          # rows of [q0 q1 q2 q3 | k0 k1 | v0 v1]
    names = ["q0", "q1", "q2", "q3", "k0", "k1", "v0", "v1"]
    assert [names[i] for i in order] == ["q0", "q1", "k0", "v0", "q2", "q3", "k1", "v1"]


@pytest.mark.parametrize("args, message", [
    ((4, 3, 2), "the number of heads 4 is not divisible by the number of key/value heads 3"),
    ((4, 2, 0), "head dimension d must be a whole number ≥ 1, got 0"),
    ((0, 1, 2), "number of heads must be a whole number ≥ 1, got 0"),
])
def test_megatron_qkv_order_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tp.megatron_qkv_order(*args)


@pytest.mark.parametrize("h, heads, kv_heads, t", [(16, 4, 2, 1), (16, 4, 2, 2), (16, 4, 2, 4), (16, 8, 1, 4),
                                                   (32, 8, 8, 4), (24, 6, 3, 3)])
def test_block_costs_counts_the_grouped_blocks_parameters_and_its_gathers(h, heads, kv_heads, t):
    dense = model.Block(h, heads, kv_heads=kv_heads)
    c = tp.block_costs(8, 2, h, heads, t, itemsize=4, kv_heads=kv_heads)
    replicated = 2 * h + 4 * h                                       # proj and fc2 biases, two LayerNorms
    assert c["weights"] == (sum(p.numel() for p in dense.parameters()) - replicated) // t + replicated
    d, w = h // heads, dense.attn.qkv.out_features
    assert c["kv_bytes"] == 2 * 8 * 2 * max(kv_heads // t, 1) * d * 4
    shared = t > kv_heads
    assert (c["gathers"], c["gather_S"]) == ((2, 8 * 2 * w * 4) if shared else (0, 0))
    assert c["sent"] == 4 * 2 * (t - 1) / t * 8 * 2 * h * 4 + (2 * (t - 1) / t * 8 * 2 * w * 4 if shared else 0)
    assert c["forward_flops"] == (2 * 8 * 2 * h * (w + h + 8 * h) + 4 * 2 * 8 * 8 * h) / t


def test_block_costs_without_kv_heads_is_multi_head_attention():
    assert tp.block_costs(2048, 1, 12288, 96, 8) == tp.block_costs(2048, 1, 12288, 96, 8, kv_heads=96)
    # qkv 3h² + 3h, proj h², fc1 4h² + 4h, fc2 4h² split; 6h replicated
    assert tp.block_costs(2048, 1, 12288, 96, 8)["weights"] == (12 * 12288 ** 2 + 7 * 12288) // 8 + 6 * 12288


def test_block_and_gpt_shapes():
    torch.manual_seed(0)
    block = model.Block(H, HEADS)
    x = torch.randn(S, B, H)
    assert block(x).shape == (S, B, H)
    assert block.mlp.fc1.out_features == 4 * H
    assert model.Block(H, HEADS, ffn=24).mlp.fc1.out_features == 24
    assert model.Attention(H, HEADS)(x).shape == (S, B, H)
    assert model.MLP(H)(x).shape == (S, B, H)
    gpt = model.TinyGPT(VOCAB, H, HEADS, layers=2)
    ids = torch.randint(0, VOCAB, (S, B))
    assert gpt(ids).shape == (S, B, VOCAB)
    loss = gpt.loss(ids, ids)
    assert loss.shape == () and torch.isfinite(loss)


def test_block_is_pre_layernorm_residual():
    torch.manual_seed(0)
    block = model.Block(H, HEADS)
    x = torch.randn(S, B, H)
    y = x + block.attn(block.ln1(x))
    want = y + block.mlp.fc2(F.gelu(block.mlp.fc1(block.ln2(y))))
    torch.testing.assert_close(block(x), want)


@pytest.mark.parametrize("bad, message", [
    (torch.zeros(S * B, H), "Block expects 3 dimensions with the last of size 16, got shape (8, 16)"),
    (torch.zeros(S, B, H + 1), "Block expects 3 dimensions with the last of size 16, got shape (4, 2, 17)"),
    (torch.zeros(S, B, H, dtype=torch.long), "Block expects a floating-point tensor, got dtype torch.int64"),
    ([[0.0] * H], "Block expects a torch.Tensor, got list"),
])
def test_block_rejects_bad_input(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        model.Block(H, HEADS)(bad)


@pytest.mark.parametrize("h, heads", [(12, 5), (16, 3), (16, 0), (16, -4)])
def test_attention_rejects_h_not_divisible_by_heads(h, heads):
    with pytest.raises(ValueError, match=re.escape(f"hidden size {h} is not divisible by the number of heads {heads}")):
        model.Attention(h, heads)


def test_cost_functions_answer_or_explain_over_the_chapter_explorer_grids():
    """Every slider combination of chapters 01–02 gives numbers or a ValueError naming a rule."""
    import itertools
    answered = refused = 0
    for m, k, n, t in itertools.product([2048, 8192, 32768], [1024, 4096, 12288], [1024, 4096, 12288, 49152],
                                        [1, 2, 3, 4, 8, 16]):
        for split in ("column", "row"):
            try:
                c = tp.linear_costs(m, k, n, t, split)
                assert c["weights"] * t == k * n * 2 and c["forward_sent"] >= 0 and c["backward_sent"] >= 0
                answered += 1
            except ValueError as err:
                assert "not divisible by the tensor-parallel degree" in str(err)
                refused += 1
    for h, heads, s, b, t in itertools.product([4096, 8192, 12288, 16384], [32, 64, 96, 128], [2048, 8192, 32768],
                                               [1, 4], [1, 2, 4, 8, 16, 32, 64, 72]):
        try:
            c = tp.block_costs(s, b, h, heads, t)
            assert c["sent"] == (0 if t == 1 else 4 * 2 * (t - 1) / t * s * b * h * 2)
            answered += 1
        except ValueError as err:
            assert "is not divisible by" in str(err)
            refused += 1
    assert answered and refused


# ------------------------------------------------------------------ (e) dropout randomness on one process
#
# The multi-rank check (tests/programs/tp_checks.check_dropout) compares a parallel block with
# dropout against its dense twin; here, the pieces it is built from.

P = 0.25


def test_model_parallel_seed_follows_megatron():
    """Megatron-LM: default seed on every tensor-parallel rank; seed + 2718 + rank inside split regions."""
    for rank in (0, 1, 3):
        tracker = tp.model_parallel_seed(7, rank)
        assert tracker.seed("default") == 7 and tracker.seed("tensor-parallel") == 7 + 2718 + rank
        for name, seed in (("default", 7), ("tensor-parallel", 7 + 2718 + rank)):
            want = torch.rand(5, generator=torch.Generator().manual_seed(seed))
            assert torch.equal(torch.rand(5, generator=tracker[name]), want)


@pytest.mark.parametrize("call, message", [
    (lambda tr: tr.add("default", 8), "the generator 'default' already exists"),
    (lambda tr: tr.add("other", 7), "seed 7 is already the seed of 'default': 'other' would draw the same masks"),
    (lambda tr: tr.add("other", -1), "a seed must be a whole number ≥ 0, got -1"),
    (lambda tr: tr.add("other", 1.5), "a seed must be a whole number ≥ 0, got 1.5"),
    (lambda tr: tr["attention"], "no generator named 'attention'; this tracker has ['default', 'tensor-parallel']"),
    (lambda tr: tp.model_parallel_seed(7, -1), "the tensor-parallel rank must be a whole number ≥ 0, got -1"),
    (lambda tr: tp.model_parallel_seed(7, True), "the tensor-parallel rank must be a whole number ≥ 0, got True"),
])
def test_rng_tracker_refuses_duplicates_and_unknown_names(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call(tp.model_parallel_seed(7, 0))


def test_dropout_mask_keeps_one_minus_p_and_ignores_the_dtype():
    keep = model.dropout_mask((200, 500), P, torch.Generator().manual_seed(0))
    assert keep.dtype == torch.bool and abs(keep.float().mean().item() - (1 - P)) < 0.01   # 1e5 draws: σ ≈ 0.0014
    x32, x64 = torch.ones(6, 7), torch.ones(6, 7, dtype=torch.float64)
    y32 = model.dropout(x32, P, generator=torch.Generator().manual_seed(1))
    y64 = model.dropout(x64, P, generator=torch.Generator().manual_seed(1))
    assert torch.equal(y32 != 0, y64 != 0)


def test_dropout_with_a_generator_is_mask_over_keep_probability_and_saves_one_byte_per_element():
    x = torch.randn(S, B, H, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = model.dropout(x, P, generator=torch.Generator().manual_seed(3))
    keep = model.dropout_mask((S, B, H), P, torch.Generator().manual_seed(3))
    torch.testing.assert_close(y, x * keep * (1 / (1 - P)), rtol=0, atol=0)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, keep * (1 / (1 - P)), rtol=0, atol=0)
    assert [t.dtype for t in saved] == [torch.bool]
    assert model.dropout(x, P, training=False, generator=torch.Generator()) is x
    assert model.dropout(x, 0.0, generator=torch.Generator()) is x


def test_dropout_without_a_generator_is_still_native_dropout():
    x = torch.randn(S, B, H)
    torch.manual_seed(5)
    want = torch.native_dropout(x, P, True)[0]
    torch.manual_seed(5)
    assert torch.equal(model.dropout(x, P), want)


@pytest.mark.parametrize("bad, message", [
    ("seed", "dropout needs a torch.Generator, got str"),
])
def test_dropout_mask_rejects_a_non_generator(bad, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        model.dropout_mask((2, 2), P, bad)


def test_attention_dropout_draws_each_head_group_from_its_generator():
    """Group g of the heads drops with generators[g]: the masks a rank with those heads would draw."""
    torch.manual_seed(0)
    attn = model.Attention(H, HEADS, dropout=P)
    x = torch.randn(S, B, H)
    groups = 2
    attn.generators = [torch.Generator().manual_seed(10 + g) for g in range(groups)]
    got = attn(x)
    qkv = attn.qkv(x)
    q, k, v = (t.reshape(S, B, HEADS, -1).permute(1, 2, 0, 3) for t in qkv.chunk(3, dim=-1))   # (b, a, s, d)
    scores = q @ k.transpose(-2, -1) / math.sqrt(H // HEADS) + torch.full((S, S), float("-inf")).triu(1)
    keep = torch.cat([model.dropout_mask((B, HEADS // groups, S, S), P, torch.Generator().manual_seed(10 + g))
                      for g in range(groups)], dim=1)                                           # (b, a, s, s)
    o = (torch.softmax(scores, -1) * keep / (1 - P)) @ v                                        # (b, a, s, d)
    torch.testing.assert_close(got, attn.proj(o.permute(2, 0, 1, 3).reshape(S, B, H)))
    attn.generators = [torch.Generator() for _ in range(3)]
    with pytest.raises(ValueError, match=re.escape("4 heads do not split into 3 equal groups, one per dropout generator")):
        attn(x)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_draws_the_same_masks_from_given_generators(recompute):
    """Recomputing the attention core (or the block) rewinds the generators: same masks, same gradients."""
    torch.manual_seed(0)
    base = model.Block(H, HEADS, dropout=P)
    x = torch.randn(S, B, H)
    runs = []
    for mode in ("none", recompute):
        block = model.Block(H, HEADS, dropout=P, recompute=mode)
        block.load_state_dict(base.state_dict())
        tp.seed_dense_dropout(block, 11, 2)
        xi = x.clone().requires_grad_()
        y = block(xi)
        y.backward(torch.ones_like(y))
        gens = [block.generator, *block.attn.generators]
        runs.append((y.detach(), xi.grad, block.mlp.fc1.weight.grad, [g.get_state() for g in gens]))
    (y0, dx0, dw0, s0), (y1, dx1, dw1, s1) = runs
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1) and torch.equal(dw0, dw1)
    assert all(torch.equal(a, b) for a, b in zip(s0, s1)), "recomputation left a generator elsewhere"


def test_seed_dense_dropout_gives_group_r_rank_r_generator():
    block = model.Block(H, HEADS, dropout=P)
    tp.seed_dense_dropout(block, 5, 4)
    assert len(block.attn.generators) == 4
    for r, g in enumerate(block.attn.generators):
        assert torch.equal(g.get_state(), tp.model_parallel_seed(5, r)["tensor-parallel"].get_state())
    assert torch.equal(block.generator.get_state(), tp.model_parallel_seed(5, 0)["default"].get_state())


@pytest.mark.parametrize("call, message", [
    (lambda: tp.seed_dense_dropout(model.Block(H, HEADS), 5, 8),
     "number of heads 4 is not divisible by the tensor-parallel degree t=8"),
    (lambda: tp.seed_dense_dropout(model.Attention(H, HEADS), 5, 2), "expects a dense Block, got Attention"),
    (lambda: tp.seed_dropout(model.Block(H, HEADS), tp.model_parallel_seed(5, 0)),
     "seed_dropout expects a tensor-parallel ParallelBlock, got Block"),
])
def test_seeding_names_the_broken_rule(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


# ------------------------------------------------------------------ (f) vocabulary padding, links, closed forms

@pytest.mark.parametrize("t, want", [(1, 50304), (2, 50432), (4, 50688), (8, 51200)])
def test_padded_vocab_size_is_megatron_rule(t, want):
    """GPT-2's 50,257 tokens padded to a multiple of 128·t: every shard a multiple of 128."""
    got = tp.padded_vocab_size(50257, t)
    assert got == want and got % t == 0 and (got // t) % 128 == 0 and got - 50257 < 128 * t
    assert tp.padded_vocab_size(51200, 8) == 51200


@pytest.mark.parametrize("args, message", [
    ((0, 8), "vocabulary size must be a whole number ≥ 1, got 0"),
    ((50257, 0), "the tensor-parallel degree t must be a whole number ≥ 1, got 0"),
    ((50257, 2, 0), "the padding multiple must be a whole number ≥ 1, got 0"),
])
def test_padded_vocab_size_rejects_bad_input(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tp.padded_vocab_size(*args)


@pytest.mark.parametrize("t, link", [(8, "NVLink 4 (H100 SXM)"), (72, "NVLink 5 (GB200 NVL72)"),
                                     (64, "InfiniBand NDR (1 NIC)"), (1, "NVLink 4 (H100 SXM)")])
def test_check_link_degree_accepts_groups_inside_a_domain(t, link):
    assert tp.check_link_degree(t, link) is None


@pytest.mark.parametrize("t, link, message", [
    (16, "NVLink 4 (H100 SXM)", "t = 16 GPUs do not fit in one NVLink 4 (H100 SXM) domain: it joins 8 GPUs"),
    (73, "NVLink 5 (GB200 NVL72)", "t = 73 GPUs do not fit in one NVLink 5 (GB200 NVL72) domain: it joins 72 GPUs"),
    (8, "NVLink 9", "unknown link 'NVLink 9'"),
    (0, "NVLink 4 (H100 SXM)", "the tensor-parallel degree t must be a whole number ≥ 1, got 0"),
])
def test_check_link_degree_names_the_rule(t, link, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        tp.check_link_degree(t, link)
    if "fit" in message:
        with pytest.raises(ValueError, match=re.escape(message)):
            tp.layer_times(2048, 1, 16384, 128, t, link)


@pytest.mark.parametrize("link", ["NVLink 4 (H100 SXM)", "InfiniBand NDR (1 NIC)", "NVLink 5 (GB200 NVL72)"])
@pytest.mark.parametrize("t", [2, 4, 8])
def test_closed_form_ratio_equals_the_cost_model(link, t):
    """(t−1)·2·F/(6hB(1 + s/6h)) · 2/3 is layer_times' ratio, for any b; h* gives ratio 1."""
    from intralayer.collectives import LINKS
    F_ = tp.H100_BF16_PEAK * 0.5
    bw = LINKS[link].bandwidth
    for s, b, h, heads in ((2048, 1, 12288, 96), (8192, 4, 4096, 32), (2048, 2, 8192, 64)):
        compute, comm_s = tp.layer_times(s, b, h, heads, t, link, efficiency=0.5)
        want = tp.comm_compute_ratio(h, t, F_, bw, s=s, passes="forward+backward")
        assert math.isclose(comm_s / compute, want, rel_tol=1e-12)
    for passes in ("forward", "forward+backward"):
        h_star = tp.break_even_hidden(t, F_, bw, passes=passes)
        assert math.isclose(tp.comm_compute_ratio(1, t, F_, bw, passes=passes) / h_star, 1, rel_tol=1e-12)
        assert math.isclose(h_star * 2 / 3 if passes == "forward" else h_star,
                            tp.break_even_hidden(t, F_, bw, passes="forward+backward"), rel_tol=1e-12)


@pytest.mark.parametrize("kwargs, message", [
    (dict(flops=0), "the sustained compute rate (FLOP/s) must be a positive number, got 0"),
    (dict(bandwidth=-1.0), "the link bandwidth (bytes/s) must be a positive number, got -1.0"),
    (dict(passes="backward"), "passes must be 'forward' or 'forward+backward', got 'backward'"),
    (dict(h=0), "hidden size must be a whole number ≥ 1, got 0"),
])
def test_comm_compute_ratio_rejects_bad_input(kwargs, message):
    args = dict(h=4096, t=8, flops=5e14, bandwidth=4.5e11) | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        tp.comm_compute_ratio(**args)


@pytest.mark.parametrize("efficiency", [0, 1.5, True, "half"])
def test_layer_times_rejects_an_efficiency_outside_zero_to_one(efficiency):
    with pytest.raises(ValueError, match=re.escape("efficiency (the fraction of peak the matrix products reach) "
                                                   "must lie in (0, 1]")):
        tp.layer_times(2048, 1, 12288, 96, 8, "NVLink 4 (H100 SXM)", efficiency=efficiency)


# ------------------------------------------------------------------ (g) the chapter's program, as documented

def test_tp_block_tolerance_is_the_float32_default_until_96_terms_then_grows_like_root_n():
    from intralayer.programs import tp_block

    assert tp_block.tolerance(8, 2, 16, 64) == dict(rtol=1.3e-6, atol=1e-5)             # the chapter's sizes
    big = tp_block.tolerance(512, 2, 1024, 32768)                                       # n = v = 32768
    assert math.isclose(big["rtol"], 1.3e-6 * math.sqrt(32768 / 96))
    assert math.isclose(big["atol"], 1e-5 * math.sqrt(32768 / 96))
    assert tp_block.tolerance(512, 2, 1024, 0)["rtol"] == 1.3e-6 * math.sqrt(4096 / 96)   # n = 4h
