"""Chapter 06: expert parallelism on real ranks — correctness, traffic, load, topology, overlap.

Part 1. Every rank builds the same single-device ``MoELayer`` and every rank's tokens
(same seeds), so it can compute the reference: the dense layer on each rank's tokens, its
gradients summed over ranks. Then it runs ``ExpertParallelMoE`` on its own tokens and
checks the output, the input gradient, its experts' weight gradients and the router's
gradient (``torch.testing.assert_close``, float32 defaults), in cases that include a rank
with no tokens, an expert that receives none, and capacity dropping.

Part 2. The P×P matrix of bytes each rank's dispatch sent to each rank, recorded by
``comm.accounting``, against ``expert_parallel.simulate`` on the same router logits.

Part 3. Load: assignments each rank's experts processed and the time they took, for a
skewed router with no capacity limit, with capacity factor 1.25, and with DeepSeek-V3's
bias balancer (trained on the same router beforehand).

Part 4. Topology: the ranks grouped into 2 nodes and a node-aware dispatch (one copy of a
token per destination node); token copies that cross nodes with and without node-limited
routing (each token to experts on at most 1 node), measured and counted.

Part 5. A timeline of a forward pass in two micro-batches, sequential and overlapped.

Laptop (gloo, CPU)::

    torchrun --standalone --nproc-per-node 4 -m intralayer.programs.ep_moe

One GPU node (NCCL) — written to be device-agnostic, but not yet run on a GPU or with NCCL
(``make gpu-check`` runs it there). Parts 1, 2 and 4 check the same things there; the
times of parts 3 and 5 are CPU-clock readings, which on a GPU do not time the kernels
(CUDA runs them asynchronously)::

    torchrun --standalone --nproc-per-node 8 -m intralayer.programs.ep_moe --tokens 4096
"""
from __future__ import annotations

import argparse
import json
import math

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from intralayer import comm, distributed
from intralayer import expert_parallel as ep
from intralayer.moe import MoELayer, bias_update, topk_route
from intralayer.programs.common import error_label

HIDDEN, FFN = 16, 32


def _diff(got, want) -> float:
    torch.testing.assert_close(got, want)                    # float32: rtol 1.3e-6, atol 1e-5
    return float((got - want).abs().max().detach()) if got.numel() else 0.0


def correctness(d, E, k, cf, shared, tokens, seed) -> dict:
    """ExpertParallelMoE on this rank's tokens against the dense layer on every rank's tokens."""
    r, dev = d.rank, d.device
    torch.manual_seed(seed)
    dense = MoELayer(HIDDEN, FFN, E, k, cf, shared=shared).to(dev)
    layer = ep.ExpertParallelMoE.from_dense(dense, d.group)
    g = torch.Generator().manual_seed(seed + 1)
    xs = [(torch.randn(t, HIDDEN, generator=g) + torch.linspace(0, 2, HIDDEN)).to(dev) for t in tokens]
    dys = [torch.randn(t, HIDDEN, generator=g).to(dev) for t in tokens]
    ref_out = ref_dx = ref_router = None
    for i, (x, dy) in enumerate(zip(xs, dys)):                # the dense layer, rank by rank
        before = None if dense.router.weight.grad is None else dense.router.weight.grad.clone()
        xi = x.clone().requires_grad_()
        y, _ = dense(xi)
        y.backward(dy)
        if i == r:
            ref_out, ref_dx = y.detach(), xi.grad
            ref_router = dense.router.weight.grad.clone() - (0 if before is None else before)
    x = xs[r].clone().requires_grad_()
    out = layer(x)
    out.backward(dys[r])
    diffs = dict(out=_diff(out, ref_out), dx=_diff(x.grad, ref_dx), router=_diff(layer.router.weight.grad, ref_router),
                 experts=max(_diff(getattr(layer, n).grad, layer.shard(getattr(dense, n).grad, n))
                             for n in ("w1", "w2", "w3")))
    got = layer.last
    return dict(diffs=diffs, tokens=tokens[r], dropped=got.route.dropped, received=sum(got.recv_counts),
                empty_experts=int((got.per_expert.sum(0) == 0).sum()))


CASES = [  # E, k, capacity factor, shared expert, tokens per rank, what it exercises
    # Rank r gets entry r mod 8 (rank 1 has no tokens whenever P ≥ 2), and E becomes the least
    # common multiple of E and P, so every case runs on any number of ranks (8 on a GPU node).
    (8, 2, 8.0, False, [12, 0, 7, 5, 3, 9, 0, 1], "uneven tokens, a rank with none"),
    (8, 2, 1.0, True, [16] * 8, "capacity dropping, shared expert"),
    (8, 1, 1.25, False, [9, 3, 1, 6, 2, 5, 1, 4], "experts that receive nothing"),
]


