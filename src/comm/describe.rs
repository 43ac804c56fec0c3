//! [`Communicator::describe_json`]: every fact the communicator knows about its own paths, in
//! one JSON object — what Python's `Communicator.info()` returns and what the C ABI's
//! `dspark_comm_describe` copies out, so that an embedder in any language can ask the
//! questions `dspark-bench`'s header answers (which transport, why not a faster one, which
//! path device memory takes and why, which algorithm a size runs, whether non-blocking device
//! calls block).
//!
//! Written by hand rather than through serde, which the library without its `cli` feature
//! does not have.

use std::fmt::Write as _;

use super::Communicator;
use crate::engine::trace::{json_opt, json_opt_str, json_str};
use crate::path::{BufferLocation, DataPath, GpuDirectCapability};
use crate::plan::Collective;

/// The `format` member of the object, for tools that read it.
pub(crate) const DESCRIBE_FORMAT: &str = "dspark-comm-info";
/// Its version: raised when a member changes meaning or goes (new members do not raise it).
pub(crate) const DESCRIBE_VERSION: u32 = 1;

/// The all_reduce sizes the `all_reduce_algorithms` member walks: 4 B to 1 GiB, doubling.
const CHOICE_SIZES: std::ops::RangeInclusive<u32> = 2..=30;

/// A JSON number that reads back as a float (`60.0`, not `60`; `1.8446744073709552e19` for
/// the longest deadline): Python's `info()` has always given floats here. Never NaN or
/// infinite (durations are neither).
fn json_f64(x: f64) -> String {
    if x.is_finite() {
        format!("{x:?}")
    } else {
        "null".to_string()
    }
}

fn str_list<I: IntoIterator<Item = S>, S: AsRef<str>>(items: I) -> String {
    let parts: Vec<String> = items.into_iter().map(|s| json_str(s.as_ref())).collect();
    format!("[{}]", parts.join(","))
}

fn capability(c: &GpuDirectCapability) -> String {
    match c {
        GpuDirectCapability::DmaBuf => "dma-buf".to_string(),
        GpuDirectCapability::PeerMem => "nvidia-peermem".to_string(),
        GpuDirectCapability::Unavailable(why) => format!("unavailable: {why}"),
    }
}

fn direction(p: &DataPath) -> String {
    format!(
        "{{\"path\":{},\"transport\":{},\"memory\":{},\"reason\":{}}}",
        json_str(&p.short()),
        json_str(p.transport.name()),
        json_str(p.memory.short()),
        json_opt_str(p.reason.as_deref())
    )
}

