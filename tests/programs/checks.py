"""Small assertions shared by the multi-rank check programs in this folder.

Each raises ``AssertionError`` with a message that says what was being checked, so a
failing rank's traceback (shown by ``intralayer.launch``) names the case.
"""
from __future__ import annotations

from torch.testing import assert_close

from intralayer import comm


def expect(cond, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def close(got, want, what: str, **tol) -> None:
    """``assert_close`` at the dtype's default tolerances unless ``rtol``/``atol`` are given."""
    expect(got is not None, f"{what}: got None")
    assert_close(got, want, msg=lambda m: f"{what}: {m}", **tol)


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
