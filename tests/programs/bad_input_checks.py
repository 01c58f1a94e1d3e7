"""Bad input to every parallel module and function: a ValueError before any collective.

The table of cases lives here so that tests/test_bad_input.py runs it on one rank (a
1-rank gloo group in the test process) and this program runs it on every rank of a real
group (``launch.run("tests.programs.bad_input_checks", 2)``), where an input that got
past its check would leave the peer waiting in a collective. :func:`world_cases` adds
the rules that only bite with more than one rank (the slice a row-parallel layer takes,
heads for Ulysses, 2P chunks for zigzag, experts over ranks …).

Each case is ``(fn, words)``: ``fn()`` must raise ValueError whose message holds every
one of ``words`` (who raised it, the argument, what was expected, what came), with no
collective recorded before it (:func:`tests.programs.checks.raises`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
import torch.nn as nn

from intralayer import context_parallel as cp
from intralayer import distributed, model, overlap
from intralayer import expert_parallel as ep
from intralayer import sequence_parallel as sp
from intralayer import tensor_parallel as tp
from intralayer.moe import MoELayer, topk_route
from tests.programs.checks import close, expect, raises

MARKER = "bad input: all refused before any collective on"

S, B, H, HEADS, FFN, T, VOCAB = 4, 2, 16, 4, 8, 6, 32
NEVER_DROPS = 1e6                 # a capacity factor no expert overflows

#: bad versions of a good floating-point input, by kind
KINDS = ("wrong last dim", "too few dims", "too many dims", "float64", "bfloat16", "int64", "meta", "not a tensor")
#: and for the modules that take only (s, b, h): the (s·b, h) a 2-D layer would take
TWO_D = "two dims"


def bad(good: torch.Tensor, kind: str):
    """``good`` spoilt one way: its last dimension, its dimensions, its dtype or its device."""
    if kind == "wrong last dim":
        return torch.randn(*good.shape[:-1], good.shape[-1] + 1)
    if kind == "too few dims":
        return good.flatten()
    if kind == TWO_D:
        return good.flatten(0, 1)
    if kind == "too many dims":
        return good.unsqueeze(0)
    if kind == "float64":
        return good.double()
    if kind == "bfloat16":
        return good.bfloat16()
    if kind == "int64":
        return torch.ones(good.shape, dtype=torch.int64)
    if kind == "meta":
        return good.to("meta")
    if kind == "not a tensor":
        return good.tolist()
    raise KeyError(kind)


def _shape(x) -> str:
    """A tensor's shape as the messages write it: ``(4, 2, 16)``."""
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else ""


def _last(x) -> str:
    """A tensor's last dimension, as a number in a message."""
    return str(x.shape[-1]) if isinstance(x, torch.Tensor) and x.dim() else ""


def _size(x) -> str:
    """``torch.Size([4, 2, 16])``, as the context-parallel checks write it."""
    return str(x.shape) if isinstance(x, torch.Tensor) else ""


# ---------------------------------------------------------------------------- what each family says

def _module_words(who, width, dims):
    """Modules checked by model.check_shape and the weights' dtype and device."""
    def words(kind, x):
        return {"wrong last dim": [who, f"last of size {width}", _shape(x)],
                "too few dims": [who, dims, _shape(x)],
                TWO_D: [who, dims, _shape(x)],
                "too many dims": [who, dims, _shape(x)],
                "float64": [who, "torch.float64", "torch.float32"],
                "bfloat16": [who, "torch.bfloat16", "torch.float32"],
                "int64": [who, "floating-point", "torch.int64"],
                "meta": [who, "meta", "cpu"],
                "not a tensor": [who, "torch.Tensor", "list"]}[kind]
    return words


def _token_words(who, width):
    """MoE layers: tokens ``(T, h)`` on the router weight's dtype and device."""
    def words(kind, x):
        return {"wrong last dim": [who, "x", f"(T, {width})", _shape(x)],
                "too few dims": [who, "x", f"(T, {width})", _shape(x)],
                "too many dims": [who, "x", f"(T, {width})", _shape(x)],
                "float64": [who, "x", "torch.float64", "torch.float32"],
                "bfloat16": [who, "x", "torch.bfloat16", "torch.float32"],
                "int64": [who, "x", "floating-point", "torch.int64"],
                "meta": [who, "x", "meta", "cpu"],
                "not a tensor": [who, "x", "list"]}[kind]
    return words


