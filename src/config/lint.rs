//! Near-miss warnings of `admitd check`: a name the file uses that is not declared, but looks like a
//! typo of one that is.
//!
//! A tool may name an upstream that has no `[upstreams.*]` section (the call then spends no upstream
//! budget), so `upstream = "warehose"` beside `[upstreams.warehouse]` is valid, and silently limits
//! nothing. Such a file is not refused (the name may be meant: an upstream known only to the
//! in-server calls, limited elsewhere), but `admitd check` says `FILE:LINE: warning: ...` and still
//! exits 0. A tenant's plan must be declared (an unknown one is an error); its error message uses the
//! same rule to say which plan was probably meant ([`did_you_mean`]).
//!
//! Every check is a list of declared names and a list of used names with where they are; a new kind
//! of name adds one pair in [`near_misses`]. The spend units of `[spend.*]` (used as
//! `[tools.NAME.spend]` and `[plans.NAME.spend.UNIT]` keys) need none: an undeclared unit is an
//! error, since an estimate or budget of no unit could only be dropped, and its message names the
//! near unit with the same rule ([`did_you_mean`]).

use std::ops::Range;

use super::raw::{line_of, RawConfig};
use super::ConfigError;

/// Damerau-Levenshtein distance (adjacent transpositions count as one edit), on characters.
fn distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().collect();
    let b: Vec<char> = b.chars().collect();
    let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
    for (i, row) in d.iter_mut().enumerate() {
        row[0] = i;
    }
    for (j, cell) in d[0].iter_mut().enumerate() {
        *cell = j;
    }
    for i in 1..=a.len() {
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            let mut v = (d[i - 1][j] + 1)
                .min(d[i][j - 1] + 1)
                .min(d[i - 1][j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                v = v.min(d[i - 2][j - 2] + 1);
            }
            d[i][j] = v;
        }
    }
    d[a.len()][b.len()]
}

/// Whether `used` looks like a typo of `declared`: the same but for case, `-`/`_`, or a few edits
/// (one for names up to 4 characters, two for longer ones; short names are too alike otherwise).
fn looks_like(used: &str, declared: &str) -> bool {
    if used == declared {
        return false;
    }
    let fold = |s: &str| s.to_lowercase().replace('-', "_");
    if fold(used) == fold(declared) {
        return true;
    }
    let allowed = if declared.chars().count() <= 4 { 1 } else { 2 };
    distance(used, declared) <= allowed
}

/// The declared name `used` most probably means, when it is not itself declared.
pub(super) fn did_you_mean<'a>(
    used: &str,
    declared: impl IntoIterator<Item = &'a str>,
) -> Option<&'a str> {
    declared
        .into_iter()
        .filter(|d| looks_like(used, d))
        .min_by_key(|d| distance(used, d))
}

/// A use of a name: the name, what the file calls it there, and where.
struct Use {
    name: String,
    key: String,
    span: Range<usize>,
}

/// Upstreams named by tools (`upstream`, and the keys of `upstreams`).
fn upstream_uses(raw: &RawConfig) -> Vec<Use> {
    let mut out = Vec::new();
    for (tool, t) in raw.tools.iter().flatten() {
        let t = t.get_ref();
        if let Some(u) = &t.upstream {
            out.push(Use {
                name: u.get_ref().clone(),
                key: format!("tools.{tool}.upstream"),
                span: u.span(),
            });
        }
        if let Some(map) = &t.upstreams {
            for (name, weight) in map.get_ref() {
                out.push(Use {
                    name: name.clone(),
                    key: format!("tools.{tool}.upstreams"),
                    span: weight.span(),
                });
            }
        }
    }
    out
}

