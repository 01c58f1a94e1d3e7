"""Expert parallelism: experts spread over ranks, tokens moved by all-to-all (chapter 06).

With P ranks and E experts, rank r owns experts ``[r·E/P, (r+1)·E/P)``; the router (and a
shared expert, if any) is replicated. A forward pass on this rank's tokens:

1. route them (top-k, capacity — counted per source rank, GShard's "groups");
2. sort the kept assignments by expert, so each destination rank's tokens are
   contiguous and, within them, grouped by expert;
3. exchange per-expert counts (a small all-to-all), then **dispatch** the token vectors
   with ``all_to_all_single`` and uneven splits;
4. run each local expert on the tokens it received, from every rank;
5. **combine**: the reverse all-to-all brings each output home, where it is weighted and
   added to its token.

Backward flows through both all-to-alls (each one's backward is the other direction),
so expert weights get gradients from every rank's tokens and the router from this rank's.
:func:`simulate` is the same arithmetic without processes: the P×P traffic matrix, the
load per rank and the inter-node share for a router, used by the chapter's explorer and
checked against the measured traffic.
"""
from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .moe import MoELayer, Route, check_tokens, topk_route
from .rules import check_group_device as _check_group_device, whole as _whole


def check_placement(experts: int, P: int) -> None:
    """``ValueError`` unless the experts split evenly over the P ranks."""
    _whole(P, "the expert-parallel degree P")
    if _whole(experts, "the number of experts") % P:
        raise ValueError(f"{experts} experts do not split evenly over P={P} ranks")


def check_nodes(P: int, nodes: int) -> None:
    """``ValueError`` unless the P ranks form ``nodes`` equal nodes."""
    if P % _whole(nodes, "the number of nodes"):
        raise ValueError(f"{P} ranks do not split evenly into {nodes} nodes")


