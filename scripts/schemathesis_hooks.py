"""Schemathesis hooks for docs/openapi.yaml (loaded by scripts/schemathesis.sh).

Two string formats of the spec that JSON Schema cannot state exactly, so that every value generated
as valid is one admitd must accept:

- ``admitd-name``: 1 to 128 *bytes* of UTF-8 without control characters (``maxLength`` counts
  characters, which is looser outside ASCII).
- ``http-date``: an RFC 9110 HTTP-date in any of its three forms, for a real calendar date
  (a pattern would also take 31 Feb or a weekday that does not match the date).
"""

from __future__ import annotations

import datetime as dt

import schemathesis
from hypothesis import strategies as st

# Cc (control characters) and Cs (surrogates, which UTF-8 cannot encode) are never in a name.
NAMES = st.text(
    alphabet=st.characters(exclude_categories=("Cc", "Cs")),
    min_size=1,
    max_size=128,
).filter(lambda s: len(s.encode("utf-8")) <= 128)

DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
LONG_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def imf_fixdate(t: dt.datetime) -> str:
    # Sun, 06 Nov 1994 08:49:37 GMT
    return (
        f"{DAYS[t.weekday()]}, {t.day:02d} {MONTHS[t.month - 1]} {t.year:04d} "
        f"{t.hour:02d}:{t.minute:02d}:{t.second:02d} GMT"
    )


def rfc850(t: dt.datetime) -> str:
    # Sunday, 06-Nov-94 08:49:37 GMT (two-digit years: 70-99 are 19xx, 00-69 are 20xx)
    return (
        f"{LONG_DAYS[t.weekday()]}, {t.day:02d}-{MONTHS[t.month - 1]}-{t.year % 100:02d} "
        f"{t.hour:02d}:{t.minute:02d}:{t.second:02d} GMT"
    )


def asctime(t: dt.datetime) -> str:
    # Sun Nov  6 08:49:37 1994
    return (
        f"{DAYS[t.weekday()]} {MONTHS[t.month - 1]} {t.day:2d} "
        f"{t.hour:02d}:{t.minute:02d}:{t.second:02d} {t.year:04d}"
    )


def _times(first: int, last: int) -> st.SearchStrategy[dt.datetime]:
    return st.datetimes(
        min_value=dt.datetime(first, 1, 1), max_value=dt.datetime(last, 12, 31, 23, 59, 59)
    ).map(lambda t: t.replace(microsecond=0))


HTTP_DATES = st.one_of(
    _times(1970, 9999).map(imf_fixdate),
    _times(1970, 2069).map(rfc850),
    _times(1970, 9999).map(asctime),
)

schemathesis.openapi.format("admitd-name", NAMES)
schemathesis.openapi.format("http-date", HTTP_DATES)
