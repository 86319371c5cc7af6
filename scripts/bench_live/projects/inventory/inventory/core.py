from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Item:
    sku: str
    name: str
    price_cents: int


class Inventory:
    def __init__(self) -> None:
        self._items: dict[str, Item] = {}
        self._stock: dict[str, int] = {}

    def add(self, item: Item, quantity: int = 0) -> None:
        if quantity < 0:
            raise ValueError("quantity must be >= 0")
        self._items[item.sku] = item
        self._stock[item.sku] = self._stock.get(item.sku, 0) + quantity

    def remove(self, sku: str, quantity: int) -> None:
        have = self._stock.get(sku, 0)
        if quantity > have:
            raise ValueError(f"only {have} of {sku} in stock")
        self._stock[sku] = have - quantity

    def stock(self, sku: str) -> int:
        return self._stock.get(sku, 0)

    def item(self, sku: str) -> Item:
        return self._items[sku]

    def value_cents(self) -> int:
        return sum(self._items[s].price_cents * n for s, n in self._stock.items())
