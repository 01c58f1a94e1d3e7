"""Tests of intralayer.moe (chapter 05's mixture of experts), on one process.

(a) count_params against Mixtral 8x7B and DeepSeek-V3, recomputed here from the published
    configuration numbers, tensor by tensor.
(b) topk_route: the capacity formula, counts, drops, GShard's priority order (against a
    plain loop written here), the combine weights, the selection bias, bad arguments.
(c) The opening example, its generator replayed: 64 tokens, k=2, capacity factor 1.25 →
    tokens per expert [6, 3, 6, 14, 16, 19, 25, 39], capacity 20, 24 dropped, loss 1.277.
(d) switch_balance_loss against NumPy, its gradient, its range.
(e) bias_update and group_limited_topk.
(f) MoELayer: the grouped forward against the per-token loop, whose routing is its own
    (routes, outputs and gradients, with drops, a bias and groups), and against an
    independent einsum computation; a routing bug planted in the fast path is caught; drops;
    bad inputs.
(g) grouped GEMM: grouped_swiglu's loop, padded and grouped_mm forms against each row computed
    on its own (float64) or against each other (float32), forward and backward; forward_grouped
    against the per-token loop; bad arguments.
(h) router_z_loss against NumPy and its gradient; sigmoid_route against DeepSeek-V3's Gate
    re-typed here; gshard_top2_route against Algorithm 1 written as a loop, and its draw's
    rate; balance_loss and sequence_balance_loss, and the scopes disagreeing.
"""
from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from intralayer import moe

from tests.programs.checks import FLOAT32_REORDERED, rounding_tol


def softmax64_tol(logits: torch.Tensor) -> dict:
    """Two float64 softmaxes of the same logits (or one and its exact sum, 1) agree to γ_n of
    float64, values ≤ 1 (mag 1): each weight exp(z − max)/Σ is within W + 2 + E + 1
    roundings of itself — the argument's (|z − max| ≤ W, the logits' spread), exp's, the sum
    of E terms', the division's — and both sides round: n = 2(W + E + 3). (assert_close's
    float64 defaults, 1e-7, would pass a float32 softmax too.)"""
    spread = float(logits.max() - logits.min())
    return rounding_tol(torch.float64, 2 * (spread + logits.shape[-1] + 3))


# ------------------------------------------------------------------ (a) parameter counts

def mixtral_counts() -> tuple[int, int]:
    """Mixtral 8x7B from its transformers configuration, written out independently."""
    h, f, L, heads, kv, d, V, E, k = 4096, 14336, 32, 32, 8, 128, 32000, 8, 2
    attn = h * heads * d + h * kv * d + h * kv * d + heads * d * h      # q, k, v, o (no biases)
    expert = h * f + h * f + f * h                                      # w1, w3, w2
    router = h * E                                                      # gate, no bias
    norms = 2 * h                                                       # input + post-attention RMSNorm
    embed = head = V * h                                                # untied
    total = embed + head + h + L * (attn + E * expert + router + norms)
    active = embed + head + h + L * (attn + k * expert + router + norms)
    return total, active


def deepseek_v3_counts() -> tuple[int, int]:
    """DeepSeek-V3 from inference/configs/config_671B.json, written out independently."""
    dim, inter, moe_inter, L, dense, heads = 7168, 18432, 2048, 61, 3, 128
    routed, shared, active_experts, V = 256, 1, 8, 129280
    q_lora, kv_lora, nope, rope, v_head = 1536, 512, 128, 64, 128
    wq_a, q_norm = dim * q_lora, q_lora
    wq_b = q_lora * heads * (nope + rope)
    wkv_a, kv_norm = dim * (kv_lora + rope), kv_lora
    wkv_b = kv_lora * heads * (nope + v_head)
    wo = heads * v_head * dim
    attn = wq_a + q_norm + wq_b + wkv_a + kv_norm + wkv_b + wo
    norms = 2 * dim
    dense_mlp = 3 * dim * inter
    expert = 3 * dim * moe_inter
    gate = routed * dim + routed                                        # weight + e_score_correction_bias
    embed = head = V * dim
    common = embed + head + dim + L * (attn + norms) + dense * dense_mlp + (L - dense) * gate
    total = common + (L - dense) * (routed + shared) * expert
    active = common + (L - dense) * (active_experts + shared) * expert
    return total, active


def test_mixtral_counts_match_the_published_sizes():
    total, active = moe.count_params(moe.MIXTRAL_8X7B)
    assert isinstance(total, int) and isinstance(active, int)
    assert (total, active) == mixtral_counts()
    assert round(total, -8) == 46_700_000_000                           # "46.7B"
    assert round(active, -8) == 12_900_000_000                          # "12.9B active"


def test_deepseek_v3_counts_match_the_published_sizes():
    total, active = moe.count_params(moe.DEEPSEEK_V3)
    assert isinstance(total, int) and isinstance(active, int)
    assert (total, active) == deepseek_v3_counts()
    assert round(total, -9) == 671_000_000_000                          # "671B"
    assert 36e9 < active < 38e9                                         # "37B activated"


@pytest.mark.parametrize("config", [moe.MIXTRAL_8X7B, moe.DEEPSEEK_V3], ids=["mixtral", "deepseek"])
def test_breakdown_sums_to_the_totals(config):
    parts = moe.param_breakdown(config)
    assert {"embedding", "attention", "norms", "routed experts", "routers", "output head"} <= set(parts)
    total, active = moe.count_params(config)
    assert sum(t for t, _ in parts.values()) == total
    assert sum(a for _, a in parts.values()) == active
    for name, (t, a) in parts.items():
        assert 0 <= a <= t, name
    # Only the routed experts are partly idle for a token.
    assert [n for n, (t, a) in parts.items() if a != t] == ["routed experts"]


@pytest.mark.parametrize("config", [moe.MIXTRAL_8X7B, moe.DEEPSEEK_V3], ids=["mixtral", "deepseek"])
def test_tied_embeddings_drop_the_head(config):
    tied = dataclasses.replace(config, tied_embeddings=True)
    total, active = moe.count_params(config)
    t_total, t_active = moe.count_params(tied)
    head = config.vocab * config.hidden
    assert (total - t_total, active - t_active) == (head, head)
    assert moe.param_breakdown(tied)["output head"] == (0, 0)


def test_unknown_attention_kind_is_refused():
    bad = dataclasses.replace(moe.MIXTRAL_8X7B, attention="linear")
    with pytest.raises(ValueError, match="attention"):
        moe.count_params(bad)


def test_count_scales_with_the_experts():
    """One more expert per MoE layer adds exactly one expert's three matrices plus a router row."""
    c = moe.MIXTRAL_8X7B
    more = dataclasses.replace(c, experts=c.experts + 1)
    assert moe.count_params(more)[0] - moe.count_params(c)[0] == c.layers * (3 * c.hidden * c.moe_ffn + c.hidden)
    assert moe.count_params(more)[1] - moe.count_params(c)[1] == c.layers * c.hidden     # router row only


# ------------------------------------------------------------------ (b) topk_route

def exact_capacity(cf: str, T: int, k: int, E: int) -> int:
    return math.ceil(Fraction(cf) * T * k / E)


def loop_kept(expert_index: torch.Tensor, E: int, cap: int) -> torch.Tensor:
    """GShard's priority by hand: all first choices (token order), then all second choices…"""
    T, k = expert_index.shape
    used = [0] * E
    kept = torch.zeros(T, k, dtype=torch.bool)
    for j in range(k):
        for t in range(T):
            e = int(expert_index[t, j])
            if used[e] < cap:
                kept[t, j] = True
                used[e] += 1
    return kept


