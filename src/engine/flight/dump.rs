//! The flight record's dump: its JSON (the format is the parent module's docs) and its file,
//! written on demand or when a communicator fails (`DSPARK_FR_DUMP`).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use super::super::trace::{json_opt as opt, json_opt_str, json_str};
use super::{unix_ns, FailureKind, FlightEntry, FlightRecord, Recorder, FORMAT, VERSION};
use crate::error::Error;
use crate::plan::Algorithm;
use crate::types::{DataType, ReduceOp};

/// The dump file of `rank`'s communicator number `k` (id `id`, see
/// [`FlightRecord::communicator_id`]) in `dir`: `rank<r>.json` for a process's first,
/// `rank<r>.c<k>.<id>.json` for the others (the two colour groups of one split both have a
/// rank 0 whose second communicator it is: the id keeps their files apart).
pub fn file_name(dir: &Path, rank: usize, k: usize, id: &str) -> PathBuf {
    dir.join(leaf_name(rank, k, id))
}

/// [`file_name`]'s last component, which a trace file (`DSPARK_TRACE`) ends in too.
pub(crate) fn leaf_name(rank: usize, k: usize, id: &str) -> String {
    match (k, id) {
        (0, _) => format!("rank{rank}.json"),
        (_, "") => format!("rank{rank}.c{k}.json"),
        _ => format!("rank{rank}.c{k}.{id}.json"),
    }
}

impl FlightEntry {
    fn json(&self, o: &mut String) {
        let s = json_opt_str;
        let _ = write!(
            o,
            r#"{{"seq":{},"collective":{},"dtype":{},"count":{},"op":{},"root":{},"peer":{},"#,
            opt(self.seq),
            json_str(self.collective),
            s(self.dtype.map(DataType::name)),
            self.count,
            s(self.op.map(ReduceOp::name)),
            opt(self.root),
            opt(self.peer),
        );
        if let Some((from, rseq)) = self.recv_from {
            let _ = write!(o, r#""recv_from":{from},"recv_seq":{rseq},"#);
        }
        let dur = self
            .ended_unix_ns
            .map(|e| format!("{:.3}", e.saturating_sub(self.started_unix_ns) as f64 / 1e3));
        let _ = write!(
            o,
            r#""algorithm":{},"transport":{},"path":{},"state":{},"started_unix_ns":{},"ended_unix_ns":{},"duration_us":{},"failure":"#,
            s(self.algorithm.map(Algorithm::name)),
            json_str(self.transport.name()),
            json_str(self.path.name()),
            json_str(self.state.name()),
            self.started_unix_ns,
            opt(self.ended_unix_ns),
            dur.as_deref().unwrap_or("null"),
        );
        match &self.failure {
            None => o.push_str("null"),
            Some(f) => {
                let _ = write!(
                    o,
                    r#"{{"kind":{},"peer":{},"progress":"#,
                    json_str(f.kind.name()),
                    opt(f.peer)
                );
                match &f.progress {
                    None => o.push_str("null"),
                    Some(p) => {
                        let _ = write!(
                            o,
                            r#"{{"peer":{},"direction":{},"step":{},"steps":{},"steps_done":{},"bytes":{},"of_bytes":{}}}"#,
                            p.peer,
                            json_str(if p.sending { "send" } else { "recv" }),
                            p.step,
                            p.steps,
                            p.steps_done,
                            p.bytes,
                            p.of_bytes
                        );
                    }
                }
                o.push('}');
            }
        }
        o.push('}');
    }
}

impl FlightRecord {
    /// The record in the dump format (see the module docs), with `reason` (`on_demand`, or
    /// why the communicator failed).
    pub fn to_json_with_reason(&self, reason: &str) -> String {
        let mut o = String::with_capacity(256 + 400 * self.entries.len());
        let _ =
            write!(
            o,
            "{{\"format\":{},\"version\":{VERSION},\"rank\":{},\"world\":{},\"communicator\":{},\
             \"communicator_id\":{},\"host\":{},\"pid\":{},\"capacity\":{},\"recorded\":{},\"reason\":{},\"error\":{},\
             \"dumped_at_unix_ns\":{},",
            json_str(FORMAT),
            self.rank,
            self.world,
            self.communicator,
            json_str(&self.communicator_id),
            self.host().map_or_else(|| "null".into(), json_str),
            std::process::id(),
            self.capacity,
            self.recorded,
            json_str(reason),
            self.error.as_deref().map_or_else(|| "null".into(), json_str),
            unix_ns(),
        );
        super::super::places::json(&mut o, &self.places);
        o.push_str(",\"entries\":[");
        for (i, e) in self.entries.iter().enumerate() {
            o.push_str(if i == 0 { "\n" } else { ",\n" });
            e.json(&mut o);
        }
        o.push_str("\n]}\n");
        o
    }

    /// The record in the dump format, taken on demand.
    pub fn to_json(&self) -> String {
        self.to_json_with_reason("on_demand")
    }

    /// Writes the dump into `dir` (created if missing) as `rank<r>.json`
    /// (`rank<r>.c<k>.<id>.json` for this process's k-th further communicator: [`file_name`]);
    /// returns the file.
    ///
    /// # Errors
    /// The I/O error.
    pub fn write_to(&self, dir: &Path, reason: &str) -> std::io::Result<PathBuf> {
        std::fs::create_dir_all(dir)?;
        let path = file_name(dir, self.rank, self.communicator, &self.communicator_id);
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, self.to_json_with_reason(reason))?;
        std::fs::rename(&tmp, &path)?;
        Ok(path)
    }
}

impl Recorder {
    /// Writes the record into `DSPARK_FR_DUMP`'s directory, if set, because of `e` (the
    /// communicator just failed). Never fails: a dump that cannot be written is a warning.
    pub(crate) fn dump_on_failure(&self, e: &Error) {
        let Some(dir) = &self.dump_dir else {
            return;
        };
        let queued = match self.queued.0.get().map(|f| f()) {
            Some(Some(q)) => q,
            Some(None) => {
                tracing::warn!(
                    rank = self.rank,
                    "DSPARK_FR_DUMP: the communicator's queue was busy for 1 ms: this dump \
                     lists no queued operations (an on-demand record can)"
                );
                Vec::new()
            }
            None => Vec::new(),
        };
        let rec = self.snapshot(&queued);
        let reason = FailureKind::of(e).0.name();
        match rec.write_to(dir, reason) {
            Ok(p) => tracing::warn!(
                rank = self.rank,
                "DSPARK_FR_DUMP: flight record written to {} (`dspark analyze {}` merges the ranks')",
                p.display(),
                dir.display()
            ),
            Err(err) => tracing::warn!(
                rank = self.rank,
                "DSPARK_FR_DUMP: cannot write the flight record into {}: {err}",
                dir.display()
            ),
        }
    }
}
