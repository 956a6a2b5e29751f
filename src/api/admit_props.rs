//! Property tests of the parsers that read what callers and operators send: the admission body,
//! `Retry-After`, the config file and the state file. Each must answer any input with a value or a
//! clear error, never a panic. `scripts/fuzz.sh` runs them with many more cases
//! (`PROPTEST_CASES`); a failing input found there is kept below as a regression case.

use proptest::prelude::*;

use super::AdmitBody;
use crate::api::body::parse_json;
use crate::api::name_field;
use crate::api::retry_after::{parse_retry_after, MAX_PENALTY};
use crate::config::Config;

/// The contract's admission, to be cut and spliced.
const ADMIT: &str = r#"{"tenant": "acme", "subject": "acme-bot", "tool": "get_sales", "upstream": "warehouse", "cost": 1, "max_wait_ms": 2000, "call_id": "c-17"}"#;

/// A config touching most sections, to be cut and spliced.
const CONFIG: &str = "[server]\nlisten = \"127.0.0.1:9470\"\nmode = \"enforce\"\nmax_wait = \"2s\"\n\n[limits.subject]\nrate = \"120/min\"\nburst = 20\nconcurrency = 8\ndaily_quota = 20000\n\n[plans.free.subject]\nrate = \"30/min\"\nburst = 5\n\n[tenants.globex]\nplan = \"free\"\n\n[tools.get_sales]\ncost = 5\nupstream = \"warehouse\"\n\n[upstreams.warehouse]\nrate = \"20/s\"\nburst = 20\npublished_limit = \"30/s\"\n\n[alerts]\nshed_ratio = 0.5\nwindow = \"5m\"\n";

/// What the admission route does with a body up to the engine: parse, then check the names.
fn admit_fields(bytes: &[u8]) -> Result<(), super::ApiError> {
    let b: AdmitBody = parse_json(bytes)?;
    name_field("tenant", &b.tenant)?;
    name_field("subject", &b.subject)?;
    name_field("tool", &b.tool)?;
    if let Some(u) = &b.upstream {
        name_field("upstream", u)?;
    }
    Ok(())
}

/// `text` with `insert` put in at `at` (a char boundary at or before it) and `cut` bytes removed after.
fn splice(text: &str, at: usize, cut: usize, insert: &str) -> String {
    let mut at = at.min(text.len());
    while !text.is_char_boundary(at) {
        at -= 1;
    }
    let mut end = (at + cut).min(text.len());
    while !text.is_char_boundary(end) {
        end += 1;
    }
    format!("{}{insert}{}", &text[..at], &text[end..])
}

proptest! {
    #[test]
    fn any_bytes_as_an_admission_body_are_parsed_or_refused_with_a_400(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        if let Err(e) = admit_fields(&bytes) {
            prop_assert_eq!(e.status.as_u16(), 400);
            prop_assert!(!e.message.is_empty());
        }
    }

    #[test]
    fn a_spliced_admission_body_is_parsed_or_refused_with_a_400(at in 0usize..200, cut in 0usize..20, insert in "\\PC{0,12}|[\\x00-\\x1f\"\\\\{}\\[\\]:,0-9eE.+-]{0,12}") {
        let body = splice(ADMIT, at, cut, &insert);
        match admit_fields(body.as_bytes()) {
            Ok(()) => {}
            Err(e) => prop_assert_eq!(e.status.as_u16(), 400),
        }
    }

    #[test]
    fn names_of_any_content_are_accepted_exactly_when_the_contract_allows_them(name in "\\PC{0,140}|[\\x00-\\x1f\\x7f a-z]{1,8}") {
        let body = serde_json::json!({"tenant": name, "subject": "s", "tool": "t"}).to_string();
        let valid = !name.is_empty() && name.len() <= 128 && !name.chars().any(char::is_control);
        prop_assert_eq!(admit_fields(body.as_bytes()).is_ok(), valid, "{:?}", name);
    }

    #[test]
    fn any_retry_after_is_a_bounded_delay_or_an_error(value in "\\PC{0,40}|[0-9]{1,25}|[A-Za-z]{3}, [0-9]{1,2} [A-Za-z]{3} [0-9]{1,5} [0-9:]{8} GMT", wall_ms in any::<i64>()) {
        if let Ok(d) = parse_retry_after(&value, wall_ms) {
            prop_assert!(d <= MAX_PENALTY);
        }
    }

    #[test]
    fn a_spliced_config_is_valid_or_one_error_on_a_line_of_the_file(at in 0usize..600, cut in 0usize..30, insert in "\\PC{0,16}|[\\[\\]=\"\\n#.a-z0-9/ ]{0,16}") {
        let text = splice(CONFIG, at, cut, &insert);
        if let Err(e) = Config::parse("p.toml", &text) {
            prop_assert!(!e.message.is_empty());
            let lines = text.lines().count().max(1) + 1;
            prop_assert!(e.line.is_none_or(|l| l >= 1 && l <= lines), "line {:?} of {}", e.line, lines);
        }
    }

    #[test]
    fn any_text_as_a_config_is_valid_or_an_error(text in "\\PC{0,200}") {
        let _ = Config::parse("p.toml", &text);
    }

    #[test]
    fn any_bytes_as_a_state_file_are_read_or_refused(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = crate::state::parse(&bytes);
    }

    #[test]
    fn a_spliced_json_state_file_is_read_or_refused(at in 0usize..120, cut in 0usize..20, insert in "[\\[\\]{}\":,0-9a-z_.-]{0,12}") {
        let text = r#"{"format": "admitd-state", "version": 1, "written_ms": 1700000000000, "tenants": {}}"#;
        let _ = crate::state::parse(splice(text, at, cut, &insert).as_bytes());
    }
}
