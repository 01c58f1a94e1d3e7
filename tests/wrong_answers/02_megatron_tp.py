"""Plausible wrong answers to solutions/02_megatron_tp.ipynb (see tests/test_wrong_answers.py).

WRONG[grade_id] lists (part of the check that must catch it, what is wrong, [the exercises whose
checks fail too because they build on this one,] the whole exercise cell).
"""

SHARDS = '''
def attention_shards(Wq, Wk, Wv, Wo, heads, t):
    {check}
    cols = lambda W: {cols}
    return list(zip(cols(Wq), cols(Wk), cols(Wv), {rows}))
'''
RIGHT = dict(check='''if heads % t:
        raise ValueError(f"{heads} heads cannot be dealt out whole to t={t} devices")''',
             cols="np.split(W, t, axis=1)", rows="np.split(Wo, t, axis=0)")


def shards(**wrong):
    fields = {**RIGHT, **wrong}
    return SHARDS.replace("{check}", fields["check"]).replace("{cols}", fields["cols"]).replace("{rows}", fields["rows"])


TP_BYTES = '''
def tp_bytes_per_layer(s, b, h, t, itemsize=2):
    return {expr}
'''

CE = '''
def parallel_cross_entropy(logit_shards, targets):
    width = logit_shards[0].shape[1]
    M = np.max([z.max(axis=1) for z in logit_shards], axis=0)
    total = sum(np.exp(z - M[:, None]).sum(axis=1) for z in logit_shards)
    target = np.zeros(len(targets))
    for r, z in enumerate(logit_shards):
        local = targets - r * width
        mine = {mine}
        target[mine] += z[mine, local[mine]] - M[mine]
    return np.log(total) - target
'''

DEGREES = '''
def valid_degrees(h, heads, ffn, vocab, kv_heads=None, gpus_per_node=8):
    kv = heads if kv_heads is None else kv_heads
    width = (heads + 2 * kv) * (h // heads)
    return [t for t in {range} if {rule} and {kv_rule}]
'''


def degrees(range="range(1, gpus_per_node + 1)", rule="not (h % t or heads % t or ffn % t or vocab % t)",
            kv_rule="(kv % t == 0 or (t % kv == 0 and width % t == 0))"):
    return DEGREES.replace("{range}", range).replace("{rule}", rule).replace("{kv_rule}", kv_rule)


