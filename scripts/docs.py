#!/usr/bin/env python3
"""Keeps the documentation true to files the tests run, and its internal links resolving.

    python3 scripts/docs.py snippets          # rewrite every included snippet from its source
    python3 scripts/docs.py snippets --check  # fail when a page drifted from its sources
    python3 scripts/docs.py links             # fail on an internal link or anchor that does not resolve

A snippet in a Markdown page is the code block between

    <!-- snippet: PATH REGION -->
    ```lang
    ...
    ```
    <!-- /snippet -->

taken from the lines between ``[REGION]`` and ``[/REGION]`` markers in PATH (a comment in the
file's own syntax), or the whole file when REGION is ``-``. Links are checked in README.md and
every page under docs/: a relative link must name an existing file, and an ``#anchor`` a heading
of the page it points to (GitHub's anchor rules)."""

from __future__ import annotations

import os
import re
import sys
from typing import Dict, Iterator, List, Optional, Tuple

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

SNIPPET = re.compile(
    r"(<!-- snippet: (?P<path>\S+) (?P<region>\S+) -->\n```(?P<lang>[\w-]*)\n)(?P<body>.*?)(```\n<!-- /snippet -->)",
    re.S,
)
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def region_of(text: str, region: str, where: str) -> str:
    """The lines strictly between the ``[region]`` and ``[/region]`` marker lines."""
    if region == "-":
        return text if text.endswith("\n") else text + "\n"
    lines = text.splitlines(keepends=True)
    start = [i for i, l in enumerate(lines) if l.strip().endswith(f"[{region}]") and "[/" not in l]
    end = [i for i, l in enumerate(lines) if l.strip().endswith(f"[/{region}]")]
    if len(start) != 1 or len(end) != 1 or end[0] <= start[0]:
        raise ValueError(f"{where}: region [{region}] must be marked exactly once, start before end")
    body = lines[start[0] + 1 : end[0]]
    # Drop the common indentation, so a region inside a function reads as top-level code.
    indents = [len(l) - len(l.lstrip()) for l in body if l.strip()]
    cut = min(indents) if indents else 0
    return "".join(l[cut:] if l.strip() else "\n" for l in body)


def render(page: str, text: str) -> str:
    def fill(m: "re.Match[str]") -> str:
        src = os.path.join(ROOT, m.group("path"))
        where = f"{os.path.relpath(page, ROOT)}: snippet {m.group('path')}"
        if not os.path.isfile(src):
            raise ValueError(f"{where}: no such file")
        with open(src) as f:
            body = region_of(f.read(), m.group("region"), where)
        return m.group(1) + body + m.group(6)

    return SNIPPET.sub(fill, text)


def pages() -> List[str]:
    found = [os.path.join(ROOT, "README.md")]
    for dirpath, _, files in os.walk(os.path.join(ROOT, "docs")):
        found += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".md")]
    return found


def snippets(check: bool) -> int:
    drifted = []
    for page in pages():
        with open(page) as f:
            text = f.read()
        new = render(page, text)
        if new != text:
            drifted.append(os.path.relpath(page, ROOT))
            if not check:
                with open(page, "w") as f:
                    f.write(new)
    if check and drifted:
        print(f"snippets drifted from their sources in {', '.join(drifted)}: run scripts/docs.py snippets")
        return 1
    return 0


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to -."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def outside_code(text: str) -> Iterator[Tuple[int, str]]:
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def anchors(path: str, cache: Dict[str, set]) -> set:
    if path not in cache:
        with open(path) as f:
            text = f.read()
        seen: Dict[str, int] = {}
        found = set()
        for _, line in outside_code(text):
            m = HEADING.match(line)
            if m:
                base = slug(m.group(2))
                n = seen.get(base, 0)
                seen[base] = n + 1
                found.add(base if n == 0 else f"{base}-{n}")
        found |= set(re.findall(r'<a (?:name|id)="([^"]+)"', text))
        cache[path] = found
    return cache[path]


def broken_links(page: str, cache: Dict[str, set]) -> List[str]:
    with open(page) as f:
        text = f.read()
    problems = []
    for n, line in outside_code(text):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue  # http:, https:, mailto: ...
            path_part, _, anchor = target.partition("#")
            dest = page if not path_part else os.path.normpath(os.path.join(os.path.dirname(page), path_part))
            where = f"{os.path.relpath(page, ROOT)}:{n}: {target}"
            if not os.path.exists(dest):
                problems.append(f"{where}: no such file")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest, cache):
                problems.append(f"{where}: no heading with anchor #{anchor}")
    return problems


def links() -> int:
    cache: Dict[str, set] = {}
    problems = [p for page in pages() for p in broken_links(page, cache)]
    for p in problems:
        print(p)
    return 1 if problems else 0


def main(argv: List[str]) -> int:
    if argv[:1] == ["snippets"]:
        return snippets(check="--check" in argv[1:])
    if argv[:1] == ["links"]:
        return links()
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
