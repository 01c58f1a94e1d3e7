"""Check intralayer.expert_parallel on real ranks against the single-device MoELayer.

Every rank builds the same ``MoELayer`` (same seed), every rank's tokens and upstream
gradients (same generators) and the optional router bias, so it can compute the
reference itself: the dense layer on each rank's tokens. Then it runs
``ExpertParallelMoE.from_dense(dense, group)`` on its own tokens and compares, with
``torch.testing.assert_close`` at float32's default tolerances:

- the output and the input gradient with the dense layer's on this rank's tokens
  (capacity is counted per source rank, so this is the exact reference);
- the gradient of each of its experts' w1, w2, w3 (``layer.shard``) with the sum over
  ranks of the dense layer's expert gradients on each rank's tokens; an expert that
  receives no tokens must get a zero gradient, not ``None``;
- the router's and the shared expert's gradients with the dense layer's on this rank's
  tokens only (they are replicated);

for E in {P, 2P, 4P}, k in {1, 2, 3, E}, capacity factors 0.5, 1, 1.25 and one that
never drops, with and without a shared expert, a router bias, group (node) limited
routing, and token counts per rank that differ and include 0 and 1.

It also checks what moved: forward records exactly three all-to-alls (counts, dispatch,
combine) and backward two, and the dispatch's bytes to each peer are the kept
assignments to that peer × hidden × 4, as ``simulate`` computes them from every rank's
logits (a replica of the router gives them); ``hierarchical_forward`` computes the plain
forward for 1, 2 and P nodes and its inter-node dispatch moves ``node_traffic``'s
per-node copies; ``timed_forward`` computes the plain forward, sequential and
overlapped, in 1 and 2 micro-batches, with a well-formed timeline, its per-expert counts
recorded by ``comm`` (one all-to-all per micro-batch); and bad input raises
``ValueError`` on every rank before any communication.

Any mismatch raises, so the rank, and the launch, fail; when every check passed on
every rank, rank 0 prints ``MARKER`` followed by the number of ranks.

``python -m tests.programs.ep_checks micro-batches`` runs only the check that
``timed_forward`` runs as many micro-batches as it is asked for (6 tokens on every
rank, 4 micro-batches: ``x.chunk(4)`` gives 3 chunks of 2).
"""
from __future__ import annotations

import itertools
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from intralayer import comm, distributed
from intralayer import expert_parallel as ep
from intralayer.moe import MoELayer, topk_route
from tests.programs.checks import expect, close, raises

# Tolerances: against the dense layer, float32 sums in another order (expert gradients
# summed over ranks, tokens regrouped by expert), at assert_close's float32 defaults
# (checks.FLOAT32_REORDERED: longest reduction, an expert's tokens from every rank, < 64).

MARKER = "EP CHECKS PASSED on ranks:"
MICRO_MARKER = "EP MICRO-BATCHES PASSED on ranks:"
HIDDEN, FFN, ITEM = 8, 12, 4            # float32 tokens: 4 bytes an element
NEVER_DROPS = 1000.0                    # a capacity factor no expert ever reaches
KINDS = ("dispatch", "experts", "combine")


# ---------------------------------------------------------------------------- helpers

def per_rank(values, P):
    """The first P entries of ``values``, repeated if P is larger."""
    return [values[i % len(values)] for i in range(P)]


def inputs(counts, seed):
    """Every rank's tokens and upstream gradients: the same tensors on every rank."""
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, HIDDEN, generator=g) + torch.linspace(0, 2, HIDDEN) for t in counts]
    dys = [torch.randn(t, HIDDEN, generator=g) for t in counts]
    return xs, dys


def peer_bytes(rows, r):
    """Bytes to each peer for ``rows`` token vectors per peer; nothing to oneself."""
    return tuple(0 if j == r else int(c) * HIDDEN * ITEM for j, c in enumerate(rows))


# ---------------------------------------------------------------------------- cases

