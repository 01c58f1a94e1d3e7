"""Tests of intralayer.inference (chapter 09's pieces, issue 29).

(a) On one process: cached greedy decoding equals uncached decoding for multi-head,
    grouped-query and multi-query attention; the cache's size and its refusals.
(b) On 2 and 4 ranks: tensor-parallel decoding equals the dense model, token for token; so do a
    context-parallel prefill with decoding from the spread cache and a follow-up turn by either ring,
    their bytes equal to the formulas, and MoE serving with data-parallel attention and expert
    parallelism (tests/programs/inference_checks.py); the two programs on 1, 2 and 4 ranks.
(c) The cost models: all-reduce algorithms and their crossover, pass-KV against pass-Q (with the
    partials' log-sum-exps), the serving planner and its search, the MoE serving memory (MLA's latent
    cache, which tensor parallelism cannot split), each with a plausible wrong answer rejected.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from intralayer import inference as inf
from intralayer.model import TinyGPT

ROOT = Path(__file__).resolve().parents[1]
from tests.programs import inference_checks
ENV = {"PYTHONPATH": str(ROOT)}


@pytest.mark.parametrize("kv_heads", [None, 2, 1])
def test_cached_decoding_equals_recomputing_the_sequence(kv_heads):
    torch.manual_seed(0)
    model = TinyGPT(64, 32, 4, layers=2, kv_heads=kv_heads).eval()
    prompt = torch.randint(0, 64, (5, 3))
    got, caches = inf.greedy_decode(model, prompt, 8)
    want, _ = inf.greedy_reference(model, prompt, 8)
    assert torch.equal(got, want)
    assert [c.length for c in caches] == [12, 12]                  # the prompt and 7 fed tokens
    assert sum(c.nbytes for c in caches) == inf.kv_cache_bytes(2, kv_heads or 4, 8, 13 * 3, itemsize=4)


def test_a_cache_that_ignores_earlier_positions_is_caught():
    """The check above must fail on a wrong cache: attend to the new token only."""
    torch.manual_seed(0)
    model = TinyGPT(64, 32, 4, layers=2).eval()
    prompt = torch.randint(0, 64, (5, 3))
    want, _ = inf.greedy_reference(model, prompt, 8)
    real = inf.KVCache.append

    def forgetful(self, k, v):
        keys, values = real(self, k, v)
        return keys[:, :, -k.shape[2]:], values[:, :, -k.shape[2]:]
    inf.KVCache.append = forgetful
    try:
        got, _ = inf.greedy_decode(model, prompt, 8)
    except RuntimeError:                                            # the prefill's mask no longer fits
        got = None
    finally:
        inf.KVCache.append = real
    assert got is None or not torch.equal(got, want)


@pytest.mark.parametrize("args, words", [
    (dict(layers=80, kv_heads=8, head_dim=128, t=3), "multiple or a divisor"),
    (dict(layers=0, kv_heads=8, head_dim=128), "layers L"),
    (dict(layers=80, kv_heads=8, head_dim=128, tokens=-1), "tokens"),
])
def test_kv_cache_bytes_refuses_in_words(args, words):
    with pytest.raises(ValueError, match=words):
        inf.kv_cache_bytes(**args)


def test_kv_cache_bytes_at_llama3_70b():
    """2·L·a_kv·d·e per token: 80 layers, 8 key/value heads of 128, bf16 (the Llama 3 paper's
    Table 3 shape); split by t up to t = a_kv, the same beyond."""
    per_token = inf.kv_cache_bytes(80, 8, 128)
    assert per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert inf.kv_cache_bytes(80, 8, 128, t=8) == per_token // 8
    assert inf.kv_cache_bytes(80, 8, 128, t=16) == per_token // 8


def test_the_cache_refuses_what_does_not_fit():
    cache = inf.KVCache.empty(1, 2, 4, 8)
    cache.append(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8))
    with pytest.raises(ValueError, match="exceed s_max"):
        cache.append(torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8))
    with pytest.raises(ValueError, match=r"\(b, kv, n, d\)"):
        cache.append(torch.zeros(1, 3, 1, 8), torch.zeros(1, 3, 1, 8))
    with pytest.raises(ValueError, match="whole number"):
        inf.KVCache.empty(1, 0, 4, 8)
    with pytest.raises(ValueError, match="TinyGPT or a ParallelGPT"):
        inf.forward_cached(torch.nn.Linear(2, 2), torch.zeros(1, 1, dtype=torch.long), [])


@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("check", inference_checks.CHECKS, ids=lambda c: c.__name__)
def test_tensor_parallel_decoding_matches_the_dense_model(on_ranks, nproc, check):
    on_ranks(inference_checks, check, nproc, env=ENV, timeout=120)


# ---------------------------------------------------------------------------- the program on real ranks

@pytest.mark.parametrize("nproc", [2, 4])
def test_the_decode_program_asserts_and_reports(pool, nproc):
    result = pool("intralayer.programs.inference_decode", nproc, env=ENV, timeout=120)
    assert "all checks passed on every rank" in result.output
    assert f"1 + 2·2 = {inf.decode_all_reduces(2)} all-reduces of b·h·e = 3·32·4 = 384 bytes" in result.output


# ---------------------------------------------------------------------------- the all-reduce cost models

from intralayer.collectives import collective_time

A, B = 1.9e-6, 450e9


@pytest.mark.parametrize("n", [2, 4, 8])
def test_allreduce_models_are_the_formulas(n):
    S = 16_384
    assert inf.allreduce_time("ring", n, S, B, A) == collective_time("all_reduce", n, S, B, A)
    assert inf.allreduce_time("one-shot", n, S, B, A) == pytest.approx(A + (n - 1) * S / B, rel=1e-12)
    assert inf.allreduce_time("two-shot", n, S, B, A) == pytest.approx(2 * A + 2 * (n - 1) / n * S / B, rel=1e-12)
    assert inf.allreduce_time("auto", n, S, B, A) == min(
        inf.allreduce_time(x, n, S, B, A) for x in ("ring", "one-shot", "two-shot"))
    assert inf.allreduce_time("one-shot", 1, S, B, A) == 0.0


@pytest.mark.parametrize("n", [3, 4, 8])
def test_the_crossover_is_where_one_shot_and_two_shot_meet(n):
    s_star = inf.one_shot_crossover(n, B, A)
    one, two = (inf.allreduce_time(x, n, s_star, B, A) for x in ("one-shot", "two-shot"))
    assert one == pytest.approx(two, rel=1e-12)
    assert inf.allreduce_time("one-shot", n, s_star / 2, B, A) < inf.allreduce_time("two-shot", n, s_star / 2, B, A)
    assert inf.allreduce_time("one-shot", n, s_star * 2, B, A) > inf.allreduce_time("two-shot", n, s_star * 2, B, A)
    # a plausible wrong crossover (the bandwidth terms' difference taken as (n-1)S/B alone) is rejected
    wrong = A * B / (n - 1)
    assert inf.allreduce_time("one-shot", n, wrong, B, A) != pytest.approx(inf.allreduce_time("two-shot", n, wrong, B, A))


def test_on_two_ranks_one_shot_always_wins():
    assert inf.one_shot_crossover(2, B, A) == float("inf")
    for S in (1e3, 1e6, 1e9):
        assert inf.allreduce_time("one-shot", 2, S, B, A) < inf.allreduce_time("two-shot", 2, S, B, A)


@pytest.mark.parametrize("call, words", [
    (lambda: inf.allreduce_time("tree", 4, 1, B, A), "one of"),
    (lambda: inf.allreduce_time("ring", 0, 1, B, A), "ranks n"),
    (lambda: inf.allreduce_time("ring", 4, -1, B, A), "size S"),
    (lambda: inf.one_shot_crossover(1, B, A), "ranks n"),
    (lambda: inf.ring_pass_bytes("pass-O", 8, 0, 8, 8, 128, 2), "variant"),
    (lambda: inf.ring_pass_bytes("pass-Q", 7, 0, 8, 8, 128, 2), "split evenly"),
    (lambda: inf.ring_pass_bytes("pass-Q", 8, 0, 8, 3, 128, 2), "multiple"),
])
def test_cost_models_refuse_in_words(call, words):
    with pytest.raises(ValueError, match=words):
        call()


# ---------------------------------------------------------------------------- pass-KV against pass-Q

def test_pass_kv_and_pass_q_bytes():
    a, a_kv, d, P = 128, 8, 128, 4                                  # Llama 3 405B's heads
    kv = inf.ring_pass_bytes("pass-KV", 1024, 0, a, a_kv, d, P)
    q = inf.ring_pass_bytes("pass-Q", 1024, 0, a, a_kv, d, P)
    assert kv == 3 * 2 * 256 * a_kv * d * 2 and q == 3 * 2 * 256 * a * d * 2
    assert q == 16 * kv                                             # a full prefill: pass-KV, 16x fewer bytes
    # at new / (new + cached) = a_kv / a the two rings send the same bytes
    new, cached = 1024, 1024 * 15
    assert new / (new + cached) == inf.pass_q_threshold(a, a_kv)
    assert inf.ring_pass_bytes("pass-KV", new, cached, a, a_kv, d, P) == inf.ring_pass_bytes("pass-Q", new, cached, a, a_kv, d, P)
    assert inf.ring_pass_bytes("pass-Q", 128, cached, a, a_kv, d, P) < inf.ring_pass_bytes("pass-KV", 128, cached, a, a_kv, d, P)


# ---------------------------------------------------------------------------- the serving planner

from intralayer import planner

H100 = planner.CLUSTERS["1024× H100 (128 nodes of 8, InfiniBand)"]
LLAMA70, LLAMA405 = planner.MODELS["Llama 3 70B"], planner.MODELS["Llama 3 405B"]


def test_weights_per_gpu():
    assert inf.weight_bytes_per_gpu(LLAMA70, 1) == 2 * planner.params(LLAMA70)["total"]
    for t in (2, 4, 8):                                             # t ≤ a_kv: all but the norms split t ways
        norms = 2 * (2 * LLAMA70.layers * LLAMA70.hidden + LLAMA70.hidden)
        assert t * inf.weight_bytes_per_gpu(LLAMA70, t) - (t - 1) * norms == pytest.approx(
            inf.weight_bytes_per_gpu(LLAMA70, 1), rel=1e-12)
    with pytest.raises(ValueError, match="mixture of experts"):
        inf.weight_bytes_per_gpu(planner.MODELS["DeepSeek-V3"], 8)


def test_serve_plan_memory_and_time():
    p = inf.serve_plan(LLAMA70, H100, 8, 32, 4096)
    assert p.kv_per_token == 327_680 // 8
    assert p.kv == 327_680 // 8 * 32 * 4096
    assert p.max_tokens == int((80e9 - p.weights) // (327_680 // 8))
    assert p.step == max(p.step_memory, p.step_compute) + p.step_comm
    assert p.step_comm == pytest.approx(161 * inf.allreduce_time("ring", 8, 32 * 8192 * 2, H100.intra, 1.9e-6)
                                        + collective_time("all_gather", 8, 32 * 128256 * 2, H100.intra, 1.9e-6))
    assert p.tokens_per_s_per_gpu == pytest.approx(32 / p.step / 8)
    assert inf.serve_plan(LLAMA70, H100, 1, 1, 1).step_comm == 0.0
    assert not inf.serve_plan(LLAMA70, H100, 1, 1, 1).fits and inf.serve_plan(LLAMA70, H100, 1, 1, 1).max_tokens == 0
    assert inf.serve_plan(LLAMA70, H100, 8, 1, 1, algorithm="one-shot").step_comm < \
        inf.serve_plan(LLAMA70, H100, 8, 1, 1, algorithm="ring").step_comm


def test_serve_plan_adds_the_per_call_latency_to_every_collective():
    from intralayer.collectives import NCCL_BASE_US
    assert inf.NCCL_RING_BASE_US == {"LL": 6.6, "LL128": 14.0, "Simple": NCCL_BASE_US}
    base, c = inf.serve_plan(LLAMA70, H100, 8, 32, 4096), 14e-6
    p = inf.serve_plan(LLAMA70, H100, 8, 32, 4096, call_latency=c)
    assert p.step_comm == pytest.approx(base.step_comm + 162 * c, rel=1e-12)      # 161 all-reduces and one gather
    assert p.prefill_comm == pytest.approx(base.prefill_comm + 161 * c, rel=1e-12)
    assert (p.weights, p.kv, p.step_memory, p.step_compute) == (base.weights, base.kv, base.step_memory, base.step_compute)
    assert inf.serve_plan(LLAMA70, H100, 1, 32, 4096, call_latency=c).step_comm == 0.0   # no collective at t = 1
    with pytest.raises(ValueError, match="call_latency"):
        inf.serve_plan(LLAMA70, H100, 8, 32, 4096, call_latency=-1e-6)


def test_an_h200_holds_llama_405b_at_t8_where_an_h100_does_not():
    import dataclasses
    h200 = dataclasses.replace(H100, memory=inf.H200_MEMORY)
    assert not inf.serve_plan(LLAMA405, H100, 8, 1, 1).fits
    p = inf.serve_plan(LLAMA405, h200, 8, 1, 1, hbm=inf.H200_HBM_BANDWIDTH)
    assert p.fits and p.max_tokens == int((141e9 - p.weights) // p.kv_per_token)
    assert p.step_memory == pytest.approx((p.weights + p.kv) / 4.8e12)


@pytest.mark.parametrize("kw, words", [
    (dict(t=16), "one NVLink node"),
    (dict(t=3), "do not split"),
    (dict(t=8, batch=0), "batch b"),
])
def test_serve_plan_refuses_in_words(kw, words):
    args = dict(m=LLAMA70, cluster=H100, t=8, batch=1, context=1) | kw
    with pytest.raises(ValueError, match=words):
        inf.serve_plan(**args)


# ---------------------------------------------------------------------------- attention by positions (serving)

from intralayer import serving as sv
from intralayer.context_parallel import merge_partials
from intralayer.moe import MoELayer, param_breakdown as moe_param_breakdown


def _sdpa_by_positions(q, k, v, q_pos, k_pos):
    g = q.shape[1] // k.shape[1]
    k, v = (x.repeat_interleave(g, 1) for x in (k, v))
    mask = k_pos[None, :] <= q_pos[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)


def test_partial_results_merge_to_causal_attention():
    """Keys in four sets of scattered positions, one empty and one no query can see: the merged partial
    results equal attention over all the keys (float64 reference; float32 work, a chain of ≤ 12 terms)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g)
    q_pos, k_pos = torch.tensor([3, 7, 9, 10, 11]), torch.randperm(12, generator=g)
    want = _sdpa_by_positions(q, k, v, q_pos, k_pos)
    sets = [torch.arange(0, 5), torch.arange(5, 5), torch.arange(5, 9), torch.arange(9, 12)]
    parts = [sv.partial_attention(q, q_pos, k[:, :, s], v[:, :, s], k_pos[s]) for s in sets]
    got = sv.merge_all([o for o, _ in parts], [l for _, l in parts])
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    # plausible wrong answers are rejected: averaging the non-empty partial outputs; a strict mask (no token
    # sees itself: the queries' positions taken one lower)
    avg = sum(o for o, _ in parts if o.abs().sum()) / 3
    assert not torch.allclose(avg.double(), want, atol=1e-3)
    strict = [sv.partial_attention(q, q_pos - 1, k[:, :, s], v[:, :, s], k_pos[s]) for s in sets]
    assert not torch.allclose(sv.merge_all([o for o, _ in strict], [l for _, l in strict]).double(), want, atol=1e-3)


