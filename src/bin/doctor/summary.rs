//! The doctor's closing lines: the notes under the data-path section (what the pairs assume,
//! the PCIe distance limit, what init allocates for GPUDirect here) and the `--require`
//! verdicts, each met or not with the reason (the exit status follows them).

use std::collections::BTreeSet;
use std::path::Path;

use clap::ValueEnum;
use dspark::path::{self, GpuDirectCapability, PathPolicy};
use serde::Serialize;

use super::fast_paths::FastPath;
use super::pairs::PairReport;
use super::Requirement;

#[derive(Debug, Serialize)]
pub(super) struct RequirementResult {
    pub(super) requirement: Requirement,
    pub(super) met: bool,
    pub(super) reason: String,
}

impl RequirementResult {
    /// The requirement as `--require` spells it (`gpu-direct`).
    pub(super) fn name(&self) -> String {
        self.requirement
            .to_possible_value()
            .map(|v| v.get_name().to_string())
            .unwrap_or_default()
    }
}

/// The notes: what the per-pair paths assume, the distance limit, what a communicator's init
/// allocates here, and the root sysfs was read below when it is not `/`.
pub(super) fn notes(
    root: &Path,
    on_real_root: bool,
    pairs: &[PairReport],
    fast: &[FastPath],
) -> Vec<String> {
    let mut notes = vec![
        "paths per GPU/NIC pair assume the peer node is configured like this one; at init each \
         connection's path is decided from both ends' facts (comm.data_paths(), bench path column)"
            .to_string(),
        format!(
            "GPUDirect is not used beyond PCIe distance {} (NCCL's default limit) unless \
             DSPARK_DATA_PATH=gpu-direct asks for it",
            path::GDR_MAX_DISTANCE.short()
        ),
    ];
    let cuda_ok = fast.iter().any(|f| f.name == "CUDA GPUs" && f.ok);
    let policy = PathPolicy::from_env_with(|k| std::env::var(k).ok()).unwrap_or(PathPolicy::Auto);
    notes.extend(region_note(!pairs.is_empty(), cuda_ok, policy));
    if !on_real_root {
        notes.push(format!(
            "sysfs and library directories read below {}",
            root.display()
        ));
    }
    notes
}

/// Each `--require` once, in a fixed order: met or not, and why.
pub(super) fn requirements(
    require: &[Requirement],
    fast: &[FastPath],
    pairs: &[PairReport],
) -> Vec<RequirementResult> {
    let mut requirements = Vec::new();
    for r in require.iter().copied().collect::<BTreeSet<_>>() {
        let find = |name: &str| {
            fast.iter()
                .find(|f| f.name == name)
                .map_or((false, format!("{name}: not probed")), |f| {
                    (f.ok, f.detail.clone())
                })
        };
        let (met, reason) = match r {
            Requirement::GpuDirect => gpu_direct(fast, pairs),
            Requirement::Verbs => find("RDMA verbs transport"),
            Requirement::Cuda => find("CUDA GPUs"),
            Requirement::Nvrtc => find("GPU reduction kernels (NVRTC)"),
        };
        requirements.push(RequirementResult {
            requirement: r,
            met,
            reason,
        });
    }
    requirements
}

/// `--require gpu-direct`: met when a GPU/NIC pair can use GPUDirect RDMA; else the GPUDirect
/// fast paths' blockers (no pair at all) or each pair's.
fn gpu_direct(fast: &[FastPath], pairs: &[PairReport]) -> (bool, String) {
    let gpu_direct_pairs = pairs
        .iter()
        .filter(|p| !matches!(p.capability, GpuDirectCapability::Unavailable(_)))
        .count();
    if gpu_direct_pairs > 0 {
        (
            true,
            format!("{gpu_direct_pairs} GPU/NIC pair(s) can use GPUDirect RDMA"),
        )
    } else if pairs.is_empty() {
        let mut why: Vec<&str> = Vec::new();
        for f in fast
            .iter()
            .filter(|f| !f.ok && f.name.starts_with("GPUDirect"))
        {
            for part in f.detail.split("; ") {
                if !why.contains(&part) {
                    why.push(part);
                }
            }
        }
        (
            false,
            format!("no GPU/NIC pair on this machine: {}", why.join("; ")),
        )
    } else {
        let why: Vec<String> = pairs
            .iter()
            .map(|p| match &p.capability {
                GpuDirectCapability::Unavailable(w) => {
                    format!("{} <-> {}: {w}", p.gpu, p.nic)
                }
                _ => String::new(),
            })
            .collect();
        (false, why.join("; "))
    }
}

/// What a communicator's init allocates on this machine for GPUDirect (issue #11 item 7), when
/// that is anything to say: on a machine with a GPU/NIC pair and a usable CUDA driver, a CUDA
/// context and the direct region, unless `DSPARK_DATA_PATH=host-staged`.
fn region_note(has_pair: bool, cuda_ok: bool, policy: PathPolicy) -> Option<String> {
    if !has_pair || !cuda_ok {
        return None;
    }
    Some(if policy == PathPolicy::HostStaged {
        "DSPARK_DATA_PATH=host-staged is set: a communicator creates no CUDA context and \
         allocates no GPU memory at init"
            .to_string()
    } else {
        format!(
            "at init a communicator over verbs here creates a CUDA context and allocates a \
             GPUDirect region (world x slots x segment bytes of GPU memory per rank; \
             DSPARK_DATA_PATH={policy}), kept only when every rank registered one; a job that \
             never passes GPU memory sets DSPARK_DATA_PATH=host-staged to allocate none \
             (CommInfo::direct_region and the bench header's `gpu region` line say what init \
             did)"
        )
    })
}

/// The human report's notes, after the data-path section.
pub(super) fn render_notes(o: &mut String, notes: &[String]) {
    for n in notes {
        o.push_str(&format!("  note: {n}\n"));
    }
}

/// The human report's last lines: each `--require` verdict.
pub(super) fn render_requirements(o: &mut String, requirements: &[RequirementResult]) {
    for q in requirements {
        o.push_str(&format!(
            "\nrequire {}: {}: {}\n",
            q.name(),
            if q.met { "MET" } else { "NOT MET" },
            q.reason
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doctor_says_init_allocates_a_gpu_region_only_where_it_would_and_how_to_avoid_it() {
        let auto = region_note(true, true, PathPolicy::Auto).unwrap();
        assert!(
            auto.contains("allocates a GPUDirect region")
                && auto.contains("DSPARK_DATA_PATH=host-staged to allocate none"),
            "{auto}"
        );
        let staged = region_note(true, true, PathPolicy::HostStaged).unwrap();
        assert!(
            staged.contains("no CUDA context") && staged.contains("no GPU memory"),
            "{staged}"
        );
        assert_eq!(
            region_note(true, false, PathPolicy::Auto),
            None,
            "no driver"
        );
        assert_eq!(region_note(false, true, PathPolicy::Auto), None, "no pair");
    }
}
