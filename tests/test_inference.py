"""Tests of intralayer.inference (chapter 09's pieces, issue 29).

(a) On one process: cached greedy decoding equals uncached decoding for multi-head,
    grouped-query and multi-query attention; the cache's size and its refusals.
(b) On 2 and 4 ranks: tensor-parallel decoding equals the dense model, token for token
    (tests/programs/inference_checks.py).
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


@pytest.mark.parametrize("kw, words", [
    (dict(t=16), "one NVLink node"),
    (dict(t=3), "do not split"),
    (dict(t=8, batch=0), "batch b"),
])
def test_serve_plan_refuses_in_words(kw, words):
    args = dict(m=LLAMA70, cluster=H100, t=8, batch=1, context=1) | kw
    with pytest.raises(ValueError, match=words):
        inf.serve_plan(**args)