def _kv_words(who):
    """Attention over a split sequence, a bad k beside good q and v."""
    def words(kind, x):
        return {"wrong last dim": [who, "same shape", _shape(x)],
                "too few dims": [who, "k must be", "(b, heads, s_local, d)", _size(x)],
                "too many dims": [who, "k must be", "(b, heads, s_local, d)", _size(x)],
                "float64": [who, "share dtype", "k torch.float64", "q torch.float32"],
                "bfloat16": [who, "share dtype", "k torch.bfloat16", "q torch.float32"],
                "int64": [who, "k must be a floating-point", "torch.int64"],
                "meta": [who, "device", "k torch.float32 on meta", "q torch.float32 on cpu"],
                "not a tensor": [who, "k must be", "list"]}[kind]
    return words


def _matmul_words(who, width):
    """The overlapped matmuls: x against a (out, in) weight."""
    def words(kind, x):
        return {"wrong last dim": [who, f"last dimension {width + 1}", f"in_features {width}"],
                "too few dims": [who, f"last dimension {_last(x)}", f"in_features {width}"],
                "float64": [who, "x", "torch.float64", "torch.float32"],
                "bfloat16": [who, "x", "torch.bfloat16", "torch.float32"],
                "int64": [who, "x must be a floating-point", "torch.int64"],
                "meta": [who, "x", "meta", "cpu"],
                "not a tensor": [who, "x must be", "list"]}[kind]
    return words


def _mlp_words(kind, x):
    who = "mlp_microbatches"
    return {"wrong last dim": [who, "x", f"last dimension of size {H}", "fc1's in_features", _shape(x)],
            "too few dims": [who, "x", "at least 2 dimensions", _shape(x)],
            "float64": [who, "x", "torch.float64", "fc1", "torch.float32"],
            "bfloat16": [who, "x", "torch.bfloat16", "fc1", "torch.float32"],
            "int64": [who, "x must be a floating-point", "torch.int64"],
            "meta": [who, "x", "meta", "cpu"],
            "not a tensor": [who, "x", "torch.Tensor", "list"]}[kind]


# ---------------------------------------------------------------------------- the targets

_ALL, _ONLY_3D = KINDS, KINDS + (TWO_D,)
_MATMUL = tuple(k for k in KINDS if k != "too many dims")          # a leading dimension of 1 is fine there

#: every target and the bad kinds of input it is given
TARGET_KINDS = {
    "ColumnParallelLinear": _ALL, "ColumnParallelLinear(gather_output)": _ALL, "RowParallelLinear": _ALL,
    "RowParallelLinear(input_is_parallel=False)": _ALL, "ParallelMLP": _ALL, "ParallelAttention": _ONLY_3D,
    "ParallelBlock": _ONLY_3D, "ParallelBlock(sequence_parallel)": _ONLY_3D,
    "ParallelBlock(sequence_parallel=False)": _ONLY_3D, "SequenceParallelColumnLinear": _ONLY_3D,
    "SequenceParallelRowLinear": _ONLY_3D, "MoELayer": _ALL, "ExpertParallelMoE": _ALL, "timed_forward": _ALL,
    "hierarchical_forward": _ALL, "ring_attention": _ALL, "ring_attention(zigzag, causal)": _ALL,
    "ulysses_attention": _ALL, "allgather_matmul": _MATMUL, "matmul_reduce_scatter": _MATMUL,
    "mlp_microbatches": _MATMUL,
}
GRID = tuple((target, kind) for target, kinds in TARGET_KINDS.items() for kind in kinds)


