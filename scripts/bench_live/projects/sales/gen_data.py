"""Writes data/sales.csv: a deterministic year of sales (seeded), about 10 MB."""

import csv
import os
import random

REGIONS = ["north", "south", "east", "west", "central"]
PRODUCTS = [f"SKU-{i:03d}" for i in range(120)]

rng = random.Random(2024)
os.makedirs("data", exist_ok=True)
with open("data/sales.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["date", "region", "product", "quantity", "unit_price"])
    for i in range(200_000):
        day = 1 + i * 365 // 200_000
        month = min(12, 1 + (day - 1) // 31)
        w.writerow(
            [
                f"2024-{month:02d}-{1 + (day - 1) % 28:02d}",
                rng.choice(REGIONS),
                rng.choice(PRODUCTS),
                rng.randint(1, 40),
                f"{rng.uniform(0.5, 250):.2f}",
            ]
        )
print("wrote data/sales.csv")
