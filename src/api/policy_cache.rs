//! The `RateLimit-Policy` value of an answer, formatted once per layer shape and then reused.
//!
//! A deployment has few distinct shapes (one per plan, tool bucket and upstream combination), and
//! formatting the header on every answer cost more than the admission decision itself
//! (`scripts/profile.sh`; docs/BENCHMARKS.md, "Choices we made and why").
//!
//! What it assumes: a shape (each layer's name, whole burst and refill seconds) determines the header
//! exactly, which [`policy_header`] guarantees; and few shapes per worker: past [`PolicyCache::CAP`]
//! it starts over, which costs formatting again, never a wrong header. One cache per worker thread,
//! so a lookup takes no lock.

use std::borrow::Cow;
use std::cell::RefCell;

use warp::http::HeaderValue;

use super::admit::{policy_header, whole};
use crate::engine::LayerState;

/// A policy's shape: (name, q, w) per layer.
type Shape = Vec<(Cow<'static, str>, u64, u64)>;

/// Header values by the shape they were formatted from.
#[derive(Default)]
pub struct PolicyCache {
    entries: Vec<(Shape, HeaderValue)>,
}

thread_local! {
    static POLICIES: RefCell<PolicyCache> = RefCell::new(PolicyCache::default());
}

impl PolicyCache {
    /// Shapes one cache remembers; past this it starts over.
    pub const CAP: usize = 256;

    /// The `RateLimit-Policy` value for `layers` (`None` when no layer applied), from this
    /// thread's cache.
    pub fn header(layers: &[LayerState]) -> Option<HeaderValue> {
        POLICIES.with(|cache| cache.borrow_mut().get(layers))
    }

    fn get(&mut self, layers: &[LayerState]) -> Option<HeaderValue> {
        if layers.is_empty() {
            return None;
        }
        let same = |shape: &Shape| {
            shape.len() == layers.len()
                && shape.iter().zip(layers).all(|((n, q, w), l)| {
                    *n == l.name && *q == whole(l.burst) && *w == l.window_secs
                })
        };
        if let Some((_, v)) = self.entries.iter().find(|(shape, _)| same(shape)) {
            return Some(v.clone());
        }
        let v = HeaderValue::from_str(&policy_header(layers)).ok()?;
        if self.entries.len() >= Self::CAP {
            self.entries.clear();
        }
        let shape = layers
            .iter()
            .map(|l| (l.name.clone(), whole(l.burst), l.window_secs))
            .collect();
        self.entries.push((shape, v.clone()));
        Some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::admit::tests::layer;
    use crate::engine::Layer;

    #[test]
    fn the_cache_answers_what_formatting_would() {
        let a = [
            layer(Layer::Subject, 20.0, 10, 19, 0),
            layer(Layer::Tenant, 50.0, 5, 49, 0),
        ];
        let b = [
            layer(Layer::Subject, 5.0, 10, 4, 0),
            layer(Layer::Tenant, 50.0, 5, 49, 0),
        ];
        for _ in 0..3 {
            assert_eq!(
                PolicyCache::header(&a).unwrap().to_str().unwrap(),
                policy_header(&a)
            );
            assert_eq!(
                PolicyCache::header(&b).unwrap().to_str().unwrap(),
                policy_header(&b)
            );
        }
        assert_ne!(policy_header(&a), policy_header(&b));
        assert!(PolicyCache::header(&[]).is_none());
    }

    #[test]
    fn a_shape_is_formatted_once_and_past_the_cap_the_cache_starts_over() {
        let mut cache = PolicyCache::default();
        let shape = |burst: f64| [layer(Layer::Subject, burst, 10, 1, 0)];
        cache.get(&shape(1.0));
        cache.get(&shape(1.0));
        // Bursts that differ only in their fraction are one shape: the header writes whole bursts.
        cache.get(&shape(1.5));
        assert_eq!(cache.entries.len(), 1);
        for burst in 2..=PolicyCache::CAP {
            cache.get(&shape(burst as f64));
        }
        assert_eq!(cache.entries.len(), PolicyCache::CAP);
        let over = shape((PolicyCache::CAP + 1) as f64);
        assert_eq!(
            cache.get(&over).unwrap().to_str().unwrap(),
            policy_header(&over)
        );
        assert_eq!(cache.entries.len(), 1);
    }
}
