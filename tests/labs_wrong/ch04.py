"""Wrong answers to lab 04 (ring attention on real ranks) and its bug hunt (a backward pass with a stale block)."""
import math

import torch
import torch.distributed as dist

from intralayer import context_parallel as cp


def _step(tensors, group, to=1):
    """One move: send to the rank ``to`` places on, receive from the rank ``to`` places back."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    incoming = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), group=group, group_peer=(me + to) % P) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=(me - to) % P) for t in incoming]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return incoming


def _scores(q, k, owner, me, causal, scale=None):
    if causal and owner > me:
        return None
    z = q @ k.transpose(-2, -1) * (scale or 1 / math.sqrt(q.shape[-1]))
    if causal and owner == me:
        n = z.shape[-1]
        z = z.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return z


def _merge(out, lse, block_out, block_lse):
    new = torch.logaddexp(lse, block_lse)
    return torch.exp(lse - new)[..., None] * out + torch.exp(block_lse - new)[..., None] * block_out, new


def _ring(q, k, v, group, causal, moves=None, to=1, scale=None):
    P, me = dist.get_world_size(group), dist.get_rank(group)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    held = [k, v]
    moves = P - 1 if moves is None else moves
    for step in range(P):
        z = _scores(q, held[0], (me - step * to) % P, me, causal, scale)
        if z is not None:
            out, lse = _merge(out, lse, torch.softmax(z, -1) @ held[1], torch.logsumexp(z, -1))
        if step < moves:
            held = _step(held, group, to)
    return out, lse


# ------------------------------------------------------------------ ring_attention (forward)

def ring_naive_merge(q, k, v, group, causal):
    """Merges with exp of the log-sum-exps themselves: overflows on the loud rows."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    num, den = torch.zeros_like(q), torch.zeros(q.shape[:-1], dtype=q.dtype)
    held = [k, v]
    for step in range(P):
        z = _scores(q, held[0], (me - step) % P, me, causal)
        if z is not None:
            w = torch.exp(z)                                   # exp(1000) = inf
            num, den = num + w @ held[1], den + w.sum(-1)
        if step < P - 1:
            held = _step(held, group)
    return num / den[..., None], torch.log(den)


def ring_naive_weights(q, k, v, group, causal):
    """A stable lse, but the outputs weighted by exp(lse) / exp(new lse): inf / inf on the loud rows."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    held = [k, v]
    for step in range(P):
        z = _scores(q, held[0], (me - step) % P, me, causal)
        if z is not None:
            block_out, block_lse = torch.softmax(z, -1) @ held[1], torch.logsumexp(z, -1)
            new = torch.logaddexp(lse, block_lse)
            out = (torch.exp(lse)[..., None] * out + torch.exp(block_lse)[..., None] * block_out) \
                / torch.exp(new)[..., None]
            lse = new
        if step < P - 1:
            held = _step(held, group)
    return out, lse


def ring_own_block_only(q, k, v, group, causal):
    """Attends to this rank's own keys and sends nothing."""
    z = _scores(q, k, 0, 0, causal)
    return torch.softmax(z, -1) @ v, torch.logsumexp(z, -1)


