"""Plausible wrong answers to solutions/00_collectives.ipynb (see tests/test_wrong_answers.py).

WRONG[grade_id] lists (part of the check that must catch it, what is wrong, [the exercises whose
checks fail too because they build on this one,] the whole exercise cell).
"""

WRONG = {
    "bus_factor": [
        ("visible", "forgets all-reduce's factor 2 (counts one phase)", '''
def bus_factor(op, n):
    if op not in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        raise ValueError(f"unknown collective {op!r}")
    return (n - 1) / n
'''),
        ("visible", "forgets the (n-1)/n factor: one whole S per phase", '''
def bus_factor(op, n):
    factors = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}")
    return factors[op]
'''),
        ("visible", "counts n-1 chunks without dividing by n", '''
def bus_factor(op, n):
    factors = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1, "all_to_all": n - 1}
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}")
    return factors[op]
'''),
        ("visible", "integer division (n - 1) // n", ("crossover",), '''
def bus_factor(op, n):
    factors = {"all_reduce": 2 * (n - 1) // n, "all_gather": (n - 1) // n,
               "reduce_scatter": (n - 1) // n, "all_to_all": (n - 1) // n}
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}")
    return factors[op]
'''),
        ("visible", "all-to-all counts the block a device keeps: factor 1", '''
def bus_factor(op, n):
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
               "reduce_scatter": (n - 1) / n, "all_to_all": 1.0}
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}")
    return factors[op]
'''),
        ("visible", "never raises ValueError: unknown collectives cost nothing", '''
def bus_factor(op, n):
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
               "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n}
    return factors.get(op, 0.0)
'''),
        ("visible", "a plain dict lookup raises KeyError, not ValueError", '''
def bus_factor(op, n):
    factors = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n,
               "reduce_scatter": (n - 1) / n, "all_to_all": (n - 1) / n}
    return factors[op]
'''),
        ("visible", "calls the course library's comm.bus_factor", ("crossover",), '''
from intralayer import comm

def bus_factor(op, n):
    return comm.bus_factor(op, n)
'''),
    ],
    "ring_all_gather": [
        ("visible", "concatenates without passing anything round", '''
def ring_all_gather(chunks, send):
    return [np.concatenate(chunks) for _ in chunks]
'''),
        ("visible", "every device sends its own chunk at every step", '''
def ring_all_gather(chunks, send):
    n = len(chunks)
    for j in range(1, n):
        for i in range(n):
            send(i, (i + 1) % n, chunks[i])
    return [np.concatenate(chunks) for _ in chunks]
'''),
        ("visible", "sends each chunk straight to every other device, not round a ring", '''
def ring_all_gather(chunks, send):
    n = len(chunks)
    held = [{i: chunks[i]} for i in range(n)]
    for i in range(n):
        for d in range(n):
            if d != i:
                held[d][i] = send(i, d, chunks[i])
    return [np.concatenate([h[c] for c in range(n)]) for h in held]
'''),
        ("visible", "sends chunk i + j at step j, before it has arrived", '''
def ring_all_gather(chunks, send):
    n = len(chunks)
    held = [{i: chunks[i]} for i in range(n)]
    for j in range(1, n):
        for i in range(n):
            c = (i + j) % n
            held[(i + 1) % n][c] = send(i, (i + 1) % n, chunks[c])
    return [np.concatenate([h[c] for c in range(n)]) for h in held]
'''),
        ("visible", "forwards everything it holds at every step", '''
def ring_all_gather(chunks, send):
    n = len(chunks)
    held = [{i: chunks[i]} for i in range(n)]
    for j in range(1, n):
        for i in range(n):
            ids = sorted(held[i])
            got = send(i, (i + 1) % n, np.concatenate([held[i][c] for c in ids]))
            for c, part in zip(ids, np.split(got, len(ids))):
                held[(i + 1) % n][c] = part
    return [np.concatenate([h[c] for c in range(n)]) for h in held]
'''),
        ("visible", "runs n steps instead of n - 1", '''
def ring_all_gather(chunks, send):
    n = len(chunks)
    held = [{i: chunks[i]} for i in range(n)]
    for j in range(1, n + 1):
        for i in range(n):
            c = (i - j + 1) % n
            held[(i + 1) % n][c] = send(i, (i + 1) % n, held[i][c])
    return [np.concatenate([h[c] for c in range(n)]) for h in held]
'''),
        ("visible", "each device's result starts with its own chunk (arrival order, not device order)", '''
def ring_all_gather(chunks, send):
    n = len(chunks)
    held = [[chunks[i]] for i in range(n)]
    for j in range(1, n):
        for i in range(n):
            held[(i + 1) % n].append(send(i, (i + 1) % n, held[i][j - 1]))
    return [np.concatenate(h) for h in held]
'''),
        ("hidden", "joins the chunks with np.hstack, right only for 1-D chunks", '''
def ring_all_gather(chunks, send):
    n = len(chunks)
    held = [{i: chunks[i]} for i in range(n)]
    for j in range(1, n):
        for i in range(n):
            c = (i - j + 1) % n
            held[(i + 1) % n][c] = send(i, (i + 1) % n, held[i][c])
    return [np.hstack([h[c] for c in range(n)]) for h in held]
'''),
        ("hidden", "assumes 4 devices: always 3 steps", '''
def ring_all_gather(chunks, send):
    n = len(chunks)
    held = [{i: chunks[i]} for i in range(n)]
    for j in range(1, 4):
        for i in range(n):
            c = (i - j + 1) % n
            held[(i + 1) % n][c] = send(i, (i + 1) % n, held[i][c])
    return [np.concatenate([h[c] for c in range(n)]) for h in held]
'''),
        ("visible", "calls the course library's ring_all_gather_np", '''
from intralayer.collectives import ring_all_gather_np

def ring_all_gather(chunks, send):
    return ring_all_gather_np(chunks).result
'''),
    ],
    "uneven_all_to_all": [
        ("visible", "counts the block a device keeps for itself as sent", '''
def uneven_all_to_all(data, counts):
    n = len(data)
    pieces = [np.split(data[i], np.cumsum(counts[i])[:-1]) for i in range(n)]
    received = [np.concatenate([pieces[i][j] for i in range(n)]) for j in range(n)]
    return received, [d.nbytes for d in data]
'''),
        ("visible", "counts 8 bytes a row, forgetting a row holds several numbers", '''
def uneven_all_to_all(data, counts):
    n = len(data)
    pieces = [np.split(data[i], np.cumsum(counts[i])[:-1]) for i in range(n)]
    received = [np.concatenate([pieces[i][j] for i in range(n)]) for j in range(n)]
    sent = [sum(8 * len(pieces[i][j]) for j in range(n) if j != i) for i in range(n)]
    return received, sent
'''),
        ("visible", "counts rows sent, not bytes", '''
def uneven_all_to_all(data, counts):
    n = len(data)
    pieces = [np.split(data[i], np.cumsum(counts[i])[:-1]) for i in range(n)]
    received = [np.concatenate([pieces[i][j] for i in range(n)]) for j in range(n)]
    sent = [sum(len(pieces[i][j]) for j in range(n) if j != i) for i in range(n)]
    return received, sent
'''),
        ("visible", "splits each device's rows into equal blocks, ignoring counts", '''
def uneven_all_to_all(data, counts):
    n = len(data)
    pieces = [np.array_split(data[i], n) for i in range(n)]
    received = [np.concatenate([pieces[i][j] for i in range(n)]) for j in range(n)]
    sent = [sum(pieces[i][j].nbytes for j in range(n) if j != i) for i in range(n)]
    return received, sent
'''),
        ("visible", "received[j] is what device j sends, not what it receives", '''
def uneven_all_to_all(data, counts):
    n = len(data)
    pieces = [np.split(data[i], np.cumsum(counts[i])[:-1]) for i in range(n)]
    received = [np.concatenate([pieces[j][i] for i in range(n)]) for j in range(n)]
    sent = [sum(pieces[i][j].nbytes for j in range(n) if j != i) for i in range(n)]
    return received, sent
'''),
        ("visible", "stacks the received rows last sender first", '''
def uneven_all_to_all(data, counts):
    n = len(data)
    pieces = [np.split(data[i], np.cumsum(counts[i])[:-1]) for i in range(n)]
    received = [np.concatenate([pieces[i][j] for i in reversed(range(n))]) for j in range(n)]
    sent = [sum(pieces[i][j].nbytes for j in range(n) if j != i) for i in range(n)]
    return received, sent
'''),
        ("visible", "calls the course library's all_to_all_np", '''
from intralayer.collectives import all_to_all_np

def uneven_all_to_all(data, counts):
    n = len(data)
    run = all_to_all_np([np.split(data[i], np.cumsum(counts[i])[:-1]) for i in range(n)])
    return [np.concatenate(r) for r in run.result], run.sent_bytes
'''),
    ],
    "crossover": [
        ("visible", "forgets the bus factor", '''
def crossover_bytes(op, n, alpha, bandwidth):
    return steps(op, n) * alpha * bandwidth
'''),
        ("visible", "counts one latency, not one per step", '''
def crossover_bytes(op, n, alpha, bandwidth):
    return alpha * bandwidth / bus_factor(op, n)
'''),
        ("visible", "multiplies by the bus factor instead of dividing", '''
def crossover_bytes(op, n, alpha, bandwidth):
    return steps(op, n) * alpha * bandwidth * bus_factor(op, n)
'''),
        ("visible", "n - 1 steps for every collective (an all-reduce takes 2(n - 1))", '''
def crossover_bytes(op, n, alpha, bandwidth):
    return (n - 1) * alpha * bandwidth / bus_factor(op, n)
'''),
        ("visible", "solves for one device's chunk S/n, not the message S", '''
def crossover_bytes(op, n, alpha, bandwidth):
    return steps(op, n) * alpha * bandwidth / bus_factor(op, n) / n
'''),
        ("visible", "returns MiB, not bytes", '''
def crossover_bytes(op, n, alpha, bandwidth):
    return steps(op, n) * alpha * bandwidth / bus_factor(op, n) / 2**20
'''),
        ("visible", "calls the course library's comm.bus_factor", '''
from intralayer import comm

def crossover_bytes(op, n, alpha, bandwidth):
    return steps(op, n) * alpha * bandwidth / comm.bus_factor(op, n)
'''),
    ],
}

