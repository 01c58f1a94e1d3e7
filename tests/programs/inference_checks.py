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

Context parallelism at inference (:mod:`intralayer.serving`), for multi-head and multi-query attention
and both layouts of the prompt:

- a prefill split over the ranks (chapter 04's ring, pass-KV), then greedy decoding from the cache it
  leaves spread over the ranks: the same tokens as the dense model, the logits close at every step;
- the ring's bytes, recorded, equal to ``ring_pass_bytes("pass-KV", …)``, and not to the pass-Q count;
- each rank's share of the cache equal to ``kv_cache_bytes`` for the positions it holds, 1/P of the
  whole, and a decode step's collectives: one all-gather of the b·a·(d+1) partial results per layer;
- a follow-up turn (n more tokens against the cache) by the pass-KV and the pass-Q ring: both close to the
  dense model, each sending what ``ring_pass_bytes`` counts for it (pass-Q's partials with their
  log-sum-exps: a count without them is told apart), and the decoding that continues from it.

MoE serving with data-parallel attention and expert parallelism: each rank decodes its own requests
(3, 1, 2, 0 of them: one rank serves none) with the experts spread over the ranks, equal to the dense
MoE model decoding all the requests at once; a decode step issues three all-to-alls per MoE layer and
nothing else, its dispatch sending what the routing says.

Any mismatch raises, so the rank fails.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from intralayer import comm, inference, serving
from intralayer.expert_parallel import ExpertParallelMoE
from intralayer.model import TinyGPT
from intralayer.tensor_parallel import ParallelGPT
from tests.programs.checks import close, expect, raises

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


# ---------------------------------------------------------------------------- context parallelism

S0_CP, TURN1, FOLLOW = 8, 5, 8                   # prompt (divisible by 2P), tokens decoded, follow-up turn


def _gathered(value) -> list:
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


def check_cp_prefill_decode(n, r, group):
    prompt = torch.randint(0, VOCAB, (S0_CP, B), generator=torch.Generator().manual_seed(5))
    for kv, layout in ((None, "zigzag"), (1, "contiguous")):
        a_kv = kv or HEADS
        what = f"CP prefill with a_kv = {a_kv}, {layout}, on {n} ranks"
        dense = dense_model(kv)
        want, logits = inference.greedy_reference(dense, prompt, TURN1)
        with comm.accounting() as acc:
            got_logits, cache = serving.cp_prefill(dense, prompt, group, S0_CP + TURN1 + FOLLOW + 4, layout)
        close(got_logits, logits[0], f"{what}: the prompt's last logits")
        ring = [rec for rec in acc.records if rec.label == "ring k,v"]
        expect(len(ring) == LAYERS * (n - 1), f"{what}: {len(ring)} ring steps, expected L·(P−1) = {LAYERS * (n - 1)}")
        sent = sum(rec.sent for rec in ring)
        formula = LAYERS * B * inference.ring_pass_bytes("pass-KV", S0_CP, 0, HEADS, a_kv, D, n, itemsize=4)
        expect(sent == formula, f"{what}: the ring sent {sent} bytes, L·b·pass-KV = {formula}")
        hops = formula * n // (n - 1) if n > 1 else formula + 1          # a count of P hops instead of P − 1
        expect(sent != hops, f"{what}: a count of P hops, {hops}, was not told apart")
        wrong = LAYERS * B * inference.ring_pass_bytes("pass-Q", S0_CP, 0, HEADS, a_kv, D, n, itemsize=4)
        expect(n == 1 or a_kv == HEADS or sent != wrong, f"{what}: the pass-Q count {wrong} was not told apart")
        # the cache: this rank's positions only
        share = inference.kv_cache_bytes(LAYERS, a_kv, D, S0_CP // n * B, itemsize=4)
        expect(cache.nbytes == share == cache.formula_bytes(),
               f"{what}: rank {r} caches {cache.nbytes} bytes, its share by formula {share}")
        whole = inference.kv_cache_bytes(LAYERS, a_kv, D, S0_CP * B, itemsize=4)
        expect(sum(_gathered(cache.nbytes)) == whole and (n == 1 or cache.nbytes != whole),
               f"{what}: the ranks' shares do not add up to the whole cache {whole} (or one holds it all)")
        # decoding from the spread cache, step by step: logits and the collectives of each step
        step_logits, ids = got_logits, []
        for step in range(TURN1):
            close(step_logits, logits[step], f"{what}: logits at decode step {step}")
            ids.append(step_logits.argmax(-1))
            if step + 1 < TURN1:
                with comm.accounting() as acc:
                    step_logits = serving.cp_decode_step(dense, ids[-1], cache, group)
                gathers = acc.select("all_gather")
                expect(len(gathers) == LAYERS and acc.count() == LAYERS,
                       f"{what}: a decode step issued\n{acc.table()}\nexpected one all-gather per layer")
                numbers = n * B * HEADS * (D + 1)
                expect(all(g.elements == numbers and g.sent == (n - 1) * B * HEADS * (D + 1) * 4 for g in gathers),
                       f"{what}: partials gathered {[g.elements for g in gathers]} numbers, expected P·b·a·(d+1) = {numbers}")
        expect(torch.equal(torch.stack(ids), want), f"{what}: tokens {torch.stack(ids).T.tolist()} ≠ {want.T.tolist()}")
        tokens, cache2 = serving.cp_greedy_decode(dense, prompt, TURN1, group, layout=layout)
        expect(torch.equal(tokens, want), f"{what}: cp_greedy_decode's tokens differ from the dense model's")
        lengths = [len(h) for h in cache2.held]
        expect(cache2.length == S0_CP + TURN1 - 1 and max(lengths) - min(lengths) <= 1,
               f"{what}: the decoded positions sit unevenly, {lengths}")


def check_cp_follow_up_turn(n, r, group):
    prompt = torch.randint(0, VOCAB, (S0_CP, B), generator=torch.Generator().manual_seed(5))
    user = torch.randint(0, VOCAB, (FOLLOW - 1, B), generator=torch.Generator().manual_seed(6))
    for kv in (None, 1):
        a_kv = kv or HEADS
        dense = dense_model(kv)
        first, cache = serving.cp_greedy_decode(dense, prompt, TURN1, group, s_max=S0_CP + TURN1 + FOLLOW + 4)
        turn = torch.cat([first[-1:], user])                         # the last token decoded, then the user's
        seq = torch.cat([prompt, first, user])
        want, logits = inference.greedy_reference(dense, seq, 3)
        cached = cache.length
        for variant in serving.RING_VARIANTS:
            what = f"follow-up turn by {variant}, a_kv = {a_kv}, on {n} ranks"
            c = copy.deepcopy(cache)
            with comm.accounting() as acc:
                got = serving.cp_extend(dense, turn, c, group, variant)
            close(got, logits[0], f"{what}: the turn's last logits")
            label = {"pass-KV": ("pass-KV ring",), "pass-Q": ("pass-Q ring", "pass-Q partials")}[variant]
            sent = sum(rec.sent for rec in acc.records if rec.label in label)
            formula = LAYERS * B * inference.ring_pass_bytes(variant, FOLLOW, cached, HEADS, a_kv, D, n, itemsize=4,
                                                             lse=True, partial_itemsize=4)
            expect(sent == formula, f"{what}: rank {r} sent {sent} bytes, the formula {formula}")
            if variant == "pass-Q" and n > 1:
                plain = LAYERS * B * inference.ring_pass_bytes(variant, FOLLOW, cached, HEADS, a_kv, D, n, itemsize=4)
                expect(sent != plain, f"{what}: the count without log-sum-exps {plain} was not told apart")
            tokens = serving.greedy_continue(dense, got, 3, c, group)
            expect(torch.equal(tokens, want), f"{what}: decoding after the turn gave {tokens.T.tolist()}, "
                                              f"the dense model {want.T.tolist()}")


def check_cp_refuses_a_full_cache(n, r, group):
    """A cache prefilled with no room left refuses the next token on every rank, before any collective
    (a refusal on the owner alone would leave the others waiting in the all-gather)."""
    prompt = torch.randint(0, VOCAB, (S0_CP, B), generator=torch.Generator().manual_seed(5))
    dense = dense_model(None)
    logits, cache = serving.cp_prefill(dense, prompt, group, S0_CP)
    raises(lambda: serving.cp_decode_step(dense, logits.argmax(-1), cache, group), "cannot take", "larger s_max",
           what=f"a full spread cache on {n} ranks")
    raises(lambda: serving.cp_extend(dense, prompt[:n], cache, group), "cannot take",
           what=f"a follow-up turn into a full spread cache on {n} ranks")
    raises(lambda: serving.cp_extend(dense, prompt[:n], cache, group, "pass-O"), "variant",
           what="an unknown ring")


# ---------------------------------------------------------------------------- MoE: DP attention + EP

FFN_MOE, EXPERTS, TOP_K = 48, 8, 2
REQUESTS = [3, 1, 2, 0]                           # requests per rank (rank r: entry r mod 4)


def moe_model() -> serving.MoEGPT:
    torch.manual_seed(11)
    return serving.MoEGPT(VOCAB, H, HEADS, FFN_MOE, EXPERTS, TOP_K, layers=LAYERS, kv_heads=2).eval()


def check_moe_dp_attention_ep(n, r, group):
    counts = [REQUESTS[j % len(REQUESTS)] for j in range(n)]
    start = sum(counts[:r])
    mine = slice(start, start + counts[r])
    what = f"MoE serving, DP attention + EP on {n} ranks, rank {r} with {counts[r]} requests"
    dense = moe_model()
    prompt = torch.randint(0, VOCAB, (S0, sum(counts)), generator=torch.Generator().manual_seed(8))
    want, logits = inference.greedy_reference(dense, prompt, STEPS)               # every request, one device
    got, layers = serving.dp_ep_greedy_decode(dense, prompt[:, mine], STEPS, group)
    expect(torch.equal(got, want[:, mine]), f"{what}: tokens {got.T.tolist()} ≠ {want[:, mine].T.tolist()}")
    expect(all(layer.local_experts == EXPERTS // n for layer in layers), f"{what}: not E/P experts per rank")
    # the same requests step by step: logits, and one decode step's collectives
    eps = [ExpertParallelMoE.from_dense(block.moe, group) for block in dense.blocks]
    b = counts[r]
    caches = inference.new_caches(dense, b, S0 + STEPS) if b else None
    step = serving.moe_forward_cached(dense, prompt[:, mine], caches, eps)[-1]
    for i in range(STEPS):
        close(step, logits[i][mine], f"{what}: logits at step {i}")
        if i + 1 < STEPS:
            with comm.accounting() as acc:
                step = serving.moe_forward_cached(dense, want[i][None, mine], caches, eps)[-1]
    labels = sorted(rec.label for rec in acc.records)
    expect(labels == sorted(["expert counts", "dispatch", "combine"] * LAYERS) and acc.count("all_to_all") == 3 * LAYERS,
           f"{what}: a decode step issued\n{acc.table()}\nexpected three all-to-alls per MoE layer and nothing else")
    dispatched = [rec for rec in acc.records if rec.label == "dispatch"]
    for layer, rec in zip(eps, dispatched):
        routed = sum(c for j, c in enumerate(layer.last.send_counts) if j != r) * H * 4
        expect(rec.sent == routed, f"{what}: dispatch sent {rec.sent} bytes, its routing {routed}")
    expect(sum(layer.last.route.dropped for layer in eps) == 0, f"{what}: tokens were dropped")


CHECKS = (check_decode, check_bad_input, check_cp_prefill_decode, check_cp_follow_up_turn,
          check_cp_refuses_a_full_cache, check_moe_dp_attention_ep)
