//! Refusals written for the model that made the call.
//!
//! A refused agent retries at once unless it is told, in words and numbers, how long to wait and what to
//! do meanwhile. Every text here therefore says: what limit was hit (in plain words), the wait as a whole
//! number of seconds (rounded up, never "soon"), that the arguments were fine, not to retry sooner, and a
//! way forward (carry on with what it has, tell the user what is pending). It names no tenant, subject,
//! host, address or key: only the tool and the logical upstream name the operator configured, and
//! those only when they read as logical names (see [`speakable`]); an upstream called
//! `10.0.3.7:5432` or `pg.prod.internal` is "the upstream" in the text.

use super::types::Scope;

/// Context for the wording of one refusal.
#[derive(Debug, Clone, Copy)]
pub struct RefusalContext<'a> {
    pub tool: &'a str,
    pub upstream: Option<&'a str>,
    /// The upstream's budget is shared by every account.
    pub shared_upstream: bool,
    pub cost: f64,
    /// The size of the limit the call did not fit (for `oversized`).
    pub limit: f64,
    /// The limit that refused is the whole account's, not this agent's (concurrency, daily quota).
    pub account_wide: bool,
}

/// Whole seconds, rounded up, of a wait in milliseconds (at least 1 for any non-zero wait).
pub fn whole_seconds(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// "Wait N seconds, then retry ...", written into the message as it is built.
struct Retry(u64);

impl std::fmt::Display for Retry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let unit = if self.0 == 1 { "second" } else { "seconds" };
        write!(
            f,
            "Wait {} {unit}, then retry this call with the same arguments; the arguments are fine. Do not retry sooner.",
            self.0
        )
    }
}

/// Whether a configured name may appear in a text for the model: a logical name such as `warehouse`,
/// `crm_writes` or `get_sales`, not one that reads as a host, an address, a URL, a port or a secret
/// (operators name upstreams after what they are, and the text must not hand those to the model).
pub fn speakable(name: &str) -> bool {
    let logical = !name.is_empty()
        && name.len() <= 40
        && name
            .chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | ' '))
        && !name.chars().all(|c| c.is_ascii_digit());
    if !logical || name.to_ascii_lowercase().contains("localhost") {
        return false;
    }
    // Read run by run (the text is written for every refused call, so nothing is collected).
    let runs = || {
        name.split(|c: char| !c.is_alphanumeric())
            .filter(|r| !r.is_empty())
    };
    let number = |r: &str| r.chars().all(|c| c.is_ascii_digit());
    // A run of letters and digits with no separator is a token or key, not a name: a long one with a
    // digit in it (`AKIAIOSFODNN7EXAMPLE`, a hex digest), one longer than words are, one that mixes
    // several letters and digits (`sk-live-abc123def456`), or a hex literal (`0x7f000001`).
    let key_like = runs().any(|run| {
        let len = run.chars().count();
        let digits = run.chars().filter(char::is_ascii_digit).count();
        (len >= 16 && digits > 0)
            || len >= 24
            || (len >= 8 && digits >= 3 && len - digits >= 3)
            || run
                .strip_prefix("0x")
                .or_else(|| run.strip_prefix("0X"))
                .is_some_and(|hex| !hex.is_empty() && hex.chars().all(|c| c.is_ascii_hexdigit()))
    });
    // An address written with other separators (`192-168-1-10`, `10 0 0 5`), or a host numbered the
    // way machines are (`db-prod-01`).
    let address_like = || {
        runs().filter(|r| number(r)).count() >= 3
            || (runs().count() >= 3
                && runs()
                    .next_back()
                    .is_some_and(|r| number(r) && r.len() >= 2 && r.starts_with('0')))
    };
    !key_like && !address_like()
}

/// A configured name as the text shows it: itself when [`speakable`], else `generic`.
fn shown<'a>(name: Option<&'a str>, generic: &'a str) -> &'a str {
    name.filter(|n| speakable(n)).unwrap_or(generic)
}

const FORWARD: &str = "Meanwhile, continue with the results you already have, or tell the user that this step is pending.";

/// Added to a refusal whose wait lies past the promise horizon (every slot before it is promised to
/// callers refused earlier): a retry within this turn makes no sense.
pub const LONG_WAIT: &str = " That is a long wait: continue without this call, and retry it only if it is still needed then.";

