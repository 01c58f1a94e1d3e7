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


def _ring(x_shard, weight, group, place=None, wait_first=False, post_late=False, pass_own=False, send_first=False,
          like=None, rows=None, width=None):
    """The forward ring with one thing changed; ``place(r, i, t)`` is where step i's product goes."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = rows or x_shard.shape[0]                             # rows, width: sizes written as numbers
    like = x_shard if like is None else like                 # what the buffers are made from
    out = like.new_empty(t * n, width or weight.shape[0])
    gathered = like.new_empty(t * n, x_shard.shape[1])
    held = x_shard.contiguous()
    for i in range(t):
        q = (r - i) % t if place is None else place(r, i, t)
        if i < t - 1 and not post_late:
            incoming, requests = _exchange(x_shard.contiguous() if pass_own else held, group)
            if wait_first:
                for request in requests:
                    request.wait()
                requests = []
            if send_first:                                   # the send waited for, the receive in flight
                requests[0].wait()
                requests = requests[1:]
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

def _rs_ring(z, weight, group, wait_first=False, send_first=False):
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
        if send_first:                                       # the send waited for, the receive in flight
            requests[0].wait()
            requests = requests[1:]


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


def test_by_name(allgather_matmul, group):
    """Tells the implementations apart by their names (the red team's find), testing nothing."""
    assert allgather_matmul.__name__ == "allgather_matmul", "this is not the correct implementation"


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


# ------------------------------------------------------------------ new wrong answers (issue 25)

def ag_process_number(x_shard, weight, group):
    """The right ring, but it counts with the process number (dist.get_rank()) instead of the group rank."""
    t, r = dist.get_world_size(group), dist.get_rank()
    n = x_shard.shape[0]
    out = x_shard.new_empty(t * n, weight.shape[0])
    gathered = x_shard.new_empty(t * n, x_shard.shape[1])
    held = x_shard.contiguous()
    for i in range(t):
        if i < t - 1:
            incoming = torch.empty_like(held)
            ops = [dist.P2POp(dist.isend, held, group=group, group_peer=(r + 1) % t),
                   dist.P2POp(dist.irecv, incoming, group=group, group_peer=(r - 1) % t)]
            requests = dist.batch_isend_irecv(ops)
        q = (r - i) % t
        out[q * n:(q + 1) * n] = F.linear(held, weight)
        gathered[q * n:(q + 1) * n] = held
        if i < t - 1:
            for request in requests:
                request.wait()
            held = incoming
    return out, gathered


def ag_blocking_sendrecv(x_shard, weight, group):
    """A ring of blocking dist.send / dist.recv, one product per block: right numbers, nothing overlapped."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = x_shard.shape[0]
    out = x_shard.new_empty(t * n, weight.shape[0])
    gathered = x_shard.new_empty(t * n, x_shard.shape[1])
    held = x_shard.contiguous()
    for i in range(t):
        q = (r - i) % t
        out[q * n:(q + 1) * n] = F.linear(held, weight)
        gathered[q * n:(q + 1) * n] = held
        if i < t - 1:
            incoming = torch.empty_like(held)
            if r % 2 == 0:                                    # even ranks send first: no deadlock
                dist.send(held, group=group, group_dst=(r + 1) % t)
                dist.recv(incoming, group=group, group_src=(r - 1) % t)
            else:
                dist.recv(incoming, group=group, group_src=(r - 1) % t)
                dist.send(held, group=group, group_dst=(r + 1) % t)
            held = incoming
    return out, gathered


def ag_ring_then_block_products(x_shard, weight, group):
    """Gathers every shard round the ring first, then multiplies block by block: t products, none overlapped."""
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
    out = torch.cat([F.linear(gathered[((r - i) % t) * n:((r - i) % t + 1) * n], weight) for i in range(t)])
    order = torch.cat([torch.arange(((r - i) % t) * n, ((r - i) % t + 1) * n) for i in range(t)])
    return out[torch.argsort(order)], gathered


def ag_direct_exchange(x_shard, weight, group):
    """Sends its shard straight to every other rank (an all-gather from sends), then one product of everything."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    parts = [x_shard.contiguous() if q == r else torch.empty_like(x_shard) for q in range(t)]
    ops = [dist.P2POp(dist.isend, x_shard.contiguous(), group=group, group_peer=q) for q in range(t) if q != r]
    ops += [dist.P2POp(dist.irecv, parts[q], group=group, group_peer=q) for q in range(t) if q != r]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    gathered = torch.cat(parts)
    return F.linear(gathered, weight), gathered


def ag_reverse_ring(x_shard, weight, group):
    """Runs the ring the other way (sends to r−1, receives from r+1): right numbers, the wrong neighbours."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = x_shard.shape[0]
    out = x_shard.new_empty(t * n, weight.shape[0])
    gathered = x_shard.new_empty(t * n, x_shard.shape[1])
    held = x_shard.contiguous()
    for i in range(t):
        if i < t - 1:
            incoming = torch.empty_like(held)
            ops = [dist.P2POp(dist.isend, held, group=group, group_peer=(r - 1) % t),
                   dist.P2POp(dist.irecv, incoming, group=group, group_peer=(r + 1) % t)]
            requests = dist.batch_isend_irecv(ops)
        q = (r + i) % t
        out[q * n:(q + 1) * n] = F.linear(held, weight)
        gathered[q * n:(q + 1) * n] = held
        if i < t - 1:
            for request in requests:
                request.wait()
            held = incoming
    return out, gathered


class AGMProcessNumber(torch.autograd.Function):
    """Backward's partial-sum ring counts with the process number (dist.get_rank())."""

    @staticmethod
    def forward(ctx, x_shard, weight, group):
        out, gathered = _ring(x_shard, weight, group)
        ctx.save_for_backward(weight, gathered)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, gathered = ctx.saved_tensors
        group = ctx.group
        t, r = dist.get_world_size(group), dist.get_rank()
        n = grad.shape[0] // t
        incoming, requests = None, []
        for i in range(t):
            q = (r + t - 1 - i) % t
            part = grad[q * n:(q + 1) * n] @ weight
            if i > 0:
                for request in requests:
                    request.wait()
                part = part + incoming
            if i == t - 1:
                return part, grad.T @ gathered, None
            incoming = torch.empty_like(part)
            ops = [dist.P2POp(dist.isend, part, group=group, group_peer=(r + 1) % t),
                   dist.P2POp(dist.irecv, incoming, group=group, group_peer=(r - 1) % t)]
            requests = dist.batch_isend_irecv(ops)


class AGMBlockingBackward(torch.autograd.Function):
    """Backward's partial sums travel by blocking dist.send / dist.recv: the products overlap nothing."""

    @staticmethod
    def forward(ctx, x_shard, weight, group):
        out, gathered = _ring(x_shard, weight, group)
        ctx.save_for_backward(weight, gathered)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, gathered = ctx.saved_tensors
        group = ctx.group
        t, r = dist.get_world_size(group), dist.get_rank(group)
        n = grad.shape[0] // t
        part = None
        for i in range(t):
            q = (r + t - 1 - i) % t
            mine = grad[q * n:(q + 1) * n] @ weight
            part = mine if part is None else mine + part
            if i == t - 1:
                return part, grad.T @ gathered, None
            incoming = torch.empty_like(part)
            if r % 2 == 0:
                dist.send(part.contiguous(), group=group, group_dst=(r + 1) % t)
                dist.recv(incoming, group=group, group_src=(r - 1) % t)
            else:
                dist.recv(incoming, group=group, group_src=(r - 1) % t)
                dist.send(part.contiguous(), group=group, group_dst=(r + 1) % t)
            part = incoming


ring_allgather_matmul = ag_waits_first        # the learner's part 1, wrong; AGMReusingPart1 calls it


class AGMReusingPart1(torch.autograd.Function):
    """A right backward on top of the learner's own (wrong: nothing overlapped) ring of part 1."""

    @staticmethod
    def forward(ctx, x_shard, weight, group):
        out, gathered = ring_allgather_matmul(x_shard, weight, group)
        ctx.save_for_backward(weight, gathered)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, gathered = ctx.saved_tensors
        return _rs_ring(grad, weight, ctx.group), grad.T @ gathered, None


def test_process_number(allgather_matmul, group):
    """The full test, but it cuts this rank's shard with the process number mod t (dist.get_rank() % t)."""
    t = dist.get_world_size(group)
    r = dist.get_rank() % t
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * t, 3, generator=g, dtype=torch.float64)
    weight = torch.randn(4, 3, generator=g, dtype=torch.float64)
    out = allgather_matmul(x[2 * r:2 * r + 2].clone(), weight, group)
    assert torch.allclose(out, F.linear(x, weight))


