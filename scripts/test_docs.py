"""Tests of scripts/docs.py: snippets follow their sources, and broken links are found."""

import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import docs  # noqa: E402


class Docs(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.root = self.dir.name
        docs.ROOT = self.root
        os.makedirs(os.path.join(self.root, "docs"))

    def tearDown(self):
        self.dir.cleanup()

    def write(self, rel, text):
        with open(os.path.join(self.root, rel), "w") as f:
            f.write(text)

    def test_a_snippet_is_its_region_dedented_and_drift_is_reported(self):
        self.write("app.py", "x = 1\ndef f():\n    # [r]\n    return 2\n    # [/r]\n")
        page = "<!-- snippet: app.py r -->\n```python\nstale\n```\n<!-- /snippet -->\n"
        self.write("docs/p.md", page)
        self.write("README.md", "# t\n")
        self.assertEqual(docs.snippets(check=True), 1)
        self.assertEqual(docs.snippets(check=False), 0)
        with open(os.path.join(self.root, "docs/p.md")) as f:
            self.assertIn("```python\nreturn 2\n```", f.read())
        self.assertEqual(docs.snippets(check=True), 0)

    def test_broken_files_and_anchors_are_found_outside_code(self):
        self.write("README.md", "# Top\n## Sizing `limits`\n[a](#sizing-limits) [b](docs/x.md#nope)\n"
                   "[c](missing.md) [d](https://example.com/#x)\n```\n[e](gone.md)\n```\n")
        self.write("docs/x.md", "# X\n")
        found = docs.broken_links(os.path.join(self.root, "README.md"), {})
        self.assertEqual(len(found), 2, found)
        self.assertIn("#nope", found[0])
        self.assertIn("missing.md: no such file", found[1])


if __name__ == "__main__":
    unittest.main()