def sized(case, P: int) -> tuple:
    """A case's (E, k, capacity factor, shared, tokens per rank) for P ranks."""
    E, k, cf, shared, tokens, _ = case
    return math.lcm(E, P), k, cf, shared, [tokens[r % len(tokens)] for r in range(P)]


def traffic(d, E, k, cf, T, skew, seed, node_limit=None, nodes=1, bias=None) -> dict:
    """One forward on T tokens per rank; the measured dispatch bytes to each rank, and the simulation."""
    P, r, dev = d.world_size, d.rank, d.device
    torch.manual_seed(seed)
    dense = MoELayer(HIDDEN, FFN, E, k, cf, groups=nodes if node_limit else 1, top_groups=node_limit).to(dev)
    layer = ep.ExpertParallelMoE.from_dense(dense, d.group)
    xs = [torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(seed + 10 + i)).to(dev) for i in range(P)]
    offset = skew * torch.linspace(0, 1, E, device=dev)                             # the router's skew
    logits = [dense.router(x).detach() + offset for x in xs]                        # every rank's routing
    layer.router = _FixedLogits(logits[r])
    with torch.no_grad(), comm.accounting() as acc:
        layer(xs[r], bias=None if bias is None else bias.to(dev))
    dispatch = next(rec for rec in acc.records if rec.label == "dispatch")
    sim = ep.simulate([lg.cpu() for lg in logits], k, cf, P, nodes=nodes, node_limit=node_limit, bias=bias)
    return dict(row=list(dispatch.peers), sim=sim, received=sum(layer.last.recv_counts),
                seconds=layer.last.expert_seconds, dropped=layer.last.route.dropped)


def topology(d, E, k, T, nodes, node_limit, seed) -> dict:
    """Node-aware dispatch (one copy per token and node): measured inter-node bytes and the count."""
    P, r, dev = d.world_size, d.rank, d.device
    torch.manual_seed(seed)
    dense = MoELayer(HIDDEN, FFN, E, k, float(E), groups=nodes if node_limit else 1, top_groups=node_limit).to(dev)
    layer = ep.ExpertParallelMoE.from_dense(dense, d.group)
    xs = [torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(seed + 10 + i)).to(dev) for i in range(P)]
    with torch.no_grad():
        reference = layer(xs[r])
        with comm.accounting() as acc:
            out = ep.hierarchical_forward(layer, xs[r], nodes)
        torch.testing.assert_close(out, reference)           # the two-stage dispatch computes the same
        logits = [dense.router(x).cpu() for x in xs]
    m = P // nodes
    rec = next(rec for rec in acc.records if rec.label == "inter-node dispatch")
    cross = sum(b for j, b in enumerate(rec.peers) if j // m != r // m)
    return dict(measured=int(cross), formula=ep.node_traffic(logits, k, float(E), P, nodes, node_limit))


class _FixedLogits(torch.nn.Module):
    """A router that returns given logits (so every rank can know every rank's routing)."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits

    def forward(self, x):
        return self.logits


def train_bias(E, k, T, P, skew, seed, steps=300, gamma=0.01) -> torch.Tensor:
    """DeepSeek-V3's bias balancer, run on fresh batches of the same skewed router."""
    torch.manual_seed(seed)
    router = MoELayer(HIDDEN, FFN, E, k).router
    bias = torch.zeros(E)
    g = torch.Generator().manual_seed(seed + 99)
    with torch.no_grad():
        for _ in range(steps):
            logits = router(torch.randn(P * T, HIDDEN, generator=g)) + skew * torch.linspace(0, 1, E)
            bias = bias_update(bias, topk_route(logits, k, 100.0, bias).counts, gamma)
    return bias


@record
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per rank for parts 2-5")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--out", help="write rank 0's tables to this JSON file")
    a = ap.parse_args(argv)
    with distributed.setup() as d:
        P, E, T = d.world_size, a.experts, a.tokens
        ep.check_placement(E, P)
        checks = [correctness(d, *sized(case, P), seed=i) for i, case in enumerate(CASES)]
        base = traffic(d, E, 2, float(E), T, 2.0, seed=7)
        capped = traffic(d, E, 2, 1.25, T, 2.0, seed=7)
        bias = train_bias(E, 2, T, P, 2.0, seed=7)
        biased = traffic(d, E, 2, float(E), T, 2.0, seed=7, bias=bias)
        nodes = 2 if P % 2 == 0 else 1
        topo = {name: topology(d, E, 4, T, nodes, limit, seed=8) for name, limit in
                (("no node limit", None), ("node limit 1", 1))}
        torch.manual_seed(11)
        layer = ep.ExpertParallelMoE.from_dense(MoELayer(64, 256, E, 2, float(E)).to(d.device), d.group)
        xt = torch.randn(8 * T, 64).to(d.device)
        timelines = {}
        for overlap in (False, True, False, True):                 # twice each; keep the second run
            _, events = ep.timed_forward(layer, xt, micro_batches=2, overlap=overlap)
            timelines["overlapped" if overlap else "sequential"] = events
        rows = dict(checks=checks, runs={name: dict(row=v["row"], received=v["received"], seconds=v["seconds"],
                                                    dropped=v["dropped"])
                                         for name, v in (("skewed", base), ("capacity 1.25", capped),
                                                         ("bias balancer", biased))},
                    topology={name: v["measured"] for name, v in topo.items()}, timelines=timelines)
        every = [None] * P
        dist.all_gather_object(every, rows)
        for name, v in (("skewed", base), ("capacity 1.25", capped), ("bias balancer", biased)):
            measured = np.array([rank["runs"][name]["row"] for rank in every])
            if not np.array_equal(measured, v["sim"].bytes(HIDDEN, 4)):
                raise AssertionError(f"{name}: measured traffic\n{measured}\n≠ simulated\n{v['sim'].bytes(HIDDEN, 4)}")
        if d.is_main:
            sims = {"skewed": base["sim"], "capacity 1.25": capped["sim"], "bias balancer": biased["sim"]}
            report(d, a, every, sims, nodes, topo)
            if a.out:
                with open(a.out, "w") as f:
                    json.dump(dict(P=P, E=E, T=T, hidden=HIDDEN, nodes=nodes, ranks=every,
                                   sims={k_: dict(traffic=v.traffic.tolist(), dropped=v.dropped,
                                                  assignments=v.assignments) for k_, v in sims.items()},
                                   topology={k_: v["formula"] for k_, v in topo.items()}), f)


