//! Settings of the verbs transport: [`VerbsOptions`] (parsed from the `DSPARK_IB_*`
//! variables), the memory they imply (slot sizes, pinned bytes per peer, the direct region's
//! [`DirectLayout`]), the device specification syntax, and the checks of what they ask of the
//! machine (the memlock limit).

use std::time::Duration;

use super::ib;
use super::wire::{self, CTS_LEN};
use crate::config::{parse_size, Config};
use crate::error::{Error, Result};
use crate::transport::{DirectLayout, HEADER_LEN};

/// Bytes of the control slot (abort / goodbye frames).
pub(super) const CTRL_BYTES: usize = 4096;

/// Settings of the verbs transport (see the module docs for the environment variables).
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
    /// The options for `cfg`, with `DSPARK_IB_*` tunables read through `get`.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable.
    pub fn from_lookup(cfg: &Config, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let num = |name: &str, lo: u64, hi: u64, default: u64| -> Result<u64> {
            match get(name).filter(|v| !v.trim().is_empty()) {
                None => Ok(default),
                Some(v) => match v.trim().parse::<u64>() {
                    Ok(x) if (lo..=hi).contains(&x) => Ok(x),
                    _ => Err(Error::config(
                        name,
                        format!("{v:?}: expected an integer in {lo}..={hi}"),
                    )),
                },
            }
        };
        let device = match &cfg.ib_device {
            None => None,
            Some(spec) => {
                Some(parse_device(spec).map_err(|w| Error::config("DSPARK_IB_DEVICE", w))?)
            }
        };
        let slots = num("DSPARK_IB_SLOTS", 2, 256, 8)? as usize;
        let seg = cfg.segment_bytes.max(64);
        let slot_payload = match get("DSPARK_IB_SLOT_BYTES").filter(|v| !v.trim().is_empty()) {
            None => seg,
            Some(v) => {
                let b = parse_size(&v).ok_or_else(|| {
                    Error::config(
                        "DSPARK_IB_SLOT_BYTES",
                        format!("{v:?} is not a size (e.g. 1M)"),
                    )
                })?;
                if b < seg {
                    return Err(Error::config(
                        "DSPARK_IB_SLOT_BYTES",
                        format!(
                            "{b} bytes is smaller than the segment size {seg} (DSPARK_CHUNK_BYTES): \
                             a slot must hold a whole segment"
                        ),
                    ));
                }
                b
            }
        };
        if (slot_payload + HEADER_LEN) as u64 > u64::from(wire::MAX_FRAME) {
            return Err(Error::config(
                "DSPARK_CHUNK_BYTES",
                format!(
                    "verbs slots hold at most {} payload bytes; {slot_payload} is too large",
                    wire::MAX_FRAME as usize - HEADER_LEN
                ),
            ));
        }
        let reliability = ib::Reliability {
            timeout: num("DSPARK_IB_TIMEOUT", 1, 31, 16)? as u8,
            retry_cnt: num("DSPARK_IB_RETRY_CNT", 0, 7, 7)? as u8,
            rnr_retry: num("DSPARK_IB_RNR_RETRY", 0, 6, 6)? as u8,
            min_rnr_timer: 12,
        };
        let spin = Duration::from_micros(num("DSPARK_IB_SPIN_US", 0, 1_000_000, 20)?);
        let zero_copy_min = match get("DSPARK_IB_ZERO_COPY_MIN").filter(|v| !v.trim().is_empty()) {
            None => 64 * 1024,
            Some(v) => parse_size(&v).ok_or_else(|| {
                Error::config("DSPARK_IB_ZERO_COPY_MIN", format!("{v:?} is not a size"))
            })?,
        };
        Ok(VerbsOptions {
            device,
            gid_index: cfg.ib_gid_index,
            slots,
            slot_payload,
            reliability,
            spin,
            zero_copy_min,
        })
    }

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
pub fn parse_device(spec: &str) -> std::result::Result<(String, Option<u8>), String> {
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
         every peer); raise the limit: `ulimit -l unlimited` in the shell that starts the ranks, \
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn opts_of(vars: &[(&str, &str)]) -> Result<VerbsOptions> {
        let cfg = Config::new(0, 2, "h:1");
        let m: std::collections::HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        VerbsOptions::from_lookup(&cfg, |k| m.get(k).cloned())
    }

    #[test]
    fn default_options_surface_a_dead_peer_within_seconds() {
        let o = opts_of(&[]).unwrap();
        let r = o.reliability;
        let worst_ms = timeout_ms(r.timeout) * f64::from(r.retry_cnt + 1);
        assert!(worst_ms < 5_000.0, "{worst_ms} ms");
        assert!(r.rnr_retry < 7, "RNR retry 7 means forever");
        assert_eq!(o.slot_payload, 512 * 1024);
        assert_eq!(o.slot_bytes() % 64, 0);
        assert!(o.slot_bytes() >= o.slot_payload + HEADER_LEN);
    }

    #[test]
    fn bad_tunables_name_their_variable() {
        let e = opts_of(&[("DSPARK_IB_SLOTS", "1")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("DSPARK_IB_SLOTS"), "{e}");
        let e = opts_of(&[("DSPARK_IB_SLOT_BYTES", "4K")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("DSPARK_IB_SLOT_BYTES") && e.contains("segment"),
            "{e}"
        );
        let e = opts_of(&[("DSPARK_IB_RETRY_CNT", "8")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("DSPARK_IB_RETRY_CNT"), "{e}");
        let o = opts_of(&[("DSPARK_IB_SLOTS", "4"), ("DSPARK_IB_SLOT_BYTES", "1M")]).unwrap();
        assert_eq!((o.slots, o.slot_payload), (4, 1 << 20));
    }

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
        let o = opts_of(&[("DSPARK_IB_SLOTS", "4")]).unwrap();
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
