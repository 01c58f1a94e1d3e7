"""Chapter 09: greedy decoding with a KV cache under tensor parallelism, checked against the dense model.

Every rank builds the same dense :class:`~intralayer.model.TinyGPT` (same seed) and the same prompts, and
decodes them greedily twice: the dense model without a cache (its own forward over the whole sequence at
every step, :func:`~intralayer.inference.greedy_reference`), and its
:class:`~intralayer.tensor_parallel.ParallelGPT` shard with a KV cache
(:func:`~intralayer.inference.greedy_decode`). For multi-head, grouped-query and multi-query attention it
asserts:

- the same tokens, step for step (with a_kv < t the ranks sharing a key/value head all-gather q|k|v,
  chapter 02's layout);
- the bytes each rank's caches hold equal to ``kv_cache_bytes``: 2·L·(a_kv/t)·d·e per token, a_kv/t taken
  as 1 when t > a_kv;
- one decode step's collectives, recorded by :func:`intralayer.comm.accounting`: 1 + 2L all-reduces of
  b·h numbers each, one all-gather of the b·v logits, one all-gather of q|k|v per block when a_kv < t,
  and nothing else.

Rank 0 prints the table and, with ``--out``, writes it as JSON.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 4 -m intralayer.programs.inference_decode

One GPU node (NCCL), a wider model and a larger batch::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.inference_decode --hidden 1024 --heads 16 \
        --batch 32 --steps 32
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from intralayer import comm, distributed, inference
from intralayer.model import TinyGPT
from intralayer.tensor_parallel import ParallelGPT


def decode_case(d, a, kv: int) -> dict:
    """Decode with ``kv`` key/value heads: the dense twin without a cache, the shard with one; counted."""
    t, dev = d.world_size, d.device
    torch.manual_seed(7)
    dense = TinyGPT(a.vocab, a.hidden, a.heads, layers=a.layers, kv_heads=kv).to(dev).eval()
    prompt = torch.randint(0, a.vocab, (a.prompt, a.batch), generator=torch.Generator().manual_seed(3)).to(dev)
    want, _ = inference.greedy_reference(dense, prompt, a.steps)
    par = ParallelGPT.from_dense(dense, d.group).eval()
    got, caches = inference.greedy_decode(par, prompt, a.steps)
    if not torch.equal(got, want):
        raise AssertionError(f"a_kv = {kv}, rank {d.rank}: TP tokens {got.T.tolist()} ≠ dense {want.T.tolist()}")
    cached = sum(c.nbytes for c in caches)
    itemsize = dense.head.weight.element_size()
    formula = inference.kv_cache_bytes(a.layers, kv, a.hidden // a.heads, (a.prompt + a.steps) * a.batch, t,
                                       itemsize)
    if cached != formula:
        raise AssertionError(f"a_kv = {kv}, rank {d.rank}: caches hold {cached} bytes, the formula says {formula}")
    # One decode step, recorded: the step after the prompt, on a fresh cache holding the prompt.
    step_caches = inference.new_caches(par, a.batch, a.prompt + 1)
    inference.forward_cached(par, prompt, step_caches)
    with comm.accounting() as acc:
        logits = inference.forward_cached(par, want[0][None], step_caches)
        comm.all_gather(logits, -1, d.group, "logits gather")
    reduces, gathers = acc.select("all_reduce"), acc.select("all_gather")
    expected = inference.decode_all_reduces(a.layers)
    if len(reduces) != expected or any(r.elements != a.batch * a.hidden for r in reduces):
        raise AssertionError(f"a_kv = {kv}: {len(reduces)} all-reduces of {[r.elements for r in reduces]} numbers, "
                             f"expected 1 + 2L = {expected} of b·h = {a.batch * a.hidden}")
    shared = kv < t
    if len(gathers) != 1 + (a.layers if shared else 0) or acc.count() != len(reduces) + len(gathers):
        raise AssertionError(f"a_kv = {kv}: unexpected collectives\n{acc.table()}")
    return dict(kv=kv, tokens=got.T.tolist(), cache_bytes=cached, formula=formula, cache_len=caches[0].length,
                all_reduces=len(reduces), all_reduce_bytes=reduces[0].bytes, itemsize=itemsize,
                qkv_gathers=len(gathers) - 1, logits_gather_bytes=gathers[-1].bytes)


def model_arguments(description: str) -> argparse.ArgumentParser:
    """The tiny GPT's sizes, which both inference programs take (``inference_serve`` too)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    return ap


@record
def main(argv=None) -> None:
    ap = model_arguments(__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=5, help="prompt length s0")
    ap.add_argument("--batch", type=int, default=3, help="sequences b")
    ap.add_argument("--steps", type=int, default=8, help="tokens to decode")
    ap.add_argument("--out", help="write rank 0's table to this JSON file")
    a = ap.parse_args(argv)
    with distributed.setup() as d:
        t = d.world_size
        cases = [decode_case(d, a, kv) for kv in sorted({a.heads, 2, 1}, reverse=True)]
        every = [None] * t
        dist.all_gather_object(every, cases)
        if d.is_main:
            for i, case in enumerate(cases):
                if any(rank[i]["tokens"] != case["tokens"] for rank in every):
                    raise AssertionError(f"a_kv = {case['kv']}: the ranks decoded different tokens")
            report(d, a, every)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(dict(t=t, args=vars(a), ranks=every), f)


def report(d, a, every) -> None:
    t = d.world_size
    print(f"t = {t} ranks ({d.backend}, {d.device.type}); TinyGPT L = {a.layers}, h = {a.hidden}, a = {a.heads}, "
          f"v = {a.vocab}; prompt {a.prompt} tokens, b = {a.batch}, {a.steps} tokens decoded greedily")
    print(f"{'a_kv':>4} {'tokens = dense':>15} {'cache bytes/rank':>17} {'formula':>8} "
          f"{'all-reduces/step':>17} {'bytes each':>11} {'q|k|v gathers':>14}")
    for i, case in enumerate(every[0]):
        same = all(rank[i]["cache_bytes"] == case["formula"] for rank in every)
        print(f"{case['kv']:4d} {'yes':>15} {case['cache_bytes']:17,d} {case['formula']:8,d}{'' if same else ' !'} "
              f"{case['all_reduces']:17d} {case['all_reduce_bytes']:11,d} {case['qkv_gathers']:14d}")
    first = every[0][0]
    print(f"decoded tokens (sequence 0): {first['tokens'][0]}")
    print(f"per decode step: 1 + 2·{a.layers} = {first['all_reduces']} all-reduces of b·h·e = "
          f"{a.batch}·{a.hidden}·{first['itemsize']} = {first['all_reduce_bytes']} bytes, and the logits' all-gather "
          f"of b·v·e = {first['logits_gather_bytes']} bytes")
    print("all checks passed on every rank")


if __name__ == "__main__":
    main()
