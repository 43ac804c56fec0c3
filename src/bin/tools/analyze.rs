//! `dspark analyze DIR`: merges the ranks' flight records (`DSPARK_FR_DUMP=DIR`, or
//! `Communicator::flight_record` written with `write_to`) and says in a few lines which rank
//! is behind and on which call, the first call where ranks disagree, which peer everyone
//! waits for, and the last call every rank completed. Missing, partial and corrupt dumps are
//! named and left out; nothing here panics on a file's content.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde_json::Value;

use crate::waits::{aborters_wait, behind_note, end, End, Wait};

/// Arguments of `dspark analyze`.
#[derive(clap::Args, Debug)]
pub(crate) struct AnalyzeArgs {
    /// The directory the ranks dumped into (`DSPARK_FR_DUMP`).
    pub dir: PathBuf,
}

/// One recorded call, as read from a dump.
#[derive(Clone, Debug, Default, PartialEq)]
struct Call {
    seq: Option<u64>,
    coll: String,
    dtype: String,
    count: u64,
    op: String,
    root: Option<u64>,
    /// A send's or receive's peer.
    peer: Option<u64>,
    algorithm: String,
    state: String,
    failure: Option<Failure>,
    /// `started_unix_ns` and `ended_unix_ns` (0: not said).
    started_ns: u64,
    ended_ns: u64,
}

#[derive(Clone, Debug, PartialEq)]
struct Failure {
    kind: String,
    peer: Option<u64>,
    progress: Option<Progress>,
}

/// Where a failed call's schedule stood (`failure.progress`).
#[derive(Clone, Debug, Default, PartialEq)]
struct Progress {
    peer: u64,
    /// `recv` or `send`.
    direction: String,
    step: u64,
    steps: u64,
    steps_done: u64,
    bytes: u64,
    of_bytes: u64,
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
#[derive(Debug, Default)]
struct Dump {
    rank: u64,
    /// Its communicator's number in the writing process (`communicator`).
    communicator: u64,
    world: u64,
    error: Option<String>,
    calls: Vec<Call>,
    /// When it was written (`dumped_at_unix_ns`; 0: not said).
    dumped_at_ns: u64,
    /// Calls recorded since init (`recorded`; 0: not said): more than `calls` holds means
    /// the ring overflowed and the oldest are gone.
    recorded: u64,
    /// Where ranks run, as this dump says (its own `host` and `pid`, and its `places`).
    places: BTreeMap<u64, Place>,
}

/// Where a rank runs: its host (empty: unknown) and process id.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Place {
    host: String,
    pid: Option<u64>,
}

impl Place {
    /// ` (on node02, pid 5151)`, or less where less is known.
    fn said(&self) -> String {
        self.said_with(None)
    }

    /// [`Place::said`] with `note` last in the parentheses: ` (on node02, pid 5151; it left
    /// no dump)`.
    fn said_with(&self, note: Option<&str>) -> String {
        let mut parts = Vec::new();
        if !self.host.is_empty() {
            parts.push(format!("on {}", self.host));
        }
        if let Some(p) = self.pid {
            parts.push(format!("pid {p}"));
        }
        let mut text = parts.join(", ");
        if let Some(n) = note {
            text = if text.is_empty() {
                n.to_string()
            } else {
                format!("{text}; {n}")
            };
        }
        if text.is_empty() {
            text
        } else {
            format!(" ({text})")
        }
    }
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
            Progress {
                peer: n("peer"),
                direction: text(p, "direction"),
                step: n("step"),
                steps: n("steps"),
                steps_done: n("steps_done"),
                bytes: n("bytes"),
                of_bytes: n("of_bytes"),
            }
        }),
    });
    Some(Call {
        seq: v.get("seq").and_then(Value::as_u64),
        coll: v.get("collective")?.as_str()?.to_string(),
        dtype: text(v, "dtype"),
        count: v.get("count").and_then(Value::as_u64).unwrap_or(0),
        op: text(v, "op"),
        root: v.get("root").and_then(Value::as_u64),
        peer: v.get("peer").and_then(Value::as_u64),
        algorithm: text(v, "algorithm"),
        state: text(v, "state"),
        failure,
        started_ns: v
            .get("started_unix_ns")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        ended_ns: v.get("ended_unix_ns").and_then(Value::as_u64).unwrap_or(0),
    })
}

/// Which communicator a dump is of: its `communicator_id` where it has one (every rank of
/// a communicator records the same), else its number in the writing process (older dumps).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct CommKey {
    number: u64,
    id: String,
}

