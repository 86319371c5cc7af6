"""Stock keeping and pricing."""

from inventory.core import Inventory, Item
from inventory.pricing import order_total, unit_price

__all__ = ["Inventory", "Item", "order_total", "unit_price"]
