import re


def slugify(text: str) -> str:
    words = re.split(r"[^A-Za-z0-9]", text.lower())
    return "-".join(words)
