//! The proposal written into the running config: the file's text with the proposed keys set and
//! every other key, comment and section order kept, checked by the same validation as
//! `admitd check` before it is handed out.

use toml_edit::{value, DocumentMut, Item, Table};

use super::method::{Proposal, Proposed};
use crate::config::Config;

/// The table at `path` below `doc`, made (implicit, so no empty header is written) where missing.
fn table<'a>(doc: &'a mut DocumentMut, path: &[&str]) -> Result<&'a mut Table, String> {
    let mut t = doc.as_table_mut();
    for (i, key) in path.iter().enumerate() {
        let last = i + 1 == path.len();
        let item = t.entry(key).or_insert_with(|| {
            let mut new = Table::new();
            new.set_implicit(!last);
            Item::Table(new)
        });
        if let Some(inline) = item.as_inline_table() {
            // An inline table (`subject = { rate = ... }`) becomes a section of its own, keeping its keys.
            *item = Item::Table(inline.clone().into_table());
        }
        t = item
            .as_table_mut()
            .ok_or_else(|| format!("{} is not a table in the config", path[..=i].join(".")))?;
    }
    Ok(t)
}

fn set(t: &mut Table, p: &Proposed, concurrency: bool) {
    t["rate"] = value(p.rate.clone());
    t["burst"] = value(i64::try_from(p.burst).unwrap_or(i64::MAX));
    if let (true, Some(c)) = (concurrency, p.concurrency) {
        t["concurrency"] = value(i64::from(c));
    }
}

/// `text` (the running config file; empty for built-in defaults) with the proposal in it, once
/// it validates.
pub fn render(text: &str, proposal: &Proposal) -> Result<String, String> {
    let mut doc: DocumentMut = text
        .parse()
        .map_err(|e| format!("the running config file does not parse: {e}"))?;
    if let Some(p) = &proposal.subject {
        set(table(&mut doc, &["limits", "subject"])?, p, true);
    }
    if let Some(p) = &proposal.tenant {
        set(table(&mut doc, &["limits", "tenant"])?, p, true);
    }
    for (name, p) in &proposal.tools {
        set(table(&mut doc, &["tools", name])?, p, false);
    }
    for (name, p) in &proposal.upstreams {
        set(table(&mut doc, &["upstreams", name])?, p, false);
    }
    let out = doc.to_string();
    Config::parse("proposal", &out).map_err(|e| format!("the proposal does not validate: {e}"))?;
    Ok(out)
}
