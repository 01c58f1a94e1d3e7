"""Check intralayer.inference's tensor-parallel decode against the dense model, on real ranks.

Every rank builds the same dense TinyGPT (same seed) and the same prompts, decodes them
greedily without a cache (the model's own forward over the whole sequence at every step),
and checks its :class:`~intralayer.tensor_parallel.ParallelGPT` decoding with a KV cache:

- the same tokens, step for step, for multi-head, grouped-query (a_kv = 2) and multi-query
  (a_kv = 1) attention: with a_kv < t the ranks share key/value heads (chapter 02's gather);
- the logits of every step (the gathered vocabulary) close to the dense model's;
- the bytes each rank's caches hold equal to ``kv_cache_bytes``'s formula, and the cache
  filled to the prompt plus every decoded token but the last;
- the collectives of one decode step, recorded by ``comm.accounting``: the embedding's
  all-reduce, two all-reduces per block of b·h numbers, the logits' all-gather of b·v, and
  nothing else.

Any mismatch raises, so the rank fails.
"""
from __future__ import annotations

import torch

from intralayer import comm, inference
from intralayer.model import TinyGPT
from intralayer.tensor_parallel import ParallelGPT
from tests.programs.checks import close, expect

VOCAB, H, HEADS, LAYERS = 64, 32, 4, 2          # vocabulary and heads divisible by 2 and 4
S0, B, STEPS = 5, 3, 8                           # prompt length, sequences, tokens decoded
D = H // HEADS


def dense_model(kv_heads: int | None) -> TinyGPT:
    torch.manual_seed(7)
    return TinyGPT(VOCAB, H, HEADS, layers=LAYERS, kv_heads=kv_heads).eval()


def check_decode(n, r, group):
    prompt = torch.randint(0, VOCAB, (S0, B), generator=torch.Generator().manual_seed(3))
    for kv in (None, 2, 1):
        what = f"decode with a_kv = {kv or HEADS} on {n} ranks"
        dense = dense_model(kv)
        want, logits = inference.greedy_reference(dense, prompt, STEPS)
        par = ParallelGPT.from_dense(dense, group).eval()
        got, caches = inference.greedy_decode(par, prompt, STEPS)
        expect(torch.equal(got, want), f"{what}: tokens {got.T.tolist()} differ from the dense model's {want.T.tolist()}")
        # the logits of each step, from a cached run of the same tokens
        caches2 = inference.new_caches(par, B, S0 + STEPS)
        ids = prompt
        for step in range(STEPS):
            full = comm.all_gather(inference.forward_cached(par, ids, caches2), -1, group)[-1]
            close(full, logits[step], f"{what}: logits at step {step}")
            ids = want[step][None]
        per_rank = sum(c.nbytes for c in caches)
        formula = inference.kv_cache_bytes(LAYERS, kv or HEADS, D, (S0 + STEPS) * B, t=n, itemsize=4)
        expect(per_rank == formula, f"{what}: the caches hold {per_rank} bytes on rank {r}, the formula {formula}")
        # a formula that splits a shared key/value head (a_kv/t without the floor of 1) must disagree
        wrong = 2 * LAYERS * ((kv or HEADS) // n) * D * 4 * (S0 + STEPS) * B
        expect((kv or HEADS) >= n or per_rank != wrong, f"{what}: the a_kv/t formula {wrong} was not told apart")
        expect(all(c.length == S0 + STEPS - 1 for c in caches), f"{what}: cache lengths {[c.length for c in caches]}")
        # one decode step's collectives
        with comm.accounting() as acc:
            comm.all_gather(inference.forward_cached(par, want[0][None], inference.new_caches(par, B, 1)), -1, group)
        expect(acc.count("all_reduce") == 1 + 2 * LAYERS,
               f"{what}: {acc.count('all_reduce')} all-reduces in one decode step, expected 1 + 2·L = {1 + 2 * LAYERS}")
        expect(all(rec.elements == B * H for rec in acc.select("all_reduce")),
               f"{what}: all-reduces of {[rec.elements for rec in acc.select('all_reduce')]} numbers, not b·h = {B * H}")
        gathers = acc.select("all_gather")
        shared = kv is not None and kv < n                            # a_kv < t: q|k|v gathered per block
        expect(len(gathers) == 1 + (LAYERS if shared else 0),
               f"{what}: {len(gathers)} all-gathers, expected the logits'" + (" and one per block" if shared else ""))
        expect(acc.count() == len(acc.select("all_reduce")) + len(gathers), f"{what}: other collectives {acc.table()}")


def check_bad_input(n, r, group):
    par = ParallelGPT.from_dense(dense_model(None), group).eval()
    caches = inference.new_caches(par, B, S0)
    try:
        inference.forward_cached(par, torch.zeros(S0 + 1, B, dtype=torch.long), caches)
    except ValueError as e:
        expect("exceed s_max" in str(e), f"an overfull cache says {e}")
    else:
        raise AssertionError("an overfull cache was accepted")
    try:
        inference.kv_cache_bytes(LAYERS, 3, D, t=2)
    except ValueError as e:
        expect("multiple or a divisor" in str(e), f"a_kv = 3 at t = 2 says {e}")
    else:
        raise AssertionError("a_kv = 3 at t = 2 was accepted")


CHECKS = (check_decode, check_bad_input)
