"""How the report writes a method's numbers: budgets, counts and sparsity levels (used by the methods' ``label``)."""

from __future__ import annotations

from typing import Any


def budget_label(b: Any) -> str:
    """A ratio of the context (<= 1) as is; a token count (> 1; ints may come back as floats from a CSV)."""
    if b is None:
        return "?"
    return f"{float(b):g}" if float(b) <= 1.0 else f"{int(b)} tok"


def count_label(v: Any) -> Any:
    """An integer that a CSV gave back as a float, as an int (K, L, page sizes, bits); anything else as is."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def fraction_label(x: float) -> str:
    """A sparsity level as the papers write it: 1, 1/2, 1/16, ... (other values as a decimal)."""
    inv = 1.0 / x
    return "1" if abs(inv - 1) < 1e-9 else (f"1/{round(inv)}" if abs(inv - round(inv)) < 1e-6 * inv else f"{x:.3g}")


def budget_level(b: Any, context: float | None) -> float | None:
    """The share of a row's keys a budget keeps: a ratio (float <= 1) as is, a token count over ``context`` (the
    keys of an average row) when that is known, else None."""
    if b is None:
        return None
    if float(b) <= 1.0:
        return float(b)
    return float(b) / float(context) if context else None
