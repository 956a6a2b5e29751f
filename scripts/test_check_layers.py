"""Tests of scripts/check_layers.sh on small source trees built for each case."""

import os
import subprocess
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check_layers.sh")


def check(files, max_lines=None):
    """Runs the check over a tree holding `files` ({path: text}); returns (exit code, stderr)."""
    with tempfile.TemporaryDirectory() as root:
        os.makedirs(os.path.join(root, "src", "engine"))
        for path, text in files.items():
            full = os.path.join(root, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w") as f:
                f.write(text)
        env = dict(os.environ)
        if max_lines is not None:
            env["MAX_CODE_LINES"] = str(max_lines)
        r = subprocess.run(["bash", SCRIPT, root], capture_output=True, text=True, env=env)
        return r.returncode, r.stderr


CLEAN_ENGINE = "use crate::clock::Clock;\nuse crate::config::{BucketSpec, Config};\nfn f() {}\n"


class CheckLayers(unittest.TestCase):
    def test_a_clean_tree_passes(self):
        code, err = check({"src/engine/tenant.rs": CLEAN_ENGINE, "src/api/mod.rs": "use crate::telemetry::X;\n"})
        self.assertEqual((code, err), (0, ""))

    def test_an_engine_import_of_telemetry_fails_with_its_line(self):
        code, err = check({"src/engine/tenant.rs": CLEAN_ENGINE + "use crate::telemetry::labels::SubjectLabels;\n"})
        self.assertEqual(code, 1)
        self.assertIn("src/engine/tenant.rs:4:", err)

    def test_every_upward_room_and_form_is_caught(self):
        for line in [
            "use crate::actors::TenantActor;",
            "fn f(x: crate::api::ApiError) {}",
            "use crate::server::run;",
            "use super::super::telemetry::Spans;",
            "use crate::{clock::Clock, api::check_name};",
            "use crate::{\n    clock::Clock,\n    telemetry::labels::SubjectLabels,\n};",
        ]:
            with self.subTest(line=line):
                code, err = check({"src/engine/x.rs": line + "\n"})
                self.assertEqual(code, 1, err)
                self.assertIn("must not depend", err)

    def test_names_that_only_contain_a_room_pass(self):
        code, err = check({"src/engine/x.rs": "use crate::config::{ServerConfig, TelemetryConfig};\nlet api_key = 1;\n"})
        self.assertEqual((code, err), (0, ""))

    def test_engine_code_may_not_parse_config_but_its_tests_may(self):
        code, err = check({"src/engine/x.rs": "fn f() { let c = Config::parse(\"f\", t); }\n"})
        self.assertEqual(code, 1)
        self.assertIn("not the config file", err)
        code, err = check({
            "src/engine/x.rs": "fn f() {}\n#[cfg(test)]\nmod t { fn g() { Config::parse(\"f\", t); } }\n",
            "src/engine/tests.rs": "fn g() { Config::parse(\"f\", t); }\n",
        })
        self.assertEqual((code, err), (0, ""))

    def test_a_file_over_the_limit_fails_but_comments_blanks_and_tests_do_not_count(self):
        body = "//! doc\n\n" + "fn a() {}\n" * 5 + "// note\n\n"
        tests = "#[cfg(test)]\nmod tests {\n" + "fn t() {}\n" * 50 + "}\n"
        self.assertEqual(check({"src/api/x.rs": body + tests}, max_lines=5), (0, ""))
        code, err = check({"src/api/x.rs": body + "fn b() {}\n" + tests}, max_lines=5)
        self.assertEqual(code, 1)
        self.assertIn("src/api/x.rs: 6 lines of code", err)
        self.assertEqual(check({"src/engine/upstream_tests.rs": "fn t() {}\n" * 9}, max_lines=5), (0, ""))


if __name__ == "__main__":
    unittest.main()