@pytest.mark.parametrize("cf", ["0.1", "0.5", "1", "1.1", "1.2", "1.25", "1.5", "2", "3.3"])
def test_capacity_formula_on_a_grid(cf):
    for T in [1, 3, 7, 10, 16, 64, 100, 1000, 4096, 10000]:
        for E in [1, 2, 4, 8, 16, 64]:
            for k in [1, 2, 4, 8]:
                if k > E:
                    continue
                assert moe.capacity(T, E, k, float(cf)) == exact_capacity(cf, T, k, E), (cf, T, E, k)


@pytest.mark.parametrize("T, E, k, cf, expected", [
    (64, 8, 2, 1.25, 20),        # 64·2·1.25/8 = 20 exactly: not 21
    (64, 8, 1, 1.25, 10),        # exactly 10
    (10, 1, 1, 1.1, 11),         # 1.1·10 is 11.000000000000002 in floating point
    (10, 2, 2, 1.1, 11),
    (100, 10, 1, 1.2, 12),       # 1.2·100/10 = 12.000000000000002
    (30, 10, 1, 1.1, 4),         # 3.3 → 4
    (7, 4, 2, 1.0, 4),           # 3.5 → 4
    (3, 8, 1, 1.0, 1),           # 0.375 → 1
    (16, 4, 2, 0.5, 4),
])
def test_route_capacity_examples(T, E, k, cf, expected):
    r = moe.topk_route(torch.randn(T, E), k, cf)
    assert isinstance(r.capacity, int)
    assert r.capacity == expected


@pytest.mark.parametrize("T, E, k, cf", [
    (64, 8, 2, 1.25), (64, 8, 2, 0.5), (50, 4, 1, 1.0), (33, 6, 3, 0.75),
    (40, 8, 8, 1.0), (17, 5, 2, 2.0), (100, 16, 4, 0.25),
])
def test_route_counts_drops_and_priority(T, E, k, cf):
    torch.manual_seed(T * 1000 + E * 10 + k)
    # Skewed router so that some experts overflow.
    logits = torch.randn(T, E) + torch.linspace(0, 2, E)
    r = moe.topk_route(logits, k, cf)
    assert r.expert_index.shape == (T, k) and r.weights.shape == (T, k)
    assert r.expert_index.dtype == torch.int64
    # Each token's k experts are distinct and are its k best logits, best first.
    assert all(len(set(row.tolist())) == k for row in r.expert_index)
    chosen = logits.gather(1, r.expert_index)
    assert_close(chosen, logits.sort(dim=1, descending=True).values[:, :k], rtol=0, atol=0)   # the same values
    # counts: before dropping.
    assert torch.equal(r.counts, torch.bincount(r.expert_index.flatten(), minlength=E))
    assert int(r.counts.sum()) == T * k
    cap = exact_capacity(str(cf), T, k, E)
    assert r.capacity == cap
    expected_dropped = sum(max(0, int(c) - cap) for c in r.counts)
    assert r.dropped == expected_dropped
    # kept per expert never exceeds capacity, and equals min(count, capacity).
    kept_per_expert = torch.bincount(r.expert_index[r.kept], minlength=E)
    assert (kept_per_expert <= cap).all()
    assert torch.equal(kept_per_expert, torch.clamp(r.counts, max=cap))
    assert torch.equal(r.kept_counts, kept_per_expert)
    # Priority: all first choices before second choices, earlier tokens first.
    assert torch.equal(r.kept, loop_kept(r.expert_index, E, cap))
    # probs: the router's full softmax.
    assert_close(r.probs, torch.softmax(logits, dim=-1))


def test_priority_prefers_first_choices_over_earlier_tokens():
    """Token 0's second choice loses to token 1's first choice for the same expert."""
    # 2 tokens, 2 experts, k=2: capacity ceil(1·2·2/2) = 2 — too roomy, so use cf=0.5 → 1.
    logits = torch.tensor([[1.0, 2.0],      # token 0: expert 1 first, expert 0 second
                           [3.0, 0.0]])     # token 1: expert 0 first, expert 1 second
    r = moe.topk_route(logits, 2, 0.5)
    assert r.capacity == 1
    assert r.expert_index.tolist() == [[1, 0], [0, 1]]
    assert r.kept.tolist() == [[True, False], [True, False]]
    assert r.dropped == 2


def test_weights_are_the_softmax_of_the_chosen_logits():
    torch.manual_seed(0)
    logits = torch.randn(30, 8, dtype=torch.float64, requires_grad=True)
    r = moe.topk_route(logits, 3, 1.0)
    assert r.weights.dtype == torch.float64
    chosen = logits.detach().gather(1, r.expert_index)
    assert_close(r.weights.sum(-1), torch.ones(30, dtype=torch.float64), **softmax64_tol(chosen))
    assert (r.weights[:, :-1] >= r.weights[:, 1:]).all()                 # best first
    assert_close(r.weights, torch.softmax(chosen, dim=-1), **softmax64_tol(chosen))
    # Differentiable in the logits, and only at the chosen columns.
    (r.weights[:, 0]).sum().backward()
    mask = torch.zeros(30, 8, dtype=torch.bool).scatter_(1, r.expert_index, True)
    assert (logits.grad[~mask] == 0).all()
    assert (logits.grad[mask] != 0).any()


def test_k_equal_to_experts_and_k_one():
    logits = torch.randn(12, 4)
    r = moe.topk_route(logits, 4, 1.0)
    assert r.capacity == 12 and r.dropped == 0
    assert r.counts.tolist() == [12] * 4
    r1 = moe.topk_route(logits, 1, 1.0)
    assert_close(r1.weights, torch.ones(12, 1), rtol=0, atol=0)         # softmax of one logit: e^0/e^0 = 1
    assert torch.equal(r1.expert_index[:, 0], logits.argmax(1))


def test_bias_changes_the_choice_not_the_weights_source():
    torch.manual_seed(1)
    T, E, k = 40, 8, 2
    logits = torch.randn(T, E, dtype=torch.float64)
    bias = torch.zeros(E, dtype=torch.float64)
    bias[5] = 100.0                                                       # everyone picks expert 5 …
    bias[2] = 50.0                                                        # … and expert 2
    plain = moe.topk_route(logits, k, 10.0)
    biased = moe.topk_route(logits, k, 10.0, bias=bias)
    assert not torch.equal(plain.expert_index, biased.expert_index)
    assert biased.expert_index.tolist() == [[5, 2]] * T
    assert biased.counts.tolist() == [0, 0, T, 0, 0, T, 0, 0]
    # Weights from the unbiased logits of the chosen experts.
    expected = torch.softmax(logits[:, [5, 2]], dim=-1)
    assert_close(biased.weights, expected, **softmax64_tol(logits))
    biased_softmax = torch.softmax((logits + bias)[:, [5, 2]], dim=-1)
    assert not torch.allclose(biased.weights, biased_softmax)
    # probs stay the unbiased router softmax.
    assert_close(biased.probs, torch.softmax(logits, dim=-1), **softmax64_tol(logits))
    # A small bias that flips only some choices, checked column by column.
    small = torch.linspace(-0.5, 0.5, E, dtype=torch.float64)
    r = moe.topk_route(logits, k, 10.0, bias=small)
    assert torch.equal(r.expert_index, (logits + small).topk(k, dim=-1).indices)
    assert_close(r.weights, torch.softmax(logits.gather(1, r.expert_index), dim=-1), **softmax64_tol(logits))