# mult: E = mult·P; k: an int or "E"; cf: capacity factor; groups: None, 2 or "P" with
# top_groups (node-limited routing); tokens per rank (the first P entries).
CASES = [
    dict(mult=1, k=1, cf=1.0, shared=False, bias=False, tokens=[0, 7, 1, 12]),
    dict(mult=1, k="E", cf=1.25, shared=True, bias=False, tokens=[5, 1, 0, 9]),
    dict(mult=2, k=2, cf=0.5, shared=True, bias=True, tokens=[1, 0, 13, 4]),
    dict(mult=2, k=1, cf=NEVER_DROPS, shared=False, bias=False, tokens=[16, 3, 0, 1]),
    dict(mult=4, k=2, cf=1.25, shared=False, bias=True, tokens=[9, 1, 6, 0]),
    dict(mult=4, k="E", cf=0.5, shared=True, bias=False, tokens=[3, 8, 1, 5]),
    dict(mult=4, k=1, cf=1.0, shared=False, bias=False, tokens=[2, 1, 1, 0]),       # idle experts
    dict(mult=1, k=1, cf=NEVER_DROPS, shared=True, bias=True, tokens=[1, 1, 1, 1]),
    dict(mult=2, k="E", cf=NEVER_DROPS, shared=False, bias=True, tokens=[6, 11, 2, 1]),
    dict(mult=2, k=2, cf=1.0, shared=True, bias=False, groups="P", top_groups=1, tokens=[11, 0, 6, 1]),
    dict(mult=4, k=2, cf=NEVER_DROPS, shared=False, bias=True, groups=2, top_groups=1, tokens=[1, 12, 0, 7]),
    dict(mult=4, k=3, cf=1.25, shared=True, bias=False, groups="P", top_groups=2, tokens=[10, 4, 1, 0]),
    dict(mult=2, k=2, cf=0.5, shared=False, bias=False, groups=2, top_groups=2, tokens=[0, 9, 3, 14]),
]


def groups_of(spec, P):
    g = spec.get("groups")
    if g == "P":
        return P
    if g == 2 and P % 2:
        return P
    return g


def reference(dense, xs, dys, r, bias):
    """The dense layer on each rank's tokens: rank r's output, input gradient and parameter
    gradients, and the expert gradients summed over every rank's tokens."""
    experts = {n: torch.zeros_like(getattr(dense, n)) for n in ("w1", "w2", "w3")}
    mine = None
    for j, (x, dy) in enumerate(zip(xs, dys)):
        dense.zero_grad(set_to_none=True)
        xj = x.clone().requires_grad_()
        y, _ = dense(xj, bias)
        y.backward(dy)
        grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                 for n, p in dense.named_parameters()}
        for n in experts:
            experts[n] += grads[n]
        if j == r:
            dx = xj.grad if xj.grad is not None else torch.zeros_like(xj)
            mine = dict(out=y.detach(), dx=dx, grads=grads)
    dense.zero_grad(set_to_none=True)
    return mine, experts


