//! The GPUDirect region's lifecycle at init, in one place: what this rank brings to the verbs
//! transport as its direct region once verbs found a usable port ([`direct_spec`]: GPU memory
//! near the NIC, the host-memory emulation for tests, or why there is none), whether it keeps
//! it once every rank announced theirs ([`settle_region`]: only when GPUDirect RDMA is used
//! job-wide), and freeing it where nothing will use it ([`free_unused_region`]: a declined
//! region, or a job that ended up on TCP). The verbs transport only registers what it is given.

use super::super::device::DIRECT_SEND_SLOTS;
use super::super::DirectRegionFact;
use crate::config::Config;
use crate::gpu::direct::DirectRegion;
use crate::path::{self, GpuDirectCapability, PathPolicy};
use crate::transport::verbs::wire::{DirectInfo, DirectKind};
use crate::transport::verbs::{self, DirectSpec, VerbsOptions, VerbsTransport};
use crate::transport::{DirectTransport, TransportKind};

/// What this rank brings to the verbs transport as its direct region (called by the verbs
/// transport once it found a usable port): the host-memory emulation when asked for (tests),
/// nothing when device memory is to be staged anyway, otherwise GPU memory of the configured
/// device with its registration candidates — the region, which the communicator keeps for as
/// long as its transport lives — or why there is none.
pub(crate) fn direct_spec(
    config: &Config,
    opts: &VerbsOptions,
    nic: &str,
) -> (DirectSpec, Option<DirectRegion>) {
    if config.emulate_gpu_direct {
        return (
            DirectSpec::HostEmulated {
                send_slots: DIRECT_SEND_SLOTS,
            },
            None,
        );
    }
    if config.data_path == PathPolicy::HostStaged {
        return (
            DirectSpec::Unavailable(path::REQUESTED_STAGED_REASON.into()),
            None,
        );
    }
    if config.world_size < 2 {
        return (DirectSpec::None, None);
    }
    match gpu_region(config, opts, nic) {
        Ok(g) => {
            let (candidates, reasons) = g.registration_candidates();
            let spec = DirectSpec::Device {
                addr: g.ptr(),
                send_slots: DIRECT_SEND_SLOTS,
                candidates,
                reasons,
            };
            (spec, Some(g))
        }
        Err(why) => (DirectSpec::Unavailable(why), None),
    }
}

/// Allocates this rank's direct region on its GPU (`Config::cuda_device` modulo the number of
/// GPUs), sized for the verbs transport's slots, unless the GPU is farther from `nic` than
/// [`path::GDR_MAX_DISTANCE`] and the path was left to `auto` (an explicit `gpu-direct` is
/// honoured with a warning).
fn gpu_region(config: &Config, opts: &VerbsOptions, nic: &str) -> Result<DirectRegion, String> {
    if !crate::gpu::probe::libcuda_present() {
        return Err("no CUDA driver (libcuda.so.1 not found)".into());
    }
    let probe = crate::gpu::probe::probe_cuda().map_err(|e| e.to_string())?;
    if probe.devices.is_empty() {
        return Err(format!(
            "no CUDA GPU visible{}",
            probe
                .init_error
                .map(|e| format!(" ({e})"))
                .unwrap_or_default()
        ));
    }
    let ordinal = config.cuda_device.unwrap_or(0) % probe.devices.len();
    let far = probe
        .devices
        .get(ordinal)
        .and_then(|d| d.pci)
        .and_then(|pci| crate::gpu::sysfs::Sysfs::default().distance(pci, nic).ok())
        .and_then(|r| path::distance_blocker(r.distance, path::GDR_MAX_DISTANCE));
    if let Some(why) = far {
        let why = format!("GPU {ordinal} and {nic}: {why}");
        if config.data_path != PathPolicy::GpuDirect {
            return Err(why);
        }
        let what = format!("DSPARK_DATA_PATH=gpu-direct: using GPUDirect although {why}");
        super::once::warn_once!(key: &what, "{what}");
    }
    let ctx = crate::gpu::device::open_context(ordinal).map_err(|e| e.to_string())?;
    let layout = verbs::direct_layout(config.world_size, opts, DIRECT_SEND_SLOTS);
    DirectRegion::new(&ctx, layout)
        .map_err(|e| format!("GPU {ordinal}: cannot allocate the direct region: {e}"))
}

