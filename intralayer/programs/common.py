"""What several programs share."""
from __future__ import annotations

import math


def error_label(err: float) -> str:
    """A stable summary of a small error: 'exact' or '<1e-k' (k the first decimal place it reaches)."""
    return "exact" if err == 0 else f"<1e-{max(0, math.floor(-math.log10(err)))}"
