"""Tests of scripts/walkthrough.py's placeholders and layout: two runs that differ only in timing or
randomness render the same text, exact values stay exact, and a value far from what the text claims
fails the run. No daemon is started here; scripts/test.sh runs the whole walk-through with --check."""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import walkthrough as w  # noqa: E402


def refusal(hint_ms, wait_s, lease="a2acd3070000000161636d65"):
    text = (f"Rate limited: this agent has made too many tool calls in a short time. Wait {wait_s} "
            f"second{'s' if wait_s != 1 else ''}, then retry this call with the same arguments.")
    return ('{"admitted":false,"scope":"upstream_penalty","reason":"upstream asked to slow down",'
            f'"retry_after_ms":{hint_ms},"retryable":true,"lease_id":"{lease}",'
            '"tool_result":{"content":[{"type":"text","text":"' + text + '"}],'
            f'"structuredContent":{{"error":"rate_limited","retry_after_ms":{hint_ms},"retryable":true}},'
            '"isError":true}}')


class Placeholders(unittest.TestCase):
    def test_timing_and_random_values_are_masked_wherever_they_appear(self):
        body = ('{"admitted":true,"lease_id":"000d1ef27e62449061636d65","waited_ms":296,"mode":"enforce",'
                '"remaining":0,"limit":5,"reset_ms":6000,'
                '"buckets":[{"tokens":43,"reset_ms":628}],"quota":{"resets_in_ms":52005901}}')
        shown = w.show_json(body, w.Masks())
        self.assertIn('"lease_id":"<lease id>"', shown)
        self.assertIn('"waited_ms":<ms>', shown)
        self.assertIn('"reset_ms":<ms>', shown)
        self.assertIn('"tokens":<n>', shown)
        self.assertIn('"resets_in_ms":<ms>', shown)
        self.assertIn('"remaining":0,"limit":5', shown)  # exact values stay as they are
        for digits in ("296", "6000", "628", "43", "52005901", "000d1ef2"):
            self.assertNotIn(digits, shown)

    def test_zero_waits_and_hints_are_exact_and_flags_are_never_masked(self):
        body = '{"waited_ms":0,"retry_after_ms":0,"retryable":false,"reset_ms":true}'
        self.assertEqual(w.show_json(body, w.Masks()), body)

    def test_two_runs_differing_only_in_timing_render_the_same(self):
        masks = lambda: w.Masks(keys={"retry_after_ms": w.about(30000, 1000)},  # noqa: E731
                                texts=[w.wait_text(w.about(30, 1))])
        one = w.show_json(refusal(29987, 30, lease="0006726017fd6bdf61636d65"), masks())
        two = w.show_json(refusal(30046, 31, lease="a2acd3060000000061636d65"), masks())
        self.assertEqual(one, two)
        self.assertIn('"retry_after_ms":<about 30000>', one)
        self.assertIn("Wait <about 30> seconds, then retry", one)

    def test_a_value_far_from_what_the_text_claims_fails(self):
        with self.assertRaises(w.Mismatch):
            w.show_json(refusal(1200, 2), w.Masks(keys={"retry_after_ms": w.about(30000, 1000)}))
        with self.assertRaises(w.Mismatch):
            w.wait_text(w.about(20, 1))("Wait 1 second, then retry")
        self.assertEqual(w.about(20, 1)(19), "<about 20>")
        self.assertEqual(w.about(20, 1)(21), "<about 20>")

    def test_wait_text_reads_the_singular_too(self):
        self.assertEqual(w.wait_text(w.always("<n>"))("Wait 1 second, then retry. Wait 3 seconds."),
                         "Wait <n> seconds, then retry. Wait <n> seconds.")
        self.assertEqual(w.wait_text(lambda v: None)("Wait 3 seconds."), "Wait 3 seconds.")

    def test_headers_are_masked_by_rule_and_the_clock_and_length_left_out(self):
        masks = w.Masks(headers={"Retry-After": w.about(30, 1)})
        answer = w.Answer(429, "Too Many Requests",
                          [("content-type", "application/json"), ("retry-after", "31"),
                           ("ratelimit", '"subject";r=4;t=2'), ("content-length", "592"),
                           ("date", "Sat, 05 Dec 2026 07:57:34 GMT")],
                          '{"admitted":false,"retry_after_ms":0}')
        shown = w.Walk.http(answer, masks)
        self.assertEqual(shown, 'HTTP/1.1 429 Too Many Requests\ncontent-type: application/json\n'
                                'retry-after: <about 30>\nratelimit: "subject";r=4;t=2\n\n'
                                '{"admitted":false,"retry_after_ms":0}')

    def test_lines_that_are_not_whole_json_are_masked_by_the_same_rules(self):
        masks = w.Masks(keys={"retry_after_ms": w.about(1300, 400)})
        self.assertEqual(masks.line('5 "scope":"subject" "retry_after_ms":1187'),
                         '5 "scope":"subject" "retry_after_ms":<about 1300>')
        self.assertEqual(w.Masks().line('1 "remaining":3 "lease_id":"00ab"'), '1 "remaining":3 "lease_id":"<lease id>"')

    def test_a_body_this_script_cannot_reproduce_byte_for_byte_is_refused(self):
        with self.assertRaises(w.Mismatch):
            w.show_json('{"admitted": true}', w.Masks())
        # Floats and escapes come back as the daemon wrote them.
        body = '{"burst":50.0,"rate_per_sec":0.75,"message":"tenant \\"initech\\" holds no state"}'
        self.assertEqual(w.show_json(body, w.Masks()), body)


