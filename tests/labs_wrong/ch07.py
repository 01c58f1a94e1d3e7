"""Wrong answers to lab 07 (the all-gather matmul as a ring, forward and backward) and its bug hunt."""
import torch
import torch.distributed as dist
import torch.nn.functional as F


def _exchange(held, group):
    """Post held → r+1 and a receive from r−1; returns (buffer, requests)."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    incoming = torch.empty_like(held)
    ops = [dist.P2POp(dist.isend, held, group=group, group_peer=(r + 1) % t),
           dist.P2POp(dist.irecv, incoming, group=group, group_peer=(r - 1) % t)]
    return incoming, dist.batch_isend_irecv(ops)


def _ring(x_shard, weight, group, place=None, wait_first=False, post_late=False, pass_own=False):
    """The forward ring with one thing changed; ``place(r, i, t)`` is where step i's product goes."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = x_shard.shape[0]
    out = x_shard.new_empty(t * n, weight.shape[0])
    gathered = x_shard.new_empty(t * n, x_shard.shape[1])
    held = x_shard.contiguous()
    for i in range(t):
        q = (r - i) % t if place is None else place(r, i, t)
        if i < t - 1 and not post_late:
            incoming, requests = _exchange(x_shard.contiguous() if pass_own else held, group)
            if wait_first:
                for request in requests:
                    request.wait()
                requests = []
        out[q * n:(q + 1) * n] = F.linear(held, weight)
        gathered[q * n:(q + 1) * n] = held
        if i < t - 1:
            if post_late:
                incoming, requests = _exchange(held, group)
            for request in requests:
                request.wait()
            held = incoming
    return out, gathered


# ------------------------------------------------------------------ ring_allgather_matmul

def ag_waits_first(x_shard, weight, group):
    """Waits for the next shard before multiplying the one it holds: right numbers, nothing overlapped."""
    return _ring(x_shard, weight, group, wait_first=True)


def ag_posts_after_product(x_shard, weight, group):
    """Multiplies first, then posts the exchange and waits: nothing overlapped either."""
    return _ring(x_shard, weight, group, post_late=True)


def ag_gather_then_multiply(x_shard, weight, group):
    """Passes every shard round the ring first, then one product of the whole gathered input."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = x_shard.shape[0]
    gathered = x_shard.new_empty(t * n, x_shard.shape[1])
    held = x_shard.contiguous()
    for i in range(t):
        q = (r - i) % t
        gathered[q * n:(q + 1) * n] = held
        if i < t - 1:
            incoming, requests = _exchange(held, group)
            for request in requests:
                request.wait()
            held = incoming
    return F.linear(gathered, weight), gathered


def ag_step_rows(x_shard, weight, group):
    """Writes step i's product at row block i."""
    return _ring(x_shard, weight, group, place=lambda r, i, t: i)


def ag_passes_own_shard(x_shard, weight, group):
    """Sends its own shard at every step instead of passing on the one it received."""
    return _ring(x_shard, weight, group, pass_own=True)


def ag_collective(x_shard, weight, group):
    """Uses the collective it is meant to decompose."""
    t = dist.get_world_size(group)
    parts = [torch.empty_like(x_shard) for _ in range(t)]
    dist.all_gather(parts, x_shard.contiguous(), group=group)
    gathered = torch.cat(parts)
    return F.linear(gathered, weight), gathered


def ag_library(x_shard, weight, group):
    """Calls the library's own ring."""
    from intralayer import overlap
    out = overlap.allgather_matmul(x_shard, weight, group, chunks=1)
    return out, None


# ------------------------------------------------------------------ AllGatherMatmul

def _rs_ring(z, weight, group, wait_first=False):
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = z.shape[0] // t
    incoming, requests = None, []
    for i in range(t):
        q = (r + t - 1 - i) % t
        if i > 0 and wait_first:
            for request in requests:
                request.wait()
        part = z[q * n:(q + 1) * n] @ weight
        if i > 0:
            if not wait_first:
                for request in requests:
                    request.wait()
            part = part + incoming
        if i == t - 1:
            return part
        incoming, requests = _exchange(part, group)


class AGMWaitsFirst(torch.autograd.Function):
    """Backward ring that waits for the travelling sum before computing its own part."""

    @staticmethod
    def forward(ctx, x_shard, weight, group):
        out, gathered = _ring(x_shard, weight, group)
        ctx.save_for_backward(weight, gathered)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, gathered = ctx.saved_tensors
        return _rs_ring(grad, weight, ctx.group, wait_first=True), grad.T @ gathered, None


class AGMOwnProductOnly(torch.autograd.Function):
    """Backward keeps this rank's own product for its rows: no reduce-scatter at all."""

    @staticmethod
    def forward(ctx, x_shard, weight, group):
        out, gathered = _ring(x_shard, weight, group)
        ctx.save_for_backward(weight, gathered)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, gathered = ctx.saved_tensors
        t, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        n = grad.shape[0] // t
        return grad[r * n:(r + 1) * n] @ weight, grad.T @ gathered, None


