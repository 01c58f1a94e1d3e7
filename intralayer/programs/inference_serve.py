"""Chapter 09: serving across ranks, checked against the dense model — a context-parallel prefill with
decoding from the spread KV cache, and an MoE model with data-parallel attention and expert parallelism.

Part 1, context parallelism (:mod:`intralayer.serving`). Every rank builds the same dense
:class:`~intralayer.model.TinyGPT` and the same prompts. The prompt's ``--prompt`` tokens are split over
the P ranks (zigzag layout) and prefilled with chapter 04's ring (pass-KV); ``--steps`` tokens are then
decoded greedily from the cache the prefill left spread over the ranks, and a follow-up turn of
``--follow`` tokens (the last token decoded, then new ones) is added to the cache by the pass-KV ring and
by the pass-Q ring, and decoding goes on. For multi-head (a_kv = a) and multi-query (a_kv = 1) attention it
asserts:

- the same tokens as the dense model decoding without a cache, at every step of both turns;
- the ring's bytes, recorded by :func:`intralayer.comm.accounting`, equal to
  :func:`~intralayer.inference.ring_pass_bytes` for each ring (pass-Q's partial outputs float32, with
  their log-sum-exps);
- each rank's share of the cache equal to ``kv_cache_bytes`` for the positions it holds, the shares adding
  up to the whole cache;
- a decode step's collectives: one all-gather per layer of the P ranks' partial results, b·a·(d + 1) numbers
  each, and nothing else.

Part 2, MoE serving. Every rank builds the same :class:`~intralayer.serving.MoEGPT` (E experts, top-k,
capacity factor E/k: nothing dropped) and serves its own requests (3, 1, 2, 0, … of them: rank r gets entry
r mod 4), the attention data-parallel, the experts spread E/P per rank. It asserts the same tokens as the
dense model decoding all the requests at once, and per decode step three all-to-alls per MoE layer and
nothing else, the dispatch sending what the routing says.

Rank 0 prints the tables and, with ``--out``, writes them as JSON.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 4 -m intralayer.programs.inference_serve

One GPU node (NCCL); the prompt a multiple of 2P, the cached positions before the follow-up turn
(prompt + steps − 1) and the turn itself multiples of P, and P dividing the experts::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.inference_serve --prompt 64 --steps 17 \
        --follow 16 --experts 16
"""
from __future__ import annotations

import copy
import json

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from intralayer import comm, distributed, inference, serving
from intralayer import context_parallel as cp
from intralayer.expert_parallel import ExpertParallelMoE, check_placement
from intralayer.model import TinyGPT
from intralayer.programs.inference_decode import model_arguments

REQUESTS = [3, 1, 2, 0]          # requests per rank in part 2: rank r serves entry r mod 4


def check_sizes(a, P: int) -> None:
    """The sizes must split over P ranks: ``ValueError`` naming the rule, before any collective."""
    cp.check_sequence(a.prompt, P, "zigzag")
    if (a.prompt + a.steps - 1) % P or a.follow % P:
        raise ValueError(f"the {a.prompt + a.steps - 1} positions cached before the follow-up turn (prompt + steps "
                         f"- 1) and its {a.follow} tokens must both be multiples of P = {P}")
    check_placement(a.experts, P)


def sent(acc, *labels) -> float:
    return sum(rec.sent for rec in acc.records if rec.label in labels)