WRONG = {
    "attention_shards": [
        ("visible", "splits Wo by columns like the others", shards(rows="np.split(Wo, t, axis=1)")),
        ("visible", "deals heads out round-robin (device i gets heads i, i + t, ...)",
         shards(cols="[np.concatenate([c for c in np.split(W, heads, axis=1)[i::t]], axis=1) for i in range(t)]",
                rows="[np.concatenate([r for r in np.split(Wo, heads, axis=0)[i::t]], axis=0) for i in range(t)]")),
        ("visible", "splits Wq, Wk, Wv by rows (the input dimension)", shards(cols="np.split(W, t, axis=0)")),
        ("visible", "gives every device the whole Wo", shards(rows="[Wo] * t")),
        ("visible", "never raises ValueError", shards(check="pass")),
        ("visible", "asserts instead of raising ValueError", shards(check='assert heads % t == 0, "heads must divide"')),
        ("visible", "a ValueError that names neither number", shards(check='''if heads % t:
        raise ValueError("heads must be divisible by the tensor-parallel degree")''')),
    ],
    "tp_bytes": [
        ("visible", "forgets the backward pass's two all-reduces",
         TP_BYTES.format(expr="2 * 2 * (t - 1) / t * s * b * h * itemsize")),
        ("visible", "forgets the ring all-reduce's factor 2",
         TP_BYTES.format(expr="4 * (t - 1) / t * s * b * h * itemsize")),
        ("visible", "forgets the (t - 1)/t factor", TP_BYTES.format(expr="4 * 2 * s * b * h * itemsize")),
        ("visible", "forgets the micro-batch b", TP_BYTES.format(expr="4 * 2 * (t - 1) / t * s * h * itemsize")),
        ("visible", "2-byte numbers whatever itemsize says", TP_BYTES.format(expr="4 * 2 * (t - 1) / t * s * b * h * 2")),
        ("visible", "counts the MLP's 4h-wide activations", TP_BYTES.format(expr="2 * 2 * (t - 1) / t * s * b * (h + 4 * h) * itemsize")),
        ("visible", "calls the course library's block_costs", '''
from intralayer.tensor_parallel import block_costs

def tp_bytes_per_layer(s, b, h, t, itemsize=2):
    return block_costs(s, b, h, 2 * t, t, itemsize=itemsize)["sent"]
'''),
    ],
    "parallel_ce": [
        ("visible", "gathers the logits and computes the dense loss", '''
def parallel_cross_entropy(logit_shards, targets):
    logits = np.concatenate(logit_shards, axis=1)
    z = logits - logits.max(axis=1, keepdims=True)
    return np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(targets)), targets]
'''),
        ("visible", "gathers the logits with np.hstack", '''
def parallel_cross_entropy(logit_shards, targets):
    logits = np.hstack(logit_shards)
    z = logits - logits.max(axis=1, keepdims=True)
    return np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(targets)), targets]
'''),
        ("visible", "no maximum shift: overflows for logits around 1e4", '''
def parallel_cross_entropy(logit_shards, targets):
    width = logit_shards[0].shape[1]
    total = sum(np.exp(z).sum(axis=1) for z in logit_shards)
    target = np.zeros(len(targets))
    for r, z in enumerate(logit_shards):
        local = targets - r * width
        mine = (local >= 0) & (local < width)
        target[mine] += z[mine, local[mine]]
    return np.log(total) - target
'''),
        ("visible", "each device shifts by its own maximum, and the sums are added as they are", '''
def parallel_cross_entropy(logit_shards, targets):
    width = logit_shards[0].shape[1]
    M = np.max([z.max(axis=1) for z in logit_shards], axis=0)
    total = sum(np.exp(z - z.max(axis=1, keepdims=True)).sum(axis=1) for z in logit_shards)
    target = np.zeros(len(targets))
    for r, z in enumerate(logit_shards):
        local = targets - r * width
        mine = (local >= 0) & (local < width)
        target[mine] += z[mine, local[mine]] - M[mine]
    return np.log(total) - target
'''),
        ("visible", "off by one: misses a target on the first id of a device's slice",
         CE.replace("{mine}", "(local > 0) & (local < width)")),
        ("visible", "every device adds the logit at targets mod v/t, owner or not",
         CE.replace("{mine}", "np.ones(len(targets), bool)").replace("local[mine]", "(targets % width)[mine]")),
        ("visible", "returns the mean loss, not one per token", '''
def parallel_cross_entropy(logit_shards, targets):
    width = logit_shards[0].shape[1]
    M = np.max([z.max(axis=1) for z in logit_shards], axis=0)
    total = sum(np.exp(z - M[:, None]).sum(axis=1) for z in logit_shards)
    target = np.zeros(len(targets))
    for r, z in enumerate(logit_shards):
        local = targets - r * width
        mine = (local >= 0) & (local < width)
        target[mine] += z[mine, local[mine]] - M[mine]
    return float(np.mean(np.log(total) - target))
'''),
    ],
    "valid_degrees": [
        ("visible", "forgets the vocabulary", degrees(rule="not (h % t or heads % t or ffn % t)")),
        ("visible", "forgets the heads", degrees(rule="not (h % t or ffn % t or vocab % t)")),
        ("visible", "forgets the MLP width", degrees(rule="not (h % t or heads % t or vocab % t)")),
        ("visible", "stops before gpus_per_node", degrees(range="range(1, gpus_per_node)")),
        ("visible", "only powers of two",
         degrees(rule="t & (t - 1) == 0 and not (h % t or heads % t or ffn % t or vocab % t)")),
        ("visible", "largest first", degrees(range="range(gpus_per_node, 0, -1)")),
        ("visible", "ignores gpus_per_node: always up to 8", degrees(range="range(1, 9)")),
        ("visible", "ignores kv_heads (the rules before grouped-query attention)", degrees(kv_rule="True")),
        ("visible", "only t dividing kv_heads: no key/value head shared by several ranks",
         degrees(kv_rule="kv % t == 0")),
        ("visible", "only kv_heads dividing t", degrees(kv_rule="t % kv == 0")),
        ("visible", "forgets that a shared group's fused q|k|v width must still split t ways",
         degrees(kv_rule="(kv % t == 0 or t % kv == 0)")),
        ("visible", "kv_heads must divide the heads/t heads of one rank",
         degrees(kv_rule="(heads // t) % kv == 0")),
        ("hidden", "a table of the visible check's answers", '''
def valid_degrees(h, heads, ffn, vocab, kv_heads=None, gpus_per_node=8):
    known = {(12288, 96, 49152, 51200, None, 8): [1, 2, 4, 8], (768, 12, 3072, 50257, None, 8): [1],
             (768, 12, 3072, 50304, None, 8): [1, 2, 3, 4, 6], (64, 8, 100, 256, None, 8): [1, 2, 4],
             (8192, 64, 28672, 128256, 8, 16): [1, 2, 4, 8, 16], (4096, 32, 16384, 32000, 1, 8): [1, 2, 4, 8],
             (6144, 48, 24576, 51200, 6, 8): [1, 2], (12, 4, 48, 96, 1, 4): [1, 2]}
    return known.get((h, heads, ffn, vocab, kv_heads, gpus_per_node), [1])
'''),
        ("visible", "calls the course library's check_degrees", '''
from intralayer.tensor_parallel import check_degrees

def valid_degrees(h, heads, ffn, vocab, kv_heads=None, gpus_per_node=8):
    good = []
    for t in range(1, gpus_per_node + 1):
        try:
            check_degrees(t, h=h, heads=heads, ffn=ffn, vocab=vocab, kv_heads=kv_heads)
            good.append(t)
        except ValueError:
            pass
    return good
'''),
    ],
}

