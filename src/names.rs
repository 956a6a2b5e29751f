//! The rule every tenant, subject, tool and upstream name obeys, in a request or in the config file.
//!
//! The API applies it to names that come from a stranger, the config validator to every name the
//! file declares, so that each one is a name a request can address. It lives below both, so that
//! neither imports the other for it. The 128-byte bound also bounds what a name costs in a metric
//! label or a span attribute.

/// Checks a tenant, subject, tool or upstream name: 1 to 128 bytes of UTF-8 without control characters.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("must not be empty".into());
    }
    if name.len() > 128 {
        return Err(format!("is {} bytes long; the limit is 128", name.len()));
    }
    // Printable ASCII, the usual name, is checked byte by byte; anything else is decoded (C1
    // controls are two bytes of UTF-8). What it bought is in docs/BENCHMARKS.md ("Spend budgets").
    let printable = name.bytes().all(|b| (0x20..0x7f).contains(&b));
    if !printable && name.chars().any(char::is_control) {
        return Err("contains a control character".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_name;

    #[test]
    fn names_are_checked() {
        assert!(check_name("acme").is_ok());
        assert!(check_name("").is_err());
        assert!(check_name(&"x".repeat(129)).is_err());
        assert!(check_name(&"x".repeat(128)).is_ok());
        assert!(check_name("a\u{7}b").is_err());
        assert!(check_name("a\u{7f}b").is_err());
        assert!(check_name("a\u{85}b").is_err());
        assert!(check_name("\u{1f}").is_err());
        assert!(check_name(" ~").is_ok());
        assert!(check_name("ünïcødé").is_ok());
    }
}