def cp_case(d, a, kv: int) -> dict:
    """Part 1 with ``kv`` key/value heads: prefill, decode, a follow-up turn by both rings, decode again."""
    P, group, dev = d.world_size, d.group, d.device
    torch.manual_seed(7)
    dense = TinyGPT(a.vocab, a.hidden, a.heads, layers=a.layers, kv_heads=kv).to(dev).eval()
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, a.vocab, (a.prompt, a.batch), generator=g).to(dev)
    user = torch.randint(0, a.vocab, (a.follow - 1, a.batch), generator=g).to(dev)
    e, dh = dense.head.weight.element_size(), a.hidden // a.heads
    want, _ = inference.greedy_reference(dense, prompt, a.steps)
    s_max = a.prompt + a.steps + a.follow + a.steps
    with comm.accounting() as acc:
        logits, cache = serving.cp_prefill(dense, prompt, group, s_max, "zigzag")
    ring = sent(acc, "ring k,v")
    formula = a.layers * a.batch * inference.ring_pass_bytes("pass-KV", a.prompt, 0, a.heads, kv, dh, P, e)
    if ring != formula:
        raise AssertionError(f"a_kv = {kv}: the prefill's ring sent {ring} bytes, L·b·pass-KV = {formula}")
    share = cache.nbytes
    if share != cache.formula_bytes():
        raise AssertionError(f"a_kv = {kv}, rank {d.rank}: {share} bytes cached, the formula {cache.formula_bytes()}")
    first = [logits.argmax(-1)]
    gather_bytes = None
    for _ in range(a.steps - 1):
        with comm.accounting() as acc:
            logits = serving.cp_decode_step(dense, first[-1], cache, group)
        if acc.count() != a.layers or acc.count("all_gather") != a.layers:
            raise AssertionError(f"a_kv = {kv}: a decode step issued\n{acc.table()}")
        gather_bytes = acc.sent()
        first.append(logits.argmax(-1))
    first = torch.stack(first)
    if not torch.equal(first, want):
        raise AssertionError(f"a_kv = {kv}, rank {d.rank}: tokens {first.T.tolist()} ≠ dense {want.T.tolist()}")
    turn = torch.cat([first[-1:], user])
    want2, _ = inference.greedy_reference(dense, torch.cat([prompt, first, user]), a.steps)
    cached, rings = cache.length, {}
    for variant in serving.RING_VARIANTS:
        c = copy.deepcopy(cache)
        with comm.accounting() as acc:
            logits = serving.cp_extend(dense, turn, c, group, variant)
        bytes_ = sent(acc, "pass-KV ring", "pass-Q ring", "pass-Q partials")
        formula2 = a.layers * a.batch * inference.ring_pass_bytes(variant, a.follow, cached, a.heads, kv, dh, P, e,
                                                                  lse=True, partial_itemsize=4)
        if bytes_ != formula2:
            raise AssertionError(f"a_kv = {kv}, {variant}, rank {d.rank}: sent {bytes_} bytes, the formula {formula2}")
        second = serving.greedy_continue(dense, logits, a.steps, c, group)
        if not torch.equal(second, want2):
            raise AssertionError(f"a_kv = {kv}, {variant}: after the turn {second.T.tolist()} ≠ {want2.T.tolist()}")
        rings[variant] = dict(bytes=bytes_, formula=formula2, tokens=second.T.tolist())
    whole = inference.kv_cache_bytes(a.layers, kv, dh, a.prompt * a.batch, itemsize=e)
    return dict(kv=kv, tokens=first.T.tolist(), ring=ring, formula=formula, share=share, whole=whole,
                held=[len(h) for h in cache.held], gather=gather_bytes, cached=cached, rings=rings, itemsize=e)


def moe_case(d, a) -> dict:
    """Part 2: this rank's requests, attention data-parallel, the experts expert-parallel."""
    P, r, dev = d.world_size, d.rank, d.device
    counts = [REQUESTS[j % len(REQUESTS)] for j in range(P)]
    mine = slice(sum(counts[:r]), sum(counts[:r + 1]))
    torch.manual_seed(11)
    dense = serving.MoEGPT(a.vocab, a.hidden, a.heads, 2 * a.hidden, a.experts, a.top_k, layers=a.layers,
                           kv_heads=2).to(dev).eval()
    prompt = torch.randint(0, a.vocab, (a.prompt, sum(counts)), generator=torch.Generator().manual_seed(8)).to(dev)
    want, _ = inference.greedy_reference(dense, prompt, a.steps)
    got, layers = serving.dp_ep_greedy_decode(dense, prompt[:, mine], a.steps, d.group)
    if not torch.equal(got, want[:, mine]):
        raise AssertionError(f"rank {r}: tokens {got.T.tolist()} ≠ dense {want[:, mine].T.tolist()}")
    # one more decode step, recorded, on fresh layers and caches holding the prompt
    eps = [ExpertParallelMoE.from_dense(block.moe, d.group) for block in dense.blocks]
    caches = inference.new_caches(dense, counts[r], a.prompt + 1) if counts[r] else None
    serving.moe_forward_cached(dense, prompt[:, mine], caches, eps)
    with comm.accounting() as acc:
        serving.moe_forward_cached(dense, want[0][None, mine], caches, eps)
    e = dense.head.weight.element_size()
    routed = sum(c for layer in eps for j, c in enumerate(layer.last.send_counts) if j != r) * a.hidden * e
    dispatch = sent(acc, "dispatch")
    if acc.count() != 3 * a.layers or acc.count("all_to_all") != 3 * a.layers or dispatch != routed:
        raise AssertionError(f"rank {r}: a decode step issued\n{acc.table()}\nexpected 3 all-to-alls per MoE layer, "
                             f"dispatch {routed} bytes by the routing")
    return dict(requests=counts[r], tokens=got.T.tolist(), dispatch=dispatch, routed=routed,
                assignments=sum(layer.last.route.kept.sum().item() for layer in eps),
                dropped=sum(layer.last.route.dropped for layer in eps), collectives=acc.count())