def report(d, a, every, sims, nodes, topo) -> None:
    P = d.world_size
    print(f"P = {P} ranks ({d.backend}, {d.device.type}), hidden {HIDDEN}, expert width {FFN}, float32")
    print("\n1. ExpertParallelMoE vs the single-device MoELayer (largest difference over all ranks)")
    print(f"{'case':36} {'tokens/rank':>14} {'dropped':>8} {'output':>7} {'dX':>7} {'experts':>8} {'router':>7}")
    for i, case in enumerate(CASES):
        worst = {k_: max(rank["checks"][i]["diffs"][k_] for rank in every) for k_ in ("out", "dx", "experts", "router")}
        toks = [rank["checks"][i]["tokens"] for rank in every]
        dropped = sum(rank["checks"][i]["dropped"] for rank in every)
        print(f"{case[5]:36} {str(toks):>14} {dropped:8d} " + " ".join(
            f"{error_label(worst[k_]):>7}" for k_ in ("out", "dx")) + f" {error_label(worst['experts']):>8} "
            f"{error_label(worst['router']):>7}")
    empties = [rank["checks"][2]["empty_experts"] for rank in every]
    print(f"(third case: experts with no tokens on each rank: {empties})")
    print(f"\n2. Dispatch bytes from rank i (row) to rank j (column), {a.tokens} tokens per rank, k = 2, "
          f"skew 2, no capacity limit — measured = simulated")
    m = np.array([rank["runs"]["skewed"]["row"] for rank in every])
    for i, row in enumerate(m):
        print("   " + " ".join(f"{v:8d}" for v in row))
    print(f"   off the diagonal: {m.sum():,} bytes = {sims['skewed'].traffic.sum() - np.trace(sims['skewed'].traffic)} "
          f"assignments × {HIDDEN} × 4 bytes (the combine sends the same back)")
    print("\n3. Load: assignments each rank's experts processed")
    for name in ("skewed", "capacity 1.25", "bias balancer"):
        rec = [rank["runs"][name]["received"] for rank in every]
        print(f"   {name:14} {str(rec):28} straggler factor {max(rec) / np.mean(rec):.2f}   "
              f"dropped {sims[name].dropped}")
    print(f"\n4. Topology: {P} ranks as {nodes} nodes, {a.experts} experts, k = 4; token copies that cross nodes")
    print(f"   {'routing':14} {'one per assignment':>19} {'one per (token, node)':>22} {'measured bytes':>15}"
          f" {'= copies × h × 4':>17}")
    for name, v in topo.items():
        measured = sum(rank["topology"][name] for rank in every)
        f = v["formula"]
        print(f"   {name:14} {f['per_assignment']:19d} {f['per_node']:22d} {measured:15d} "
              f"{f['per_node'] * HIDDEN * 4:17d}")
    print("\nall checks passed on every rank")


if __name__ == "__main__":
    main()