def test_a_query_that_sees_no_key_passes_over():
    q, k, v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    out, lse = sv.partial_attention(q, torch.tensor([0]), k, v, torch.tensor([1, 2, 3]))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    seen, seen_lse = sv.partial_attention(q, torch.tensor([5]), k, v, torch.tensor([1, 2, 3]))
    merged, _ = merge_partials(out, lse, seen, seen_lse)
    assert torch.equal(merged, seen)
    empty = sv.partial_attention(q, torch.tensor([5]), k[:, :, :0], v[:, :, :0], torch.tensor([], dtype=torch.long))
    assert torch.isneginf(empty[1]).all()


@pytest.mark.parametrize("call, words", [
    (lambda: sv.partial_attention(torch.randn(1, 3, 1, 4), torch.tensor([0]), torch.randn(1, 2, 2, 4),
                                  torch.randn(1, 2, 2, 4), torch.tensor([0, 1])), "dividing"),
    (lambda: sv.partial_attention(torch.randn(1, 2, 1, 4), torch.tensor([0, 1]), torch.randn(1, 2, 2, 4),
                                  torch.randn(1, 2, 2, 4), torch.tensor([0, 1])), "one position per token"),
    (lambda: sv.partial_attention(torch.randn(2, 4), torch.tensor([0]), torch.randn(1, 2, 2, 4),
                                  torch.randn(1, 2, 2, 4), torch.tensor([0, 1])), "4 dimensions"),
    (lambda: sv.merge_all([], []), "at least one"),
    (lambda: sv.cp_prefill(torch.nn.Linear(2, 2), torch.zeros(4, 1, dtype=torch.long), None, 8), "TinyGPT"),
    (lambda: sv.cp_extend(TinyGPT(8, 8, 2), torch.zeros(4, 1, dtype=torch.long), None, None, "pass-O"), "variant"),
    (lambda: sv.moe_forward_cached(TinyGPT(8, 8, 2), torch.zeros(1, 1, dtype=torch.long), []), "MoEGPT"),
    (lambda: sv.MoEGPT(8, 8, 2, 8, 4, 2, layers=0), "layers L"),
    (lambda: sv.ep_decode_bytes(-1, 2, 4, 8), "tokens"),
    (lambda: sv.cached_numbers_per_token(object()), "planner Model"),
    (lambda: sv.greedy_continue(TinyGPT(8, 8, 2), torch.zeros(3), 2, None, None), "2 dimensions"),
])
def test_serving_refuses_in_words(call, words):
    with pytest.raises(ValueError, match=words):
        call()


