"""Kubernetes quantities as the builders add and scale them, and the settings that hold them."""

from __future__ import annotations

from decimal import Decimal

import pytest
from pydantic import ValidationError

from omnimodel_operator.quantity import add_quantities, format_quantity, parse_quantity
from omnimodel_operator.settings import OperatorSettings


@pytest.mark.parametrize(
    ("written", "units"),
    [
        ("500m", "0.5"),
        (2, "2"),
        ("1.5", "1.5"),
        ("16Gi", str(16 * 2**30)),
        ("3G", "3e9"),
        ("1e3", "1000"),
        ("2E", "2e18"),
    ],
)
def test_quantities_read_as_the_api_server_reads_them(written: int | str, units: str) -> None:
    assert parse_quantity(written) == Decimal(units)


@pytest.mark.parametrize("written", ["", "1.5.2", "16GB", "m", "-", "1 Gi"])
def test_what_the_api_server_would_refuse_is_no_quantity(written: str) -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        parse_quantity(written)


@pytest.mark.parametrize(
    ("units", "resource", "written"),
    [
        ("2", "cpu", "2"),
        ("2.5", "cpu", "2500m"),
        ("0.0001", "cpu", "1m"),  # the API server's milli precision, rounded up
        (str(18 * 2**30), "memory", "18Gi"),
        (str(1536 * 2**20), "memory", "1536Mi"),
        ("3e9", "memory", "3000000000"),
    ],
)
def test_quantities_are_written_as_the_api_server_writes_them(units: str, resource: str, written: str) -> None:
    assert format_quantity(Decimal(units), resource) == written


def test_a_process_share_plus_one_per_device() -> None:
    base = {"cpu": "500m", "memory": "2Gi"}
    device = {"cpu": "2", "memory": "16Gi"}
    assert add_quantities((base, 1), (device, 4)) == {"cpu": "8500m", "memory": "66Gi"}


def test_a_setting_that_is_no_quantity_stops_the_operator_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMNIMODEL_DEVICE_REQUESTS", '{"cpu": "2 cores"}')
    with pytest.raises(ValidationError, match="device_requests"):
        OperatorSettings()
    monkeypatch.setenv("OMNIMODEL_DEVICE_REQUESTS", "{}")
    monkeypatch.setenv("OMNIMODEL_LIMIT_RATIOS", '{"cpu": -1}')
    with pytest.raises(ValidationError, match="limit_ratios"):
        OperatorSettings()
