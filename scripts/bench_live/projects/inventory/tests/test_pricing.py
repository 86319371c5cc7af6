import unittest

from inventory import Item, order_total, unit_price
from inventory.pricing import discount_percent


class PricingTest(unittest.TestCase):
    def test_small_orders_pay_list_price(self):
        self.assertEqual(unit_price(Item("a", "a", 200), 99), 200)

    def test_bulk_threshold_is_inclusive(self):
        self.assertEqual(discount_percent(100), 10)
        self.assertEqual(unit_price(Item("a", "a", 200), 100), 180)

    def test_wholesale(self):
        self.assertEqual(discount_percent(1000), 15)
        self.assertEqual(order_total(Item("a", "a", 200), 1000), 170000)

    def test_totals_are_monotonic_in_price(self):
        for cents in range(1, 400):
            item = Item("x", "x", cents)
            for q in range(1, 1200, 7):
                self.assertLessEqual(unit_price(item, q), cents)
                self.assertGreaterEqual(order_total(item, q + 1), order_total(item, q) - cents)


if __name__ == "__main__":
    unittest.main()
