"""Small assertions shared by the multi-rank check programs in this folder.

Each raises ``AssertionError`` with a message that says what was being checked, so a
failing rank's traceback (shown by ``intralayer.launch``) names the case.

Tolerances (:data:`UNIT_ROUNDOFF`, :func:`gamma`, :func:`rounding_tol`)
------------------------------------------------------------------------
A comparison's tolerance should follow from the dtypes involved, not from what a run
happened to need. The model (Higham, *Accuracy and Stability of Numerical Algorithms*,
2nd ed., §2.2 and Lemma 3.1): one correctly rounded operation in a type with unit
roundoff u has relative error at most u, and a chain of n of them (a sum or dot product
of n terms, say) at most γ_n = n·u/(1 − n·u), relative to the *magnitude* of the terms
(Σ|terms|), not to the result, which may cancel to near zero.

==========  ===============  ==============================================================
dtype       unit roundoff u  typical use in these tests
==========  ===============  ==============================================================
float64     2^-53 ≈ 1.1e-16  references; their own error is ignored (2^29 below float32's)
float32     2^-24 ≈ 6.0e-8   work dtype: γ_n for a chain of n roundings
float16     2^-11 ≈ 4.9e-4   (not used by the library; listed for completeness)
bfloat16    2^-8  ≈ 3.9e-3   storage only here: one final rounding of a float32 result
==========  ===============  ==============================================================

(``torch.finfo(dtype).eps`` is 2u: the gap from 1 to the next number, 2^-23 for float32
and 2^-7 for bfloat16.) So a float32 result of n roundings, stored in ``dtype``, against a
float64 reference on the same (already rounded) inputs satisfies
``|got − want| ≤ γ_n·mag + u(dtype)·|want|`` (the second term only when ``dtype`` is
narrower than the work dtype): :func:`rounding_tol` turns that into ``assert_close``'s
``rtol``/``atol`` with ``atol = rtol·mag`` for a typical magnitude ``mag`` of the terms.
The count n is the caller's to state and justify. ``assert_close``'s own defaults
(float32 rtol 1.3e-6 ≈ 22u, atol 1e-5; float64 rtol 1e-7, atol 1e-7; bfloat16 rtol
1.6e-2 ≈ 4u, atol 1e-5) are not derived from the computation being checked: the float32
atol of 1e-5 is 168 units of roundoff for values of order 1, and the bfloat16 atol of
1e-5 is about 1/400 of one rounding for values of order 1.

Float32 parallel against float32 dense (:data:`FLOAT32_REORDERED`). Most checks in these
programs compare a float32 parallel result with its float32 dense twin: the same terms,
summed in another order (partial sums joined by an all-reduce, blocks merged by the
log-sum-exp rule, chunks accumulated). Each side is within γ_n·Σ|terms| of the exact
value, n the longest reduction (H, 4H, the sequence s, the rows of a weight gradient, or
P partial sums: n ≤ 96 here), so in the worst case they differ by 2γ_n·Σ|terms|; but
rounding errors of both signs add up like √n·u, not n·u (Higham §2.8), about 10u
relative for n = 96. Those comparisons keep ``assert_close``'s float32 defaults (rtol
1.3e-6 ≈ 22u, atol 1e-5), and each program says so in a comment; the largest error
measured in any of them is 0.2 of that tolerance (tp 0.07, sp 0.09, ep 0.19, overlap
0.20, cp 0.18, on 2 and 4 ranks). Where the sizes grow, or a comparison is against a
float64 reference, use :func:`rounding_tol`; results that must be bit for bit (slices,
copies, recomputations) use :data:`EXACT`.
"""
from __future__ import annotations

import torch
from torch.testing import assert_close

from intralayer import comm


#: Unit roundoff u of each floating type: half the gap from 1 to the next number, the
#: largest relative error of one correctly rounded operation (round to nearest).
UNIT_ROUNDOFF = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
                 torch.bfloat16: 2.0 ** -8}


def gamma(n: float, dtype: torch.dtype = torch.float32) -> float:
    """γ_n = n·u/(1 − n·u): the relative error bound of a chain of n roundings in ``dtype``."""
    nu = n * UNIT_ROUNDOFF[dtype]
    if not 0 <= nu < 1:
        raise ValueError(f"n·u = {nu} for n = {n} in {dtype}: no bound (n·u must be below 1)")
    return nu / (1 - nu)


