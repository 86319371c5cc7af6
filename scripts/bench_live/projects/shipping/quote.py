"""Quote every parcel of parcels.csv: python quote.py parcels.csv"""

import csv
import sys

from tariff import rate_cents


def main(path: str) -> None:
    total = 0
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            dims = tuple(float(row[k]) for k in ("l", "w", "h"))
            cents = rate_cents(float(row["weight"]), row["weight_unit"], dims, row["dim_unit"], row["service"])
            total += cents
            print(f"{row['id']:>6} {row['service']:<8} {cents / 100:8.2f}")
    print(f"total {total / 100:.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
