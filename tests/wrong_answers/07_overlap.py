"""Plausible wrong answers to solutions/07_overlap.ipynb (see tests/test_wrong_answers.py).

WRONG[grade_id] lists (part of the check that must catch it, what is wrong, [the exercises whose
checks fail too because they build on this one,] the whole exercise cell).
"""

RING = '''
def ring_allgather_matmul(x_shards, W):
    P, n = len(x_shards), x_shards[0].shape[0]
    outputs = [np.zeros((P * n, {width})) for _ in range(P)]
    order = [[] for _ in range(P)]
    for i in range({steps}):
        for r in range(P):
            j = {held}
            outputs[r][{rows}] = {product}
            order[r].append(j)
    return outputs, order
'''
RING_RIGHT = dict(width="W.shape[0]", steps="P", held="(r - i) % P", rows="j * n:(j + 1) * n", product="x_shards[j] @ W.T")


def ring(**wrong):
    return RING.format(**{**RING_RIGHT, **wrong})


PIPELINED = '''
def pipelined(comm, comp):
    {check}
    arrived = done = 0.0
    for c_, p_ in zip(comm, comp):
        arrived += c_
        done = {done}
    return {result}
'''
PIPELINED_RIGHT = dict(check='''if len(comm) != len(comp):
        raise ValueError("one transfer and one multiply per chunk")''', done="max(done, arrived) + p_", result="done")


def pipelined(**wrong):
    fields = {**PIPELINED_RIGHT, **wrong}
    return PIPELINED.replace("{check}", fields["check"]).replace("{done}", fields["done"]).replace("{result}", fields["result"])


CHUNKS = '''
def best_chunks(t, h, tokens, bandwidth, flops, candidates):
    best = None
    for c in sorted(candidates):
        if {skip}:
            continue
        time_c = model_times({args})[{key}]
        if best is None or time_c {better} best[1]:
            best = (c, time_c)
    return {result}
'''
CHUNKS_RIGHT = dict(skip="tokens % (t * c)", args="t, h, tokens, c, bandwidth, flops", key='"chunked"', better="<",
                    result="None if best is None else best[0]")


def chunks(**wrong):
    return CHUNKS.format(**{**CHUNKS_RIGHT, **wrong})


SHARE = '''
def break_even_share(hop, shard, overhead):
    if {never}:
        return 0.0
    return {share}
'''
SHARE_RIGHT = dict(never="shard <= overhead or hop <= overhead", share="1 - overhead / hop")


def share(**wrong):
    return SHARE.format(**{**SHARE_RIGHT, **wrong})


