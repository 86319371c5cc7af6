"""Revenue per region and month: python summarize.py data/sales.csv [--top N]"""

import argparse
import csv
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=3)
    args = ap.parse_args()
    revenue = defaultdict(float)
    by_product = defaultdict(float)
    with open(args.path, newline="") as f:
        for row in csv.DictReader(f):
            amount = int(row["quantity"]) * int(row["unit_price"])
            revenue[(row["region"], row["date"][:7])] += amount
            by_product[row["product"]] += amount
    for region in sorted({r for r, _ in revenue}):
        months = sorted(m for r, m in revenue if r == region)
        total = sum(revenue[(region, m)] for m in months)
        print(f"{region:<8} {total:14.2f}  best month {max(months, key=lambda m: revenue[(region, m)])}")
    for product, amount in sorted(by_product.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"top {product} {amount:.2f}")


if __name__ == "__main__":
    main()
