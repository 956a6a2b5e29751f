"""Schemathesis hooks for docs/openapi.yaml (loaded by scripts/schemathesis.sh).

Two string formats of the spec that JSON Schema cannot state exactly, so that every value generated
as valid is one admitd must accept:

- ``admitd-name``: 1 to 128 *bytes* of UTF-8 without control characters (``maxLength`` counts
  characters, which is looser outside ASCII).
- ``http-date``: an RFC 9110 HTTP-date in any of its three forms, for a real calendar date
  (a pattern would also take 31 Feb or a weekday that does not match the date).

And two filters: a generated body whose strings JSON would change on the way is not sent, and a
failure about valid or invalid data is reported only when the body really is what the generator
said it was, judged by the spec with both formats checked exactly.
"""

from __future__ import annotations

import datetime as dt
import os
import re

import schemathesis
import jsonschema_rs
import yaml
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

# A high surrogate right before a low one: JSON writes them as two escapes that every JSON reader
# (admitd's too) reads as one valid character.
SURROGATE_PAIR = re.compile("[\ud800-\udbff][\udc00-\udfff]")


def _strings(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _strings(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


@schemathesis.hook
def filter_body(context, body) -> bool:
    """Drop a generated body that is not what goes on the wire.

    Hypothesis can generate a string with surrogates in it, invalid for a name; where a high one
    comes right before a low one, the body arrives holding one valid character instead, and
    admitd is right to accept it. Such a case tests nothing, so it is not sent. Lone surrogates
    reach admitd as they are and are still sent (admitd answers them 400).
    """
    return not any(SURROGATE_PAIR.search(s) for s in _strings(body))


schemathesis.openapi.format("admitd-name", NAMES)
schemathesis.openapi.format("http-date", HTTP_DATES)


def _is_name(value: object) -> bool:
    return isinstance(value, str) and 1 <= len(value.encode("utf-8", "surrogatepass")) <= 128


_DAY = "(?P<day>\\d\\d)"
_TIME = "(?P<h>\\d\\d):(?P<m>\\d\\d):(?P<s>\\d\\d)"
_MONTH = f"(?P<mon>{'|'.join(MONTHS)})"
# Each form with its writer: a string is an HTTP-date when it names a real time from 1970 on in
# one form and that time written back in that form is the same string (so the weekday is right).
_DATE_FORMS = (
    (re.compile(f"[A-Za-z]{{3}}, {_DAY} {_MONTH} (?P<year>\\d{{4}}) {_TIME} GMT"), imf_fixdate),
    (re.compile(f"[A-Za-z]+, {_DAY}-{_MONTH}-(?P<yy>\\d\\d) {_TIME} GMT"), rfc850),
    (
        re.compile(f"[A-Za-z]{{3}} {_MONTH} (?P<day>[ \\d]\\d) {_TIME} (?P<year>\\d{{4}})"),
        asctime,
    ),
)


def _is_http_date(value: object) -> bool:
    if not isinstance(value, str):
        return False
    for form, write in _DATE_FORMS:
        match = form.fullmatch(value)
        if match is None:
            continue
        fields = match.groupdict()
        if "yy" in fields:
            # As admitd reads a two-digit year: 70-99 are 19xx, 00-69 are 20xx.
            yy = int(fields["yy"])
            year = 1900 + yy if yy >= 70 else 2000 + yy
        else:
            year = int(fields["year"])
        try:
            parsed = dt.datetime(
                year,
                MONTHS.index(fields["mon"]) + 1,
                int(fields["day"]),
                int(fields["h"]),
                int(fields["m"]),
                int(fields["s"]),
            )
        except ValueError:
            return False
        return year >= 1970 and write(parsed) == value
    return False


def _load_spec() -> dict:
    with open(os.environ["ADMITD_ST_SPEC"], encoding="utf-8") as f:
        return yaml.safe_load(f)


SPEC = _load_spec()
_VALIDATORS: dict[tuple[str, str], object] = {}


def _body_validator(path: str, method: str):
    key = (path, method)
    if key not in _VALIDATORS:
        operation = SPEC["paths"].get(path, {}).get(method, {})
        content = operation.get("requestBody", {}).get("content", {})
        schema = content.get("application/json", {}).get("schema")
        _VALIDATORS[key] = (
            None
            if schema is None
            else jsonschema_rs.validator_for(
                # The components travel with the schema, so that its `$ref`s resolve.
                {**schema, "components": SPEC["components"]},
                formats={"admitd-name": _is_name, "http-date": _is_http_date},
                validate_formats=True,
            )
        )
    return _VALIDATORS[key]


def _body_is_valid(case) -> bool | None:
    """Whether the case's body is valid by the spec, formats included; None where there is no
    body schema to judge it by."""
    validator = _body_validator(case.path, case.method.lower())
    return None if validator is None else validator.is_valid(case.body)


def _unconfigured_spend_unit(response) -> bool:
    """Whether the answer refuses a spend unit that the daemon's config does not declare: the spec
    allows any unit name (`[spend.NAME]`), and which ones exist is the running config's to say."""
    if response is None or response.status_code != 400:
        return False
    try:
        body = response.json()
    except ValueError:
        return False
    return (
        isinstance(body, dict)
        and body.get("error") == "invalid_request"
        and "which is not configured" in str(body.get("message", ""))
    )


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    """Drop a failure that blames admitd for a body the generator mislabelled.

    Two ways: a body generated as invalid that is valid (ST201, "invalid data accepted"), when the
    body is the only part made invalid; and a body generated as valid that is not (ST202, "valid
    data rejected"), as the stateful phase can make for a format it does not apply.
    """
    if case.meta is None or failure.code not in ("ST201", "ST202"):
        return True
    if failure.code == "ST202" and _unconfigured_spend_unit(response):
        return False
    if failure.code == "ST201":
        negative = [
            location for location, info in case.meta.components.items() if info.mode.is_negative
        ]
        if [location.name for location in negative] != ["BODY"]:
            return True
        return _body_is_valid(case) is not True
    return _body_is_valid(case) is not False
