"""Tests of intralayer.memory (chapter 03's activation-memory formulas and meter), on one process.

(a) The total against Korthikanti et al. 2022, Table 2, written out here independently.
(b) The term list: structural properties of each assumption it takes.
(c) Bad sizes: a ValueError naming the rule.
(d) The meter (saved_bytes) on a dense model.Block against the terms, with matching assumptions.
(e) Recomputation is exact: same output and gradients as keeping everything.
(f) The meter itself: parameters left out, each storage counted once, at its full size.
"""
from __future__ import annotations

import itertools
import re
from fractions import Fraction

import pytest
import torch
import torch.nn as nn
from torch.testing import assert_close

from intralayer import memory, model

S, B, H, A = 16, 2, 32, 4          # the measurement's block: small, every rule satisfied


# ------------------------------------------------------------------ (a) Table 2

def table2(s, b, h, a, t, sp, recompute) -> Fraction:
    """Korthikanti et al. 2022, Table 2, as printed (bytes per layer and device)."""
    sbh = Fraction(s * b * h)
    core = Fraction(5 * a * s, h)                                          # 5as/h
    if recompute == "full":
        return 2 * sbh                                                     # 2sbh, whatever the layout
    if t == 1 and not sp and recompute == "none":
        return sbh * (34 + core)                                           # no parallelism
    printed = {
        (False, "none"): sbh * (10 + Fraction(24, t) + core / t),         # tensor parallel (baseline)
        (True, "none"): sbh * (Fraction(34, t) + core / t),              # tensor + sequence parallel
        (False, "selective"): sbh * (10 + Fraction(24, t)),               # TP + selective recomputation
        (True, "selective"): sbh * Fraction(34, t),                       # TP + SP + selective
    }
    return printed[(sp, recompute)]


GRID = list(itertools.product(
    [1, 8, 12, 2048],            # s
    [1, 3],                      # b
    [16, 48, 96, 12288],         # h
    [1, 2, 3, 4, 8, 96],         # a
    [1, 2, 3, 4, 8],             # t
    [False, True],               # sp
    memory.RECOMPUTE,
))


def _valid(s, b, h, a, t, sp, recompute) -> bool:
    return h % a == 0 and a % t == 0 and h % t == 0 and (not sp or s % t == 0)


def test_total_equals_table_2_over_a_grid():
    answered = refused = 0
    for case in GRID:
        if not _valid(*case):
            with pytest.raises(ValueError):
                memory.activation_bytes_per_layer(*case)
            refused += 1
            continue
        want = table2(*case)
        assert want.denominator == 1, case
        got = memory.activation_bytes_per_layer(*case)
        s, b, h, a, t, sp, recompute = case
        if sp and recompute == "full":     # Megatron-LM keeps the layer input as it arrives: split by sequence
            want = want / t
        assert isinstance(got, int) and got == want, (case, got, want)
        assert sum(memory.activation_terms(*case).values()) == got, case
        answered += 1
    assert answered > 500 and refused > 100


@pytest.mark.parametrize("s, b, h, a, t", [
    (2048, 1, 12288, 96, 8),     # GPT-3 175B, the paper's t = 8
    (2048, 1, 20480, 128, 8),    # 530B
    (2048, 1, 25600, 160, 8),    # 1T
    (1024, 4, 1024, 16, 2),
])
def test_table_2_rows_for_paper_sized_models(s, b, h, a, t):
    sbh = s * b * h
    f = memory.activation_bytes_per_layer
    assert f(s, b, h, a) == sbh * 34 + 5 * a * s * s * b
    assert f(s, b, h, a, t) == sbh * 10 + sbh * 24 // t + 5 * a * s * s * b // t
    assert f(s, b, h, a, t, sp=True) == sbh * 34 // t + 5 * a * s * s * b // t
    assert f(s, b, h, a, t, recompute="selective") == sbh * 10 + sbh * 24 // t
    assert f(s, b, h, a, t, sp=True, recompute="selective") == sbh * 34 // t
    assert f(s, b, h, a, t, recompute="full") == 2 * sbh
    assert f(s, b, h, a, t, sp=True, recompute="full") == 2 * sbh // t          # Megatron-LM's
    assert table2(s, b, h, a, t, True, "full") == 2 * sbh                              # Table 2's
    # Sequence parallelism with selective recomputation is exactly t times less than no parallelism
    # without the attention core (the paper's point).
    assert f(s, b, h, a, 1, recompute="selective") == t * f(s, b, h, a, t, sp=True, recompute="selective")


