"""Wrong answers to lab 06 (expert parallelism's all-to-alls) and its bug hunt (the experts' gradient under
data parallelism)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from intralayer import comm


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = rows.new_empty(sum(recv), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send), grad.shape[1])
        dist.all_to_all_single(back, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back, None, None, None


class _NothingBack(torch.autograd.Function):
    """An all-to-all whose backward keeps the gradient where it is instead of sending it home."""

    @staticmethod
    def forward(ctx, rows, send, recv, group):
        out = rows.new_empty(sum(recv), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None


def _counts(expert_index, experts, group):
    P = dist.get_world_size(group)
    counts = torch.bincount(expert_index.reshape(-1), minlength=experts).view(P, -1)
    per_expert = torch.empty_like(counts)
    dist.all_to_all_single(per_expert, counts, group=group)
    return counts, per_expert


def _dispatch(x, expert_index, experts, group, exchange=_AllToAll):
    k = expert_index.shape[1]
    order = torch.argsort(expert_index.reshape(-1), stable=True)
    counts, per_expert = _counts(expert_index, experts, group)
    received = exchange.apply(x[order // k], counts.sum(1).tolist(), per_expert.sum(1).tolist(), group)
    return received, per_expert


# ------------------------------------------------------------------ ep_dispatch

def dispatch_token_order(x, expert_index, experts, group):
    """Sends the rows in token order, not sorted by expert: the splits no longer match the rows."""
    k = expert_index.shape[1]
    counts, per_expert = _counts(expert_index, experts, group)
    token = torch.arange(x.shape[0]).repeat_interleave(k)
    return _AllToAll.apply(x[token], counts.sum(1).tolist(), per_expert.sum(1).tolist(), group), per_expert


def dispatch_all_gather(x, expert_index, experts, group):
    """All-gathers every rank's tokens and choices (padded to the longest) and keeps its own experts' rows."""
    P, r = dist.get_world_size(group), dist.get_rank(group)
    n, k = experts // P, expert_index.shape[1]
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(P)]
    dist.all_gather(sizes, torch.tensor([x.shape[0]]), group=group)
    longest = max(int(s) for s in sizes)
    pad_x = torch.cat([x, x.new_zeros(longest - x.shape[0], x.shape[1])])
    pad_e = torch.cat([expert_index, expert_index.new_full((longest - x.shape[0], k), -1)])
    xs = [torch.empty_like(pad_x) for _ in range(P)]
    es = [torch.empty_like(pad_e) for _ in range(P)]
    dist.all_gather(xs, pad_x, group=group)
    dist.all_gather(es, pad_e, group=group)
    rows, per_expert = [], torch.zeros(P, n, dtype=torch.int64)
    for s in range(P):
        flat = es[s].reshape(-1)
        order = torch.argsort(flat, stable=True)
        mine = order[(flat[order] // n) == r]
        rows.append(xs[s][mine // k])
        per_expert[s] = torch.bincount(flat[mine] - r * n, minlength=n)
    return torch.cat(rows), per_expert


def dispatch_no_autograd(x, expert_index, experts, group):
    """Calls dist.all_to_all_single directly: right rows, but no gradient goes home."""
    k = expert_index.shape[1]
    order = torch.argsort(expert_index.reshape(-1), stable=True)
    counts, per_expert = _counts(expert_index, experts, group)
    received = x.new_empty(int(per_expert.sum()), x.shape[1])
    dist.all_to_all_single(received, x[order // k].detach().contiguous(), per_expert.sum(1).tolist(),
                           counts.sum(1).tolist(), group=group)
    return received, per_expert


def dispatch_own_counts(x, expert_index, experts, group):
    """Returns the counts it sent, not the ones it received."""
    received, _ = _dispatch(x, expert_index, experts, group)
    P = dist.get_world_size(group)
    return received, torch.bincount(expert_index.reshape(-1), minlength=experts).view(P, -1)


def dispatch_two_count_exchanges(x, expert_index, experts, group):
    """Exchanges the rows per rank, then the rows per expert: two small all-to-alls where one does."""
    P = dist.get_world_size(group)
    per_rank = torch.bincount(expert_index.reshape(-1) // (experts // P), minlength=P)
    incoming = torch.empty_like(per_rank)
    dist.all_to_all_single(incoming, per_rank, group=group)
    return _dispatch(x, expert_index, experts, group)


def dispatch_backward_stays(x, expert_index, experts, group):
    """Its backward returns the received rows' gradient as it is, without sending it home."""
    return _dispatch(x, expert_index, experts, group, exchange=_NothingBack)


