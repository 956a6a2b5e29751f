#!/usr/bin/env python3
"""Where a server's CPU time per request goes, by phase of the request, from `perf script` output.

    perf script -i admitd.perf -F tid,ip,sym > admitd.txt
    scripts/phases.py admitd.txt 16.6                  # 16.6: the run's server CPU us per request
    scripts/phases.py a.txt 11.4 b.txt 16.6            # two runs side by side, with the difference
    scripts/phases.py a.txt 11.4 b.txt 16.6 --within decision   # the leaf functions of one phase

Each sample (recorded with `--call-graph dwarf`, so inlined frames are named) is put in the first phase
whose pattern appears anywhere in its call stack, in the order of PHASES; its share of the samples
times the CPU per request gives microseconds per request. `scripts/profile.sh` records the input.
"""

import collections
import re
import signal
import sys

# (phase, patterns), most specific first: the decision runs inside the actor's task, which runs
# inside the worker's event loop, which also runs the HTTP connections.
PHASES = [
    ("tick", ["Handler<admitd::actors::tenant::Tick>", "admitd::actors::Shared::tick_arbiter"]),
    ("telemetry", ["admitd::telemetry::"]),
    ("decision", ["Handler<admitd::actors::tenant::Admit>", "Handler<admitd::actors::tenant::Release>"]),
    ("answer", ["admitd::api::admit::answer", "admitd::api::admit::write_"]),
    ("api", ["admitd::api::", "admitd::actors::Shared::"]),
    ("http", ["hyper::", "hyper_util::", "httparse::", "http::header"]),
    ("actor hop", ["actix::", "atomic_waker", "tokio::sync::oneshot"]),
]
USER_PREFIXES = ("admitd", "hyper", "http", "tokio", "actix", "core", "alloc", "std", "_rjem", "__mem",
                 "hashbrown", "serde", "bytes", "futures", "<", "[unknown]")


def samples(path):
    """Yields each sample's stack, leaf first, as a list of symbol names."""
    stack = None
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("\t"):
                parts = line.strip().split(None, 1)
                if stack is not None and len(parts) == 2:
                    stack.append(parts[1])
            elif line.strip():
                if stack:
                    yield stack
                stack = []
    if stack:
        yield stack


def leaf(stack):
    """The function the sample was taken in (its first frame that is not an inlined caller's)."""
    return next((f for f in stack if "(inlined)" not in f), stack[0])


def phase(stack):
    kernel = not leaf(stack).startswith(USER_PREFIXES)
    for name, patterns in PHASES:
        if any(p in f for f in stack for p in patterns):
            return f"{name} (kernel)" if kernel else name
    return "other (kernel)" if kernel else "other"


def where(stack):
    """The leaf and the innermost admitd function around it."""
    own = next((f for f in stack if f.startswith(("admitd::", "<admitd::")) and f != leaf(stack)), "")
    short = re.sub(r"<[^<>]*>", "", leaf(stack))[:60]
    return f"{short}  in  {own.replace(' (inlined)', '')[:90]}" if own else short


def table(path, per_request, within):
    stacks = list(samples(path))
    if not stacks:
        sys.exit(f"{path}: no samples (record with --call-graph dwarf; print with -F tid,ip,sym)")
    if within:
        counts = collections.Counter(where(s) for s in stacks if phase(s).split(" (")[0] == within)
    else:
        counts = collections.Counter(phase(s) for s in stacks)
    return {k: v * per_request / len(stacks) for k, v in counts.items()}


def main(argv):
    within = None
    if "--within" in argv:
        i = argv.index("--within")
        if i + 1 >= len(argv):
            sys.exit("--within needs a phase name\n" + __doc__)
        within = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    if len(argv) not in (2, 4):
        sys.exit(__doc__)
    runs = [table(argv[i], float(argv[i + 1]), within) for i in range(0, len(argv), 2)]
    keys = sorted(set().union(*runs), key=lambda k: -max(r.get(k, 0) for r in runs))
    if within:
        keys = keys[:30]
    print("us per request" + ("".join(f"  {'run ' + str(i + 1):>8}" for i in range(len(runs))))
          + ("  difference" if len(runs) == 2 else ""))
    for k in keys:
        vals = [r.get(k, 0.0) for r in runs]
        row = "".join(f"  {v:8.2f}" for v in vals)
        if len(runs) == 2:
            row += f"  {vals[1] - vals[0]:+10.2f}"
        print(f"{row}  {k}")
    totals = [sum(r.values()) for r in runs]
    print("".join(f"  {t:8.2f}" for t in totals) + "  total")


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `| head` ends the output quietly
    main(sys.argv[1:])
