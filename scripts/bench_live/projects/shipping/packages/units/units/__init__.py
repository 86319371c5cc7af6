"""Mass and length conversions."""

KG_PER = {"kg": 1.0, "g": 0.001, "lb": 0.45359237, "oz": 0.028349523125}
M_PER = {"m": 1.0, "cm": 0.01, "mm": 0.001, "in": 0.0254, "ft": 0.3048}


def to_kg(value: float, unit: str) -> float:
    return value * KG_PER[unit]


def to_m(value: float, unit: str) -> float:
    return value * M_PER[unit]