@record
def main(argv=None) -> None:
    ap = model_arguments(__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=16, help="prompt length s0 (a multiple of 2P)")
    ap.add_argument("--batch", type=int, default=3, help="sequences b in part 1")
    ap.add_argument("--steps", type=int, default=5, help="tokens decoded per turn")
    ap.add_argument("--follow", type=int, default=8, help="tokens of the follow-up turn (a multiple of P)")
    ap.add_argument("--experts", type=int, default=8, help="experts E in part 2 (a multiple of P)")
    ap.add_argument("--top-k", type=int, default=2, help="experts per token k in part 2")
    ap.add_argument("--out", help="write rank 0's tables to this JSON file")
    a = ap.parse_args(argv)
    with distributed.setup() as d:
        check_sizes(a, d.world_size)
        cases = [cp_case(d, a, kv) for kv in sorted({a.heads, 1}, reverse=True)]
        moe = moe_case(d, a)
        every = [None] * d.world_size
        dist.all_gather_object(every, dict(cp=cases, moe=moe))
        if d.is_main:
            report(d, a, every)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(dict(P=d.world_size, args=vars(a), ranks=every), f)


def report(d, a, every) -> None:
    P = d.world_size
    print(f"P = {P} ranks ({d.backend}, {d.device.type}); TinyGPT L = {a.layers}, h = {a.hidden}, a = {a.heads}, "
          f"v = {a.vocab}, b = {a.batch}")
    print(f"1. context-parallel prefill of {a.prompt} tokens (zigzag), then {a.steps} tokens decoded from the "
          f"spread cache")
    print(f"{'a_kv':>4} {'tokens = dense':>15} {'ring bytes/rank':>16} {'L·b·pass-KV':>12} {'prompt cache/rank':>18} "
          f"{'whole':>7} {'decode gather bytes/step':>25}")
    for i, case in enumerate(every[0]["cp"]):
        if sum(rank["cp"][i]["share"] for rank in every) != case["whole"]:
            raise AssertionError(f"a_kv = {case['kv']}: the ranks' shares do not add up to the whole cache")
        print(f"{case['kv']:4d} {'yes':>15} {case['ring']:16,.0f} {case['formula']:12,d} {case['share']:18,d} "
              f"{case['whole']:7,d} {case['gather']:25,.0f}")
    first = every[0]["cp"][0]
    print(f"   positions held per rank after decoding: {first['held']}")
    print(f"   follow-up turn of {a.follow} tokens against {first['cached']} cached (new share "
          f"{a.follow / (a.follow + first['cached']):.3f}), then {a.steps} more decoded:")
    print(f"{'a_kv':>4} {'a_kv/a':>7} {'variant':>8} {'bytes/rank':>11} {'formula':>8} {'then tokens = dense':>20}")
    for case in every[0]["cp"]:
        for variant, ring in case["rings"].items():
            print(f"{case['kv']:4d} {case['kv'] / a.heads:7.3f} {variant:>8} {ring['bytes']:11,.0f} "
                  f"{ring['formula']:8,d} {'yes':>20}")
    print(f"2. MoE serving: attention data-parallel, E = {a.experts} experts, k = {a.top_k}, "
          f"{a.experts // P} per rank; {a.steps} tokens decoded")
    print(f"{'rank':>4} {'requests':>9} {'tokens = dense':>15} {'assignments/step':>17} {'dispatch bytes':>15} "
          f"{'by routing':>11} {'collectives/step':>17}")
    for r, rank in enumerate(every):
        m = rank["moe"]
        print(f"{r:4d} {m['requests']:9d} {'yes':>15} {m['assignments']:17d} {m['dispatch']:15,.0f} "
              f"{m['routed']:11,d} {m['collectives']:17d}")
    print(f"   dropped assignments: {sum(rank['moe']['dropped'] for rank in every)}; per decode step and MoE layer: "
          f"three all-to-alls (counts, dispatch, combine), no all-reduce")
    print("all checks passed on every rank")


if __name__ == "__main__":
    main()
