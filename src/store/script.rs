//! The shared-store script as Redis runs it: `admitd.lua` with the engine's constants written in.
//!
//! Where the script applies a rule of the engine (the promise horizon and grace, the stagger of
//! upstream hints, the adaptive window's slots, the concurrency slot margin, the AIMD snap, the
//! served meter's restart, an adaptive refusal's wait), its text names the constant as a placeholder, `${NAME}`, and [`text`]
//! writes in the engine's own value: one definition, in Rust. The store loads only that text (its
//! SHA follows the values). A placeholder without a value, or a value the script no longer names, is
//! an error the store refuses to start with (and this module's tests catch first); an unwritten
//! placeholder would not compile either, `$` not being Lua.

use std::sync::OnceLock;

use crate::clock::Nanos;
use crate::engine::{adaptive, bucket, probe, slots};

/// The script as written, with its placeholders.
const TEMPLATE: &str = include_str!("admitd.lua");

/// A duration in the script's unit, microseconds.
fn us(ns: Nanos) -> String {
    (ns / 1_000).to_string()
}

/// Each placeholder of the script and the engine's value for it.
fn constants() -> Vec<(&'static str, String)> {
    vec![
        ("PROMISE_HORIZON", us(bucket::PROMISE_HORIZON)),
        ("PROMISE_GRACE", us(bucket::PROMISE_GRACE)),
        ("STAGGER_MIN_WINDOW", us(bucket::STAGGER_MIN_WINDOW)),
        ("SRE_SLOTS", adaptive::SRE_SLOTS.to_string()),
        ("MARGIN_SHARE", slots::MARGIN_SHARE.to_string()),
        ("MARGIN_MIN", us(slots::MARGIN_MIN)),
        ("MARGIN_MAX", us(slots::MARGIN_MAX)),
        ("DEFAULT_RUN", us(slots::DEFAULT_RUN_NS)),
        ("AIMD_SNAP", format!("{:?}", adaptive::AIMD_SNAP)),
        (
            "ADAPTIVE_WAIT_PER_ODDS",
            format!("{:?}", adaptive::ADAPTIVE_WAIT_PER_ODDS),
        ),
        (
            "ADAPTIVE_LEAST_ACCEPT",
            format!("{:?}", adaptive::ADAPTIVE_LEAST_ACCEPT),
        ),
        ("ADAPTIVE_WAIT_MIN", us(adaptive::ADAPTIVE_WAIT_MIN)),
        ("ADAPTIVE_WAIT_MAX", us(adaptive::ADAPTIVE_WAIT_MAX)),
        ("METER_RESTART", format!("{:?}", probe::METER_RESTART)),
    ]
}

/// A text of the script (another version of `admitd.lua`, for tools that run it outside admitd)
/// with the engine's constants written in, as [`text`] is.
pub fn render(template: &str) -> Result<String, String> {
    render_with(template, &constants())
}

/// `template` with each `${NAME}` replaced by its value. Every placeholder must have a value and
/// every value must be used; errors name the script's line.
fn render_with(template: &str, values: &[(&'static str, String)]) -> Result<String, String> {
    let line = |at: usize| template[..at].matches('\n').count() + 1;
    let mut out = String::with_capacity(template.len());
    let mut used = vec![false; values.len()];
    let mut done = 0;
    while let Some(i) = template[done..].find("${").map(|i| done + i) {
        out.push_str(&template[done..i]);
        let name_at = i + 2;
        let end = template[name_at..]
            .find('}')
            .map(|e| name_at + e)
            .filter(|&e| !template[name_at..e].contains('\n'))
            .ok_or_else(|| format!("admitd.lua:{}: a placeholder without its `}}`", line(i)))?;
        let name = &template[name_at..end];
        let k = values
            .iter()
            .position(|(n, _)| *n == name)
            .ok_or_else(|| format!("admitd.lua:{}: no value for `${{{name}}}`", line(i)))?;
        used[k] = true;
        out.push_str(&values[k].1);
        done = end + 1;
    }
    out.push_str(&template[done..]);
    if let Some(k) = used.iter().position(|u| !u) {
        return Err(format!(
            "admitd.lua names no `${{{}}}`: the engine's value would not reach it",
            values[k].0
        ));
    }
    Ok(out)
}

/// The script Redis loads: its text with the engine's constants written in, built once.
pub fn text() -> Result<&'static str, String> {
    static TEXT: OnceLock<Result<String, String>> = OnceLock::new();
    TEXT.get_or_init(|| render(TEMPLATE))
        .as_deref()
        .map_err(Clone::clone)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_script_loaded_has_every_placeholder_written_in() {
        let text = text().expect("the script renders");
        assert!(!text.contains("${"), "a placeholder is left in the script");
        // The engine's values, in microseconds.
        assert!(text.contains("local HORIZON = 60000000 "));
        assert!(text.contains("local GRACE = 1000000 "));
        assert!(text.contains("local SRE_SLOTS = 24 "));
        assert!(text.contains("local MARGIN_MIN, MARGIN_MAX = 20000, 250000 "));
        assert!(text.contains("local AIMD_SNAP = 1e-9 "));
        // Nothing else changed: the text around the placeholders is the script's.
        assert_eq!(
            text.lines().count(),
            TEMPLATE.lines().count(),
            "rendering keeps every line in its place (error lines match the file)"
        );
    }

    #[test]
    fn the_sha_redis_runs_follows_the_values() {
        let loaded = redis::Script::new(text().unwrap());
        let other = render_with(
            TEMPLATE,
            &constants()
                .into_iter()
                .map(|(n, v)| {
                    if n == "SRE_SLOTS" {
                        (n, "12".to_string())
                    } else {
                        (n, v)
                    }
                })
                .collect::<Vec<_>>(),
        )
        .unwrap();
        assert_ne!(
            loaded.get_hash(),
            redis::Script::new(&other).get_hash(),
            "another engine constant is another script"
        );
    }

    #[test]
    fn a_placeholder_without_a_value_is_refused_with_its_line() {
        let values = vec![("A", "1".to_string())];
        let err = render_with("local a = ${A}\nlocal b = ${B}\n", &values).unwrap_err();
        assert_eq!(err, "admitd.lua:2: no value for `${B}`");
        let err = render_with("local a = ${A}\nlocal b = ${B\n}", &values).unwrap_err();
        assert_eq!(err, "admitd.lua:2: a placeholder without its `}`");
    }

    #[test]
    fn a_value_the_script_does_not_name_is_refused() {
        let values = vec![("A", "1".to_string()), ("B", "2".to_string())];
        let err = render_with("local a = ${A}\n", &values).unwrap_err();
        assert!(err.contains("`${B}`"), "{err}");
        // Lua's own `$` (pattern anchors) is no placeholder.
        assert_eq!(
            render_with("local a = ${A} .. match(x, '^a$')", &values[..1]).unwrap(),
            "local a = 1 .. match(x, '^a$')"
        );
    }
}
