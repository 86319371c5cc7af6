import random
import unittest

from textkit import slugify, wrap


class TextkitTest(unittest.TestCase):
    def test_slug(self):
        self.assertEqual(slugify("Hello, World!"), "hello-world")
        self.assertEqual(slugify("  a  b "), "a-b")

    def test_wrap_width(self):
        rng = random.Random(3)
        words = ["".join(rng.choice("abcdef") for _ in range(rng.randint(1, 9))) for _ in range(400)]
        for width in range(10, 80):
            for _ in range(60):
                text = " ".join(rng.sample(words, 50))
                lines = wrap(text, width)
                self.assertTrue(all(len(line) <= width for line in lines))
                self.assertEqual(" ".join(lines), text)


if __name__ == "__main__":
    unittest.main()
