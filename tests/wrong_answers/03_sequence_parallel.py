"""Plausible wrong answers to solutions/03_sequence_parallel.ipynb (see tests/test_wrong_answers.py).

WRONG[grade_id] lists (part of the check that must catch it, what is wrong, [the exercises whose
checks fail too because they build on this one,] the whole exercise cell).
"""

LAYER = '''
def layer_bytes(s, b, h, a):
    sbh, as2b = {sbh}, a * s * s * b
    attention = {attention}
    mlp = {mlp}
    layernorm = {layernorm}
    return {{"attention": attention, "mlp": mlp, "layernorm": layernorm}}
'''
RIGHT = dict(sbh="s * b * h", attention="2 * sbh + 4 * sbh + 2 * as2b + as2b + 2 * as2b + 2 * sbh + 2 * sbh + sbh",
             mlp="2 * sbh + 8 * sbh + 8 * sbh + sbh", layernorm="4 * sbh")


def layer(**wrong):
    return LAYER.format(**{**RIGHT, **wrong})


GATHER = '''
class GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *chunks):
        ctx.sizes = [c.shape[0] for c in chunks]
        full = torch.cat(chunks, dim=0)
        return {forward}

    @staticmethod
    def backward(ctx, *grads):
        {backward}
'''
GATHER_RIGHT = dict(forward="tuple(full.clone() for _ in chunks)",
                    backward="return tuple(sum(grads).split(ctx.sizes, dim=0))")


def gather(**wrong):
    return GATHER.format(**{**GATHER_RIGHT, **wrong})


METER = '''
def saved_activation_bytes(module, x):
    params = {{p.untyped_storage().data_ptr() for p in module.parameters()}}
    seen = {{}}

    def pack(t):
        st = t.untyped_storage()
        if {keep}:
            seen[{key}] = {size}
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())
'''
METER_RIGHT = dict(keep="st.data_ptr() not in params", key="st.data_ptr()", size="st.nbytes()")


def meter(**wrong):
    return METER.format(**{**METER_RIGHT, **wrong})


BATCH = '''
def max_microbatch(gpu_bytes, other_bytes, s, h, a, L, t, sp, recompute="none"):
    per_sample = {per_sample}
    return {result}
'''
BATCH_RIGHT = dict(per_sample="L * activation_bytes_per_layer(s, 1, h, a, t=t, sp=sp, recompute=recompute)",
                   result="max(0, int((gpu_bytes - other_bytes) // per_sample))")


def batch(**wrong):
    return BATCH.format(**{**BATCH_RIGHT, **wrong})


