"""Tests of scripts/schemathesis_hooks.py's failure filter, run in the Schemathesis venv."""

import os
import subprocess
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV_PYTHON = os.path.join(ROOT, "target", "schemathesis-venv", "bin", "python")

# Decides fake failures with the real hook and prints one line per case: kept or dropped.
PROBE = r"""
import sys
from collections import namedtuple
from types import SimpleNamespace as NS
sys.path.insert(0, "scripts")
import schemathesis_hooks as hooks

Location = namedtuple("Location", "name")

def case(body, *negative, path="/v1/admit", **kw):
    mode = lambda neg: NS(mode=NS(is_negative=neg))
    components = {Location("BODY"): mode("BODY" in negative)}
    for location in negative:
        if location != "BODY":
            components[Location(location)] = mode(True)
    return NS(meta=NS(components=components), path=path, method="POST", body=body)

accepted = NS(code="ST201")
valid = {"tenant": "acme", "subject": "e\U0003682e", "tool": "get_sales"}
cases = [
    (accepted, case(valid, "BODY")),
    (accepted, case({**valid, "subject": "x" * 129}, "BODY")),
    (accepted, case({**valid, "subject": "\u00e9" * 65}, "BODY")),
    (accepted, case({**valid, "tool": "a\x07"}, "BODY")),
    (accepted, case({**valid, "cost": 0}, "BODY")),
    (accepted, case(valid, "BODY", "HEADER")),
    (NS(code="ST101"), case(valid, "BODY")),
]
rejected = NS(code="ST202")
release = {"lease_id": "x", "outcome": "ok"}
cases += [
    (rejected, case({**release, "retry_after": "Wed, 21 Oct 2026 07:28:00 GMT"}, path="/v1/release")),
    (rejected, case({**release, "retry_after": "\u00f7\u0088"}, path="/v1/release")),
    (rejected, case({**release, "retry_after": "Thu, 21 Oct 2026 07:28:00 GMT"}, path="/v1/release")),
    (rejected, case({**valid, "tool": "a\x07"})),
    (rejected, case(valid)),
]
for failure, c in cases:
    print("kept" if hooks.filter_failure(None, failure, c, None) else "dropped")
def answer(status, body):
    return NS(status_code=status, json=lambda: body)
unit = {"error": "invalid_request", "message": 'spend names the unit "a", which is not configured'}
other = {"error": "invalid_request", "message": "cost -1 must be positive"}
answered = [
    (rejected, case({**valid, "spend": {"a": 1}}), answer(400, unit)),
    (rejected, case(valid), answer(400, other)),
    (rejected, case(valid), answer(500, unit)),
    (accepted, case({**valid, "cost": 0, "spend": {"a": 1}}, "BODY"), answer(400, unit)),
]
print(" ".join("kept" if hooks.filter_failure(None, f, c, r) else "dropped" for f, c, r in answered))
dates = [
    "Sun, 06 Nov 1994 08:49:37 GMT", "Sunday, 06-Nov-94 08:49:37 GMT", "Sun Nov  6 08:49:37 1994",
    "Wednesday, 06-Nov-69 08:49:37 GMT", "Fri, 31 Dec 9999 23:59:59 GMT",
    "Mon, 06 Nov 1994 08:49:37 GMT", "Sun, 31 Nov 1994 08:49:37 GMT", "Sun Nov 06 08:49:37 1994",
    "Thursday, 06-Nov-69 08:49:37 GMT", "Thu, 01 Jan 1960 00:00:00 GMT", "30", 30,
]
print(" ".join("date" if hooks._is_http_date(d) else "not" for d in dates))
"""


class FilterFailure(unittest.TestCase):
    def test_only_a_valid_body_generated_as_invalid_is_dropped(self):
        if not os.path.exists(VENV_PYTHON):
            self.skipTest("no Schemathesis venv (scripts/schemathesis.sh makes it)")
        env = dict(os.environ, ADMITD_ST_SPEC=os.path.join(ROOT, "docs", "openapi.yaml"))
        run = subprocess.run(
            [VENV_PYTHON, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, env=env
        )
        self.assertEqual(run.returncode, 0, run.stderr)
        self.assertEqual(
            run.stdout.split("\n")[:-3],
            # ST201, invalid data accepted: a valid astral name; 129 bytes; 130 bytes in 65
            # characters; a control character; a zero cost; a header broken too; another check's
            # failure.
            ["dropped", "kept", "kept", "kept", "kept", "kept", "kept"]
            # ST202, valid data rejected: a real HTTP-date; not a date; a wrong weekday; a control
            # character; a valid body.
            + ["kept", "dropped", "dropped", "dropped", "kept"],
        )
        self.assertEqual(
            run.stdout.split("\n")[-3].split(),
            # ST202 answered 400 for a spend unit the config does not declare (the spec cannot know
            # which exist): dropped; for anything else, or another status: kept; ST201: not this
            # rule's (an invalid body generated as invalid stays a failure).
            ["dropped", "kept", "kept", "kept"],
        )
        self.assertEqual(
            run.stdout.split("\n")[-2].split(),
            # the three forms, 2069 in two digits, the last day a four-digit year can name; a
            # wrong weekday, 31 November, asctime's day padded with 0, 1969's weekday for 2069,
            # before 1970, delay-seconds, a number
            ["date"] * 5 + ["not"] * 7,
        )


if __name__ == "__main__":
    unittest.main()
