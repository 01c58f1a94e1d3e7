"""Plausible wrong answers to solutions/04_context_parallel.ipynb (see tests/test_wrong_answers.py).

WRONG[grade_id] lists (part of the check that must catch it, what is wrong, [the exercises whose
checks fail too because they build on this one,] the whole exercise cell).
"""

ZIGZAG = '''
def zigzag_positions(s, P, r):
    {check}
    c = s // (2 * P)
    return {result}
'''
ZIGZAG_RIGHT = dict(check='''if s % (2 * P):
        raise ValueError(f"{s} is not divisible by {2 * P}")''',
                    result="list(range(r * c, (r + 1) * c)) + list(range((2 * P - 1 - r) * c, (2 * P - r) * c))")


def zigzag(**wrong):
    fields = {**ZIGZAG_RIGHT, **wrong}
    return ZIGZAG.replace("{check}", fields["check"]).replace("{result}", fields["result"])


WORK = '''
def causal_work(s, P, layout):
    n = P if layout == "contiguous" else 2 * P
    c = {c}
    held = (lambda r: [r]) if layout == "contiguous" else (lambda r: {zig})
    everything = [j for r in range(P) for j in held(r)]
    return [sum({block} for i in held(r) for j in {seen} if {rule}) for r in range(P)]
'''
WORK_RIGHT = dict(c="s // n", zig="[r, 2 * P - 1 - r]", block="c * c", seen="everything", rule="i >= j")


def work(**wrong):
    return WORK.format(**{**WORK_RIGHT, **wrong})


TIMES = '''
def cp_times(s, P, heads, d, flops, bandwidth, itemsize=2):
    {check}
    compute = 4 * (s // P) * s * heads * d / flops
    move = {move}
    ring = {ring}
    ulysses = {ulysses}
    return {{"ring": ring, "ulysses": ulysses}}


def faster(s, P, heads, d, flops, bandwidth, itemsize=2):
    times = cp_times(s, P, heads, d, flops, bandwidth, itemsize)
    return {choice}
'''
TIMES_RIGHT = dict(check='''if s % P:
        raise ValueError(f"{{s}} is not divisible by {{P}}")''',
                   move="2 * (s // P) * heads * d * itemsize / bandwidth",
                   ring="(P - 1) * max(compute / P, move) + compute / P",
                   ulysses="None if heads % P else compute + 4 * (P - 1) / P * (s // P) * heads * d * itemsize / bandwidth",
                   choice='"ring" if times["ulysses"] is None or times["ring"] <= times["ulysses"] else "ulysses"')


def times(**wrong):
    return TIMES.format(**{**TIMES_RIGHT, **wrong})


