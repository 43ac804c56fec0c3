//! Settings of the verbs transport: [`VerbsOptions`] (plain data; the communicator's setup
//! builds them from the job's configuration and the `DSPARK_IB_*` variables), the memory they
//! imply (slot sizes, pinned bytes per peer, the direct region's [`DirectLayout`]), the device
//! specification syntax, and the checks of what they ask of the machine (the memlock limit).

use std::time::Duration;

use super::ib;
use super::wire::CTS_LEN;
use crate::transport::{DirectLayout, HEADER_LEN};

/// Bytes of the control slot (abort / goodbye frames).
pub(super) const CTRL_BYTES: usize = 4096;

/// Settings of the verbs transport (the environment variables are listed in [`super`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerbsOptions {
    /// Device name and optional port (`DSPARK_IB_DEVICE`).
    pub device: Option<(String, Option<u8>)>,
    /// GID index (`DSPARK_IB_GID_INDEX`).
    pub gid_index: Option<u32>,
    /// Slots per peer and direction.
    pub slots: usize,
    /// Payload bytes per slot.
    pub slot_payload: usize,
    /// Reliability of the queue pairs.
    pub reliability: ib::Reliability,
    /// Busy-poll time in `wait`.
    pub spin: Duration,
    /// Smallest payload sent zero-copy from a registered buffer.
    pub zero_copy_min: usize,
}

impl VerbsOptions {
    /// Bytes of one slot (header + payload, rounded up to 64).
    pub fn slot_bytes(&self) -> usize {
        (HEADER_LEN + self.slot_payload).div_ceil(64) * 64
    }

    /// Bytes of the two memories registered per peer: (remote, local). Remote: the receive
    /// slots, the control slot and the CTS ring the peer writes; local: the staging slots,
    /// the outgoing CTS entries and the outgoing control frame.
    pub(super) fn peer_memory(&self) -> (usize, usize) {
        let (n, sb) = (self.slots, self.slot_bytes());
        (
            n * sb + CTRL_BYTES + n * CTS_LEN,
            n * sb + n * CTS_LEN + CTRL_BYTES,
        )
    }

    /// Bytes of memory this rank pins per peer.
    pub fn pinned_per_peer(&self) -> usize {
        let (remote, local) = self.peer_memory();
        remote + local
    }
}

/// The direct region layout for `world` ranks under `opts`: one landing slot per receive slot
/// and peer, each as large as a receive slot's payload.
pub fn direct_layout(world: usize, opts: &VerbsOptions, send_slots: usize) -> DirectLayout {
    DirectLayout {
        world,
        slots: opts.slots,
        slot_bytes: opts.slot_payload,
        send_slots,
    }
}

/// Parses `DSPARK_IB_DEVICE`: `name` or `name:port`.
pub fn parse_device(spec: &str) -> Result<(String, Option<u8>), String> {
    let s = spec.trim();
    let (name, port) = match s.rsplit_once(':') {
        Some((n, p)) => {
            let port: u8 =
                p.parse().ok().filter(|&p| p >= 1).ok_or_else(|| {
                    format!("{s:?}: {p:?} is not a port number (ports count from 1)")
                })?;
            (n, Some(port))
        }
        None => (s, None),
    };
    if name.is_empty() {
        return Err(format!("{s:?}: no device name"));
    }
    Ok((name.to_string(), port))
}

/// Why registering `need` bytes would fail under a memlock limit of `soft` bytes (`None`:
/// unlimited), unless the process has `CAP_IPC_LOCK`.
pub fn memlock_shortfall(soft: Option<u64>, need: u64, privileged: bool) -> Option<String> {
    let soft = soft?;
    if privileged || need <= soft {
        return None;
    }
    Some(format!(
        "RLIMIT_MEMLOCK is {} KiB but the verbs transport must pin {} KiB (slots and rings for \
         every peer connected at init); raise the limit: `ulimit -l unlimited` in the shell that starts the ranks, \
         `LimitMEMLOCK=infinity` for a systemd service, `--ulimit memlock=-1` for docker, or \
         `* - memlock unlimited` in /etc/security/limits.conf; or use fewer/smaller slots \
         (DSPARK_IB_SLOTS, DSPARK_CHUNK_BYTES)",
        soft / 1024,
        need.div_ceil(1024)
    ))
}

