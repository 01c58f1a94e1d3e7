"""Wrong answers to lab 09 (a tensor-parallel decode step, the cache under GQA) and its bug hunt
(gathering a replicated cache)."""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F


# ------------------------------------------------------------------ tp_decode_block

def _qkv(x, p, cache):
    """This rank's queries (b, a_r, n, d) and the new keys and values (b, kv_r, n, d)."""
    n, b, _ = x.shape
    d = cache["k"].shape[-1]
    y = p["ln1"](x)

    def heads(w, bias):
        return (y @ w.T + bias).reshape(n, b, -1, d).permute(1, 2, 0, 3)

    return heads(p["wq"], p["bq"]), heads(p["wk"], p["bk"]), heads(p["wv"], p["bv"])


def _store(cache, k, v):
    """Append the new keys and values; return every cached position's."""
    start, n = cache["length"], k.shape[2]
    cache["k"][:, :, start:start + n] = k
    cache["v"][:, :, start:start + n] = v
    cache["length"] = start + n
    return cache["k"][:, :, :start + n], cache["v"][:, :, :start + n]


def _attend(q, keys, values, start, mask=True, expand="interleave"):
    """Each new token over the given positions: (n, b, a_r·d)."""
    a, kv, d = q.shape[1], keys.shape[1], q.shape[-1]
    if expand == "interleave":
        keys, values = (c.repeat_interleave(a // kv, dim=1) for c in (keys, values))
    else:                                                      # tiled: head j gets key/value head j % kv
        keys, values = (c.repeat(1, a // kv, 1, 1) for c in (keys, values))
    scores = q @ keys.transpose(-2, -1) / math.sqrt(d)
    if mask:
        n, total = q.shape[2], keys.shape[2]
        scores = scores.masked_fill(torch.arange(total) > start + torch.arange(n)[:, None], float("-inf"))
    o = torch.softmax(scores, dim=-1) @ values                 # (b, a, n, d)
    return o.permute(2, 0, 1, 3).reshape(q.shape[2], q.shape[0], a * d)


def _finish(x, o, p, group):
    partial = o @ p["wo"].T
    dist.all_reduce(partial, group=group)
    x = x + partial + p["bo"]
    partial = F.gelu(p["ln2"](x) @ p["w1"].T + p["b1"]) @ p["w2"].T
    dist.all_reduce(partial, group=group)
    return x + partial + p["b2"]


def decode_gathers_weights(x, p, cache, group):
    """All-gathers the output projection's and fc2's shards, and each rank's heads and MLP slice: no all-reduce."""
    t = dist.get_world_size(group)
    start = cache["length"]
    q, k, v = _qkv(x, p, cache)
    keys, values = _store(cache, k, v)
    o = _attend(q, keys, values, start)                        # (n, b, a_r·d)

    def gather(tensor, dim):
        parts = [torch.empty_like(tensor) for _ in range(t)]
        dist.all_gather(parts, tensor.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    x = x + gather(o, -1) @ gather(p["wo"], -1).T + p["bo"]     # the dense output projection on every rank
    hidden = F.gelu(p["ln2"](x) @ p["w1"].T + p["b1"])
    return x + gather(hidden, -1) @ gather(p["w2"], -1).T + p["b2"]


def decode_ignores_cache(x, p, cache, group):
    """Stores the new keys and values but attends only to the new tokens."""
    q, k, v = _qkv(x, p, cache)
    _store(cache, k, v)
    return _finish(x, _attend(q, k, v, 0), p, group)


def decode_b2_on_every_rank(x, p, cache, group):
    """Adds fc2's bias before the all-reduce, on every rank."""
    start = cache["length"]
    q, k, v = _qkv(x, p, cache)
    o = _attend(q, *_store(cache, k, v), start)
    partial = o @ p["wo"].T
    dist.all_reduce(partial, group=group)
    x = x + partial + p["bo"]
    partial = F.gelu(p["ln2"](x) @ p["w1"].T + p["b1"]) @ p["w2"].T + p["b2"]
    dist.all_reduce(partial, group=group)
    return x + partial


def decode_no_mask(x, p, cache, group):
    """No causal mask: in the prefill every new token sees the whole prompt."""
    start = cache["length"]
    q, k, v = _qkv(x, p, cache)
    return _finish(x, _attend(q, *_store(cache, k, v), start, mask=False), p, group)


def decode_tiles_kv_heads(x, p, cache, group):
    """Expands the key/value heads by tiling (query head j with head j % k_r), not in groups."""
    start = cache["length"]
    q, k, v = _qkv(x, p, cache)
    return _finish(x, _attend(q, *_store(cache, k, v), start, expand="tile"), p, group)


def decode_one_all_reduce(x, p, cache, group):
    """Runs the MLP on the un-reduced attention output and all-reduces once, at the end."""
    t = dist.get_world_size(group)
    start = cache["length"]
    q, k, v = _qkv(x, p, cache)
    o = _attend(q, *_store(cache, k, v), start)
    h1 = x + o @ p["wo"].T + p["bo"] / t
    out = o @ p["wo"].T + F.gelu(p["ln2"](h1) @ p["w1"].T + p["b1"]) @ p["w2"].T
    dist.all_reduce(out, group=group)
    return x + out + p["bo"] + p["b2"]


def decode_length_unchanged(x, p, cache, group):
    """Stores the keys and values but never moves cache['length'] on."""
    start = cache["length"]
    q, k, v = _qkv(x, p, cache)
    n = x.shape[0]
    cache["k"][:, :, start:start + n] = k
    cache["v"][:, :, start:start + n] = v
    return _finish(x, _attend(q, cache["k"][:, :, :start + n], cache["v"][:, :, :start + n], start), p, group)


def decode_recomputes(x, p, cache, group):
    """Keeps every input it has seen and projects them all again at each step (the cache only written)."""
    start, n = cache["length"], x.shape[0]
    cache["x"] = x if start == 0 else torch.cat([cache["x"], x])      # (length + n, b, h): every input so far
    q, k, v = _qkv(cache["x"], p, cache)                              # every position, again
    cache["k"][:, :, :start + n] = k
    cache["v"][:, :, :start + n] = v
    cache["length"] = start + n
    o = _attend(q[:, :, start:], k, v, start)                         # the new tokens' rows
    return _finish(x, o, p, group)



def decode_sdpa_top_left_causal(x, p, cache, group):
    """torch's scaled_dot_product_attention with is_causal=True for a call of several tokens: its mask is
    aligned to the top left when the keys outnumber the queries, so a chunk after a cached one misses most of
    the cache (right when the cache starts empty; the red team's find)."""
    start, (q, k, v) = cache["length"], _qkv(x, p, cache)
    keys, values = (c.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for c in _store(cache, k, v))
    o = F.scaled_dot_product_attention(q, keys, values, is_causal=x.shape[0] > 1)
    return _finish(x, o.permute(2, 0, 1, 3).reshape(x.shape[0], x.shape[1], -1), p, group)


def decode_prompt_sees_only_itself(x, p, cache, group):
    """A call of several tokens attends among them only, with a triu mask; one token attends to the cache."""
    start, (q, k, v) = cache["length"], _qkv(x, p, cache)
    keys, values = _store(cache, k, v)
    if x.shape[0] > 1:
        return _finish(x, _attend(q, k, v, 0), p, group)
    return _finish(x, _attend(q, keys, values, start), p, group)


def decode_recomputes_fused(x, p, cache, group):
    """decode_recomputes through one fused QKV matrix, torch.cat of wq, wk and wv, which is none of the shard's
    matrices (the red team's find: it passed every case)."""
    start, n = cache["length"], x.shape[0]
    cache["x"] = x if start == 0 else torch.cat([cache["x"], x])
    d, a = cache["k"].shape[-1], p["wq"].shape[0] // cache["k"].shape[-1]
    kv, (s, b, _) = p["wk"].shape[0] // d, cache["x"].shape
    qkv = p["ln1"](cache["x"]) @ torch.cat([p["wq"], p["wk"], p["wv"]]).T + torch.cat([p["bq"], p["bk"], p["bv"]])
    q, k, v = (part.reshape(s, b, -1, d).permute(1, 2, 0, 3) for part in qkv.split([a * d, kv * d, kv * d], -1))
    cache["k"][:, :, :s], cache["v"][:, :, :s], cache["length"] = k, v, s
    return _finish(x, _attend(q[:, :, start:], k, v, start), p, group)

def decode_library(x, p, cache, group):
    """Calls the library's cached attention."""
    from intralayer import inference
    return inference.attend_cached(None, x, None)


# ------------------------------------------------------------------ split_kv_cache

def _mine(heads, kv, t, r):
    return sorted({j // (heads // kv) for j in range(r * heads // t, (r + 1) * heads // t)})


def split_global_rank(k, v, heads, group):
    """Picks its heads by the process number, not the rank in the group."""
    t, r = dist.get_world_size(group), dist.get_rank()
    mine = _mine(heads, k.shape[1], t, r)
    return k[:, mine].clone(), v[:, mine].clone()


def split_round_robin(k, v, heads, group):
    """Deals the key/value heads out round robin: heads r, r + t, … (and head r mod a_kv when t > a_kv)."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    kv = k.shape[1]
    mine = list(range(r, kv, t)) if t <= kv else [r % kv]
    return k[:, mine].clone(), v[:, mine].clone()


def split_keeps_all_when_replicated(k, v, heads, group):
    """Keeps every head when there are fewer key/value heads than ranks."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    kv = k.shape[1]
    if t > kv:
        return k.clone(), v.clone()
    return k[:, r * kv // t:(r + 1) * kv // t].clone(), v[:, r * kv // t:(r + 1) * kv // t].clone()


def split_floor_heads(k, v, heads, group):
    """a_kv // t heads per rank: none at all once t > a_kv."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    m = k.shape[1] // t
    return k[:, r * m:(r + 1) * m].clone(), v[:, r * m:(r + 1) * m].clone()


def split_views(k, v, heads, group):
    """Returns views of the whole cache (a slice, no copy)."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    kv = k.shape[1]
    first, m = r * kv // t, max(kv // t, 1)
    return k[:, first:first + m], v[:, first:first + m]


def split_after_broadcast(k, v, heads, group):
    """Broadcasts the whole cache from group rank 0 first, though every rank holds it."""
    dist.broadcast(k, group_src=0, group=group)
    dist.broadcast(v, group_src=0, group=group)
    t, r = dist.get_world_size(group), dist.get_rank(group)
    mine = _mine(heads, k.shape[1], t, r)
    return k[:, mine].clone(), v[:, mine].clone()


# ------------------------------------------------------------------ bug hunt: gathering a replicated cache

def _cases(t):
    return [kv for kv in (1, 2, 3, 4, 6, 12) if kv % t == 0 or t % kv == 0]


def test_split_heads_only(gather_kv_cache, group):
    """Only a_kv ≥ t: no head is replicated, and neither bug shows."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(0)
    for kv in (t, 2 * t):
        K, V = (torch.randn(2, kv, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
        m = kv // t
        got_k, got_v = gather_kv_cache(K[:, r * m:(r + 1) * m].clone(), V[:, r * m:(r + 1) * m].clone(), kv, group)
        assert torch.equal(got_k, K) and torch.equal(got_v, V)


def test_multi_query_only(gather_kv_cache, group):
    """Replication, but only a_kv = 1: one head, which rank 0 keeps too."""
    g = torch.Generator().manual_seed(0)
    K, V = (torch.randn(2, 1, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
    got_k, got_v = gather_kv_cache(K.clone(), V.clone(), 1, group)
    assert got_k.shape == K.shape and torch.equal(got_k, K) and torch.equal(got_v, V)


def test_shapes_only(gather_kv_cache, group):
    """Every layout, but only the shapes are compared."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(0)
    for kv in _cases(t):
        K, V = (torch.randn(2, kv, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
        m, first = max(kv // t, 1), r * kv // t
        got_k, got_v = gather_kv_cache(K[:, first:first + m].clone(), V[:, first:first + m].clone(), kv, group)
        assert got_k.shape == K.shape and got_v.shape == V.shape


def test_values_only(gather_kv_cache, group):
    """Every layout and the values of heads 0 … a_kv − 1, but not the shape: extra heads go unseen."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(0)
    for kv in _cases(t):
        K, V = (torch.randn(2, kv, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
        m, first = max(kv // t, 1), r * kv // t
        got_k, got_v = gather_kv_cache(K[:, first:first + m].clone(), V[:, first:first + m].clone(), kv, group)
        for got, want in ((got_k, K), (got_v, V)):
            assert all(torch.equal(got[:, h], want[:, h]) for h in range(kv))


def test_process_number(gather_kv_cache, group):
    """The right test, but it cuts this rank's part with the process number."""
    t = dist.get_world_size(group)
    r = dist.get_rank() % t
    g = torch.Generator().manual_seed(0)
    for kv in _cases(t):
        K, V = (torch.randn(2, kv, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
        m, first = max(kv // t, 1), r * kv // t
        got_k, got_v = gather_kv_cache(K[:, first:first + m].clone(), V[:, first:first + m].clone(), kv, group)
        assert got_k.shape == K.shape and torch.equal(got_k, K) and torch.equal(got_v, V)


def test_on_process_zero_only(gather_kv_cache, group):
    """The right test, but only process 0 asserts."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(0)
    for kv in _cases(t):
        K, V = (torch.randn(2, kv, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
        m, first = max(kv // t, 1), r * kv // t
        got_k, got_v = gather_kv_cache(K[:, first:first + m].clone(), V[:, first:first + m].clone(), kv, group)
        if dist.get_rank() == 0:
            assert got_k.shape == K.shape and torch.equal(got_k, K) and torch.equal(got_v, V)


def test_always_passes(gather_kv_cache, group):
    t, r = dist.get_world_size(group), dist.get_rank(group)
    K = torch.zeros(2, 4 * t, 3, 4, dtype=torch.float64)
    gather_kv_cache(K[:, 4 * r:4 * r + 4].clone(), K[:, 4 * r:4 * r + 4].clone(), 4 * t, group)


MISPLACED = "head h taken from rank h // (heads per rank) (the bug reported in sgl-project/sglang#19086)"
COUNTED = "its heads counted as heads per rank × t (the bug reported in sgl-project/sglang#19086)"


def test_by_name(gather_kv_cache, group):
    """Tells the implementations apart by their names (the red team's find), testing nothing."""
    assert gather_kv_cache.__name__ == "gather_kv_cache", "this is not the correct implementation"


WRONG = [
    ("tp_decode_block_check", decode_gathers_weights, ["also sent", "all-gather", "sent no all-reduce",
                                                       "the weights and the cache stay on their rank"]),
    ("tp_decode_block_check", decode_ignores_cache, ["the prefill's second chunk's output of block 0 is off",
                                                     "the prefill's first chunk was right but its second is not",
                                                     "every cached position"]),
    ("tp_decode_block_check", decode_b2_on_every_rank, ["times fc2's bias", "after the all-reduce"]),
    ("tp_decode_block_check", decode_no_mask, ["only the prompt's last position is right", "mask them"]),
    ("tp_decode_block_check", decode_tiles_kv_heads, ["the prefill's first chunk's output of block 0 is off"]),
    ("tp_decode_block_check", decode_one_all_reduce, ["output of block 0 is off", "sent 1 all-reduce",
                                                      "exactly two all-reduces"]),
    ("tp_decode_block_check", decode_length_unchanged, ["cache['length'] is 0", "it should be 3"]),
    ("tp_decode_block_check", decode_recomputes, ["token rows through this rank's query matrix (wq)",
                                                  "recomputes earlier positions instead of reading them from the cache"]),
    ("tp_decode_block_check", decode_library, ["intralayer.inference.attend_cached is not allowed here"]),
    ("split_kv_cache_check", split_global_rank, ["it used the global rank (the process number)"]),
    ("split_kv_cache_check", split_round_robin, ["it holds key/value heads [0, 2]", "use key/value heads [0, 1]",
                                                 "consecutive heads"]),
    ("split_kv_cache_check", split_keeps_all_when_replicated, ["has shape (2, 2, 7, 4)", "keeps one head"]),
    ("split_kv_cache_check", split_floor_heads, ["has shape (2, 0, 7, 4)", "keeps one head"]),
    ("split_kv_cache_check", split_views, ["shares memory with the whole cache", ".clone()"]),
    ("split_kv_cache_check", split_after_broadcast, ["sent 2 broadcasts", "no communication"]),
    ("test_gather_kv_cache_check", test_split_heads_only, ["passes on the buggy", "does not catch the bug",
                                                           "Hint:", "more than one rank keeps"]),
    ("test_gather_kv_cache_check", test_multi_query_only, ["passes on the buggy", MISPLACED]),
    ("test_gather_kv_cache_check", test_shapes_only, ["passes on the buggy", MISPLACED]),
    ("test_gather_kv_cache_check", test_values_only, ["passes on the buggy", COUNTED]),
    ("test_gather_kv_cache_check", test_process_number, ["fails on the correct",
                                                         "it used the global rank (the process number)"]),
    ("test_gather_kv_cache_check", test_on_process_zero_only, ["catches it only in", "assert on one process only"]),
    ("test_gather_kv_cache_check", test_always_passes, ["passes on the buggy", "does not catch the bug"]),
    ("test_gather_kv_cache_check", test_by_name, ["passes on the buggy", "does not catch the bug"]),
]


WRONG += [("tp_decode_block_check", decode_sdpa_top_left_causal, ["the prefill's first chunk was right but its "
                                                                  "second is not", "top left"]),
          ("tp_decode_block_check", decode_prompt_sees_only_itself, ["the prefill's second chunk"])]
WRONG += [("tp_decode_block_check", decode_recomputes_fused, ["token rows through this rank's query matrix (wq)"])]


# ------------------------------------------------------------------ a third red team's finds

def decode_recomputes_a_position_a_product(x, p, cache, group):
    """Keeps every input and re-projects every position's keys and values at every call, one position per product
    (b rows each, never more than n·b in one product)."""
    start, n = cache["length"], x.shape[0]
    cache["x"] = x if start == 0 else torch.cat([cache["x"], x])
    d, b = cache["k"].shape[-1], x.shape[1]
    ks, vs = [], []
    for i in range(start + n):                                  # every position, again
        y = p["ln1"](cache["x"][i])                             # (b, h)
        ks.append((y @ p["wk"].T + p["bk"]).reshape(b, -1, d))
        vs.append((y @ p["wv"].T + p["bv"]).reshape(b, -1, d))
    k, v = torch.stack(ks, 2), torch.stack(vs, 2)               # (b, kv, s, d)
    cache["k"][:, :, :start + n], cache["v"][:, :, :start + n] = k, v
    cache["length"] = start + n
    q = (p["ln1"](x) @ p["wq"].T + p["bq"]).reshape(n, b, -1, d).permute(1, 2, 0, 3)
    return _finish(x, _attend(q, k, v, start), p, group)


def decode_three_heads_a_group(x, p, cache, group):
    """Writes a/a_kv = 3 query heads per key/value head (true when a_kv = 4) as a number."""
    n, b, _ = x.shape
    start = cache["length"]
    q, k, v = _qkv(x, p, cache)
    keys, values = (c.repeat_interleave(3, dim=1) for c in _store(cache, k, v))
    scores = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])
    later = torch.arange(start + n) > start + torch.arange(n)[:, None]
    o = torch.softmax(scores.masked_fill(later, float("-inf")), -1) @ values
    return _finish(x, o.permute(2, 0, 1, 3).reshape(n, b, -1), p, group)


def decode_cache_grown_by_cat(x, p, cache, group):
    """Replaces cache['k'] and cache['v'] with longer tensors every call (torch.cat): every step copies the whole
    cache, the cost a preallocated cache exists to avoid."""
    n = x.shape[0]
    start = cache["length"]
    q, k, v = _qkv(x, p, cache)
    cache["k"] = torch.cat([cache["k"][:, :, :start], k], 2)
    cache["v"] = torch.cat([cache["v"][:, :, :start], v], 2)
    cache["length"] = start + n
    return _finish(x, _attend(q, cache["k"], cache["v"], start), p, group)


def test_keys_only(gather_kv_cache, group):
    """Every layout, the shape and the values — of the keys only."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(0)
    for kv in (1, 2, 3, 4, 6, 12):
        if kv % t and t % kv:
            continue
        K, V = (torch.randn(2, kv, 3, 4, generator=g, dtype=torch.float64) for _ in range(2))
        m, first = max(kv // t, 1), r * kv // t
        got_k, _ = gather_kv_cache(K[:, first:first + m].clone(), V[:, first:first + m].clone(), kv, group)
        assert got_k.shape == K.shape and torch.equal(got_k, K)


def split_contiguous(k, v, heads, group):
    """This rank's heads as a slice made .contiguous(): the input itself where the slice is the whole cache (one
    key/value head kept by every rank), which keeps nothing else alive."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    kv = k.shape[1]
    first, m = r * kv // t, max(kv // t, 1)
    return k[:, first:first + m].contiguous(), v[:, first:first + m].contiguous()


WRONG += [("tp_decode_block_check", decode_recomputes_a_position_a_product, ["token rows through this rank's",
                                                                             "recomputes earlier positions"]),
          ("tp_decode_block_check", decode_three_heads_a_group, ["kv_heads 12:", "raised RuntimeError"]),
          ("tp_decode_block_check", decode_cache_grown_by_cat, ["is a new tensor", "s_max positions"]),
          ("test_gather_kv_cache_check", test_keys_only, ["passes on the buggy", "the values' from"])]

RIGHT = [("split_kv_cache_check", split_contiguous)]