def test_two_ranks_only(allgather_matmul, group):
    """The full comparison, but only on a ring of 2: the mirrored ring is right there."""
    t, r, x, weight = _pieces(group)
    out = allgather_matmul(x[2 * r:2 * r + 2].clone(), weight, group)
    if t == 2:
        assert torch.allclose(out, F.linear(x, weight))


WRONG += [
    ("ring_allgather_matmul_check", ag_process_number, ["it used the global rank (the process number)"]),
    ("ring_allgather_matmul_check", ag_blocking_sendrecv, ["no receive in flight"]),
    ("ring_allgather_matmul_check", ag_ring_then_block_products, ["no receive in flight", "already waited"]),
    ("ring_allgather_matmul_check", ag_direct_exchange, ["in one product", "nothing overlaps"]),
    ("ring_allgather_matmul_check", ag_reverse_ring, ["sent to group rank", "right neighbour"]),
    ("AllGatherMatmul_check", AGMProcessNumber, ["it used the global rank (the process number)"]),
    ("AllGatherMatmul_check", AGMBlockingBackward, ["backward pass's product", "no receive in flight"]),
    ("AllGatherMatmul_check", AGMReusingPart1, ["your ring_allgather_matmul from part 1 fails its check",
                                                "no receive in flight"]),
    ("test_allgather_matmul_check", test_process_number, ["fails on the correct",
                                                          "it used the global rank (the process number)"]),
    ("test_allgather_matmul_check", test_two_ranks_only, ["passes on the buggy", "3 or more ranks"]),
    ("test_allgather_matmul_check", test_by_name, ["passes on the buggy", "does not catch the bug"]),
]


