"""Activation memory: the formulas of Korthikanti et al. 2022, term by term, and a meter.

:func:`activation_bytes_per_layer` is the paper's Table 2 (16-bit activations, 1-byte
dropout masks, LayerNorm statistics ignored, MLP h → 4h), with one row as Megatron-LM
implements it rather than as the table prints it: full recomputation with sequence
parallelism keeps 2sbh/t, not 2sbh (``tests/test_memory.py`` holds the table as printed). It is the sum of the
terms :func:`activation_terms` lists — one per tensor a GPT layer keeps for its backward
pass — and those terms take the assumptions as arguments, so that a measurement in
float32, or without dropout, or with LayerNorm statistics, has a formula to match.

:func:`saved_bytes` is the meter: it runs a forward pass under
``torch.autograd.graph.saved_tensors_hooks`` and adds up the distinct storages autograd
keeps, leaving out the parameters.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .model import RECOMPUTE        # "none", "selective", "full": the dense block's choices, counted here
from .rules import whole as _whole

# name, part, elements per (s·b·h) or per (a·s²·b) or per (s·b), kind, how it is split
#   kind: "act" (itemsize bytes), "mask" (mask_bytes), "stat" (stats_bytes: LayerNorm mean and 1/σ)
#   split: "tp" — divided by t under tensor parallelism; "rep" — replicated under tensor
#   parallelism, divided by t under sequence parallelism; "core" — the attention core,
#   divided by t and dropped by selective recomputation.
_TERMS = (
    ("LayerNorm 1 input", "attention", ("sbh", 1), "act", "rep"),
    ("LayerNorm 1 statistics", "attention", ("sb", 2), "stat", "rep"),
    ("q|k|v input", "attention", ("sbh", 1), "act", "rep"),
    ("Q and K", "attention", ("sbh", 2), "act", "tp"),
    ("softmax output", "attention", ("as2b", 1), "act", "core"),
    ("attention dropout mask", "attention", ("as2b", 1), "mask", "core"),
    ("attention dropout output", "attention", ("as2b", 1), "act", "core"),
    ("V", "attention", ("sbh", 1), "act", "tp"),
    ("projection input", "attention", ("sbh", 1), "act", "tp"),
    ("attention output dropout mask", "attention", ("sbh", 1), "mask", "rep"),
    ("LayerNorm 2 input", "MLP", ("sbh", 1), "act", "rep"),
    ("LayerNorm 2 statistics", "MLP", ("sb", 2), "stat", "rep"),
    ("fc1 input", "MLP", ("sbh", 1), "act", "rep"),
    ("GeLU input", "MLP", ("sbh", 4), "act", "tp"),
    ("fc2 input", "MLP", ("sbh", 4), "act", "tp"),
    ("MLP dropout mask", "MLP", ("sbh", 1), "mask", "rep"),
)
TERM_NAMES = tuple(name for name, *_ in _TERMS)
# The inputs of the column-parallel layers: under sequence parallelism an all-gather
# assembles them, and the layer keeps either this device's slice or the gathered whole.
GATHERED_INPUTS = ("q|k|v input", "fc1 input")


def _check(s, b, h, a, t, sp, recompute) -> None:
    for value, what in ((s, "sequence length s"), (b, "micro-batch b"), (h, "hidden size h"),
                        (a, "number of heads a"), (t, "tensor-parallel degree t")):
        _whole(value, what)
    if h % a:
        raise ValueError(f"hidden size h={h} is not divisible by the number of heads a={a}")
    if a % t or h % t:
        raise ValueError(f"tensor parallelism needs t to divide the heads and the hidden size: "
                         f"a={a}, h={h}, t={t}")
    if sp and s % t:
        raise ValueError(f"sequence parallelism needs t to divide the sequence length: s={s}, t={t}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")


def activation_terms(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none",
                     itemsize: int = 2, mask_bytes: int = 1, dropout: bool = True, ln_stats: bool = False,
                     stats_bytes: int = 4, fused: bool = False, keep_gathered: bool = False) -> dict[str, int]:
    """Bytes one device keeps for one layer's backward pass, by tensor.

    The defaults are the paper's assumptions. ``itemsize`` is the activations' bytes per
    number (4 for float32); ``dropout=False`` removes the masks and the separate dropout
    output of the attention probabilities (the weighted sum then keeps the softmax output
    itself); ``ln_stats`` adds the mean and 1/σ each LayerNorm keeps (one per token,
    ``stats_bytes`` each: float32 in PyTorch's CUDA kernel for 16-bit activations, the
    activations' own type in its CPU kernel); ``fused`` replaces the s×s attention tensors
    by what a FlashAttention-style kernel keeps besides q, k, v and its output (which is
    the projection's input): one log-sum-exp per head and token, in float32. (Its backward
    pass recomputes the s×s tensors from them.)
    ``recompute="selective"`` drops the attention core; ``"full"`` keeps only the
    layer's input (this device's part of it: ``s/t`` tokens under sequence parallelism).
    ``keep_gathered`` (sequence parallelism only) keeps the gathered ``(s, b, h)`` inputs
    of the ``q|k|v`` projection and ``fc1`` instead of this device's ``s/t`` slices, which
    the paper's count assumes (its backward pass gathers them again).
    """
    _check(s, b, h, a, t, sp, recompute)
    for value, what in ((itemsize, "itemsize"), (mask_bytes, "mask_bytes"), (stats_bytes, "stats_bytes")):
        _whole(value, what)
    if keep_gathered and not sp:
        raise ValueError("keep_gathered needs sequence parallelism (sp=True): without it the inputs of the "
                         "q|k|v projection and fc1 are whole already")
    units = {"sbh": s * b * h, "as2b": a * s * s * b, "sb": s * b}
    rep_div = t if sp else 1
    if recompute == "full":
        return {"layer input": units["sbh"] * itemsize // rep_div}
    out: dict[str, int] = {}
    for name, _, (unit, count), kind, split in _TERMS:
        if kind == "mask" and not dropout:
            continue
        if kind == "stat" and not ln_stats:
            continue
        if name == "attention dropout output" and not dropout:
            continue
        if split == "core" and (recompute == "selective" or fused):
            continue
        nbytes = units[unit] * count * {"act": itemsize, "mask": mask_bytes, "stat": stats_bytes}[kind]
        if keep_gathered and name in GATHERED_INPUTS:
            out[name] = nbytes                               # the gathered (s, b, h), whole
        else:
            out[name] = nbytes // (rep_div if split == "rep" else t)
    if fused and recompute != "selective":
        out["log-sum-exp (fused kernel)"] = a * s * b * 4 // t
    return out


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                               recompute: str = "none") -> int:
    """Bytes of activations per layer and device: Korthikanti et al. 2022, Table 2.

    none: sbh(34 + 5as/h) · tensor parallel: sbh(10 + 24/t + 5as/(ht)) · with sequence
    parallelism: sbh(34/t + 5as/(ht)) · selective recomputation drops the 5as/h term ·
    full recomputation keeps the layer input: 2sbh, as Table 2 prints it, except with
    sequence parallelism, where this returns 2sbh/t — what Megatron-LM keeps, the layer's
    input as it arrives, already split by sequence.
    """
    return sum(activation_terms(s, b, h, a, t, sp, recompute).values())


# ---------------------------------------------------------------------------- measuring

@dataclass
class SavedReport:
    """What autograd kept during a forward pass: distinct storages, in the order first saved."""

    tensors: list[tuple[tuple[int, ...], str, int]] = field(default_factory=list)  # (shape, dtype, bytes)

    @property
    def total(self) -> int:
        return sum(n for *_, n in self.tensors)

    def table(self, unit: int | None = None) -> str:
        lines = [f"{'#':>2} {'shape as first saved':24} {'dtype':9} {'bytes':>10}" + ("  ÷ unit" if unit else "")]
        for i, (shape, dtype, n) in enumerate(self.tensors, 1):
            lines.append(f"{i:2d} {str(shape):24} {dtype:9} {n:10,d}" + (f"  {n / unit:g}" if unit else ""))
        lines.append(f"{'':2} {'total':24} {'':9} {self.total:10,d}" + (f"  {self.total / unit:g}" if unit else ""))
        return "\n".join(lines)


class saved_bytes:
    """``with saved_bytes(exclude=model.parameters()) as report: loss = f(x)``.

    Every tensor autograd saves for backward inside the block passes through the pack
    hook; each distinct storage is counted once, at its full size (a saved view keeps its
    whole storage alive), and the storages of ``exclude`` (the parameters: they are not
    activations) are left out.
    """

    def __init__(self, exclude=()):
        self.skip = {p.untyped_storage().data_ptr() for p in exclude}
        self.report = SavedReport()
        self._seen: set[int] = set()

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.skip and ptr not in self._seen:
            self._seen.add(ptr)
            self.report.tensors.append((tuple(t.shape), str(t.dtype).removeprefix("torch."), storage.nbytes()))
        return t

    def __enter__(self) -> SavedReport:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self.report

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return False
