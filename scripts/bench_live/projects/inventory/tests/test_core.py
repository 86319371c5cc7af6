import random
import unittest

from inventory import Inventory, Item


class CoreTest(unittest.TestCase):
    def test_add_remove(self):
        inv = Inventory()
        inv.add(Item("a1", "bolt", 25), 10)
        inv.remove("a1", 4)
        self.assertEqual(inv.stock("a1"), 6)
        with self.assertRaises(ValueError):
            inv.remove("a1", 7)

    def test_value(self):
        inv = Inventory()
        inv.add(Item("a1", "bolt", 25), 10)
        inv.add(Item("b2", "nut", 10), 3)
        self.assertEqual(inv.value_cents(), 280)

    def test_random_walk(self):
        # many random moves keep stock consistent with a plain counter
        rng = random.Random(7)
        for _trial in range(70):
            inv, ref = Inventory(), {}
            skus = [f"s{i}" for i in range(50)]
            for s in skus:
                inv.add(Item(s, s, rng.randrange(1, 500)))
                ref[s] = 0
            for _ in range(20000):
                s = rng.choice(skus)
                n = rng.randrange(1, 20)
                if rng.random() < 0.6:
                    inv.add(inv.item(s), n)
                    ref[s] += n
                elif ref[s] >= n:
                    inv.remove(s, n)
                    ref[s] -= n
            self.assertEqual({s: inv.stock(s) for s in skus}, ref)


if __name__ == "__main__":
    unittest.main()