# ---------------------------------------------------------------------------- the MoE model served

def _moe(seed=11, **kw):
    torch.manual_seed(seed)
    return sv.MoEGPT(64, 32, 4, 48, 8, 2, layers=2, kv_heads=2, **kw).eval()


def test_cached_moe_decoding_equals_recomputing():
    model, prompt = _moe(), torch.randint(0, 64, (5, 3), generator=torch.Generator().manual_seed(8))
    want, _ = inf.greedy_reference(model, prompt, 6)
    caches = inf.new_caches(model, 3, 11)
    logits, got = sv.moe_forward_cached(model, prompt, caches)[-1], []
    for _ in range(6):
        got.append(logits.argmax(-1))
        logits = sv.moe_forward_cached(model, got[-1][None], caches)[-1]
    assert torch.equal(torch.stack(got), want)


def test_the_serving_moe_layer_drops_nothing():
    """Capacity factor E/k: capacity = the batch's tokens, so an expert takes every token that picks it,
    whatever the other requests; a factor of 1 (as in training) drops tokens of this skewed batch."""
    model = _moe()
    layer = model.blocks[0].moe
    x = torch.randn(40, 32, generator=torch.Generator().manual_seed(1)) + 3 * layer.router.weight[0]
    _, route = layer(x)
    assert route.capacity == 40 and route.dropped == 0
    training = MoELayer(32, 48, 8, 2, capacity_factor=1.0)
    training.load_state_dict(layer.state_dict())
    assert training(x)[1].dropped > 0


