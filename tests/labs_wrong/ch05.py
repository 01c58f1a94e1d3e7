"""Wrong answers to lab 05 (capacity-limited dispatch and combine) and its bug hunt (the balance loss under
capacity)."""
import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F


def _places(expert_index, experts):
    """Every assignment's place in its expert's queue, GShard's order, no capacity: (T, k)."""
    T, k = expert_index.shape
    order = expert_index.T.reshape(-1)
    onehot = F.one_hot(order, experts)
    return ((onehot.cumsum(0) - 1) * onehot).sum(-1).reshape(k, T).T


def _fill(x, expert_index, slot, experts, capacity):
    kept = slot >= 0
    token = torch.arange(x.shape[0]).unsqueeze(1).expand_as(slot)[kept]
    buffer = x.new_zeros(experts, capacity, x.shape[1])
    return buffer.index_put((expert_index[kept], slot[kept]), x[token])


# ------------------------------------------------------------------ dispatch

def dispatch_token_major(x, expert_index, experts, capacity):
    """Fills the queues token by token: token 0's choices, then token 1's."""
    T, k = expert_index.shape
    used = [0] * experts
    slot = torch.full((T, k), -1, dtype=torch.int64)
    for t in range(T):
        for j in range(k):
            e = int(expert_index[t, j])
            if used[e] < capacity:
                slot[t, j] = used[e]
                used[e] += 1
    return _fill(x, expert_index, slot, experts, capacity), slot


def dispatch_no_capacity(x, expert_index, experts, capacity):
    """Ignores the capacity: every assignment gets a place, the buffer grows to the longest queue."""
    slot = _places(expert_index, experts)
    longest = int(slot.max()) + 1
    return _fill(x, expert_index, slot, experts, longest), slot


def dispatch_one_too_many(x, expert_index, experts, capacity):
    """Keeps C + 1 assignments per expert (<= instead of <), and cuts the buffer to C."""
    slot = _places(expert_index, experts)
    slot = torch.where(slot <= capacity, slot, -1)
    kept = (slot >= 0) & (slot < capacity)
    return _fill(x, expert_index, torch.where(kept, slot, -1), experts, capacity), slot


def dispatch_through_numpy(x, expert_index, experts, capacity):
    """Builds the buffer in NumPy: right values, but no gradient reaches x."""
    slot = _places(expert_index, experts)
    slot = torch.where(slot < capacity, slot, -1)
    buffer = np.zeros((experts, capacity, x.shape[1]))
    for t, j in zip(*np.nonzero(slot.numpy() >= 0)):
        buffer[expert_index[t, j], slot[t, j]] = x[t].detach().numpy()
    return torch.from_numpy(buffer), slot


def dispatch_float_slots(x, expert_index, experts, capacity):
    """Returns the places as floats."""
    slot = _places(expert_index, experts)
    slot = torch.where(slot < capacity, slot, -1)
    return _fill(x, expert_index, slot, experts, capacity), slot.to(x.dtype)


def dispatch_library(x, expert_index, experts, capacity):
    """Asks the course library's router which assignments it keeps."""
    from intralayer.moe import topk_route
    route = topk_route(torch.zeros(x.shape[0], experts), expert_index.shape[1], 1.0)
    return route.kept, route.kept


def dispatch_unstable_sort(x, expert_index, experts, capacity):
    """Sorts the assignments (choice rank first, then token) by expert without stable=True: ties reorder."""
    T, k = expert_index.shape
    flat = expert_index.T.reshape(-1)                                    # (k·T,): GShard's order
    order = torch.argsort(flat)                                          # not stable: equal experts reorder
    counts = torch.bincount(flat, minlength=experts)
    starts = counts.cumsum(0) - counts
    place = torch.empty_like(flat)
    place[order] = torch.arange(flat.numel()) - starts[flat[order]]
    slot = place.reshape(k, T).T
    slot = torch.where(slot < capacity, slot, -1)
    return _fill(x, expert_index, slot, experts, capacity), slot


def dispatch_skips_empty_expert(x, expert_index, experts, capacity):
    """Splits the sorted rows into the queues that torch.unique finds: an expert nobody chose gets no rows,
    and every later expert's queue moves up one."""
    slot = _places(expert_index, experts)
    slot = torch.where(slot < capacity, slot, -1)
    kept = slot >= 0
    token = torch.arange(x.shape[0]).unsqueeze(1).expand_as(slot)
    flat_e, flat_s, flat_t = expert_index[kept], slot[kept], token[kept]
    order = torch.argsort(flat_e * capacity + flat_s)
    _, counts = torch.unique(flat_e, return_counts=True)                 # the experts that were chosen only
    buffer = x.new_zeros(experts, capacity, x.shape[1])
    for e, rows in enumerate(x[flat_t[order]].split(counts.tolist())):
        buffer = buffer.index_put((torch.full((rows.shape[0],), e), torch.arange(rows.shape[0])), rows)
    return buffer, slot


