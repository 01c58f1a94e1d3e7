"""Plausible wrong answers to solutions/01_split_matmul.ipynb (see tests/test_wrong_answers.py).

WRONG[grade_id] lists (part of the check that must catch it, what is wrong, [the exercises whose
checks fail too because they build on this one,] the whole exercise cell).
"""

ROW_QUESTION = '''

def row_communication():
    return {"Y"}
'''

ROW_PARALLEL = '''def row_parallel(X_parts, A_parts, dY):
    Y = sum(x @ a for x, a in zip(X_parts, A_parts))
    return Y, [dY @ a.T for a in A_parts], [x.T @ dY for x in X_parts]
'''

F_AND_G = '''
class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t):
        return {f_forward}

    @staticmethod
    def backward(ctx, *grads):
        return {f_backward}


class G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *partials):
        ctx.n = len(partials)
        return {g_forward}

    @staticmethod
    def backward(ctx, grad):
        return {g_backward}
'''
RIGHT = dict(f_forward="tuple(x.clone() for _ in range(t))", f_backward="sum(grads), None",
             g_forward="sum(partials)", g_backward="(grad,) * ctx.n")


def f_and_g(**wrong):
    return F_AND_G.format(**{**RIGHT, **wrong})


SPLIT_COSTS = '''
def split_costs(m, h_in, h_out, t, split, itemsize=2):
    if split not in ("column", "row"):
        raise ValueError(f"split must be 'column' or 'row', got {{split!r}}")
    {check}
    ring = {ring}
    weights = {weights}
    if split == "column":
        return dict(weights=weights, forward_sent=0.0, backward_sent={column_backward})
    return dict(weights=weights, forward_sent={row_forward}, backward_sent=0.0)
'''
COSTS = dict(check='''dim = h_out if split == "column" else h_in
    if dim % t:
        raise ValueError(f"{dim} is not divisible by t={t}")''',
             ring="2 * (t - 1) / t", weights="h_in * h_out // t * itemsize",
             column_backward="ring * m * h_in * itemsize", row_forward="ring * m * h_out * itemsize")


def split_costs(**wrong):
    fields = {**COSTS, **wrong}
    fields["check"] = fields["check"].replace("{", "{{").replace("}", "}}")
    return SPLIT_COSTS.format(**fields).replace("{{", "{").replace("}}", "}")


