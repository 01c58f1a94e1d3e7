"""Plausible wrong answers to solutions/05_moe.ipynb (see tests/test_wrong_answers.py).

WRONG[grade_id] lists (part of the check that must catch it, what is wrong, [the exercises whose
checks fail too because they build on this one,] the whole exercise cell).
"""

COUNT = '''
def mixtral_params(vocab, hidden, layers, heads, kv_heads, head_dim, experts, k, ffn):
    attention = {attention}
    expert = {expert}
    per_layer = attention + {norms} + {router}
    embeddings = {embeddings}
    total = layers * (per_layer + experts * expert) + embeddings
    active = {active}
    return total, active
'''
COUNT_RIGHT = dict(attention="hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim",
                   expert="3 * hidden * ffn", norms="2 * hidden", router="hidden * experts",
                   embeddings="2 * vocab * hidden + hidden",
                   active="layers * (per_layer + k * expert) + embeddings")


def count(**wrong):
    return COUNT.format(**{**COUNT_RIGHT, **wrong})


KEEP = '''
def keep_mask(expert_index, experts, capacity):
    T, k = expert_index.shape
    used = np.zeros(experts, dtype=int)
    kept = np.zeros((T, k), dtype=bool)
    {loops}
            e = expert_index[t, j]
            if {test}:
                used[e] += 1
                kept[t, j] = True
    return {result}
'''
KEEP_RIGHT = dict(loops='''for j in range(k):
        for t in range(T):''', test="used[e] < capacity", result="kept")


def keep(**wrong):
    fields = {**KEEP_RIGHT, **wrong}
    out = KEEP
    for key, value in fields.items():
        out = out.replace("{" + key + "}", value)
    return out