# ------------------------------------------------------------------ combine

def combine_unweighted(expert_out, slot, expert_index, weights):
    kept = slot >= 0
    rows = expert_out[expert_index, slot.clamp(min=0)]
    return (rows * kept.unsqueeze(-1)).sum(dim=1)


def combine_minus_one(expert_out, slot, expert_index, weights):
    """Indexes with slot as it is: a dropped assignment's −1 reads the expert's last place."""
    return (expert_out[expert_index, slot] * weights.unsqueeze(-1)).sum(dim=1)


def combine_renormalized(expert_out, slot, expert_index, weights):
    """Renormalizes the weights over the kept assignments."""
    kept = slot >= 0
    w = weights * kept
    w = w / w.sum(-1, keepdim=True).clamp(min=1e-300)
    return (expert_out[expert_index, slot.clamp(min=0)] * w.unsqueeze(-1)).sum(dim=1)


def combine_detached_weights(expert_out, slot, expert_index, weights):
    """Detaches the weights: right output, but the router gets no gradient."""
    kept = slot >= 0
    rows = expert_out[expert_index, slot.clamp(min=0)]
    return (rows * (weights.detach() * kept).unsqueeze(-1)).sum(dim=1)


def combine_loop_item(expert_out, slot, expert_index, weights):
    """A loop that reads each weight with .item(): right output, a constant as far as autograd knows."""
    T, k = slot.shape
    out = torch.zeros(T, expert_out.shape[-1], dtype=expert_out.dtype)
    for t in range(T):
        for j in range(k):
            if slot[t, j] >= 0:
                out[t] += weights[t, j].item() * expert_out[expert_index[t, j], slot[t, j]]
    return out


# ------------------------------------------------------------------ bug hunt: the balance loss

def _batch(n, T=8, E=4, k=2, skew=3.0):
    g = torch.Generator().manual_seed(0)
    every = torch.randn(n, T, E, generator=g, dtype=torch.float64) + torch.linspace(0, skew, E, dtype=torch.float64)
    return every, every.topk(k, dim=-1).indices


def _loss(every, choices, E, k):
    n, T = every.shape[:2]
    f = torch.bincount(choices.flatten(), minlength=E).to(torch.float64) / (n * T * k)
    return E * (f * torch.softmax(every.reshape(n * T, E), dim=-1).mean(dim=0)).sum()


def _total(share, group):
    total = share.detach().clone()
    dist.all_reduce(total, group=group)
    return total


def test_nothing_dropped(balance_loss, group):
    """Compares the summed shares with the loss, but with every assignment kept: the bug cannot show."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    every, choices = _batch(n)
    kept = torch.ones_like(choices[me], dtype=torch.bool)
    total = _total(balance_loss(every[me].clone(), choices[me], kept, group), group)
    assert torch.allclose(total, _loss(every, choices, 4, 2), rtol=1e-12, atol=0)


def test_same_batch_on_every_rank(balance_loss, group):
    """Drops assignments, but gives every rank the same logits: local counts then equal the group's."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    every, choices = _batch(1)
    every, choices = every.expand(n, -1, -1), choices.expand(n, -1, -1)
    cap = math.ceil(8 * 2 / 4)
    kept = _places(choices[me], 4) < cap
    total = _total(balance_loss(every[me].clone(), choices[me], kept, group), group)
    assert torch.allclose(total, _loss(every, choices, 4, 2), rtol=1e-12, atol=0)