def test_defaults_are_the_papers_assumptions():
    assert memory.activation_terms(S, B, H, A) == memory.activation_terms(
        S, B, H, A, t=1, sp=False, recompute="none", itemsize=2, mask_bytes=1, dropout=True, ln_stats=False,
        fused=False, keep_gathered=False)
    assert memory.activation_bytes_per_layer(S, B, H, A) == S * B * H * 34 + 5 * A * S * S * B


# ------------------------------------------------------------------ (b) the terms

LAYOUTS = [dict(t=1, sp=False), dict(t=2, sp=False), dict(t=4, sp=True), dict(t=2, sp=True)]
SS_TERMS = {"softmax output", "attention dropout mask", "attention dropout output"}


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("recompute", memory.RECOMPUTE)
def test_terms_sum_and_names(layout, recompute):
    terms = memory.activation_terms(S, B, H, A, recompute=recompute, **layout)
    assert sum(terms.values()) == memory.activation_bytes_per_layer(S, B, H, A, recompute=recompute, **layout)
    assert all(isinstance(v, int) and v > 0 for v in terms.values())
    if recompute == "full":
        assert terms == {"layer input": 2 * S * B * H // (layout["t"] if layout["sp"] else 1)}
    else:
        assert set(terms) <= set(memory.TERM_NAMES)
        assert list(terms) == [n for n in memory.TERM_NAMES if n in terms]      # the paper's order
        assert not set(terms) & {"LayerNorm 1 statistics", "LayerNorm 2 statistics"}   # paper: ignored
        assert bool(SS_TERMS & set(terms)) == (recompute == "none")


def test_term_values_for_one_layout():
    """t = 2 with SP, 16-bit: every term as the paper's derivation (§4.1) gives it."""
    s, b, h, a, t = S, B, H, A, 2
    sbh, as2b = s * b * h, a * s * s * b
    assert memory.activation_terms(s, b, h, a, t=t, sp=True) == {
        "LayerNorm 1 input": 2 * sbh // t,
        "q|k|v input": 2 * sbh // t,
        "Q and K": 4 * sbh // t,
        "softmax output": 2 * as2b // t,
        "attention dropout mask": as2b // t,
        "attention dropout output": 2 * as2b // t,
        "V": 2 * sbh // t,
        "projection input": 2 * sbh // t,
        "attention output dropout mask": sbh // t,
        "LayerNorm 2 input": 2 * sbh // t,
        "fc1 input": 2 * sbh // t,
        "GeLU input": 8 * sbh // t,
        "fc2 input": 8 * sbh // t,
        "MLP dropout mask": sbh // t,
    }


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_float32_doubles_every_activation_but_not_masks_or_statistics(layout, recompute):
    half = memory.activation_terms(S, B, H, A, recompute=recompute, ln_stats=True, **layout)
    full = memory.activation_terms(S, B, H, A, recompute=recompute, ln_stats=True, itemsize=4, **layout)
    assert set(half) == set(full)
    for name in half:
        if "mask" in name or "statistics" in name:
            assert full[name] == half[name], name
        else:
            assert full[name] == 2 * half[name], name
    assert sum(1 for n in half if "mask" in n) == (3 if recompute == "none" else 2)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_full_recomputation_scales_with_itemsize(layout):
    two = memory.activation_terms(S, B, H, A, recompute="full", **layout)
    four = memory.activation_terms(S, B, H, A, recompute="full", itemsize=4, **layout)
    assert four["layer input"] == 2 * two["layer input"]


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_no_dropout_removes_the_masks_and_the_attention_dropout_output(layout, recompute):
    on = memory.activation_terms(S, B, H, A, recompute=recompute, **layout)
    off = memory.activation_terms(S, B, H, A, recompute=recompute, dropout=False, **layout)
    removed = {n for n in on if "mask" in n} | ({"attention dropout output"} if recompute == "none" else set())
    assert set(on) - set(off) == removed
    assert set(off) <= set(on)
    assert all(off[n] == on[n] for n in off)
    assert "softmax output" in off if recompute == "none" else "softmax output" not in off


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("stats_bytes", [2, 4])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_layernorm_statistics_add_two_terms(layout, stats_bytes, recompute):
    off = memory.activation_terms(S, B, H, A, recompute=recompute, **layout)
    on = memory.activation_terms(S, B, H, A, recompute=recompute, ln_stats=True, stats_bytes=stats_bytes, **layout)
    added = {n: on[n] for n in set(on) - set(off)}
    div = layout["t"] if layout["sp"] else 1
    assert added == {"LayerNorm 1 statistics": 2 * S * B * stats_bytes // div,
                     "LayerNorm 2 statistics": 2 * S * B * stats_bytes // div}
    assert all(on[n] == off[n] for n in off)
    assert list(on) == [n for n in memory.TERM_NAMES if n in on]


def test_layernorm_statistics_are_not_kept_under_full_recomputation():
    assert memory.activation_terms(S, B, H, A, recompute="full", ln_stats=True) == \
        memory.activation_terms(S, B, H, A, recompute="full")


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
@pytest.mark.parametrize("dropout", [True, False])
def test_fused_attention_replaces_the_s_by_s_tensors_by_a_log_sum_exp(layout, dropout):
    plain = memory.activation_terms(S, B, H, A, dropout=dropout, **layout)
    fused = memory.activation_terms(S, B, H, A, dropout=dropout, fused=True, **layout)
    assert set(plain) - set(fused) == SS_TERMS & set(plain)
    assert set(fused) - set(plain) == {"log-sum-exp (fused kernel)"}
    assert fused["log-sum-exp (fused kernel)"] == A * S * B * 4 // layout["t"]
    assert all(fused[n] == plain[n] for n in plain if n not in SS_TERMS)
    # float32 numbers whatever the activations' type
    assert memory.activation_terms(S, B, H, A, fused=True, itemsize=4, **layout)["log-sum-exp (fused kernel)"] \
        == fused["log-sum-exp (fused kernel)"]


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_fused_attention_under_recomputation_keeps_no_log_sum_exp(recompute):
    assert memory.activation_terms(S, B, H, A, t=2, recompute=recompute, fused=True) == \
        memory.activation_terms(S, B, H, A, t=2, recompute=recompute)


def test_sequence_parallelism_divides_exactly_the_replicated_terms():
    tp = memory.activation_terms(S, B, H, A, t=4, ln_stats=True)
    sp = memory.activation_terms(S, B, H, A, t=4, sp=True, ln_stats=True)
    assert set(tp) == set(sp)
    replicated = {"LayerNorm 1 input", "LayerNorm 1 statistics", "q|k|v input", "attention output dropout mask",
                  "LayerNorm 2 input", "LayerNorm 2 statistics", "fc1 input", "MLP dropout mask"}
    for name in tp:
        assert sp[name] == (tp[name] // 4 if name in replicated else tp[name]), name


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_keeping_the_gathered_inputs_stores_them_whole(t, recompute):
    """keep_gathered: the q|k|v and fc1 inputs as under TP (whole), everything else as under SP."""
    tp = memory.activation_terms(S, B, H, A, t=t, recompute=recompute)
    sp = memory.activation_terms(S, B, H, A, t=t, sp=True, recompute=recompute)
    keep = memory.activation_terms(S, B, H, A, t=t, sp=True, recompute=recompute, keep_gathered=True)
    assert set(keep) == set(sp)
    for name in keep:
        assert keep[name] == (tp[name] if name in memory.GATHERED_INPUTS else sp[name]), name
    # 16-bit: sbh(30/t + 4 + 5as/(ht)) without recomputation, 4sbh(t−1)/t more than Table 2's TP+SP
    sbh = S * B * H
    assert sum(keep.values()) - sum(sp.values()) == 4 * sbh * (t - 1) // t
    if recompute == "none":
        assert sum(keep.values()) == Fraction(sbh) * (Fraction(30, t) + 4 + Fraction(5 * A * S, H * t))


def test_keep_gathered_changes_nothing_under_full_recomputation():
    assert memory.activation_terms(S, B, H, A, t=2, sp=True, recompute="full", keep_gathered=True) == \
        memory.activation_terms(S, B, H, A, t=2, sp=True, recompute="full")


def test_keep_gathered_without_sequence_parallelism_names_the_rule():
    with pytest.raises(ValueError, match=re.escape("keep_gathered needs sequence parallelism (sp=True)")):
        memory.activation_terms(S, B, H, A, t=2, keep_gathered=True)


# ------------------------------------------------------------------ (c) bad sizes

BAD = [
    (dict(s=16, b=2, h=32, a=4, t=3), "tensor parallelism needs t to divide the heads and the hidden size: a=4, h=32, t=3"),
    (dict(s=16, b=2, h=48, a=6, t=4), "tensor parallelism needs t to divide the heads and the hidden size: a=6, h=48, t=4"),
    (dict(s=16, b=2, h=32, a=1, t=2), "tensor parallelism needs t to divide the heads and the hidden size: a=1, h=32, t=2"),
    (dict(s=10, b=2, h=32, a=4, t=4, sp=True), "sequence parallelism needs t to divide the sequence length: s=10, t=4"),
    (dict(s=30, b=2, h=32, a=4, t=4, sp=True, recompute="full"),
     "sequence parallelism needs t to divide the sequence length: s=30, t=4"),
    (dict(s=16, b=2, h=30, a=4), "hidden size h=30 is not divisible by the number of heads a=4"),
    (dict(s=16, b=2, h=32, a=5, t=5), "hidden size h=32 is not divisible by the number of heads a=5"),
    (dict(s=16, b=2, h=32, a=4, recompute="partial"), "recompute must be one of ('none', 'selective', 'full'), got 'partial'"),
    (dict(s=16, b=2, h=32, a=4, recompute=None), "recompute must be one of ('none', 'selective', 'full'), got None"),
    (dict(s=0, b=2, h=32, a=4), "sequence length s must be a whole number ≥ 1, got 0"),
    (dict(s=16.0, b=2, h=32, a=4), "sequence length s must be a whole number ≥ 1, got 16.0"),
    (dict(s=16, b=0, h=32, a=4), "micro-batch b must be a whole number ≥ 1, got 0"),
    (dict(s=16, b=-1, h=32, a=4), "micro-batch b must be a whole number ≥ 1, got -1"),
    (dict(s=16, b=2, h=32.5, a=4), "hidden size h must be a whole number ≥ 1, got 32.5"),
    (dict(s=16, b=2, h="32", a=4), "hidden size h must be a whole number ≥ 1, got '32'"),
    (dict(s=16, b=2, h=32, a=0), "number of heads a must be a whole number ≥ 1, got 0"),
    (dict(s=16, b=2, h=32, a=True), "number of heads a must be a whole number ≥ 1, got True"),
    (dict(s=16, b=2, h=32, a=4, t=0), "tensor-parallel degree t must be a whole number ≥ 1, got 0"),
    (dict(s=16, b=2, h=32, a=4, t=2.0), "tensor-parallel degree t must be a whole number ≥ 1, got 2.0"),
    (dict(s=16, b=2, h=32, a=4, t=None), "tensor-parallel degree t must be a whole number ≥ 1, got None"),
]


@pytest.mark.parametrize("fn", [memory.activation_terms, memory.activation_bytes_per_layer],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("kwargs, message", BAD, ids=[m.split(":")[0][:40] + f"-{i}" for i, (_, m) in enumerate(BAD)])
def test_bad_sizes_name_the_rule(fn, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        fn(**kwargs)


def test_sequence_length_needs_no_divisibility_without_sequence_parallelism():
    assert memory.activation_bytes_per_layer(10, 2, 32, 4, t=4) == table2(10, 2, 32, 4, 4, False, "none")


# ------------------------------------------------------------------ (d) the meter on a dense block

def _measure(block, x):
    with memory.saved_bytes(exclude=block.parameters()) as report:
        y = block(x)
    y.float().sum().backward()                  # the saved tensors must do their job
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
    return report


@pytest.mark.parametrize("recompute", memory.RECOMPUTE)
@pytest.mark.parametrize("fused", [False, True], ids=["written-out", "fused"])
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["p0", "p0.1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_measured_bytes_equal_the_terms_with_matching_assumptions(dtype, p, fused, recompute):
    torch.manual_seed(0)
    block = model.Block(H, A, dropout=p, fused=fused, recompute=recompute).to(dtype)
    x = torch.randn(S, B, H, dtype=dtype, requires_grad=True)
    report = _measure(block, x)
    e = dtype.itemsize
    want = memory.activation_terms(S, B, H, A, recompute=recompute, itemsize=e, dropout=p > 0,
                                   ln_stats=recompute != "full", stats_bytes=e,   # CPU: the input's type
                                   fused=fused and p == 0)                         # the fused kernel: only at p = 0
    assert report.total == sum(want.values()), f"\n{report.table()}\n{want}"
    assert all(d in {str(dtype).removeprefix("torch."), "bool", "float32"} for _, d, _ in report.tensors)
    if recompute == "full":
        assert report.tensors == [((S, B, H), str(dtype).removeprefix("torch."), S * B * H * e)]


def test_eval_mode_keeps_no_dropout_masks():
    torch.manual_seed(0)
    block = model.Block(H, A, dropout=0.1, fused=False).eval()
    report = _measure(block, torch.randn(S, B, H, requires_grad=True))
    want = memory.activation_terms(S, B, H, A, itemsize=4, dropout=False, ln_stats=True, stats_bytes=4)
    assert report.total == sum(want.values())
    assert not any(d == "bool" for _, d, _ in report.tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_attention_with_residual_dropout_keeps_selective_plus_a_log_sum_exp(dtype):
    """Chapter 03's fused row: dropout on the residual stream, none on the attention probabilities."""
    torch.manual_seed(0)
    block = model.Block(H, A, dropout=0.1, fused=True).to(dtype)
    block.attn.p = 0.0                          # scaled_dot_product_attention is the fused kernel only at p = 0
    report = _measure(block, torch.randn(S, B, H, dtype=dtype, requires_grad=True))
    e = dtype.itemsize
    kw = dict(itemsize=e, ln_stats=True, stats_bytes=e)
    fused = memory.activation_terms(S, B, H, A, fused=True, **kw)
    selective = memory.activation_terms(S, B, H, A, recompute="selective", **kw)
    assert report.total == sum(fused.values()), f"\n{report.table()}\n{fused}"
    assert sum(fused.values()) - sum(selective.values()) == A * S * B * 4


def test_sp_block_counts_layernorm_statistics_as_the_kernels_keep_them():
    from intralayer.programs.sp_block import stats_bytes
    assert [stats_bytes(torch.device("cpu"), e) for e in (2, 4)] == [2, 4]     # the activations' own type
    assert [stats_bytes(torch.device("cuda"), e) for e in (2, 4)] == [4, 4]    # float32 (accumulation type)


def test_dropout_masks_are_one_byte():
    torch.manual_seed(0)
    block = model.Block(H, A, dropout=0.1, fused=False)
    report = _measure(block, torch.randn(S, B, H, requires_grad=True))
    masks = sorted(n for _, d, n in report.tensors if d == "bool")
    assert masks == sorted([S * B * H, S * B * H, A * S * S * B])


# ------------------------------------------------------------------ (e) recomputation is exact

def _step(recompute, fused, seed=123):
    torch.manual_seed(0)
    block = model.Block(H, A, dropout=0.1, fused=fused, recompute=recompute)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    up = torch.randn(S, B, H, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(seed)
    y = block(x)
    y.backward(up)
    return y.detach(), x.grad, {n: p.grad for n, p in block.named_parameters()}, torch.get_rng_state()


@pytest.mark.parametrize("fused", [False, True], ids=["written-out", "fused"])
@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recomputation_gives_the_same_output_and_gradients(recompute, fused):
    y0, gx0, grads0, rng0 = _step("none", fused)
    y, gx, grads, rng = _step(recompute, fused)
    # Recomputation repeats the same operations on the same values (and the same dropout
    # masks): bit for bit, tolerance 0.
    assert_close(y, y0, rtol=0, atol=0)
    assert_close(gx, gx0, rtol=0, atol=0)
    assert set(grads) == set(grads0)
    for name in grads0:
        assert grads[name] is not None, name
        assert_close(grads[name], grads0[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
    # The backward pass draws the masks again from a restored state and puts the generator back:
    # the global random stream is where keeping everything would have left it.
    assert torch.equal(rng, rng0)


def test_dropout_is_really_drawn_in_the_recomputation_check():
    """A different seed gives a different output: the check above compares random masks, not none."""
    y1 = _step("full", False, seed=123)[0]
    y2 = _step("full", False, seed=124)[0]
    assert not torch.allclose(y1, y2)


def test_checkpoint_keeps_only_its_inputs_and_restores_the_rng():
    x = torch.randn(64, requires_grad=True)

    def fn(t):
        return torch.nn.functional.dropout(t.exp(), 0.5).sin()

    with memory.saved_bytes() as report:
        y = model.checkpoint(fn, x)
    assert report.tensors == [((64,), "float32", 256)]
    torch.manual_seed(7)
    y = model.checkpoint(fn, x)
    y.sum().backward()
    g_ck = x.grad.clone()
    x.grad = None
    torch.manual_seed(7)
    y0 = fn(x)
    assert_close(y, y0.detach(), rtol=0, atol=0)               # the same ops, the same mask: exact
    y0.sum().backward()
    assert_close(g_ck, x.grad, rtol=0, atol=0)


# ------------------------------------------------------------------ (f) the meter itself

def test_a_storage_saved_twice_is_counted_once():
    x = torch.randn(10, requires_grad=True)
    with memory.saved_bytes() as report:
        y = x * x                                  # mul saves self and other: the same tensor
        z = x.view(2, 5).sin()                     # another view of the same storage, another op
    assert report.tensors == [((10,), "float32", 40)]
    assert report.total == 40
    (y.sum() + z.sum()).backward()


def test_a_saved_view_counts_its_whole_storage():
    base = torch.randn(100, requires_grad=True) * 1       # a non-leaf of 100 numbers
    with memory.saved_bytes() as report:
        y = base[:10].sin()                                # sin saves its input: a view into base
    assert report.tensors == [((10,), "float32", 400)]
    y.sum().backward()


def test_parameters_are_left_out():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    with memory.saved_bytes() as everything:
        lin(x)
    with memory.saved_bytes(exclude=lin.parameters()) as activations:
        lin(x)
    assert activations.tensors == [((5, 4), "float32", 80)]
    assert everything.total == 80 + lin.weight.numel() * 4          # the weight is saved, as a view

    block = model.Block(H, A)
    x = torch.randn(S, B, H, requires_grad=True)
    with memory.saved_bytes() as everything:
        block(x)
    with memory.saved_bytes(exclude=block.parameters()) as activations:
        block(x)
    weights = sum(m.weight.numel() * 4 for m in (block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2))
    extra = everything.total - activations.total
    assert weights <= extra <= sum(p.numel() * 4 for p in block.parameters())
    assert activations.total == sum(memory.activation_terms(S, B, H, A, itemsize=4, dropout=False, ln_stats=True,
                                                            fused=True).values())


def test_nothing_is_counted_without_grad_or_outside_the_block():
    x = torch.randn(10, requires_grad=True)
    with torch.no_grad(), memory.saved_bytes() as report:
        x.sin()
    assert report.tensors == [] and report.total == 0
    with memory.saved_bytes() as report:
        pass
    x.sin()                                         # after the block: not recorded
    assert report.total == 0


def test_report_table_lists_every_tensor_and_the_total():
    x = torch.randn(10, requires_grad=True)
    with memory.saved_bytes() as report:
        (x * 2).exp()                               # mul by a number saves nothing; exp saves its output
    text = report.table(unit=40)
    assert "total" in text and "40" in text and "float32" in text
    assert len(text.splitlines()) == 1 + len(report.tensors) + 1
