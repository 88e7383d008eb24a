"""How vidtune writes a number a person reads: trials.csv's significant digits, a learning rate's
short form in trial names and on plot axes. On the floor, so the searched parameters
(`tune.config.searched`), the tables, the plots and MLflow's params write a number the same way."""
from __future__ import annotations

import math


def significant(x: float | None, digits: int = 3) -> str:
    """`x` to `digits` significant digits as trials.csv writes it ("" for None, "nan" if not finite)."""
    if x is None:
        return ""
    return f"{x:.{digits}g}" if math.isfinite(x) else "nan"


def short_number(x: float) -> str:
    """1e-4 -> '1e-4', 0.00025 -> '2.5e-4' (two significant digits, no exponent padding)."""
    mantissa, exponent = f"{float(x):.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