/// The short operator-facing reason for a scope.
pub fn reason(scope: Scope) -> &'static str {
    match scope {
        Scope::Subject
        | Scope::SubjectTool
        | Scope::Tenant
        | Scope::TenantUpstream
        | Scope::Global => "rate limit reached",
        Scope::Concurrency => "too many calls in flight",
        Scope::DailyQuota => "daily quota used up",
        Scope::UpstreamPenalty => "upstream asked to slow down",
        Scope::Adaptive => "upstream is rejecting requests",
        Scope::Oversized => "call larger than the limit",
        Scope::TaskPoll => "task polled sooner than told",
        Scope::Spend => "spend budget used up",
    }
}

/// Room for the longest text (435 bytes without its names) with an upstream name of up to 38 bytes,
/// which it names twice. A longer name makes the buffer grow once.
const MESSAGE_CAPACITY: usize = 512;

/// The text the model reads.
pub fn message(scope: Scope, retry_after_ms: u64, cx: &RefusalContext<'_>) -> String {
    use std::fmt::Write;
    let retry = Retry(whole_seconds(retry_after_ms).max(1));
    let up = shown(cx.upstream, "upstream");
    // "Other tools that use ___ share this quota."
    let users = shown(cx.upstream, "the same upstream");
    let penalised = if cx.shared_upstream {
        "every account that uses it"
    } else {
        "this account"
    };
    let who = if cx.account_wide {
        "this account"
    } else {
        "this agent"
    };
    // Written into one buffer as large as the longest text: a refusal is made for every shed call, a
    // runaway loop's included, and building it from pieces cost more than deciding the call.
    let mut text = String::with_capacity(MESSAGE_CAPACITY);
    let _ = match scope {
        Scope::Subject => write!(
            text,
            "Rate limited: this agent has made too many tool calls in a short time. {retry} {FORWARD}"
        ),
        Scope::SubjectTool if speakable(cx.tool) => write!(
            text,
            "Rate limited: the {} tool has been called too often by this agent. {retry} Other tools are not affected. {FORWARD}",
            cx.tool
        ),
        Scope::SubjectTool => write!(
            text,
            "Rate limited: this tool has been called too often by this agent. {retry} Other tools are not affected. {FORWARD}"
        ),
        Scope::Tenant => write!(
            text,
            "Rate limited by the overall tool-call quota for this account. {retry} {FORWARD}"
        ),
        Scope::TenantUpstream if cx.shared_upstream => write!(
            text,
            "Rate limited by the {up} quota, which all accounts share. {retry} Other tools that use {users} share this quota. {FORWARD}"
        ),
        Scope::TenantUpstream => write!(
            text,
            "Rate limited by the {up} quota for this account. {retry} Other tools that use {users} share this quota. {FORWARD}"
        ),
        Scope::Global => write!(
            text,
            "The tool service is handling too many calls overall right now. {retry} {FORWARD}"
        ),
        Scope::Concurrency => write!(
            text,
            "Too many tool calls from {who} are running at the same time. {retry} Start fewer calls in parallel. {FORWARD}"
        ),
        Scope::DailyQuota => write!(
            text,
            "The daily tool-call quota of {who} is used up; it resets at midnight UTC. {retry} Calls before then will be refused. Tell the user that this step must wait until the quota resets, and continue with the results you already have."
        ),
        Scope::UpstreamPenalty => write!(
            text,
            "The {up} service asked for calls to slow down (it is rate limiting {penalised}). {retry} Calls before then will be refused, so retrying sooner cannot help; after the wait, retrying is expected to work. Other tools that use {users} are paused too. {FORWARD}"
        ),
        Scope::Adaptive => write!(
            text,
            "The {up} service is rejecting most requests right now, so this call was not sent to it. Retrying at once will not help. {retry} {FORWARD}"
        ),
        Scope::Spend => write!(
            text,
            "The daily spending budget of {who} is used up; it resets at midnight UTC. {retry} Calls before then will be refused. Tell the user that this step must wait until the budget resets, and continue with the results you already have."
        ),
        Scope::Oversized => write!(
            text,
            "This call is too large to ever fit its limit (it costs {} units; the limit is {}). Waiting will not help and retrying it unchanged will fail again. Make the request smaller, for example ask for fewer items or a narrower range, or tell the user it cannot be done in one call.",
            trim_number(cx.cost),
            trim_number(cx.limit)
        ),
        Scope::TaskPoll => write!(
            text,
            "This task's status was checked sooner than the server asked; the task keeps running meanwhile. {retry} {FORWARD}"
        ),
    };
    text
}