@pytest.mark.parametrize("logits, k, cf", [
    (torch.randn(8, 4), 5, 1.0),                     # k > E
    (torch.randn(8, 4), 0, 1.0),                     # k = 0
    (torch.randn(8, 4), -1, 1.0),
    (torch.randn(8, 4), 1.5, 1.0),                   # k not whole
    (torch.randn(8, 4), True, 1.0),                  # a bool is not a count
    (torch.randn(8), 1, 1.0),                        # 1-D
    (torch.randn(2, 8, 4), 1, 1.0),                  # 3-D
    (torch.arange(32).reshape(8, 4), 1, 1.0),        # integer logits
    (torch.randn(8, 4), 1, 0.0),                     # cf = 0
    (torch.randn(8, 4), 1, -1.25),                   # cf < 0
    (torch.randn(8, 4), 1, float("nan")),
])
def test_route_rejects_bad_arguments(logits, k, cf):
    with pytest.raises(ValueError):
        moe.topk_route(logits, k, cf)


# ------------------------------------------------------------------ (c) the opening example

OPENING_COUNTS = [6, 3, 6, 14, 16, 19, 25, 39]


def opening_logits() -> np.ndarray:
    """The opening example's router logits: its generator, replayed past the tensor-parallel
    MLP's draws (X, A, B), then (64, 8) normal logits skewed by linspace(0, 1.5, 8)."""
    rng = np.random.default_rng(0)
    rng.standard_normal((6, 8)), rng.standard_normal((8, 32)), rng.standard_normal((32, 8))   # X, A, B
    return rng.standard_normal((64, 8)) + np.linspace(0, 1.5, 8)


def test_opening_example():
    logits = opening_logits()
    r = moe.topk_route(torch.from_numpy(logits), 2, 1.25)
    assert torch.equal(r.expert_index, torch.from_numpy(np.argsort(-logits, axis=1)[:, :2]))   # the lesson's top
    assert r.counts.tolist() == OPENING_COUNTS
    assert r.capacity == 20 == int(1.25 * 64 * 2 / 8)                    # ceiling and floor agree here
    assert r.dropped == 24                                                # (25 − 20) + (39 − 20)
    assert r.kept_counts.tolist() == [min(c, 20) for c in OPENING_COUNTS]
    assert torch.equal(r.kept, loop_kept(r.expert_index, 8, 20))
    assert round(float(moe.switch_balance_loss(torch.from_numpy(logits), r.expert_index)), 3) == 1.277


# ------------------------------------------------------------------ (d) switch_balance_loss

def numpy_balance(logits: np.ndarray, expert_index: np.ndarray) -> float:
    E = logits.shape[1]
    f = np.bincount(expert_index.ravel(), minlength=E) / expert_index.size
    z = logits - logits.max(1, keepdims=True)
    p = (np.exp(z) / np.exp(z).sum(1, keepdims=True)).mean(0)
    return float(E * (f * p).sum())


@pytest.mark.parametrize("T, E, k", [(16, 4, 1), (64, 8, 2), (24, 8, 8)])
def test_balance_loss_is_one_when_uniform(T, E, k):
    logits = torch.zeros(T, E)
    expert_index = (torch.arange(T * k) % E).reshape(T, k)
    loss = moe.switch_balance_loss(logits, expert_index)
    assert loss.dim() == 0
    assert_close(loss, torch.tensor(1.0))


@pytest.mark.parametrize("seed, T, E, k", [(0, 32, 8, 2), (1, 50, 4, 1), (2, 10, 16, 4)])
def test_balance_loss_matches_numpy(seed, T, E, k):
    torch.manual_seed(seed)
    logits = torch.randn(T, E, dtype=torch.float64) * 2
    r = moe.topk_route(logits, k, 1.0)
    loss = moe.switch_balance_loss(logits, r.expert_index)
    assert loss.item() == pytest.approx(numpy_balance(logits.numpy(), r.expert_index.numpy()), rel=1e-12)
    # Any assignment, not only the router's own.
    other = torch.randint(0, E, (T, k))
    loss = moe.switch_balance_loss(logits, other)
    assert loss.item() == pytest.approx(numpy_balance(logits.numpy(), other.numpy()), rel=1e-12)


def test_balance_loss_gradient():
    torch.manual_seed(3)
    logits = torch.randn(20, 6, dtype=torch.float64, requires_grad=True)
    expert_index = logits.detach().topk(2, dim=-1).indices
    loss = moe.switch_balance_loss(logits, expert_index)
    loss.backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert logits.grad.abs().sum() > 0
    # The gradient flows through p only: it matches the analytic one, and gradcheck agrees.
    f = torch.bincount(expert_index.flatten(), minlength=6).double() / expert_index.numel()
    p = torch.softmax(logits.detach(), dim=-1)
    # d/dz_tj of (E/T) Σ_i f_i p_ti = (E/T) p_tj (f_j − Σ_i f_i p_ti)
    expected = 6 / 20 * p * (f - (p * f).sum(1, keepdim=True))
    assert_close(logits.grad, expected)
    assert torch.autograd.gradcheck(lambda z: moe.switch_balance_loss(z, expert_index), (logits,))


def test_balance_loss_grows_as_routing_concentrates():
    T, E = 64, 8
    base = torch.randn(T, E, generator=torch.Generator().manual_seed(4))
    losses = []
    for scale in [0.0, 1.0, 3.0, 10.0]:
        logits = base.clone()
        logits[:, 0] += scale                                             # favour expert 0
        r = moe.topk_route(logits, 1, 1.0)
        losses.append(moe.switch_balance_loss(logits, r.expert_index).item())
    assert all(a < b for a, b in zip(losses, losses[1:])), losses
    # Everything on one expert with a confident router: close to the maximum, E.
    logits = torch.zeros(T, E)
    logits[:, 0] = 50.0
    loss = moe.switch_balance_loss(logits, torch.zeros(T, 1, dtype=torch.long))
    assert loss.item() == pytest.approx(E, rel=1e-6)


# ------------------------------------------------------------------ (e) DeepSeek-V3's balancing

def test_bias_update_sign_rule():
    bias = torch.tensor([0.0, 0.5, -0.5, 1.0, 0.0])
    before = bias.clone()
    counts = torch.tensor([10, 5, 5, 0, 5])                               # mean 5
    new = moe.bias_update(bias, counts, gamma=0.1)
    assert_close(new, torch.tensor([-0.1, 0.5, -0.5, 1.1, 0.0]))
    assert torch.equal(bias, before)                                      # not in place
    assert new.dtype == bias.dtype
    # Default γ and a float64 bias.
    b64 = torch.zeros(4, dtype=torch.float64)
    new = moe.bias_update(b64, [1, 2, 3, 6])                              # mean 3
    assert new.dtype == torch.float64
    want = torch.tensor([1e-3, 1e-3, 0.0, -1e-3], dtype=torch.float64)
    assert_close(new, want, rtol=0, atol=0)                              # 0 − γ·(±1 or 0): exact
    # Repeated updates push load toward balance on a fixed skewed router.
    torch.manual_seed(6)
    logits = torch.randn(256, 8) + torch.linspace(0, 1.5, 8)
    b = torch.zeros(8)
    spread = []
    for step in range(100):
        r = moe.topk_route(logits, 2, 8.0, bias=b)
        spread.append(int(r.counts.max() - r.counts.min()))
        b = moe.bias_update(b, r.counts, gamma=0.01)
    assert min(spread[-20:]) < spread[0] / 2


def reference_group_topk(scores, k, groups, top_groups, bias=None):
    choose = scores if bias is None else scores + bias
    T, E = scores.shape
    n = E // groups
    out = []
    for t in range(T):
        gscore = [sorted(choose[t, g * n:(g + 1) * n].tolist(), reverse=True)[:2] for g in range(groups)]
        gscore = [sum(s) for s in gscore]
        keep = sorted(range(groups), key=lambda g: -gscore[g])[:top_groups]
        allowed = [e for g in keep for e in range(g * n, (g + 1) * n)]
        best = sorted(allowed, key=lambda e: -float(choose[t, e]))[:k]
        out.append(best)
    return torch.tensor(out)


