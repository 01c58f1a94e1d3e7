"""The one input check every module shares: a count must be a whole number."""
from __future__ import annotations

import numbers


def whole(value, what: str, minimum: int = 1) -> int:
    """``value`` as an int, or a ``ValueError`` naming ``what`` unless it is a whole number ≥ ``minimum``."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{what} must be a whole number ≥ {minimum}, got {value!r}")
    return int(value)