pub(super) fn memlock_problem(need: u64) -> Option<String> {
    use nix::sys::resource::{getrlimit, Resource, RLIM_INFINITY};
    let (soft, _) = getrlimit(Resource::RLIMIT_MEMLOCK).ok()?;
    let soft = (soft != RLIM_INFINITY).then_some(soft);
    memlock_shortfall(soft, need, has_cap_ipc_lock())
}

/// Whether this process has `CAP_IPC_LOCK` (then the memlock limit does not apply).
fn has_cap_ipc_lock() -> bool {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return false;
    };
    cap_ipc_lock_in(&s)
}

/// Whether the text of a `/proc/<pid>/status` file gives `CAP_IPC_LOCK` in `CapEff`.
pub fn cap_ipc_lock_in(s: &str) -> bool {
    s.lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

pub(super) fn reg_hint(e: &ib::VerbError) -> String {
    let mut s = e.to_string();
    if matches!(
        e.err.raw_os_error(),
        Some(libc::ENOMEM) | Some(libc::EAGAIN) | Some(libc::EPERM)
    ) {
        s += "; memory registration pins pages: check RLIMIT_MEMLOCK (`ulimit -l`; set it to \
              unlimited for the ranks)";
    }
    s
}

pub(super) fn timeout_ms(t: u8) -> f64 {
    4.096e-3 * f64::from(1u32 << t.min(31))
}

/// The options the defaults give for the default 512 KiB segment, with `slots` slots (for the
/// transport's unit tests: the defaults are parsed in the communicator's setup).
#[cfg(test)]
pub(super) fn test_options(slots: usize) -> VerbsOptions {
    VerbsOptions {
        device: None,
        gid_index: None,
        slots,
        slot_payload: 512 * 1024,
        reliability: ib::Reliability {
            timeout: 16,
            retry_cnt: 7,
            rnr_retry: 6,
            min_rnr_timer: 12,
            service_level: 0,
            traffic_class: 0,
        },
        spin: Duration::from_micros(20),
        zero_copy_min: 64 * 1024,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_specs_parse_with_optional_port() {
        assert_eq!(parse_device("mlx5_0").unwrap(), ("mlx5_0".into(), None));
        assert_eq!(
            parse_device("mlx5_1:2").unwrap(),
            ("mlx5_1".into(), Some(2))
        );
        assert!(parse_device("mlx5_0:0").is_err());
        assert!(parse_device(":1").is_err());
    }

    #[test]
    fn too_small_memlock_limit_is_reported_with_the_fix() {
        let w = memlock_shortfall(Some(64 * 1024), 9 << 20, false).unwrap();
        assert!(
            w.contains("RLIMIT_MEMLOCK is 64 KiB") && w.contains("ulimit -l unlimited"),
            "{w}"
        );
        assert_eq!(memlock_shortfall(None, 1 << 40, false), None);
        assert_eq!(memlock_shortfall(Some(1 << 30), 9 << 20, false), None);
        assert_eq!(
            memlock_shortfall(Some(0), 9 << 20, true),
            None,
            "CAP_IPC_LOCK ignores the limit"
        );
    }

    #[test]
    fn pinned_memory_accounts_for_both_directions() {
        let o = test_options(4);
        assert_eq!(
            o.pinned_per_peer(),
            2 * 4 * o.slot_bytes() + 2 * CTRL_BYTES + 2 * 4 * CTS_LEN
        );
        // Worked by hand for the default 512 KiB segment: 524288 + 32 header bytes round up
        // to 524352-byte slots; 4 slots each way (4194816) + two 4 KiB control slots (8192)
        // + 4 CTS entries of 32 bytes each way (256).
        assert_eq!(o.slot_bytes(), 524_352);
        assert_eq!(o.pinned_per_peer(), 4_203_264);
    }
}