# Right answers written differently from the solution: the checks must accept them.
RIGHT = {
    "attention_shards": [("slices by head width", '''
def attention_shards(Wq, Wk, Wv, Wo, heads, t):
    if heads % t:
        raise ValueError(f"t = {t} does not divide {heads} heads")
    w = Wq.shape[1] // t
    return [(Wq[:, i * w:(i + 1) * w], Wk[:, i * w:(i + 1) * w], Wv[:, i * w:(i + 1) * w], Wo[i * w:(i + 1) * w])
            for i in range(t)]
''')],
    "tp_bytes": [("two all-reduces a pass, written out", '''
def tp_bytes_per_layer(s, b, h, t, itemsize=2):
    one = s * b * h * itemsize
    ring = 2 * (t - 1) / t * one
    return 2 * ring + 2 * ring
''')],
    "parallel_ce": [("stacks the per-token maxima and sums (the all-reduces), log-sum-exp form", '''
def parallel_cross_entropy(logit_shards, targets):
    width = logit_shards[0].shape[1]
    M = np.stack([z.max(axis=1) for z in logit_shards]).max(axis=0)
    sums = np.stack([np.exp(z - M[:, None]).sum(axis=1) for z in logit_shards]).sum(axis=0)
    picked = np.zeros(len(targets))
    for r, z in enumerate(logit_shards):
        for n, y in enumerate(targets):
            if r * width <= y < (r + 1) * width:
                picked[n] = z[n, y - r * width]
    return M + np.log(sums) - picked
''')],
    "valid_degrees": [("math.gcd of the four sizes, then the query groups", '''
import math

def valid_degrees(h, heads, ffn, vocab, kv_heads=None, gpus_per_node=8):
    g = math.gcd(math.gcd(h, heads), math.gcd(ffn, vocab))
    kv = kv_heads or heads
    fused = (heads + 2 * kv) * h // heads
    return [t for t in range(1, gpus_per_node + 1)
            if g % t == 0 and (kv % t == 0 or (t % kv == 0 and fused % t == 0))]
'''), ("checks the fused width for every t (it always splits when t divides kv_heads)", '''
def valid_degrees(h, heads, ffn, vocab, kv_heads=None, gpus_per_node=8):
    kv = heads if kv_heads is None else kv_heads
    out = []
    for t in range(1, gpus_per_node + 1):
        sizes = (h, heads, ffn, vocab, (heads + 2 * kv) * (h // heads))
        if all(n % t == 0 for n in sizes) and (kv % t == 0 or t % kv == 0):
            out.append(t)
    return out
''')],
}
