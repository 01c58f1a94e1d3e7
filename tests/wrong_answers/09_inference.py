"""Plausible wrong answers to solutions/09_inference.ipynb (see tests/test_wrong_answers.py).

WRONG[grade_id] lists (part of the check that must catch it, what is wrong, [the exercises whose
checks fail too because they build on this one,] the whole exercise cell).
"""

KV = '''
def kv_bytes_per_token(layers, kv_heads, head_dim, t, itemsize=2):
    {check}
    return {per_token}


def tokens_that_fit(memory, weights, t, layers, kv_heads, head_dim, itemsize=2):
    free = {free}
    return {tokens}
'''
KV_RIGHT = dict(check='''if kv_heads % t and t % kv_heads:
        raise ValueError(f"a_kv = {kv_heads}, t = {t}")''',
                per_token="2 * layers * max(kv_heads // t, 1) * head_dim * itemsize",
                free="memory - weights / t",
                tokens="max(int(free // kv_bytes_per_token(layers, kv_heads, head_dim, t, itemsize)), 0)")


def kv(**wrong):
    fields = {**KV_RIGHT, **wrong}
    out = KV
    for key, value in fields.items():
        out = out.replace("{" + key + "}", value)
    return out


REDUCES = '''
def tp_all_reduces(b, h, layers, t, tokens=1, itemsize=2):
    count = {count}
    size = {size}
    return {{"count": count, "size": size, "sent": {sent}}}
'''
REDUCES_RIGHT = dict(count="0 if t == 1 else 1 + 2 * layers", size="tokens * b * h * itemsize",
                     sent="count * 2 * (t - 1) / t * size")


def reduces(**wrong):
    return REDUCES.format(**{**REDUCES_RIGHT, **wrong})


TIMES = '''
def allreduce_times(n, S, B, alpha):
    {one}
    return {{"ring": {ring}, "one-shot": {one_shot}, "two-shot": {two_shot}}}


def one_shot_crossover(n, B, alpha):
    {check}
    if n == 2:
        return math.inf
    return {crossover}
'''
TIMES_RIGHT = dict(one='''if n == 1:
        return {"ring": 0.0, "one-shot": 0.0, "two-shot": 0.0}''',
                   ring="2 * (n - 1) * alpha + 2 * (n - 1) / n * S / B",
                   one_shot="alpha + (n - 1) * S / B",
                   two_shot="2 * alpha + 2 * (n - 1) / n * S / B",
                   check='''if n < 2:
        raise ValueError(f"n = {n}")''',
                   crossover="alpha * B * n / ((n - 1) * (n - 2))")


def times(**wrong):
    fields = {**TIMES_RIGHT, **wrong}
    out = TIMES.replace("{{", "\0").replace("}}", "\1")
    for key, value in fields.items():
        out = out.replace("{" + key + "}", value)
    return out.replace("\0", "{").replace("\1", "}")


RING = '''
def ring_bytes(variant, new, cached, heads, kv_heads, head_dim, P, itemsize=2):
    {check}
    if variant == "pass-KV":
        return {kv}
    {other}


def choose_ring(new, cached, heads, kv_heads, head_dim, P, itemsize=2):
    kv = ring_bytes("pass-KV", new, cached, heads, kv_heads, head_dim, P, itemsize)
    q = ring_bytes("pass-Q", new, cached, heads, kv_heads, head_dim, P, itemsize)
    return {choice}
'''
RING_RIGHT = dict(check='''if new % P or cached % P:
        raise ValueError(f"P = {P} does not divide the tokens")''',
                  kv="(P - 1) / P * 2 * (cached + new) * kv_heads * head_dim * itemsize",
                  other='''if variant == "pass-Q":
        return (P - 1) / P * 2 * new * heads * head_dim * itemsize
    raise ValueError(f"unknown variant {variant!r}")''',
                  choice='"pass-Q" if q < kv else "pass-KV"')


def ring(**wrong):
    fields = {**RING_RIGHT, **wrong}
    out = RING
    for key, value in fields.items():
        out = out.replace("{" + key + "}", value)
    return out


EP = '''
def ep_decode_bytes(expert_index, E, P, hidden, itemsize=2):
    rows = np.zeros((P, P), dtype=int)
    for r, idx in enumerate(expert_index):
        for e in np.asarray(idx, dtype=int).reshape(-1):
            rows[r, {owner}] += 1
    {diagonal}
    return ({total} * {unit}).tolist()
'''
EP_RIGHT = dict(owner="e // (E // P)", diagonal="np.fill_diagonal(rows, 0)", total="(rows.sum(axis=1) + rows.sum(axis=0))",
                unit="hidden * itemsize")


def ep(**wrong):
    fields = {**EP_RIGHT, **wrong}
    out = EP
    for key, value in fields.items():
        out = out.replace("{" + key + "}", value)
    return out


