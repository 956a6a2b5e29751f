//! The deploy kit (deploy/): every YAML, JSON and TOML file parses, every admitd config in it passes
//! the same validation as `admitd check`, the container image runs on safe defaults, and
//! `admitd health` (the image's health check) tells a serving daemon from a missing one.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use admitd::config::{Config, Mode};
use common::{bin, Daemon};

fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy")
}

/// Every file under deploy/, recursively.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files(&path));
        } else {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// The admitd configs embedded in Kubernetes ConfigMaps (`data."*.toml"`).
fn embedded_configs(docs: &[serde_json::Value]) -> Vec<(String, String)> {
    docs.iter()
        .filter(|d| d["kind"] == "ConfigMap")
        .flat_map(|d| {
            d["data"]
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, _)| k.ends_with(".toml"))
                .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn every_yaml_json_and_toml_file_in_deploy_parses_and_every_admitd_config_validates() {
    let mut counts = [0usize; 3];
    let mut configs = 0;
    for path in files(&deploy_dir()) {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(&path).unwrap();
        match path.extension().and_then(|e| e.to_str()) {
            Some("yaml" | "yml") => {
                let docs: Vec<serde_json::Value> = serde_norway::Deserializer::from_str(&text)
                    .map(|d| {
                        serde::Deserialize::deserialize(d).unwrap_or_else(|e| panic!("{name}: {e}"))
                    })
                    .filter(|d: &serde_json::Value| !d.is_null())
                    .collect();
                assert!(!docs.is_empty(), "{name} is empty");
                for (key, config) in embedded_configs(&docs) {
                    Config::parse(&format!("{name} ({key})"), &config)
                        .unwrap_or_else(|e| panic!("{e}"));
                    configs += 1;
                }
                counts[0] += 1;
            }
            Some("json") => {
                serde_json::from_str::<serde_json::Value>(&text)
                    .unwrap_or_else(|e| panic!("{name}: {e}"));
                counts[1] += 1;
            }
            Some("toml") => {
                toml::from_str::<toml::Table>(&text).unwrap_or_else(|e| panic!("{name}: {e}"));
                // Every TOML file in deploy/ is an admitd config.
                Config::load(&path).unwrap_or_else(|e| panic!("{e}"));
                configs += 1;
                counts[2] += 1;
            }
            _ => {}
        }
    }
    assert!(counts[0] >= 3, "YAML files found: {}", counts[0]);
    assert!(counts[2] >= 2, "TOML files found: {}", counts[2]);
    assert!(configs >= 3, "admitd configs found: {configs}");
}

#[test]
fn the_example_config_passes_admitd_check() {
    let out = Command::new(bin())
        .args(["check", "--config"])
        .arg(deploy_dir().join("admitd.example.toml"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains(": ok ("), "{stdout}");
}

/// The Containerfile's instructions, continuation lines joined.
fn containerfile() -> Vec<String> {
    let text = std::fs::read_to_string(deploy_dir().join("Containerfile")).unwrap();
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || (line.is_empty() && cur.is_empty()) {
            continue;
        }
        match line.strip_suffix('\\') {
            Some(part) => cur.push_str(part),
            None => {
                cur.push_str(line);
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
        }
    }
    out
}

#[test]
fn the_container_runs_as_non_root_on_pinned_images_with_a_health_check_and_no_demo_policy() {
    let lines = containerfile();
    let args: std::collections::HashMap<String, String> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("ARG "))
        .filter_map(|a| a.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect();
    let froms: Vec<&String> = lines.iter().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2, "{froms:?}");
    for from in froms {
        let image = from.split_whitespace().nth(1).unwrap();
        let image = match image.strip_prefix("${").and_then(|i| i.strip_suffix('}')) {
            Some(arg) => args
                .get(arg)
                .unwrap_or_else(|| panic!("no ARG {arg}"))
                .clone(),
            None => image.to_string(),
        };
        let tag = image.rsplit_once(':').map(|(_, t)| t).unwrap_or("");
        // Pinned: a digest, or a tag with a full version number (not latest, not a bare major).
        let pinned = image.contains("@sha256:")
            || tag.split('-').next().is_some_and(|v| {
                v.split('.').count() >= 2 && v.split('.').all(|p| p.parse::<u32>().is_ok())
            });
        assert!(pinned, "base image not pinned: {image}");
    }
    let user = lines
        .iter()
        .rfind(|l| l.starts_with("USER "))
        .expect("USER");
    let uid = user[5..].split(':').next().unwrap().trim();
    assert!(uid != "0" && uid != "root", "{user}");
    let health = lines
        .iter()
        .find(|l| l.starts_with("HEALTHCHECK "))
        .expect("HEALTHCHECK");
    assert!(
        health.contains("admitd\", \"health\"") || health.contains("admitd health"),
        "{health}"
    );
    assert!(
        !health.contains("curl") && !health.contains("wget"),
        "{health}"
    );
    let cmd = lines.iter().rfind(|l| l.starts_with("CMD ")).expect("CMD");
    assert!(
        !cmd.contains("--listen"),
        "the CMD would override a mounted config's listen: {cmd}"
    );
    // The config the image carries: no demo tenants or plans enforced.
    let copied = lines
        .iter()
        .find(|l| l.starts_with("COPY deploy/") && l.ends_with("/etc/admitd/admitd.toml"))
        .expect("the image's config");
    let src = copied.split_whitespace().nth(1).unwrap();
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(src);
    let c = Config::load(&path).unwrap();
    if c.server.mode == Mode::Enforce {
        assert!(
            c.tenants.is_empty()
                && c.plans.is_empty()
                && c.tools.is_empty()
                && c.upstreams.is_empty(),
            "{src} bakes a demo policy into an enforcing image"
        );
    }
    // A wildcard listen, so that the published port and the health probe reach it.
    assert_eq!(c.server.listen.to_string(), "0.0.0.0:9470");
}

#[test]
fn the_kubernetes_example_mounts_a_writable_volume_for_the_state_file() {
    let text = std::fs::read_to_string(deploy_dir().join("kubernetes/sidecar.yaml")).unwrap();
    let docs: Vec<serde_json::Value> = serde_norway::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let deploy = docs.iter().find(|d| d["kind"] == "Deployment").unwrap();
    let spec = &deploy["spec"]["template"]["spec"];
    let admitd = spec["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "admitd")
        .unwrap();
    let mount = admitd["volumeMounts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"] == "/var/lib/admitd")
        .expect("a volume at /var/lib/admitd");
    assert_ne!(mount["readOnly"], true);
    let volume = spec["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the mounted volume");
    assert!(volume.get("emptyDir").is_some() || volume.get("persistentVolumeClaim").is_some());
}

fn health(args: &[&str]) -> (bool, String) {
    let out = Command::new(bin())
        .arg("health")
        .args(args)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn admitd_health_exits_0_for_a_serving_daemon_and_1_otherwise() {
    let d = Daemon::start_default();
    let (ok, text) = health(&["--listen", &d.addr]);
    assert!(ok, "{text}");
    assert!(text.contains("/healthz: 200"), "{text}");
    let (ok, text) = health(&["--listen", &d.addr, "--ready"]);
    assert!(ok, "{text}");
    assert!(text.contains("/readyz: 200"), "{text}");
    // The config's listen names the daemon; a wildcard is probed on loopback.
    let port = d.addr.rsplit(':').next().unwrap().to_string();
    let mut f = tempfile::Builder::new().suffix(".toml").tempfile().unwrap();
    std::io::Write::write_all(
        &mut f,
        format!("[server]\nlisten = \"0.0.0.0:{port}\"\n").as_bytes(),
    )
    .unwrap();
    let (ok, text) = health(&["--config", f.path().to_str().unwrap()]);
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!("127.0.0.1:{port}/healthz: 200")),
        "{text}"
    );
    drop(d);
    let (ok, text) = health(&["--listen", &format!("127.0.0.1:{port}"), "--timeout", "1s"]);
    assert!(!ok, "{text}");
    assert!(text.contains("cannot connect"), "{text}");
}

#[test]
fn admitd_health_reaches_a_daemon_on_a_unix_socket_and_fails_on_a_non_200() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("h.sock");
    let listen = format!("unix:{}", sock.display());
    let mut child = Command::new(bin())
        .args(["serve", "--listen", &listen])
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    assert!(common::eventually(
        std::time::Duration::from_secs(20),
        || sock.exists()
    ));
    let (ok, text) = health(&["--listen", &listen]);
    let _ = child.kill();
    let _ = child.wait();
    assert!(ok, "{text}");
    // Something that answers, but not 200.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        if let Ok((mut s, _)) = l.accept() {
            let mut buf = [0u8; 512];
            let _ = std::io::Read::read(&mut s, &mut buf);
            let _ = std::io::Write::write_all(
                &mut s,
                b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n",
            );
        }
    });
    let (ok, text) = health(&["--listen", &addr]);
    assert!(!ok, "{text}");
    assert!(text.contains(": 503"), "{text}");
}
