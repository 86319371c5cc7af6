from __future__ import annotations

from inventory.core import Item

BULK = 100
WHOLESALE = 1000


def discount_percent(quantity: int) -> int:
    if quantity >= WHOLESALE:
        return 15
    if quantity > BULK:
        return 10
    return 0


def unit_price(item: Item, quantity: int) -> int:
    """Price of one unit, in cents, for an order of ``quantity`` units (rounded down)."""
    return item.price_cents * (100 - discount_percent(quantity)) // 100


def order_total(item: Item, quantity: int) -> int:
    return unit_price(item, quantity) * quantity