# Right answers written differently from the solution: the checks must accept them.
RIGHT = {
    "bus_factor": [("if/elif, one phase counted once", '''
def bus_factor(op, n):
    if op == "all_reduce":
        return 2 * (n - 1) / n
    elif op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    raise ValueError(f"unknown collective {op!r}")
''')],
    "ring_all_gather": [("devices visited in reverse order within each step, result from received copies", '''
def ring_all_gather(chunks, send):
    n = len(chunks)
    held = [[None] * n for _ in range(n)]
    for i in range(n):
        held[i][i] = chunks[i]
    for j in range(n - 1):
        for i in reversed(range(n)):
            c = (i - j) % n
            held[(i + 1) % n][c] = send(i, (i + 1) % n, held[i][c])
    return [np.concatenate(h, axis=0) for h in held]
''')],
    "uneven_all_to_all": [("explicit offsets", '''
def uneven_all_to_all(data, counts):
    n = len(data)
    received = [[] for _ in range(n)]
    sent = [0] * n
    for i in range(n):
        start = 0
        for j in range(n):
            rows = data[i][start:start + counts[i][j]]
            start += counts[i][j]
            received[j].append(rows)
            if j != i:
                sent[i] += rows.nbytes
    return [np.concatenate(r) for r in received], sent
''')],
    "crossover": [("the closed form n·α·bandwidth (steps / bus factor is n for every collective)", '''
def crossover_bytes(op, n, alpha, bandwidth):
    return n * alpha * bandwidth
''')],
}
