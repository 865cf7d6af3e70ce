"""Kubernetes resource quantities ("500m", "16Gi", 2, "1e3"): read, added, scaled and written back as the
API server writes them, so the requests and limits the builders derive compare equal to what comes back."""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import ROUND_CEILING, Decimal
from typing import Final

_SCALE: Final[Mapping[str, Decimal]] = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}
_BINARY: Final = ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki")
# The API server's grammar: a signed decimal number, then a decimal exponent or one suffix.
_QUANTITY: Final = re.compile(r"([+-]?(?:\d+(?:\.\d*)?|\.\d+))(?:[eE]([+-]?\d+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]))?")


def parse_quantity(value: int | str) -> Decimal:
    """``value`` in units (CPUs, bytes); ValueError when the API server would not read it either."""
    found = _QUANTITY.fullmatch(str(value).strip())
    if found is None:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    number, exponent, suffix = found.groups()
    amount = Decimal(number)
    return amount.scaleb(int(exponent)) if exponent else amount * _SCALE[suffix or ""]


def format_quantity(amount: Decimal, resource: str) -> str:
    """``amount`` as the API server writes it: CPU in whole CPUs or millicores (rounded up to its milli
    precision), anything else in whole units with the largest binary suffix that keeps them whole."""
    if resource == "cpu":
        millis = int((amount * 1000).to_integral_value(rounding=ROUND_CEILING))
        return str(millis // 1000) if millis % 1000 == 0 else f"{millis}m"
    whole = int(amount.to_integral_value(rounding=ROUND_CEILING))
    for suffix in _BINARY:
        unit = int(_SCALE[suffix])
        if whole and whole % unit == 0:
            return f"{whole // unit}{suffix}"
    return str(whole)


def add_quantities(*amounts: tuple[Mapping[str, int | str], int]) -> dict[str, str]:
    """Sum of ``count`` × quantities per resource, e.g. a process's own requests plus one share per device."""
    totals: dict[str, Decimal] = {}
    for quantities, count in amounts:
        for resource, value in quantities.items():
            totals[resource] = totals.get(resource, Decimal(0)) + count * parse_quantity(value)
    return {resource: format_quantity(total, resource) for resource, total in sorted(totals.items())}