WRONG = {
    "count": [
        ("visible", "forgets the routers", count(router="0")),
        ("visible", "ties the embedding and the output head", count(embeddings="vocab * hidden + hidden")),
        ("visible", "full multi-head attention: a key/value head per query head",
         count(attention="4 * hidden * heads * head_dim")),
        ("visible", "an expert as a plain two-matrix MLP", count(expert="2 * hidden * ffn")),
        ("visible", "counts every expert as active", count(active="total")),
        ("visible", "forgets the RMSNorms", count(norms="0", embeddings="2 * vocab * hidden")),
        ("visible", "forgets only the final RMSNorm", count(embeddings="2 * vocab * hidden")),
        ("visible", "leaves the embeddings out of the active count", count(active="layers * (per_layer + k * expert)")),
        ("visible", "calls the course library's count_params", '''
from intralayer import moe

def mixtral_params(vocab, hidden, layers, heads, kv_heads, head_dim, experts, k, ffn):
    return moe.count_params(moe.MoEConfig(name="m", vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                                          kv_heads=kv_heads, head_dim=head_dim, experts=experts, top_k=k, moe_ffn=ffn))
'''),
    ],
    "dispatch": [
        ("visible", "a dispatch that ignores capacity", keep(test="True")),
        ("visible", "serves token by token, all of a token's choices first", keep(loops='''for t in range(T):
        for j in range(k):''')),
        ("visible", "a fresh capacity for each choice rank", keep(loops='''for j in range(k):
        used[:] = 0
        for t in range(T):''')),
        ("visible", "off by one: takes capacity + 1", keep(test="used[e] <= capacity")),
        ("visible", "later tokens first", keep(loops='''for j in range(k):
        for t in reversed(range(T)):''')),
        ("visible", "returns a list of lists", keep(result="kept.tolist()")),
        ("visible", "drops a token's every choice once one is dropped", keep(result="kept & kept.all(axis=1, keepdims=True)")),
    ],
    "bias": [
        ("visible", "signs reversed: the overloaded expert gains", '''
def bias_step(bias, counts, gamma):
    counts = np.asarray(counts, dtype=float)
    return bias + gamma * np.sign(counts - counts.mean())
'''),
        ("visible", "compares with the median load, not the mean", '''
def bias_step(bias, counts, gamma):
    counts = np.asarray(counts, dtype=float)
    return bias - gamma * np.sign(counts - np.median(counts))
'''),
        ("visible", "moves in proportion to the gap", '''
def bias_step(bias, counts, gamma):
    counts = np.asarray(counts, dtype=float)
    return bias - gamma * (counts - counts.mean())
'''),
        ("visible", "an expert exactly at the mean loses gamma", '''
def bias_step(bias, counts, gamma):
    counts = np.asarray(counts, dtype=float)
    return bias - gamma * np.where(counts >= counts.mean(), 1.0, -1.0)
'''),
        ("visible", "updates the bias array in place", '''
def bias_step(bias, counts, gamma):
    counts = np.asarray(counts, dtype=float)
    bias -= gamma * np.sign(counts - counts.mean())
    return bias
'''),
        ("visible", "calls the course library's bias_update", '''
import torch
from intralayer.moe import bias_update

def bias_step(bias, counts, gamma):
    return bias_update(torch.tensor(bias), torch.tensor(counts), gamma).numpy()
'''),
    ],
    "balance": [
        ("visible", "f over T, not T·k assignments", '''
def balance_loss(logits, expert_index):
    T, E = logits.shape
    f = np.bincount(expert_index.ravel(), minlength=E) / T
    z = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    return E * float((f * probs.mean(axis=0)).sum())
'''),
        ("visible", "π from the chosen experts (one-hot argmax), not the probabilities", '''
def balance_loss(logits, expert_index):
    T, E = logits.shape
    f = np.bincount(expert_index.ravel(), minlength=E) / expert_index.size
    pi = np.bincount(logits.argmax(axis=1), minlength=E) / T
    return E * float((f * pi).sum())
'''),
        ("visible", "softmax without the maximum shift", '''
def balance_loss(logits, expert_index):
    T, E = logits.shape
    f = np.bincount(expert_index.ravel(), minlength=E) / expert_index.size
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return E * float((f * probs.mean(axis=0)).sum())
'''),
        ("visible", "forgets the factor E", '''
def balance_loss(logits, expert_index):
    T, E = logits.shape
    f = np.bincount(expert_index.ravel(), minlength=E) / expert_index.size
    z = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    return float((f * probs.mean(axis=0)).sum())
'''),
        ("visible", "π summed over tokens, not averaged", '''
def balance_loss(logits, expert_index):
    T, E = logits.shape
    f = np.bincount(expert_index.ravel(), minlength=E) / expert_index.size
    z = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    return E * float((f * probs.sum(axis=0)).sum())
'''),
        ("visible", "returns the per-expert terms, not their sum", '''
def balance_loss(logits, expert_index):
    T, E = logits.shape
    f = np.bincount(expert_index.ravel(), minlength=E) / expert_index.size
    z = logits - logits.max(axis=1, keepdims=True)
    probs = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    return E * f * probs.mean(axis=0)
'''),
        ("visible", "calls the course library's switch_balance_loss", '''
import torch
from intralayer import moe

def balance_loss(logits, expert_index):
    return float(moe.switch_balance_loss(torch.tensor(logits), torch.tensor(expert_index)))
'''),
    ],
}

# Right answers written differently from the solution: the checks must accept them.
RIGHT = {
    "count": [("part by part", '''
def mixtral_params(vocab, hidden, layers, heads, kv_heads, head_dim, experts, k, ffn):
    q_and_o = 2 * hidden * heads * head_dim
    k_and_v = 2 * hidden * kv_heads * head_dim
    shared = layers * (q_and_o + k_and_v + 2 * hidden + hidden * experts) + 2 * vocab * hidden + hidden
    expert = 3 * hidden * ffn
    return shared + layers * experts * expert, shared + layers * k * expert
''')],
    "dispatch": [("per-expert counters in a dict, int mask", '''
def keep_mask(expert_index, experts, capacity):
    T, k = expert_index.shape
    load = {}
    kept = np.zeros((T, k), dtype=int)
    for j in range(k):
        for t in range(T):
            e = int(expert_index[t, j])
            if load.get(e, 0) < capacity:
                load[e] = load.get(e, 0) + 1
                kept[t, j] = 1
    return kept
''')],
    "bias": [("np.where", '''
def bias_step(bias, counts, gamma):
    counts = np.asarray(counts)
    mean = counts.mean()
    return bias + np.where(counts > mean, -gamma, np.where(counts < mean, gamma, 0.0))
''')],
    "balance": [("one-hot assignments and a stable softmax", '''
def balance_loss(logits, expert_index):
    T, E = logits.shape
    onehot = np.zeros((expert_index.size, E))
    onehot[np.arange(expert_index.size), expert_index.ravel()] = 1
    f = onehot.mean(axis=0)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return float(E * np.dot(f, p.mean(axis=0)))
''')],
}