class Layout(unittest.TestCase):
    def test_what_fits_stays_on_one_line(self):
        self.assertEqual(w.pretty({"released": True}), '{"released":true}')

    def test_a_long_object_breaks_between_members_and_keeps_a_long_text_whole(self):
        text = "x" * 150
        value = {"admitted": False, "scope": "subject", "tool_result": {"content": [{"type": "text", "text": text}],
                                                                         "isError": True}}
        lines = w.pretty(value, width=60).split("\n")
        self.assertEqual(lines[0], '{"admitted":false,"scope":"subject",')
        self.assertEqual(lines[1], ' "tool_result":{"content":[{"type":"text","text":"' + text + '"}],')
        self.assertEqual(lines[2], '  "isError":true}}')

    def test_array_elements_that_are_objects_take_a_line_each_aligned_after_the_bracket(self):
        value = {"subjects": [{"subject": "a", "inflight": 0}, {"subject": "b", "inflight": 2}]}
        self.assertEqual(w.pretty(value, width=45),
                         '{"subjects":[{"subject":"a","inflight":0},\n'
                         '             {"subject":"b","inflight":2}]}')

    def test_placeholders_are_written_verbatim(self):
        self.assertEqual(w.compact({"a": w.Masked("<ms>"), "b": [w.Masked('"<lease id>"')]}),
                         '{"a":<ms>,"b":["<lease id>"]}')


class Commands(unittest.TestCase):
    def test_a_curl_command_shows_the_request_sent_to_the_address_in_a_variable(self):
        cmd = w.curl_command("/v1/admit", '{"tenant":"acme"}', [("traceparent", "00-ab-01")], "-si",
                             tail="| head -2")
        self.assertEqual(cmd, "curl -si $ADMITD/v1/admit -H 'content-type: application/json' \\\n"
                              "  -H 'traceparent: 00-ab-01' \\\n"
                              "  -d '{\"tenant\":\"acme\"}' \\\n"
                              "  | head -2")
        self.assertEqual(w.curl_command("/v1/tenants/acme"), "curl -s $ADMITD/v1/tenants/acme")
        with self.assertRaises(ValueError):
            w.curl_command("/v1/admit", '{"tool":"it\'s"}')

    def test_a_captured_lease_is_pasted_into_the_release(self):
        import subprocess

        cmd = w.captured("printf '%s' '{\"admitted\":true,\"lease_id\":\"00ab\",\"waited_ms\":0}'")
        body = w.with_lease({"lease_id": "x", "outcome": "ok"})
        out = subprocess.run(["sh", "-c", cmd + "\necho " + body], capture_output=True, text=True, check=True)
        self.assertEqual(out.stdout.splitlines()[-1], '{"lease_id":"00ab","outcome":"ok"}')

    def test_splice_replaces_only_the_text_between_the_markers(self):
        readme = f"# t\n\n{w.BEGIN}\nold\n{w.END}\n\n## next\n"
        self.assertEqual(w.splice(readme, "new\n"), f"# t\n\n{w.BEGIN}\nnew\n{w.END}\n\n## next\n")
        with self.assertRaises(ValueError):
            w.splice("# no markers\n", "new")
        with self.assertRaises(ValueError):
            w.splice(f"{w.END}\n{w.BEGIN}\n", "new")


if __name__ == "__main__":
    unittest.main()