def owner(expert: torch.Tensor, experts: int, P: int) -> torch.Tensor:
    """The rank that owns each expert: experts are laid out contiguously, E/P per rank."""
    return torch.div(expert, experts // P, rounding_mode="floor")


@dataclass
class Dispatch:
    """What one forward pass moved, as this rank saw it."""

    send_counts: list[int]                  # kept assignments sent to each rank
    recv_counts: list[int]                  # assignments received from each rank
    per_expert: torch.Tensor                # (P, E/P): assignments received, by source and local expert
    route: Route | None = None
    expert_seconds: float = 0.0             # wall time of the local experts


class ExpertParallelMoE(nn.Module):
    """This rank's share of a :class:`~intralayer.moe.MoELayer`: E/P experts, a replicated router."""

    def __init__(self, dense: MoELayer, group):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ExpertParallelMoE needs a process group: build it inside distributed.setup()")
        P, r = dist.get_world_size(group), dist.get_rank(group)
        check_placement(dense.experts, P)
        self.group, self.P, self.rank = group, P, r
        self.E, self.k, self.hidden = dense.experts, dense.k, dense.hidden
        self.capacity_factor, self.groups, self.top_groups = dense.capacity_factor, dense.groups, dense.top_groups
        n = dense.experts // P
        self.first = r * n
        self.router = copy.deepcopy(dense.router)
        self.w1 = nn.Parameter(dense.w1.detach()[r * n:(r + 1) * n].clone())      # (E/P, ffn, h)
        self.w3 = nn.Parameter(dense.w3.detach()[r * n:(r + 1) * n].clone())
        self.w2 = nn.Parameter(dense.w2.detach()[r * n:(r + 1) * n].clone())      # (E/P, h, ffn)
        self.shared = copy.deepcopy(dense.shared)
        self.last: Dispatch | None = None

    @classmethod
    def from_dense(cls, moe_layer: MoELayer, group) -> "ExpertParallelMoE":
        return cls(moe_layer, group)

    @property
    def local_experts(self) -> int:
        return self.w1.shape[0]

    def shard(self, full: torch.Tensor, name: str) -> torch.Tensor:
        """This rank's piece of a dense parameter (or its gradient), by parameter name."""
        if name.split(".")[-1] in ("w1", "w2", "w3") and "shared" not in name:
            return full[self.first:self.first + self.local_experts]
        return full

    # The dense layer's routing (router, k, capacity factor, groups) and its SwiGLU expert,
    # which here indexes this rank's E/P experts.
    route = MoELayer.route
    expert = MoELayer.expert

    def exchange_expert_counts(self, expert: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """Tell each rank how many of this rank's assignments go to each of its experts (a small
        all-to-all, recorded as "expert counts"); ``expert``: the kept assignments' experts,
        sorted. Returns the counts received, ``(P sources, E/P)``, and the rows this rank
        will send to and receive from each rank."""
        P = self.P
        counts = torch.bincount(expert, minlength=self.E).view(P, -1)                      # (P owners, E/P)
        per_expert = comm.all_to_all(counts, [1] * P, [1] * P, self.group, "expert counts")  # (P sources, E/P)
        return per_expert, counts.sum(1).tolist(), per_expert.sum(1).tolist()

    def _check(self, x: torch.Tensor, who: str = "ExpertParallelMoE") -> None:
        # The experts' weights, not the router's: a program may swap the router for any module.
        check_tokens(x, self.hidden, self.w1, who, "this rank's tokens", "the experts' weights")
        _check_group_device(x, "x", who, self.group)

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self._check(x)
        P, n = self.P, self.local_experts
        route = self.route(x, bias)
        token, expert, weight = route.assignments()       # (A,) each, by expert, hence by owner rank too
        # 1. per-expert counts: rank j learns how many tokens of each of its experts come from each rank
        per_expert, send, recv = self.exchange_expert_counts(expert)                        # (P sources, E/P)
        # 2. dispatch the token vectors, uneven splits
        arrived = comm.all_to_all(x[token], send, recv, self.group, "dispatch")               # (R, h)
        # 3. regroup by local expert across sources, run each expert (even on no tokens: its
        #    weights then get a zero gradient, as in the dense layer)
        src_major = per_expert.flatten().tolist()                       # blocks: (source, expert) in order
        blocks = list(torch.arange(arrived.shape[0], device=x.device).split(src_major))
        by_expert = [torch.cat([blocks[s * n + e] for s in range(P)]) for e in range(n)]
        out_arrived = torch.zeros_like(arrived)
        t0 = time.perf_counter()
        for e, idx in enumerate(by_expert):
            out_arrived = out_arrived.index_add(0, idx, self.expert(e, arrived[idx]))
        secs = time.perf_counter() - t0
        # 4. combine: outputs go home in the order they came, then weighted and summed per token
        back = comm.all_to_all(out_arrived, recv, send, self.group, "combine")                # (A, h)
        out = torch.zeros_like(x).index_add(0, token, back * weight.unsqueeze(1))
        if self.shared is not None:
            out = out + self.shared(x)
        self.last = Dispatch(send, recv, per_expert, route, secs)
        return out


# ---------------------------------------------------------------------------- simulation

@dataclass
class Simulation:
    """Expert parallelism's traffic and load for given routers, without processes."""

    traffic: np.ndarray            # (P, P): assignments sent from rank i to rank j (dispatch)
    received: np.ndarray           # (P,): assignments each rank's experts process
    dropped: int
    assignments: int
    nodes: int

    @property
    def straggler(self) -> float:
        """Busiest rank's expert work over the mean: the step waits for the busiest."""
        mean = self.received.mean()
        return float(self.received.max() / mean) if mean else 1.0

    @property
    def inter_node_share(self) -> float:
        """Fraction of dispatched assignments that cross nodes."""
        P = len(self.received)
        node = np.arange(P) // (P // self.nodes)
        cross = self.traffic[node[:, None] != node[None, :]].sum()
        return float(cross / self.traffic.sum()) if self.traffic.sum() else 0.0

    def bytes(self, hidden: int, itemsize: int) -> np.ndarray:
        """(P, P) bytes of one dispatch (the combine sends the same back), diagonal excluded."""
        b = self.traffic * hidden * itemsize
        np.fill_diagonal(b, 0)
        return b


def simulate(logits_per_rank: list[torch.Tensor], k: int, capacity_factor: float, P: int, nodes: int = 1,
             node_limit: int | None = None, bias: torch.Tensor | None = None) -> Simulation:
    """Route each rank's tokens as :class:`ExpertParallelMoE` does and count what moves where.

    ``node_limit`` M restricts each token to experts on at most M nodes (DeepSeek-V3's
    node-limited routing, with the experts of a node forming one group).
    """
    E = logits_per_rank[0].shape[-1]
    check_placement(E, P)
    check_nodes(P, nodes)
    if len(logits_per_rank) != P:
        raise ValueError(f"simulate needs one logits matrix per rank: {len(logits_per_rank)} for P={P}")
    if node_limit is not None and not 1 <= node_limit <= nodes:
        raise ValueError(f"node limit M={node_limit} must lie between 1 and the {nodes} nodes")
    traffic = np.zeros((P, P), dtype=np.int64)
    dropped = total = 0
    for i, logits in enumerate(logits_per_rank):
        groups = nodes if node_limit is not None else 1
        r = topk_route(logits, k, capacity_factor, bias, groups, node_limit)
        dest = owner(r.expert_index[r.kept], E, P)
        traffic[i] += np.bincount(dest.numpy(), minlength=P)
        dropped += r.dropped
        total += r.kept.numel()
    return Simulation(traffic, traffic.sum(0), dropped, total, nodes)


def alltoall_seconds(bytes_matrix: np.ndarray, intra: float, inter: float, nodes: int) -> float:
    """Time of an all-to-all in which each rank sends to all its peers at once, its
    intra-node bytes at ``intra`` and its inter-node bytes at ``inter`` (bytes/s), the two
    one after the other; the busiest rank's sends or receives set the time. Adding the two
    is pessimistic: with NVLink and InfiniBand busy at the same time (as DeepSeek-V3's
    kernels keep them) it would be the larger of the two."""
    P = bytes_matrix.shape[0]
    check_nodes(P, nodes)
    node = np.arange(P) // (P // nodes)
    same = node[:, None] == node[None, :]
    t_send = (bytes_matrix * same).sum(1) / intra + (bytes_matrix * ~same).sum(1) / inter
    t_recv = (bytes_matrix * same).sum(0) / intra + (bytes_matrix * ~same).sum(0) / inter
    return float(max(t_send.max(), t_recv.max()))


def skewed_router_logits(T: int, E: int, skew: float, seed: int, hidden: int = 16) -> torch.Tensor:
    """Logits of a random router for T random tokens, skewed towards higher-numbered experts."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, hidden, generator=g)
    W = torch.randn(hidden, E, generator=g) / math.sqrt(hidden)
    return x @ W + skew * torch.linspace(0, 1, E)


@dataclass(frozen=True)
class Placement:
    """Where each expert's replicas sit and the load that leaves each rank with.

    ``replicas[e]`` copies of expert e; ``slots[r]`` the experts rank r holds (one entry per
    replica); ``rank_load[r]`` the assignments rank r processes, each replica taking an equal
    share of its expert's."""
    replicas: tuple[int, ...]
    slots: tuple[tuple[int, ...], ...]
    rank_load: tuple[float, ...]

    @property
    def straggler(self) -> float:
        return max(self.rank_load) / (sum(self.rank_load) / len(self.rank_load))


def contiguous_placement(load, P: int) -> Placement:
    """The chapter's layer: expert e on rank e·P // E, one copy each."""
    load = np.asarray(load, dtype=float)
    E = load.size
    check_placement(E, P)
    per = E // P
    slots = tuple(tuple(range(r * per, (r + 1) * per)) for r in range(P))
    return Placement((1,) * E, slots, tuple(float(load[list(s)].sum()) for s in slots))


def redundant_placement(load, P: int, redundant: int) -> Placement:
    """Redundant experts by the two steps of DeepSeek's EPLB global policy (its
    ``replicate_experts`` and ``balanced_packing``, commit d52c72d), written here anew.

    1. Give ``redundant`` extra replicas, one at a time, to the expert whose load per replica
       is the largest (ties: the lower index).
    2. Each replica carries its expert's load divided by its replica count; place them,
       heaviest first, on the least-loaded rank that still has a free slot. Every rank gets
       (E + redundant)/P slots. Greedy, so more replicas can pack worse than fewer.
    """
    load = np.asarray(load, dtype=float)
    E = load.size
    if load.ndim != 1 or E == 0 or (load < 0).any():
        raise ValueError(f"redundant_placement needs one non-negative load per expert, got shape {load.shape}")
    if redundant < 0 or (E + redundant) % P:
        raise ValueError(f"E + redundant = {E} + {redundant} slots must split evenly over P = {P} ranks "
                         f"(every rank holds the same number of experts)")
    replicas = np.ones(E, dtype=int)
    for _ in range(redundant):
        replicas[int(np.argmax(load / replicas))] += 1
    per_rank = (E + redundant) // P
    items = sorted(((load[e] / replicas[e], e) for e in range(E) for _ in range(replicas[e])),
                   key=lambda item: (-item[0], item[1]))
    slots, rank_load = [[] for _ in range(P)], [0.0] * P
    for share, e in items:
        r = min((r for r in range(P) if len(slots[r]) < per_rank), key=lambda r: (rank_load[r], r))
        slots[r].append(e)
        rank_load[r] += float(share)
    return Placement(tuple(int(n) for n in replicas), tuple(tuple(s) for s in slots), tuple(rank_load))


# ---------------------------------------------------------------------------- overlap

def _prepare(layer: ExpertParallelMoE, x: torch.Tensor):
    """Route and sort one micro-batch; exchange its per-expert counts (small, blocking)."""
    token, expert, weight = layer.route(x).assignments()
    per_expert, send, recv = layer.exchange_expert_counts(expert)
    return dict(x=x[token].contiguous(), token=token, weight=weight, per_expert=per_expert, send=send, recv=recv)


def _start_alltoall(src, send, recv, group):
    out = torch.empty(sum(recv), src.shape[1], dtype=src.dtype, device=src.device)
    work = dist.all_to_all_single(out, src, recv, send, group=group, async_op=True)
    return out, work


def _run_experts(layer: ExpertParallelMoE, arrived: torch.Tensor, per_expert: torch.Tensor) -> torch.Tensor:
    P, n = layer.P, layer.local_experts
    blocks = list(torch.arange(arrived.shape[0], device=arrived.device).split(per_expert.flatten().tolist()))
    out = torch.zeros_like(arrived)
    for e in range(n):
        idx = torch.cat([blocks[s * n + e] for s in range(P)])
        out.index_add_(0, idx, layer.expert(e, arrived[idx]))
    return out


def timed_forward(layer: ExpertParallelMoE, x: torch.Tensor, micro_batches: int = 2, overlap: bool = True):
    """Forward only (no autograd), in micro-batches, recording a timeline of this rank's work.

    Sequential: each micro-batch dispatches, computes, combines, then the next starts.
    Overlapped: the next micro-batch's dispatch is issued (asynchronously) before this
    one's experts run, and each combine is left in flight while the next computes. Returns
    ``(output, events)``; events are ``(what, micro-batch, start, end)`` in seconds from
    the start, an asynchronous operation ending when it was waited for.
    """
    layer._check(x, "timed_forward")
    if micro_batches < 1 or x.shape[0] < micro_batches:
        raise ValueError(f"cannot cut {x.shape[0]} tokens into {micro_batches} micro-batches")
    events, t0 = [], time.perf_counter()
    now = lambda: time.perf_counter() - t0
    with torch.no_grad():
        chunks = x.tensor_split(micro_batches)                # exactly micro_batches pieces
        preps = [_prepare(layer, c) for c in chunks]
        outs = [torch.zeros_like(c) for c in chunks]

        def finish(i, back):
            p = preps[i]
            outs[i].index_add_(0, p["token"], back * p["weight"].unsqueeze(1))

        if not overlap:
            for i, p in enumerate(preps):
                s = now()
                arrived, w = _start_alltoall(p["x"], p["send"], p["recv"], layer.group)
                w.wait()
                events.append(("dispatch", i, s, now()))
                s = now()
                y = _run_experts(layer, arrived, p["per_expert"])
                events.append(("experts", i, s, now()))
                s = now()
                back, w = _start_alltoall(y, p["recv"], p["send"], layer.group)
                w.wait()
                events.append(("combine", i, s, now()))
                finish(i, back)
        else:
            s = now()
            pending = [_start_alltoall(preps[0]["x"], preps[0]["send"], preps[0]["recv"], layer.group) + (s,)]
            combines = []
            for i, p in enumerate(preps):
                arrived, w, started = pending[i]
                w.wait()
                events.append(("dispatch", i, started, now()))
                if i + 1 < len(preps):                                   # next dispatch goes out now
                    q = preps[i + 1]
                    pending.append(_start_alltoall(q["x"], q["send"], q["recv"], layer.group) + (now(),))
                s = now()
                y = _run_experts(layer, arrived, p["per_expert"])
                events.append(("experts", i, s, now()))
                combines.append((i,) + _start_alltoall(y, p["recv"], p["send"], layer.group) + (now(),))
            for i, back, w, started in combines:
                w.wait()
                events.append(("combine", i, started, now()))
                finish(i, back)
        out = torch.cat(outs)
        if layer.shared is not None:
            out = out + layer.shared(x)
    return out, events


# ---------------------------------------------------------------------------- node-aware dispatch

def _exchange(t: torch.Tensor, counts: list[int], group, label: str) -> torch.Tensor:
    """An all-to-all of rows with uneven splits; the receive counts are exchanged first."""
    return comm.all_to_all(t, counts, None, group, label)


def hierarchical_forward(layer: ExpertParallelMoE, x: torch.Tensor, nodes: int) -> torch.Tensor:
    """Forward only: dispatch each token **once per destination node**, then forward within the node.

    The ranks form ``nodes`` nodes of ``m = P/nodes`` ranks; rank r = (node, local index).
    Stage 1 (across nodes): for every node that owns at least one of a token's experts, one
    copy of the token goes to that node's rank with r's local index (the gateway), with
    the list of (expert, weight) it needs there. Stage 2 (inside the node): the gateway
    sends the copy to each expert's owner. The combine runs backwards: owners return
    outputs to the gateway, which adds them up, weighted, and sends one vector per token
    and node home. This is how DeepSeek-V3 keeps inter-node traffic to one copy per node
    (and, with node-limited routing, to at most M nodes per token). The all-to-alls are
    recorded with labels ``"inter-node …"`` and ``"intra-node …"``.
    """
    P, r = layer.P, layer.rank
    check_nodes(P, nodes)
    layer._check(x, "hierarchical_forward")
    m, g = P // nodes, layer.group
    with torch.no_grad():
        T, dev = x.shape[0], x.device
        token, expert, weight = layer.route(x).assignments(by_expert=False)
        node = owner(expert, layer.E, P) // m
        # stage 1: unique (token, node) copies, sorted by node; gateway of node n is n·m + (r mod m)
        key = node * T + token
        uniq, copy_of = torch.unique(key, return_inverse=True)                     # sorted by node, then token
        copy_node, copy_token = uniq // T, uniq % T
        counts = [0] * P
        for n_, c in zip(*torch.unique(copy_node, return_counts=True)):
            counts[int(n_) * m + r % m] = int(c)
        copies = _exchange(x[copy_token], counts, g, "inter-node dispatch")       # (C, h) at the gateways
        # the (copy index, expert, weight) of every assignment, to the same gateways
        order = torch.argsort(copy_of, stable=True)
        a_counts = [0] * P
        for n_, c in zip(*torch.unique(node, return_counts=True)):
            a_counts[int(n_) * m + r % m] = int(c)
        start = torch.tensor([0] + counts, device=dev).cumsum(0)[:-1]            # first copy index per gateway
        local_copy = copy_of[order] - start[copy_node[copy_of[order]] * m + r % m]
        meta = torch.stack([local_copy.float(), expert[order].float(), weight[order]], 1)
        meta = _exchange(meta, a_counts, g, "inter-node routing")                  # (A', 3)
        # where each received assignment's copy sits in `copies`: sources arrive in rank order
        src_counts = _received_counts(counts, g)
        src_assign = _received_counts(a_counts, g)
        copy_base = torch.tensor([0] + src_counts, device=dev).cumsum(0)[:-1]
        src_of = torch.repeat_interleave(torch.arange(P, device=dev), torch.tensor(src_assign, device=dev))
        copy_idx = meta[:, 0].long() + copy_base[src_of]
        exp_ids, w = meta[:, 1].long(), meta[:, 2]
        # stage 2: inside the node, one vector per assignment to the expert's owner
        dest = owner(exp_ids, layer.E, P)
        by_dest = torch.argsort(dest, stable=True)
        d_counts = torch.bincount(dest, minlength=P).tolist()
        at_owner = _exchange(copies[copy_idx[by_dest]], d_counts, g, "intra-node dispatch")
        own_exp = _exchange(exp_ids[by_dest].float().unsqueeze(1), d_counts, g, "intra-node routing")
        own_exp = own_exp.squeeze(1).long() - layer.first
        y = torch.zeros_like(at_owner)
        for e in range(layer.local_experts):
            idx = (own_exp == e).nonzero().squeeze(1)
            y.index_add_(0, idx, layer.expert(e, at_owner[idx]))
        # combine: back to the gateway, weighted sum per copy, back home once per (token, node)
        back = comm.all_to_all(y, _received_counts(d_counts, g), d_counts, g, "intra-node combine")
        per_assign = torch.empty_like(back)
        per_assign[by_dest] = back
        summed = torch.zeros_like(copies).index_add_(0, copy_idx, per_assign * w.unsqueeze(1))
        home = comm.all_to_all(summed, src_counts, counts, g, "inter-node combine")
        out = torch.zeros_like(x).index_add_(0, copy_token, home)
        if layer.shared is not None:
            out = out + layer.shared(x)
    return out


def _received_counts(send_counts: list[int], group) -> list[int]:
    return comm.exchange_counts(send_counts, group)


def node_traffic(logits_per_rank: list[torch.Tensor], k: int, capacity_factor: float, P: int, nodes: int,
                 node_limit: int | None = None) -> dict:
    """Token copies that cross nodes: one per assignment (plain all-to-all) and one per
    (token, remote node) (node-aware dispatch), over all ranks' tokens."""
    E = logits_per_rank[0].shape[-1]
    check_placement(E, P)
    check_nodes(P, nodes)
    if len(logits_per_rank) != P:
        raise ValueError(f"node_traffic needs one logits matrix per rank: {len(logits_per_rank)} for P={P}")
    m = P // nodes
    per_assignment = per_node = 0
    for i, logits in enumerate(logits_per_rank):
        token, expert, _ = topk_route(logits, k, capacity_factor, None, nodes if node_limit else 1,
                                      node_limit).assignments(by_expert=False)
        T = logits.shape[0]
        node = owner(expert, E, P) // m
        remote = node != i // m
        per_assignment += int(remote.sum())
        per_node += int(torch.unique(node[remote] * T + token[remote]).numel())
    return dict(per_assignment=per_assignment, per_node=per_node)
