//! The doctor's NIC side: the RDMA verbs section (rdma-core's libibverbs, the devices under
//! /sys/class/infiniband with their ports, GIDs and dma-buf support) and the locked-memory
//! section (RLIMIT_MEMLOCK, which registering buffers with the NIC needs): what is probed,
//! whether the verbs transport can run, and how both read in the human report.

use std::path::Path;

use dspark::internals::gpu::probe::{self, MemlockLimit, VerbsLibrary, MEMLOCK_MIN_BYTES};
use dspark::internals::gpu::sysfs::{RdmaDevice, Sysfs};
use dspark::internals::transport::verbs::{
    cap_ipc_lock_in, memlock_shortfall, probe_nic_dmabuf, NicDmaBuf, VerbsOptions,
};
use serde::Serialize;

use super::fixes::{FIX_NO_NIC, FIX_PORT, FIX_RDMA_CORE};
use super::{kv, limit_text, rounded_bytes};

#[derive(Debug, Serialize)]
pub(super) struct RdmaSection {
    pub(super) libibverbs: VerbsLibrary,
    pub(super) devices: Vec<RdmaDevice>,
    /// Per device, whether it accepts dma-buf registrations (probed only on the real root
    /// with libibverbs present).
    pub(super) dma_buf: Vec<NicDmaBuf>,
}

impl RdmaSection {
    pub(super) fn dma_buf_of(&self, device: &str) -> Option<&NicDmaBuf> {
        self.dma_buf.iter().find(|d| d.device == device)
    }
}

#[derive(Debug, Serialize)]
pub(super) struct MemlockSection {
    pub(super) limit: Option<MemlockLimit>,
    pub(super) error: Option<String>,
    pub(super) minimum_bytes: u64,
    /// At least `minimum_bytes`, unlimited, or not applying (`cap_ipc_lock`).
    pub(super) sufficient: bool,
    /// Whether this process has CAP_IPC_LOCK: then no memlock limit applies to it (nor to
    /// the ranks a launcher starts with the same capabilities).
    pub(super) cap_ipc_lock: bool,
    /// What the verbs transport pins per connected peer with the default options (it
    /// refuses to start where the limit holds less than its peers' total).
    pub(super) verbs_bytes_per_peer: u64,
    /// Why the verbs settings in the environment (`DSPARK_IB_*`, `DSPARK_CHUNK_BYTES`) would
    /// fail init, if they would (then `verbs_bytes_per_peer` is 0: unknown).
    pub(super) verbs_settings_error: Option<String>,
}

impl MemlockSection {
    /// Why the verbs transport could not pin one peer's buffers here, if it could not.
    pub(super) fn verbs_shortfall(&self) -> Option<String> {
        if let Some(e) = &self.verbs_settings_error {
            return Some(format!("the verbs settings would fail init: {e}"));
        }
        let soft = self.limit.and_then(|l| l.soft);
        memlock_shortfall(soft, self.verbs_bytes_per_peer, self.cap_ipc_lock)
    }

    /// How many peers' verbs buffers the limit holds (`None`: no limit applies).
    pub(super) fn verbs_peers(&self) -> Option<u64> {
        let soft = self.limit.and_then(|l| l.soft)?;
        (!self.cap_ipc_lock).then(|| soft / self.verbs_bytes_per_peer.max(1))
    }
}

/// The RDMA section: libibverbs (searched below `root` unless it is the real root, where the
/// loader's own search applies), the devices in sysfs, and per device whether it accepts
/// dma-buf registrations (probed only on the real root with libibverbs present).
pub(super) fn probe_rdma(sysfs: &Sysfs, root: &Path, on_real_root: bool) -> RdmaSection {
    let libibverbs = if on_real_root {
        probe::libibverbs()
    } else {
        probe::find_libibverbs(root, None, None)
    };
    let devices = sysfs.rdma_devices();
    let dma_buf = if on_real_root && libibverbs.path.is_some() {
        devices.iter().map(|d| probe_nic_dmabuf(&d.name)).collect()
    } else {
        Vec::new()
    };
    RdmaSection {
        libibverbs,
        devices,
        dma_buf,
    }
}