@pytest.mark.parametrize("T, E, groups, top_groups, k", [
    (50, 16, 4, 2, 4), (30, 32, 8, 4, 8), (20, 8, 8, 3, 3), (25, 12, 3, 1, 4), (10, 256, 8, 4, 8),
])
def test_group_limited_topk_respects_groups(T, E, groups, top_groups, k):
    torch.manual_seed(T + E)
    scores = torch.randn(T, E, dtype=torch.float64)
    bias = torch.randn(E, dtype=torch.float64) * 0.3
    for b in [None, bias]:
        idx = moe.group_limited_topk(scores, k, groups, top_groups, bias=b)
        assert idx.shape == (T, k)
        per = E // groups
        for row in idx.tolist():
            assert len(set(row)) == k
            assert len({e // per for e in row}) <= top_groups
        assert torch.equal(idx, reference_group_topk(scores, k, groups, top_groups, b))


def test_group_limited_topk_equals_plain_topk_when_all_groups_are_kept():
    torch.manual_seed(7)
    scores = torch.randn(40, 16)
    bias = torch.randn(16) * 0.5
    for groups in [1, 2, 4, 8, 16]:
        assert torch.equal(moe.group_limited_topk(scores, 4, groups, groups), scores.topk(4, dim=-1).indices)
        assert torch.equal(moe.group_limited_topk(scores, 4, groups, groups, bias=bias),
                           (scores + bias).topk(4, dim=-1).indices)


def test_group_limited_topk_can_differ_from_plain_topk():
    # Token's top-2 experts are 0 (group 0) and 4 (group 1), but group 1 sums higher.
    scores = torch.tensor([[5.0, -9.0, -9.0, -9.0, 4.0, 3.9, -9.0, -9.0]])
    assert moe.group_limited_topk(scores, 2, 2, 1).tolist() == [[4, 5]]
    assert scores.topk(2).indices.tolist() == [[0, 4]]


@pytest.mark.parametrize("E, k, groups, top_groups", [
    (10, 2, 4, 2),      # 10 experts do not split into 4 groups
    (16, 2, 4, 0),      # top_groups < 1
    (16, 2, 4, 5),      # top_groups > groups
    (16, 5, 4, 1),      # 5 experts from one group of 4
    (16, 9, 4, 2),
    (16, 2, 0, 1),      # no groups
])
def test_group_limited_topk_rejects_bad_arguments(E, k, groups, top_groups):
    with pytest.raises(ValueError):
        moe.group_limited_topk(torch.randn(6, E), k, groups, top_groups)


@pytest.mark.parametrize("k, top_groups", [(0, 2), (-1, 2), (1.5, 2), (2, 1.5)])
def test_group_limited_topk_rejects_non_counts(k, top_groups):
    with pytest.raises(ValueError):
        moe.group_limited_topk(torch.randn(6, 16), k, 4, top_groups)


# ------------------------------------------------------------------ (f) MoELayer

H, FFN = 12, 20


def close64(got, want):
    """A float64 MoE layer against its per-token loop or its einsum twin: γ_n of float64 with
    n = 256, over twice (both sides round) the longest chain of roundings here, < 128: the
    router's H = 12 terms and its softmax (~20), an expert's H-term products, SiLU, its
    FFN = 20-term product, the combine's ≤ 5 terms and the shared expert's, and backward
    the sums over ≤ 24 tokens; atol for terms up to mag = 64, four times the largest entry
    compared, which is below 16 (checked). assert_close's float64 defaults (1e-7) would pass
    float32 arithmetic too (errors ~1e-6 here); float64's measure ~5e-15."""
    assert float(want.detach().abs().max()) < 16, "an entry of 16 or more: close64's mag no longer holds"
    assert_close(got, want, **rounding_tol(torch.float64, 256, mag=64))


def make_layer(E, k, cf, shared, seed=0):
    torch.manual_seed(seed)
    layer = moe.MoELayer(H, FFN, E, k, cf, shared=shared).double()
    return layer


def independent_output(layer, x, route):
    """Σ_j kept · w_tj · w2_e (silu(w1_e x_t) ⊙ w3_e x_t) (+ shared), computed expert-blind."""
    w1 = layer.w1[route.expert_index]                                     # (T, k, f, h)
    w3 = layer.w3[route.expert_index]
    w2 = layer.w2[route.expert_index]                                     # (T, k, h, f)
    a = torch.einsum("tkfh,th->tkf", w1, x)
    b = torch.einsum("tkfh,th->tkf", w3, x)
    y = torch.einsum("tkhf,tkf->tkh", w2, F.silu(a) * b)                  # (T, k, h)
    out = (y * (route.weights * route.kept).unsqueeze(-1)).sum(1)
    if layer.shared is not None:
        s = layer.shared
        out = out + F.linear(F.silu(F.linear(x, s["w1"].weight)) * F.linear(x, s["w3"].weight), s["w2"].weight)
    return out


def grads(layer, x, out, g):
    params = [x, layer.router.weight, layer.w1, layer.w2, layer.w3]
    if layer.shared is not None:
        params += [layer.shared[n].weight for n in ("w1", "w2", "w3")]
    return torch.autograd.grad((out * g).sum(), params, allow_unused=False)


CASES = [
    # T, E, k, cf, shared, starve (an expert nobody picks)
    (16, 4, 2, 4.0, False, False),       # roomy: nothing dropped
    (16, 4, 1, 2.0, True, False),
    (24, 8, 2, 0.5, True, False),        # tight: drops
    (24, 8, 2, 0.5, False, False),
    (20, 6, 3, 1.0, True, True),         # an idle expert
    (20, 6, 2, 0.4, False, True),        # an idle expert and drops
    (9, 5, 5, 1.0, True, False),         # k = experts
    (1, 4, 2, 1.0, True, False),         # a single token
]


@pytest.mark.parametrize("T, E, k, cf, shared, starve", CASES)
def test_forward_equals_naive_forward(T, E, k, cf, shared, starve):
    layer = make_layer(E, k, cf, shared, seed=T * 7 + E)
    gen = torch.Generator().manual_seed(T + 100 * E)
    x = torch.randn(T, H, dtype=torch.float64, generator=gen)
    if starve:
        # Positive tokens and a negative router row: expert E−1 never wins.
        x = x.abs() + 0.1
        with torch.no_grad():
            layer.router.weight[E - 1] = -1.0
    x.requires_grad_(True)
    out, r = layer(x)
    out_n, r_n = layer.forward_naive(x)
    assert out.shape == (T, H) and out.dtype == torch.float64
    assert torch.equal(r.expert_index, r_n.expert_index) and torch.equal(r.kept, r_n.kept)
    if starve:
        assert r.counts[E - 1] == 0
    if cf < 1 and T > 1:
        assert r.dropped > 0
    close64(out, out_n)
    close64(out, independent_output(layer, x.detach(), r))
    # The route is the router's.
    ref = moe.topk_route(layer.router(x.detach()), k, cf)
    assert torch.equal(r.expert_index, ref.expert_index) and torch.equal(r.kept, ref.kept)
    g = torch.randn(T, H, dtype=torch.float64, generator=gen)
    for a, b in zip(grads(layer, x, out, g), grads(layer, x, out_n, g)):
        assert torch.isfinite(a).all()
        close64(a, b)


def test_forward_with_bias_equals_naive_and_can_idle_an_expert():
    layer = make_layer(6, 2, 1.0, True, seed=11)
    x = torch.randn(18, H, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(6, dtype=torch.float64)
    bias[2] = -1e4
    out, r = layer(x, bias=bias)
    out_n, _ = layer.forward_naive(x, bias=bias)
    assert r.counts[2] == 0
    close64(out, out_n)
    g = torch.randn_like(out)
    for a, b in zip(grads(layer, x, out, g), grads(layer, x, out_n, g)):
        close64(a, b)
    # Expert 2 gets no gradient: it saw no token.
    gw1 = torch.autograd.grad((layer(x, bias=bias)[0] * g).sum(), layer.w1)[0]
    assert (gw1[2] == 0).all() and (gw1.abs().sum() > 0)


def test_naive_routes_on_its_own():
    """forward_naive's route, computed without topk_route, is the one topk_route promises:
    each token's k best logits, queues filled choice rank first then token order."""
    for T, E, k, cf, groups, top_groups in [(40, 8, 2, 0.5, 1, None), (33, 6, 3, 0.75, 1, None),
                                            (48, 16, 4, 0.6, 4, 2), (30, 8, 2, 1.0, 2, 1)]:
        torch.manual_seed(T + E)
        layer = moe.MoELayer(H, FFN, E, k, cf, groups=groups, top_groups=top_groups).double()
        x = torch.randn(T, H, dtype=torch.float64)
        logits = layer.router(x).detach()
        _, r = layer.forward_naive(x)
        if groups == 1:
            assert_close(logits.gather(1, r.expert_index), logits.sort(dim=1, descending=True).values[:, :k],
                         rtol=0, atol=0)
        else:
            assert torch.equal(r.expert_index, reference_group_topk(logits, k, groups, top_groups))
        assert r.capacity == exact_capacity(str(cf), T, k, E)
        assert r.dropped > 0, "each case should drop"
        assert torch.equal(r.kept, loop_kept(r.expert_index, E, r.capacity))
        assert torch.equal(r.counts, torch.bincount(r.expert_index.flatten(), minlength=E))
        assert_close(r.weights, torch.softmax(logits.gather(1, r.expert_index), dim=-1), **softmax64_tol(logits))
        assert_close(r.probs, torch.softmax(logits, dim=-1), **softmax64_tol(logits))
        ref = moe.topk_route(logits, k, cf, groups=groups, top_groups=top_groups)
        assert torch.equal(r.expert_index, ref.expert_index) and torch.equal(r.kept, ref.kept)


@pytest.mark.parametrize("groups, top_groups, with_bias", [(4, 2, False), (4, 1, True), (2, 2, True)])
def test_group_limited_layer_equals_naive(groups, top_groups, with_bias):
    torch.manual_seed(groups * 10 + top_groups)
    layer = moe.MoELayer(H, FFN, 8, 2, 0.75, shared=True, groups=groups, top_groups=top_groups).double()
    x = torch.randn(24, H, dtype=torch.float64, requires_grad=True)
    bias = torch.linspace(-0.3, 0.3, 8, dtype=torch.float64) if with_bias else None
    out, r = layer(x, bias=bias)
    out_n, r_n = layer.forward_naive(x, bias=bias)
    assert torch.equal(r.expert_index, r_n.expert_index) and torch.equal(r.kept, r_n.kept)
    assert r.dropped > 0
    per = 8 // groups
    assert all(len({e // per for e in row}) <= top_groups for row in r_n.expert_index.tolist())
    close64(out, out_n)
    g = torch.randn_like(out)
    for a, b in zip(grads(layer, x, out, g), grads(layer, x, out_n, g)):
        close64(a, b)


def test_empty_batch():
    layer = moe.MoELayer(H, FFN, 4, 2).double()
    x = torch.zeros(0, H, dtype=torch.float64)
    for out, r in (layer(x), layer.forward_naive(x)):
        assert out.shape == (0, H) and r.expert_index.shape == (0, 2) and r.kept.shape == (0, 2)
        assert r.dropped == 0 and r.capacity == 0


TOPK_ROUTE = moe.topk_route


def token_major_route(logits, k, capacity_factor, bias=None, groups=1, top_groups=None):
    """A plausible bug: queues filled token by token (token 0's first and second choice,
    then token 1's …) instead of all first choices before any second choice."""
    r = TOPK_ROUTE(logits, k, capacity_factor, bias, groups, top_groups)
    T, E = logits.shape
    room = [r.capacity] * E
    kept = torch.zeros(T, k, dtype=torch.bool)
    for t in range(T):
        for j in range(k):
            e = int(r.expert_index[t, j])
            if room[e] > 0:
                room[e] -= 1
                kept[t, j] = True
    return dataclasses.replace(r, kept=kept)


def test_a_routing_bug_in_the_fast_path_is_caught(monkeypatch):
    """The reference routes on its own, so a wrong drop order in topk_route shows up."""
    layer = make_layer(8, 2, 0.5, False, seed=3)
    x = torch.randn(24, H, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    out, r = layer(x)
    close64(out, layer.forward_naive(x)[0])
    monkeypatch.setattr(moe, "topk_route", token_major_route)
    bad, r_bad = layer(x)
    good, r_n = layer.forward_naive(x)
    assert r_bad.dropped == r_n.dropped == r.dropped                     # the same number dropped …
    assert not torch.equal(r_bad.kept, r_n.kept)                          # … but not the same ones
    assert torch.equal(r_n.kept, r.kept)
    assert float((bad - good).detach().abs().max()) > 1e-3


@pytest.mark.parametrize("shared", [False, True])
def test_fully_dropped_token_gets_only_the_shared_expert(shared):
    T, E, k = 32, 4, 2
    layer = make_layer(E, k, 0.25, shared, seed=21)                       # capacity ceil(0.25·32·2/4) = 4
    x = torch.randn(T, H, dtype=torch.float64)
    out, r = layer(x)
    assert r.capacity == 4
    gone = (~r.kept).all(dim=1).nonzero().flatten().tolist()
    assert gone, "the example should drop some token entirely"
    expected = layer.shared(x) if shared else torch.zeros(T, H, dtype=torch.float64)
    for t in gone:
        close64(out[t], expected[t])
    # Partly dropped tokens: only their kept assignments count.
    close64(out, independent_output(layer, x, r))
    out_n, _ = layer.forward_naive(x)
    close64(out, out_n)
    # A fully dropped token's input reaches no routed expert: its gradient comes from the
    # shared expert alone (and, through the router, only via kept assignments — none here).
    xg = x.clone().requires_grad_(True)
    w1_grad = torch.autograd.grad(layer(xg)[0][gone].sum(), layer.w1, allow_unused=True)[0]
    assert w1_grad is None or (w1_grad == 0).all()


@pytest.mark.parametrize("by_expert", [True, False])
def test_assignments_list_the_kept_choices(by_expert):
    """Route.assignments, the preamble MoELayer and expert parallelism share: every kept
    (token, expert, weight), written out here from the route's (T, k) tables — in token order,
    a token's choices best first, or grouped by expert with token order kept within an expert."""
    logits = torch.randn(12, 4, generator=torch.Generator().manual_seed(5))
    r = moe.topk_route(logits, 2, 0.75)
    assert r.dropped > 0                                                  # some choices are not kept
    want = [(t, int(r.expert_index[t, j]), float(r.weights[t, j])) for t in range(12) for j in range(2)
            if r.kept[t, j]]
    if by_expert:
        want = sorted(want, key=lambda a: a[1])                           # Python's sort is stable
    token, expert, weight = r.assignments(by_expert)
    assert list(zip(token.tolist(), expert.tolist(), weight.tolist())) == want


def test_the_shared_expert_is_a_swiglu_mlp_with_named_layers():
    torch.manual_seed(6)
    shared = moe.SharedExpert(H, FFN).double()
    assert [name for name, _ in shared.named_parameters()] == ["w1.weight", "w3.weight", "w2.weight"]
    x = torch.randn(5, H, dtype=torch.float64)
    w1, w3, w2 = (shared[n].weight for n in ("w1", "w3", "w2"))
    close64(shared(x), (F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T)


@pytest.mark.parametrize("x", [
    torch.randn(5, H + 1),                      # wrong hidden size
    torch.randn(H),                             # 1-D
    torch.randn(2, 5, H),                       # 3-D
    torch.ones(5, H, dtype=torch.long),         # integer
    [[0.0] * H] * 5,                            # not a tensor
])
def test_layer_rejects_bad_inputs(x):
    layer = moe.MoELayer(H, FFN, 4, 2)
    with pytest.raises(ValueError):
        layer(x)
    with pytest.raises(ValueError):
        layer.forward_naive(x)


@pytest.mark.parametrize("kwargs", [
    dict(hidden=H, ffn=FFN, experts=4, k=5),
    dict(hidden=H, ffn=FFN, experts=4, k=0),
    dict(hidden=H, ffn=FFN, experts=0, k=1),
    dict(hidden=0, ffn=FFN, experts=4, k=1),
    dict(hidden=H, ffn=2.5, experts=4, k=1),
])
def test_layer_constructor_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError):
        moe.MoELayer(**kwargs)


@pytest.mark.parametrize("cf", [0.0, -1.0])
def test_layer_constructor_rejects_bad_capacity_factor(cf):
    with pytest.raises(ValueError):
        moe.MoELayer(H, FFN, 4, 2, cf)


@pytest.mark.parametrize("cf", [0.0, -1.0])
def test_layer_with_bad_capacity_factor_fails_by_the_first_forward(cf):
    """Whenever it is caught, a factor ≤ 0 is a ValueError, not a silent empty layer."""
    with pytest.raises(ValueError):
        layer = moe.MoELayer(H, FFN, 4, 2, cf)
        layer(torch.randn(3, H))


def test_layer_shapes_and_parameters():
    layer = moe.MoELayer(H, FFN, 4, 2, shared=True)
    assert layer.experts == 4
    assert layer.w1.shape == (4, FFN, H) and layer.w3.shape == (4, FFN, H) and layer.w2.shape == (4, H, FFN)
    assert layer.router.weight.shape == (4, H) and layer.router.bias is None
    n = sum(p.numel() for p in layer.parameters())
    assert n == 4 * 3 * H * FFN + 3 * H * FFN + 4 * H
    assert sum(p.numel() for p in moe.MoELayer(H, FFN, 4, 2).parameters()) == 4 * 3 * H * FFN + 4 * H


# ------------------------------------------------------------------ (g) grouped GEMM

def grouped_case(E, f, sizes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(sizes), H, dtype=dtype, generator=g)
    w1 = torch.randn(E, f, H, dtype=dtype, generator=g) / H ** 0.5
    w3 = torch.randn(E, f, H, dtype=dtype, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, f, dtype=dtype, generator=g) / f ** 0.5
    return x, w1, w3, w2


def expert_by_expert(x, sizes, w1, w3, w2):
    """The experts written out row by row: row r of expert e is w2_e (silu(w1_e x_r) ⊙ w3_e x_r)."""
    rows, e_of = [], [e for e, n in enumerate(sizes) for _ in range(n)]
    for r, e in enumerate(e_of):
        rows.append(w2[e] @ (F.silu(w1[e] @ x[r]) * (w3[e] @ x[r])))
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])


SIZES = [[5, 0, 3, 7], [1, 1, 1, 1], [0, 0, 9, 0], [12, 0, 0, 4]]


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("impl, pad", [("loop", None), ("padded", None), ("padded", 13)])
def test_grouped_swiglu_equals_the_experts_row_by_row(sizes, impl, pad):
    """float64: 'loop' and 'padded' (to the busiest expert, or to a capacity of 13 rows) against
    each row computed on its own, forward and backward, empty experts included."""
    x, w1, w3, w2 = (t.requires_grad_() for t in grouped_case(4, FFN, sizes, torch.float64))
    y = moe.grouped_swiglu(x, sizes, w1, w3, w2, impl, pad_to=pad)
    want = expert_by_expert(x, sizes, w1, w3, w2)
    assert y.shape == (sum(sizes), H)
    close64(y, want)
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, [x, w1, w3, w2], dy), torch.autograd.grad(want, [x, w1, w3, w2], dy)):
        close64(a, b)
    # An expert with no rows gets a zero gradient, not none.
    gw1 = torch.autograd.grad(moe.grouped_swiglu(x, sizes, w1, w3, w2, impl, pad_to=pad).sum(), w1)[0]
    for e, n in enumerate(sizes):
        if n == 0:
            assert (gw1[e] == 0).all()


@pytest.mark.parametrize("sizes", SIZES)
def test_grouped_mm_equals_the_loop_in_float32(sizes):
    """torch's grouped_mm (on CPU a loop of mm inside ATen) against the Python loop, float32, forward
    and backward: the same products, so within float32's reordering tolerance; a broadcast
    gradient (``.sum().backward()``) is accepted."""
    f = 16                                                    # 16 × 4 bytes: a row of a multiple of 16 bytes
    x, w1, w3, w2 = (t.requires_grad_() for t in grouped_case(4, f, sizes, torch.float32, seed=1))
    y = moe.grouped_swiglu(x, sizes, w1, w3, w2, "grouped_mm")
    want = moe.grouped_swiglu(x, sizes, w1, w3, w2, "loop")
    assert_close(y, want, **FLOAT32_REORDERED)
    dy = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, [x, w1, w3, w2], dy), torch.autograd.grad(want, [x, w1, w3, w2], dy)):
        assert_close(a, b, **FLOAT32_REORDERED)
    moe.grouped_swiglu(x, sizes, w1, w3, w2, "grouped_mm").sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (x, w1, w3, w2))