class AGMWholeProduct(torch.autograd.Function):
    """Backward multiplies the whole gradient at once, then passes sums round the ring."""

    @staticmethod
    def forward(ctx, x_shard, weight, group):
        out, gathered = _ring(x_shard, weight, group)
        ctx.save_for_backward(weight, gathered)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, gathered = ctx.saved_tensors
        t, r = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        n = grad.shape[0] // t
        full = grad @ weight                                          # every destination's part at once
        incoming, requests = None, []
        for i in range(t):
            q = (r + t - 1 - i) % t
            part = full[q * n:(q + 1) * n]
            if i > 0:
                for request in requests:
                    request.wait()
                part = part + incoming
            if i == t - 1:
                return part, grad.T @ gathered, None
            incoming, requests = _exchange(part.contiguous(), ctx.group)


class AGMReduceScatterCollective(torch.autograd.Function):
    """Backward with the reduce-scatter collective."""

    @staticmethod
    def forward(ctx, x_shard, weight, group):
        out, gathered = _ring(x_shard, weight, group)
        ctx.save_for_backward(weight, gathered)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, gathered = ctx.saved_tensors
        t = dist.get_world_size(ctx.group)
        full = grad @ weight
        mine = torch.empty_like(full[:full.shape[0] // t])
        dist.reduce_scatter_tensor(mine, full.contiguous(), group=ctx.group)
        return mine, grad.T @ gathered, None


class AGMWeightGradOwnRows(torch.autograd.Function):
    """The weight's gradient from this rank's own rows only."""

    @staticmethod
    def forward(ctx, x_shard, weight, group):
        out, gathered = _ring(x_shard, weight, group)
        ctx.save_for_backward(weight, x_shard)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, x_shard = ctx.saved_tensors
        r = dist.get_rank(ctx.group)
        n = x_shard.shape[0]
        return _rs_ring(grad, weight, ctx.group), grad[r * n:(r + 1) * n].T @ x_shard, None


# ------------------------------------------------------------------ bug hunt: where the rows go

def _pieces(group, same=False):
    t, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 if same else 2 * t, 3, generator=g, dtype=torch.float64)
    if same:
        x = x.repeat(t, 1)                                            # every rank's shard the same
    weight = torch.randn(4, 3, generator=g, dtype=torch.float64)
    return t, r, x, weight


def test_rank0_only(allgather_matmul, group):
    """Checks the output on rank 0 only."""
    t, r, x, weight = _pieces(group)
    out = allgather_matmul(x[2 * r:2 * r + 2].clone(), weight, group)
    if r == 0:
        assert torch.allclose(out, F.linear(x, weight))


def test_same_shards(allgather_matmul, group):
    """Gives every rank the same shard: every block of the output is then the same."""
    t, r, x, weight = _pieces(group, same=True)
    out = allgather_matmul(x[2 * r:2 * r + 2].clone(), weight, group)
    assert torch.allclose(out, F.linear(x, weight))


def test_own_block(allgather_matmul, group):
    """Checks only this rank's own block of rows, which step 0 always writes right."""
    t, r, x, weight = _pieces(group)
    out = allgather_matmul(x[2 * r:2 * r + 2].clone(), weight, group)
    assert torch.allclose(out[2 * r:2 * r + 2], F.linear(x[2 * r:2 * r + 2], weight))
    assert torch.allclose(out[:2], F.linear(x[:2], weight)) or r != 0


def test_shape_only(allgather_matmul, group):
    t, r, x, weight = _pieces(group)
    out = allgather_matmul(x[2 * r:2 * r + 2].clone(), weight, group)
    assert out.shape == (2 * t, 4)


WRONG = [
    ("ring_allgather_matmul_check", ag_waits_first, ["no receive in flight", "already waited"]),
    ("ring_allgather_matmul_check", ag_posts_after_product, ["no receive in flight", "not posted yet"]),
    ("ring_allgather_matmul_check", ag_gather_then_multiply, ["in one product", "nothing overlaps"]),
    ("ring_allgather_matmul_check", ag_step_rows, ["out is off", "belong at rows q·n"]),
    ("ring_allgather_matmul_check", ag_passes_own_shard, ["gathered is off", "send 2 carried"]),
    ("ring_allgather_matmul_check", ag_collective, ["all-gather is not allowed here"]),
    ("ring_allgather_matmul_check", ag_library, ["intralayer.overlap.allgather_matmul is not allowed here"]),
    ("AllGatherMatmul_check", AGMWaitsFirst, ["backward pass's product of step 1 ran with no receive in flight"]),
    ("AllGatherMatmul_check", AGMOwnProductOnly, ["this rank's own product only", "backward pass sent 0 messages"]),
    ("AllGatherMatmul_check", AGMWholeProduct, ["backward pass multiplied all", "in one product"]),
    ("AllGatherMatmul_check", AGMReduceScatterCollective, ["reduce-scatter is not allowed here"]),
    ("AllGatherMatmul_check", AGMWeightGradOwnRows, ["weight.grad is off", "every row of the gathered input"]),
    ("test_allgather_matmul_check", test_rank0_only, ["passes on the buggy", "does not catch the bug"]),
    ("test_allgather_matmul_check", test_same_shards, ["passes on the buggy", "different shard"]),
    ("test_allgather_matmul_check", test_own_block, ["passes on the buggy", "as if it came from the right"]),
    ("test_allgather_matmul_check", test_shape_only, ["passes on the buggy"]),
]
