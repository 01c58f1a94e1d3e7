"""Wrong answers to lab 00 (a ring reduce-scatter and all-reduce from send/recv) and its bug hunt."""
import torch
import torch.distributed as dist


def _exchange(outgoing, incoming, group, right, left):
    ops = [dist.P2POp(dist.isend, outgoing, group=group, group_peer=right),
           dist.P2POp(dist.irecv, incoming, group=group, group_peer=left)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()


# ------------------------------------------------------------------ ring_reduce_scatter

def rs_no_communication(x, group):
    """Returns its own chunk: nothing passed round."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(n)[me].clone()


def rs_whole_tensor(x, group):
    """Passes the whole running sum round the ring and slices at the end: right values, n times the bytes."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    total = x.clone()
    held = x.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(held)
        _exchange(held, incoming, group, (me + 1) % n, (me - 1) % n)
        total += incoming
        held = incoming
    return total.chunk(n)[me]


def rs_direct(x, group):
    """Sends each chunk straight to its owner: right values, but not a ring."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = list(x.chunk(n))
    mine = chunks[me].clone()
    for step in range(1, n):
        to, frm = (me + step) % n, (me - step) % n
        incoming = torch.empty_like(mine)
        _exchange(chunks[to].contiguous(), incoming, group, to, frm)
        mine += incoming
    return mine


def rs_all_reduce(x, group):
    """Uses the collective it is meant to build."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    total = x.clone()
    dist.all_reduce(total, group=group)
    return total.chunk(n)[me]


def rs_library(x, group):
    """Calls the course library's own ring."""
    from intralayer.collectives import ring_all_reduce
    n, me = dist.get_world_size(group), dist.get_rank(group)
    return ring_all_reduce(x, group).chunk(n)[me]


def rs_off_by_one(x, group):
    """A schedule one step off: ends with chunk me+1 complete, and returns it instead of chunk me."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = [c.clone() for c in x.chunk(n)]
    for step in range(1, n):
        out_c, in_c = (me - step + 1) % n, (me - step) % n
        incoming = torch.empty_like(chunks[in_c])
        _exchange(chunks[out_c], incoming, group, (me + 1) % n, (me - 1) % n)
        chunks[in_c] += incoming
    return chunks[(me + 1) % n]


def rs_global_rank(x, group):
    """Counts with the global rank (mod n) instead of the rank in the group: right only where they agree."""
    n, me = dist.get_world_size(group), dist.get_rank()
    chunks = [c.clone() for c in x.chunk(n)]
    for step in range(1, n):
        out_c, in_c = (me - step) % n, (me - step - 1) % n
        incoming = torch.empty_like(chunks[in_c])
        _exchange(chunks[out_c], incoming, group, (me + 1) % n, (me - 1) % n)
        chunks[in_c] += incoming
    return chunks[me % n]


def rs_default_group(x, group):
    """Forgets group=group: talks in the default group of every process."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = [c.clone() for c in x.chunk(n)]
    for step in range(1, n):
        out_c, in_c = (me - step) % n, (me - step - 1) % n
        incoming = torch.empty_like(chunks[in_c])
        ops = [dist.P2POp(dist.isend, chunks[out_c], (me + 1) % n), dist.P2POp(dist.irecv, incoming, (me - 1) % n)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        chunks[in_c] += incoming
    return chunks[me]


# ------------------------------------------------------------------ ring_all_reduce

def ar_concatenate(x, group):
    """An 'all-gather' that just concatenates what it has: nothing passed round."""
    n = dist.get_world_size(group)
    return torch.cat([c * n for c in x.chunk(n)])


def ar_whole_tensor_ring(x, group):
    """Passes whole tensors round the ring (n−1 steps): right values, (n−1)·S bytes."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    total, held = x.clone(), x.clone()
    for _ in range(n - 1):
        incoming = torch.empty_like(held)
        _exchange(held, incoming, group, (me + 1) % n, (me - 1) % n)
        total += incoming
        held = incoming
    return total


def ar_to_rank0(x, group):
    """Everyone sends to rank 0, which sums and sends back: a star, not a ring."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    if me == 0:
        total = x.clone()
        for q in range(1, n):
            incoming = torch.empty_like(x)
            dist.recv(incoming, group=group, group_src=q)
            total += incoming
        for q in range(1, n):
            dist.send(total, group=group, group_dst=q)
        return total
    dist.send(x.contiguous(), group=group, group_dst=0)
    total = torch.empty_like(x)
    dist.recv(total, group=group, group_src=0)
    return total


def ar_gather_partials(x, group):
    """Reduce-scatter right, then passes on the partial sums it received instead of finished chunks."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = [c.clone() for c in x.chunk(n)]
    for step in range(1, n):
        out_c, in_c = (me - step) % n, (me - step - 1) % n
        incoming = torch.empty_like(chunks[in_c])
        _exchange(chunks[out_c], incoming, group, (me + 1) % n, (me - 1) % n)
        chunks[in_c] += incoming
    original = [c.clone() for c in x.chunk(n)]
    for step in range(n - 1):
        out_c, in_c = (me - step) % n, (me - step - 1) % n
        outgoing = chunks[out_c] if step == 0 else original[out_c]
        incoming = torch.empty_like(chunks[in_c])
        _exchange(outgoing.contiguous(), incoming, group, (me + 1) % n, (me - 1) % n)
        chunks[in_c] = incoming
    return torch.cat(chunks)


def ar_global_rank(x, group):
    """The all-gather phase counts with the process number (dist.get_rank()) instead of the group rank."""
    n, me = dist.get_world_size(group), dist.get_rank()
    chunks = [c.clone() for c in x.chunk(n)]
    for step in range(1, n):
        out_c, in_c = (me - step) % n, (me - step - 1) % n
        incoming = torch.empty_like(chunks[in_c])
        _exchange(chunks[out_c], incoming, group, (me + 1) % n, (me - 1) % n)
        chunks[in_c] += incoming
    for step in range(n - 1):
        out_c, in_c = (me - step) % n, (me - step - 1) % n
        _exchange(chunks[out_c], chunks[in_c], group, (me + 1) % n, (me - 1) % n)
    return torch.cat(chunks)


def rs_peer_as_dst(x, group):
    """Names the neighbours with dst=/src= (process numbers) though they are group ranks."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = [c.clone() for c in x.chunk(n)]
    for step in range(1, n):
        out_c, in_c = (me - step) % n, (me - step - 1) % n
        incoming = torch.empty_like(chunks[in_c])
        send = dist.isend(chunks[out_c], dst=(me + 1) % n, group=group)
        dist.recv(incoming, src=(me - 1) % n, group=group)
        send.wait()
        chunks[in_c] += incoming
    return chunks[me]


ring_reduce_scatter = rs_off_by_one          # the learner's part 1, wrong; ar_reusing_part1 calls it


def ar_reusing_part1(x, group):
    """Right all-gather phase on top of a wrong part 1 (the learner's own ring_reduce_scatter)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = [torch.empty_like(c) for c in x.chunk(n)]
    chunks[me] = ring_reduce_scatter(x, group)
    for step in range(n - 1):
        out_c, in_c = (me - step) % n, (me - step - 1) % n
        _exchange(chunks[out_c], chunks[in_c], group, (me + 1) % n, (me - 1) % n)
    return torch.cat(chunks)


# ------------------------------------------------------------------ bug hunt: an all-gather's backward

def test_always_passes(all_gather, group):
    x = torch.ones(2, 3, requires_grad=True)
    all_gather(x, group).sum().backward()


def test_always_fails(all_gather, group):
    x = torch.ones(2, 3, requires_grad=True)
    all_gather(x, group).sum().backward()
    assert False, "nothing can pass me"


def test_forward_only(all_gather, group):
    n, me = dist.get_world_size(group), dist.get_rank(group)
    x = torch.full((2, 3), float(me))
    got = all_gather(x, group)
    assert torch.equal(got, torch.cat([torch.full((2, 3), float(q)) for q in range(n)]))


def test_process_number(all_gather, group):
    """The right test, but it picks this rank's rows with the process number (dist.get_rank())."""
    n, me = dist.get_world_size(group), dist.get_rank()
    ws = [torch.randn(2 * n, 3, generator=torch.Generator().manual_seed(q)) for q in range(n)]
    x = torch.ones(2, 3, requires_grad=True)
    (ws[dist.get_rank(group)] * all_gather(x, group)).sum().backward()
    want = sum(w[2 * (me % n):2 * (me % n) + 2] for w in ws)
    assert torch.allclose(x.grad, want)


def test_same_loss_one_gradient(all_gather, group):
    """Every rank computes the same loss, and the test expects the gradient of one loss."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    w = torch.arange(2.0 * n * 3).reshape(2 * n, 3)
    x = torch.ones(2, 3, requires_grad=True)
    (w * all_gather(x, group)).sum().backward()
    assert torch.allclose(x.grad, w[2 * me:2 * me + 2])


def test_own_loss_not_own_gradient(all_gather, group):
    """Catches keep-own (the gradient must differ from this rank's own), not the average."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    ws = [torch.randn(2 * n, 3, generator=torch.Generator().manual_seed(q)) for q in range(n)]
    x = torch.ones(2, 3, requires_grad=True)
    (ws[me] * all_gather(x, group)).sum().backward()
    assert not torch.allclose(x.grad, ws[me][2 * me:2 * me + 2])


def test_by_name(all_gather, group):
    """Tells the implementations apart by their names (the red team's find), testing nothing."""
    assert all_gather.__name__ == "all_gather_sum", "this is not the correct implementation"


WRONG = [
    ("ring_reduce_scatter_check", rs_no_communication, ["sent 0 messages", "it holds chunk 0 of rank 0 only; it should hold chunk 0 summed over all 2 ranks"]),
    ("ring_reduce_scatter_check", rs_whole_tensor, ["each step passes one chunk", "bytes; a ring reduce-scatter sends (n−1)/n·S"]),
    ("ring_reduce_scatter_check", rs_direct, ["only to its right neighbour"]),
    ("ring_reduce_scatter_check", rs_all_reduce, ["all-reduce is not allowed here", "point-to-point"]),
    ("ring_reduce_scatter_check", rs_library, ["intralayer.collectives.ring_all_reduce is not allowed here"]),
    ("ring_reduce_scatter_check", rs_off_by_one, ["it should hold chunk"]),
    ("ring_reduce_scatter_check", rs_global_rank, ["it used the global rank (the process number)", "of _exchange", "Pair is not connected"]),
    ("ring_reduce_scatter_check", rs_default_group, ["default process group", "pass group=group"]),
    ("ring_reduce_scatter_check", rs_peer_as_dst, ["torch read peer", "as a process number", "group_dst="]),
    ("ring_all_reduce_check", ar_global_rank, ["it used the global rank (the process number)", "dist.get_rank(group)"]),
    ("ring_all_reduce_check", ar_reusing_part1, ["your ring_reduce_scatter from part 1 fails its check"]),
    ("ring_all_reduce_check", ar_concatenate, ["sent 0 messages", "the result is off by"]),
    ("ring_all_reduce_check", ar_whole_tensor_ring, ["each step passes one chunk"]),
    ("ring_all_reduce_check", ar_to_rank0, ["it received 1 message; it should receive 2"]),
    ("ring_all_reduce_check", ar_gather_partials, ["all-gather phase", "finished chunks"]),
    ("test_all_gather_check", test_always_passes, ["passes on the buggy", "does not catch the bug", "Hint: give each rank a loss of its own"]),
    ("test_all_gather_check", test_always_fails, ["fails on the correct", "nothing can pass me"]),
    ("test_all_gather_check", test_forward_only, ["passes on the buggy"]),
    ("test_all_gather_check", test_process_number, ["fails on the correct", "it used the global rank (the process number)"]),
    ("test_all_gather_check", test_same_loss_one_gradient, ["fails on the correct"]),
    ("test_all_gather_check", test_own_loss_not_own_gradient, ["passes on the buggy", "averages", "cellarium"]),
    ("test_all_gather_check", test_by_name, ["fails on the correct"]),
]


# ------------------------------------------------------------------ a third red team's finds

def rs_unwaited_send(x, group):
    """Never waits on its isend requests (only on the blocking recv): passed in 3 of 4 runs before the check
    looked at the requests left in flight."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = [c.clone() for c in x.chunk(n)]
    for step in range(1, n):
        o, i = (me - step) % n, (me - step - 1) % n
        incoming = torch.empty_like(chunks[i])
        dist.isend(chunks[o], group=group, group_dst=(me + 1) % n)      # the request is dropped
        dist.recv(incoming, group=group, group_src=(me - 1) % n)
        chunks[i] += incoming
    return chunks[me]


def _ring_rs(x, group, chunk=None, buffer=None):
    """The ring reduce-scatter with a size written as a number, or receive buffers made by ``buffer(c)``."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    c = chunk or x.numel() // n
    chunks = [x[k * c:(k + 1) * c].clone() for k in range(n)]
    for step in range(1, n):
        o, i = (me - step) % n, (me - step - 1) % n
        incoming = buffer(c) if buffer else torch.empty_like(chunks[i])
        _exchange(chunks[o], incoming, group, (me + 1) % n, (me - 1) % n)
        chunks[i] += incoming
    return chunks[me]


def rs_float32_buffer(x, group):
    """Receives into torch.zeros(c), always float32: right only for the float32 cases."""
    return _ring_rs(x, group, buffer=torch.zeros)


def rs_chunk4(x, group):
    """Writes the default chunk size, c = 4, as a number."""
    return _ring_rs(x, group, chunk=4)


def test_not_a_known_bug(all_gather, group):
    """Asserts only that the gradient is neither this rank's own nor the average: any other wrong one passes."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    ws = [torch.randn(2 * n, 3, generator=torch.Generator().manual_seed(q), dtype=torch.float64) for q in range(n)]
    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    (ws[me] * all_gather(x, group)).sum().backward()
    assert not torch.allclose(x.grad, ws[me][2 * me:2 * me + 2]), "keeps its own gradient"
    assert not torch.allclose(x.grad, sum(w[2 * me:2 * me + 2] for w in ws) / n), "averages"


def test_same_loss_times_n(all_gather, group):
    """Every rank computes the same loss and expects n times one loss's gradient: passes a backward that returns
    n times its own gradient, wrong as soon as the ranks' losses differ."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    w = torch.arange(2.0 * n * 3, dtype=torch.float64).reshape(2 * n, 3)
    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    (w * all_gather(x, group)).sum().backward()
    assert torch.allclose(x.grad, n * w[2 * me:2 * me + 2])


WRONG += [("ring_reduce_scatter_check", rs_unwaited_send, ["it returned with 1 send not waited for", "wait()"]),
          ("ring_reduce_scatter_check", rs_float32_buffer, ["stopped by gloo: a message of", "arrived for a receive buffer of",
                                                            "size and dtype"]),
          ("ring_reduce_scatter_check", rs_chunk4, ["chunk 5, dtype float64:", "it should have shape (5,)"]),
          ("test_all_gather_check", test_not_a_known_bug, ["passes on the buggy", "own gradient by n"]),
          ("test_all_gather_check", test_same_loss_times_n, ["passes on the buggy", "own gradient by n"])]


def rs_power_of_two_mask(x, group):
    """Indexes the ring with '& (n - 1)', a 'fast modulo' that is right only when n is a power of two."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = [c.clone() for c in x.chunk(n)]
    for step in range(1, n):
        o, i = (me - step) & (n - 1), (me - step - 1) & (n - 1)
        incoming = torch.empty_like(chunks[i])
        _exchange(chunks[o], incoming, group, (me + 1) & (n - 1), (me - 1) & (n - 1))
        chunks[i] += incoming
    return chunks[me]


WRONG += [("ring_reduce_scatter_check", rs_power_of_two_mask, ["On 3 ranks (processes [1, 2, 3])"])]


def rs_parity_blocking(x, group):
    """Blocking send and recv, even ranks sending first and odd ranks receiving first."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    chunks = [c.clone() for c in x.chunk(n)]
    for step in range(1, n):
        o, i = (me - step) % n, (me - step - 1) % n
        incoming = torch.empty_like(chunks[i])
        if me % 2 == 0:
            dist.send(chunks[o], group=group, group_dst=(me + 1) % n)
            dist.recv(incoming, group=group, group_src=(me - 1) % n)
        else:
            dist.recv(incoming, group=group, group_src=(me - 1) % n)
            dist.send(chunks[o], group=group, group_dst=(me + 1) % n)
        chunks[i] += incoming
    return chunks[me]


def rs_global_peers(x, group):
    """The peers as global ranks (dist.get_global_rank), passed as dst= and src= with group=."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    right, left = dist.get_global_rank(group, (me + 1) % n), dist.get_global_rank(group, (me - 1) % n)
    chunks = [c.clone() for c in x.chunk(n)]
    for step in range(1, n):
        o, i = (me - step) % n, (me - step - 1) % n
        incoming = torch.empty_like(chunks[i])
        for request in (dist.isend(chunks[o], dst=right, group=group), dist.irecv(incoming, src=left, group=group)):
            request.wait()
        chunks[i] += incoming
    return chunks[me]


#: Right answers in forms the checks must accept (a third red team's).
RIGHT = [("ring_reduce_scatter_check", rs_parity_blocking), ("ring_reduce_scatter_check", rs_global_peers)]
