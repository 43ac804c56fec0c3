//! `dspark analyze DIR`: merges the ranks' flight records (`DSPARK_FR_DUMP=DIR`, or
//! `Communicator::flight_record` written with `write_to`) and says in a few lines which rank
//! is behind and on which call, the first call where ranks disagree, which peer everyone
//! waits for, and the last call every rank completed. Missing, partial and corrupt dumps are
//! named and left out; nothing here panics on a file's content.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde_json::Value;

/// Arguments of `dspark analyze`.
#[derive(clap::Args, Debug)]
pub(crate) struct AnalyzeArgs {
    /// The directory the ranks dumped into (`DSPARK_FR_DUMP`).
    pub dir: PathBuf,
}

/// One recorded call, as read from a dump.
#[derive(Clone, Debug, PartialEq)]
struct Call {
    seq: Option<u64>,
    coll: String,
    dtype: String,
    count: u64,
    op: String,
    root: Option<u64>,
    algorithm: String,
    state: String,
    failure: Option<Failure>,
}

#[derive(Clone, Debug, PartialEq)]
struct Failure {
    kind: String,
    peer: Option<u64>,
    /// (peer, direction, step, steps, bytes, of_bytes)
    progress: Option<(u64, String, u64, u64, u64, u64)>,
}

impl Call {
    fn is_collective(&self) -> bool {
        !matches!(self.coll.as_str(), "send" | "recv" | "send_recv")
    }

    /// `all_reduce #5`
    fn name(&self) -> String {
        match self.seq {
            Some(s) => format!("{} #{s}", self.coll),
            None => format!("{} (queued)", self.coll),
        }
    }

    /// `f32 × 2, sum, root 0, ring`
    fn shape(&self) -> String {
        let mut s = if self.count == u64::MAX {
            // An all_to_all_v: counts per peer.
            format!("{} × counts per peer", self.dtype)
        } else {
            format!("{} × {}", self.dtype, self.count)
        };
        if !self.op.is_empty() {
            s += &format!(", {}", self.op);
        }
        if let Some(r) = self.root {
            s += &format!(", root {r}");
        }
        if !self.algorithm.is_empty() {
            s += &format!(", {}", self.algorithm);
        }
        s
    }

    fn signature(&self) -> (&str, &str, u64, &str, Option<u64>, &str) {
        (
            &self.coll,
            &self.dtype,
            self.count,
            &self.op,
            self.root,
            &self.algorithm,
        )
    }
}

/// One rank's dump.
#[derive(Debug)]
struct Dump {
    rank: u64,
    world: u64,
    error: Option<String>,
    calls: Vec<Call>,
}

fn text(v: &Value, k: &str) -> String {
    v.get(k).and_then(Value::as_str).unwrap_or("").to_string()
}

fn parse_call(v: &Value) -> Option<Call> {
    let failure = v.get("failure").filter(|f| f.is_object()).map(|f| Failure {
        kind: text(f, "kind"),
        peer: f.get("peer").and_then(Value::as_u64),
        progress: f.get("progress").filter(|p| p.is_object()).map(|p| {
            let n = |k: &str| p.get(k).and_then(Value::as_u64).unwrap_or(0);
            (
                n("peer"),
                text(p, "direction"),
                n("step"),
                n("steps"),
                n("bytes"),
                n("of_bytes"),
            )
        }),
    });
    Some(Call {
        seq: v.get("seq").and_then(Value::as_u64),
        coll: v.get("collective")?.as_str()?.to_string(),
        dtype: text(v, "dtype"),
        count: v.get("count").and_then(Value::as_u64).unwrap_or(0),
        op: text(v, "op"),
        root: v.get("root").and_then(Value::as_u64),
        algorithm: text(v, "algorithm"),
        state: text(v, "state"),
        failure,
    })
}