impl CommKey {
    /// What groups dumps: the id, or (without one) the number.
    fn group(&self) -> String {
        if self.id.is_empty() {
            format!("#{}", self.number)
        } else {
            self.id.clone()
        }
    }

    fn label(&self) -> String {
        if self.id.is_empty() {
            format!("communicator {}", self.number)
        } else {
            format!("communicator {} (id {})", self.number, self.id)
        }
    }
}

/// Reads one dump: `Ok((communicator, dump))`, or why it cannot be used.
fn read_dump(path: &Path) -> Result<(CommKey, Dump), String> {
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
    if world > dspark::config::MAX_WORLD_SIZE as u64 {
        return Err(format!(
            "says a world of {world} ranks, more than dspark allows ({})",
            dspark::config::MAX_WORLD_SIZE
        ));
    }
    if rank >= world {
        return Err(format!("says rank {rank} of a world of {world}"));
    }
    let entries = v
        .get("entries")
        .and_then(Value::as_array)
        .ok_or("has no \"entries\" list")?;
    let calls: Vec<Call> = entries.iter().filter_map(parse_call).collect();
    let comm = CommKey {
        number: v.get("communicator").and_then(Value::as_u64).unwrap_or(0),
        id: text(&v, "communicator_id"),
    };
    let error = v.get("error").and_then(Value::as_str).map(str::to_string);
    let number = comm.number;
    let mut places: BTreeMap<u64, Place> = v
        .get("places")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|p| {
            let r = p.get("rank")?.as_u64().filter(|&r| r < world)?;
            Some((
                r,
                Place {
                    host: text(p, "host"),
                    pid: p.get("pid").and_then(Value::as_u64),
                },
            ))
        })
        .collect();
    // Its own, as it wrote them.
    let own = places.entry(rank).or_default();
    if let Some(h) = v.get("host").and_then(Value::as_str) {
        own.host = h.to_string();
    }
    own.pid = v.get("pid").and_then(Value::as_u64).or(own.pid);
    Ok((
        comm,
        Dump {
            rank,
            communicator: number,
            world,
            error,
            calls,
            dumped_at_ns: v
                .get("dumped_at_unix_ns")
                .and_then(Value::as_u64)
                .unwrap_or(0),
            recorded: v.get("recorded").and_then(Value::as_u64).unwrap_or(0),
            places,
        },
    ))
}

/// `rank 3`, `ranks 0, 2`, `ranks 0-36, 38-63`: runs of three or more as ranges, so that a
/// 64-rank job's lists stay one short line.
fn list(ranks: &BTreeSet<u64>) -> String {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &r in ranks {
        match runs.last_mut() {
            Some((_, hi)) if *hi + 1 == r => *hi = r,
            _ => runs.push((r, r)),
        }
    }
    let parts: Vec<String> = runs
        .iter()
        .flat_map(|&(lo, hi)| match hi - lo {
            0 => vec![lo.to_string()],
            1 => vec![lo.to_string(), hi.to_string()],
            _ => vec![format!("{lo}-{hi}")],
        })
        .collect();
    match (ranks.len(), parts.len()) {
        (1, _) => format!("rank {}", parts[0]),
        _ => format!("ranks {}", parts.join(", ")),
    }
}

/// The first `MAX_SAID` of `items`, then how many more.
fn some_of(items: &[String], sep: &str) -> String {
    let mut s = items
        .iter()
        .take(MAX_SAID)
        .cloned()
        .collect::<Vec<_>>()
        .join(sep);
    if items.len() > MAX_SAID {
        s += &format!("{sep}and {} more", items.len() - MAX_SAID);
    }
    s
}

/// Dumps written further apart than this (seconds) are said to be of different runs.
const STALE_S: u64 = 3600;

/// How many of a kind of line (failed ranks, the reasons of a wait) are said in full.
const MAX_SAID: usize = 4;

