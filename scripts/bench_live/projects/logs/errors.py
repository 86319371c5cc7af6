"""Per path: requests and the share of 5xx answers. python errors.py access.log"""

import sys
from collections import Counter

total, errors = Counter(), Counter()
with open(sys.argv[1]) as f:
    for line in f:
        parts = line.split()
        path, status = parts[6], int(parts[8])
        total[path] += 1
        if status > 500:
            errors[path] += 1
for path in sorted(total):
    print(f"{path:<16} {total[path]:7d} {100 * errors[path] / total[path]:6.2f}%")