WRONG = {
    "merge": [
        ("visible", "naive np.exp of each log-sum-exp: overflows for scores in the thousands", '''
def merge(o1, l1, o2, l2):
    e1, e2 = np.exp(l1), np.exp(l2)
    w1, w2 = e1 / (e1 + e2), e2 / (e1 + e2)
    return w1[:, None] * o1 + w2[:, None] * o2, np.log(e1 + e2)
'''),
        ("visible", "adds the two outputs without weights", '''
def merge(o1, l1, o2, l2):
    return o1 + o2, np.logaddexp(l1, l2)
'''),
        ("visible", "averages the two outputs", '''
def merge(o1, l1, o2, l2):
    return (o1 + o2) / 2, np.logaddexp(l1, l2)
'''),
        ("visible", "keeps the larger log-sum-exp as the new one", '''
def merge(o1, l1, o2, l2):
    l = np.logaddexp(l1, l2)
    with np.errstate(invalid="ignore"):
        w1 = np.where(np.isfinite(l), np.exp(l1 - l), 0.0)
        w2 = np.where(np.isfinite(l), np.exp(l2 - l), 0.0)
    return w1[:, None] * o1 + w2[:, None] * o2, np.maximum(l1, l2)
'''),
        ("visible", "adds the log-sum-exps", '''
def merge(o1, l1, o2, l2):
    l = np.logaddexp(l1, l2)
    with np.errstate(invalid="ignore"):
        w1 = np.where(np.isfinite(l), np.exp(l1 - l), 0.0)
        w2 = np.where(np.isfinite(l), np.exp(l2 - l), 0.0)
    return w1[:, None] * o1 + w2[:, None] * o2, l1 + l2
'''),
        ("visible", "stable weights, but NaN for a row that saw no key at all", '''
def merge(o1, l1, o2, l2):
    m = np.maximum(l1, l2)
    w1, w2 = np.exp(l1 - m), np.exp(l2 - m)
    return (w1[:, None] * o1 + w2[:, None] * o2) / (w1 + w2)[:, None], m + np.log(w1 + w2)
'''),
        ("visible", "swaps the two weights", '''
def merge(o1, l1, o2, l2):
    l = np.logaddexp(l1, l2)
    with np.errstate(invalid="ignore"):
        w1 = np.where(np.isfinite(l), np.exp(l1 - l), 0.0)
        w2 = np.where(np.isfinite(l), np.exp(l2 - l), 0.0)
    return w2[:, None] * o1 + w1[:, None] * o2, l
'''),
    ],
    "zigzag": [
        ("visible", "never raises ValueError", zigzag(check="pass")),
        ("visible", "checks s % P instead of s % 2P", zigzag(check='''if s % P:
        raise ValueError(f"{s} is not divisible by {P}")''')),
        ("visible", "second chunk 2P - r, off by one",
         zigzag(result="list(range(r * c, (r + 1) * c)) + list(range((2 * P - r) * c, (2 * P - r + 1) * c))")),
        ("visible", "chunks r and P + r (striped, not mirrored)",
         zigzag(result="list(range(r * c, (r + 1) * c)) + list(range((P + r) * c, (P + r + 1) * c))")),
        ("visible", "returns a NumPy array, not a list",
         zigzag(result="np.r_[r * c:(r + 1) * c, (2 * P - 1 - r) * c:(2 * P - r) * c]")),
        ("visible", "P chunks of s/P (contiguous layout)", zigzag(result="list(range(r * 2 * c, (r + 1) * 2 * c))")),
        ("visible", "asserts instead of raising ValueError", zigzag(check='assert s % (2 * P) == 0, "2P must divide s"')),
    ],
    "causal_work": [
        ("visible", "a zigzag schedule of all zeros", '''
def causal_work(s, P, layout):
    if layout == "zigzag":
        return [0] * P
    c = s // P
    return [(r + 1) * c * c for r in range(P)]
'''),
        ("visible", "skips the diagonal blocks (i > j)", work(rule="i > j")),
        ("visible", "zigzag chunks of s/P, not s/2P", work(c="s // P")),
        ("visible", "counts blocks, not scores", work(block="1")),
        ("visible", "only the pairs of a device's own chunks", work(seen="held(r)")),
        ("visible", "zigzag gives device r chunks r and P + r", work(zig="[r, P + r]")),
        ("visible", "zigzag as even shares of the contiguous total", '''
def causal_work(s, P, layout):
    c = s // P
    contiguous = [(r + 1) * c * c for r in range(P)]
    return contiguous if layout == "contiguous" else [sum(contiguous) // P] * P
'''),
        ("hidden", "a table of the visible check's answers", '''
def causal_work(s, P, layout):
    known = {(32, 4, "contiguous"): [64, 128, 192, 256], (32, 4, "zigzag"): [144] * 4,
             (24, 3, "contiguous"): [64, 128, 192], (24, 3, "zigzag"): [112] * 3}
    return known.get((s, P, layout), [0] * P)
'''),
        ("visible", "calls the course library's work_per_rank", '''
from intralayer import context_parallel as cp

def causal_work(s, P, layout):
    return cp.work_per_rank(s, P, layout, True)
'''),
    ],
    "faster": [
        ("visible", "the ring hides every transfer (time = compute)", times(ring="compute")),
        ("visible", "the ring overlaps nothing (compute + P - 1 transfers)", times(ring="compute + (P - 1) * move")),
        ("visible", "the ring's last step waits for a transfer too", times(ring="P * max(compute / P, move)")),
        ("visible", "moves one block (K only), not K and V", times(move="(s // P) * heads * d * itemsize / bandwidth")),
        ("visible", "Ulysses forgets the (P - 1)/P factor",
         times(ulysses="None if heads % P else compute + 4 * (s // P) * heads * d * itemsize / bandwidth")),
        ("visible", "Ulysses with two all-to-alls, not four",
         times(ulysses="None if heads % P else compute + 2 * (P - 1) / P * (s // P) * heads * d * itemsize / bandwidth")),
        ("visible", "forgets the element size", times(
            move="2 * (s // P) * heads * d / bandwidth",
            ulysses="None if heads % P else compute + 4 * (P - 1) / P * (s // P) * heads * d / bandwidth")),
        ("visible", "Ulysses allowed whatever the heads",
         times(ulysses="compute + 4 * (P - 1) / P * (s // P) * heads * d * itemsize / bandwidth",
               choice='"ring" if times["ring"] <= times["ulysses"] else "ulysses"')),
        ("visible", "a tie goes to Ulysses",
         times(choice='"ring" if times["ulysses"] is None or times["ring"] < times["ulysses"] else "ulysses"')),
        ("visible", "never raises ValueError: s / P tokens may be fractional", times(check="pass").replace("s // P", "s / P")),
    ],
}