/// Why a rank waits: whether it was aborted (a consequence, not a cause), and how.
type Why = (bool, String);

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
    // Dumps of one failure are written within its deadline of one another; hours apart,
    // they are of different runs (a directory reused).
    let times: Vec<u64> = dumps
        .values()
        .map(|d| d.dumped_at_ns)
        .filter(|&t| t > 0)
        .collect();
    if let (Some(&lo), Some(&hi)) = (times.iter().min(), times.iter().max()) {
        let apart = (hi - lo) / 1_000_000_000;
        if apart > STALE_S {
            let old: BTreeSet<u64> = dumps
                .values()
                .filter(|d| d.dumped_at_ns > 0 && d.dumped_at_ns < hi - STALE_S * 1_000_000_000)
                .map(|d| d.rank)
                .collect();
            out.push(format!(
                "warning: the dumps were written {:.1} hours apart ({} older): of different \
                 runs? empty DSPARK_FR_DUMP's directory between runs",
                apart as f64 / 3600.0,
                list(&old)
            ));
        }
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
    if dumps
        .values()
        .all(|d| d.calls.is_empty() && d.error.is_none())
    {
        out.push(head + "; no calls recorded");
        return out;
    }
    out.push(head);
    let places = merged_places(dumps);
    let place_of = |r: u64| places.get(&r).map_or(String::new(), Place::said);
    // Whether a line below says some rank is stuck (behind, inside a call, waited for).
    let mut stuck = false;
    if let Some(line) = hosts_line(&places, world) {
        out.push(line);
    }
    let failed: Vec<&Dump> = dumps.values().filter(|d| d.error.is_some()).collect();
    for d in failed.iter().take(MAX_SAID) {
        out.push(format!(
            "rank {} failed: {}",
            d.rank,
            d.error.as_deref().unwrap_or("")
        ));
    }
    if failed.len() > MAX_SAID {
        let rest: BTreeSet<u64> = failed[MAX_SAID..].iter().map(|d| d.rank).collect();
        out.push(format!(
            "{} failed too (their errors are in their dumps)",
            list(&rest)
        ));
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
            "no disagreement in the collectives the dumps hold (#{}..#{})",
            seqs.first().copied().unwrap_or(0),
            seqs.last().copied().unwrap_or(0)
        )),
        None => {}
    }
    // A mismatch a rank found where the dumps show none (a send against a receive of
    // another size; a peer's dump missing): its error says which calls.
    if disagreement.is_none() {
        for (&r, d) in dumps {
            let found = d
                .calls
                .iter()
                .find(|c| c.failure.as_ref().is_some_and(|f| f.kind == "mismatch"));
            if let Some(c) = found {
                let with = c
                    .failure
                    .as_ref()
                    .and_then(|f| f.peer)
                    .map_or(String::new(), |p| format!(" with rank {p}"));
                out.push(format!(
                    "mismatch: rank {r} found one{with} in {} ({}): its error says which calls \
                     disagree",
                    c.name(),
                    c.shape()
                ));
            }
        }
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
            let was = match (last.get(&r).copied().flatten(), dumps.get(&r)) {
                (Some(c), _) => format!("its last call is {} ({})", c.name(), c.state),
                (None, Some(d)) if d.recorded > d.calls.len() as u64 => format!(
                    "its ring holds only its last {} of {} calls, none a collective \
                     (DSPARK_FR_ENTRIES keeps more)",
                    d.calls.len(),
                    d.recorded
                ),
                _ => "it recorded no collective".into(),
            };
            out.push(format!(
                "behind: rank {r}{}: {was}; it never started {at}, which {} reached",
                place_of(r),
                list(&ahead)
            ));
        }
        stuck |= !behind.is_empty();
        if behind.is_empty() && !missing.is_empty() {
            stuck = true;
            out.push(format!(
                "behind: unknown: every dump reached {at}; {} left no dump",
                list(&missing)
            ));
        }
    }

    // A rank inside a send or receive that never finished (its collective may be queued
    // behind it): the calls the collectives' lines above do not show.
    for (&r, d) in dumps {
        let inside = d
            .calls
            .iter()
            .rev()
            .find(|c| !c.is_collective() && c.state == "started");
        if let Some(c) = inside {
            let with = c.peer.map_or(String::new(), |p| {
                format!(" {} rank {p}", if c.coll == "recv" { "from" } else { "to" })
            });
            out.push(format!(
                "rank {r} is inside {}{with}, started and not finished",
                c.name()
            ));
            stuck = true;
        }
    }

    // Which peer everyone waits for: each failed rank's wait (`waits`: the rank it lost, the
    // peer its schedule timed out on, or, aborted, the peer it was waiting for then), and
    // where the chain of waits ends.
    let mut waits: BTreeMap<u64, Wait> = BTreeMap::new();
    // The call each wait is in, by rank, for the words of a rank found behind.
    let mut in_call: BTreeMap<u64, String> = BTreeMap::new();
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
        // A lost rank is the wait, whatever the schedule was waiting on when it was noticed;
        // an abort names the rank that failed first, not a cause.
        let schedule = f.progress.as_ref().map(|p| p.peer);
        let p = if f.kind == "peer_lost" {
            f.peer.or(schedule)
        } else {
            schedule.or(f.peer.filter(|_| f.kind != "aborted"))
        };
        let Some(p) = p else { continue };
        let how = match (&f.progress, f.kind.as_str()) {
            (_, "peer_lost") => format!("rank {r} lost rank {p} in {}", c.name()),
            (Some(g), "timeout") if g.direction == "recv" => format!(
                "rank {r} timed out in {} receiving from rank {p} (step {} of {}, {} of {} \
                 bytes)",
                c.name(),
                g.step,
                g.steps,
                g.bytes,
                g.of_bytes
            ),
            (Some(g), "timeout") => format!(
                "rank {r} timed out in {} sending to rank {p} (step {} of {})",
                c.name(),
                g.step,
                g.steps
            ),
            (Some(g), "aborted") => format!(
                "rank {r} was {} rank {p} in {} (step {} of {}{}) when rank {} aborted",
                if g.direction == "recv" {
                    "receiving from"
                } else {
                    "sending to"
                },
                c.name(),
                g.step,
                g.steps,
                if g.direction == "recv" {
                    format!(", {} of {} bytes", g.bytes, g.of_bytes)
                } else {
                    String::new()
                },
                f.peer.map_or("?".into(), |a| a.to_string()),
            ),
            (_, k) => format!("rank {r}: {k} with rank {p} in {}", c.name()),
        };
        let progress = f.progress.as_ref().map(|g| (c.seq, g.steps, g.steps_done));
        in_call.insert(r, c.name());
        waits.insert(
            r,
            Wait {
                to: p,
                how,
                aborted: f.kind == "aborted",
                progress,
            },
        );
    }
    // A rank that aborted others and left no dump: its wait, from their errors (the rank it
    // lost, or timed out waiting for), so that the chain goes on to the cause.
    let mut told: Vec<(u64, Wait)> = Vec::new();
    for (&r, d) in dumps {
        let Some((by, to, lost)) = d.error.as_deref().and_then(aborters_wait) else {
            continue;
        };
        if dumps.contains_key(&by) || waits.contains_key(&by) || told.iter().any(|t| t.0 == by) {
            continue;
        }
        let call = in_call
            .get(&r)
            .cloned()
            .unwrap_or_else(|| "its call".into());
        let how = if lost {
            format!("rank {by} lost rank {to} in {call} (as rank {r}'s error says)")
        } else {
            format!(
                "rank {by} timed out waiting for rank {to} in {call} (as rank {r}'s error says)"
            )
        };
        told.push((
            by,
            Wait {
                to,
                how,
                aborted: false,
                progress: None,
            },
        ));
    }
    waits.extend(told);
    let mut ends: BTreeMap<End, (BTreeSet<u64>, Vec<Why>)> = BTreeMap::new();
    for (&r, w) in &waits {
        let e = ends.entry(end(&waits, r)).or_default();
        e.0.insert(r);
        e.1.push((w.aborted, w.how.clone()));
    }
    // A chain that ended at a rank because its peer was ahead of it: say so, first.
    for (e, (_, why)) in ends.iter_mut() {
        if let End::Rank(p) = e {
            let call = in_call.get(p).map_or("its call", String::as_str);
            if let Some(note) = behind_note(&waits, *p, call) {
                why.insert(0, (false, note));
            }
        }
    }
    // Every group, the largest first (on a tie, one that left no dump).
    let mut groups: Vec<_> = ends.into_iter().collect();
    groups.sort_by_key(|(e, (who, _))| {
        let silent = matches!(e, End::Rank(p) if missing.contains(p) || !waits.contains_key(p));
        (std::cmp::Reverse(who.len()), !silent)
    });
    let single = groups.len() == 1;
    stuck |= !groups.is_empty();
    let mut silent = Vec::new();
    for (e, (who, mut why)) in groups {
        // The causes (timeouts, lost peers) before the waits of aborted ranks.
        why.sort_by_key(|(aborted, _)| *aborted);
        let why: Vec<String> = why.into_iter().map(|(_, how)| how).collect();
        let why = some_of(&why, "; ");
        out.push(match e {
            End::Cycle(ring) => format!(
                "{} wait for one another (a cycle: the order of their sends and receives, \
                 or each waits in another call): {why}",
                list(&ring)
            ),
            End::Rank(peer) => {
                let note = missing.contains(&peer).then(|| {
                    silent.push(peer);
                    "it left no dump"
                });
                let place = places
                    .get(&peer)
                    .cloned()
                    .unwrap_or_default()
                    .said_with(note);
                // The rank found behind is in its own group, not waiting for itself.
                let mut who = who;
                who.remove(&peer);
                if single || who.is_empty() {
                    format!("everyone waits for rank {peer}{place}: {why}")
                } else {
                    let verb = if who.len() == 1 { "waits" } else { "wait" };
                    format!("{} {verb} for rank {peer}{place}: {why}", list(&who))
                }
            }
        });
    }
    if !silent.is_empty() {
        let who: BTreeSet<u64> = silent.into_iter().collect();
        // Where each is, and the command that shows its stack there.
        let how: Vec<String> = who
            .iter()
            .filter_map(|&r| {
                let p = places.get(&r)?;
                let on = if p.host.is_empty() {
                    String::new()
                } else {
                    format!(" on {}", p.host)
                };
                Some(match p.pid {
                    Some(pid) => format!("rank {r}: py-spy dump --pid {pid}{on} (or gdb -p {pid})"),
                    None if !on.is_empty() => format!("rank {r}{on}"),
                    None => return None,
                })
            })
            .collect();
        let how = if how.is_empty() {
            " (py-spy dump, gdb -p)".to_string()
        } else {
            format!(": {}", some_of(&how, "; "))
        };
        out.push(format!(
            "next: look at {}'s log or stack{how}; it hung, died, or wrote its dump on \
             another host's DSPARK_FR_DUMP",
            list(&who)
        ));
    }
    if !stuck && failed.is_empty() && missing.is_empty() {
        out.push("no rank is stuck: no dump records a failure".into());
    }
    if let Some(line) = late_line(dumps, &places) {
        out.push(line);
    }
    out
}

