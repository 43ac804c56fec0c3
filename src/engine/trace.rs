//! `DSPARK_TRACE`: a Chrome / Perfetto trace of what each rank's engine did.
//!
//! One JSON file per communicator (`<prefix>.rank<r>.json`, and
//! `<prefix>.rank<r>.c<k>.<id>.json` for the k-th further communicator of the process, `id`
//! the flight recorder's communicator id: a split, a torch group, or ranks run as threads),
//! in the Trace Event Format that `chrome://tracing` and <https://ui.perfetto.dev>
//! open. The process is the rank; its lanes ("threads") are:
//!
//! * `calls`: every collective and point-to-point call, from its start to its return, named
//!   after the call and its sequence number (`all_reduce #12`), with the algorithm, the size,
//!   the type and the transport as arguments;
//! * `send → rank p`, `recv ← rank p`: every segment, from the moment its dependencies were met
//!   (it could go) to its completion, so a receive's length includes the wait for the peer;
//!   reducing receives say so;
//! * `waits`: the times the engine blocked in the transport, found nothing to do;
//! * `device`: the staged device path's copies and reductions, from the host's enqueue to the
//!   completion of their stream event.
//!
//! Timestamps are microseconds of the wall clock, so the files of ranks on one host line up
//! when opened together (Perfetto opens several; `jq -s add` concatenates them). Events are
//! written as they complete and flushed at the end of every call; the closing `]` is written
//! when the communicator closes, and the format accepts a file cut short by a crash.
//!
//! Tracing costs a clock read per segment and a buffered write per event: meant for finding
//! out why a call is slow, not for production runs.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Communicators opened with a trace in this process so far (for unique file names).
static OPENED: AtomicUsize = AtomicUsize::new(0);

/// A lane of a rank's trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    Calls,
    Waits,
    Device,
    Send(usize),
    Recv(usize),
}

impl Lane {
    fn tid(self) -> usize {
        match self {
            Lane::Calls => 0,
            Lane::Waits => 1,
            Lane::Device => 2,
            Lane::Send(p) => 10 + 2 * p,
            Lane::Recv(p) => 11 + 2 * p,
        }
    }

    fn name(self) -> String {
        match self {
            Lane::Calls => "calls".into(),
            Lane::Waits => "waits".into(),
            Lane::Device => "device".into(),
            Lane::Send(p) => format!("send \u{2192} rank {p}"),
            Lane::Recv(p) => format!("recv \u{2190} rank {p}"),
        }
    }
}

/// One rank's trace file.
#[derive(Debug)]
pub(crate) struct Trace {
    out: BufWriter<File>,
    path: PathBuf,
    rank: usize,
    /// `epoch` as microseconds since the Unix epoch.
    epoch_us: f64,
    epoch: Instant,
    /// Lanes whose name was written (bit per tid below 128; more are named every time).
    named: u128,
    first: bool,
    /// A write failed: the trace stopped (said once).
    broken: bool,
}

/// The file of the communicator of `rank` that is the process's `k`-th with a trace, its
/// id `id` (the flight recorder's `communicator_id`; empty when unknown): the id keeps apart
/// the files of the two colour groups of one split, each of which has a rank 0 whose second
/// communicator it is (two processes wrote one file), as it does the flight dumps.
pub(crate) fn file_name(prefix: &Path, rank: usize, k: usize, id: &str) -> PathBuf {
    let mut s = prefix.as_os_str().to_owned();
    s.push(".");
    s.push(super::flight::leaf_name(rank, k, id));
    PathBuf::from(s)
}