/// The locked-memory section: this process's RLIMIT_MEMLOCK against [`MEMLOCK_MIN_BYTES`],
/// and whether CAP_IPC_LOCK lifts it (`/proc/self/status`).
pub(super) fn probe_memlock() -> MemlockSection {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    memlock_section(probe::memlock_limit(), cap_ipc_lock_in(&status))
}

/// What the verbs transport pins per connected peer under the slot and segment settings
/// `env` gives (`DSPARK_IB_*`, `DSPARK_CHUNK_BYTES`: what the doctor's advice says to
/// change), the library's defaults where it gives none; the error init would give where
/// they do not parse.
pub(super) fn verbs_bytes_per_peer(env: impl Fn(&str) -> Option<String>) -> Result<u64, String> {
    let fixed = |k: &str| match k {
        "DSPARK_RANK" => Some("0".to_string()),
        "DSPARK_WORLD_SIZE" => Some("2".to_string()),
        "DSPARK_ROOT_ADDR" => Some("127.0.0.1:1".to_string()),
        k if k.starts_with("DSPARK_IB_") || k == "DSPARK_CHUNK_BYTES" => env(k),
        _ => None,
    };
    dspark::Config::from_lookup(fixed)
        .and_then(|cfg| VerbsOptions::from_config(&cfg))
        .map(|o| o.pinned_per_peer() as u64)
        .map_err(|e| e.to_string())
}

/// [`probe_memlock`] from what it read.
pub(super) fn memlock_section(
    limit: dspark::Result<MemlockLimit>,
    cap_ipc_lock: bool,
) -> MemlockSection {
    let (verbs_bytes_per_peer, verbs_settings_error) =
        match verbs_bytes_per_peer(|k| std::env::var(k).ok()) {
            Ok(b) => (b, None),
            Err(e) => (0, Some(e)),
        };
    match limit {
        Ok(l) => MemlockSection {
            sufficient: cap_ipc_lock || l.sufficient(),
            limit: Some(l),
            error: None,
            minimum_bytes: MEMLOCK_MIN_BYTES,
            cap_ipc_lock,
            verbs_bytes_per_peer,
            verbs_settings_error: verbs_settings_error.clone(),
        },
        Err(e) => MemlockSection {
            limit: None,
            error: Some(e.to_string()),
            minimum_bytes: MEMLOCK_MIN_BYTES,
            sufficient: cap_ipc_lock,
            cap_ipc_lock,
            verbs_bytes_per_peer,
            verbs_settings_error,
        },
    }
}