/// The text of a refusal by a spend budget: it names the unit (with its currency symbol when the
/// config gives one), the budget and what is left, and whether waiting helps. A run's budget never
/// refills, so the model is told to go on with what it has or ask the user; a daily budget resets at
/// midnight UTC, and the wait is given like every other wait.
pub fn spend_message(
    unit: &crate::config::SpendUnit,
    short: &super::spend::SpendShort,
    retry_after_ms: u64,
) -> String {
    use super::spend::SpendBudget;
    let size = unit.amount(short.size);
    let left = if short.remaining > 0.0 {
        format!("{} is left", unit.amount(short.remaining))
    } else if short.remaining < 0.0 {
        format!("it is overspent by {}", unit.amount(-short.remaining))
    } else {
        "nothing is left".to_string()
    };
    let needs = unit.amount(short.estimate);
    match short.budget {
        SpendBudget::Run => format!(
            "The budget of {size} for this task is spent ({left}; this call needs about {needs}). Waiting will not help and retrying will be refused the same way for the rest of this task. Continue with the results you already have, or ask the user whether to spend more on this task."
        ),
        SpendBudget::SubjectDaily | SpendBudget::TenantDaily => {
            let who = if short.budget == SpendBudget::TenantDaily {
                "this account"
            } else {
                "this agent"
            };
            format!(
                "The daily budget of {size} for {who} is spent ({left}; this call needs about {needs}); it resets at midnight UTC. {} Calls before then will be refused. Tell the user that this step must wait until the budget resets, and continue with the results you already have.",
                Retry(whole_seconds(retry_after_ms).max(1))
            )
        }
    }
}