/// Whether this rank keeps its direct region after init: `Ok` when it registered one and
/// every rank can use theirs — GPUDirect RDMA is used job-wide ([`path::uses_gpu_direct`] over
/// [`capabilities_of`], the rule device collectives follow), or, for the host-memory
/// emulation (which is never reported as GPUDirect), every rank announced an emulated region.
/// Otherwise why the region is of no use. Every rank decides from the same exchanged facts,
/// so all keep theirs or none does.
fn region_fate(policy: PathPolicy, infos: &[DirectInfo], rank: usize) -> Result<(), String> {
    let emulated = match infos.get(rank) {
        Some(DirectInfo::Region { kind, .. }) => *kind == DirectKind::HostEmulated,
        Some(DirectInfo::Unavailable(why)) => {
            return Err(format!("it could not be registered: {why}"))
        }
        _ => return Err("this rank announced no region".into()),
    };
    let is_emulated = |i: &DirectInfo| {
        matches!(
            i,
            DirectInfo::Region {
                kind: DirectKind::HostEmulated,
                ..
            }
        )
    };
    let caps = capabilities_of(infos);
    let agreed = if emulated {
        infos.iter().all(is_emulated)
    } else {
        path::uses_gpu_direct(policy, TransportKind::Verbs, &caps)
    };
    if agreed {
        return Ok(());
    }
    let lacking: Vec<String> = infos
        .iter()
        .zip(&caps)
        .enumerate()
        .filter_map(
            |(r, (info, cap))| match (emulated, is_emulated(info), cap) {
                (true, true, _) => None,
                (true, false, GpuDirectCapability::Unavailable(why))
                | (false, _, GpuDirectCapability::Unavailable(why)) => {
                    Some(format!("rank {r}: {why}"))
                }
                (true, false, _) => Some(format!(
                    "rank {r}: its region is GPU memory, not the emulation"
                )),
                (false, _, _) => None,
            },
        )
        .collect();
    let who = if lacking.is_empty() {
        format!("{}={policy}", path::DATA_PATH_ENV)
    } else {
        lacking.join("; ")
    };
    Err(format!("GPUDirect RDMA is not used job-wide ({who})"))
}

/// Keeps this rank's direct region where [`region_fate`] says so; otherwise drops the
/// transport's registration of it first (so that the NIC never touches it again) and then
/// frees it. Returns what became of it.
pub(super) fn settle_region(
    t: &mut VerbsTransport,
    region: &mut Option<DirectRegion>,
    config: &Config,
) -> DirectRegionFact {
    let rank = config.rank;
    let infos = t.direct_infos();
    match region_fate(config.data_path, infos, rank) {
        Ok(()) => DirectRegionFact::Kept {
            bytes: t.direct_layout().map_or(0, |l| l.len()),
            emulated: region.is_none(),
        },
        Err(why) => {
            let none_why = match infos.get(rank) {
                Some(DirectInfo::Unavailable(w)) => w.clone(),
                _ => "no device memory is set up for a world of one".to_string(),
            };
            let registered = t.drop_direct_region();
            free_unused_region(region, registered, rank, &why)
                .unwrap_or(DirectRegionFact::NotAllocated(none_why))
        }
    }
}

/// Frees a direct region that nothing will use (its registration failed or was dropped, or
/// the job fell back to TCP), so that the GPU memory does not stay allocated for the
/// communicator's lifetime; `registered` is the size of a region the transport held itself
/// (the emulation's host memory, already freed). Logs why; `None` when there was none.
pub(super) fn free_unused_region(
    region: &mut Option<DirectRegion>,
    registered: Option<usize>,
    rank: usize,
    why: &str,
) -> Option<DirectRegionFact> {
    let bytes = region.take().map(|r| r.len()).or(registered)?;
    tracing::info!(rank, bytes, "freed the GPUDirect region at init: {why}");
    Some(DirectRegionFact::Freed {
        bytes,
        why: why.into(),
    })
}

