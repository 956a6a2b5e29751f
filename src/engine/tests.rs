//! Fake-clock tests of the tenant engine: every layer, refund, hold, queue, lease and penalty rule.