/// Whether the verbs transport can run: `Err` lists every blocker with its fix.
pub(super) fn verbs_usable(rdma: &RdmaSection) -> Result<String, Vec<(String, &'static str)>> {
    let mut blockers: Vec<(String, &'static str)> = Vec::new();
    if rdma.libibverbs.path.is_none() {
        blockers.push((
            "rdma-core's libibverbs.so.1 is not installed".into(),
            FIX_RDMA_CORE,
        ));
    }
    if rdma.devices.is_empty() {
        blockers.push((
            "no RDMA device under /sys/class/infiniband".into(),
            FIX_NO_NIC,
        ));
    }
    let active: Vec<String> = rdma
        .devices
        .iter()
        .flat_map(|d| {
            d.ports
                .iter()
                .filter(|p| p.is_active())
                .map(move |p| format!("{}:{}", d.name, p.port))
        })
        .collect();
    if !rdma.devices.is_empty() && active.is_empty() {
        let states: Vec<String> = rdma
            .devices
            .iter()
            .flat_map(|d| {
                d.ports.iter().map(move |p| {
                    format!(
                        "{}:{} {}",
                        d.name,
                        p.port,
                        p.state.as_deref().unwrap_or("?")
                    )
                })
            })
            .collect();
        blockers.push((
            format!("no RDMA port is ACTIVE ({})", states.join(", ")),
            FIX_PORT,
        ));
    }
    if blockers.is_empty() {
        Ok(format!("active port(s): {}", active.join(", ")))
    } else {
        Err(blockers)
    }
}

/// Whether one NIC can carry GPUDirect traffic: libibverbs installed and an ACTIVE port.
pub(super) fn nic_usable(
    rdma: &RdmaSection,
    dev: &RdmaDevice,
) -> Result<(), (String, &'static str)> {
    if rdma.libibverbs.path.is_none() {
        return Err((
            "rdma-core's libibverbs.so.1 is not installed".into(),
            FIX_RDMA_CORE,
        ));
    }
    if !dev.ports.iter().any(|p| p.is_active()) {
        return Err((format!("{} has no ACTIVE port", dev.name), FIX_PORT));
    }
    Ok(())
}

/// The human report's "RDMA (verbs)" section: the library, then every device with its
/// dma-buf verdict, ports, MTU and GIDs.
pub(super) fn render_rdma(o: &mut String, rdma: &RdmaSection) {
    o.push_str("RDMA (verbs)\n");
    match &rdma.libibverbs.path {
        Some(p) => kv(o, "libibverbs.so.1", format!("found: {p}")),
        None => kv(
            o,
            "libibverbs.so.1",
            format!(
                "NOT FOUND (searched {})",
                rdma.libibverbs.searched.join(", ")
            ),
        ),
    }
    if rdma.devices.is_empty() {
        kv(o, "devices", "none under /sys/class/infiniband");
    }
    for d in &rdma.devices {
        let pci = d
            .pci
            .as_ref()
            .and_then(|p| p.chain.last())
            .map_or("no PCI device (software RDMA)".to_string(), |a| {
                format!("PCI {a}")
            });
        kv(
            o,
            &format!("device {}", d.name),
            format!(
                "{pci}{}",
                d.fw_ver
                    .as_ref()
                    .filter(|f| !f.is_empty())
                    .map(|f| format!(", firmware {f}"))
                    .unwrap_or_default()
            ),
        );
        if let Some(b) = rdma.dma_buf_of(&d.name) {
            let verdict = match b.supported {
                Some(true) => "accepted",
                Some(false) => "REFUSED",
                None => "unknown",
            };
            kv(
                o,
                "  dma-buf registration",
                format!("{verdict}: {}", b.detail),
            );
        }
        for p in &d.ports {
            kv(
                o,
                &format!("  port {}", p.port),
                format!(
                    "state {}, phys {}, link layer {}, rate {}",
                    p.state.as_deref().unwrap_or("?"),
                    p.phys_state.as_deref().unwrap_or("?"),
                    p.link_layer.as_deref().unwrap_or("?"),
                    p.rate.as_deref().unwrap_or("?")
                ),
            );
            kv(
                o,
                "    MTU",
                p.active_mtu
                    .map_or(p.mtu_note.clone(), |m| format!("{m} ({})", p.mtu_note)),
            );
            if p.gids.is_empty() {
                kv(o, "    GIDs", "none populated");
            }
            for g in &p.gids {
                kv(
                    o,
                    &format!("    GID {}", g.index),
                    format!(
                        "{} {}{}",
                        g.gid,
                        g.kind.as_deref().unwrap_or(""),
                        g.netdev
                            .as_ref()
                            .map(|n| format!(" ({n})"))
                            .unwrap_or_default()
                    ),
                );
            }
        }
    }
}

/// The human report's "Locked memory" section.
pub(super) fn render_memlock(o: &mut String, memlock: &MemlockSection) {
    o.push_str("\nLocked memory\n");
    match (&memlock.limit, &memlock.error) {
        (Some(l), _) => kv(
            o,
            "RLIMIT_MEMLOCK",
            format!(
                "soft {}, hard {}{}",
                limit_text(l.soft),
                limit_text(l.hard),
                if memlock.cap_ipc_lock {
                    " (CAP_IPC_LOCK: no limit applies)".to_string()
                } else if memlock.sufficient {
                    String::new()
                } else {
                    format!(": below {}", rounded_bytes(memlock.minimum_bytes))
                }
            ),
        ),
        (None, Some(e)) => kv(o, "RLIMIT_MEMLOCK", format!("unreadable: {e}")),
        _ => {}
    }
}