# ---------------------------------------------------------------------------- the serving arithmetic

DEEPSEEK, MIXTRAL = planner.MODELS["DeepSeek-V3"], planner.MODELS["Mixtral 8x7B"]


def test_mla_caches_a_latent_that_tensor_parallelism_cannot_split():
    """DeepSeek-V3: kv_lora_rank 512 + qk_rope_head_dim 64 numbers per token and layer, 61 layers, bf16:
    70,272 bytes per token on every GPU of an attention replica, whatever t; Mixtral's GQA cache splits."""
    assert sv.cached_numbers_per_token(DEEPSEEK) == (576, False)
    for t in (1, 2, 4, 8):
        s = sv.moe_serving_memory(DEEPSEEK, 32, t)
        assert s.kv_per_token == 61 * 576 * 2 == 70_272
        assert s.tokens == 32 // t * s.tokens_per_replica
        # a wrong answer: the latent split t ways like heads
        assert t == 1 or s.kv_per_token != 70_272 / t
        assert sv.moe_serving_memory(MIXTRAL, 8, t).kv_per_token == inf.kv_cache_bytes(32, 8, 128, 1, t)


def test_moe_serving_weights():
    """At t = 1 a GPU holds everything but the routed experts, and 1/P of those (moe.count_params' totals);
    raising t divides the attention, shared experts, dense MLPs and tables, not the norms and routers."""
    p = planner.params(DEEPSEEK)
    for P in (32, 256):
        one = sv.moe_serving_memory(DEEPSEEK, P, 1, itemsize=1)
        assert one.experts == pytest.approx(p["experts"] / P, rel=1e-12)
        assert one.weights == pytest.approx(p["total"] - p["experts"] + p["experts"] / P, rel=1e-12)
        parts = moe_param_breakdown(DEEPSEEK.moe_config)
        whole = parts["norms"][0] + parts["routers"][0]
        four = sv.moe_serving_memory(DEEPSEEK, P, 4, itemsize=1)
        assert four.weights - four.experts == pytest.approx((one.weights - one.experts - whole) / 4 + whole, rel=1e-12)