def dispatch_library(x, expert_index, experts, group):
    """Uses the course library's autograd all-to-all."""
    k = expert_index.shape[1]
    order = torch.argsort(expert_index.reshape(-1), stable=True)
    counts, per_expert = _counts(expert_index, experts, group)
    return comm.all_to_all(x[order // k], counts.sum(1).tolist(), per_expert.sum(1).tolist(), group), per_expert


# ------------------------------------------------------------------ ep_moe

def _experts(received, per_expert, w1, w3, w2, P):
    n = w1.shape[0]
    blocks = torch.arange(received.shape[0]).split(per_expert.flatten().tolist())
    out = torch.zeros_like(received)
    for e in range(n):
        idx = torch.cat([blocks[s * n + e] for s in range(P)])
        rows = received[idx]
        out = out.index_add(0, idx, (F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T)
    return out


def _home(out, per_expert, expert_index, n, group):
    P = dist.get_world_size(group)
    sent = torch.bincount(expert_index.reshape(-1) // n, minlength=P).tolist()
    return _AllToAll.apply(out, per_expert.sum(1).tolist(), sent, group)


def moe_token_order_not_restored(x, expert_index, weights, w1, w3, w2, group):
    """Adds the returned rows to the tokens as if they came back in token order."""
    P, n, k = dist.get_world_size(group), w1.shape[0], expert_index.shape[1]
    received, per_expert = _dispatch(x, expert_index, n * P, group)
    back = _home(_experts(received, per_expert, w1, w3, w2, P), per_expert, expert_index, n, group)
    token = torch.arange(x.shape[0]).repeat_interleave(k)
    return torch.zeros_like(x).index_add(0, token, back * weights.reshape(-1).unsqueeze(1))


def moe_unweighted(x, expert_index, weights, w1, w3, w2, group):
    P, n, k = dist.get_world_size(group), w1.shape[0], expert_index.shape[1]
    received, per_expert = _dispatch(x, expert_index, n * P, group)
    back = _home(_experts(received, per_expert, w1, w3, w2, P), per_expert, expert_index, n, group)
    order = torch.argsort(expert_index.reshape(-1), stable=True)
    return torch.zeros_like(x).index_add(0, order // k, back)


def moe_counts_again(x, expert_index, weights, w1, w3, w2, group):
    """Exchanges the counts a second time before the combine."""
    P, n, k = dist.get_world_size(group), w1.shape[0], expert_index.shape[1]
    received, per_expert = _dispatch(x, expert_index, n * P, group)
    out = _experts(received, per_expert, w1, w3, w2, P)
    _counts(expert_index, n * P, group)
    back = _home(out, per_expert, expert_index, n, group)
    order = torch.argsort(expert_index.reshape(-1), stable=True)
    return torch.zeros_like(x).index_add(0, order // k, back * weights.reshape(-1)[order].unsqueeze(1))


def moe_expert_major_blocks(x, expert_index, weights, w1, w3, w2, group):
    """Reads expert e's rows as one contiguous block, as if they arrived grouped by expert, not by source."""
    P, n, k = dist.get_world_size(group), w1.shape[0], expert_index.shape[1]
    received, per_expert = _dispatch(x, expert_index, n * P, group)
    sizes = per_expert.sum(0).tolist()
    out = torch.cat([(F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T
                     for e, rows in enumerate(received.split(sizes))])
    back = _home(out, per_expert, expert_index, n, group)
    order = torch.argsort(expert_index.reshape(-1), stable=True)
    return torch.zeros_like(x).index_add(0, order // k, back * weights.reshape(-1)[order].unsqueeze(1))


def moe_local_only(x, expert_index, weights, w1, w3, w2, group):
    """Keeps the tokens at home and uses only this rank's experts."""
    r, n = dist.get_rank(group), w1.shape[0]
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(expert_index.shape[1]):
            e = int(expert_index[t, j]) - r * n
            if 0 <= e < n:
                rows = x[t:t + 1]
                y[t] += weights[t, j] * ((F.silu(rows @ w1[e].T) * (rows @ w3[e].T)) @ w2[e].T)[0]
    return y


def moe_detached_weights(x, expert_index, weights, w1, w3, w2, group):
    P, n, k = dist.get_world_size(group), w1.shape[0], expert_index.shape[1]
    received, per_expert = _dispatch(x, expert_index, n * P, group)
    back = _home(_experts(received, per_expert, w1, w3, w2, P), per_expert, expert_index, n, group)
    order = torch.argsort(expert_index.reshape(-1), stable=True)
    w = weights.detach().reshape(-1)[order]
    return torch.zeros_like(x).index_add(0, order // k, back * w.unsqueeze(1))


def moe_library(x, expert_index, weights, w1, w3, w2, group):
    from intralayer.expert_parallel import ExpertParallelMoE
    return ExpertParallelMoE(None, group)(x)


# ------------------------------------------------------------------ bug hunt: the experts' gradient

def _problem(P, same_tokens=False):
    T, h, E = 4, 3, 2 * P
    g = torch.Generator().manual_seed(0)
    X = torch.randn(P, T, h, generator=g, dtype=torch.float64)
    if same_tokens:
        X = X[:1].expand(P, T, h)
    R = torch.randn(E, h, generator=g, dtype=torch.float64)
    W = torch.randn(E, h, h, generator=g, dtype=torch.float64)
    return X, R, W


def _dense(X, R, W, reduce="mean"):
    P, T, h = X.shape
    Rd, Wd = R.clone().requires_grad_(), W.clone().requires_grad_()
    xs = X.reshape(P * T, h)
    p, e = torch.softmax(xs @ Rd.T, dim=-1).max(dim=-1)
    y = p[:, None] * torch.einsum("tij,tj->ti", Wd[e], xs)
    per_token = 0.5 * (y ** 2).sum(dim=-1)
    (per_token.mean() if reduce == "mean" else per_token.reshape(P, T).mean(1).sum()).backward()
    return Rd.grad, Wd.grad


def _call(expert_grads, group, same_tokens=False):
    P, r = dist.get_world_size(group), dist.get_rank(group)
    X, R, W = _problem(P, same_tokens)
    mine = slice(2 * r, 2 * r + 2)
    got = expert_grads(X[r].clone(), R.clone().requires_grad_(), W[mine].clone().requires_grad_(), group)
    return X, R, W, mine, got


def test_router_only(expert_grads, group):
    X, R, W, mine, (router_grad, w_grad) = _call(expert_grads, group)
    assert torch.allclose(router_grad, _dense(X, R, W)[0], rtol=1e-10, atol=1e-12)


def test_experts_only(expert_grads, group):
    X, R, W, mine, (router_grad, w_grad) = _call(expert_grads, group)
    assert torch.allclose(w_grad, _dense(X, R, W)[1][mine], rtol=1e-10, atol=1e-12)


def test_same_tokens_everywhere(expert_grads, group):
    """Compares both gradients, but every rank holds the same tokens: its own router gradient is the average."""
    X, R, W, mine, (router_grad, w_grad) = _call(expert_grads, group, same_tokens=True)
    want_r, want_w = _dense(X, R, W)
    assert torch.allclose(w_grad, want_w[mine], rtol=1e-10, atol=1e-12)
    assert torch.allclose(router_grad, want_r, rtol=1e-10, atol=1e-12)


def test_sum_of_rank_losses(expert_grads, group):
    """Its reference adds the ranks' losses instead of averaging them: it expects the experts' bug."""
    X, R, W, mine, (router_grad, w_grad) = _call(expert_grads, group)
    want_r, want_w = _dense(X, R, W, reduce="sum")
    assert torch.allclose(w_grad, want_w[mine], rtol=1e-10, atol=1e-12)


def test_shapes_only(expert_grads, group):
    X, R, W, mine, (router_grad, w_grad) = _call(expert_grads, group)
    assert router_grad.shape == R.shape and w_grad.shape == W[mine].shape


def dispatch_unstable_sort(x, expert_index, experts, group):
    """Sorts the assignments by expert without stable=True: one expert's tokens may come out of order."""
    P, k = dist.get_world_size(group), expert_index.shape[1]
    order = torch.argsort(expert_index.reshape(-1))
    counts, per_expert = _counts(expert_index, experts, group)
    received = _AllToAll.apply(x[order // k], counts.sum(1).tolist(), per_expert.sum(1).tolist(), group)
    return received, per_expert


def dispatch_expert_major(x, expert_index, experts, group):
    """Regroups the received rows by local expert, then source: the wrong grouping."""
    received, per_expert = _dispatch(x, expert_index, experts, group)
    blocks = received.split(per_expert.flatten().tolist())            # (source, local expert) blocks
    P, m = per_expert.shape
    return torch.cat([blocks[s * m + e] for e in range(m) for s in range(P)]), per_expert


ep_dispatch = dispatch_unstable_sort          # the learner's part 1, wrong; moe_reusing_part1 calls it


def moe_reusing_part1(x, expert_index, weights, w1, w3, w2, group):
    """A right layer on top of the learner's own (wrong) ep_dispatch of part 1."""
    P, n, k = dist.get_world_size(group), w1.shape[0], expert_index.shape[1]
    received, per_expert = ep_dispatch(x, expert_index, n * P, group)
    blocks = received.split(per_expert.flatten().tolist())
    out = torch.cat([(F.silu(rows @ w1[i % n].T) * (rows @ w3[i % n].T)) @ w2[i % n].T
                     for i, rows in enumerate(blocks)])
    back = _home(out, per_expert, expert_index, n, group)
    order = torch.argsort(expert_index.reshape(-1), stable=True)
    return torch.zeros_like(x).index_add(0, order // k, back * weights.reshape(-1)[order].unsqueeze(1))


def test_by_name(expert_grads, group):
    """Tells the implementations apart by their names (the red team's find), testing nothing."""
    assert expert_grads.__name__ == "expert_grads", "this is not the correct implementation"


def dispatch_two_per_rank(x, expert_index, experts, group):
    """Counts two experts per rank whatever ``experts`` says (every case had E = 2P until the red team's find)."""
    P = dist.get_world_size(group)
    k = expert_index.shape[1]
    order = torch.argsort(expert_index.reshape(-1), stable=True)
    counts = torch.bincount(expert_index.reshape(-1), minlength=2 * P)[:2 * P].view(P, 2)
    per_expert = torch.empty_like(counts)
    dist.all_to_all_single(per_expert, counts, group=group)
    received = _AllToAll.apply(x[order // k], counts.sum(1).tolist(), per_expert.sum(1).tolist(), group)
    return received, per_expert


class _TorchsAllToAll:
    """torch's own differentiable all-to-all instead of the learner's autograd.Function."""

    @staticmethod
    def apply(rows, send, recv, group):
        import torch.distributed.nn.functional as dnnf
        out = rows.new_empty(sum(recv), rows.shape[1])
        return dnnf.all_to_all_single(out, rows.contiguous(), recv, send, group=group)


def dispatch_torchs_autograd_all_to_all(x, expert_index, experts, group):
    """The all-to-all's backward left to torch.distributed.nn (the red team's find: it passed)."""
    return _dispatch(x, expert_index, experts, group, exchange=_TorchsAllToAll)


class _ListAllToAll(torch.autograd.Function):
    """The rows by the list form of dist.all_to_all, which gloo runs only with tensors of one size."""

    @staticmethod
    def forward(ctx, rows, send, recv, group):
        outs = [rows.new_empty(r, rows.shape[1]) for r in recv]
        dist.all_to_all(outs, list(rows.contiguous().split(send)), group=group)
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("not reached")


def dispatch_list_all_to_all(x, expert_index, experts, group):
    """Uneven splits through gloo's list all_to_all (the third helper's find: gloo's own words named no fix)."""
    return _dispatch(x, expert_index, experts, group, exchange=_ListAllToAll)


WRONG = [
    ("ep_dispatch_check", dispatch_unstable_sort, ["received row", "it should hold rank"]),
    ("ep_dispatch_check", dispatch_expert_major, ["received row", "by source rank, then local expert"]),
    ("ep_moe_check", moe_reusing_part1, ["your ep_dispatch from part 1 fails its check", "received row"]),
    ("ep_dispatch_check", dispatch_token_order, ["received row", "it should hold rank",
                                                 "then local expert, then token"]),
    ("ep_dispatch_check", dispatch_all_gather, ["also sent", "all-gather", "with all-to-all"]),
    ("ep_dispatch_check", dispatch_no_autograd, ["received does not require a gradient", "autograd.Function"]),
    ("ep_dispatch_check", dispatch_own_counts, ["per_expert is off"]),
    ("ep_dispatch_check", dispatch_two_count_exchanges, ["it should send 2 all-to-alls", "per-expert counts"]),
    ("ep_dispatch_check", dispatch_backward_stays, ["raised RuntimeError", "invalid gradient"]),
    ("ep_dispatch_check", dispatch_library, ["uses comm", "intralayer.comm its autograd all-to-all"]),
    ("ep_moe_check", moe_token_order_not_restored, ["the output is off", "token"]),
    ("ep_moe_check", moe_unweighted, ["the output is off", "unweighted sum"]),
    ("ep_moe_check", moe_counts_again, ["it should send 3 all-to-alls"]),
    ("ep_moe_check", moe_expert_major_blocks, ["the output is off"]),
    ("ep_moe_check", moe_local_only, ["the output is off", "sent no all-to-all"]),
    ("ep_moe_check", moe_detached_weights, ["the gradient of the weights"]),
    ("ep_moe_check", moe_library, ["intralayer.expert_parallel.ExpertParallelMoE is not allowed here"]),
    ("test_expert_grads_check", test_router_only, ["passes on the buggy", "databricks/megablocks#20",
                                                   "compare both returned gradients"]),
    ("test_expert_grads_check", test_experts_only, ["passes on the buggy", "router's gradient not all-reduced"]),
    ("test_expert_grads_check", test_same_tokens_everywhere, ["passes on the buggy", "not all-reduced"]),
    ("test_expert_grads_check", test_sum_of_rank_losses, ["fails on the correct"]),
    ("test_expert_grads_check", test_shapes_only, ["passes on the buggy", "does not catch the bug"]),
    ("test_expert_grads_check", test_by_name, ["passes on the buggy", "does not catch the bug"]),
]


WRONG += [("ep_dispatch_check", dispatch_two_per_rank, ["per_rank 3:", "Split sizes"]),
          ("ep_dispatch_check", dispatch_torchs_autograd_all_to_all, ["torch.distributed.nn.functional.all_to_all_single "
                                                                     "is not allowed here", "torch's own differentiable"])]
WRONG += [("ep_dispatch_check", dispatch_list_all_to_all, ["gloo's list dist.all_to_all needs every tensor the same "
                                                           "size", "all_to_all_single"])]


# ------------------------------------------------------------------ a third red team's finds

class _Float32Wire(torch.autograd.Function):
    """The rows travel as float32 (torch.empty without a dtype) and are cast back."""

    @staticmethod
    def forward(ctx, rows, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = torch.empty(sum(recv), rows.shape[1])
        dist.all_to_all_single(out, rows.float().contiguous(), recv, send, group=group)
        return out.to(rows.dtype)

    @staticmethod
    def backward(ctx, grad):
        back = torch.empty(sum(ctx.send), grad.shape[1])
        dist.all_to_all_single(back, grad.float().contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return back.to(grad.dtype), None, None, None


def dispatch_float32_wire(x, expert_index, experts, group):
    """Right rows, rounded to float32 on the way (the old integer data was exact in float32)."""
    return _dispatch(x, expert_index, experts, group, exchange=_Float32Wire)


def dispatch_k_two(x, expert_index, experts, group):
    """Writes k = 2, the choices a token makes in most cases, as a number."""
    order = torch.argsort(expert_index.reshape(-1), stable=True)
    counts, per_expert = _counts(expert_index, experts, group)
    return _AllToAll.apply(x[order // 2], counts.sum(1).tolist(), per_expert.sum(1).tolist(), group), per_expert


def moe_every_expert_every_row(x, expert_index, weights, w1, w3, w2, group):
    """Runs every local expert on every received row, then keeps each row's own expert's output: right numbers,
    E/P times the experts' work."""
    P, n, k = dist.get_world_size(group), w1.shape[0], expert_index.shape[1]
    received, per_expert = _dispatch(x, expert_index, n * P, group)
    which = torch.arange(n).repeat(P).repeat_interleave(per_expert.flatten())      # each row's local expert
    every = torch.stack([(F.silu(received @ w1[e].T) * (received @ w3[e].T)) @ w2[e].T for e in range(n)])
    back = _home(every[which, torch.arange(received.shape[0])], per_expert, expert_index, n, group)
    order = torch.argsort(expert_index.reshape(-1), stable=True)
    return torch.zeros_like(x).index_add(0, order // k, back * weights.reshape(-1)[order].unsqueeze(1))


def moe_view_minus_one(x, expert_index, weights, w1, w3, w2, group):
    """Puts the tokens back with view(T, k, -1), which fails on a rank with no tokens."""
    P, n, (T, k) = dist.get_world_size(group), w1.shape[0], expert_index.shape
    received, per_expert = _dispatch(x, expert_index, n * P, group)
    back = _home(_experts(received, per_expert, w1, w3, w2, P), per_expert, expert_index, n, group)
    order = torch.argsort(expert_index.reshape(-1), stable=True)
    unsorted = torch.empty_like(back).index_copy(0, order, back).view(T, k, -1)
    return (unsorted * weights.unsqueeze(-1)).sum(1)


def test_router_same_on_every_rank(expert_grads, group):
    """The experts' gradient against the single-device layer; the router's only checked to be the same on every
    rank (a router gradient summed, not averaged, passes)."""
    X, R, W, mine, (router_grad, w_grad) = _call(expert_grads, group)
    assert torch.allclose(w_grad, _dense(X, R, W)[1][mine], rtol=1e-10, atol=1e-12)
    every = [torch.empty_like(router_grad) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, router_grad.contiguous(), group=group)
    assert all(torch.equal(o, every[0]) for o in every)


WRONG += [("ep_dispatch_check", dispatch_float32_wire, ["received holds the right numbers rounded to float32",
                                                        "dtype=x.dtype"]),
          ("ep_dispatch_check", dispatch_k_two, ["k 1, empty False"]),
          ("ep_moe_check", moe_every_expert_every_row, ["rows by local expert", "run each expert on its own rows"]),
          ("ep_moe_check", moe_view_minus_one, ["empty True, per_rank 3:", "raised RuntimeError"]),
          ("test_expert_grads_check", test_router_same_on_every_rank, ["passes on the buggy",
                                                                        "summed over the ranks, not averaged"])]
