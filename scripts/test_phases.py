"""Tests of scripts/phases.py on a small, hand-written `perf script` output."""

import contextlib
import io
import os
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import phases  # noqa: E402

# Four samples: a decision (an inlined map lookup inside the tenant actor's handler), the kernel
# under hyper's write, telemetry, and a frame nothing matches.
PERF_SCRIPT = """\
 1197 
\t     1 hashbrown::raw::RawTable<T,A>::find (inlined)
\t     1 hashbrown::map::HashMap<K,V,S,A>::get
\t     2 admitd::engine::tenant::TenantEngine::subject_names (inlined)
\t     2 admitd::engine::tenant::TenantEngine::resolve
\t     3 <admitd::actors::tenant::TenantActor as actix::handler::Handler<admitd::actors::tenant::Admit>>::handle
\t     4 tokio::task::local::LocalSet::tick

 1197 
\t     5 tcp_sendmsg_locked
\t     6 __x64_sys_sendto
\t     7 hyper::proto::h1::dispatch::Dispatcher<D,Bs,I,T>::poll_write
\t     4 tokio::task::local::LocalSet::tick

 1198 
\t     8 admitd::telemetry::metrics::MetricsActor::record_other
\t     9 actix::context_impl::ContextFut<A,C>::poll

 1197 
\t    10 read_tsc

"""


class PhasesTest(unittest.TestCase):
    def setUp(self):
        fd, self.path = tempfile.mkstemp(suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(PERF_SCRIPT)

    def tearDown(self):
        os.unlink(self.path)

    def test_samples_are_split_and_classified_by_their_innermost_matching_phase(self):
        stacks = list(phases.samples(self.path))
        self.assertEqual(len(stacks), 4)
        self.assertEqual([phases.phase(s) for s in stacks],
                         ["decision", "http (kernel)", "telemetry", "other (kernel)"])

    def test_shares_of_samples_become_microseconds_per_request(self):
        t = phases.table(self.path, 8.0, None)
        self.assertEqual(t, {"decision": 2.0, "http (kernel)": 2.0, "telemetry": 2.0,
                             "other (kernel)": 2.0})

    def test_within_a_phase_samples_are_named_by_leaf_and_admitd_caller(self):
        t = phases.table(self.path, 4.0, "decision")
        self.assertEqual(list(t), [
            "hashbrown::map::HashMap::get  in  admitd::engine::tenant::TenantEngine::subject_names"])
        self.assertEqual(t[list(t)[0]], 1.0)

    def test_two_runs_print_their_difference(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            phases.main([self.path, "8", self.path, "12"])
        lines = out.getvalue().splitlines()
        self.assertIn("difference", lines[0])
        decision = next(line for line in lines if line.endswith("  decision"))
        self.assertEqual(decision.split()[:3], ["2.00", "3.00", "+1.00"])
        self.assertEqual(lines[-1].split()[:2], ["8.00", "12.00"])

    def test_bad_arguments_exit_with_the_usage_instead_of_a_traceback(self):
        for argv in ([self.path], [self.path, "8", "--within"]):
            with self.assertRaises(SystemExit) as e:
                phases.main(argv)
            self.assertIn("scripts/phases.py", str(e.exception.code))


if __name__ == "__main__":
    unittest.main()