/// Reads one dump: `Ok((communicator, dump))`, or why it cannot be used.
fn read_dump(path: &Path) -> Result<(u64, Dump), String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot be read: {e}"))?;
    if bytes.is_empty() {
        return Err("is empty (the rank may have died while writing it)".into());
    }
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| {
        if e.is_eof() {
            format!("is cut short ({e}): the rank may have died while writing it")
        } else {
            format!("is not valid JSON ({e})")
        }
    })?;
    if v.get("format").and_then(Value::as_str) != Some(dspark::flight::FORMAT) {
        return Err(format!(
            "is not a dspark flight record (no \"format\": \"{}\")",
            dspark::flight::FORMAT
        ));
    }
    let version = v.get("version").and_then(Value::as_u64).unwrap_or(0);
    if version > u64::from(dspark::flight::VERSION) {
        return Err(format!(
            "has format version {version}; this dspark reads version {} (use a newer dspark)",
            dspark::flight::VERSION
        ));
    }
    let num = |k: &str| {
        v.get(k)
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("has no {k:?}"))
    };
    let (rank, world) = (num("rank")?, num("world")?);
    if rank >= world {
        return Err(format!("says rank {rank} of a world of {world}"));
    }
    let entries = v
        .get("entries")
        .and_then(Value::as_array)
        .ok_or("has no \"entries\" list")?;
    let calls: Vec<Call> = entries.iter().filter_map(parse_call).collect();
    let comm = v.get("communicator").and_then(Value::as_u64).unwrap_or(0);
    let error = v.get("error").and_then(Value::as_str).map(str::to_string);
    Ok((
        comm,
        Dump {
            rank,
            world,
            error,
            calls,
        },
    ))
}

fn list(ranks: &BTreeSet<u64>) -> String {
    let v: Vec<String> = ranks.iter().map(u64::to_string).collect();
    match v.len() {
        1 => format!("rank {}", v[0]),
        _ => format!("ranks {}", v.join(", ")),
    }
}