/// Where each rank runs, from every dump: a dump's word on itself over the others' tables.
fn merged_places(dumps: &BTreeMap<u64, Dump>) -> BTreeMap<u64, Place> {
    let mut places: BTreeMap<u64, Place> = BTreeMap::new();
    for d in dumps.values() {
        for (&r, p) in &d.places {
            let e = places.entry(r).or_default();
            if !p.host.is_empty() && (e.host.is_empty() || r == d.rank) {
                e.host.clone_from(&p.host);
            }
            if e.pid.is_none() || r == d.rank {
                e.pid = p.pid.or(e.pid);
            }
        }
    }
    places
}

/// `hosts: node01 (ranks 0-3), node02 (ranks 4-7)` where the dumps say which host each
/// rank is on and there is more than one (with how many ranks' places are known, where not
/// all of the `world`'s: above `FULL_PLACES` a dump lists only the ranks it names).
fn hosts_line(places: &BTreeMap<u64, Place>, world: u64) -> Option<String> {
    let mut by_host: BTreeMap<&str, BTreeSet<u64>> = BTreeMap::new();
    for (&r, p) in places.iter().filter(|(_, p)| !p.host.is_empty()) {
        by_host.entry(&p.host).or_default().insert(r);
    }
    if by_host.len() < 2 {
        return None;
    }
    let hosts: Vec<String> = by_host
        .iter()
        .map(|(h, ranks)| format!("{h} ({})", list(ranks)))
        .collect();
    let known: usize = by_host.values().map(BTreeSet::len).sum();
    let note = if (known as u64) < world {
        format!(" ({known} ranks' places known)")
    } else {
        String::new()
    };
    Some(format!("hosts: {}{note}", some_of(&hosts, ", ")))
}