# Right answers written differently from the solution: the checks must accept them.
RIGHT = {
    "merge": [("shift by the larger log-sum-exp, empty rows handled apart", '''
def merge(o1, l1, o2, l2):
    m = np.maximum(l1, l2)
    empty = np.isneginf(m)
    m = np.where(empty, 0.0, m)
    w1, w2 = np.exp(l1 - m), np.exp(l2 - m)
    total = w1 + w2
    safe = np.where(empty, 1.0, total)
    o = (w1[:, None] * o1 + w2[:, None] * o2) / safe[:, None]
    return o, np.where(empty, -np.inf, m + np.log(safe))
''')],
    "zigzag": [("np.arange and tolist", '''
def zigzag_positions(s, P, r):
    if s % (2 * P) != 0:
        raise ValueError(f"2P = {2 * P} does not divide s = {s}")
    c = s // (2 * P)
    return np.concatenate([np.arange(r * c, (r + 1) * c), np.arange((2 * P - 1 - r) * c, (2 * P - r) * c)]).tolist()
''')],
    "causal_work": [("blocks counted by formula", '''
def causal_work(s, P, layout):
    if layout == "contiguous":
        c = s / P
        return [(r + 1) * c * c for r in range(P)]
    c = s / (2 * P)
    return [((r + 1) + (2 * P - r)) * c * c for r in range(P)]
''')],
    "faster": [("real division s / P, and faster compares its own numbers", '''
def cp_times(s, P, heads, d, flops, bandwidth, itemsize=2):
    if s % P != 0:
        raise ValueError(f"P = {P} does not divide s = {s}")
    step = 4 * (s / P) * s * heads * d / flops / P
    kv = 2 * (s / P) * heads * d * itemsize / bandwidth
    ring = (P - 1) * max(step, kv) + step
    if heads % P:
        return {"ring": ring, "ulysses": None}
    return {"ring": ring, "ulysses": P * step + 4 * (P - 1) / P * (s / P) * heads * d * itemsize / bandwidth}


def faster(s, P, heads, d, flops, bandwidth, itemsize=2):
    times = cp_times(s, P, heads, d, flops, bandwidth, itemsize)
    if times["ulysses"] is not None and times["ulysses"] < times["ring"]:
        return "ulysses"
    return "ring"
''')],
}