/// The analysis of one communicator's dumps, as lines.
fn analyze(dumps: &BTreeMap<u64, Dump>) -> Vec<String> {
    let mut out = Vec::new();
    let world = dumps.values().map(|d| d.world).max().unwrap_or(0);
    if let Some(d) = dumps.values().find(|d| d.world != world) {
        out.push(format!(
            "warning: rank {} says the world has {} ranks, others {world}: dumps of different jobs?",
            d.rank, d.world
        ));
    }
    let present: BTreeSet<u64> = dumps.keys().copied().collect();
    let missing: BTreeSet<u64> = (0..world).filter(|r| !present.contains(r)).collect();
    let mut head = format!("dumps from {} of {world}", list(&present));
    if !missing.is_empty() {
        head += &format!(
            "; none from {} (a rank writes one when its communicator fails; one that hung \
             or died leaves none)",
            list(&missing)
        );
    }
    out.push(head);
    for d in dumps.values() {
        if let Some(e) = &d.error {
            out.push(format!("rank {} failed: {e}", d.rank));
        }
    }
    // Collectives by sequence number, per rank.
    let colls: BTreeMap<u64, BTreeMap<u64, &Call>> = dumps
        .iter()
        .map(|(&r, d)| {
            let m = d
                .calls
                .iter()
                .filter(|c| c.is_collective())
                .filter_map(|c| Some((c.seq?, c)))
                .collect();
            (r, m)
        })
        .collect();

    // The last call every rank completed.
    let done: BTreeMap<u64, Option<u64>> = colls
        .iter()
        .map(|(&r, m)| {
            let last = m
                .iter()
                .filter(|(_, c)| c.state == "completed")
                .map(|(&s, _)| s)
                .max();
            (r, last)
        })
        .collect();
    let all_done = done.values().copied().min().flatten();
    match all_done {
        Some(s) => {
            let c = colls.values().find_map(|m| m.get(&s));
            let what = c.map_or(format!("call #{s}"), |c| {
                format!("{} ({})", c.name(), c.shape())
            });
            let note = if missing.is_empty() {
                String::new()
            } else {
                format!(" (of the ranks with a dump; {} unknown)", list(&missing))
            };
            out.push(format!("last call every rank completed: {what}{note}"));
        }
        None => out.push("last call every rank completed: none in the dumps".into()),
    }

    // The first call where ranks disagree.
    let seqs: BTreeSet<u64> = colls.values().flat_map(|m| m.keys().copied()).collect();
    let mut disagreement = None;
    for &s in &seqs {
        let at: Vec<(u64, &Call)> = colls
            .iter()
            .filter_map(|(&r, m)| m.get(&s).map(|c| (r, *c)))
            .collect();
        let Some(&(r0, c0)) = at.first() else {
            continue;
        };
        if let Some(&(r1, c1)) = at.iter().find(|(_, c)| c.signature() != c0.signature()) {
            disagreement = Some((s, r0, c0, r1, c1));
            break;
        }
    }
    match disagreement {
        Some((s, r0, c0, r1, c1)) => out.push(format!(
            "first disagreement: call #{s}: rank {r0} called {} ({}), rank {r1} called {} ({})",
            c0.coll,
            c0.shape(),
            c1.coll,
            c1.shape()
        )),
        None if !seqs.is_empty() => out.push(format!(
            "no disagreement in the calls the dumps hold (#{}..#{})",
            seqs.first().copied().unwrap_or(0),
            seqs.last().copied().unwrap_or(0)
        )),
        None => {}
    }

    // Which rank is behind: the ranks whose last call is older than the others'.
    let last: BTreeMap<u64, Option<&Call>> = colls
        .iter()
        .map(|(&r, m)| (r, m.values().next_back().copied()))
        .collect();
    let front = last.values().filter_map(|c| c.and_then(|c| c.seq)).max();
    if let Some(front) = front {
        let behind: BTreeSet<u64> = last
            .iter()
            .filter(|(_, c)| c.and_then(|c| c.seq).is_none_or(|s| s < front))
            .map(|(&r, _)| r)
            .collect();
        let ahead: BTreeSet<u64> = present.difference(&behind).copied().collect();
        let at = colls
            .values()
            .find_map(|m| m.get(&front))
            .map_or(format!("call #{front}"), |c| c.name());
        for &r in &behind {
            let was = match last.get(&r).copied().flatten() {
                Some(c) => format!("its last call is {} ({})", c.name(), c.state),
                None => "it recorded no collective".into(),
            };
            out.push(format!(
                "behind: rank {r}: {was}; it never started {at}, which {} reached",
                list(&ahead)
            ));
        }
        if behind.is_empty() && !missing.is_empty() {
            out.push(format!(
                "behind: unknown: every dump reached {at}; {} left no dump",
                list(&missing)
            ));
        }
    }

    // Which peer everyone waits for: each failed rank names the peer its schedule waited
    // for (without that, the peer its error names, unless an abort: that names the rank
    // that failed first, not a cause); follow the chain (rank 1 waits for rank 0, which
    // waits for rank 2) to the rank that waits for nobody.
    let mut waits: BTreeMap<u64, (u64, String)> = BTreeMap::new();
    for (&r, d) in dumps {
        let Some((c, f)) = d
            .calls
            .iter()
            .find_map(|c| c.failure.as_ref().map(|f| (c, f)))
            // A rank that found a mismatch waits for nobody: the disagreement says it.
            .filter(|(_, f)| f.kind != "mismatch")
        else {
            continue;
        };
        let named = f.peer.filter(|_| f.kind != "aborted");
        let Some(p) = f.progress.as_ref().map(|p| p.0).or(named) else {
            continue;
        };
        let how = match (&f.progress, f.kind.as_str()) {
            (Some((_, dir, step, steps, got, of)), "timeout") if dir == "recv" => format!(
                "rank {r} timed out in {} receiving from rank {p} (step {step} of {steps}, \
                 {got} of {of} bytes)",
                c.name()
            ),
            (Some((_, _, step, steps, ..)), "timeout") => format!(
                "rank {r} timed out in {} sending to rank {p} (step {step} of {steps})",
                c.name()
            ),
            (Some((_, dir, step, steps, got, of)), "aborted") => format!(
                "rank {r} was {} rank {p} in {} (step {step} of {steps}{}) when rank {} \
                 aborted",
                if dir == "recv" {
                    "receiving from"
                } else {
                    "sending to"
                },
                c.name(),
                if dir == "recv" {
                    format!(", {got} of {of} bytes")
                } else {
                    String::new()
                },
                f.peer.map_or("?".into(), |a| a.to_string()),
            ),
            (_, "peer_lost") => format!("rank {r} lost rank {p} in {}", c.name()),
            (_, "mismatch") => format!("rank {r} disagreed with rank {p} in {}", c.name()),
            (_, k) => format!("rank {r}: {k} with rank {p} in {}", c.name()),
        };
        waits.insert(r, (p, how));
    }
    let root = |mut r: u64| {
        let mut seen = BTreeSet::new();
        while let Some((p, _)) = waits.get(&r) {
            if !seen.insert(r) {
                break;
            }
            r = *p;
        }
        r
    };
    let mut roots: BTreeMap<u64, Vec<&str>> = BTreeMap::new();
    for (&r, (_, how)) in &waits {
        roots.entry(root(r)).or_default().push(how);
    }
    // The most waited-for; on a tie, one that is behind or left no dump.
    if let Some((&peer, why)) = roots
        .iter()
        .max_by_key(|(p, v)| (v.len(), missing.contains(p) || !waits.contains_key(p)))
    {
        let note = if missing.contains(&peer) {
            " (it left no dump)"
        } else {
            ""
        };
        out.push(format!(
            "everyone waits for rank {peer}{note}: {}",
            why.join("; ")
        ));
    }
    out
}