WRONG = {
    "column_backward": [
        ("visible", "X̄ from one device only: forgets f's all-reduce", '''
def column_backward(X, A_parts, dY_parts):
    return dY_parts[0] @ A_parts[0].T, [X.T @ dY for dY in dY_parts]
'''),
        ("visible", "averages the devices' contributions to X̄", '''
def column_backward(X, A_parts, dY_parts):
    dX = sum(dY @ A.T for dY, A in zip(dY_parts, A_parts)) / len(A_parts)
    return dX, [X.T @ dY for dY in dY_parts]
'''),
        ("visible", "stacks the contributions to X̄ side by side instead of adding them", '''
def column_backward(X, A_parts, dY_parts):
    dX = np.concatenate([dY @ A.T for dY, A in zip(dY_parts, A_parts)], axis=1)
    return dX, [X.T @ dY for dY in dY_parts]
'''),
        ("visible", "transposed weight gradients Ȳ_iᵀ X", '''
def column_backward(X, A_parts, dY_parts):
    dX = sum(dY @ A.T for dY, A in zip(dY_parts, A_parts))
    return dX, [dY.T @ X for dY in dY_parts]
'''),
        ("visible", "returns the weight gradient as one array, not a list per device", '''
def column_backward(X, A_parts, dY_parts):
    dX = sum(dY @ A.T for dY, A in zip(dY_parts, A_parts))
    return dX, X.T @ np.concatenate(dY_parts, axis=1)
'''),
        ("visible", "every device's Ā_i from the whole Ȳ", '''
def column_backward(X, A_parts, dY_parts):
    dX = sum(dY @ A.T for dY, A in zip(dY_parts, A_parts))
    full = np.concatenate(dY_parts, axis=1)
    return dX, [X.T @ full for _ in dY_parts]
'''),
    ],
    "row_parallel": [
        ("visible", "returns the partial products without the all-reduce", '''
def row_parallel(X_parts, A_parts, dY):
    return [x @ a for x, a in zip(X_parts, A_parts)], [dY @ a.T for a in A_parts], [x.T @ dY for x in X_parts]
''' + ROW_QUESTION),
        ("visible", "averages the partial products", '''
def row_parallel(X_parts, A_parts, dY):
    Y = sum(x @ a for x, a in zip(X_parts, A_parts)) / len(X_parts)
    return Y, [dY @ a.T for a in A_parts], [x.T @ dY for x in X_parts]
''' + ROW_QUESTION),
        ("visible", "X̄_i scaled by 1/t, as if Ȳ were split", '''
def row_parallel(X_parts, A_parts, dY):
    t = len(X_parts)
    Y = sum(x @ a for x, a in zip(X_parts, A_parts))
    return Y, [dY @ a.T / t for a in A_parts], [x.T @ dY for x in X_parts]
''' + ROW_QUESTION),
        ("visible", "says the backward needs an all-reduce too, as in the column split", ROW_PARALLEL + '''

def row_communication():
    return {"Y", "dX"}
'''),
        ("visible", "says nothing needs communication", ROW_PARALLEL + '''

def row_communication():
    return set()
'''),
        ("visible", "answers with a string, not a set", ROW_PARALLEL + '''

def row_communication():
    return "Y"
'''),
        ("visible", "says only the gradients need communication", ROW_PARALLEL + '''

def row_communication():
    return {"dX", "dA"}
'''),
    ],
    "f_and_g": [
        ("visible", "F's backward keeps rank 0's gradient only (no all-reduce)", f_and_g(f_backward="grads[0], None")),
        ("visible", "F's backward averages the ranks' gradients", f_and_g(f_backward="sum(grads) / len(grads), None")),
        ("visible", "G's backward divides the gradient among the ranks", f_and_g(g_backward="(grad / ctx.n,) * ctx.n")),
        ("visible", "G's backward returns one gradient, not one per partial", f_and_g(g_backward="grad")),
        ("visible", "F's backward forgets the None for t", f_and_g(f_backward="sum(grads)")),
        ("visible", "G's forward averages the partials", f_and_g(g_forward="sum(partials) / ctx.n")),
        ("visible", "F's forward returns x itself, not a tuple of copies", f_and_g(f_forward="x")),
    ],
    "split_costs": [
        ("visible", "checks the wrong dimension (h_in for a column split)",
         split_costs(check='''dim = h_in if split == "column" else h_out
    if dim % t:
        raise ValueError(f"{dim} is not divisible by t={t}")''')),
        ("visible", "requires both dimensions divisible",
         split_costs(check='''if h_in % t or h_out % t:
        raise ValueError(f"{h_in} or {h_out} is not divisible by t={t}")''')),
        ("visible", "never raises ValueError", split_costs(check="pass")),
        ("visible", "forgets the element size in the weights", split_costs(weights="h_in * h_out // t")),
        ("visible", "forgets the (t - 1)/t factor", split_costs(ring="2")),
        ("visible", "one phase (t - 1)/t, as for an all-gather", split_costs(ring="(t - 1) / t")),
        ("visible", "column backward sends Ȳ's width h_out, not X̄'s h_in",
         split_costs(column_backward="ring * m * h_out * itemsize")),
        ("visible", "weights not divided by t", split_costs(weights="h_in * h_out * itemsize")),
        ("visible", "2-byte numbers whatever itemsize says",
         split_costs(weights="h_in * h_out // t * 2", column_backward="ring * m * h_in * 2",
                     row_forward="ring * m * h_out * 2")),
        ("visible", "calls the course library's linear_costs", '''
from intralayer.tensor_parallel import linear_costs

def split_costs(m, h_in, h_out, t, split, itemsize=2):
    return linear_costs(m, h_in, h_out, t, split, itemsize=itemsize)
'''),
    ],
}

# Right answers written differently from the solution: the checks must accept them.
RIGHT = {
    "column_backward": [("the weight gradients as a tuple, X̄ with np.add.reduce", '''
def column_backward(X, A_parts, dY_parts):
    return np.add.reduce([dY @ A.T for dY, A in zip(dY_parts, A_parts)]), tuple(X.T @ dY for dY in dY_parts)
''')],
    "row_parallel": [("a frozenset answer", ROW_PARALLEL + '''

def row_communication():
    return frozenset({"Y"})
''')],
    "f_and_g": [("F returns x itself t times; stack-and-sum", '''
class F(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, t):
        return (x,) * t

    @staticmethod
    def backward(ctx, *grads):
        return torch.stack(grads).sum(0), None


class G(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *partials):
        ctx.n = len(partials)
        return torch.stack(partials).sum(0)

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad for _ in range(ctx.n))
''')],
    "split_costs": [("one formula for both splits", '''
def split_costs(m, h_in, h_out, t, split, itemsize=2):
    sizes = {"column": (h_out, h_in, "backward_sent"), "row": (h_in, h_out, "forward_sent")}
    if split not in sizes:
        raise ValueError(f"unknown split {split!r}")
    divided, reduced, key = sizes[split]
    if divided % t:
        raise ValueError(f"{divided} is not divisible by {t}")
    costs = {"weights": h_in * h_out * itemsize / t, "forward_sent": 0, "backward_sent": 0}
    costs[key] = 2 * (t - 1) / t * m * reduced * itemsize
    return costs
''')],
}