impl Trace {
    /// Opens this communicator's trace file under `prefix` (see the module docs).
    pub(crate) fn open(
        prefix: &Path,
        rank: usize,
        world: usize,
        id: &str,
    ) -> std::io::Result<Self> {
        let k = OPENED.fetch_add(1, Ordering::Relaxed);
        let path = file_name(prefix, rank, k, id);
        let file = File::create(&path)?;
        let epoch = Instant::now();
        let epoch_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64() * 1e6);
        let mut t = Trace {
            out: BufWriter::new(file),
            path,
            rank,
            epoch_us,
            epoch,
            named: 0,
            first: true,
            broken: false,
        };
        let label = match (k, id) {
            (0, _) => format!("rank {rank} of {world}"),
            (_, "") => format!("rank {rank} of {world} (communicator {k} of this process)"),
            _ => format!("rank {rank} of {world} (communicator {k} of this process, id {id})"),
        };
        t.line(&format!(
            r#"{{"ph":"M","name":"process_name","pid":{rank},"tid":0,"args":{{"name":{}}}}}"#,
            json_str(&label)
        ));
        t.line(&format!(
            r#"{{"ph":"M","name":"process_sort_index","pid":{rank},"tid":0,"args":{{"sort_index":{rank}}}}}"#
        ));
        Ok(t)
    }

    /// Where the trace goes.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn ts(&self, t: Instant) -> f64 {
        self.epoch_us + t.saturating_duration_since(self.epoch).as_secs_f64() * 1e6
    }

    fn line(&mut self, event: &str) {
        if self.broken {
            return;
        }
        let sep = if self.first { "[\n" } else { ",\n" };
        self.first = false;
        if let Err(e) = self
            .out
            .write_all(sep.as_bytes())
            .and_then(|()| self.out.write_all(event.as_bytes()))
        {
            self.stop(&e);
        }
    }

    fn stop(&mut self, e: &std::io::Error) {
        self.broken = true;
        tracing::warn!(
            rank = self.rank,
            "DSPARK_TRACE: writing {} failed ({e}); the trace stops here",
            self.path.display()
        );
    }

    fn name_lane(&mut self, lane: Lane) {
        let tid = lane.tid();
        if tid < 128 {
            if self.named & (1 << tid) != 0 {
                return;
            }
            self.named |= 1 << tid;
        }
        let ev = format!(
            r#"{{"ph":"M","name":"thread_name","pid":{},"tid":{tid},"args":{{"name":{}}}}}"#,
            self.rank,
            json_str(&lane.name())
        );
        self.line(&ev);
        let ev = format!(
            r#"{{"ph":"M","name":"thread_sort_index","pid":{},"tid":{tid},"args":{{"sort_index":{tid}}}}}"#,
            self.rank
        );
        self.line(&ev);
    }

    /// A span on `lane` from `start` to `end`. `args` is a list of `(key, value)` where each
    /// value is already JSON (a number, or a string through [`json_str`]).
    pub(crate) fn span(
        &mut self,
        lane: Lane,
        cat: &str,
        name: &str,
        start: Instant,
        end: Instant,
        args: &[(&str, String)],
    ) {
        if self.broken {
            return;
        }
        self.name_lane(lane);
        let ts = self.ts(start);
        let dur = end.saturating_duration_since(start).as_secs_f64() * 1e6;
        let mut ev = format!(
            r#"{{"ph":"X","cat":{},"name":{},"pid":{},"tid":{},"ts":{ts:.3},"dur":{dur:.3}"#,
            json_str(cat),
            json_str(name),
            self.rank,
            lane.tid()
        );
        if !args.is_empty() {
            ev.push_str(r#","args":{"#);
            for (i, (k, v)) in args.iter().enumerate() {
                if i > 0 {
                    ev.push(',');
                }
                let _ = write!(ev, "{}:{v}", json_str(k));
            }
            ev.push('}');
        }
        ev.push('}');
        self.line(&ev);
    }

    /// Pushes what is buffered to the file (end of every call).
    pub(crate) fn flush(&mut self) {
        if !self.broken {
            if let Err(e) = self.out.flush() {
                self.stop(&e);
            }
        }
    }

    /// Ends the JSON array (the communicator closes).
    pub(crate) fn finish(&mut self) {
        if self.broken {
            return;
        }
        let end = if self.first { "[]\n" } else { "\n]\n" };
        self.first = false;
        if let Err(e) = self
            .out
            .write_all(end.as_bytes())
            .and_then(|()| self.out.flush())
        {
            self.stop(&e);
        }
        self.broken = true; // nothing after the end
    }
}

/// `s` as a JSON string literal.
pub(crate) fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// `s` as a JSON string literal, or `null`.
pub(crate) fn json_opt_str(s: Option<&str>) -> String {
    s.map_or_else(|| "null".to_string(), json_str)
}

/// `v` as its `Display` (a JSON number), or `null`.
pub(crate) fn json_opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "null".to_string(), |x| x.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_escaped_for_json() {
        assert_eq!(json_str(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(json_str("x\ny\u{1}"), r#""x\ny\u0001""#);
        assert_eq!(json_str("send \u{2192} rank 1"), "\"send \u{2192} rank 1\"");
    }

    #[test]
    fn the_first_communicator_of_a_process_has_the_plain_name() {
        let p = Path::new("/tmp/run");
        assert_eq!(
            file_name(p, 3, 0, "ab"),
            PathBuf::from("/tmp/run.rank3.json")
        );
        assert_eq!(
            file_name(p, 3, 2, ""),
            PathBuf::from("/tmp/run.rank3.c2.json")
        );
        // Two groups of one split: the same rank and count, apart by their ids.
        assert_eq!(
            file_name(p, 0, 1, "00ff"),
            PathBuf::from("/tmp/run.rank0.c1.00ff.json")
        );
        assert_ne!(file_name(p, 0, 1, "00ff"), file_name(p, 0, 1, "1234"));
    }
}
