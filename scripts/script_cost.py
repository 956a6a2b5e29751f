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
"""
import argparse, glob, json, os, random, socket, subprocess, tempfile, time

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

def decision(tenant, subject, lease):
    base, idh = 'admitd:{t:%d}' % tenant, '%016x' % lease
    def layer(k, fp):
        return {'k': k, 'fp': fp, 'T': 0.1, 'b': 1e7, 'n': 1, 'hold': True, 'm': '', 'f': 120e6, 'pl': 1e6}
    spec = {'own': True, 'h': base + ':h', 'z': base + ':ls', 'id': idh, 'm': idh + 'b' + subject,
            'subject': subject, 'tool': 'tool0', 'cost': 1, 'max_wait': 0, 'ttl': 10e6, 'shadow': False,
            'returning': False, 'rand': 0.5, 'floor': 1000, 'forget': 120e6, 'pen': [], 'ad': [],
            'conc': [{'f': 's:%s|n' % subject, 'cap': 1000000, 'sub': True, 'cursor': 'cs:' + subject},
                     {'f': 't|n', 'cap': 1000000, 'sub': False, 'cursor': 'ct'}],
            'quota': [], 'index': '',
            'layers': [layer(base + ':h', 's:%s|' % subject), layer(base + ':h', 't|'), layer('admitd:{x}:b:g', '')]}
    data = {'subject': subject, 'tool': 'tool0', 'cost': 1, 'keys': [[l['k'], l['fp']] for l in spec['layers']],
            'quotas': [], 'm': spec['m'], 'up': []}
    return json.dumps(spec), json.dumps(data)

def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser()
    ap.add_argument('--script', default=os.path.join(here, '..', 'src', 'store', 'admitd.lua'))
    ap.add_argument('--calls', type=int, default=20)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix='script-cost-')
    port = next(p for p in range(19600, 19700) if socket.socket().connect_ex(('127.0.0.1', p)) != 0)
    out = os.path.join(work, 'cg.%p')
    srv = subprocess.Popen(['valgrind', '--tool=callgrind', '--callgrind-out-file=' + out, 'redis-server',
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
                for _ in range(20):
                    args += ['decide', *decision(random.randrange(1000), 's%d' % random.randrange(20), random.getrandbits(64))]
                for o in r.cmd(*args):
                    assert o[0] == 'ok', o
        calls(2)  # warm: the script compiled, the first keys made
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
        print('%d instructions per decision, %.2f commands per decision (%d decisions)' % (total // n, inner / n, n))
    finally:
        srv.terminate(); srv.wait()

if __name__ == '__main__':
    main()