def test_grouped_swiglu_on_no_rows():
    for impl in ("loop", "padded"):
        x, w1, w3, w2 = grouped_case(3, FFN, [0, 0, 0], torch.float64)
        assert moe.grouped_swiglu(x, [0, 0, 0], w1, w3, w2, impl).shape == (0, H)
    x, w1, w3, w2 = grouped_case(3, 16, [0, 0, 0], torch.float32)
    assert moe.grouped_swiglu(x, [0, 0, 0], w1, w3, w2, "grouped_mm").shape == (0, H)


def test_padded_rows():
    assert moe.padded_rows([5, 0, 3, 7]) == 28
    assert moe.padded_rows([5, 0, 3, 7], pad_to=10) == 40
    assert moe.padded_rows([]) == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(impl="einsum"), "impl"),
    (dict(sizes=[5, 0, 3]), "sizes"),
    (dict(sizes=[5, 0, 3, 6]), "sizes"),
    (dict(sizes=[5, 0, -3, 13]), "row count"),
    (dict(impl="padded", pad_to=6), "pad_to"),
    (dict(impl="grouped_mm", pad_to=7), "pad_to"),
    (dict(impl="grouped_mm", dtype=torch.float64), "float64"),
    (dict(impl="grouped_mm", f=FFN + 1), "16 bytes"),
])
def test_grouped_swiglu_refuses(kwargs, match):
    dtype, f = kwargs.pop("dtype", torch.float32), kwargs.pop("f", 16)
    x, w1, w3, w2 = grouped_case(4, f, [5, 0, 3, 7], dtype)
    sizes = kwargs.pop("sizes", [5, 0, 3, 7])
    with pytest.raises(ValueError, match=match):
        moe.grouped_swiglu(x, sizes, w1, w3, w2, **kwargs)
    with pytest.raises(ValueError, match="w1, w3"):
        moe.grouped_swiglu(x, [5, 0, 3, 7], w1, w3, w2.transpose(1, 2), "loop")


