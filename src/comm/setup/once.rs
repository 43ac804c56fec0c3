//! Init warnings once per process: a torch job makes a communicator per process group (FSDP's
//! hybrid sharding, DeviceMesh: several per process), and each init would repeat the same
//! warning about the same machine (CPU sharing, the open-file limit, a tune file, a transport
//! fallback). The first of each text is a warning; the repeats are at debug level
//! (`DSPARK_LOG=debug` shows them), and every communicator's `CommInfo` still carries its own
//! facts.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

/// The texts warned about so far (hashed). Bounded: past it, every warning is given.
static GIVEN: Mutex<Vec<u64>> = Mutex::new(Vec::new());
const MAX_REMEMBERED: usize = 512;

/// Whether `key` is new to this process (and now remembered). `key` is what makes two
/// warnings the same: their text without the rank, which differs between a process's groups.
pub(crate) fn first(key: &str) -> bool {
    let mut h = DefaultHasher::new();
    key.hash(&mut h);
    let h = h.finish();
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    if given.contains(&h) {
        return false;
    }
    if given.len() < MAX_REMEMBERED {
        given.push(h);
    }
    true
}

/// `tracing::warn!` the first time this process sees `key` ([`first`]), `tracing::debug!`
/// after: `warn_once!(key: &text, rank, "...")`.
macro_rules! warn_once {
    (key: $key:expr, $($arg:tt)+) => {
        if $crate::comm::setup::once::first($key) {
            ::tracing::warn!($($arg)+)
        } else {
            ::tracing::debug!($($arg)+)
        }
    };
}
pub(crate) use warn_once;

#[cfg(test)]
mod tests {
    use super::first;

    #[test]
    fn a_text_is_first_once_and_others_stay_first() {
        let a = "once.rs test: a text no other test uses";
        assert!(first(a));
        assert!(!first(a));
        assert!(!first(a));
        assert!(first("once.rs test: another text"));
    }
}
