#!/usr/bin/env python3
"""Instructions redis-server spends per decision of admitd's shared-store script (docs/BENCHMARKS.md,
"Shared store (Redis)"): exact, so two versions of src/store/admitd.lua compare without the noise of
CPU time on a shared machine.

Starts redis-server under callgrind (valgrind) on a free loopback port, loads the script (with the
engine's constants written in, as admitd loads it: `cargo run --example store_script`), sends
script calls of 20 decisions shaped like the shared-store benchmark's (subject, tenant and global
buckets, subject and tenant concurrency; 1 000 tenants x 20 subjects, fresh keys) and prints
callgrind's instruction count between two dumps over the decisions sent, and the commands the
script ran per decision (INFO commandstats).

    python3 scripts/script_cost.py                 # src/store/admitd.lua, 20 script calls
    python3 scripts/script_cost.py --script X.lua --calls 50
    python3 scripts/script_cost.py --warm 200      # keys seen before: a busy fleet's steady state
    python3 scripts/script_cost.py --release       # each decision and its release
    python3 scripts/script_cost.py --warm 200 --server path/to/redis-server --top 40

`--top N` prints the N functions of redis-server that ran the most instructions over the count
(callgrind_annotate, exclusive): the Lua VM (luaV_execute), its tables (luaH_*) and strings
(luaS_*), its garbage collector, the commands the script runs, or the script call's own machinery.
Debian's redis-server is stripped and shows one line: `--server` runs another build (one of the
same version, from Redis's source with its default flags, for the functions' names) instead.
"""
import argparse, glob, os, random, re, socket, struct, subprocess, tempfile, time

def enc(*args):
    out = [b'*%d\r\n' % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b'$%d\r\n%s\r\n' % (len(a), a))
    return b''.join(out)

class Redis:
    def __init__(self, port):
        self.s = socket.create_connection(('127.0.0.1', port))
        self.f = self.s.makefile('rb')
    def cmd(self, *a):
        self.s.sendall(enc(*a))
        return self.read()
    def read(self):
        line = self.f.readline()
        t, r = line[:1], line[1:-2]
        if t == b'+': return r.decode()
        if t == b'-': raise RuntimeError(r.decode())
        if t == b':': return int(r)
        if t == b'$':
            n = int(r)
            return None if n < 0 else self.f.read(n + 2)[:-2].decode()
        if t == b'*':
            return [self.read() for _ in range(max(int(r), 0))]
        raise RuntimeError('unexpected answer %r' % line)

def mp(*items):
    """MessagePack, as src/store/spec.rs writes a decision's spec (scalars) and its lease data (a map)."""
    out = []
    for x in items:
        if x is None: out.append(b'\xc0')
        elif x is True: out.append(b'\xc3')
        elif x is False: out.append(b'\xc2')
        # As src/store/pack.rs writes a number: a small whole one in one byte, any other a double.
        elif isinstance(x, (int, float)) and 0 <= x < 128 and x == int(x): out.append(bytes([int(x)]))
        elif isinstance(x, (int, float)): out.append(b'\xcb' + struct.pack('>d', x))
        elif isinstance(x, list): out.append(bytes([0x90 | len(x)]) + mp(*x))
        elif isinstance(x, dict):
            out.append(bytes([0x80 | len(x)]) + b''.join(mp(k, v) for k, v in x.items()))
        else:
            b = x.encode()
            out.append((bytes([0xa0 | len(b)]) if len(b) < 32 else b'\xd9' + bytes([len(b)])) + b)
    return b''.join(out)

def decision(tenant, subject, lease):
    base, idh = 'admitd:{t:%d}' % tenant, '%016x' % lease
    h, m = base + ':h', idh + 'b' + subject
    layers = [(h, 's:%s|' % subject), (h, 't|'), ('admitd:{x}:b:g', '')]
    spec = [True, h, base + ':ls', 'l:' + idh, m, subject, 'tool0', 1, 0, 10e6, False, False, 0.5, 1000,
            120e6, None, '[0,0,0]', lease & 0xff < 4, lease & 0xf == 0, len(layers)]
    for k, fp in layers:
        spec += [None if k == h else k, fp + 'tat', None, 0.1, 1e7, 1, True, None, 120e6, 1e6, 0, 0, 0, 0, 0, 0, 0]
    spec += [2, 's:%s|n' % subject, 1000000, True, None, 0, 't|n', 1000000, False, None, 0]
    spec += [0, 0, 0, 0]
    data = {'subject': subject, 'tool': 'tool0', 'cost': 1, 'keys': [list(l) for l in layers],
            'quotas': [], 'm': m, 'up': []}
    return mp(*spec), mp(data)