def check_case(i, spec, P, r, group, seen):
    E = spec["mult"] * P
    k = E if spec["k"] == "E" else spec["k"]
    cf, shared = spec["cf"], spec["shared"]
    G, M = groups_of(spec, P), spec.get("top_groups")
    counts = per_rank(spec["tokens"], P)
    what = (f"case {i} (E={E}, k={k}, capacity factor {cf}, shared={shared}, bias={spec['bias']}, "
            f"groups={G}, top_groups={M}, tokens {counts}, rank {r})")
    torch.manual_seed(100 + i)
    dense = MoELayer(HIDDEN, FFN, E, k, cf, shared=shared, groups=G or 1, top_groups=M)
    layer = ep.ExpertParallelMoE.from_dense(dense, group)
    n = E // P
    expect(layer.local_experts == n and layer.w1.shape == (n, FFN, HIDDEN), f"{what}: local experts {layer.w1.shape}")
    bias = torch.randn(E, generator=torch.Generator().manual_seed(200 + i)) if spec["bias"] else None
    xs, dys = inputs(counts, seed=300 + i)
    ref, expert_sum = reference(dense, xs, dys, r, bias)

    # ---- forward and backward on this rank's tokens
    x = xs[r].clone().requires_grad_()
    with comm.accounting() as acc:
        out = layer(x, bias)
        out.backward(dys[r])
    close(out, ref["out"], f"{what}: output")
    close(x.grad, ref["dx"], f"{what}: input gradient")
    close(layer.router.weight.grad, ref["grads"]["router.weight"], f"{what}: router gradient (this rank's tokens)")
    for name in ("w1", "w2", "w3"):
        got = getattr(layer, name).grad
        expect(got is not None, f"{what}: {name} has no gradient")
        want = layer.shard(expert_sum[name], name)
        expect(want.shape[0] == n, f"{what}: shard of {name} has {want.shape[0]} experts")
        close(got, want, f"{what}: {name} gradient (every rank's tokens)")
    if shared:
        for name, p in layer.shared.named_parameters():
            close(p.grad, ref["grads"][f"shared.{name}"], f"{what}: shared {name} gradient (this rank's tokens)")
    else:
        expect(layer.shared is None, f"{what}: a shared expert appeared")

    # ---- what the layer says it moved, against the routing of every rank's tokens
    last = layer.last
    with torch.no_grad():
        logits = [dense.router(t) for t in xs]                    # a replica of the router
    routes = [topk_route(lg, k, cf, bias, G or 1, M) for lg in logits]
    for s in range(P):
        want = routes[s].kept_counts[r * n:(r + 1) * n]
        expect(torch.equal(last.per_expert[s].long(), want),
               f"{what}: assignments from rank {s} to my experts {last.per_expert[s].tolist()}, want {want.tolist()}")
    idle = (last.per_expert.sum(0) == 0).nonzero().flatten().tolist()
    for e in idle:                                                # zero, not None, not garbage
        for name in ("w1", "w2", "w3"):
            expect(bool((getattr(layer, name).grad[e] == 0).all()),
                   f"{what}: expert {r * n + e} received no tokens but its {name} gradient is not zero")
    seen["idle experts"] += len(idle)
    seen["dropped"] += last.route.dropped
    seen["ranks with 0 tokens"] += counts[r] == 0
    seen["ranks with 1 token"] += counts[r] == 1

    sim = ep.simulate(logits, k, cf, P, nodes=G if M else 1, node_limit=M, bias=bias)
    expect(sim.traffic[r].tolist() == list(last.send_counts),
           f"{what}: sent {last.send_counts}, simulate says {sim.traffic[r].tolist()}")
    expect(sim.traffic[:, r].tolist() == list(last.recv_counts),
           f"{what}: received {last.recv_counts}, simulate says {sim.traffic[:, r].tolist()}")
    kept = int(routes[r].kept.sum())
    expect(sum(last.send_counts) == kept, f"{what}: sent {sum(last.send_counts)} assignments, {kept} were kept")

    # ---- the records: 3 all-to-alls forward, 2 backward, with exact bytes to each peer
    expect(all(rec.op == "all_to_all" for rec in acc.records), f"{what}: records\n{acc.table()}")
    fwd, bwd = acc.select(phase="forward"), acc.select(phase="backward")
    expect([rec.label for rec in fwd] == ["expert counts", "dispatch", "combine"],
           f"{what}: forward records {[rec.label for rec in fwd]}")
    expect([rec.label for rec in bwd] == ["combine", "dispatch"],
           f"{what}: backward records {[rec.label for rec in bwd]}")
    expect(len(acc.records) == 5, f"{what}: {len(acc.records)} records")
    counts_rec, dispatch, combine = fwd
    expect(counts_rec.peers == tuple(0 if j == r else n * 8 for j in range(P)),
           f"{what}: counts record peers {counts_rec.peers}")
    want_dispatch = tuple(int(b) for b in sim.bytes(HIDDEN, ITEM)[r])
    expect(dispatch.peers == want_dispatch, f"{what}: dispatch sent {dispatch.peers}, simulate says {want_dispatch}")
    expect(dispatch.peers == peer_bytes(last.send_counts, r), f"{what}: dispatch peers {dispatch.peers}")
    expect(dispatch.sent == sum(want_dispatch), f"{what}: dispatch sent {dispatch.sent} bytes in all")
    expect(combine.peers == peer_bytes(last.recv_counts, r), f"{what}: combine peers {combine.peers}")
    expect(bwd[0].peers == peer_bytes(last.send_counts, r), f"{what}: backward of combine peers {bwd[0].peers}")
    expect(bwd[1].peers == peer_bytes(last.recv_counts, r), f"{what}: backward of dispatch peers {bwd[1].peers}")

    if bias is None:
        check_hierarchical(layer, xs, logits, k, cf, G, M, P, r, what)