@pytest.mark.parametrize("T, E, k, cf, shared, groups, top_groups, with_bias", [
    (24, 8, 2, 0.5, True, 1, None, False),          # drops
    (20, 6, 3, 1.0, False, 1, None, True),
    (24, 8, 2, 0.75, True, 4, 2, True),             # group-limited
    (9, 5, 5, 1.0, True, 1, None, False),           # k = experts
    (1, 4, 2, 1.0, False, 1, None, False),
])
@pytest.mark.parametrize("impl", ["loop", "padded"])
def test_forward_grouped_equals_the_per_token_loop(T, E, k, cf, shared, groups, top_groups, with_bias, impl):
    torch.manual_seed(T * 3 + E)
    layer = moe.MoELayer(H, FFN, E, k, cf, shared=shared, groups=groups, top_groups=top_groups).double()
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    bias = torch.linspace(-0.3, 0.3, E, dtype=torch.float64) if with_bias else None
    out, r = layer.forward_grouped(x, bias=bias, impl=impl)
    out_n, r_n = layer.forward_naive(x, bias=bias)
    assert torch.equal(r.expert_index, r_n.expert_index) and torch.equal(r.kept, r_n.kept)
    close64(out, out_n)
    g = torch.randn_like(out)
    for a, b in zip(grads(layer, x, out, g), grads(layer, x, out_n, g)):
        close64(a, b)
    # Padded to the capacity, the static-shape layout: the same result.
    if impl == "padded":
        close64(layer.forward_grouped(x, bias=bias, impl="padded", pad_to=r.capacity)[0], out_n)


