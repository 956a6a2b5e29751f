"""Tests of scripts/advice_example.py's comparison: two runs that differ only in their figures (and in
the order subjects with equal counts are listed) compare equal, a different text does not, and a
run that does not show what the example claims is refused. No daemon is started here;
scripts/test.sh runs the whole example with --check."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import advice_example as a  # noqa: E402


def output(rate="240", burst="4", proposed="acme/runaway (104 of 140)", first="agent-01 (11 of 16)",
           second="agent-02 (11 of 16)"):
    return (
        "# admitd advise: 451 calls over 10.0s seen by http://127.0.0.1:9470\n"
        f"# Replayed, the current config would refuse 21 subjects: acme/runaway (134 of 140), "
        f"acme/{first}, acme/{second} and 18 more\n"
        f"# Replayed, the proposal would refuse 1 subjects: {proposed}\n\n"
        f"[limits.subject]            # the first guess\nrate = \"{rate}/min\"\nburst = {burst}\n")


class Comparison(unittest.TestCase):
    def test_figures_and_the_order_of_equal_counts_do_not_matter(self):
        one = a.section(output())
        other = a.section(output(rate="216", burst="5", first="agent-07 (12 of 20)", second="agent-03 (9 of 16)"))
        self.assertEqual(a.normal(one), a.normal(other))

    def test_a_different_text_is_a_difference(self):
        one = a.section(output())
        other = a.section(output(proposed="acme/runaway (104 of 140), acme/agent-01 (1 of 20)"))
        self.assertNotEqual(a.normal(one), a.normal(other))

    def test_a_run_must_show_what_the_example_claims(self):
        self.assertIsNone(a.holds(output()))
        self.assertIn("rate", a.holds(output(rate="900")))
        self.assertIn("burst", a.holds(output(burst="20")))
        self.assertIn("runaway alone", a.holds(output(proposed="acme/agent-01 (1 of 20)")))


if __name__ == "__main__":
    unittest.main()