/// The late-rank line ([`crate::late`]): from the collectives every dump holds completed
/// whose every output needs every rank's input, with elements, stamped by the precise
/// clock (a one-shot call's start is the coarse clock's, up to a tick early).
fn late_line(dumps: &BTreeMap<u64, Dump>, places: &BTreeMap<u64, Place>) -> Option<String> {
    const NEED_EVERY_RANK: [&str; 5] = [
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "barrier",
    ];
    let spans: BTreeMap<u64, BTreeMap<u64, crate::late::Span>> = dumps
        .iter()
        .map(|(&r, d)| {
            let m = d
                .calls
                .iter()
                .filter(|c| NEED_EVERY_RANK.contains(&c.coll.as_str()) && c.state == "completed")
                .filter(|c| c.count > 0 || c.coll == "barrier")
                .filter(|c| c.algorithm != "one_shot" && c.started_ns > 0)
                .filter_map(|c| {
                    let span = crate::late::Span {
                        start: c.started_ns,
                        end: c.ended_ns.max(c.started_ns),
                    };
                    Some((c.seq?, span))
                })
                .collect();
            (r, m)
        })
        .collect();
    // One clock: every rank with a dump on one known host.
    let host = |r: &u64| places.get(r).map_or("", |p| p.host.as_str());
    let first = dumps.keys().next().map_or("", host);
    let one_clock = !first.is_empty() && dumps.keys().all(|r| host(r) == first);
    let Some(l) = crate::late::late(&spans, one_clock) else {
        // Too few calls compared: say so where one-shot calls were left out, rather than
        // let "no rank is stuck" read as "none is late".
        let compared = spans.values().map(BTreeMap::len).min().unwrap_or(0);
        let one_shot = dumps
            .values()
            .map(|d| {
                d.calls
                    .iter()
                    .filter(|c| c.algorithm == "one_shot" && c.state == "completed")
                    .count()
            })
            .min()
            .unwrap_or(0);
        return (compared < crate::late::MIN_CALLS && one_shot >= crate::late::MIN_CALLS).then(
            || {
                format!(
                    "late: not judged: {one_shot} of the calls ran one_shot (small all_reduces, \
                 their start stamped by a coarse clock), and {compared} other collectives are \
                 too few to tell a straggler (it takes {})",
                    crate::late::MIN_CALLS
                )
            },
        );
    };
    let ms = |ns: u64| ns as f64 / 1e6;
    let (last_in, of, first, last) = (l.last_in, l.of, l.first, l.last);
    let (med, max) = (ms(l.median_ns), ms(l.max_ns));
    let came = format!("in {last_in} of the {of} collectives every dump holds (#{first}-#{last})");
    let how = if l.by_start {
        format!("started last {came}, a median {med:.1} ms after the others (at most {max:.1} ms)")
    } else {
        format!(
            "came last {came}: the others' calls lasted a median {med:.1} ms longer than its \
             own (at most {max:.1} ms; each rank's own clock, as the ranks are on different \
             hosts)"
        )
    };
    Some(format!(
        "late: rank {}{} {how}: they wait for it in those calls; look at what it does between \
         calls (data loading, a slower device, its host's load)",
        l.rank,
        places.get(&l.rank).map_or(String::new(), Place::said),
    ))
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
        .filter(|p| p.extension().is_some_and(|x| x == "json" || x == "tmp"))
        .collect();
    files.sort();
    let mut lines = Vec::new();
    // A dump cut short where it was written (`.json.tmp`: its writer stopped before the
    // rename): the rank died or was killed while writing it.
    files.retain(|p| {
        let tmp = p.extension().is_some_and(|x| x == "tmp");
        if tmp {
            lines.push(format!(
                "warning: {} is a dump whose writing never finished: its rank stopped while \
                 writing it",
                p.file_name()
                    .map_or(String::new(), |n| n.to_string_lossy().into_owned())
            ));
        }
        !tmp
    });
    // Per communicator (`CommKey::group`): its label and its dumps by rank.
    let mut comms: BTreeMap<String, (String, BTreeMap<u64, Dump>)> = BTreeMap::new();
    for f in &files {
        let name = f.file_name().map_or_else(
            || f.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        match read_dump(f) {
            Ok((k, d)) => {
                let rank = d.rank;
                let label = k.label();
                let (_, of) = comms
                    .entry(k.group())
                    .or_insert_with(|| (label.clone(), BTreeMap::new()));
                if let std::collections::btree_map::Entry::Vacant(v) = of.entry(rank) {
                    v.insert(d);
                } else {
                    lines.push(format!(
                        "warning: {name}: a second dump of rank {rank} of {label}: ignored"
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
    // In the order the processes opened them (the first process's numbering), not by id.
    let mut comms: Vec<&(String, BTreeMap<u64, Dump>)> = comms.values().collect();
    comms.sort_by_key(|(_, dumps)| dumps.values().next().map_or(u64::MAX, |d| d.communicator));
    for (label, dumps) in comms {
        if several {
            lines.push(format!("{label}:"));
        }
        let indent = if several { "  " } else { "" };
        lines.extend(analyze(dumps).into_iter().map(|l| format!("{indent}{l}")));
    }
    Ok(lines)
}

#[cfg(test)]
#[path = "analyze_tests.rs"]
mod tests;