@pytest.mark.parametrize("kw, words", [
    (dict(m=planner.MODELS["Llama 3 70B"], P=8), "experts"),
    (dict(m=DEEPSEEK, P=32, t=3), "does not divide"),
    (dict(m=DEEPSEEK, P=24), "experts"),
])
def test_moe_serving_memory_refuses_in_words(kw, words):
    with pytest.raises(ValueError, match=words):
        sv.moe_serving_memory(**kw)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_ep_decode_bytes_against_the_routing(P):
    """A router that spreads assignments exactly evenly (token i to experts i and i+1 mod E): the dispatch
    simulated per rank sends ep_decode_bytes/2; counting every copy, the local ones too, is rejected."""
    from intralayer import expert_parallel as ep
    E, k, T, h = 8, 2, 16, 32
    logits = torch.full((T, E), -10.0)
    for i in range(T):
        logits[i, i % E], logits[i, (i + 1) % E] = 2.0, 1.0
    sim = ep.simulate([logits] * P, k, E / k, P)
    sent = sim.bytes(h, 2).sum(1)
    assert (sent == sv.ep_decode_bytes(T, k, P, h) / 2).all()
    assert (sent != 2 * T * k * h * 2 / 2).all()


# ---------------------------------------------------------------------------- the serving program, the new counts