WRONG = {
    "layer_bytes": [
        ("visible", "forgets the dropout masks",
         layer(attention="2 * sbh + 4 * sbh + 2 * as2b + 2 * as2b + 2 * sbh + 2 * sbh", mlp="2 * sbh + 8 * sbh + 8 * sbh")),
        ("visible", "dropout masks of 2 bytes, like the activations",
         layer(attention="2 * sbh + 4 * sbh + 2 * as2b + 2 * as2b + 2 * as2b + 2 * sbh + 2 * sbh + 2 * sbh",
               mlp="2 * sbh + 8 * sbh + 8 * sbh + 2 * sbh")),
        ("visible", "the MLP's GeLU input counted h wide, not 4h", layer(mlp="2 * sbh + 2 * sbh + 8 * sbh + sbh")),
        ("visible", "forgets the LayerNorm inputs", layer(layernorm="0")),
        ("visible", "counts only the softmax output among the s² terms",
         layer(attention="2 * sbh + 4 * sbh + 2 * as2b + 2 * sbh + 2 * sbh + sbh")),
        ("visible", "forgets the micro-batch b", layer(sbh="s * h").replace("a * s * s * b", "a * s * s")),
        ("visible", "counts elements, not bytes",
         layer(attention="sbh + 2 * sbh + as2b + as2b + as2b + sbh + sbh + sbh", mlp="sbh + 4 * sbh + 4 * sbh + sbh",
               layernorm="2 * sbh")),
        ("visible", "takes the total from the course library and splits it", '''
from intralayer.memory import activation_bytes_per_layer as total_bytes

def layer_bytes(s, b, h, a):
    sbh = s * b * h
    return {"attention": total_bytes(s, b, h, a) - 23 * sbh, "mlp": 19 * sbh, "layernorm": 4 * sbh}
'''),
    ],
    "gather_sequence": [
        ("visible", "backward: each chunk's gradient from its own rank's copy only (no reduction)",
         gather(backward="return tuple(g.split(ctx.sizes, dim=0)[i] for i, g in enumerate(grads))")),
        ("visible", "backward averages the ranks' gradients", gather(backward="return tuple((sum(grads) / len(grads)).split(ctx.sizes, dim=0))")),
        ("visible", "backward returns the whole summed gradient for every chunk (no scatter)",
         gather(backward="return (sum(grads),) * len(grads)")),
        ("visible", "backward uses rank 0's gradient for everyone", gather(backward="return tuple(grads[0].split(ctx.sizes, dim=0))")),
        ("visible", "forward returns one tensor, not one copy per rank", gather(forward="full")),
        ("visible", "forward stacks the chunks along the wrong dimension",
         gather(forward="tuple(torch.cat(chunks, dim=1).clone() for _ in chunks)")),
    ],
    "saved_meter": [
        ("visible", "counts the parameters too", meter(keep="True")),
        ("visible", "counts each saved tensor's own bytes, not its storage", meter(size="t.numel() * t.element_size()")),
        ("visible", "counts every saved tensor, without removing duplicates",
         meter(key="len(seen)", size="st.nbytes()")),
        ("visible", "removes duplicates by the tensor's data pointer, not its storage's", meter(key="t.data_ptr()")),
        ("visible", "counts elements, not bytes", meter(size="st.nbytes() // 4")),
        ("visible", "calls the course library's saved_bytes", '''
from intralayer import memory

def saved_activation_bytes(module, x):
    with memory.saved_bytes(exclude=module.parameters()) as rep:
        module(x)
    return rep.total
'''),
    ],
    "max_microbatch": [
        ("visible", "forgets what weights, gradients and optimizer state take",
         batch(result="max(0, int(gpu_bytes // per_sample))")),
        ("visible", "forgets the number of layers",
         batch(per_sample="activation_bytes_per_layer(s, 1, h, a, t=t, sp=sp, recompute=recompute)")),
        ("visible", "at least 1 even when nothing fits", batch(result="max(1, int((gpu_bytes - other_bytes) // per_sample))")),
        ("visible", "negative when the other bytes exceed the GPU", batch(result="int((gpu_bytes - other_bytes) // per_sample)")),
        ("visible", "rounds up", batch(result="max(0, -int(-(gpu_bytes - other_bytes) // per_sample))")),
        ("visible", "ignores recompute", batch(per_sample="L * activation_bytes_per_layer(s, 1, h, a, t=t, sp=sp)")),
        ("visible", "ignores sequence parallelism",
         batch(per_sample="L * activation_bytes_per_layer(s, 1, h, a, t=t, sp=False, recompute=recompute)")),
    ],
}

# Right answers written differently from the solution: the checks must accept them.
RIGHT = {
    "layer_bytes": [("the paper's sums directly", '''
def layer_bytes(s, b, h, a):
    return {"attention": 11 * s * b * h + 5 * a * s * s * b, "mlp": 19 * s * b * h, "layernorm": 4 * s * b * h}
''')],
    "gather_sequence": [("backward with torch.stack and chunk", '''
class GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *chunks):
        ctx.t = len(chunks)
        return tuple(torch.cat(chunks) for _ in chunks)

    @staticmethod
    def backward(ctx, *grads):
        return torch.stack(grads).sum(0).chunk(ctx.t)
''')],
    "saved_meter": [("storages keyed by (pointer, size), parameters by identity of storage", '''
def saved_activation_bytes(module, x):
    params = {(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in module.parameters()}
    kept = set()

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in params:
            kept.add(key)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(size for _, size in kept)
''')],
    "max_microbatch": [("grows b until it no longer fits", '''
def max_microbatch(gpu_bytes, other_bytes, s, h, a, L, t, sp, recompute="none"):
    b = 0
    while L * activation_bytes_per_layer(s, b + 1, h, a, t=t, sp=sp, recompute=recompute) <= gpu_bytes - other_bytes:
        b += 1
    return b
''')],
}
