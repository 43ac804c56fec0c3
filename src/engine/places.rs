//! Where the ranks of a communicator run, for the flight record ([`super::flight`]): its
//! `host` (this rank's) and `places` (rank, host, data address, process id), so that a dump
//! names where a rank everyone waits for runs and which process it is, the rank that hung
//! and left no dump included (`dspark analyze`: "py-spy dump --pid 4242 on node07").

use std::collections::BTreeSet;
use std::fmt::Write as _;

use super::flight::FlightEntry;
use super::trace::json_str;

/// Every rank is in a dump's `places` up to this many ranks (about 60 bytes each); a larger
/// communicator's dump lists this rank and the ranks its entries name (peers, roots, the
/// peer a failed call waited for).
pub const FULL_PLACES: usize = 1024;

/// Where one rank runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Place {
    /// Its host, as the rank table has it (the host name, or `DSPARK_HOST_ID` where set).
    pub host: String,
    /// Its data listener (`10.0.0.7:41234`); empty where unknown.
    pub addr: String,
    /// Its process id on its host; 0 where unknown.
    pub pid: u32,
}

/// The ranks a dump of `rank` of `world` lists: every rank up to [`FULL_PLACES`], else this
/// rank and those `entries` name.
pub(crate) fn dumped(
    places: &[Place],
    rank: usize,
    world: usize,
    entries: &[FlightEntry],
) -> Vec<(usize, Place)> {
    let chosen: BTreeSet<usize> = if world <= FULL_PLACES {
        (0..world).collect()
    } else {
        let mut s = BTreeSet::from([rank]);
        for e in entries {
            s.extend(e.root);
            s.extend(e.peer);
            s.extend(e.recv_from.map(|(r, _)| r));
            if let Some(f) = &e.failure {
                s.extend(f.peer);
                s.extend(f.progress.as_ref().map(|p| p.peer));
            }
        }
        s
    };
    chosen
        .into_iter()
        .filter_map(|r| Some((r, places.get(r)?.clone())))
        .filter(|(_, p)| *p != Place::default())
        .collect()
}

/// `"places":[{"rank":0,"host":"node01","addr":"10.0.0.7:41234","pid":4242},...]` into `o`
/// (`addr` and `pid` left out where unknown).
pub(crate) fn json(o: &mut String, places: &[(usize, Place)]) {
    o.push_str("\"places\":[");
    for (i, (r, p)) in places.iter().enumerate() {
        if i > 0 {
            o.push(',');
        }
        let _ = write!(o, "{{\"rank\":{r},\"host\":{}", json_str(&p.host));
        if !p.addr.is_empty() {
            let _ = write!(o, ",\"addr\":{}", json_str(&p.addr));
        }
        if p.pid != 0 {
            let _ = write!(o, ",\"pid\":{}", p.pid);
        }
        o.push('}');
    }
    o.push(']');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::flight::{FailureKind, FlightFailure, FlightPath, FlightState};
    use crate::transport::TransportKind;

    fn place(r: usize) -> Place {
        Place {
            host: format!("node{:02}", r / 4),
            addr: format!("10.0.0.{}:4{r:04}", r / 4),
            pid: 1000 + r as u32,
        }
    }

    fn entry(peer: Option<usize>, failed_on: Option<usize>) -> FlightEntry {
        FlightEntry {
            seq: Some(1),
            collective: "send",
            dtype: None,
            count: 1,
            op: None,
            root: None,
            peer,
            recv_from: None,
            algorithm: None,
            transport: TransportKind::Tcp,
            path: FlightPath::Host,
            state: FlightState::Failed,
            started_unix_ns: 1,
            ended_unix_ns: None,
            failure: failed_on.map(|p| FlightFailure {
                kind: FailureKind::Timeout,
                peer: Some(p),
                progress: None,
            }),
        }
    }

    #[test]
    fn a_small_communicator_lists_every_rank_a_large_one_those_named() {
        let small: Vec<Place> = (0..6).map(place).collect();
        let got = dumped(&small, 2, 6, &[]);
        assert_eq!(
            got.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 5]
        );
        assert_eq!(got[5].1, place(5));
        // A rank whose place is unknown (a partial table) is left out.
        let mut gap = small.clone();
        gap[4] = Place::default();
        assert_eq!(dumped(&gap, 2, 6, &[]).len(), 5);
        let world = FULL_PLACES + 5;
        let large: Vec<Place> = (0..world).map(place).collect();
        let got = dumped(&large, 7, world, &[entry(Some(900), Some(1028))]);
        assert_eq!(
            got.iter().map(|(r, _)| *r).collect::<Vec<_>>(),
            [7, 900, 1028]
        );
        // No table at all (a communicator over a given transport): nothing.
        assert!(dumped(&[], 0, 3, &[]).is_empty());
    }

    #[test]
    fn places_are_json_with_unknown_fields_left_out() {
        let mut o = String::from("{");
        let unknown_pid = Place {
            host: "a\"b".into(),
            addr: String::new(),
            pid: 0,
        };
        json(&mut o, &[(0, place(0)), (3, unknown_pid)]);
        o.push('}');
        let v: serde_json::Value = serde_json::from_str(&o).expect(&o);
        let p = &v["places"];
        assert_eq!(p[0]["rank"], 0);
        assert_eq!(p[0]["host"], "node00");
        assert_eq!(p[0]["addr"], "10.0.0.0:40000");
        assert_eq!(p[0]["pid"], 1000);
        assert_eq!(p[1]["host"], "a\"b");
        assert!(
            p[1].get("pid").is_none() && p[1].get("addr").is_none(),
            "{o}"
        );
    }
}