def test_forward_grouped_with_grouped_mm_equals_forward_in_float32():
    torch.manual_seed(2)
    layer = moe.MoELayer(16, 32, 8, 2, 0.75, shared=True)                      # 16 and 32 floats: 16-byte rows
    x = torch.randn(40, 16, requires_grad=True)
    out, r = layer(x)
    out_g, r_g = layer.forward_grouped(x, impl="grouped_mm")
    assert torch.equal(r.kept, r_g.kept) and r.dropped > 0
    assert_close(out_g, out, **FLOAT32_REORDERED)
    g = torch.randn_like(out)
    params = [x, layer.router.weight, layer.w1, layer.w2, layer.w3]
    for a, b in zip(torch.autograd.grad((out_g * g).sum(), params), torch.autograd.grad((out * g).sum(), params)):
        assert_close(a, b, **FLOAT32_REORDERED)


def test_forward_grouped_refuses_bad_inputs():
    layer = moe.MoELayer(H, FFN, 4, 2)
    with pytest.raises(ValueError):
        layer.forward_grouped(torch.randn(5, H + 1))
    with pytest.raises(ValueError, match="impl"):
        layer.forward_grouped(torch.randn(5, H), impl="bmm")


# ------------------------------------------------------------------ (h) router numerics, DeepSeek's and GShard's routers, scopes

def test_router_z_loss_against_numpy_and_its_gradient():
    torch.manual_seed(8)
    z = torch.randn(30, 8, dtype=torch.float64) * 3
    want = np.mean(np.log(np.exp(z.numpy()).sum(1)) ** 2)
    assert float(moe.router_z_loss(z)) == pytest.approx(want, rel=1e-12)
    zg = z.clone().requires_grad_()
    moe.router_z_loss(zg).backward()
    lse = torch.logsumexp(z, -1, keepdim=True)
    close64(zg.grad, 2 / 30 * lse * torch.softmax(z, -1))                # (2/T) lse_t p_tj
    assert torch.autograd.gradcheck(moe.router_z_loss, (z.clone().requires_grad_(),))


def test_router_z_loss_sees_the_shift_softmax_ignores():
    z = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    losses = [float(moe.router_z_loss(z + c)) for c in (-2.0, 0.0, 5.0, 40.0)]
    assert losses[1] < losses[2] < losses[3]
    close64(torch.softmax(z + 40.0, -1), torch.softmax(z, -1))
    # Its minimum over a common shift is where the mean logsumexp is 0.
    c = -float(torch.logsumexp(z, -1).mean())
    best = float(moe.router_z_loss(z + c))
    assert all(best <= float(moe.router_z_loss(z + c + d)) for d in (-0.1, 0.1))
    with pytest.raises(ValueError):
        moe.router_z_loss(torch.randn(8))
    with pytest.raises(ValueError):
        moe.router_z_loss(torch.ones(4, 4, dtype=torch.long))


def deepseek_gate(logits, k, bias, route_scale, groups, top_groups):
    """DeepSeek-V3's inference/model.py Gate.forward, re-typed here for sigmoid scores."""
    scores = logits.sigmoid()
    original = scores
    if bias is not None:
        scores = scores + bias
    if groups > 1:
        scores = scores.view(logits.size(0), groups, -1)
        group_scores = scores.amax(dim=-1) if bias is None else scores.topk(2, dim=-1)[0].sum(dim=-1)
        indices = group_scores.topk(top_groups, dim=-1)[1]
        mask = scores.new_ones(logits.size(0), groups, dtype=torch.bool).scatter_(1, indices, False)
        scores = scores.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
    indices = torch.topk(scores, k, dim=-1)[1]
    weights = original.gather(1, indices)
    weights = weights / weights.sum(dim=-1, keepdim=True) * route_scale
    return weights, indices


@pytest.mark.parametrize("groups, top_groups", [(1, None), (8, 4), (4, 1)])
def test_sigmoid_route_is_deepseek_v3s_gate(groups, top_groups):
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(50, 32, dtype=torch.float64, generator=g)
    bias = torch.randn(32, dtype=torch.float64, generator=g) * 0.1
    r = moe.sigmoid_route(logits, 8, bias=bias, route_scale=2.5, groups=groups, top_groups=top_groups)
    w, idx = deepseek_gate(logits, 8, bias, 2.5, groups, top_groups or groups)
    assert torch.equal(r.expert_index, idx)
    close64(r.weights, w)
    close64(r.weights.sum(-1), torch.full((50,), 2.5, dtype=torch.float64))
    assert r.kept.all() and r.dropped == 0 and r.capacity == 50
    assert torch.equal(r.counts, torch.bincount(idx.flatten(), minlength=32))
    s = torch.sigmoid(logits)
    close64(r.probs, s / s.sum(-1, keepdim=True))                        # DeepSeek-V3's s'


def test_sigmoid_route_chooses_as_the_logits_do_without_a_bias():
    logits = torch.randn(40, 16, generator=torch.Generator().manual_seed(11))
    r = moe.sigmoid_route(logits, 4)
    assert torch.equal(r.expert_index, logits.topk(4, dim=-1).indices)  # sigmoid keeps the order
    with pytest.raises(ValueError):
        moe.sigmoid_route(logits, 17)
    with pytest.raises(ValueError):
        moe.sigmoid_route(logits, 2, route_scale=0.0)
    with pytest.raises(ValueError):
        moe.sigmoid_route(logits, 2, bias=torch.zeros(15))


