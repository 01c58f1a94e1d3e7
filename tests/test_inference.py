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