def ring_sends_to_everyone(q, k, v, group, causal):
    """Sends its own block straight to every other rank: an all-gather by hand, no ring."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    for j in range(1, P):
        got = [torch.empty_like(k), torch.empty_like(v)]
        ops = [dist.P2POp(dist.isend, t, group=group, group_peer=(me + j) % P) for t in (k, v)]
        ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=(me - j) % P) for t in got]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        z = _scores(q, got[0], (me - j) % P, me, causal)
        if z is not None:
            out, lse = _merge(out, lse, torch.softmax(z, -1) @ got[1], torch.logsumexp(z, -1))
    z = _scores(q, k, me, me, causal)
    return _merge(out, lse, torch.softmax(z, -1) @ v, torch.logsumexp(z, -1))


def ring_one_move_too_many(q, k, v, group, causal):
    """Passes the blocks on after the last step too: P moves, the last one sending each block home."""
    P = dist.get_world_size(group)
    return _ring(q, k, v, group, causal, moves=P)


def ring_ignores_causal(q, k, v, group, causal):
    return _ring(q, k, v, group, False)


def ring_gathers(q, k, v, group, causal):
    """All-gathers the keys and values (Llama 3's way), not a ring."""
    P = dist.get_world_size(group)
    ks, vs = [torch.empty_like(k) for _ in range(P)], [torch.empty_like(v) for _ in range(P)]
    dist.all_gather(ks, k.contiguous(), group=group)
    dist.all_gather(vs, v.contiguous(), group=group)
    z = q @ torch.cat(ks, 2).transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(z, -1) @ torch.cat(vs, 2), torch.logsumexp(z, -1)


def ring_resends_own_block(q, k, v, group, causal):
    """Sends its own block at every step instead of passing on the one it received."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    held = [k, v]
    for step in range(P):
        z = _scores(q, held[0], (me - step) % P, me, causal)
        if z is not None:
            out, lse = _merge(out, lse, torch.softmax(z, -1) @ held[1], torch.logsumexp(z, -1))
        if step < P - 1:
            held = _step([k, v], group)
    return out, lse


def ring_leftwards(q, k, v, group, causal):
    """Sends to the left neighbour and receives from the right: the right result, the wrong ring."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    held = [k, v]
    for step in range(P):
        z = _scores(q, held[0], (me + step) % P, me, causal)
        if z is not None:
            out, lse = _merge(out, lse, torch.softmax(z, -1) @ held[1], torch.logsumexp(z, -1))
        if step < P - 1:
            held = _step(held, group, to=-1)
    return out, lse


def ring_library(q, k, v, group, causal):
    return cp.ring_attention(q, k, v, group, causal), None


def ring_gather_then_dense(q, k, v, group, causal):
    """Passes the blocks round the ring as it should, keeps them all, then one dense softmax: right values,
    but every block held at once and no per-block merge."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    ks, vs = {me: k}, {me: v}
    held = [k, v]
    for step in range(1, P):
        held = _step(held, group)
        ks[(me - step) % P], vs[(me - step) % P] = held
    K = torch.cat([ks[r] for r in range(P)], dim=2)                      # (b, a, s, d): every block
    V = torch.cat([vs[r] for r in range(P)], dim=2)
    z = q @ K.transpose(-2, -1) / math.sqrt(q.shape[-1])                # (b, a, s/P, s)
    if causal:
        sl = q.shape[2]
        rows = me * sl + torch.arange(sl)[:, None]
        z = z.masked_fill(torch.arange(P * sl)[None, :] > rows, float("-inf"))
    return torch.softmax(z, -1) @ V, torch.logsumexp(z, -1)


def ring_keeps_every_block(q, k, v, group, causal):
    """Passes the blocks on in ring order and merges each as it arrives, but keeps every block it
    received in a list: right values, right messages, the whole sequence's keys in memory."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    kept = [[k, v]]
    for step in range(P):
        z = _scores(q, kept[-1][0], (me - step) % P, me, causal)
        if z is not None:
            out, lse = _merge(out, lse, torch.softmax(z, -1) @ kept[-1][1], torch.logsumexp(z, -1))
        if step < P - 1:
            kept.append(_step(kept[-1], group))
    return out, lse


def ring_receives_all_then_merges(q, k, v, group, causal):
    """Runs the whole ring first, into one buffer of P blocks, then merges the blocks one at a time."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    buffer = torch.empty((P, 2) + tuple(k.shape), dtype=k.dtype)
    buffer[0, 0], buffer[0, 1] = k, v
    for step in range(1, P):
        buffer[step] = torch.stack(_step(list(buffer[step - 1]), group))
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    for step in range(P):
        z = _scores(q, buffer[step, 0], (me - step) % P, me, causal)
        if z is not None:
            out, lse = _merge(out, lse, torch.softmax(z, -1) @ buffer[step, 1], torch.logsumexp(z, -1))
    return out, lse


def ring_process_number(q, k, v, group, causal):
    """The right ring, but it counts with the process number: its peers and block owners are wrong."""
    P, me = dist.get_world_size(group), dist.get_rank()
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    held = [k, v]
    for step in range(P):
        z = _scores(q, held[0], (me - step) % P, me % P, causal)
        if z is not None:
            out, lse = _merge(out, lse, torch.softmax(z, -1) @ held[1], torch.logsumexp(z, -1))
        if step < P - 1:
            incoming = [torch.empty_like(t) for t in held]
            ops = [dist.P2POp(dist.isend, t.contiguous(), group=group, group_peer=(me + 1) % P) for t in held]
            ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=(me - 1) % P) for t in incoming]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            held = incoming
    return out, lse


# ------------------------------------------------------------------ RingAttention (backward)

def _grads(q, k, v, out, lse, dout, group, causal, block_d=False, local_p=False, travel=True, kv_moves=None,
           home=True, process_number=False, scale=None):
    P, me = dist.get_world_size(group), (dist.get_rank() if process_number else dist.get_rank(group))
    scale = scale or 1 / math.sqrt(q.shape[-1])
    delta = (dout * out).sum(-1, keepdim=True)
    dq = torch.zeros_like(q)
    held, moving = [k, v], [torch.zeros_like(k), torch.zeros_like(v)]
    kv_moves = P - 1 if kv_moves is None else kv_moves
    for step in range(P):
        z = _scores(q, held[0], (me - step) % P, me, causal, scale)
        if z is not None:
            p = torch.softmax(z, -1) if local_p else torch.exp(z - lse[..., None])
            d = (dout * (torch.softmax(z, -1) @ held[1])).sum(-1, keepdim=True) if block_d else delta
            dz = p * (dout @ held[1].transpose(-2, -1) - d)
            dq += dz @ held[0] * scale
            moving = [moving[0] + dz.transpose(-2, -1) @ q * scale, moving[1] + p.transpose(-2, -1) @ dout]
        if travel and (home or step < P - 1):
            moving = _step(moving, group)
        if step < kv_moves:
            held = _step(held, group)
    return dq, moving[0], moving[1], None, None


class BackwardNoTravel(torch.autograd.Function):
    """dK and dV stay on the rank that computed them: each rank's are partial sums for other ranks' blocks."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal):
        out, lse = _ring(q, k, v, group, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal = group, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return _grads(q, k, v, out, lse, dout, ctx.group, ctx.causal, travel=False)


class BackwardProcessNumber(torch.autograd.Function):
    """The backward's causal mask with dist.get_rank(), the process number: on the pair [1, 2] process 1
    masks as rank 1 (found by tools/mutants.py; the 2-rank visible case was not causal before)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal):
        out, lse = _ring(q, k, v, group, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal = group, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return _grads(q, k, v, out, lse, dout, ctx.group, ctx.causal, process_number=True)


class BackwardBlockD(torch.autograd.Function):
    """D = rowsum(dO ⊙ O_j) from each block's own output O_j (tenstorrent/tt-metal#53205)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal):
        out, lse = _ring(q, k, v, group, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal = group, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return _grads(q, k, v, out, lse, dout, ctx.group, ctx.causal, block_d=True)


class BackwardBlockSoftmax(torch.autograd.Function):
    """Recomputes each block's probabilities with the block's own softmax, not the final lse."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal):
        out, lse = _ring(q, k, v, group, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal = group, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return _grads(q, k, v, out, lse, dout, ctx.group, ctx.causal, local_p=True)


class BackwardKVHomeToo(torch.autograd.Function):
    """Right gradients, but the key/value blocks also make a P-th move, home, for nothing."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal):
        out, lse = _ring(q, k, v, group, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal = group, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return _grads(q, k, v, out, lse, dout, ctx.group, ctx.causal,
                      kv_moves=dist.get_world_size(ctx.group))


class BackwardGradsNotHome(torch.autograd.Function):
    """dK and dV travel with their block but stop one move short of home."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal):
        out, lse = _ring(q, k, v, group, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal = group, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return _grads(q, k, v, out, lse, dout, ctx.group, ctx.causal, home=False)


class BackwardLibrary(torch.autograd.Function):
    """Hands the work to the library's ring attention."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal):
        return cp.ring_attention(q, k, v, group, causal)

    @staticmethod
    def backward(ctx, dout):
        return dout, dout, dout, None, None


# ------------------------------------------------------------------ bug hunt

ring_attention = ring_naive_merge             # the learner's part 1, wrong; BackwardReusingPart1 calls it


class BackwardReusingPart1(torch.autograd.Function):
    """A right backward on top of the learner's own (wrong) ring_attention of part 1."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal):
        out, lse = ring_attention(q, k, v, group, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal = group, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return _grads(q, k, v, out, lse, dout, ctx.group, ctx.causal)


def test_process_number(ring_attention, group):
    """The full test, but it picks this rank's rows of the upstream gradient by the process number mod P."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    Qd, Kd, Vd, U, dense, mine, q, k, v = _setup(P, me)
    out = ring_attention(q, k, v, group)
    other = dist.get_rank() % P
    (out * U[:, :, other * 3:(other + 1) * 3]).sum().backward()
    for got, want in ((out, dense), (q.grad, Qd.grad), (k.grad, Kd.grad), (v.grad, Vd.grad)):
        assert torch.allclose(got, want[:, :, mine], rtol=1e-10, atol=1e-10)


def _setup(P, me, same_blocks=False):
    b, a, sl, d = 1, 2, 3, 4
    g = torch.Generator().manual_seed(0)
    Q, K, V, U = (torch.randn(b, a, P * sl, d, generator=g, dtype=torch.float64) for _ in range(4))
    if same_blocks:                                        # every rank holds the same keys and values
        K, V = K[:, :, :sl].repeat(1, 1, P, 1), V[:, :, :sl].repeat(1, 1, P, 1)
    Qd, Kd, Vd = (t.clone().requires_grad_() for t in (Q, K, V))
    dense = torch.softmax(Qd @ Kd.transpose(-2, -1) / math.sqrt(d), dim=-1) @ Vd
    (dense * U).sum().backward()
    mine = slice(me * sl, (me + 1) * sl)
    q, k, v = (t[:, :, mine].clone().requires_grad_() for t in (Q, K, V))
    return Qd, Kd, Vd, U, dense, mine, q, k, v


def test_forward_only(ring_attention, group):
    P, me = dist.get_world_size(group), dist.get_rank(group)
    Qd, Kd, Vd, U, dense, mine, q, k, v = _setup(P, me)
    out = ring_attention(q, k, v, group)
    assert torch.allclose(out, dense[:, :, mine], rtol=1e-10, atol=1e-10)


def test_v_grad_only(ring_attention, group):
    """Checks the output and v.grad: misses a wrong D, which leaves v.grad exact."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    Qd, Kd, Vd, U, dense, mine, q, k, v = _setup(P, me)
    out = ring_attention(q, k, v, group)
    (out * U[:, :, mine]).sum().backward()
    assert torch.allclose(out, dense[:, :, mine], rtol=1e-10, atol=1e-10)
    assert torch.allclose(v.grad, Vd.grad[:, :, mine], rtol=1e-10, atol=1e-10)


def test_same_blocks_everywhere(ring_attention, group):
    """Gives every rank the same keys and values: a stale block then equals the right one."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    Qd, Kd, Vd, U, dense, mine, q, k, v = _setup(P, me, same_blocks=True)
    out = ring_attention(q, k, v, group)
    (out * U[:, :, mine]).sum().backward()
    assert torch.allclose(q.grad, Qd.grad[:, :, mine], rtol=1e-10, atol=1e-10)


def test_against_own_block(ring_attention, group):
    """Compares with attention over this rank's own keys only: fails on the correct function."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    Qd, Kd, Vd, U, dense, mine, q, k, v = _setup(P, me)
    out = ring_attention(q, k, v, group)
    (out * U[:, :, mine]).sum().backward()
    local = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v
    assert torch.allclose(out, local, rtol=1e-10, atol=1e-10)


def test_by_name(ring_attention, group):
    """Tells the implementations apart by their names (the red team's find), testing nothing."""
    assert ring_attention.__name__ == "ring_attention_correct", "this is not the correct implementation"


def _every_block(q, k, v, group):
    """Runs the ring, writing each block into one (b, a, s, d) buffer of keys and one of values."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    sl = q.shape[2]
    K, V = (q.new_empty(q.shape[:2] + (P * sl, q.shape[3])) for _ in range(2))
    held = [k, v]
    for step in range(P):
        owner = (me - step) % P
        K[:, :, owner * sl:(owner + 1) * sl], V[:, :, owner * sl:(owner + 1) * sl] = held
        if step < P - 1:
            held = _step(held, group)
    return K, V


def _dense(q, K, V, me, causal):
    """One dense softmax of this rank's queries over every key: (out, lse)."""
    z = q @ K.transpose(-2, -1) / math.sqrt(q.shape[-1])                     # (b, a, s/P, s)
    if causal:
        sl = q.shape[2]
        z = z.masked_fill(torch.arange(K.shape[2])[None, :] > me * sl + torch.arange(sl)[:, None], float("-inf"))
    return torch.softmax(z, -1) @ V, torch.logsumexp(z, -1)


def ring_dense_keys_by_queries(q, k, v, group, causal):
    """The ring into one buffer, then one dense softmax over every key with the scores laid out keys by
    queries, (s, s/P), so that no score matrix is s/P rows by several blocks wide (the red team's find)."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    K, V = _every_block(q, k, v, group)
    sl = q.shape[2]
    zt = K @ q.transpose(-2, -1) / math.sqrt(q.shape[-1])                # (b, a, s, s/P)
    if causal:
        zt = zt.masked_fill(torch.arange(P * sl)[:, None] > me * sl + torch.arange(sl)[None, :], float("-inf"))
    return torch.softmax(zt, -2).transpose(-2, -1) @ V, torch.logsumexp(zt, -2)


def ring_dense_row_by_row(q, k, v, group, causal):
    """The ring into one buffer, then a dense softmax one query row at a time: scores (1, s)."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    K, V = _every_block(q, k, v, group)
    outs, lses = [], []
    for i in range(q.shape[2]):
        z = q[:, :, i:i + 1] @ K.transpose(-2, -1) / math.sqrt(q.shape[-1])   # (b, a, 1, s)
        if causal:
            z = z.masked_fill(torch.arange(K.shape[2]) > me * q.shape[2] + i, float("-inf"))
        outs.append(torch.softmax(z, -1) @ V)
        lses.append(torch.logsumexp(z, -1))
    return torch.cat(outs, 2), torch.cat(lses, 2)


def ring_functional_gather(q, k, v, group, causal):
    """Gathers the keys and values with torch's functional all-gather (what DTensor uses), whose operators
    are not c10d's: the recorder saw them only after the red team's find."""
    import torch.distributed._functional_collectives as fc
    K, V = (fc.all_gather_tensor(t.contiguous(), 2, group) for t in (k, v))
    return _dense(q, K, V, dist.get_rank(group), causal)


class DenseForwardRingBackward(torch.autograd.Function):
    """The backward is a right ring; the forward passes the blocks round, keeps them all and does one dense
    softmax (part 2's forward was not checked as a ring before the red team's find)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal):
        out, lse = _dense(q, *_every_block(q, k, v, group), dist.get_rank(group), causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal = group, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return _grads(q, k, v, out, lse, dout, ctx.group, ctx.causal)


WRONG = [
    ("ring_attention_check", ring_gather_then_dense, ["over 6 keys at once", "2 ranks' blocks", "one block of s/P = 3 keys at a time"]),
    ("ring_attention_check", ring_keeps_every_block, ["still held the key/value blocks of group ranks",
                                                      "3 of the 3 it receives", "keeps only the block it computes on"]),
    ("ring_attention_check", ring_receives_all_then_merges, ["still held the key/value blocks of group ranks"]),
    ("ring_attention_check", ring_process_number, ["it used the global rank (the process number)"]),
    ("ring_attention_backward_check", BackwardReusingPart1, ["your ring_attention from part 1 fails its check", "overflows"]),
    ("test_ring_attention_check", test_process_number, ["fails on the correct", "it used the global rank (the process number)"]),
    ("ring_attention_check", ring_naive_merge, ["NaN or inf", "overflows", "holds a score of 1000"]),
    ("ring_attention_check", ring_naive_weights, ["out is off by up to nan", "out holds NaN or inf", "overflows"]),
    ("ring_attention_check", ring_own_block_only, ["own keys only", "never passed on", "it sent 0 bytes"]),
    ("ring_attention_check", ring_sends_to_everyone, ["it sent to group rank 2:", "right neighbour"]),
    ("ring_attention_check", ring_one_move_too_many, ["next stop is its own rank", "P − 1 times (P = 2)"]),
    ("ring_attention_check", ring_ignores_causal, ["without the causal mask"]),
    ("ring_attention_check", ring_gathers, ["all-gather is not allowed here", "point-to-point"]),
    ("ring_attention_check", ring_resends_own_block, ["times; each block moves once per step"]),
    ("ring_attention_check", ring_leftwards, ["it sent to group rank", "only to its right neighbour"]),
    ("ring_attention_check", ring_library, ["uses cp", "library's own ring attention"]),
    ("ring_attention_backward_check", BackwardProcessNumber, ["q.grad is off",
                                                              "dist.get_rank() without its group is the process number"]),
    ("ring_attention_backward_check", BackwardNoTravel, ["k.grad is off", "the backward pass: it sent"]),
    ("ring_attention_backward_check", BackwardBlockD, ["v.grad is right but q.grad and k.grad are not",
                                                       "the final output O"]),
    ("ring_attention_backward_check", BackwardBlockSoftmax, ["q.grad is off", "k.grad is off"]),
    ("ring_attention_backward_check", BackwardKVHomeToo, ["the backward pass: it sent", "(2P−1)·2·b·a·(s/P)·d·e"]),
    ("ring_attention_backward_check", BackwardGradsNotHome, ["k.grad is off", "dK and dV P times"]),
    ("ring_attention_backward_check", BackwardLibrary, ["uses cp", "library's own ring attention"]),
    ("test_ring_attention_check", test_forward_only, ["passes on the buggy", "does not catch the bug",
                                                      "diffusers#14265"]),
    ("test_ring_attention_check", test_v_grad_only, ["passes on the buggy", "takes D from each block's own output",
                                                     "tt-metal#53205"]),
    ("test_ring_attention_check", test_same_blocks_everywhere, ["passes on the buggy",
                                                                "keys and values that differ from rank to rank"]),
    ("test_ring_attention_check", test_against_own_block, ["fails on the correct",
                                                           "must pass on a correct implementation"]),
    ("test_ring_attention_check", test_by_name, ["fails on the correct"]),
    ("ring_attention_check", ring_dense_keys_by_queries, ["before the last block arrived it had made 0 score products",
                                                          "computes on each block while it holds it"]),
    ("ring_attention_check", ring_dense_row_by_row, ["before the last block arrived it had made 0 score products"]),
    ("ring_attention_check", ring_functional_gather, ["all-gather is not allowed here"]),
    ("ring_attention_backward_check", DenseForwardRingBackward, ["the forward pass: it computed scores (or their softmax) over"]),
]


def ring_packs_k_and_v(q, k, v, group, causal):
    """A right ring that sends each key and value block in one message, joined along the head dimension
    (rejected as 'no rank's block' until the red team's find)."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    held = torch.cat([k, v], dim=-1)
    for step in range(P):
        kb, vb = held.split(k.shape[-1], dim=-1)
        z = _scores(q, kb, (me - step) % P, me, causal)
        if z is not None:
            out, lse = _merge(out, lse, torch.softmax(z, -1) @ vb, torch.logsumexp(z, -1))
        if step < P - 1:
            [held] = _step([held], group)
    return out, lse


def ring_exchange_first_own_last(q, k, v, group, causal):
    """A right ring that exchanges first, computes on the block it held before the exchange, and merges its own
    block last (rejected as too late until the second red team's find)."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    held = [k, v]
    for step in range(P):
        previous, owner = held, (me - step) % P
        if step < P - 1:
            held = _step(held, group)
        z = _scores(q, previous[0], owner, me, causal) if step > 0 else None
        if z is not None:
            out, lse = _merge(out, lse, torch.softmax(z, -1) @ previous[1], torch.logsumexp(z, -1))
    z = _scores(q, k, me, me, causal)
    return _merge(out, lse, torch.softmax(z, -1) @ v, torch.logsumexp(z, -1))


def ring_row_by_row(q, k, v, group, causal):
    """A right ring that computes each block's scores one query row at a time, (1, s/P) each."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
    held = [k, v]
    for step in range(P):
        owner = (me - step) % P
        if not (causal and owner > me):
            rows_out, rows_lse = [], []
            for i in range(q.shape[2]):
                z = q[:, :, i:i + 1] @ held[0].transpose(-2, -1) / math.sqrt(q.shape[-1])   # (b, a, 1, s/P)
                if causal and owner == me:
                    z = z.masked_fill(torch.arange(z.shape[-1]) > i, float("-inf"))
                rows_out.append(torch.softmax(z, -1) @ held[1])
                rows_lse.append(torch.logsumexp(z, -1))
            out, lse = _merge(out, lse, torch.cat(rows_out, 2), torch.cat(rows_lse, 2))
        if step < P - 1:
            held = _step(held, group)
    return out, lse


def ring_dummy_products_then_dense(q, k, v, group, causal):
    """One throw-away block-sized product per step, every block kept, then one dense softmax (the second red
    team's find: the census looked only at the first product after the last block came)."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    ks, vs, held = {me: k}, {me: v}, [k, v]
    for step in range(1, P):
        _ = q @ held[0].transpose(-2, -1)
        held = _step(held, group)
        ks[(me - step) % P], vs[(me - step) % P] = held
    return _dense(q, torch.cat([ks[r] for r in range(P)], 2), torch.cat([vs[r] for r in range(P)], 2), me, causal)


class BackwardCollectsEveryBlockFirst(torch.autograd.Function):
    """The backward passes K and V round first and keeps every block, then runs the dK, dV ring: right values and
    bytes, the whole sequence's keys in memory (the second red team's find: the backward had no census)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal):
        out, lse = _ring(q, k, v, group, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal = group, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal = ctx.group, ctx.causal
        P, me = dist.get_world_size(group), dist.get_rank(group)
        blocks = [[k, v]]
        for _ in range(P - 1):
            blocks.append(_step(blocks[-1], group))                  # every block, kept
        scale, delta = 1 / math.sqrt(q.shape[-1]), (dout * out).sum(-1, keepdim=True)
        dq, moving = torch.zeros_like(q), [torch.zeros_like(k), torch.zeros_like(v)]
        for step, (kb, vb) in enumerate(blocks):
            z = _scores(q, kb, (me - step) % P, me, causal)
            if z is not None:
                p = torch.exp(z - lse[..., None])
                dz = p * (dout @ vb.transpose(-2, -1) - delta)
                dq = dq + dz @ kb * scale
                moving = [moving[0] + dz.transpose(-2, -1) @ q * scale, moving[1] + p.transpose(-2, -1) @ dout]
            moving = _step(moving, group)
        return dq, moving[0], moving[1], None, None


WRONG += [("ring_attention_check", ring_dummy_products_then_dense, ["over 6 keys at once"]),
          ("ring_attention_backward_check", BackwardCollectsEveryBlockFirst,
           ["the backward pass: when the last block arrived this rank still held"])]

def ring_fixed_scale(q, k, v, group, causal):
    """A right ring with the scale 1/√4 written as a number: right only for head dim 4."""
    return _ring(q, k, v, group, causal, scale=0.5)


class BackwardFixedScale(torch.autograd.Function):
    """A right forward; a backward with the scale 1/√4 written as a number."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal):
        out, lse = _ring(q, k, v, group, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal = group, causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return _grads(q, k, v, out, lse, dout, ctx.group, ctx.causal, scale=0.5)


WRONG += [("ring_attention_check", ring_fixed_scale, ["scaled by 1/√4, though this case's head dim is d = 8",
                                                      "q.shape[-1]"]),
          ("ring_attention_backward_check", BackwardFixedScale, ["causal True, d 8:", "q.grad is off"])]

#: Right answers in forms the checks must accept.
RIGHT = [("ring_attention_check", ring_packs_k_and_v), ("ring_attention_check", ring_exchange_first_own_last),
         ("ring_attention_check", ring_row_by_row)]