WRONG = {
    "kv_cache": [
        ("visible", "divides by t with no floor of one head: the cache keeps shrinking past t = a_kv",
         kv(per_token="2 * layers * kv_heads / t * head_dim * itemsize")),
        ("visible", "a_kv // t heads: none at all once t > a_kv",
         kv(per_token="2 * layers * (kv_heads // t) * head_dim * itemsize")),
        ("visible", "keys only: forgets the factor 2", kv(per_token="layers * max(kv_heads // t, 1) * head_dim * itemsize")),
        ("visible", "never raises ValueError", kv(check="pass")),
        ("visible", "raises ValueError whenever t does not divide a_kv, replication included", kv(check='''if kv_heads % t:
        raise ValueError(f"t = {t} does not divide a_kv = {kv_heads}")''')),
        ("visible", "every GPU holds all the weights", kv(free="memory - weights")),
        ("visible", "a fraction of a token: no floor",
         kv(tokens="max(free / kv_bytes_per_token(layers, kv_heads, head_dim, t, itemsize), 0)")),
        ("visible", "a negative number of tokens when the weights do not fit",
         kv(tokens="int(free // kv_bytes_per_token(layers, kv_heads, head_dim, t, itemsize))")),
        ("visible", "the cache per token of one GPU, not split by t",
         kv(tokens="max(int(free // kv_bytes_per_token(layers, kv_heads, head_dim, 1, itemsize)), 0)")),
        ("visible", "tokens per GPU: the replica's tokens divided by t",
         kv(tokens="max(int(free // kv_bytes_per_token(layers, kv_heads, head_dim, t, itemsize)) // t, 0)")),
        ("visible", "every GPU's tokens counted apart: t times the replica's",
         kv(tokens="max(int(free // kv_bytes_per_token(layers, kv_heads, head_dim, t, itemsize)) * t, 0)")),
    ],
    "all_reduces": [
        ("visible", "two all-reduces per layer, the embedding's forgotten", reduces(count="0 if t == 1 else 2 * layers")),
        ("visible", "numbers, not bytes: the size without itemsize", reduces(size="tokens * b * h")),
        ("visible", "the ring sends the whole S per all-reduce", reduces(sent="count * size")),
        ("visible", "a reduce-scatter's share, (t−1)/t · S, per all-reduce", reduces(sent="count * (t - 1) / t * size")),
        ("visible", "all-reduces on one GPU too", reduces(count="1 + 2 * layers")),
        ("visible", "a decode step's size whatever the tokens", reduces(size="b * h * itemsize")),
    ],
    "allreduce_times": [
        ("visible", "the ring pays n − 1 latencies, not 2(n − 1)", times(ring="(n - 1) * alpha + 2 * (n - 1) / n * S / B")),
        ("visible", "one-shot sends S once, not to each of the n − 1 others", times(one_shot="alpha + S / B")),
        ("visible", "two-shot with one latency", times(two_shot="alpha + 2 * (n - 1) / n * S / B")),
        ("visible", "one GPU still pays the latencies", times(one="pass")),
        ("visible", "the crossover without the factor n", times(crossover="alpha * B / ((n - 1) * (n - 2))")),
        ("visible", "no ValueError for one GPU", times(check="pass")),
        ("visible", "divides by zero on two GPUs", '''
def allreduce_times(n, S, B, alpha):
    if n == 1:
        return {"ring": 0.0, "one-shot": 0.0, "two-shot": 0.0}
    return {"ring": 2 * (n - 1) * alpha + 2 * (n - 1) / n * S / B, "one-shot": alpha + (n - 1) * S / B,
            "two-shot": 2 * alpha + 2 * (n - 1) / n * S / B}


def one_shot_crossover(n, B, alpha):
    if n < 2:
        raise ValueError(f"n = {n}")
    return alpha * B * n / ((n - 1) * (n - 2))
'''),
    ],
    "ring_choice": [
        ("visible", "pass-KV moves only the new tokens' keys and values",
         ring(kv="(P - 1) / P * 2 * new * kv_heads * head_dim * itemsize")),
        ("visible", "pass-Q counted with the key/value heads", ring(other='''if variant == "pass-Q":
        return (P - 1) / P * 2 * new * kv_heads * head_dim * itemsize
    raise ValueError(f"unknown variant {variant!r}")''')),
        ("visible", "a tie goes to pass-Q", ring(choice='"pass-Q" if q <= kv else "pass-KV"')),
        ("visible", "forgets the (P − 1)/P of a ring", ring(kv="2 * (cached + new) * kv_heads * head_dim * itemsize",
                                                           other='''if variant == "pass-Q":
        return 2 * new * heads * head_dim * itemsize
    raise ValueError(f"unknown variant {variant!r}")''')),
        ("visible", "pass-Q counts the queries but not the partial outputs coming back", ring(other='''if variant == "pass-Q":
        return (P - 1) / P * new * heads * head_dim * itemsize
    raise ValueError(f"unknown variant {variant!r}")''')),
        ("visible", "any other variant counted as pass-Q",
         ring(other="return (P - 1) / P * 2 * new * heads * head_dim * itemsize")),
        ("visible", "no ValueError when P does not divide the tokens", ring(check="pass")),
    ],
    "ep_bytes": [
        ("visible", "the dispatch only: the combine's returns forgotten", ep(total="rows.sum(axis=1)")),
        ("visible", "counts the rows for its own experts too", ep(diagonal="pass")),
        ("visible", "the combine counted as its own rows coming back", ep(total="2 * rows.sum(axis=1)")),
        ("visible", "experts dealt round robin, e mod P", ep(owner="e % P")),
        ("visible", "one row per token and remote rank, not per assignment", '''
def ep_decode_bytes(expert_index, E, P, hidden, itemsize=2):
    rows = np.zeros((P, P), dtype=int)
    for r, idx in enumerate(expert_index):
        for token in np.asarray(idx, dtype=int):
            for owner in set((token // (E // P)).tolist()):
                rows[r, owner] += 1
    np.fill_diagonal(rows, 0)
    return ((rows.sum(axis=1) + rows.sum(axis=0)) * hidden * itemsize).tolist()
'''),
        ("visible", "rows, not bytes", ep(unit="1")),
        ("hidden", "two experts per rank, whatever E and P", ep(owner="e // 2")),
    ],
}

