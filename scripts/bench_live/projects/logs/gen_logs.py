"""Writes access.log: a deterministic web server log (seeded)."""

import random

rng = random.Random(99)
paths = ["/", "/login", "/api/items", "/api/items/42", "/static/app.js", "/health", "/search"]
with open("access.log", "w") as f:
    for i in range(150_000):
        ip = f"10.0.{rng.randrange(8)}.{rng.randrange(256)}"
        status = rng.choices([200, 301, 404, 500], [90, 4, 5, 1])[0]
        f.write(
            f"{ip} - - [01/Mar/2024:{i // 6250 % 24:02d}:{i // 104 % 60:02d}:{i % 60:02d} +0000] "
            f'"GET {rng.choice(paths)} HTTP/1.1" {status} {rng.randrange(200, 90000)}\n'
        )
print("wrote access.log")