def release(tenant, lease):
    base = 'admitd:{t:%d}' % tenant
    # As admitd releases a call that answered (outcome ok): nothing refunded, the upstream report on,
    # the answer accepted and healthy (src/store/spec.rs, `release_spec`).
    return mp(base + ':h', base + ':ls', '%016x' % lease, 'never', True, False, -1, 1e6, -1, False, None, True,
              True, 0)

def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument('--script', default=os.path.join(here, '..', 'src', 'store', 'admitd.lua'))
    ap.add_argument('--calls', type=int, default=20)
    ap.add_argument('--release', action='store_true',
                    help='release each decision in a script call of its own batch: counts a decision and its release')
    ap.add_argument('--server', default='redis-server', help='the redis-server to run (default: on PATH)')
    ap.add_argument('--top', type=int, default=0,
                    help="print redis-server's N functions that ran the most instructions over the count")
    ap.add_argument('--warm', type=int, default=2,
                    help='script calls before the count: 2 leaves most keys fresh (every hash and lease set'
                         ' gets its first expiry during the count); 200 counts the steady state of a busy'
                         ' fleet, whose keys are pushed once per 10 s')
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix='script-cost-')
    port = next(p for p in range(19600, 19700) if socket.socket().connect_ex(('127.0.0.1', p)) != 0)
    out = os.path.join(work, 'cg.%p')
    srv = subprocess.Popen(['valgrind', '--tool=callgrind', '--callgrind-out-file=' + out, a.server,
                            '--port', str(port), '--bind', '127.0.0.1', '--save', '', '--appendonly', 'no',
                            '--dir', work], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                r = Redis(port); r.cmd('PING'); break
            except OSError:
                time.sleep(0.2)
        text = subprocess.run(['cargo', 'run', '-q', '--example', 'store_script', '--', a.script],
                              cwd=os.path.join(here, '..'), check=True, capture_output=True, text=True).stdout
        sha = r.cmd('SCRIPT', 'LOAD', text)
        random.seed(1)
        def calls(n):
            for _ in range(n):
                args = ['EVALSHA', sha, 1, 'admitd:{t:0}', 'batch']
                made = []
                for _ in range(20):
                    made.append((random.randrange(1000), random.getrandbits(64)))
                    args += ['decide', *decision(made[-1][0], 's%d' % random.randrange(20), made[-1][1])]
                for o in r.cmd(*args):
                    assert o[0] == 'ok', o
                if a.release:
                    args = ['EVALSHA', sha, 1, 'admitd:{t:0}', 'batch']
                    for tenant, lease in made:
                        args += ['release', release(tenant, lease), '']
                    for o in r.cmd(*args):
                        assert o[0] == 'released', o
        calls(a.warm)  # warm: the script compiled, the first keys made
        r.cmd('CONFIG', 'RESETSTAT')
        subprocess.run(['callgrind_control', '-z', str(srv.pid)], capture_output=True)
        calls(a.calls)
        subprocess.run(['callgrind_control', '-d', str(srv.pid)], capture_output=True)
        dumps = sorted(glob.glob(os.path.join(work, 'cg.*')), key=os.path.getmtime)
        total = next(int(l.split()[1]) for l in open(dumps[-1]) if l.startswith(('summary:', 'totals:')))
        inner = 0
        for line in r.cmd('INFO', 'commandstats').split('\r\n'):
            name = line.split(':')[0][len('cmdstat_'):]
            if line.startswith('cmdstat_') and name not in ('evalsha', 'info', 'config|resetstat'):
                inner += int(line.split('calls=')[1].split(',')[0])
        n = a.calls * 20
        what = 'decision and its release' if a.release else 'decision'
        print('%d instructions per %s, %.2f commands per %s (%d decisions)' % (total // n, what, inner / n, what, n))
        if a.top:
            rows = subprocess.run(['callgrind_annotate', '--inclusive=no', '--threshold=100', dumps[-1]],
                                  check=True, capture_output=True, text=True).stdout.splitlines()
            rows = [re.match(r'\s*([\d,]+) \(\s*[\d.]+%\)\s+(\S.*)$', l) for l in rows]
            rows = [m for m in rows if m and not m.group(2).startswith('PROGRAM TOTALS')]
            # Exclusive counts: the entry points above main would show the whole count again.
            rows = [m for m in rows if int(m.group(1).replace(',', '')) < total]
            for m in rows[:a.top]:
                print('%8d per %s  %s' % (int(m.group(1).replace(',', '')) // n, what, m.group(2)))
    finally:
        srv.terminate(); srv.wait()

if __name__ == '__main__':
    main()