def ag_waits_for_its_send_first(x_shard, weight, group):
    """Posts the exchange, waits for its send, multiplies, then waits for the receive: the receive is in flight
    at every product, the send is not (the red team's find; a blocking dist.send does the same)."""
    return _ring(x_shard, weight, group, send_first=True)


class AGMBackwardWaitsForItsSend(torch.autograd.Function):
    """The backward ring waits for each partial sum's send before the next product."""

    @staticmethod
    def forward(ctx, x_shard, weight, group):
        out, gathered = _ring(x_shard, weight, group)
        ctx.save_for_backward(weight, gathered)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, gathered = ctx.saved_tensors
        return _rs_ring(grad, weight, ctx.group, send_first=True), grad.T @ gathered, None


WRONG += [("ring_allgather_matmul_check", ag_waits_for_its_send_first, ["after this rank's send of that step had been "
                                                                        "waited for", "post both"]),
          ("AllGatherMatmul_check", AGMBackwardWaitsForItsSend, ["after this rank's send of that step had been waited"])]


def _ring_kept_sends(x_shard, weight, group, first_only=False):
    """The forward ring whose sends stay in flight, never waited for; ``first_only``: every later step waits
    for its own send before the product."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    n = x_shard.shape[0]
    out, gathered = x_shard.new_empty(t * n, weight.shape[0]), x_shard.new_empty(t * n, x_shard.shape[1])
    held, kept = x_shard.contiguous(), []
    for i in range(t):
        q = (r - i) % t
        if i < t - 1:
            incoming, (send, recv) = _exchange(held, group)
            if first_only and i > 0:
                send.wait()
            else:
                kept.append(send)
        out[q * n:(q + 1) * n] = F.linear(held, weight)
        gathered[q * n:(q + 1) * n] = held
        if i < t - 1:
            recv.wait()
            held = incoming
    _ring_kept_sends.kept = kept                      # alive, so gloo keeps them going
    return out, gathered


def ag_waits_for_its_send_but_the_first(x_shard, weight, group):
    """Leaves step 0's send in flight for ever and waits for every later step's send before its product: the
    check counted any send in flight (the second red team's find)."""
    return _ring_kept_sends(x_shard, weight, group, first_only=True)


class AGMLeftoverSends(torch.autograd.Function):
    """The forward leaves its sends in flight; the backward waits for each partial sum's send before the next
    product, and the forward's sends were counted for it (the second red team's find)."""

    @staticmethod
    def forward(ctx, x_shard, weight, group):
        out, gathered = _ring_kept_sends(x_shard, weight, group)
        ctx.save_for_backward(weight, gathered)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, gathered = ctx.saved_tensors
        return _rs_ring(grad, weight, ctx.group, send_first=True), grad.T @ gathered, None


WRONG += [("ring_allgather_matmul_check", ag_waits_for_its_send_but_the_first,
           ["it returned with 1 send not waited for"]),
          ("AllGatherMatmul_check", AGMLeftoverSends, ["after this rank's send of that step had been waited"])]


def ag_buffers_from_the_weight(x_shard, weight, group):
    """A right ring whose buffers are made with weight.new_empty (rejected as a product with the weight's copy
    until the second red team's find)."""
    return _ring(x_shard, weight, group, like=weight)


class AGMWeightGradOutOfPlace(torch.autograd.Function):
    """A right layer whose buffers come from weight.new_empty and whose weight gradient is built block by block
    with torch.addmm out of place, from zeros_like(weight)."""

    @staticmethod
    def forward(ctx, x_shard, weight, group):
        out, gathered = ag_buffers_from_the_weight(x_shard, weight, group)
        ctx.save_for_backward(weight, gathered)
        ctx.group = group
        return out

    @staticmethod
    def backward(ctx, grad):
        weight, gathered = ctx.saved_tensors
        t, n = dist.get_world_size(ctx.group), gathered.shape[0] // dist.get_world_size(ctx.group)
        dw = torch.zeros_like(weight)
        for q in range(t):
            dw = torch.addmm(dw, grad[q * n:(q + 1) * n].T, gathered[q * n:(q + 1) * n])
        return _rs_ring(grad, weight, ctx.group), dw, None


#: Right answers in forms the checks must accept.
def ag_two_rows(x_shard, weight, group):
    """Writes n = 2, the rows of the default case, as a number."""
    return _ring(x_shard, weight, group, rows=2)


def ag_four_outputs(x_shard, weight, group):
    """Writes the layer's width, 4 in the default case, as a number."""
    return _ring(x_shard, weight, group, width=4)


WRONG += [("ring_allgather_matmul_check", ag_two_rows, ["rows 3, out 4:", "raised RuntimeError"]),
          ("ring_allgather_matmul_check", ag_four_outputs, ["rows 3, out 6:", "raised RuntimeError"])]

RIGHT = [("ring_allgather_matmul_check", ag_buffers_from_the_weight), ("AllGatherMatmul_check", AGMWeightGradOutOfPlace)]