# Right answers written differently from the solution: the checks must accept them.
RIGHT = {
    "kv_cache": [("heads per GPU by case, bytes with integer arithmetic", '''
def kv_bytes_per_token(layers, kv_heads, head_dim, t, itemsize=2):
    if t <= kv_heads:
        if kv_heads % t != 0:
            raise ValueError(f"t = {t} does not divide a_kv = {kv_heads}")
        per_gpu = kv_heads // t
    else:
        if t % kv_heads != 0:
            raise ValueError(f"a_kv = {kv_heads} does not divide t = {t}")
        per_gpu = 1
    return 2 * layers * per_gpu * head_dim * itemsize


def tokens_that_fit(memory, weights, t, layers, kv_heads, head_dim, itemsize=2):
    per_token = kv_bytes_per_token(layers, kv_heads, head_dim, t, itemsize)
    if weights / t >= memory:
        return 0
    return math.floor((memory - weights / t) / per_token)
''')],
    "all_reduces": [("a branch for one GPU, the ring's bytes per all-reduce first", '''
def tp_all_reduces(b, h, layers, t, tokens=1, itemsize=2):
    S = b * tokens * h * itemsize
    if t == 1:
        return {"count": 0, "size": S, "sent": 0}
    per = 2 * (t - 1) * S / t
    n = 2 * layers + 1
    return {"count": n, "size": S, "sent": n * per}
''')],
    "allreduce_times": [("shared bandwidth term, a table of steps", '''
def allreduce_times(n, S, B, alpha):
    if n < 2:
        return dict.fromkeys(("ring", "one-shot", "two-shot"), 0.0)
    moved = 2 * (n - 1) / n * S / B
    return {"ring": 2 * (n - 1) * alpha + moved, "one-shot": alpha + (n - 1) * S / B, "two-shot": 2 * alpha + moved}


def one_shot_crossover(n, B, alpha):
    if n <= 1:
        raise ValueError("a crossover needs two GPUs or more")
    return float("inf") if n == 2 else n * alpha * B / ((n - 1) * (n - 2))
''')],
    "ring_choice": [("a table of per-token widths; choose compares with min", '''
def ring_bytes(variant, new, cached, heads, kv_heads, head_dim, P, itemsize=2):
    if variant not in ("pass-KV", "pass-Q"):
        raise ValueError(variant)
    if new % P != 0 or cached % P != 0:
        raise ValueError("the tokens must split evenly over the ranks")
    tokens, width = ((cached + new), kv_heads) if variant == "pass-KV" else (new, heads)
    return 2 * tokens * width * head_dim * itemsize * (P - 1) / P


def choose_ring(new, cached, heads, kv_heads, head_dim, P, itemsize=2):
    sizes = {v: ring_bytes(v, new, cached, heads, kv_heads, head_dim, P, itemsize) for v in ("pass-KV", "pass-Q")}
    return min(("pass-KV", "pass-Q"), key=lambda v: sizes[v])
''')],
    "ep_bytes": [("plain loops over every assignment", '''
def ep_decode_bytes(expert_index, E, P, hidden, itemsize=2):
    sent = [0] * P
    per_rank = E // P
    for r, idx in enumerate(expert_index):
        for row in idx:
            for e in row:
                owner = int(e) // per_rank
                if owner != r:
                    sent[r] += hidden * itemsize
                    sent[owner] += hidden * itemsize
    return sent
''')],
}