/// Every near-miss of the file, in file order, each a `FILE:LINE: warning: ...` once displayed.
/// `text` is a file that [`super::Config::parse`] accepted.
pub fn near_misses(file: &str, text: &str) -> Vec<ConfigError> {
    let Ok(raw) = toml::from_str::<RawConfig>(text) else {
        return Vec::new();
    };
    let upstreams: Vec<&str> = raw
        .upstreams
        .iter()
        .flatten()
        .map(|(n, _)| n.as_str())
        .collect();
    // One entry per kind of name: what it is called, its section, the declared names, the uses.
    // Spend units need no entry: a `[tools.NAME.spend]` or `[plans.NAME.spend.UNIT]` naming a unit
    // that is not declared is an error at validation, which says "did you mean" the near unit.
    let checks = [("upstream", "upstreams", upstreams, upstream_uses(&raw))];
    let mut out: Vec<(usize, ConfigError)> = Vec::new();
    for (what, section, declared, uses) in checks {
        for u in uses {
            if declared.contains(&u.name.as_str()) {
                continue;
            }
            if let Some(meant) = did_you_mean(&u.name, declared.iter().copied()) {
                out.push((
                    u.span.start,
                    ConfigError {
                        file: file.to_string(),
                        line: Some(line_of(text, u.span.start)),
                        message: format!(
                            "warning: {}: {what} {:?} is not declared, but [{section}.{meant}] is: a typo? As written, the {what} {:?} has no limits of its own",
                            u.key, u.name, u.name
                        ),
                    },
                ));
            }
        }
    }
    out.sort_by_key(|(at, _)| *at);
    out.into_iter().map(|(_, e)| e).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typos_are_near_and_other_names_are_not() {
        for (used, declared) in [
            ("warehose", "warehouse"),
            ("wearhouse", "warehouse"),
            ("Warehouse", "warehouse"),
            ("ware-house", "ware_house"),
            ("fre", "free"),
            ("pro", "pr0"),
        ] {
            assert!(looks_like(used, declared), "{used} ~ {declared}");
        }
        for (used, declared) in [
            ("warehouse", "warehouse"),
            ("crm", "erp"),
            ("search", "sales"),
            ("ab", "xy"),
            ("billing", "shipping"),
        ] {
            assert!(!looks_like(used, declared), "{used} !~ {declared}");
        }
        assert_eq!(distance("ab", "ba"), 1);
        assert_eq!(did_you_mean("fre", ["pro", "free", "team"]), Some("free"));
        assert_eq!(did_you_mean("enterprise", ["pro", "free"]), None);
    }

    /// A spend unit near a declared one is not a warning but an error (an estimate or budget in no
    /// unit could only be dropped), and the error names the unit that was probably meant.
    #[test]
    fn a_spend_unit_near_a_declared_one_is_an_error_that_names_it() {
        let units =
            "[spend.usd]\nestimate = 0.01\ntenant_daily = 5\n[spend.tokens]\nestimate = 100\n";
        let err = |rest: &str| {
            let text = format!("{units}{rest}");
            assert!(
                near_misses("a.toml", &text).is_empty(),
                "no warning beside the error"
            );
            super::super::Config::parse("a.toml", &text)
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            err("[tools.summarize.spend]\nuds = 0.02\n"),
            "a.toml:7: tools.summarize.spend.uds: unknown spend unit \"uds\" (did you mean \"usd\"? configured units: tokens, usd)"
        );
        assert_eq!(
            err("[plans.free.spend.Tokens]\nrun = 5\n"),
            "a.toml:6: plans.free.spend.Tokens: unknown spend unit \"Tokens\" (did you mean \"tokens\"? configured units: tokens, usd)"
        );
        // A unit like none of them lists them without a guess.
        assert_eq!(
            err("[tools.summarize.spend]\nrows = 1\n"),
            "a.toml:7: tools.summarize.spend.rows: unknown spend unit \"rows\" (configured units: tokens, usd)"
        );
    }

    #[test]
    fn a_tools_upstream_near_a_declared_one_is_warned_about_on_its_line() {
        let text = "[upstreams.warehouse]\nrate = \"5/s\"\nburst = 5\n\n\
                    [tools.get_sales]\nupstream = \"warehose\"\n\n\
                    [tools.report]\nupstreams = { \"Warehouse\" = 1, crm = 2 }\n\n\
                    [tools.ok]\nupstream = \"warehouse\"\n\n\
                    [tools.elsewhere]\nupstream = \"billing\"\n";
        let w = near_misses("a.toml", text);
        let shown: Vec<String> = w.iter().map(ToString::to_string).collect();
        assert_eq!(shown.len(), 2, "{shown:#?}");
        assert!(shown[0].starts_with("a.toml:6: warning: tools.get_sales.upstream: upstream \"warehose\" is not declared, but [upstreams.warehouse] is"), "{}", shown[0]);
        assert!(
            shown[1]
                .starts_with("a.toml:9: warning: tools.report.upstreams: upstream \"Warehouse\""),
            "{}",
            shown[1]
        );
    }
}
