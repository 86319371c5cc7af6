"""Parcel rates: a base fee, a rate per kg of billable weight (the larger of the real and
the volumetric weight, 5000 cm^3 per kg)."""

from units import to_kg, to_m

BASE_CENTS = 450
CENTS_PER_KG = {"standard": 180, "express": 390}


def billable_kg(weight: float, weight_unit: str, dims: tuple[float, float, float], dim_unit: str) -> float:
    volume_cm3 = 1.0
    for d in dims:
        volume_cm3 *= to_m(d, dim_unit) * 100
    return max(to_kg(weight, weight_unit), volume_cm3 / 5000)


def rate_cents(weight: float, weight_unit: str, dims, dim_unit: str, service: str = "standard") -> int:
    return BASE_CENTS + round(CENTS_PER_KG[service] * billable_kg(weight, weight_unit, dims, dim_unit))