WRONG = {
    "ring": [
        ("visible", "no ring: every device multiplies the shards in the order 0, 1, …, P − 1", ring(held="i")),
        ("visible", "passes the shards to r − 1: device r holds shard (r + i) mod P", ring(held="(r + i) % P")),
        ("visible", "holds shard (i − r) mod P, the ring turned the wrong way", ring(held="(i - r) % P")),
        ("visible", "writes step i's product at rows i·n, not at its shard's rows",
         ring(rows="i * n:(i + 1) * n")),
        ("visible", "stops after the P − 1 transfers: the last shard to arrive is never multiplied",
         ring(steps="P - 1")),
        ("visible", "multiplies by W, not by W transposed", ring(product="x_shards[j] @ W")),
        ("visible", "output width W.shape[1] (h), not W.shape[0] (h_out)", ring(width="W.shape[1]")),
        ("visible", "multiplies the device's own shard at every step", ring(held="r")),
        ("hidden", "a table of the visible check's orders (4 devices)", '''
def ring_allgather_matmul(x_shards, W):
    P, n = len(x_shards), x_shards[0].shape[0]
    full = np.concatenate(x_shards) @ W.T
    order = [[0, 3, 2, 1], [1, 0, 3, 2], [2, 1, 0, 3], [3, 2, 1, 0]]
    return [full.copy() for _ in range(P)], order[:P]
'''),
        ("visible", "takes the order from the library's ring_order", '''
def ring_allgather_matmul(x_shards, W):
    from intralayer.overlap import ring_order
    P, n = len(x_shards), x_shards[0].shape[0]
    outputs = [np.zeros((P * n, W.shape[0])) for _ in range(P)]
    order = [[step[0] for step in ring_order(P, r)] for r in range(P)]
    for r in range(P):
        for j in order[r]:
            outputs[r][j * n:(j + 1) * n] = x_shards[j] @ W.T
    return outputs, order
'''),
    ],
    "pipelined": [
        ("visible", "no overlap: every transfer and every multiply one after the other",
         pipelined(done="done + c_ + p_")),
        ("visible", "the longer of all the transfers and all the multiplies", '''
def pipelined(comm, comp):
    if len(comm) != len(comp):
        raise ValueError("one transfer and one multiply per chunk")
    return max(sum(comm), sum(comp))
'''),
        ("visible", "the first transfer, then every multiply back to back", '''
def pipelined(comm, comp):
    if len(comm) != len(comp):
        raise ValueError("one transfer and one multiply per chunk")
    return comm[0] + sum(comp)
'''),
        ("visible", "the larger of two bounds only: every transfer then the last multiply, or the first transfer "
                    "then every multiply", '''
def pipelined(comm, comp):
    if len(comm) != len(comp):
        raise ValueError("one transfer and one multiply per chunk")
    return max(sum(comm) + comp[-1], comm[0] + sum(comp))
'''),
        ("visible", "lock-step: each step lasts the longer of this multiply and the next transfer", '''
def pipelined(comm, comp):
    if len(comm) != len(comp):
        raise ValueError("one transfer and one multiply per chunk")
    n = len(comm)
    return comm[0] + sum(max(comp[i], comm[i + 1]) for i in range(n - 1)) + comp[-1]
'''),
        ("visible", "forgets the last multiply: returns when it could start", pipelined(done="max(done, arrived) + p_",
                                                                                       result="done - p_")),
        ("visible", "multiplies a chunk while it is still arriving", pipelined(done="max(done + p_, arrived)")),
        ("visible", "zip drops the extra times silently: no ValueError for lists of different lengths",
         pipelined(check="pass")),
    ],
    "best_chunks": [
        ("visible", "minimises the sequential, chunked time", chunks(key='"sequential_chunked"')),
        ("visible", "picks the slowest candidate", chunks(better=">")),
        ("visible", "skips only candidates that do not divide the tokens, not t × chunks", chunks(skip="tokens % c")),
        ("visible", "skips nothing: model_times refuses a count that does not divide", chunks(skip="False")),
        ("visible", "returns the time, not the chunk count", chunks(result="None if best is None else best[1]")),
        ("visible", "fails when no candidate divides the tokens", chunks(result="best[0]")),
        ("visible", "bandwidth and FLOP rate swapped", chunks(args="t, h, tokens, c, flops, bandwidth")),
        ("hidden", "a table of the visible check's answers", '''
def best_chunks(t, h, tokens, bandwidth, flops, candidates):
    if not any(tokens % (t * c) == 0 for c in candidates):
        return None
    return 16 if bandwidth < 1e11 else 4
'''),
        ("visible", "calls the library's overlap module instead of the imported model_times", '''
def best_chunks(t, h, tokens, bandwidth, flops, candidates):
    from intralayer import overlap
    valid = [c for c in candidates if tokens % (t * c) == 0]
    if not valid:
        return None
    return min(valid, key=lambda c: (overlap.model_times(t, h, tokens, c, bandwidth, flops)["chunked"], c))
'''),
    ],
    "break_even": [
        ("visible", "1 − o/c: the shard's multiply instead of the transfer", share(share="1 - overhead / shard")),
        ("visible", "o/m: the share the overhead takes, not the share the SMs can give", share(share="overhead / hop")),
        ("visible", "1 − o/min(c, m): the shorter of the two times", share(share="1 - overhead / min(shard, hop)")),
        ("visible", "1 − c/m: where the ring stops hiding the whole transfer", share(share="1 - shard / hop")),
        ("visible", "forgets a multiply shorter than its launch", share(never="hop <= overhead")),
        ("visible", "no zero case: a negative share when the ring never pays", share(never="False")),
        ("visible", "a percentage, not a fraction", share(share="100 * (1 - overhead / hop)")),
        ("visible", "bisects the library's ring_saving", '''
def break_even_share(hop, shard, overhead):
    from intralayer.overlap import ring_saving
    if ring_saving(2, hop, shard, overhead, 0.0) <= 0:
        return 0.0
    lo, hi = 0.0, 1.0 - 1e-15
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ring_saving(2, hop, shard, overhead, mid) > 0 else (lo, mid)
    return lo
'''),
    ],
}

# Right answers written differently from the solution: the checks must accept them.
RIGHT = {
    "ring": [("the held shards rotated as a list, the order as tuples", '''
def ring_allgather_matmul(x_shards, W):
    P = len(x_shards)
    n = len(x_shards[0])
    held = list(range(P))
    outputs, order = [], [()] * P
    for r in range(P):
        outputs.append(np.empty((P * n, len(W))))
    for step in range(P):
        for r, j in enumerate(held):
            outputs[r][j * n:(j + 1) * n] = np.einsum("nh,oh->no", x_shards[j], W)
            order[r] = order[r] + (j,)
        held = held[-1:] + held[:-1]          # device r now holds what r − 1 held
    return outputs, order
''')],
    "pipelined": [("the closed form: the latest chunk arrival plus the multiplies from it on", '''
def pipelined(comm, comp):
    comm, comp = list(comm), list(comp)
    if len(comm) != len(comp):
        raise ValueError(f"{len(comm)} transfers, {len(comp)} multiplies")
    return max(sum(comm[:i + 1]) + sum(comp[i:]) for i in range(len(comm)))
''')],
    "best_chunks": [("min over the valid candidates with a key", '''
def best_chunks(t, h, tokens, bandwidth, flops, candidates):
    valid = [c for c in candidates if tokens % (t * c) == 0]
    if not valid:
        return None
    return min(valid, key=lambda c: (model_times(t, h, tokens, c, bandwidth, flops)["chunked"], c))
''')],
    "break_even": [("the saving solved for φ with min(c, m) tested first", '''
def break_even_share(hop, shard, overhead):
    if min(shard, hop) - overhead <= 0:
        return 0.0
    return (hop - overhead) / hop
''')],
}