/// A number as a person writes it: whole numbers without decimals, fractions with two, and numbers
/// too large to read digit by digit in scientific notation.
pub(crate) fn trim_number(x: f64) -> String {
    if x.abs() >= 1e15 {
        format!("{x:e}")
    } else if x.fract() == 0.0 {
        format!("{}", x as i64)
    } else {
        format!("{x:.2}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cx() -> RefusalContext<'static> {
        RefusalContext {
            tool: "get_sales",
            upstream: Some("warehouse"),
            shared_upstream: false,
            cost: 1.0,
            limit: 20.0,
            account_wide: false,
        }
    }

    #[test]
    fn concurrency_and_quota_texts_say_whose_limit_it_is() {
        for scope in [Scope::Concurrency, Scope::DailyQuota] {
            let agent = message(scope, 1000, &cx());
            let account = message(
                scope,
                1000,
                &RefusalContext {
                    account_wide: true,
                    ..cx()
                },
            );
            assert!(
                agent.contains("this agent") && !agent.contains("this account"),
                "{agent}"
            );
            assert!(
                account.contains("this account") && !account.contains("this agent"),
                "{account}"
            );
        }
    }

    #[test]
    fn every_retryable_text_gives_whole_seconds_and_a_way_forward() {
        for scope in Scope::ALL {
            if scope == Scope::Oversized {
                continue;
            }
            let m = message(scope, 3_001, &cx());
            assert!(m.contains("4 seconds"), "{scope:?}: {m}");
            assert!(!m.contains("3.0"), "{m}");
            assert!(m.contains("same arguments; the arguments are fine"), "{m}");
            assert!(m.contains("Do not retry sooner"), "{m}");
            assert!(
                m.contains("continue with the results you already have"),
                "{m}"
            );
        }
    }

    #[test]
    fn the_upstream_text_matches_the_contract_example() {
        let m = message(Scope::TenantUpstream, 4000, &cx());
        assert!(
            m.starts_with("Rate limited by the warehouse quota for this account. Wait 4 seconds"),
            "{m}"
        );
        assert!(m.contains("Other tools that use warehouse share this quota."));
    }

    #[test]
    fn names_that_read_as_hosts_addresses_or_keys_are_not_shown() {
        for name in [
            "warehouse",
            "crm_writes",
            "openai-gpt4",
            "Lager Nord",
            "get_sales",
            "billing-v2",
            "crm_2024",
            "eu-west-1 warehouse",
            "warehouse 2",
            "倉庫",
            "日本語の倉庫",
            "0x",
        ] {
            assert!(speakable(name), "{name}");
        }
        for name in [
            "10.0.3.7:5432",
            "redis://cache.internal:6379",
            "pg.prod.internal",
            "api.example.com",
            "user@host",
            "::1",
            "5432",
            "sk_live_51H8aBcDeFgH1234567",
            "AKIAIOSFODNN7EXAMPLE",
            "0123456789abcdef0123456789abcdef",
            "localhost",
            "LOCALHOST",
            "0x7f000001",
            "192-168-1-10",
            "127 0 0 1",
            "sk-live-abc123def456",
            "db-prod-01",
            "",
            "a_name_far_longer_than_any_operator_would_write",
        ] {
            assert!(!speakable(name), "{name}");
        }
        for (scope, shared) in [
            (Scope::TenantUpstream, false),
            (Scope::TenantUpstream, true),
            (Scope::UpstreamPenalty, false),
            (Scope::Adaptive, false),
        ] {
            for name in [
                "10.0.3.7:5432",
                "redis://cache.internal:6379",
                "pg.prod.internal",
            ] {
                let cx = RefusalContext {
                    upstream: Some(name),
                    shared_upstream: shared,
                    ..cx()
                };
                let m = message(scope, 4000, &cx);
                assert!(!m.contains(name), "{scope:?}: {m}");
                assert!(!m.contains("internal") && !m.contains("10.0"), "{m}");
                assert!(m.contains("upstream"), "{m}");
                assert!(m.contains("Wait 4 seconds"), "{m}");
            }
        }
        let m = message(
            Scope::TenantUpstream,
            4000,
            &RefusalContext {
                upstream: Some("pg.prod.internal"),
                ..cx()
            },
        );
        assert!(
            m.contains("Rate limited by the upstream quota for this account.")
                && m.contains("Other tools that use the same upstream share this quota."),
            "{m}"
        );
        let m = message(
            Scope::SubjectTool,
            4000,
            &RefusalContext {
                tool: "https://tools.internal/run",
                ..cx()
            },
        );
        assert!(
            m.starts_with("Rate limited: this tool has been called too often")
                && !m.contains("https"),
            "{m}"
        );
    }

    #[test]
    fn a_shared_upstream_penalty_says_it_holds_every_account() {
        let shared = RefusalContext {
            shared_upstream: true,
            ..cx()
        };
        let m = message(Scope::UpstreamPenalty, 2000, &shared);
        assert!(
            m.contains("rate limiting every account that uses it"),
            "{m}"
        );
        let m = message(Scope::UpstreamPenalty, 2000, &cx());
        assert!(m.contains("(it is rate limiting this account)"), "{m}");
    }

    #[test]
    fn oversized_says_make_it_smaller_not_wait() {
        let m = message(Scope::Oversized, 0, &RefusalContext { cost: 50.0, ..cx() });
        assert!(m.contains("costs 50 units; the limit is 20"), "{m}");
        assert!(m.contains("Waiting will not help"));
        assert!(m.contains("smaller"));
    }

    #[test]
    fn absurd_costs_are_written_short() {
        let m = message(
            Scope::Oversized,
            0,
            &RefusalContext {
                cost: 1e300,
                ..cx()
            },
        );
        assert!(m.contains("costs 1e300 units; the limit is 20"), "{m}");
        let m = message(Scope::Oversized, 0, &RefusalContext { cost: 2.5, ..cx() });
        assert!(m.contains("costs 2.50 units"), "{m}");
    }

    #[test]
    fn sub_second_waits_round_up_to_one_second() {
        assert!(message(Scope::Subject, 1, &cx()).contains("Wait 1 second,"));
        assert_eq!(whole_seconds(1000), 1);
        assert_eq!(whole_seconds(1001), 2);
    }

    #[test]
    fn every_text_is_written_into_one_buffer_without_growing_it() {
        // Upstream names as long as an operator is likely to choose, in both places they appear.
        let up = "warehouse-reporting-eu-west";
        for scope in Scope::ALL {
            for account_wide in [false, true] {
                for shared_upstream in [false, true] {
                    let cx = RefusalContext {
                        upstream: Some(up),
                        tool: "get_quarterly_sales_report",
                        account_wide,
                        shared_upstream,
                        ..cx()
                    };
                    let text = message(scope, 12_345, &cx);
                    assert_eq!(text.capacity(), MESSAGE_CAPACITY, "{scope:?} grew: {text}");
                }
            }
        }
        assert!(message(Scope::Subject, 1000, &cx()).contains("Wait 1 second, then retry"));
        assert!(message(Scope::Subject, 1001, &cx()).contains("Wait 2 seconds, then retry"));
    }
}