def check_hierarchical(layer, xs, logits, k, cf, G, M, P, r, what):
    """Node-aware dispatch: the plain forward's output; the inter-node dispatch moves one
    copy per (token, remote node), node_traffic's count, where the two route alike."""
    with torch.no_grad():
        plain = layer(xs[r])
    for nodes in sorted({1, 2 if P % 2 == 0 else 1, P}):
        m = P // nodes
        with torch.no_grad(), comm.accounting() as acc:
            got = ep.hierarchical_forward(layer, xs[r], nodes)
        close(got, plain, f"{what}: hierarchical_forward on {nodes} nodes")
        if G is not None and G != nodes:
            continue                           # node_traffic routes within `nodes` groups, the layer within G
        recs = [rec for rec in acc.records if rec.label == "inter-node dispatch"]
        expect(len(recs) == 1, f"{what}, {nodes} nodes: {len(recs)} inter-node dispatch records\n{acc.table()}")
        peers = recs[0].peers
        cross = sum(b for j, b in enumerate(peers) if j // m != r // m)
        expect(cross == sum(peers), f"{what}, {nodes} nodes: inter-node dispatch within the node {peers}")
        total = torch.tensor([cross], dtype=torch.int64)
        dist.all_reduce(total)
        copies = ep.node_traffic(logits, k, cf, P, nodes, M if G else None)["per_node"]
        expect(int(total) == copies * HIDDEN * ITEM,
               f"{what}, {nodes} nodes: {int(total)} bytes crossed nodes, node_traffic says {copies} copies "
               f"= {copies * HIDDEN * ITEM} bytes")
        if nodes == 1:
            expect(int(total) == 0, f"{what}: bytes crossed nodes on one node")


# ---------------------------------------------------------------------------- timeline

def check_events(events, micro_batches, overlap, what):
    expect(len(events) == 3 * micro_batches, f"{what}: {len(events)} events for {micro_batches} micro-batches")
    at = {}
    for kind, i, start, end in events:
        expect(kind in KINDS and i in range(micro_batches), f"{what}: event {(kind, i)}")
        expect(0 <= start <= end, f"{what}: {kind} of micro-batch {i} runs from {start} to {end}")
        expect((kind, i) not in at, f"{what}: two {kind} events for micro-batch {i}")
        at[kind, i] = (start, end)
    expect(set(at) == set(itertools.product(KINDS, range(micro_batches))), f"{what}: events {sorted(at)}")
    for i in range(micro_batches):
        expect(at["dispatch", i][1] <= at["experts", i][0] and at["experts", i][1] <= at["combine", i][0],
               f"{what}: micro-batch {i}'s experts do not run between its dispatch and its combine")
    for i in range(micro_batches - 1):
        if overlap:     # the next dispatch is issued before this micro-batch's experts run
            expect(at["dispatch", i + 1][0] <= at["experts", i][0], f"{what}: dispatch {i + 1} not overlapped")
        else:           # one micro-batch after the other
            expect(at["combine", i][1] <= at["dispatch", i + 1][0], f"{what}: micro-batches {i}, {i + 1} overlap")


def check_timed(P, r, group):
    """timed_forward against the plain forward; with capacity dropping, against the plain
    forward on each micro-batch (each micro-batch is routed on its own)."""
    counts = per_rank([5, 2, 9, 3], P)
    for j, (cf, shared) in enumerate(((NEVER_DROPS, True), (1.0, False))):
        torch.manual_seed(400 + j)
        layer = ep.ExpertParallelMoE.from_dense(MoELayer(HIDDEN, FFN, 2 * P, 2, cf, shared=shared), group)
        x = inputs(counts, seed=410 + j)[0][r]
        with torch.no_grad():
            plain = layer(x)
        for mb in (1, 2):
            with torch.no_grad():
                per_chunk = torch.cat([layer(c) for c in x.chunk(mb)])
            for overlap in (False, True):
                what = f"timed_forward (capacity factor {cf}, {mb} micro-batches, overlap={overlap}, rank {r})"
                with comm.accounting() as acc:
                    out, events = ep.timed_forward(layer, x, micro_batches=mb, overlap=overlap)
                expect(not out.requires_grad, f"{what}: the output requires grad")
                counted = [rec for rec in acc.records if rec.label == "expert counts"]
                to_peers = tuple(0 if j == r else 2 * 8 for j in range(P))     # E/P = 2 int64 counts a peer
                expect(len(counted) == mb and all(rec.op == "all_to_all" and rec.peers == to_peers for rec in counted),
                       f"{what}: the count exchanges recorded\n{acc.table()}")
                if cf == NEVER_DROPS or mb == 1:
                    close(out, plain, f"{what}: output against the plain forward")
                close(out, per_chunk, f"{what}: output against the plain forward on each micro-batch")
                check_events(events, mb, overlap, what)


def check_micro_batch_count(P, r, group):
    """6 tokens on every rank in 4 micro-batches: 4 micro-batches in the timeline."""
    torch.manual_seed(500)
    layer = ep.ExpertParallelMoE.from_dense(MoELayer(HIDDEN, FFN, 2 * P, 2, NEVER_DROPS), group)
    x = inputs([6] * P, seed=501)[0][r]
    with torch.no_grad():
        plain = layer(x)
    for overlap in (False, True):
        what = f"timed_forward (6 tokens, 4 micro-batches, overlap={overlap}, rank {r})"
        out, events = ep.timed_forward(layer, x, micro_batches=4, overlap=overlap)
        close(out, plain, f"{what}: output")
        ran = sorted({i for _, i, _, _ in events})
        expect(ran == [0, 1, 2, 3], f"{what}: the timeline has micro-batches {ran}")
        check_events(events, 4, overlap, what)


# ---------------------------------------------------------------------------- bad input

def check_bad_input(P, r, group):
    """Each raises ValueError on every rank, before any rank communicates."""
    torch.manual_seed(600)
    dense = MoELayer(HIDDEN, FFN, 2 * P, 2, NEVER_DROPS)
    layer = ep.ExpertParallelMoE.from_dense(dense, group)
    rule = f"floating-point (T, {HIDDEN}) tensor"
    raises(lambda: layer(torch.randn(3, HIDDEN + 1)), rule, what="wrong hidden size")
    raises(lambda: layer(torch.randn(HIDDEN)), rule, what="1-D tokens")
    raises(lambda: layer(torch.randn(2, 3, HIDDEN)), rule, what="3-D tokens")
    raises(lambda: layer(torch.ones(3, HIDDEN, dtype=torch.int64)), rule, what="integer tokens")
    for E in sorted({P + 1, 3 * P - 1, 2 * P + 1} - {0}):
        if E % P:
            raises(lambda: ep.ExpertParallelMoE.from_dense(MoELayer(HIDDEN, FFN, E, 1), group),
                   f"{E} experts do not split evenly over P={P} ranks", what=f"E={E} on {P} ranks")
    x = torch.randn(4, HIDDEN)
    for nodes in (3, 5):
        if P % nodes:
            raises(lambda: ep.hierarchical_forward(layer, x, nodes), f"{P} ranks do not split evenly into {nodes} nodes",
                   what=f"hierarchical_forward on {nodes} nodes")
    raises(lambda: ep.timed_forward(layer, x[:1], micro_batches=2), "cannot cut 1 tokens into 2 micro-batches",
           what="timed_forward, fewer tokens than micro-batches")
    raises(lambda: ep.timed_forward(layer, x, micro_batches=0), "into 0 micro-batches",
           what="timed_forward, 0 micro-batches")
    # nothing is left half-done: a forward afterwards still matches the dense layer
    with torch.no_grad():
        close(layer(x), dense(x)[0], "forward after the bad input")


# ---------------------------------------------------------------------------- main

@record
def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    with distributed.setup() as d:
        P, r, group = d.world_size, d.rank, d.group
        if argv == ["micro-batches"]:
            check_micro_batch_count(P, r, group)
            marker = MICRO_MARKER
        elif not argv:
            check_bad_input(P, r, group)          # first: each must raise before any rank communicates
            seen = dict.fromkeys(("idle experts", "dropped", "ranks with 0 tokens", "ranks with 1 token"), 0)
            for i, spec in enumerate(CASES):
                check_case(i, spec, P, r, group, seen)
            check_timed(P, r, group)
            totals = torch.tensor([int(v) for v in seen.values()], dtype=torch.int64)
            dist.all_reduce(totals)               # the cases exercise what they claim to
            for name, total in zip(seen, totals.tolist()):
                expect(total > 0, f"no case had {name}: {dict(zip(seen, totals.tolist()))}")
            marker = MARKER
        else:
            raise SystemExit(f"unknown arguments {argv}; expected none or 'micro-batches'")
        dist.barrier()
        if d.is_main:
            print(f"{marker} {P}")


if __name__ == "__main__":
    main()
