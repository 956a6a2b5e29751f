//! The shared-store script's functions, evaluated by a real Redis next to the engine's (the parity
//! tests): the script as the store loads it, cut after one of its functions, on a clock the test
//! sets.

/// How the script reads the store's clock; the parity tests replace it with ARGV[1].
pub const CLOCK: &str = "local now = tonumber(t[1]) * 1000000 + tonumber(t[2])";

/// The script the store loads (the engine's constants written in).
pub fn text() -> &'static str {
    admitd::store::script::text().expect("the script renders")
}

/// The loaded script's text through the end of its top-level function `name` (every function
/// before it included, nothing run), on the clock ARGV[1] (microseconds), then `body`. `body` may
/// move the clock (`now = ...`): the functions read the same local.
pub fn through(name: &str, body: &str) -> String {
    let script = text();
    assert!(
        script.contains(CLOCK),
        "the script reads the store's clock as expected"
    );
    let start = script
        .find(&format!("\nlocal function {name}("))
        .unwrap_or_else(|| panic!("the script defines `{name}` at its top level"));
    let end = start
        + script[start..]
            .find("\nend\n")
            .unwrap_or_else(|| panic!("`{name}` ends"))
        + "\nend\n".len();
    let head = script[..end].replace(CLOCK, "local now = tonumber(ARGV[1])");
    format!("{head}\n{body}")
}

/// Runs `src` (no key) on the clock 0 with `args` after it, as the parity tests feed a function a
/// list of inputs; its answer, one line per value.
pub fn eval_at_zero(r: &super::redis::RedisServer, src: &str, args: &[String]) -> Vec<String> {
    let mut cmd = vec!["EVAL", src, "0", "0"];
    cmd.extend(args.iter().map(String::as_str));
    let out = r.cli(&cmd);
    let lines: Vec<String> = out.lines().map(str::to_string).collect();
    assert_eq!(lines.len(), args.len(), "one answer per input: {out}");
    lines
}