@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_the_serve_program_asserts_and_reports(pool, nproc):
    result = pool("intralayer.programs.inference_serve", nproc, env=ENV, timeout=180)
    assert "all checks passed on every rank" in result.output
    per_rank = inf.ring_pass_bytes("pass-KV", 16, 0, 4, 4, 8, nproc, itemsize=4) * 2 * 3       # L·b·pass-KV
    assert f"   4             yes {per_rank:16,d} {per_rank:12,d}" in result.output


def test_the_serve_program_refuses_sizes_that_do_not_split():
    from intralayer.programs import inference_serve
    from argparse import Namespace
    with pytest.raises(ValueError, match="multiples of P"):
        inference_serve.check_sizes(Namespace(prompt=16, steps=4, follow=8, experts=8), 4)
    with pytest.raises(ValueError, match="not divisible by 2P"):
        inference_serve.check_sizes(Namespace(prompt=12, steps=5, follow=8, experts=8), 4)


def test_pass_q_counts_its_partials_and_their_log_sum_exps():
    a, a_kv, d, P, new = 128, 8, 128, 8, 8192
    with_lse = inf.ring_pass_bytes("pass-Q", new, 0, a, a_kv, d, P, itemsize=2, lse=True, partial_itemsize=4)
    assert with_lse == (P - 1) * new // P * a * (d * 2 + (d + 1) * 4)
    assert with_lse != inf.ring_pass_bytes("pass-Q", new, 0, a, a_kv, d, P, itemsize=2)      # lse and e_p told apart
    # at the exact threshold the two rings send the same bytes; a_kv/a alone is not it
    share = inf.pass_q_threshold(a, a_kv, d, itemsize=2, lse=True, partial_itemsize=4)
    cached = new / share - new
    kv = (P - 1) / P * 2 * (cached + new) * a_kv * d * 2
    assert kv == pytest.approx(with_lse, rel=1e-12)
    assert share < inf.pass_q_threshold(a, a_kv) == inf.pass_q_threshold(a, a_kv, d) == a_kv / a


