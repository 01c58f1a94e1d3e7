"""Tests of intralayer.expert_parallel.

(a) ExpertParallelMoE on 2 and 4 ranks against the single-device MoELayer: output, input,
    expert, router and shared-expert gradients, the all-to-all records and their bytes
    against simulate, hierarchical_forward against the plain forward and node_traffic,
    timed_forward and its timeline, bad input (tests/programs/ep_checks.py); the chapter
    program's cases sized for 1 to 16 ranks.
(b) simulate: the traffic matrix against routing counted by hand, bytes, straggler
    factor, inter-node share; node-limited routing and node_traffic.
(c) alltoall_seconds against a hand computation.
(d) Errors that name the rule: placement, nodes, node limit; no process group.

Some tests began as strict xfails for bugs they found, since fixed: timed_forward ran
fewer micro-batches than asked when ``x.chunk`` returned fewer chunks; node_traffic,
alltoall_seconds and simulate accepted a number of nodes that does not split the ranks
(or none), and simulate a list of logits that is not one per rank.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from intralayer import expert_parallel as ep
from intralayer.moe import MoELayer, topk_route

ROOT = Path(__file__).resolve().parents[1]
from tests.programs import ep_checks
ENV = {"PYTHONPATH": str(ROOT)}


# ------------------------------------------------------------------ (a) on real ranks

@pytest.mark.parametrize("nproc", [2, 4])
def test_expert_parallel_matches_the_dense_layer_on_real_ranks(pool, nproc):
    result = pool("tests.programs.ep_checks", nproc, env=ENV, timeout=120)
    assert f"{ep_checks.MARKER} {nproc}" in result.output
    assert all("Traceback" not in text for text in result.stderr.values())


def test_timed_forward_runs_as_many_micro_batches_as_asked(pool):
    result = pool("tests.programs.ep_checks", 2, args=["micro-batches"], env=ENV, timeout=60)
    assert f"{ep_checks.MICRO_MARKER} 2" in result.output


@pytest.mark.parametrize("P", [1, 2, 4, 8, 16])
def test_the_programs_cases_fit_the_gpu_node_command(P):
    """`ep_moe` on 8 GPUs (the chapter's command) once indexed past its 4 token counts and
    ran a 4-expert case on 8 ranks; every case must give one count per rank, experts that
    split over the ranks, and a rank with no tokens in the first case."""
    from intralayer.programs import ep_moe
    for case in ep_moe.CASES:
        E, k, cf, shared, tokens = ep_moe.sized(case, P)
        ep.check_placement(E, P)
        assert len(tokens) == P and E >= case[0] and (k, cf, shared) == case[1:4]
    if P >= 2:
        assert 0 in ep_moe.sized(ep_moe.CASES[0], P)[4]


# ------------------------------------------------------------------ (b) simulate

def logits_for(counts, E, skew=1.5, seed=0):
    return [ep.skewed_router_logits(t, E, skew, seed + i) for i, t in enumerate(counts)]


def preferring(choices, E, strength=10.0):
    """Logits of tokens that each prefer the given expert (then the others, in order)."""
    choices = torch.as_tensor(choices, dtype=torch.int64)
    return strength * torch.nn.functional.one_hot(choices, E).float() - 1e-3 * torch.arange(E)


def test_owner_lays_experts_out_contiguously():
    assert ep.owner(torch.arange(8), 8, 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert ep.owner(torch.arange(6), 6, 1).tolist() == [0] * 6
    assert ep.owner(torch.tensor([[5, 0], [3, 4]]), 6, 6).tolist() == [[5, 0], [3, 4]]


@pytest.mark.parametrize("cf", [0.5, 1.25, 100.0])
@pytest.mark.parametrize("with_bias", [False, True])
def test_simulate_traffic_counts_kept_assignments_by_source_and_owner(cf, with_bias):
    P, E, k = 4, 8, 2
    counts = [10, 0, 7, 15]
    logits = logits_for(counts, E)
    bias = torch.linspace(1, -1, E) if with_bias else None
    sim = ep.simulate(logits, k, cf, P, bias=bias)
    want = np.zeros((P, P), dtype=np.int64)
    dropped = 0
    for i, lg in enumerate(logits):
        r = topk_route(lg, k, cf, bias)
        for e in r.expert_index[r.kept].tolist():
            want[i, e // (E // P)] += 1
        dropped += r.dropped
        assert sim.traffic[i].sum() == int(r.kept.sum())            # row: kept assignments of rank i
    np.testing.assert_array_equal(sim.traffic, want)
    np.testing.assert_array_equal(sim.received, want.sum(0))        # column: what rank j's experts process
    assert sim.dropped == dropped and sim.assignments == sum(counts) * k
    assert sim.traffic.sum() + sim.dropped == sim.assignments
    if cf == 100.0:
        assert sim.dropped == 0
    if cf == 0.5:
        assert sim.dropped > 0


def test_bytes_scale_traffic_and_exclude_the_diagonal():
    sim = ep.simulate(logits_for([12, 5, 9, 3], 8), 2, 2.0, 4)
    before = sim.traffic.copy()
    b = sim.bytes(16, 2)
    assert np.all(np.diag(b) == 0)
    off = ~np.eye(4, dtype=bool)
    np.testing.assert_array_equal(b[off], sim.traffic[off] * 16 * 2)
    np.testing.assert_array_equal(sim.traffic, before)              # the traffic itself keeps its diagonal
    assert np.diag(sim.traffic).sum() > 0


def test_straggler_factor():
    P, E = 4, 8
    balanced = [preferring(torch.arange(2 * E) % E, E) for _ in range(P)]   # every expert, twice per rank
    sim = ep.simulate(balanced, 1, 100.0, P)
    np.testing.assert_array_equal(sim.received, [4 * P] * P)
    assert sim.straggler == 1.0
    onto_one = [preferring(torch.zeros(6, dtype=torch.int64), E) for _ in range(P)]
    assert ep.simulate(onto_one, 1, 100.0, P).straggler == pytest.approx(P)
    skewed = ep.simulate(logits_for([64] * P, E, skew=4.0), 2, 100.0, P)
    assert skewed.straggler == pytest.approx(skewed.received.max() / skewed.received.mean()) and skewed.straggler > 1
    assert ep.simulate([torch.zeros(0, E)] * P, 2, 1.0, P).straggler == 1.0      # no tokens anywhere


def test_inter_node_share():
    P, E = 4, 4
    sim = ep.simulate(logits_for([20, 3, 0, 9], E), 2, 100.0, P, nodes=1)
    assert sim.inter_node_share == 0.0
    # rank i sends its 3 tokens to rank i+1's expert: 0→1, 2→3 stay inside 2 nodes, 1→2, 3→0 cross
    ring = [preferring([(i + 1) % P] * 3, E) for i in range(P)]
    assert ep.simulate(ring, 1, 100.0, P, nodes=2).inter_node_share == 0.5
    assert ep.simulate(ring, 1, 100.0, P, nodes=4).inter_node_share == 1.0
    home = [preferring([i] * 3, E) for i in range(P)]
    assert ep.simulate(home, 1, 100.0, P, nodes=4).inter_node_share == 0.0
    assert ep.simulate([torch.zeros(0, E)] * P, 1, 1.0, P, nodes=2).inter_node_share == 0.0


def test_node_traffic_counts_copies_by_hand():
    P, nodes, E = 4, 2, 4                      # one expert per rank; ranks 0, 1 on node 0, ranks 2, 3 on node 1
    k = 2
    def pair(a, b):
        return 10.0 * torch.nn.functional.one_hot(torch.tensor(a), E) + 5.0 * torch.nn.functional.one_hot(
            torch.tensor(b), E)
    rank0 = torch.stack([pair(2, 3), pair(0, 2), pair(0, 1)]).float()   # remote: 2 assignments, 1 node; 1, 1; 0, 0
    rank3 = torch.stack([pair(0, 1)]).float()                            # both on node 0: 2 assignments, 1 copy
    empty = torch.zeros(0, E)
    got = ep.node_traffic([rank0, empty, empty, rank3], k, 100.0, P, nodes)
    assert got == dict(per_assignment=2 + 1 + 0 + 2, per_node=1 + 1 + 0 + 1)


def test_node_limited_routing_reaches_at_most_m_nodes_per_token():
    P, nodes, E, k, cf = 8, 4, 16, 4, 100.0
    counts = [12, 0, 5, 1, 9, 12, 3, 7]
    logits = logits_for(counts, E, skew=0.5, seed=3)
    per_node = E // nodes
    free = ep.node_traffic(logits, k, cf, P, nodes)
    widest = max(len(set((row // per_node).tolist())) for lg in logits for row in topk_route(lg, k, cf).expert_index)
    assert widest > 1                                    # without a limit tokens do reach several nodes
    for M in range(1, nodes + 1):
        for i, lg in enumerate(logits):
            r = topk_route(lg, k, cf, None, nodes, M)
            for row in r.expert_index:
                assert len(set((row // per_node).tolist())) <= M
        sim = ep.simulate(logits, k, cf, P, nodes=nodes, node_limit=M)
        want = np.zeros((P, P), dtype=np.int64)
        for i, lg in enumerate(logits):
            r = topk_route(lg, k, cf, None, nodes, M)
            want[i] += np.bincount(ep.owner(r.expert_index[r.kept], E, P).numpy(), minlength=P)
        np.testing.assert_array_equal(sim.traffic, want)
        t = ep.node_traffic(logits, k, cf, P, nodes, node_limit=M)
        assert t["per_node"] <= sum(counts) * M
        assert t["per_node"] <= t["per_assignment"] <= sum(counts) * k
        if M == 1:                                       # one node: a token copy crosses at most once
            assert t["per_node"] <= sum(counts)
            assert t["per_node"] < free["per_node"]
    assert free["per_node"] <= sum(counts) * (nodes - 1)


# ------------------------------------------------------------------ (c) alltoall_seconds

def test_alltoall_seconds_two_nodes_uniform():
    P, b = 4, 1000.0
    uniform = b * (1 - np.eye(P))
    intra, inter = 100.0, 10.0
    # each rank sends b to its one node-mate and b to each of the two ranks of the other node
    assert ep.alltoall_seconds(uniform, intra, inter, 2) == pytest.approx(b / intra + 2 * b / inter)
    assert ep.alltoall_seconds(uniform, intra, inter, 1) == pytest.approx(3 * b / intra)
    assert ep.alltoall_seconds(uniform, intra, inter, 4) == pytest.approx(3 * b / inter)


def test_alltoall_seconds_is_the_busiest_send_or_receive():
    intra, inter = 100.0, 10.0
    one = np.zeros((4, 4))
    one[0, 2] = 5000.0                                       # across nodes
    assert ep.alltoall_seconds(one, intra, inter, 2) == pytest.approx(5000 / inter)
    fan_in = np.zeros((4, 4))
    fan_in[0, 2] = fan_in[1, 2] = 1000.0                     # rank 2 receives twice what anyone sends
    fan_in[3, 2] = 1000.0                                    # and 1000 from its node-mate
    assert ep.alltoall_seconds(fan_in, intra, inter, 2) == pytest.approx(2000 / inter + 1000 / intra)


# ------------------------------------------------------------------ (d) errors

@pytest.mark.parametrize("experts, P, message", [
    (6, 4, "6 experts do not split evenly over P=4 ranks"),
    (8, 3, "8 experts do not split evenly over P=3 ranks"),
    (8, 0, "the expert-parallel degree P must be a whole number ≥ 1, got 0"),
    (8, 2.0, "the expert-parallel degree P must be a whole number ≥ 1, got 2.0"),
    (8, -2, "must be a whole number ≥ 1"),
])
def test_check_placement_names_the_rule(experts, P, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        ep.check_placement(experts, P)


def test_check_placement_accepts_even_splits():
    for experts, P in ((8, 1), (8, 2), (8, 8), (256, 64)):
        ep.check_placement(experts, P)


@pytest.mark.parametrize("E, P, kwargs, message", [
    (6, 4, {}, "6 experts do not split evenly over P=4 ranks"),
    (8, 4, dict(nodes=3), "4 ranks do not split evenly into 3 nodes"),
    (8, 2, dict(nodes=4), "2 ranks do not split evenly into 4 nodes"),
    (8, 4, dict(nodes=2, node_limit=3), "node limit M=3 must lie between 1 and the 2 nodes"),
    (8, 4, dict(nodes=2, node_limit=0), "node limit M=0 must lie between 1 and the 2 nodes"),
])
def test_simulate_errors_name_the_rule(E, P, kwargs, message):
    logits = logits_for([5] * P, E)
    with pytest.raises(ValueError, match=re.escape(message)):
        ep.simulate(logits, 2, 1.0, P, **kwargs)


def test_node_traffic_rejects_uneven_placement():
    with pytest.raises(ValueError, match=re.escape("6 experts do not split evenly over P=4 ranks")):
        ep.node_traffic(logits_for([5] * 4, 6), 2, 1.0, 4, 2)


def test_expert_parallel_moe_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="needs a process group"):
        ep.ExpertParallelMoE.from_dense(MoELayer(8, 12, 4, 2), None)


@pytest.mark.parametrize("nodes", [3, 0])
def test_node_traffic_rejects_nodes_that_do_not_split_the_ranks(nodes):
    with pytest.raises(ValueError, match=f"do not split evenly into {nodes} nodes" if nodes else "nodes"):
        ep.node_traffic(logits_for([5] * 4, 8), 2, 1.0, 4, nodes)


@pytest.mark.parametrize("nodes", [3, 0])
def test_alltoall_seconds_rejects_nodes_that_do_not_split_the_ranks(nodes):
    with pytest.raises(ValueError, match=f"do not split evenly into {nodes} nodes" if nodes else "nodes"):
        ep.alltoall_seconds(1000.0 * (1 - np.eye(4)), 100.0, 10.0, nodes)


@pytest.mark.parametrize("nodes", [0, -2])
def test_simulate_rejects_a_number_of_nodes_below_one(nodes):
    with pytest.raises(ValueError, match="nodes"):
        ep.simulate(logits_for([5] * 4, 8), 2, 1.0, 4, nodes=nodes).inter_node_share


@pytest.mark.parametrize("ranks", [2, 6])
def test_simulate_wants_one_logits_matrix_per_rank(ranks):
    with pytest.raises(ValueError, match="4"):
        ep.simulate(logits_for([5] * ranks, 8), 2, 1.0, 4)


# ---------------------------------------------------------------------------- redundant experts

def test_redundant_placement_replicates_by_load_per_replica_and_packs_heaviest_first():
    # 10 splits into 5 + 5, then 6 (not 10 again) is the most load per replica: 3 + 3
    p = ep.redundant_placement([10, 6, 1, 1], P=2, redundant=2)
    assert p.replicas == (2, 2, 1, 1)
    assert sorted(map(len, p.slots)) == [3, 3]
    assert list(p.rank_load) == [9.0, 9.0]            # 5 + 3 + 1 on each rank, heaviest first
    # the layer as built: experts 0 and 1 on rank 0
    assert ep.contiguous_placement([10, 6, 1, 1], P=2).rank_load == (16.0, 2.0)
    # heaviest first evens these out exactly; lightest first would leave 9 and 11
    assert ep.redundant_placement([5, 4, 3, 3, 3, 2], P=2, redundant=0).rank_load == (10.0, 10.0)


@pytest.mark.parametrize("seed", range(20))
def test_redundant_placement_keeps_the_load_and_never_loses_an_expert(seed):
    rng = np.random.default_rng(seed)
    E, P = 8, 4
    load = rng.integers(0, 500, E)
    for extra in (0, 4, 8):
        p = ep.redundant_placement(load, P, extra)
        assert sum(p.replicas) == E + extra and min(p.replicas) >= 1
        assert [sorted(e for s in p.slots for e in s).count(i) for i in range(E)] == list(p.replicas)
        assert all(len(s) == (E + extra) // P for s in p.slots)
        assert np.isclose(sum(p.rank_load), load.sum())
        # no rank carries more than the heaviest replica beyond an even share
        assert max(p.rank_load) <= load.sum() / P + max(load / np.array(p.replicas)) + 1e-9


def test_redundant_placement_refuses_slots_that_do_not_split():
    with pytest.raises(ValueError, match="split evenly over P = 4"):
        ep.redundant_placement([1] * 8, P=4, redundant=3)
    with pytest.raises(ValueError, match="non-negative load per expert"):
        ep.redundant_placement([1, -1], P=2, redundant=0)