def rounding_tol(dtype: torch.dtype, n: float, mag: float = 1.0, work: torch.dtype | None = None) -> dict:
    """``rtol``/``atol`` for a result stored in ``dtype`` and computed in ``work`` (float32 for
    bfloat16 and float16 results, else ``dtype``) by a chain of n roundings, against a float64
    reference on the same inputs; ``mag`` is a typical magnitude of the terms (Σ|terms|).

    rtol = γ_n(work) + u(dtype) if ``dtype`` is narrower than ``work`` (one final rounding),
    else γ_n(work); atol = γ_n(work)·mag (error of entries that cancel to near zero).
    """
    if work is None:
        work = torch.float32 if UNIT_ROUNDOFF[dtype] > UNIT_ROUNDOFF[torch.float32] else dtype
    g = gamma(n, work)
    final = UNIT_ROUNDOFF[dtype] if UNIT_ROUNDOFF[dtype] > UNIT_ROUNDOFF[work] else 0.0
    return dict(rtol=g + final, atol=g * mag)


#: assert_close's float32 defaults, named: a float32 parallel result against its float32
#: dense twin, the same terms summed in another order (module docstring).
FLOAT32_REORDERED = dict(rtol=1.3e-6, atol=1e-5)

#: Tolerance zero, for results that must come out bit for bit: a shard that is a slice or a
#: copy of a dense tensor, or the same operations on the same values (a recomputation).
EXACT = dict(rtol=0.0, atol=0.0)


def expect(cond, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def close(got, want, what: str, **tol) -> None:
    """``assert_close`` at the dtype's default tolerances unless ``rtol``/``atol`` are given.

    The float32 defaults are :data:`FLOAT32_REORDERED`, for a float32 parallel result against
    its float32 dense twin (module docstring); anything else states its tolerance."""
    expect(got is not None, f"{what}: got None")
    assert_close(got, want, msg=lambda m: f"{what}: {m}", **tol)


def bounded(got, want, what: str, rtol, atol) -> None:
    """``|got − want| ≤ atol + rtol·|want|`` elementwise, in ``want``'s dtype, and got finite.

    As ``assert_close``, but ``atol`` may be a tensor shaped like ``want``: :func:`rounding_tol`
    with an elementwise magnitude (``mag``), so an entry whose terms are small is held to
    its own bound rather than to the largest entry's.
    """
    expect(got is not None and got.shape == want.shape,
           f"{what}: shape {None if got is None else tuple(got.shape)}, want {tuple(want.shape)}")
    got = got.to(want.dtype)
    expect(bool(torch.isfinite(got).all()), f"{what}: not finite")
    err = (got - want).abs()
    bound = atol + rtol * want.abs()
    worst = float((err / bound.clamp_min(torch.finfo(want.dtype).tiny)).max()) if err.numel() else 0.0
    expect(bool((err <= bound).all()), f"{what}: error {float(err.max()):.3g} over the bound "
                                        f"(rtol {rtol:.3g}); worst error/bound {worst:.3g}")


def raises(fn, *words, what: str) -> str:
    """``fn()`` must raise ValueError naming every one of ``words``, having issued no collective."""
    with comm.accounting() as acc:
        try:
            fn()
        except ValueError as e:
            message = str(e)
            for word in words:
                expect(word in message, f"{what}: the message {message!r} does not mention {word!r}")
            expect(not acc.records, f"{what}: {len(acc.records)} collectives issued before the error")
            return message
    raise AssertionError(f"{what}: no ValueError was raised")


def dense_run(dense, x, upstream):
    """Forward and backward of the dense twin; returns output and input gradient."""
    leaf = x.clone().requires_grad_()
    out = dense(leaf)
    out.backward(upstream)
    return out.detach(), leaf.grad


def run_check(module: str, name: str) -> None:
    """One ``check_*(n, r, group)`` of a check program on this rank (the target of a pool job): one
    test item per check (tests/conftest.py's ``on_ranks``)."""
    import importlib

    import torch.distributed as dist

    from intralayer import distributed

    with distributed.setup() as d:
        getattr(importlib.import_module(module), name)(d.world_size, d.rank, d.group)
        dist.barrier()