def test_serve_plan_with_narrower_weights():
    p2 = inf.serve_plan(LLAMA70, H100, 8, 32, 4096)
    p1 = inf.serve_plan(LLAMA70, H100, 8, 32, 4096, weight_itemsize=1)
    assert p1.weights == pytest.approx(p2.weights / 2, rel=1e-12) and p1.kv == p2.kv
    assert p1.step_memory == pytest.approx((p2.weights / 2 + p2.kv) / inf.H100_HBM_BANDWIDTH, rel=1e-12)
    with pytest.raises(ValueError, match="weight_itemsize"):
        inf.serve_plan(LLAMA70, H100, 8, 32, 4096, weight_itemsize=0)


def test_serve_search_keeps_the_best_plan_that_fits_in_time():
    """15 ms a token at 8,192 tokens of context: the time binds at t = 4 and 8 (larger batches fit but are
    slower), memory at t = 2 (nothing fits at t = 1: 141 GB of weights)."""
    latency = 0.015
    best = inf.serve_search(LLAMA70, H100, 8192, latency, algorithm="two-shot")
    assert best[1] is None
    bound = 0
    for t, p in best.items():
        every = [inf.serve_plan(LLAMA70, H100, t, b, 8192, algorithm="two-shot") for b in inf.SERVE_BATCHES]
        ok = [q for q in every if q.fits and q.step <= latency]
        if p is None:
            assert not ok
            continue
        assert p.fits and p.step <= latency
        assert p.tokens_per_s_per_gpu == max(q.tokens_per_s_per_gpu for q in ok)
        # a plausible wrong search: the largest batch that fits, ignoring the time per token
        largest = max((q for q in every if q.fits), key=lambda q: q.batch)
        bound += largest.batch != p.batch
    assert bound >= 2, "the latency never bound: the test could not tell the wrong search apart"
    with pytest.raises(ValueError, match="latency"):
        inf.serve_search(LLAMA70, H100, 8192, 0)
