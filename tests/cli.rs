//! `admitd check`, run as an operator would: its verdicts, exit codes and warnings.

use std::process::Command;

fn check(toml: &str) -> (i32, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("admitd.toml");
    std::fs::write(&path, toml).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_admitd"))
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).replace(path.to_str().unwrap(), "admitd.toml");
    (
        out.status.code().unwrap_or(-1),
        text(&out.stdout),
        text(&out.stderr),
    )
}

#[test]
fn a_good_file_is_ok_and_a_bad_one_names_its_file_and_line() {
    let (code, out, err) = check("[limits.subject]\nrate = \"120/min\"\nburst = 20\n");
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("admitd.toml: ok ("), "{out}");
    assert_eq!(err, "");

    let (code, _, err) = check("[limits.subject]\nburst = 20\nrate = \"5/mins\"\n");
    assert_eq!(code, 1);
    assert!(err.starts_with("admitd.toml:3: "), "{err}");
}

/// The wire contract's example tool costs 20 with a tool bucket of 5: the file is valid, but every
/// call to the tool would be refused as oversized, and `check` says so without failing.
#[test]
fn a_tool_that_can_never_fit_is_a_warning() {
    let (code, out, err) = check(
        "[plans.free.subject]\nrate = \"30/min\"\nburst = 5\n[tenants.globex]\nplan = \"free\"\n\
         [tools.get_sales]\ncost = 20\nupstream = \"warehouse\"\nrate = \"5/min\"\nburst = 5\n\
         [tools.search]\ncost = 8\n\
         [upstreams.warehouse]\nrate = \"20/s\"\nburst = 20\nshared = false\n",
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("admitd.toml: ok ("), "{out}");
    let warnings: Vec<&str> = err.lines().collect();
    assert_eq!(
        warnings,
        [
            "admitd.toml: warning: tools.get_sales costs 20, more than the 5 a bucket or quota on its path can hold: every call to it is refused as oversized for tenants on the default limits",
            "admitd.toml: warning: tools.get_sales costs 20, more than the 5 a bucket or quota on its path can hold: every call to it is refused as oversized for tenants on plan \"free\"",
            "admitd.toml: warning: tools.search costs 8, more than the 5 a bucket or quota on its path can hold: every call to it is refused as oversized for tenants on plan \"free\"",
        ],
        "{err}"
    );
}

/// `[store]` keys are checked like every other key, a Redis store's included, and a Redis store
/// needs its URL.
#[test]
fn store_keys_are_checked() {
    let (code, out, err) =
        check("[store]\nkind = \"memory\"\ntimeout = \"20ms\"\non_error = \"fail_open\"\n");
    assert_eq!(code, 0, "{out}{err}");

    let (code, _, err) = check("[store]\nkind = \"memory\"\non_error = \"shrug\"\n");
    assert_eq!(code, 1);
    assert!(err.starts_with("admitd.toml:3: store.on_error"), "{err}");

    // `check` reads the file only: a Redis that does not answer is not its business.
    let (code, out, err) = check(
        "[store]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:1\"\non_error = \"local_fallback\"\nreplicas = 3\n",
    );
    assert_eq!(code, 0, "{out}{err}");

    let (code, _, err) = check("[store]\nkind = \"redis\"\n");
    assert_eq!(code, 1);
    assert!(
        err.starts_with("admitd.toml:2: store.kind = \"redis\" needs store.url"),
        "{err}"
    );
    let (code, _, err) = check("[store]\nkind = \"redis\"\nurl = \"http://127.0.0.1:6379\"\n");
    assert_eq!(code, 1);
    assert!(err.starts_with("admitd.toml:3: store.url"), "{err}");
}

/// A tool's upstream that is not declared but looks like a typo of one that is: valid (an
/// undeclared upstream just has no limits of its own), so a warning with its line, exit 0.
#[test]
fn a_name_that_looks_like_a_typo_of_a_declared_one_is_a_warning_on_its_line() {
    let (code, out, err) = check(
        "[upstreams.warehouse]\nrate = \"20/s\"\nburst = 20\n\
         [tools.get_sales]\nupstream = \"warehose\"\n\
         [tools.search]\nupstream = \"index\"\n",
    );
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        err.lines().collect::<Vec<_>>(),
        ["admitd.toml:5: warning: tools.get_sales.upstream: upstream \"warehose\" is not declared, but [upstreams.warehouse] is: a typo? As written, the upstream \"warehose\" has no limits of its own"],
        "{err}"
    );
    // A tenant's plan must exist; the error says which one was probably meant.
    let (code, _, err) =
        check("[plans.free.subject]\nburst = 5\n[tenants.globex]\nplan = \"fre\"\n");
    assert_eq!(code, 1);
    assert!(
        err.starts_with(
            "admitd.toml:4: tenants.globex.plan: unknown plan \"fre\" (did you mean \"free\"?"
        ),
        "{err}"
    );
    // So must a spend unit a tool's estimates are in: the error names the near unit.
    let (code, out, err) = check(
        "[spend.usd]\nestimate = 0.01\ntenant_daily = 5\n\
         [tools.summarize.spend]\nusd = 0.02\n\
         [tools.translate.spend]\nuds = 0.02\n",
    );
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.starts_with(
            "admitd.toml:7: tools.translate.spend.uds: unknown spend unit \"uds\" (did you mean \"usd\"?"
        ),
        "{err}"
    );
}

/// `check` names the store `serve` would use, and never a Redis password.
#[test]
fn check_names_the_store() {
    let (code, out, _) = check("[limits.subject]\nburst = 20\n");
    assert_eq!(code, 0);
    assert!(
        out.contains("admitd.toml: store memory (this process only"),
        "{out}"
    );
    let (code, out, err) = check(
        "[store]\nkind = \"redis\"\nurl = \"rediss://admitd:s3cret@redis.internal:6380/0\"\ntimeout = \"20ms\"\n",
    );
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("admitd.toml: store redis at rediss://redis.internal:6380 (timeout 20ms, on_error fail_closed)"),
        "{out}"
    );
    assert!(!out.contains("s3cret") && !out.contains("admitd:"), "{out}");
}

/// The probe keys of a shared upstream are checked like every other key: a good value passes, a bad
/// one names its file and line.
#[test]
fn probe_keys_are_checked() {
    let head = "[upstreams.api]\nrate = \"60/s\"\nshared = true\n";
    let (code, out, err) = check(&format!(
        "{head}probe_every = \"20s\"\nprobe_step = 0.1\nprobe_hold = 0.85\n"
    ));
    assert_eq!(code, 0, "{out}{err}");
    let (code, _, err) = check(&format!("{head}probe_every = \"100ms\"\n"));
    assert_eq!(code, 1);
    assert!(
        err.starts_with("admitd.toml:4: upstreams.api.probe_every must be at least 1s"),
        "{err}"
    );
    let (code, _, err) = check(&format!("{head}probe_hold = 0\n"));
    assert_eq!(code, 1);
    assert!(
        err.starts_with("admitd.toml:4: upstreams.api.probe_hold must be greater than 0"),
        "{err}"
    );
}