impl Communicator {
    /// Every fact this rank knows about its communicator, as one JSON object (one line):
    /// `format` (`"dspark-comm-info"`) and `version`; `rank`, `world_size`; the transport
    /// (`transport`, `transport_detail`, `transport_reason`: why not a faster one, or null),
    /// each connection's (`peer_transports`, by rank; `intra_host`, `inter_host`), `hosts`,
    /// `local_ranks`, `connected_at_init`; CPU sharing and the spin that follows from it
    /// (`cpu_sharing`, `spin_us`, `spin_yields`); `timeout` (seconds), `segment_bytes`;
    /// the cost model (`cost_model`), `algorithm_forced` (or null) and
    /// `all_reduce_algorithms` (`[{"from_bytes": 4, "algorithm": "..."}, ...]`: where the
    /// choice by size switches, 4 B to 1 GiB); the device-memory path: `data_path` (the
    /// policy), `gpu_direct` (every rank's capability), `device_path` (the common path, e.g.
    /// `tcp/staged`, or `mixed`), `device_paths` (per peer, each direction's path, transport,
    /// memory path and the reason it is not the fast one), `device_path_warnings`,
    /// `device_path_error` (why the policy cannot be honoured, or null), `enqueue_blocks`
    /// (`[{"gpu": 0, "reason": "..."}]`: GPUs where non-blocking device calls run as blocking
    /// ones, among those a non-blocking call has run on so far), `direct_region`;
    /// `rendezvous` and `auth` (how the ranks met and authenticated each other, in words).
    /// Numbers of seconds and microseconds are written as floats.
    ///
    /// Never waits for an operation in progress. Its cost grows with the world (a member per
    /// peer): for a debugging session or a log line, not for every call.
    pub fn describe_json(&self) -> String {
        let i = self.info();
        let mut o = String::with_capacity(1024 + 160 * self.world_size());
        let _ = write!(
            o,
            "{{\"format\":{},\"version\":{DESCRIBE_VERSION},\"rank\":{},\"world_size\":{},\
             \"transport\":{},\"transport_detail\":{},\"transport_reason\":{},\
             \"peer_transports\":{},\"intra_host\":{},\"inter_host\":{},\"hosts\":{},\
             \"local_ranks\":{},\"connected_at_init\":{},\"cpu_sharing\":{},\"spin_us\":{},\
             \"spin_yields\":{},\"timeout\":{},\"segment_bytes\":{},\"cost_model\":{},",
            json_str(DESCRIBE_FORMAT),
            self.rank(),
            self.world_size(),
            json_str(i.transport.name()),
            json_str(&i.transport_detail),
            json_opt_str(i.transport_reason.as_deref()),
            str_list(i.peer_transports.iter().map(|k| k.name())),
            str_list(i.intra_host.iter().map(|k| k.name())),
            json_str(i.inter_host.name()),
            str_list(&i.hosts),
            i.local_ranks,
            json_opt(i.connected_at_init),
            json_str(&i.cpu_sharing),
            json_f64(i.spin.as_secs_f64() * 1e6),
            i.spin_yields,
            json_f64(i.timeout.as_secs_f64()),
            i.segment_bytes,
            json_str(&i.cost_model),
        );
        // Where the choice by size switches for all_reduce (or the forced algorithm).
        let mut steps: Vec<String> = Vec::new();
        let mut last = None;
        for b in CHOICE_SIZES.map(|s| 1usize << s) {
            let a = self.algorithm(Collective::AllReduce, b);
            if last != Some(a) {
                last = Some(a);
                steps.push(format!(
                    "{{\"from_bytes\":{b},\"algorithm\":{}}}",
                    json_str(a.name())
                ));
            }
        }
        let _ = write!(
            o,
            "\"algorithm_forced\":{},\"all_reduce_algorithms\":[{}],\"data_path\":{},\
             \"gpu_direct\":{},",
            json_opt_str(self.forced_algorithm().map(|a| a.name())),
            steps.join(","),
            json_str(self.data_path().name()),
            str_list(i.gpu_direct.iter().map(capability)),
        );
        match self.data_paths(BufferLocation::Device) {
            Ok(plan) => {
                let conns: Vec<String> = plan
                    .connections
                    .iter()
                    .map(|c| {
                        format!(
                            "{{\"peer\":{},\"send\":{},\"recv\":{}}}",
                            c.peer,
                            direction(&c.send),
                            direction(&c.recv)
                        )
                    })
                    .collect();
                let _ = write!(
                    o,
                    "\"device_path\":{},\"device_paths\":[{}],\"device_path_warnings\":{},\
                     \"device_path_error\":null,",
                    json_str(&plan.column()),
                    conns.join(","),
                    str_list(&plan.warnings),
                );
            }
            Err(e) => {
                let _ = write!(
                    o,
                    "\"device_path\":null,\"device_paths\":[],\"device_path_warnings\":[],\
                     \"device_path_error\":{},",
                    json_str(&e.to_string())
                );
            }
        }
        let blocking: Vec<String> = self
            .enqueue_blocking_gpus()
            .iter()
            .map(|(g, why)| format!("{{\"gpu\":{g},\"reason\":{}}}", json_str(why)))
            .collect();
        let _ = write!(
            o,
            "\"enqueue_blocks\":[{}],\"direct_region\":{},\"rendezvous\":{},\"auth\":{}}}",
            blocking.join(","),
            json_str(&i.direct_region.to_string()),
            json_str(&i.rendezvous),
            json_str(&i.auth.to_string()),
        );
        o
    }
}

#[cfg(test)]
mod tests {
    use super::json_f64;

    #[test]
    fn seconds_read_back_as_floats_and_the_longest_deadline_as_json() {
        assert_eq!(json_f64(60.0), "60.0");
        assert_eq!(json_f64(0.5), "0.5");
        let max = std::time::Duration::MAX.as_secs_f64();
        let text = json_f64(max);
        assert_eq!(text.parse::<f64>().ok(), Some(max), "{text}");
        assert!(text.contains('e') || text.contains('.'), "{text}");
        assert_eq!(json_f64(f64::NAN), "null");
    }
}