def test_reference_counts_kept(balance_loss, group):
    """Its own reference counts only the kept assignments: it expects the bug."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    every, choices = _batch(n)
    cap = math.ceil(8 * 2 / 4)
    kept = torch.stack([_places(c, 4) < cap for c in choices])
    total = _total(balance_loss(every[me].clone(), choices[me], kept[me], group), group)
    f = torch.bincount(choices[kept], minlength=4).to(torch.float64) / (n * 8 * 2)
    want = 4 * (f * torch.softmax(every.reshape(-1, 4), dim=-1).mean(dim=0)).sum()
    assert torch.allclose(total, want, rtol=1e-12, atol=0)


def test_share_is_positive(balance_loss, group):
    n, me = dist.get_world_size(group), dist.get_rank(group)
    every, choices = _batch(n)
    kept = _places(choices[me], 4) < 4
    assert float(balance_loss(every[me].clone(), choices[me], kept, group)) > 0


def test_by_name(balance_loss, group):
    """Tells the implementations apart by their names (the red team's find), testing nothing."""
    assert balance_loss.__name__ == "balance_loss", "this is not the correct implementation"


def test_by_its_globals(balance_loss, group):
    """Finds the correct implementation in the buggy one's module globals and compares bytecode (the red
    team's find)."""
    assert balance_loss.__code__.co_code == balance_loss.__globals__["balance_loss"].__code__.co_code


WRONG = [
    ("dispatch_check", dispatch_token_major, ["token by token", "first choice"]),
    ("dispatch_check", dispatch_no_capacity, ["past the capacity C"]),
    ("dispatch_check", dispatch_one_too_many, ["past the capacity C"]),
    ("dispatch_check", dispatch_through_numpy, ["does not require a gradient"]),
    ("dispatch_check", dispatch_float_slots, ["slot has dtype torch.float64", "whole numbers"]),
    ("dispatch_check", dispatch_library, ["intralayer.moe.topk_route is not allowed here"]),
    ("combine_check", combine_unweighted, ["the output is off", "unweighted sum"]),
    ("combine_check", combine_minus_one, ["the output is off", "-1 indexes from the end"]),
    ("combine_check", combine_renormalized, ["the output is off", "renormalized"]),
    ("combine_check", combine_detached_weights, ["the router's gradient is a NoneType", "keep `weights` in the graph"]),
    ("combine_check", combine_loop_item, ["the router's gradient is a NoneType", "keep `weights` in the graph"]),
    ("test_balance_loss_check", test_nothing_dropped, ["passes on the buggy", "NVIDIA/Megatron-LM#1513",
                                                       "capacity drops"]),
    ("test_balance_loss_check", test_same_batch_on_every_rank, ["passes on the buggy", "only this rank's choices"]),
    ("test_balance_loss_check", test_reference_counts_kept, ["fails on the correct"]),
    ("test_balance_loss_check", test_share_is_positive, ["passes on the buggy", "does not catch the bug"]),
]


# ------------------------------------------------------------------ new wrong answers (issue 25)

def _hunt_case(n, me, dispatch_fn=None):
    """Every rank's logits and choices (skewed, so capacity binds) and this rank's kept mask."""
    T, E, k = 8, 4, 2
    every, choices = _batch(n)
    cap = math.ceil(T * k / E)
    kept = ((dispatch_fn(torch.zeros(T, 1, dtype=torch.float64), choices[me], E, cap)[1] if dispatch_fn
             else torch.where(_places(choices[me], E) < cap, 0, -1)) >= 0)
    return every, choices, kept


def test_process_number(balance_loss, group):
    """The full test, but it picks this rank's logits with the process number (dist.get_rank())."""
    n, me = dist.get_world_size(group), dist.get_rank()
    every, choices, kept = _hunt_case(n, me)
    total = _total(balance_loss(every[me].clone(), choices[me], kept, group), group)
    assert torch.allclose(total, _loss(every, choices, 4, 2), rtol=1e-12, atol=0)


def test_own_share_only(balance_loss, group):
    """Checks only this rank's own share, against the loss of its own tokens split n ways: it expects the
    local-counts bug."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    every, choices, kept = _hunt_case(n, me)
    share = balance_loss(every[me].clone(), choices[me], kept, group)
    assert torch.allclose(share.detach(), _loss(every[me:me + 1], choices[me:me + 1], 4, 2) / n, rtol=1e-12, atol=0)


dispatch = dispatch_no_capacity          # the learner's part 1, wrong; test_with_own_dispatch calls it


def test_with_own_dispatch(balance_loss, group):
    """The right test, on the kept mask of the learner's own (wrong) dispatch of part 1: it keeps everything."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    every, choices, kept = _hunt_case(n, me, dispatch)
    total = _total(balance_loss(every[me].clone(), choices[me], kept, group), group)
    assert torch.allclose(total, _loss(every, choices, 4, 2), rtol=1e-12, atol=0)


WRONG += [
    ("dispatch_check", dispatch_unstable_sort, ["token", "place", "stable=True"]),
    ("dispatch_check", dispatch_skips_empty_expert, ["buffer[0] holds expert 1's queue", "empty queue",
                                                   "by the expert's number"]),
    ("test_balance_loss_check", test_process_number, ["fails on the correct",
                                                      "it used the global rank (the process number)"]),
    ("test_balance_loss_check", test_own_share_only, ["fails on the correct", "must pass on a correct"]),
    ("test_balance_loss_check", test_with_own_dispatch, ["your dispatch from part 1 fails its check",
                                                         "past the capacity C"]),
    ("test_balance_loss_check", test_by_name, ["passes on the buggy", "does not catch the bug"]),
]


WRONG += [("test_balance_loss_check", test_by_its_globals, ["fails on the correct"])]
