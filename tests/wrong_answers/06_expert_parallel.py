"""Plausible wrong answers to solutions/06_expert_parallel.ipynb (see tests/test_wrong_answers.py).

WRONG[grade_id] lists (part of the check that must catch it, what is wrong, [the exercises whose
checks fail too because they build on this one,] the whole exercise cell).
"""

COPIES = '''
def copies_across(expert_index, rank, E, P, nodes):
    m = {m}
    node = (expert_index // (E // P)) // m
    remote = node != {own}
    per_assignment = int(remote.sum())
    per_node = {per_node}
    return per_assignment, per_node
'''
COPIES_RIGHT = dict(m="P // nodes", own="rank // m",
                    per_node="sum(len(set(node[t][remote[t]].tolist())) for t in range(len(node)))")


def copies(**wrong):
    return COPIES.format(**{**COPIES_RIGHT, **wrong})


DISPATCH = '''
def dispatch_time(T, k, h, e, P, nodes, intra, inter):
    per_peer = {per_peer}
    m = P // nodes
    return {time}
'''
DISPATCH_RIGHT = dict(per_peer="T * k * h * e / P", time="(m - 1) * per_peer / intra + (P - m) * per_peer / inter")


def dispatch(**wrong):
    return DISPATCH.format(**{**DISPATCH_RIGHT, **wrong})


WRONG = {
    "send_counts": [
        ("visible", "counts dropped assignments too", '''
def send_counts(expert_index, kept, E, P):
    return np.bincount((expert_index // (E // P)).ravel(), minlength=P).tolist()
'''),
        ("visible", "deals experts out round-robin (expert e on rank e mod P)", '''
def send_counts(expert_index, kept, E, P):
    return np.bincount(expert_index[kept] % P, minlength=P).tolist()
'''),
        ("visible", "owner e // P instead of e // (E/P)", '''
def send_counts(expert_index, kept, E, P):
    return np.bincount(expert_index[kept] // P, minlength=P).tolist()
'''),
        ("visible", "counts per expert, not per rank", '''
def send_counts(expert_index, kept, E, P):
    return np.bincount(expert_index[kept], minlength=E).tolist()
'''),
        ("visible", "np.bincount without minlength: short when the last ranks get nothing", '''
def send_counts(expert_index, kept, E, P):
    return np.bincount(expert_index[kept] // (E // P)).tolist()
'''),
        ("visible", "returns a NumPy array", '''
def send_counts(expert_index, kept, E, P):
    return np.bincount(expert_index[kept] // (E // P), minlength=P)
'''),
    ],
    "combine": [
        ("visible", "forgets the router weights", '''
def combine(returned, token, weight, T):
    out = np.zeros((T, returned.shape[1]))
    np.add.at(out, token, returned)
    return out
'''),
        ("visible", "fancy-index += drops repeated tokens", '''
def combine(returned, token, weight, T):
    out = np.zeros((T, returned.shape[1]))
    out[token] += weight[:, None] * returned
    return out
'''),
        ("visible", "averages a token's assignments", '''
def combine(returned, token, weight, T):
    out = np.zeros((T, returned.shape[1]))
    np.add.at(out, token, weight[:, None] * returned)
    n = np.bincount(token, minlength=T)
    return out / np.maximum(n, 1)[:, None]
'''),
        ("visible", "one row per token seen, not T rows", '''
def combine(returned, token, weight, T):
    out = np.zeros((token.max() + 1, returned.shape[1]))
    np.add.at(out, token, weight[:, None] * returned)
    return out
'''),
        ("visible", "the last assignment overwrites the others", '''
def combine(returned, token, weight, T):
    out = np.zeros((T, returned.shape[1]))
    for a, t in enumerate(token):
        out[t] = weight[a] * returned[a]
    return out
'''),
    ],
    "copies": [
        ("visible", "counts the token's own node among its copies",
         copies(per_node="sum(len(set(node[t].tolist())) for t in range(len(node)))")),
        ("visible", "its own node taken as the rank number", copies(own="rank")),
        ("visible", "ranks per node taken as the number of nodes", copies(m="nodes")),
        ("visible", "distinct remote nodes over all tokens, not per token", copies(per_node="len(set(node[remote].tolist()))")),
        ("visible", "counts assignments to other ranks, not other nodes", '''
def copies_across(expert_index, rank, E, P, nodes):
    m = P // nodes
    owner = expert_index // (E // P)
    node = owner // m
    remote = node != rank // m
    per_node = sum(len(set(node[t][remote[t]].tolist())) for t in range(len(node)))
    return int((owner != rank).sum()), per_node
'''),
        ("visible", "copies per node counted once per assignment", copies(per_node="int(remote.sum())")),
    ],
    "dispatch_time": [
        ("visible", "counts the rank itself among its node's peers", dispatch(time="m * per_peer / intra + (P - m) * per_peer / inter")),
        ("visible", "NVLink and InfiniBand at once: the longer of the two",
         dispatch(time="max((m - 1) * per_peer / intra, (P - m) * per_peer / inter)")),
        ("visible", "every peer over InfiniBand", dispatch(time="(P - 1) * per_peer / inter")),
        ("visible", "forgets to divide by P: a rank's whole send to every peer", dispatch(per_peer="T * k * h * e")),
        ("visible", "the number of nodes as the ranks per node",
         dispatch(time="(nodes - 1) * per_peer / intra + (P - nodes) * per_peer / inter")),
        ("visible", "forgets the bytes per number", dispatch(per_peer="T * k * h / P")),
    ],
}

# Right answers written differently from the solution: the checks must accept them.
RIGHT = {
    "send_counts": [("a loop", '''
def send_counts(expert_index, kept, E, P):
    counts = [0] * P
    for e, keep in zip(expert_index.ravel(), kept.ravel()):
        if keep:
            counts[int(e) * P // E] += 1
    return counts
''')],
    "combine": [("a loop", '''
def combine(returned, token, weight, T):
    out = np.zeros((T, returned.shape[1]))
    for a in range(len(token)):
        out[token[a]] += weight[a] * returned[a]
    return out
''')],
    "copies": [("sets per token", '''
def copies_across(expert_index, rank, E, P, nodes):
    per_node_ranks = P // nodes
    home = rank // per_node_ranks
    assignments, copies = 0, 0
    for row in expert_index:
        others = [int(e) // (E // P) // per_node_ranks for e in row]
        others = [n for n in others if n != home]
        assignments += len(others)
        copies += len(set(others))
    return [assignments, copies]
''')],
    "dispatch_time": [("bytes inside and outside the node", '''
def dispatch_time(T, k, h, e, P, nodes, intra, inter):
    share = T * k * h * e / P
    inside = P // nodes - 1
    return inside * share / intra + (P - 1 - inside) * share / inter
''')],
}
