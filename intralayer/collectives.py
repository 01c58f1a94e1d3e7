"""Chapter 00: the collectives, simulated in NumPy, written with send/recv, and costed.

* :func:`ring_reduce_scatter_np`, :func:`ring_all_gather_np`, :func:`ring_all_reduce_np`
  and :func:`all_to_all_np` simulate n devices as a list of arrays and count the bytes
  each device sends, step by step.
* :func:`ring_all_reduce` is the same ring written with real ``torch.distributed``
  send/recv, so that :mod:`intralayer.comm`'s accounting counts the bytes it sends.
* :func:`collective_time` is the α–β (latency–bandwidth) cost model; :func:`fit_alpha_beta`
  fits it to measured times; :data:`LINKS` (from :mod:`intralayer.hardware`) holds link bandwidths
  with their sources.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .comm import bus_factor
from .hardware import LINKS, Link  # noqa: F401  (the links' facts live in intralayer.hardware)

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _check_devices(arrays) -> int:
    n = len(arrays)
    if n < 1:
        raise ValueError("need at least one simulated device")
    shapes = {np.shape(a) for a in arrays}
    if len(shapes) != 1:
        raise ValueError(f"every device must hold an array of the same shape, got {sorted(shapes)}")
    return n


# ------------------------------------------------------------------ NumPy simulations

@dataclass
class RingRun:
    """A simulated ring collective: what each device ends with, and what it sent."""

    result: list            # per device: its final chunk(s) or array
    sent_bytes: list[int]   # per device
    steps: list[list[tuple[int, int, int]]]  # per step: (from device, to device, chunk index)
    states: list[list[list]]  # before the first step and after each: device -> chunk -> array or None


def ring_reduce_scatter_np(arrays: list[np.ndarray]) -> RingRun:
    """Reduce-scatter on a ring: device i ends with chunk i of the sum of all arrays.

    Each array is split into n chunks (``np.array_split`` on the flattened array). At
    step j = 1 … n−1, device i sends its running partial sum of chunk (i−j) mod n to
    device i+1, which adds its own copy of that chunk. After n−1 steps the partial sum
    of chunk i, having passed every device once, arrives complete at device i.
    """
    n = _check_devices(arrays)
    parts = [[c.copy() for c in np.array_split(np.asarray(a).ravel(), n)] for a in arrays]
    sent = [0] * n
    steps = []
    states = [[[c.copy() for c in p] for p in parts]]
    for j in range(1, n):
        outgoing = [(i, (i + 1) % n, (i - j) % n) for i in range(n)]
        payload = [parts[i][c].copy() for i, _, c in outgoing]      # all send at once
        for (i, nxt, c), data in zip(outgoing, payload):
            parts[nxt][c] += data
            sent[i] += data.nbytes
        steps.append(outgoing)
        states.append([[c.copy() for c in p] for p in parts])
    return RingRun([parts[i][i] for i in range(n)], sent, steps, states)


def ring_all_gather_np(chunks: list[np.ndarray]) -> RingRun:
    """All-gather on a ring: device i starts with chunk i and ends with all n in order.

    At step j = 1 … n−1, device i forwards chunk (i−j+1) mod n to i+1: its own chunk at
    step 1, then the one it received last.
    """
    n = len(chunks)
    if n < 1:
        raise ValueError("need at least one simulated device")
    held = [{i: np.asarray(chunks[i]).copy()} for i in range(n)]
    sent = [0] * n
    steps = []

    def snapshot():
        return [[h[c].copy() if c in h else None for c in range(n)] for h in held]

    states = [snapshot()]
    for j in range(1, n):
        outgoing = [(i, (i + 1) % n, (i - j + 1) % n) for i in range(n)]
        for i, nxt, c in outgoing:
            held[nxt][c] = held[i][c].copy()
            sent[i] += held[i][c].nbytes
        steps.append(outgoing)
        states.append(snapshot())
    return RingRun([np.concatenate([h[c] for c in range(n)]) for h in held], sent, steps, states)


def ring_all_reduce_np(arrays: list[np.ndarray]) -> RingRun:
    """All-reduce as reduce-scatter followed by all-gather: 2(n−1) steps.

    Numbering the steps j = 1 … 2(n−1) through both phases, device i sends chunk
    (i−j) mod n at every step: the receiver adds it in the first n−1 steps and keeps the
    finished chunk in the last n−1.
    """
    _check_devices(arrays)
    shape = np.shape(arrays[0])
    rs = ring_reduce_scatter_np(arrays)
    ag = ring_all_gather_np(rs.result)
    # After the reduce-scatter, device i holds only its finished chunk i.
    return RingRun([r.reshape(shape) for r in ag.result],
                   [a + b for a, b in zip(rs.sent_bytes, ag.sent_bytes)], rs.steps + ag.steps,
                   rs.states + ag.states[1:])


def all_to_all_np(blocks: list[list[np.ndarray]]) -> RingRun:
    """All-to-all: ``blocks[i][j]`` is what device i sends to device j.

    Device j ends with ``[blocks[0][j], blocks[1][j], …]``: the n×n grid of blocks is
    transposed. A device's block to itself does not travel.
    """
    n = len(blocks)
    if n < 1 or any(len(row) != n for row in blocks):
        raise ValueError(f"blocks must be an n×n grid (one block per sender and receiver), got rows of "
                         f"{[len(r) for r in blocks]}")
    result = [[np.asarray(blocks[i][j]) for i in range(n)] for j in range(n)]
    sent = [sum(np.asarray(blocks[i][j]).nbytes for j in range(n) if j != i) for i in range(n)]
    moves = [(i, j, j) for i in range(n) for j in range(n) if i != j]
    return RingRun(result, sent, [moves], [[list(row) for row in blocks], result])


# ------------------------------------------------------------------ real send/recv ring

def ring_all_reduce(x, group=None):
    """All-reduce (sum) of a tensor on a ring of real ranks, with send/recv only.

    The same two phases as :func:`ring_all_reduce_np`. Returns a new tensor; every send
    is recorded by :mod:`intralayer.comm`'s accounting, so the bytes are counted, not
    assumed. (No autograd: this is for seeing the algorithm, not for training.)
    """
    import torch.distributed as dist

    from .comm import sendrecv

    n, r = dist.get_world_size(group), dist.get_rank(group)
    flat = x.detach().contiguous().view(-1).clone()
    parts = list(flat.tensor_split(n))                    # views into flat: n chunks
    nxt, prv = (r + 1) % n, (r - 1) % n
    # At step j this rank sends chunk (r − j) mod n and receives chunk (r − j − 1) mod n,
    # the one its left neighbour sends: steps 1 … n−1 add it (reduce-scatter), steps
    # n … 2(n−1) keep it, finished (all-gather).
    for j in range(1, n):                                 # reduce-scatter
        out_c, in_c = (r - j) % n, (r - j - 1) % n
        got = sendrecv(parts[out_c], nxt, prv, parts[in_c].shape, group, label="ring reduce-scatter")
        parts[in_c] += got
    for j in range(n, 2 * n - 1):                         # all-gather
        out_c, in_c = (r - j) % n, (r - j - 1) % n
        got = sendrecv(parts[out_c], nxt, prv, parts[in_c].shape, group, label="ring all-gather")
        parts[in_c].copy_(got)
    return flat.view_as(x)


# ------------------------------------------------------------------ the α–β cost model

def steps(op: str, n: int) -> int:
    """Latency-bound steps of the ring algorithm (pairwise exchange for all-to-all)."""
    bus_factor(op, n)                                     # validates op and n
    return 2 * (n - 1) if op == "all_reduce" else (n - 1)


def collective_time(op: str, n: int, size_bytes: float, bandwidth: float, alpha: float) -> float:
    """α–β model of a collective of S = ``size_bytes`` on n ranks.

    time = steps(op, n)·α + bus_factor(op, n)·S / bandwidth — latency per step plus the
    bytes each rank must send over its link (Thakur, Rabenseifner & Gropp 2005; the
    bus-bandwidth factors of nccl-tests).
    """
    if size_bytes < 0:
        raise ValueError(f"message size {size_bytes} bytes must be ≥ 0")
    if bandwidth <= 0:
        raise ValueError(f"link bandwidth {bandwidth} bytes/s must be > 0")
    if alpha < 0:
        raise ValueError(f"latency α={alpha} s must be ≥ 0")
    return steps(op, n) * alpha + bus_factor(op, n) * size_bytes / bandwidth


@dataclass(frozen=True)
class Fit:
    """α (s per step) and bandwidth (bytes/s) fitted to measured times of one collective."""

    op: str
    n: int
    alpha: float
    bandwidth: float
    max_rel_error: float

    def predict(self, size_bytes):
        return steps(self.op, self.n) * self.alpha + bus_factor(self.op, self.n) * np.asarray(size_bytes) / self.bandwidth


def fit_alpha_beta(op: str, n: int, sizes, times) -> Fit:
    """Least-squares fit of t = steps·α + factor·S/B, weighting each point by 1/t.

    Relative weighting makes the small (latency-bound) and large (bandwidth-bound)
    messages count alike although their times differ by orders of magnitude.
    """
    S = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if S.shape != t.shape or S.size < 2:
        raise ValueError("need at least two (size, time) pairs of equal length")
    if (t <= 0).any():
        raise ValueError("measured times must be positive")
    if n < 2:
        raise ValueError(f"n={n}: a collective on one rank sends nothing, so there is no model to fit")
    A = np.stack([np.full_like(S, steps(op, n)), S * bus_factor(op, n)], axis=1) / t[:, None]
    (alpha, inv_bw), *_ = np.linalg.lstsq(A, np.ones_like(t), rcond=None)
    if inv_bw <= 0:
        raise ValueError("the fitted time does not grow with message size; measure larger messages")
    fit = Fit(op, n, max(alpha, 0.0), 1.0 / inv_bw, 0.0)
    err = float(np.max(np.abs(fit.predict(S) - t) / t))
    return Fit(op, n, fit.alpha, fit.bandwidth, err)


# ------------------------------------------------------------------ NCCL's own cost model, at scale
#
# NCCL picks an algorithm for every collective from a model of its time: a latency that grows with
# the number of steps, plus the bytes over a bandwidth (src/graph/tuning.cc, NVIDIA/nccl at commit
# 5067397c, ``ncclTopoTuneModel`` and ``ncclTopoGetAlgoTime``). The figures below are that file's
# defaults (``ncclTunerConstantsDefaults``), in microseconds: the ring's step over NVLink for each of
# the three protocols, and the rest for the Simple protocol, the one NCCL uses for large messages.

#: A collective's base latency (``baseLatencies``, Simple: ring and tree alike).
NCCL_BASE_US = 8.4
#: The latency NCCL charges one step of a ring over NVLink, by protocol (``hwLatencies``, the NVLINK
#: row's Ring entries): chapter 00's explorer offers all three and starts at LL128's.
NCCL_RING_NVLINK_STEP_US = {"LL": 0.6, "LL128": 1.9, "Simple": 3.4}
#: The latency of one step, by algorithm and link (``hwLatencies``, Simple): NVLink inside a node,
#: the network between nodes.
NCCL_STEP_US = {("ring", "nvlink"): NCCL_RING_NVLINK_STEP_US["Simple"], ("tree", "nvlink"): 4.0,
                ("ring", "net"): 14.0, ("tree", "net"): 14.0}
#: Inside a multi-node ring every step costs at least the network overhead (``getNetOverhead``: 1 µs on
#: Intel x86, 2 on AMD), tripled for the Simple protocol; a cluster gives its own (``Cluster.net_overhead_us``).
NCCL_NET_OVERHEAD_US = 1.0
#: A multi-node ring all-reduce of large messages has its latency raised 1.4× on compute capability
#: 8.0 and later (1.9× before; the course's clusters are all 8.0 or later): the "plateau effect of ring".
NCCL_RING_PLATEAU = 1.4
#: The tree's bus bandwidth is 0.92 of the ring's, and a tree all-reduce moves each byte twice
#: (algorithm bandwidth = bus bandwidth / 2), corrected by ``treeCorrectionFactor`` for messages of
#: 64 B·2^i, i < 23 (the Simple row):
NCCL_TREE_BW = 0.92
#: With one GPU of the communicator per node the tree's pattern is NCCL_TOPO_PATTERN_TREE (search.cc), whose
#: bus bandwidth NCCL lowers by a further 0.85.
NCCL_TREE_ONE_PER_NODE = 0.85
NCCL_TREE_CORRECTION = (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9)
NCCL_ALGORITHMS = ("ring", "tree")


def _log2i(n: int) -> int:
    return int(n).bit_length() - 1


def nccl_latency(op: str, ranks: int, nodes: int = 1, algorithm: str = "ring",
                 net_overhead_us: float = NCCL_NET_OVERHEAD_US) -> float:
    """Seconds of latency NCCL's tuning model charges one ``op`` on ``ranks`` GPUs over ``nodes`` nodes.

    Ring: ``base + (steps − inter)·intra + inter·net`` with ``steps = 2(n−1)`` for an all-reduce
    (``n−1`` for all-gather and reduce-scatter) of which ``2(nodes−1)`` (``nodes−1``) cross the
    network; a multi-node ring all-reduce ×1.4 (:data:`NCCL_RING_PLATEAU`: NCCL applies it on Ampere and
    later once each channel's share of each rank is 64 bytes or more, true of any gradient bucket). Tree (all-reduce
    only): ``base + 2·((n/nodes − 1)·intra + ⌊log2 nodes⌋·net)`` — logarithmic in the nodes, where
    the ring is linear.
    """
    if op not in ("all_reduce", "all_gather", "reduce_scatter"):
        raise ValueError(f"NCCL's model here covers all_reduce, all_gather and reduce_scatter, not {op!r}")
    if algorithm not in NCCL_ALGORITHMS:
        raise ValueError(f"algorithm must be one of {NCCL_ALGORITHMS}, got {algorithm!r}")
    for value, what in ((ranks, "ranks"), (nodes, "nodes")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what}={value!r} must be a whole number ≥ 1")
    if nodes > ranks:
        raise ValueError(f"nodes={nodes} cannot exceed ranks={ranks}: every node holds at least one rank")
    if algorithm == "tree" and op != "all_reduce":
        raise ValueError("NCCL's tree runs all-reduces only; all-gather and reduce-scatter use the ring")
    if ranks == 1:
        return 0.0
    net = NCCL_STEP_US[(algorithm, "net")]
    if algorithm == "tree":
        intra = NCCL_STEP_US[("tree", "nvlink")]
        return 1e-6 * (NCCL_BASE_US + 2 * ((ranks // nodes - 1) * intra + _log2i(nodes) * net))
    intra = NCCL_STEP_US[("ring", "nvlink")]
    if nodes > 1:
        intra = max(intra, 3 * net_overhead_us)
    total, inter = (2 * (ranks - 1), 2 * (nodes - 1)) if op == "all_reduce" else (ranks - 1, nodes - 1)
    latency = NCCL_BASE_US + (total - inter) * intra + inter * net
    if op == "all_reduce" and nodes > 1:
        latency *= NCCL_RING_PLATEAU
    return 1e-6 * latency


def nccl_time(op: str, size_bytes: float, ranks: int, nodes: int, bandwidth: float,
              algorithm: str = "auto", net_overhead_us: float = NCCL_NET_OVERHEAD_US) -> tuple[float, str]:
    """(seconds, algorithm) of one ``op`` of S = ``size_bytes`` in NCCL's model for the Simple protocol, with
    ``bandwidth`` the ring's bus bandwidth per GPU (bytes/s); ``"auto"`` takes the faster of ring and tree
    (an all-reduce only: the others run on the ring). NCCL's tuner also weighs the LL and LL128 protocols
    and the NVLS, CollNet and PAT algorithms, which this model leaves out: its pick is the Simple
    protocol's, not necessarily NCCL's."""
    if not (isinstance(size_bytes, (int, float)) and size_bytes >= 0 and bandwidth > 0):
        raise ValueError(f"size_bytes={size_bytes!r} must be ≥ 0 and bandwidth={bandwidth!r} > 0")
    if algorithm == "auto":
        choices = NCCL_ALGORITHMS if op == "all_reduce" and nodes > 1 else ("ring",)
        return min((nccl_time(op, size_bytes, ranks, nodes, bandwidth, a, net_overhead_us) for a in choices),
                   key=lambda t: t[0])
    if ranks == 1:
        return 0.0, algorithm
    latency = nccl_latency(op, ranks, nodes, algorithm, net_overhead_us)
    if algorithm == "ring":
        return latency + bus_factor(op, ranks) * size_bytes / bandwidth, "ring"
    size_class = _log2i(int(size_bytes) >> 6)                 # −1 below 64 bytes: no correction, as in NCCL
    correction = NCCL_TREE_CORRECTION[size_class] if 0 <= size_class < len(NCCL_TREE_CORRECTION) else 1.0
    pattern = NCCL_TREE_ONE_PER_NODE if ranks == nodes else 1.0
    return latency + 2 * size_bytes / (NCCL_TREE_BW * pattern * bandwidth * correction), "tree"