def gshard_by_hand(logits, cf, rnd, declined_take_a_slot=False):
    """Algorithm 1 of GShard (one group), with the draw ``rnd`` given, as a plain loop. A second
    choice the draw turns down takes no place in the queue, unless ``declined_take_a_slot``:
    then, as Algorithm 1 is printed, the expert's counter c_e2 advances for it all the same."""
    T, E = logits.shape
    gates = torch.softmax(logits, -1)
    cap = moe.capacity(T, E, 2, cf)
    count = [0] * E
    kept = torch.zeros(T, 2, dtype=torch.bool)
    top = [gates[t].topk(2) for t in range(T)]
    for t in range(T):                                                   # first choices
        e1 = int(top[t].indices[0])
        if count[e1] < cap:
            kept[t, 0] = True
        count[e1] += 1
    for t in range(T):                                                   # second choices, drawn
        g1, g2 = (float(v) for v in top[t].values)
        e2 = int(top[t].indices[1])
        drawn = 2 * g2 / (g1 + g2) > rnd[t]
        if drawn and count[e2] < cap:
            kept[t, 1] = True
        if drawn or declined_take_a_slot:
            count[e2] += 1
    return kept


@pytest.mark.parametrize("T, E, cf, seed", [(64, 8, 1.0, 0), (100, 4, 0.5, 1), (33, 6, 2.0, 2)])
def test_gshard_top2_route_follows_algorithm_1(T, E, cf, seed):
    logits = torch.randn(T, E, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) \
        + torch.linspace(0, 2, E, dtype=torch.float64)
    r, sampled = moe.gshard_top2_route(logits, cf, generator=torch.Generator().manual_seed(seed + 100))
    rnd = torch.rand(T, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)
    assert torch.equal(r.kept, gshard_by_hand(logits, cf, rnd))
    plain = moe.topk_route(logits, 2, cf)
    assert torch.equal(r.expert_index, plain.expert_index) and r.capacity == plain.capacity
    close64(r.weights, plain.weights)                                    # g1/(g1+g2): the softmax of the two
    assert torch.equal(sampled, 2 * plain.weights[:, 1] > rnd)
    assert torch.equal(r.kept[:, 1] & ~sampled, torch.zeros(T, dtype=torch.bool))
    assert (r.kept_counts <= r.capacity).all()
    assert int(r.counts.sum()) == T + int(sampled.sum())
    printed, sampled_p = moe.gshard_top2_route(logits, cf, generator=torch.Generator().manual_seed(seed + 100),
                                               declined_take_a_slot=True)
    assert torch.equal(sampled_p, sampled)                               # the same draw
    assert torch.equal(printed.kept, gshard_by_hand(logits, cf, rnd, declined_take_a_slot=True))
    assert torch.equal(printed.kept[:, 0], r.kept[:, 0])                 # first choices: the same queue
    assert not (printed.kept & ~r.kept).any()                            # a held slot only ever drops more


def test_gshard_printed_rule_differs_where_a_declined_choice_holds_a_slot():
    # Capacity 1 per expert. Token 0's second choice, expert 1, has 2·g2 ≈ 0.013 and the draw
    # declines it; token 1's second choice is expert 1 too, with 2·g2 ≈ 0.995, and is drawn.
    # Freed (the default), token 1 takes expert 1's one place; held (Algorithm 1 as printed), the
    # declined choice already advanced expert 1's counter, and token 1's is dropped.
    logits = torch.tensor([[5.0, 0.0, -9.0, -9.0], [-9.0, 4.99, 5.0, -9.0]], dtype=torch.float64)
    rnd = torch.rand(2, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    freed, s_f = moe.gshard_top2_route(logits, 1.0, generator=torch.Generator().manual_seed(0))
    held, s_h = moe.gshard_top2_route(logits, 1.0, generator=torch.Generator().manual_seed(0),
                                      declined_take_a_slot=True)
    assert freed.capacity == 1 and float(2 * freed.weights[0, 1]) < rnd[0] and float(2 * freed.weights[1, 1]) > rnd[1]
    assert torch.equal(s_f, s_h) and s_f.tolist() == [False, True]
    assert freed.kept.tolist() == [[True, False], [True, True]]
    assert held.kept.tolist() == [[True, False], [True, False]]
    with pytest.raises(ValueError, match="declined_take_a_slot"):
        moe.gshard_top2_route(logits, 1.0, declined_take_a_slot=1)


def test_gshard_dispatches_the_second_expert_with_probability_2_g2():
    logits = torch.randn(20000, 8, generator=torch.Generator().manual_seed(12)) * 1.5
    r, sampled = moe.gshard_top2_route(logits, 8.0, generator=torch.Generator().manual_seed(13))
    p = float((2 * r.weights[:, 1]).mean())
    assert abs(float(sampled.float().mean()) - p) < 4 * (p * (1 - p) / 20000) ** 0.5   # within 4 standard errors
    assert r.kept[:, 0].all()                                            # roomy: every first choice kept
    with pytest.raises(ValueError):
        moe.gshard_top2_route(torch.randn(5, 1), 1.0)
    with pytest.raises(ValueError):
        moe.gshard_top2_route(torch.randn(5, 4), 0.0)


def test_balance_loss_is_switch_balance_loss_with_counts():
    torch.manual_seed(14)
    logits = torch.randn(40, 8, dtype=torch.float64) * 2
    r = moe.topk_route(logits, 2, 1.0)
    got = moe.balance_loss(torch.softmax(logits, -1), torch.bincount(r.expert_index.flatten(), minlength=8))
    assert float(got) == pytest.approx(float(moe.switch_balance_loss(logits, r.expert_index)), rel=1e-12)
    uniform = moe.balance_loss(torch.full((10, 4), 0.25, dtype=torch.float64), torch.tensor([3, 3, 3, 3]))
    assert float(uniform) == pytest.approx(1.0, rel=1e-15)
    for bad in (torch.tensor([1, 2, 3]), torch.tensor([1, -1, 2, 2])):
        with pytest.raises(ValueError):
            moe.balance_loss(torch.full((10, 4), 0.25), bad)


def test_sequence_balance_loss_averages_the_sequences():
    g = torch.Generator().manual_seed(15)
    probs = torch.softmax(torch.randn(48, 6, dtype=torch.float64, generator=g), -1)
    index = torch.randint(0, 6, (48, 2), generator=g)
    want = np.mean([float(moe.balance_loss(probs[s:s + 12], torch.bincount(index[s:s + 12].flatten(), minlength=6)))
                    for s in range(0, 48, 12)])
    assert float(moe.sequence_balance_loss(probs, index, 12)) == pytest.approx(want, rel=1e-12)
    one = moe.sequence_balance_loss(probs, index, 48)                   # one sequence: the batch's loss
    assert float(one) == pytest.approx(float(moe.balance_loss(probs, torch.bincount(index.flatten(), minlength=6))),
                                       rel=1e-12)
    p = probs.clone().requires_grad_()
    moe.sequence_balance_loss(p, index, 12).backward()
    assert p.grad.abs().sum() > 0
    with pytest.raises(ValueError):
        moe.sequence_balance_loss(probs, index, 10)                     # 48 tokens are not sequences of 10
    with pytest.raises(ValueError):
        moe.sequence_balance_loss(probs, index[:40], 12)


def test_the_scopes_disagree_on_domain_sequences():
    """Sequences of one domain each, the domains even over the batch: balanced globally, not per sequence."""
    E, S = 4, 8
    index = torch.tensor([[d, d] for d in range(E) for _ in range(S)])           # sequence d sends all to expert d
    probs = F.one_hot(index[:, 0], E).double() * 0.7 + 0.3 / E
    batch = moe.balance_loss(probs, torch.bincount(index.flatten(), minlength=E))
    per_sequence = moe.sequence_balance_loss(probs, index, S)
    assert float(batch) == pytest.approx(1.0) and float(per_sequence) > 3.0
