import math

import pytest

from mapper.errors import InvalidValueError
from mapper.shared.model import (
    PROPERTIES,
    PROPERTY_BY_NAME,
    TWIN_KEY_RE,
    TWIN_VALUE_RE,
    clock_event_reasons_text,
    format_value,
    parse_value,
    twin_safe,
)

REQUIRED = {
    "ReadOnly": [
        "uuid",
        "product_name",
        "utilization_gpu",
        "utilization_memory",
        "memory_used",
        "memory_total",
        "temperature",
        "power_usage",
        "energy_consumption",
        "clock_sm",
        "clock_memory",
        "clock_event_reasons",
        "pstate",
        "fan_speed",
        "pcie_tx",
        "pcie_rx",
        "ecc_errors_corrected",
        "ecc_errors_uncorrected",
        "xid_last",
    ],
    "ReadWrite": [
        "power_limit",
        "locked_gpu_clock_min",
        "locked_gpu_clock_max",
        "locked_memory_clock_min",
        "locked_memory_clock_max",
        "persistence_mode",
        "compute_mode",
    ],
}


def test_the_catalog_has_every_public_property_with_its_access_mode():
    for access, names in REQUIRED.items():
        for name in names:
            assert PROPERTY_BY_NAME[name].access == access, name
    assert PROPERTY_BY_NAME["persistence_mode"].ptype == "BOOLEAN"
    assert PROPERTY_BY_NAME["compute_mode"].ptype == "STRING"


def test_every_property_name_is_a_valid_twin_key_and_unique():
    assert len({p.name for p in PROPERTIES}) == len(PROPERTIES)
    for p in PROPERTIES:
        assert TWIN_KEY_RE.fullmatch(p.name), p.name


def test_prometheus_names_use_base_units():
    for p in PROPERTIES:
        if not p.prom_name:
            continue
        assert p.prom_name.startswith("gpu_"), p.name
        assert "percent" not in p.prom_name and "mhz" not in p.prom_name.lower(), p.name
        if p.prom_type == "counter":
            assert p.prom_name.endswith("_total"), p.name


def test_product_names_become_twin_safe():
    assert twin_safe("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert TWIN_VALUE_RE.fullmatch(twin_safe("Tesla T4 (rev +1) 100%"))


@pytest.mark.parametrize("value", [0.0, 1e-7, 123456789.123, 1e20, 72.5, 450.0])
def test_formatted_floats_fit_the_twin_charset(value):
    text = format_value(PROPERTY_BY_NAME["power_usage"], value)
    assert TWIN_VALUE_RE.fullmatch(text), text
    assert "e" not in text and "+" not in text


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("", "empty"),
        ("abc", "not-a-number"),
        ("nan", "nan"),
        ("inf", "infinite"),
        ("-5", "negative"),
        ("9" * 600, "too-long"),
        ("\uff14\uff15\uff10", "non-ascii"),
        (True, "wrong-type"),
    ],
)
def test_bad_numbers_are_rejected_with_a_reason(raw, reason):
    with pytest.raises(InvalidValueError) as err:
        parse_value(PROPERTY_BY_NAME["power_limit"], raw)
    assert err.value.reason == reason
    assert "power_limit" in str(err.value)


def test_float32_integers_are_accepted_for_int_properties():
    assert parse_value(PROPERTY_BY_NAME["locked_gpu_clock_max"], 1755.0000001) == 1755
    with pytest.raises(InvalidValueError):
        parse_value(PROPERTY_BY_NAME["locked_gpu_clock_max"], "1755.5")


def test_booleans_parse_from_twin_strings():
    spec = PROPERTY_BY_NAME["persistence_mode"]
    assert parse_value(spec, "true") is True
    assert parse_value(spec, "0") is False
    with pytest.raises(InvalidValueError):
        parse_value(spec, "maybe")


def test_clock_event_reasons_by_name():
    assert clock_event_reasons_text(0) == "none"
    assert clock_event_reasons_text(0x24) == "sw_power_cap,sw_thermal_slowdown"
    assert not math.isnan(0x24)


def test_a_devices_property_lookup_finds_the_first_of_a_name_and_nothing_for_an_unknown_one() -> None:
    from mapper.shared.model import DeviceConfig, DeviceProperty

    first = DeviceProperty("power_limit", collect_cycle_ms=1000)
    device = DeviceConfig(
        "edge", "gpu-0", "gpu-model", "GPU-1", properties=(first, DeviceProperty("power_limit", collect_cycle_ms=5000))
    )
    assert device.property("power_limit") is first
    assert device.property("temperature") is None
    assert device.key == "edge/gpu-0"
    assert device == DeviceConfig("edge", "gpu-0", "gpu-model", "GPU-1", properties=device.properties)