/// Runs `dspark analyze`.
pub(crate) fn analyze_main(args: &AnalyzeArgs) -> ExitCode {
    match run(&args.dir) {
        Ok(lines) => {
            for l in lines {
                println!("{l}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("dspark analyze: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The report for `dir`, or why there is none.
fn run(dir: &Path) -> Result<Vec<String>, String> {
    let rd = std::fs::read_dir(dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    let mut files: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    let mut lines = Vec::new();
    let mut comms: BTreeMap<u64, BTreeMap<u64, Dump>> = BTreeMap::new();
    for f in &files {
        let name = f.file_name().map_or_else(
            || f.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        match read_dump(f) {
            Ok((k, d)) => {
                let rank = d.rank;
                if let std::collections::btree_map::Entry::Vacant(v) =
                    comms.entry(k).or_default().entry(rank)
                {
                    v.insert(d);
                } else {
                    lines.push(format!(
                        "warning: {name}: a second dump of rank {rank} of communicator {k}: ignored"
                    ));
                }
            }
            Err(e) => lines.push(format!("warning: {name} {e}: ignored")),
        }
    }
    if comms.is_empty() {
        return Err(format!(
            "no usable flight record in {} ({} .json file(s) read){}",
            dir.display(),
            files.len(),
            if lines.is_empty() {
                String::new()
            } else {
                format!(":\n{}", lines.join("\n"))
            }
        ));
    }
    let several = comms.len() > 1;
    for (k, dumps) in &comms {
        if several {
            lines.push(format!("communicator {k}:"));
        }
        let indent = if several { "  " } else { "" };
        lines.extend(analyze(dumps).into_iter().map(|l| format!("{indent}{l}")));
    }
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(seq: u64, count: u64, state: &str) -> Call {
        Call {
            seq: Some(seq),
            coll: "all_reduce".into(),
            dtype: "f32".into(),
            count,
            op: "sum".into(),
            root: None,
            algorithm: "ring".into(),
            state: state.into(),
            failure: None,
        }
    }

    #[test]
    fn a_late_rank_and_a_disagreement_are_named() {
        let mut dumps = BTreeMap::new();
        let timeout = Failure {
            kind: "timeout".into(),
            peer: Some(2),
            progress: Some((2, "recv".into(), 1, 4, 0, 8)),
        };
        for r in 0..2 {
            let mut last = call(3, 2, "failed");
            last.failure = Some(timeout.clone());
            dumps.insert(
                r,
                Dump {
                    rank: r,
                    world: 3,
                    error: None,
                    calls: vec![call(1, 2, "completed"), call(2, 2, "completed"), last],
                },
            );
        }
        dumps.insert(
            2,
            Dump {
                rank: 2,
                world: 3,
                error: None,
                calls: vec![call(1, 2, "completed"), call(2, 5, "completed")],
            },
        );
        let out = analyze(&dumps).join("\n");
        assert!(
            out.contains("behind: rank 2: its last call is all_reduce #2"),
            "{out}"
        );
        assert!(out.contains("first disagreement: call #2"), "{out}");
        assert!(out.contains("everyone waits for rank 2"), "{out}");
        assert!(
            out.contains("last call every rank completed: all_reduce #2"),
            "{out}"
        );
    }
}