def targets(n: int, group):
    """name → (good input, call(x), words(kind, x)): built inside the process group."""
    torch.manual_seed(0)
    col = tp.ColumnParallelLinear.from_dense(nn.Linear(H, 2 * H), group)
    col_gather = tp.ColumnParallelLinear.from_dense(nn.Linear(H, 2 * H), group, gather_output=True)
    row = tp.RowParallelLinear.from_dense(nn.Linear(2 * H, H), group)
    row_full = tp.RowParallelLinear.from_dense(nn.Linear(2 * H, H), group, input_is_parallel=False)
    mlp = tp.ParallelMLP.from_dense(nn.Linear(H, 4 * H), nn.Linear(4 * H, H), group)
    attn = tp.ParallelAttention.from_dense(model.Attention(H, HEADS), group)
    block = tp.ParallelBlock.from_dense(model.Block(H, HEADS), group)
    sp_block = sp.ParallelBlock.from_dense(model.Block(H, HEADS), group, sequence_parallel=True)
    sp_off = sp.ParallelBlock.from_dense(model.Block(H, HEADS), group, sequence_parallel=False)
    sp_col = sp.SequenceParallelColumnLinear.from_dense(nn.Linear(H, 2 * H), group)
    sp_row = sp.SequenceParallelRowLinear.from_dense(nn.Linear(2 * H, H), group)
    dense_moe = MoELayer(H, FFN, 2 * n, 2, NEVER_DROPS)
    ep_moe = ep.ExpertParallelMoE.from_dense(dense_moe, group)
    q = torch.randn(1, HEADS, 2, 4)                                   # (b, heads, s_local, d)
    W = torch.randn(2 * H, H)
    fc1, fc2 = torch.randn(FFN, H), torch.randn(H, FFN)

    seq, slice_, wide = torch.randn(S, B, H), torch.randn(S, B, 2 * H // n), torch.randn(S, B, 2 * H)
    local = torch.randn(S // n, B, H)
    t = {
        "ColumnParallelLinear": (seq, col, _module_words("ColumnParallelLinear", H, "2 dimensions or 3 dimensions")),
        "ColumnParallelLinear(gather_output)": (seq, col_gather, _module_words(
            "ColumnParallelLinear", H, "2 dimensions or 3 dimensions")),
        "RowParallelLinear": (slice_, row, _module_words("RowParallelLinear", 2 * H // n,
                                                         "2 dimensions or 3 dimensions")),
        "RowParallelLinear(input_is_parallel=False)": (wide, row_full, _module_words(
            "RowParallelLinear", 2 * H, "2 dimensions or 3 dimensions")),
        "ParallelMLP": (seq, mlp, _module_words("ParallelMLP", H, "2 dimensions or 3 dimensions")),
        "ParallelAttention": (seq, attn, _module_words("ParallelAttention", H, "3 dimensions")),
        "ParallelBlock": (seq, block, _module_words("ParallelBlock", H, "3 dimensions")),
        "ParallelBlock(sequence_parallel)": (local, sp_block, _module_words("ParallelBlock", H, "3 dimensions")),
        "ParallelBlock(sequence_parallel=False)": (seq, sp_off, _module_words("ParallelBlock", H, "3 dimensions")),
        "SequenceParallelColumnLinear": (local, sp_col, _module_words("SequenceParallelColumnLinear", H,
                                                                      "3 dimensions")),
        "SequenceParallelRowLinear": (slice_, sp_row, _module_words("SequenceParallelRowLinear", 2 * H // n,
                                                                    "3 dimensions")),
        "MoELayer": (torch.randn(T, H), dense_moe, _token_words("MoELayer", H)),
        "ExpertParallelMoE": (torch.randn(T, H), ep_moe, _token_words("ExpertParallelMoE", H)),
        "timed_forward": (torch.randn(T, H), lambda x: ep.timed_forward(ep_moe, x, 2),
                          _token_words("timed_forward", H)),
        "hierarchical_forward": (torch.randn(T, H), lambda x: ep.hierarchical_forward(ep_moe, x, 1),
                                 _token_words("hierarchical_forward", H)),
        "ring_attention": (q, lambda k: cp.ring_attention(q, k, q, group), _kv_words("ring_attention")),
        "ring_attention(zigzag, causal)": (q, lambda k: cp.ring_attention(q, k, q, group, True, "zigzag"),
                                           _kv_words("ring_attention")),
        "ulysses_attention": (q, lambda k: cp.ulysses_attention(q, k, q, group, True),
                              _kv_words("ulysses_attention")),
        "allgather_matmul": (torch.randn(4, H), lambda x: overlap.allgather_matmul(x, W, group, 2),
                             _matmul_words("allgather_matmul", H)),
        "matmul_reduce_scatter": (torch.randn(4 * n, H), lambda x: overlap.matmul_reduce_scatter(x, W, group, 2),
                                  _matmul_words("matmul_reduce_scatter", H)),
        "mlp_microbatches": (torch.randn(4, H), lambda x: overlap.mlp_microbatches(x, fc1, fc2, group, True, 2),
                             _mlp_words),
    }
    return t


def case(built: dict, target: str, kind: str) -> tuple:
    """``(fn, words)`` for one target given one bad kind of input."""
    good, call, words = built[target]
    x = bad(good, kind)
    return (lambda: call(x)), words(kind, x)


def grid(n: int, group) -> dict[str, tuple]:
    """Every target × every bad kind it takes: ``"target: kind" → (fn, words)``."""
    built = targets(n, group)
    expect(set(built) == set(TARGET_KINDS), f"targets built {sorted(built)} are not those listed")
    return {f"{target}: {kind}": case(built, target, kind) for target, kind in GRID}


#: the cases of :func:`extra_cases`, by name
EXTRA = (
    "ring_attention: q, k, v on meta",
    "ulysses_attention: q, k, v on meta",
    "allgather_matmul: x and weight on meta",
    "matmul_reduce_scatter: x and weight on meta",
    "mlp_microbatches: everything on meta",
    "unshard_sequence: on meta",
    "unshard_sequence: a list",
    "shard_sequence: a list",
    "mlp_microbatches: fc2 of the wrong width",
    "mlp_microbatches: float64 fc2",
    "mlp_microbatches: 1-D fc1",
    "allgather_matmul: float64 weight",
    "topk_route: bias of the wrong length",
    "topk_route: one bias for all experts",
    "topk_route: integer bias",
    "topk_route: bias on meta",
    "topk_route: logits on meta",
    "topk_route: 3-D logits",
    "topk_route: integer logits",
    "ExpertParallelMoE: bias of the wrong length",
    "VocabParallelEmbedding: float ids",
    "VocabParallelEmbedding: ids on meta",
    "VocabParallelEmbedding: a list",
    "vocab_parallel_cross_entropy: integer logits",
    "vocab_parallel_cross_entropy: targets a list",
    "vocab_parallel_cross_entropy: targets on meta",
    "vocab_parallel_cross_entropy: logits and targets on meta",
    "vocab_parallel_cross_entropy: float targets",
)

def extra_cases(n: int, group) -> dict[str, tuple]:
    """Bad arguments beside the main input, and inputs that only a process group can refuse."""
    torch.manual_seed(1)
    q = torch.randn(1, HEADS, 2, 4)
    meta_q = q.to("meta")
    W = torch.randn(2 * H, H)
    fc1, fc2 = torch.randn(FFN, H), torch.randn(H, FFN)
    logits = torch.randn(T, 2 * n)
    emb = tp.VocabParallelEmbedding.from_dense(nn.Embedding(VOCAB, H), group)
    vocab_logits, targets_ = torch.randn(S, B, VOCAB // n), torch.randint(0, VOCAB, (S, B))
    ep_moe = ep.ExpertParallelMoE.from_dense(MoELayer(H, FFN, 2 * n, 2, NEVER_DROPS), group)
    cases = {
        # every shard on meta: consistent with each other, but no backend sends them
        "ring_attention: q, k, v on meta": (lambda: cp.ring_attention(meta_q, meta_q, meta_q, group),
                                            ["ring_attention", "q is on meta", "process group"]),
        "ulysses_attention: q, k, v on meta": (lambda: cp.ulysses_attention(meta_q, meta_q, meta_q, group),
                                               ["ulysses_attention", "q is on meta", "process group"]),
        "allgather_matmul: x and weight on meta": (
            lambda: overlap.allgather_matmul(torch.randn(4, H, device="meta"), W.to("meta"), group, 2),
            ["allgather_matmul", "x is on meta", "process group"]),
        "matmul_reduce_scatter: x and weight on meta": (
            lambda: overlap.matmul_reduce_scatter(torch.randn(4 * n, H, device="meta"), W.to("meta"), group, 2),
            ["matmul_reduce_scatter", "x is on meta", "process group"]),
        "mlp_microbatches: everything on meta": (
            lambda: overlap.mlp_microbatches(torch.randn(4, H, device="meta"), fc1.to("meta"), fc2.to("meta"),
                                             group, True, 2),
            ["mlp_microbatches", "x is on meta", "process group"]),
        "unshard_sequence: on meta": (lambda: cp.unshard_sequence(q.to("meta"), 2, group),
                                      ["unshard_sequence", "x_local is on meta", "process group"]),
        "unshard_sequence: a list": (lambda: cp.unshard_sequence(q.tolist(), 2, group),
                                     ["unshard_sequence", "x_local must be a torch.Tensor", "list"]),
        "shard_sequence: a list": (lambda: cp.shard_sequence(q.tolist(), 2, group),
                                   ["shard_sequence", "x must be a torch.Tensor", "list"]),
        # the other arguments
        "mlp_microbatches: fc2 of the wrong width": (
            lambda: overlap.mlp_microbatches(torch.randn(4, H), fc1, fc2[:, :-1], group, True, 2),
            ["mlp_microbatches", "fc2", f"last dimension of size {FFN}", "fc1's out_features",
             str((H, FFN - 1))]),
        "mlp_microbatches: float64 fc2": (
            lambda: overlap.mlp_microbatches(torch.randn(4, H), fc1, fc2.double(), group, True, 2),
            ["mlp_microbatches", "fc2", "torch.float64", "torch.float32"]),
        "mlp_microbatches: 1-D fc1": (
            lambda: overlap.mlp_microbatches(torch.randn(4, H), fc1.flatten(), fc2, group, True, 2),
            ["mlp_microbatches", "fc1", "2 dimensions", "(ffn/t, h)", str((FFN * H,))]),
        "allgather_matmul: float64 weight": (
            lambda: overlap.allgather_matmul(torch.randn(4, H), W.double(), group, 2),
            ["allgather_matmul", "torch.float32", "torch.float64"]),
        "topk_route: bias of the wrong length": (
            lambda: topk_route(logits, 2, 1.0, torch.zeros(2 * n + 1)),
            ["topk_route", "bias", f"({2 * n},)", str((2 * n + 1,))]),
        "topk_route: one bias for all experts": (
            lambda: topk_route(logits, 2, 1.0, torch.zeros(1)), ["topk_route", "bias", f"({2 * n},)", "(1,)"]),
        "topk_route: integer bias": (
            lambda: topk_route(logits, 2, 1.0, torch.zeros(2 * n, dtype=torch.int64)),
            ["topk_route", "bias", "floating-point", "torch.int64"]),
        "topk_route: bias on meta": (
            lambda: topk_route(logits, 2, 1.0, torch.zeros(2 * n, device="meta")),
            ["topk_route", "bias is on meta", "cpu"]),
        "topk_route: logits on meta": (lambda: topk_route(logits.to("meta"), 2, 1.0), ["topk_route", "meta"]),
        "topk_route: 3-D logits": (lambda: topk_route(logits[None], 2, 1.0),
                                   ["logits", "(tokens, experts)", str((1, T, 2 * n))]),
        "topk_route: integer logits": (lambda: topk_route(logits.long(), 2, 1.0),
                                       ["logits", "floating-point", "torch.int64"]),
        "ExpertParallelMoE: bias of the wrong length": (
            lambda: ep_moe(torch.randn(T, H), torch.zeros(2 * n + 1)),
            ["topk_route", "bias", f"({2 * n},)", str((2 * n + 1,))]),
        "VocabParallelEmbedding: float ids": (lambda: emb(torch.zeros(S, B)),
                                              ["VocabParallelEmbedding", "integer token ids", "torch.float32"]),
        "VocabParallelEmbedding: ids on meta": (lambda: emb(targets_.to("meta")),
                                                ["VocabParallelEmbedding", "token ids are on meta", "cpu"]),
        "VocabParallelEmbedding: a list": (lambda: emb(targets_.tolist()), ["VocabParallelEmbedding", "list"]),
        "vocab_parallel_cross_entropy: integer logits": (
            lambda: tp.vocab_parallel_cross_entropy(vocab_logits.long(), targets_, group),
            ["vocab_parallel_cross_entropy", "logits", "floating point", "torch.int64"]),
        "vocab_parallel_cross_entropy: targets a list": (
            lambda: tp.vocab_parallel_cross_entropy(vocab_logits, targets_.tolist(), group),
            ["vocab_parallel_cross_entropy", "targets", "list"]),
        "vocab_parallel_cross_entropy: targets on meta": (
            lambda: tp.vocab_parallel_cross_entropy(vocab_logits, targets_.to("meta"), group),
            ["vocab_parallel_cross_entropy", "token ids are on meta", "cpu"]),
        "vocab_parallel_cross_entropy: logits and targets on meta": (
            lambda: tp.vocab_parallel_cross_entropy(vocab_logits.to("meta"), targets_.to("meta"), group),
            ["vocab_parallel_cross_entropy", "logits is on meta", "process group"]),
        "vocab_parallel_cross_entropy: float targets": (
            lambda: tp.vocab_parallel_cross_entropy(vocab_logits, targets_.float(), group),
            ["vocab_parallel_cross_entropy", "integer token ids", "torch.float32"]),
    }
    expect(tuple(cases) == EXTRA, f"extra cases {list(cases)} are not those listed in EXTRA")
    return cases


def world_cases(n: int, group) -> dict[str, tuple]:
    """Rules that only bite on more than one rank (n ≥ 2): each names the rule and the numbers."""
    torch.manual_seed(2)
    row = tp.RowParallelLinear.from_dense(nn.Linear(2 * H, H), group)
    sp_row = sp.SequenceParallelRowLinear.from_dense(nn.Linear(2 * H, H), group)
    three = torch.randn(1, 2 * n - 1, 2, 4)                           # an odd number of heads
    odd = torch.randn(1, HEADS, 3, 4)                                 # 3 tokens a rank: not 2 zigzag chunks
    return {
        "RowParallelLinear: the full width where a slice is expected": (
            lambda: row(torch.randn(S, B, 2 * H)),
            ["RowParallelLinear", "this rank's slice", f"last of size {2 * H // n}", str((S, B, 2 * H))]),
        "SequenceParallelRowLinear: a sequence the ranks cannot split": (
            lambda: sp_row(torch.randn(n * S + 1, B, 2 * H // n)),
            ["reduce_scatter", f"size {n * S + 1}", f"group size {n}"]),
        "ulysses_attention: heads not divisible by P": (
            lambda: cp.ulysses_attention(three, three, three, group),
            ["Ulysses", f"{2 * n - 1} heads are not divisible by the context-parallel degree P={n}"]),
        "ring_attention(zigzag): 3 tokens a rank": (
            lambda: cp.ring_attention(odd, odd, odd, group, True, "zigzag"),
            [f"sequence length {3 * n} is not divisible by 2P = {2 * n}", "zigzag"]),
        "shard_sequence: a sequence not divisible by P": (
            lambda: cp.shard_sequence(torch.randn(1, HEADS, n + 1, 4), 2, group),
            [f"sequence length {n + 1} is not divisible by P = {n}"]),
        "ExpertParallelMoE: experts not divisible by P": (
            lambda: ep.ExpertParallelMoE.from_dense(MoELayer(H, FFN, 2 * n + 1, 1), group),
            [f"{2 * n + 1} experts do not split evenly over P={n} ranks"]),
        "matmul_reduce_scatter: rows not divisible by P": (
            lambda: overlap.matmul_reduce_scatter(torch.randn(n + 1, H), torch.randn(2 * H, H), group, 1),
            ["matmul_reduce_scatter", f"{n + 1} rows", f"{n} ranks × 1 chunks"]),
        "VocabParallelEmbedding: a vocabulary the ranks cannot split": (
            lambda: tp.VocabParallelEmbedding.from_dense(nn.Embedding(2 * n + 1, H), group),
            [f"vocabulary size {2 * n + 1} is not divisible by the tensor-parallel degree t={n}"]),
    }


def still_works(n: int, r: int, group) -> None:
    """After all the refusals, the ranks still communicate in step: nothing was left half-sent."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, HEADS, 2 * n * 2, 4) for _ in range(3))          # the whole sequence
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    mine = [cp.shard_sequence(t, 2, group, "zigzag") for t in (q, k, v)]
    got = cp.ring_attention(*mine, group, True, "zigzag")
    close(cp.unshard_sequence(got, 2, group, "zigzag"), want, "ring attention after the refusals")
    dense = model.Block(H, HEADS)
    x = torch.randn(S * n, B, H)
    block = sp.ParallelBlock.from_dense(dense, group, sequence_parallel=True)
    with torch.no_grad():
        close(block(x.chunk(n, 0)[r]), dense(x).chunk(n, 0)[r], "SP block after the refusals")


@record
def main() -> None:
    with distributed.setup() as d:
        n, r, group = d.world_size, d.rank, d.group
        expect(n >= 2, f"run this program on 2 ranks or more, not {n}")
        counted = 0
        for cases in (grid(n, group), extra_cases(n, group), world_cases(n, group)):
            for what, (fn, words) in cases.items():
                raises(fn, *words, what=f"rank {r}, {what}")
                counted += 1
        still_works(n, r, group)
        dist.barrier()
        if d.is_main:
            print(f"{MARKER} {n} ranks ({counted} cases)")


if __name__ == "__main__":
    main()