/// Every rank's GPUDirect capability from the direct regions announced at init.
pub(crate) fn capabilities_of(infos: &[DirectInfo]) -> Vec<GpuDirectCapability> {
    infos
        .iter()
        .map(|d| match d {
            DirectInfo::Region {
                kind: DirectKind::DmaBuf,
                ..
            } => GpuDirectCapability::DmaBuf,
            DirectInfo::Region {
                kind: DirectKind::PeerMem,
                ..
            } => GpuDirectCapability::PeerMem,
            DirectInfo::Region {
                kind: DirectKind::HostEmulated,
                ..
            } => GpuDirectCapability::Unavailable(
                "its direct region is host memory (DSPARK_EMULATE_GPU_DIRECT, for tests)".into(),
            ),
            DirectInfo::None => {
                GpuDirectCapability::Unavailable("no GPU memory was set up at init".into())
            }
            DirectInfo::Unavailable(why) => GpuDirectCapability::Unavailable(why.clone()),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(kind: DirectKind) -> DirectInfo {
        DirectInfo::Region {
            kind,
            addr: 1 << 20,
            rkey: 7,
            slot_bytes: 512 << 10,
        }
    }

    /// #11 item 7: a direct region is kept only where it was registered and GPUDirect RDMA is
    /// used job-wide; every other rank frees its own, and says which rank stands in the way.
    #[test]
    fn a_direct_region_is_kept_only_when_every_rank_registered_one() {
        use DirectKind::{DmaBuf, HostEmulated, PeerMem};
        let fate = |infos: &[DirectInfo], r| region_fate(PathPolicy::Auto, infos, r);
        // Every rank registered GPU memory (mechanisms may differ): all keep theirs.
        let all = [region(DmaBuf), region(PeerMem), region(DmaBuf)];
        for r in 0..3 {
            assert_eq!(fate(&all, r), Ok(()), "rank {r}");
            assert_eq!(region_fate(PathPolicy::GpuDirect, &all, r), Ok(()));
        }
        // Rank 1 could not register, rank 2 set up none: nobody keeps one, and the ranks
        // that registered name the ranks that did not.
        let why = DirectInfo::Unavailable("ibv_reg_mr: EFAULT".into());
        let infos = [region(PeerMem), why, DirectInfo::None];
        let e = fate(&infos, 0).unwrap_err();
        assert!(e.contains("not used job-wide"), "{e}");
        assert!(e.contains("rank 1: ibv_reg_mr: EFAULT"), "{e}");
        assert!(e.contains("rank 2: no GPU memory"), "{e}");
        assert!(!e.contains("rank 0"), "{e}");
        let e = fate(&infos, 1).unwrap_err();
        assert!(
            e.contains("could not be registered: ibv_reg_mr: EFAULT"),
            "{e}"
        );
        assert!(fate(&infos, 2).is_err(), "no region announced: freed");
        assert!(fate(&infos, 3).is_err(), "no information: freed");
        // The emulation agrees with itself only: every rank emulating keeps; one rank without
        // it (or with real GPU memory) makes every emulating rank free its region.
        let emu = [
            region(HostEmulated),
            region(HostEmulated),
            region(HostEmulated),
        ];
        for r in 0..3 {
            assert_eq!(fate(&emu, r), Ok(()), "rank {r}");
        }
        let infos = [
            region(HostEmulated),
            region(HostEmulated),
            DirectInfo::Unavailable("no CUDA driver".into()),
        ];
        for r in 0..2 {
            let e = fate(&infos, r).unwrap_err();
            assert!(e.contains("rank 2: no CUDA driver"), "{e}");
            assert!(!e.contains("rank 0") && !e.contains("rank 1"), "{e}");
        }
        let mixed = [region(HostEmulated), region(DmaBuf)];
        let e = fate(&mixed, 0).unwrap_err();
        assert!(e.contains("rank 1: its region is GPU memory"), "{e}");
        let e = fate(&mixed, 1).unwrap_err();
        assert!(
            e.contains("rank 0: its direct region is host memory"),
            "{e}"
        );
    }

    /// What the bench header and `CommInfo` print about the region: its size and its fate.
    #[test]
    fn the_direct_region_fact_says_what_was_allocated_and_whether_it_is_held() {
        let kept = DirectRegionFact::Kept {
            bytes: 36 << 20,
            emulated: false,
        };
        assert_eq!(
            kept.to_string(),
            "36 MiB of GPU memory, registered and held"
        );
        let freed = DirectRegionFact::Freed {
            bytes: 3 << 20,
            why: "GPUDirect RDMA is not used job-wide (rank 2: no CUDA driver)".into(),
        };
        let s = freed.to_string();
        assert!(
            s.starts_with("3 MiB allocated, then freed at init: "),
            "{s}"
        );
        assert!(s.ends_with("(rank 2: no CUDA driver)"), "{s}");
        let none = DirectRegionFact::NotAllocated(path::REQUESTED_STAGED_REASON.into());
        assert_eq!(
            none.to_string(),
            "none allocated (DSPARK_DATA_PATH=host-staged was requested)"
        );
    }
}
