//! Shared memory as a candidate, in its two forms:
//!
//! - **one host** ([`select`]): every rank on one host (equal host identities, equal boot ids)
//!   and none asking for TCP or verbs: the whole job over shared memory. A rank that asked for
//!   `DSPARK_TRANSPORT=shm` turns every "no" into [`Error::Unavailable`] on every rank, naming
//!   the ranks and why.
//! - **within each host** of a job on several hosts that ended up on TCP ([`select_within_hosts`]):
//!   every host with at least two ranks, each of which could create its segment and map its host
//!   peers', shares memory among them (`shm+tcp`), unless some rank asked for one transport
//!   everywhere. A host whose ranks cannot keeps TCP among them, with the reason; the others are
//!   not affected.
//!
//! Both announce the same offer ([`ShmOffer`]) and go through the one negotiation driver; the
//! decisions ([`OneHost::decide`], [`WithinHosts::decide`] and their `settle`) are pure.

use std::net::TcpStream;

use super::negotiate::{self, first_failure, Candidate, Outcome, Verdict};
use super::offer::{Confirm, SegOffer, ShmOffer};
use crate::bootstrap::Bootstrap;
use crate::config::{Config, TransportChoice};
use crate::error::{Error, Result};
use crate::plan;
use crate::transport::shm::{self, Prepared, Seg, ShmOptions, ShmTransport};
use crate::transport::{Transport, TransportKind};

/// The shared-memory transport's options for `cfg`.
pub(crate) fn shm_options(cfg: &Config) -> ShmOptions {
    // A ring holds at least two whole frames: a sender must be able to finish a frame (up to
    // a segment) while its peer is itself still sending, as TCP's socket buffers and the
    // verbs slots allow; a schedule whose receive waits for its own send (recursive doubling
    // in place) would otherwise deadlock until the deadline.
    ShmOptions {
        ring_bytes: cfg
            .shm_ring_bytes
            .max(2 * (cfg.segment_bytes.max(64) + 2 * 64)),
        membarrier: cfg.shm_membarrier,
    }
}

/// This rank's offer for a segment prepared by `prepared` (or why it has none).
fn offer_of(
    mode: TransportChoice,
    prepared: std::result::Result<Prepared, String>,
) -> (ShmOffer, Option<Prepared>) {
    match prepared {
        Ok(p) => (
            ShmOffer {
                mode: Some(mode),
                seg: SegOffer::Capable {
                    boot_id: super::crowd::boot_id(),
                    info: p.info(),
                },
            },
            Some(p),
        ),
        Err(why) => (
            ShmOffer {
                mode: Some(mode),
                seg: SegOffer::Incapable(why),
            },
            None,
        ),
    }
}

/// Why rank `r` cannot share memory, from its offer (None: it can).
fn offer_why(r: usize, o: &ShmOffer) -> Option<String> {
    match &o.seg {
        SegOffer::Capable { .. } => None,
        SegOffer::Incapable(w) => Some(format!("rank {r}: {w}")),
        SegOffer::Malformed => Some(format!("rank {r} sent a malformed shm announcement")),
    }
}

fn boot_of(o: &ShmOffer) -> Option<&str> {
    match &o.seg {
        SegOffer::Capable { boot_id, .. } => Some(boot_id),
        _ => None,
    }
}

fn infos(offers: &[ShmOffer]) -> Vec<Option<shm::SegInfo>> {
    offers
        .iter()
        .map(|o| match &o.seg {
            SegOffer::Capable { info, .. } => Some(*info),
            _ => None,
        })
        .collect()
}

/// "ranks 0, 1 on a; rank 2 on b".
pub(crate) fn ranks_by_host(hosts: &[String]) -> String {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (r, h) in hosts.iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| *g == h.as_str()) {
            Some((_, v)) => v.push(r),
            None => groups.push((h.as_str(), vec![r])),
        }
    }
    groups
        .iter()
        .map(|(h, v)| {
            let rs: Vec<String> = v.iter().map(usize::to_string).collect();
            let word = if v.len() == 1 { "rank" } else { "ranks" };
            format!("{word} {} on {h}", rs.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The transports other than shm that ranks asked for (`DSPARK_TRANSPORT`), and which ranks:
/// `DSPARK_TRANSPORT=tcp on ranks 0-2,5; DSPARK_TRANSPORT=verbs on rank 4`; `None` where
/// nobody did.
fn asked_for(offers: &[ShmOffer]) -> Option<String> {
    let mut asked: Vec<(TransportChoice, Vec<usize>)> = Vec::new();
    for (r, o) in offers.iter().enumerate() {
        let Some(m @ (TransportChoice::Tcp | TransportChoice::Verbs)) = o.mode else {
            continue;
        };
        match asked.iter_mut().find(|(k, _)| *k == m) {
            Some((_, rs)) => rs.push(r),
            None => asked.push((m, vec![r])),
        }
    }
    if asked.is_empty() {
        return None;
    }
    let parts: Vec<String> = asked
        .iter()
        .map(|(m, rs)| {
            let word = if rs.len() == 1 { "rank" } else { "ranks" };
            format!(
                "DSPARK_TRANSPORT={m} on {word} {}",
                super::crowd::format_list(rs)
            )
        })
        .collect();
    Some(parts.join("; "))
}

/// Why the ranks of a host do not share memory: a warning from the host's first rank, the
/// others' at debug level (every rank's `CommInfo` carries the reason; 128 ranks on a host
/// would otherwise print it 128 times).
fn shm_declined(first_on_host: bool, rank: usize, reason: &str, what: &str) {
    if first_on_host {
        let key = format!("{what}: {reason}");
        super::once::warn_once!(key: &key, rank, reason = %reason, "{what}");
    } else {
        tracing::debug!(rank, reason = %reason, "{what}");
    }
}

fn shm_unavailable(forced: &[usize], reason: &str) -> Error {
    let who: Vec<String> = forced.iter().map(usize::to_string).collect();
    Error::unavailable(
        format!(
            "the shared-memory transport (DSPARK_TRANSPORT=shm on rank(s) {})",
            who.join(", ")
        ),
        reason,
    )
}

// ------------------------------------------------------------------------------ one host

/// The job-wide facts a shared-memory decision reads (the same on every rank but `rank`).
#[derive(Debug)]
pub(crate) struct ShmFacts {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    /// Every rank's host identity.
    pub(crate) hosts: Vec<String>,
    /// What this rank asked for.
    pub(crate) mode: TransportChoice,
    pub(crate) opts: ShmOptions,
}

impl ShmFacts {
    fn of(boot: &Bootstrap, cfg: &Config) -> Self {
        ShmFacts {
            rank: cfg.rank,
            world: cfg.world_size,
            hosts: boot.peers.iter().map(|p| p.host.clone()).collect(),
            mode: cfg.transport,
            opts: shm_options(cfg),
        }
    }
}

/// The whole job over shared memory.
#[derive(Debug)]
pub(crate) struct OneHost(pub(crate) ShmFacts);

impl std::ops::Deref for OneHost {
    type Target = ShmFacts;
    fn deref(&self) -> &ShmFacts {
        &self.0
    }
}

impl OneHost {
    fn one_host(&self) -> bool {
        self.hosts.iter().all(|h| *h == self.hosts[0])
    }

    fn forced(offers: &[ShmOffer]) -> Vec<usize> {
        (0..offers.len())
            .filter(|&r| offers[r].mode == Some(TransportChoice::Shm))
            .collect()
    }

    /// Why not shared memory (None: every rank can), from the offers.
    fn why_not(&self, offers: &[ShmOffer]) -> Option<String> {
        if !self.one_host() {
            return Some(format!(
                "the ranks are not on one host: {} (host identity: DSPARK_HOST_ID, else the \
                 host name); DSPARK_TRANSPORT=shm needs every rank on one host, while auto uses \
                 shared memory within each host and TCP between hosts",
                ranks_by_host(&self.hosts)
            ));
        }
        if let Some(w) = offers.iter().enumerate().find_map(|(r, o)| offer_why(r, o)) {
            return Some(w);
        }
        let boots: Vec<Option<&str>> = offers.iter().map(boot_of).collect();
        if boots.iter().any(|b| *b != boots[0]) {
            return Some(format!(
                "the ranks share a host identity ({}) but not a kernel (different boot ids): \
                 several machines with one host name?",
                self.hosts[0]
            ));
        }
        None
    }

    /// Where every rank is on one host but some asked for another transport
    /// (`DSPARK_TRANSPORT`), which ones: `shm not used although every rank is on one host:
    /// DSPARK_TRANSPORT=tcp on ranks 0-2,5`.
    fn asked_otherwise(&self, offers: &[ShmOffer]) -> Option<String> {
        if !self.one_host() {
            return None;
        }
        let asked = asked_for(offers)?;
        Some(format!(
            "shm not used although every rank is on one host: {asked}"
        ))
    }

    /// A "no": an error where a rank asked for shm, else a decline whose reason is reported
    /// only where shared memory was a candidate (one host, no other transport asked for).
    fn no(&self, offers: &[ShmOffer], why: String, candidate: bool) -> Verdict {
        let forced = Self::forced(offers);
        if !forced.is_empty() {
            return Verdict::Fail(shm_unavailable(&forced, &why));
        }
        Verdict::Decline(candidate.then_some(why))
    }
}

impl Candidate for OneHost {
    type Offer = ShmOffer;
    type Prepared = Prepared;
    type Connected = Vec<Option<Seg>>;

    fn offer(&mut self) -> Result<(ShmOffer, Option<Prepared>)> {
        let wants = matches!(self.mode, TransportChoice::Auto | TransportChoice::Shm);
        let prepared = if !wants {
            Err(format!("DSPARK_TRANSPORT={}", self.mode))
        } else if !self.one_host() {
            Err("the ranks are on several hosts".to_string())
        } else {
            let world = self.world;
            let partners = |r: usize| plan::algo::standing_partners(world, r);
            shm::prepare(self.rank, world, &partners, self.opts)
        };
        Ok(offer_of(self.mode, prepared))
    }

    fn decide(&self, offers: &[ShmOffer]) -> Verdict {
        match self.why_not(offers) {
            None => Verdict::Go,
            Some(why) => {
                let others_asked = offers.iter().any(|o| {
                    matches!(
                        o.mode,
                        Some(TransportChoice::Tcp) | Some(TransportChoice::Verbs)
                    )
                });
                self.no(offers, why, self.one_host() && !others_asked)
            }
        }
    }

    fn connect(
        &mut self,
        prepared: &mut Prepared,
        offers: &[ShmOffer],
    ) -> std::result::Result<Vec<Option<Seg>>, String> {
        // `decide` went ahead only with every rank capable.
        let infos: Option<Vec<shm::SegInfo>> = infos(offers).into_iter().collect();
        prepared.connect(&infos.unwrap_or_default())
    }

    fn settle(&self, offers: &[ShmOffer], confirms: &[Confirm]) -> Verdict {
        match first_failure(confirms) {
            None => Verdict::Go,
            Some((r, w)) => self.no(
                offers,
                format!("rank {r}: mapping the segments failed: {w}"),
                true,
            ),
        }
    }

    fn unprepared(&self) -> Error {
        shm_unavailable(&[self.rank], "internal: capable without a segment")
    }
}

/// Agrees with every other rank on whether the whole job uses shared memory (see the module
/// docs): `Ok(transport)`, or why not where it was a candidate and failed (the reason for
/// `CommInfo`).
///
/// # Errors
/// [`Error::Unavailable`] where a rank asked for shm; bootstrap errors ([`Error::Timeout`],
/// [`Error::PeerLost`]).
pub(crate) fn select(
    boot: &mut Bootstrap,
    cfg: &Config,
    streams: &mut Vec<Option<TcpStream>>,
) -> Result<std::result::Result<ShmTransport, Option<String>>> {
    let (rank, world) = (cfg.rank, cfg.world_size);
    if world == 1 {
        if cfg.transport == TransportChoice::Shm {
            return Ok(Ok(ShmTransport::single()?));
        }
        return Ok(Err(None));
    }
    let mut c = OneHost(ShmFacts::of(boot, cfg));
    let n = negotiate::negotiate(&mut c, boot, streams)?;
    match n.outcome {
        Outcome::Won(prep, segs) => {
            // Shared memory watches each peer's liveness through a connection to it: the
            // standing partners' from the rendezvous, the others' made on first use, when
            // their rings are committed too.
            let mut t = ShmTransport::new(prep, segs, std::mem::take(streams))?;
            if let Some(l) = boot.links() {
                t = t.with_links(Box::new(l));
            }
            tracing::info!(rank, transport = %t.describe(), "using shared memory");
            Ok(Ok(t))
        }
        // Not a candidate. On one host that is because a rank asked for another transport:
        // no warning (it was asked for), but the reason in `CommInfo`, which says why the
        // transport is not the fastest one.
        Outcome::Declined(None) => Ok(Err(c.asked_otherwise(&n.offers))),
        Outcome::Declined(Some(why)) => {
            shm_declined(
                rank == 0,
                rank,
                &why,
                "not using shared memory although every rank is on one host",
            );
            Ok(Err(Some(format!("shm unavailable: {why}"))))
        }
    }
}

// ------------------------------------------------------------------------ within each host

/// Shared memory among the ranks of each host of a job on several.
#[derive(Debug)]
pub(crate) struct WithinHosts(pub(crate) ShmFacts);

impl std::ops::Deref for WithinHosts {
    type Target = ShmFacts;
    fn deref(&self) -> &ShmFacts {
        &self.0
    }
}

impl WithinHosts {
    /// The ranks on `r`'s host, `r` included, in rank order.
    fn members(&self, r: usize) -> Vec<usize> {
        (0..self.world)
            .filter(|&q| self.hosts[q] == self.hosts[r])
            .collect()
    }

    /// Whether the negotiation applies at all (the same on every rank): several hosts, and
    /// at least one with several ranks.
    pub(crate) fn applies(&self) -> bool {
        let one_host = self.hosts.iter().all(|h| *h == self.hosts[0]);
        let shared = (0..self.world).any(|r| self.members(r).len() > 1);
        !(self.world < 2 || one_host || !shared || self.hosts.len() != self.world)
    }

    /// Some rank asked for one transport everywhere: no shared memory anywhere.
    fn one_transport_asked(offers: &[ShmOffer]) -> bool {
        offers.iter().any(|o| o.mode != Some(TransportChoice::Auto))
    }

    /// Per rank, why its host's ranks cannot share memory (None: they can), from the offers
    /// and, after round two, the confirmations.
    fn group_whys(&self, offers: &[ShmOffer], confirms: &[Confirm]) -> Vec<Option<String>> {
        let mut whys: Vec<Option<String>> = offers
            .iter()
            .enumerate()
            .map(|(r, o)| offer_why(r, o))
            .collect();
        for (r, c) in confirms.iter().enumerate() {
            if let Confirm::Failed(w) = c {
                whys[r] = Some(format!("rank {r}: mapping the segments failed: {w}"));
            }
        }
        (0..self.world)
            .map(|r| {
                let g = self.members(r);
                if g.len() < 2 {
                    return Some("alone on its host".into());
                }
                if let Some(w) = g.iter().find_map(|&q| whys.get(q).cloned().flatten()) {
                    return Some(w);
                }
                let first = offers.get(g[0]).and_then(boot_of);
                if g.iter().any(|&q| offers.get(q).and_then(boot_of) != first) {
                    return Some(format!(
                        "the ranks share a host identity ({}) but not a kernel (different boot \
                         ids)",
                        self.hosts[r]
                    ));
                }
                None
            })
            .collect()
    }

    /// Per rank, the transport among its host's ranks.
    pub(crate) fn intra(&self, offers: &[ShmOffer], confirms: &[Confirm]) -> Vec<TransportKind> {
        if Self::one_transport_asked(offers) {
            return vec![TransportKind::Tcp; self.world];
        }
        self.group_whys(offers, confirms)
            .iter()
            .map(|w| match w {
                None => TransportKind::Shm,
                Some(_) => TransportKind::Tcp,
            })
            .collect()
    }

    /// This rank's verdict: go where its host's ranks can share memory, else why not (only
    /// where it has host peers).
    fn verdict(&self, offers: &[ShmOffer], confirms: &[Confirm], before: Verdict) -> Verdict {
        match self.group_whys(offers, confirms).swap_remove(self.rank) {
            None => before,
            Some(w) => Verdict::Decline((self.members(self.rank).len() > 1).then(|| {
                format!(
                    "shm unavailable among the ranks of host {}: {w}",
                    self.hosts[self.rank]
                )
            })),
        }
    }
}

impl Candidate for WithinHosts {
    type Offer = ShmOffer;
    type Prepared = Prepared;
    type Connected = Vec<Option<Seg>>;

    fn offer(&mut self) -> Result<(ShmOffer, Option<Prepared>)> {
        let mine = self.members(self.rank);
        let prepared = if self.mode != TransportChoice::Auto {
            Err(format!("DSPARK_TRANSPORT={}", self.mode))
        } else if mine.len() < 2 {
            Err("alone on its host".to_string())
        } else {
            let world = self.world;
            let partners = |r: usize| plan::algo::standing_partners(world, r);
            shm::prepare_group(self.rank, world, &mine, &partners, self.opts)
        };
        Ok(offer_of(self.mode, prepared))
    }

    fn decide(&self, offers: &[ShmOffer]) -> Verdict {
        if Self::one_transport_asked(offers) {
            return Verdict::Decline(None);
        }
        // Every rank takes part in round two; only those whose host can share memory map
        // their host peers' segments.
        match self.verdict(offers, &[], Verdict::Go) {
            Verdict::Go => Verdict::Go,
            _ => Verdict::Stand,
        }
    }

    fn connect(
        &mut self,
        prepared: &mut Prepared,
        offers: &[ShmOffer],
    ) -> std::result::Result<Vec<Option<Seg>>, String> {
        prepared.connect_group(&infos(offers))
    }

    fn settle(&self, offers: &[ShmOffer], confirms: &[Confirm]) -> Verdict {
        self.verdict(offers, confirms, Verdict::Go)
    }

    fn unprepared(&self) -> Error {
        shm_unavailable(&[self.rank], "internal: capable without a segment")
    }
}

/// What the within-hosts negotiation decided for this rank.
#[derive(Debug)]
pub(crate) struct WithinHostsSelected {
    /// The shared-memory transport to the ranks of this host and which peers it serves, when
    /// this host's ranks share memory (the streams to them are taken from the caller's).
    pub(crate) shm: Option<(ShmTransport, Vec<bool>)>,
    /// Per rank, the transport among its host's ranks.
    pub(crate) intra: Vec<TransportKind>,
    /// Why this host's ranks do not share memory, where they could have.
    pub(crate) why: Option<String>,
}

/// In a job over several hosts that ended up on TCP, agrees with every other rank on which
/// hosts' ranks share memory (see the module docs). The streams to this rank's host peers
/// move to the shared-memory transport (its liveness connections); the rest stay for TCP.
///
/// # Errors
/// Bootstrap errors ([`Error::Timeout`], [`Error::PeerLost`]); a transport that cannot be
/// built.
pub(crate) fn select_within_hosts(
    boot: &mut Bootstrap,
    cfg: &Config,
    streams: &mut [Option<TcpStream>],
) -> Result<WithinHostsSelected> {
    let (rank, world) = (cfg.rank, cfg.world_size);
    let mut c = WithinHosts(ShmFacts::of(boot, cfg));
    if !c.applies() {
        return Ok(WithinHostsSelected {
            shm: None,
            intra: vec![TransportKind::Tcp; world],
            why: None,
        });
    }
    let n = negotiate::negotiate(&mut c, boot, streams)?;
    let intra = c.intra(&n.offers, &n.confirms);
    match n.outcome {
        Outcome::Won(prep, segs) => {
            // The standing partners within the host have their liveness connections from the
            // rendezvous; the other same-host pairs connect on first use (the links the
            // caller shares between the two transports).
            let mut shm_streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
            let mut local = vec![false; world];
            for p in c.members(rank).into_iter().filter(|&p| p != rank) {
                shm_streams[p] = streams[p].take();
                local[p] = true;
            }
            let t = ShmTransport::new(prep, segs, shm_streams)?;
            Ok(WithinHostsSelected {
                shm: Some((t, local)),
                intra,
                why: None,
            })
        }
        Outcome::Declined(why) => {
            if let Some(w) = &why {
                let first = c.members(rank).first() == Some(&rank);
                shm_declined(first, rank, w, "not using shared memory within this host");
            }
            // Not a candidate because a rank asked for a transport: no warning, but the
            // reason where this rank has host peers it could have shared memory with.
            let why = why.or_else(|| {
                let asked = asked_for(&n.offers)?;
                (c.members(rank).len() > 1).then(|| {
                    format!(
                        "shm not used among the ranks of host {}: {asked}",
                        c.hosts[rank]
                    )
                })
            });
            Ok(WithinHostsSelected {
                shm: None,
                intra,
                why,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::shm::SegInfo;

    fn capable(mode: TransportChoice, boot: &str) -> ShmOffer {
        ShmOffer {
            mode: Some(mode),
            seg: SegOffer::Capable {
                boot_id: boot.into(),
                info: SegInfo {
                    pid: 1,
                    fd: 3,
                    len: 4096,
                    ring: 1024,
                    nonce: 9,
                },
            },
        }
    }

    fn incapable(mode: TransportChoice, why: &str) -> ShmOffer {
        ShmOffer {
            mode: Some(mode),
            seg: SegOffer::Incapable(why.into()),
        }
    }

    fn facts(rank: usize, hosts: &[&str], mode: TransportChoice) -> ShmFacts {
        ShmFacts {
            rank,
            world: hosts.len(),
            hosts: hosts.iter().map(|h| h.to_string()).collect(),
            mode,
            opts: ShmOptions::default(),
        }
    }

    fn one_host(rank: usize, hosts: &[&str], mode: TransportChoice) -> OneHost {
        OneHost(facts(rank, hosts, mode))
    }

    fn within(rank: usize, hosts: &[&str]) -> WithinHosts {
        WithinHosts(facts(rank, hosts, Auto))
    }

    use TransportChoice::{Auto, Shm, Tcp};

    /// The largest segment `DSPARK_CHUNK_BYTES` allows still gets a ring of two whole frames
    /// (a larger one was clamped to the ring's limit, below two).
    #[test]
    fn the_largest_segment_gets_a_ring_of_two_frames() {
        let mut cfg = Config::new(0, 2, "127.0.0.1:1");
        cfg.segment_bytes = crate::config::MAX_SEGMENT;
        cfg.validate().expect("the largest segment is valid");
        let ring = shm_options(&cfg).ring_bytes;
        assert!(ring <= shm::MAX_RING_BYTES, "{ring}");
        assert!(ring >= 2 * (cfg.segment_bytes + 32), "{ring}");
        cfg.segment_bytes += 1;
        assert!(cfg.validate().is_err());
    }

    #[test]
    fn the_ring_setting_and_the_transport_agree_on_its_default_and_range() {
        use crate::config;
        assert_eq!(config::DEFAULT_SHM_RING_BYTES, shm::DEFAULT_RING_BYTES);
        assert_eq!(config::MIN_SHM_RING_BYTES, shm::MIN_RING_BYTES);
        assert_eq!(config::MAX_SHM_RING_BYTES, shm::MAX_RING_BYTES);
        assert_eq!(
            ShmOptions::default().ring_bytes,
            config::DEFAULT_SHM_RING_BYTES
        );
    }

    #[test]
    fn a_transport_asked_for_on_one_host_is_the_reason_shm_is_not_used_and_elsewhere_none() {
        use TransportChoice::Verbs;
        let c = one_host(1, &["a"; 6], Auto);
        let offers = vec![
            incapable(Tcp, "DSPARK_TRANSPORT=tcp"),
            incapable(Tcp, "DSPARK_TRANSPORT=tcp"),
            incapable(Tcp, "DSPARK_TRANSPORT=tcp"),
            capable(Auto, "k"),
            incapable(Verbs, "DSPARK_TRANSPORT=verbs"),
            incapable(Tcp, "DSPARK_TRANSPORT=tcp"),
        ];
        assert!(matches!(c.decide(&offers), Verdict::Decline(None)));
        assert_eq!(
            c.asked_otherwise(&offers).as_deref(),
            Some(
                "shm not used although every rank is on one host: DSPARK_TRANSPORT=tcp on \
                 ranks 0-2,5; DSPARK_TRANSPORT=verbs on rank 4"
            )
        );
        // Nobody asked: no such reason (a decline there has its own).
        assert_eq!(c.asked_otherwise(&vec![capable(Auto, "k"); 6]), None);
        // Several hosts: shm was never the candidate.
        let apart = one_host(0, &["a", "b"], Auto);
        let two = [incapable(Tcp, "x"), incapable(Tcp, "x")];
        assert_eq!(apart.asked_otherwise(&two), None);
    }

    #[test]
    fn every_rank_capable_on_one_kernel_goes_ahead() {
        let c = one_host(1, &["a", "a", "a"], Auto);
        let offers = vec![capable(Auto, "k"); 3];
        assert!(matches!(c.decide(&offers), Verdict::Go));
        assert!(matches!(
            c.settle(&offers, &[Confirm::Ok, Confirm::Ok, Confirm::Ok]),
            Verdict::Go
        ));
    }

    #[test]
    fn one_incapable_rank_declines_with_its_reason_or_fails_where_shm_was_asked_for() {
        let c = one_host(0, &["a", "a", "a"], Auto);
        let offers = vec![
            capable(Auto, "k"),
            incapable(Auto, "no /dev/shm"),
            ShmOffer::decode(&[0, 1, 200]),
        ];
        match c.decide(&offers) {
            Verdict::Decline(Some(w)) => assert_eq!(w, "rank 1: no /dev/shm"),
            v => panic!("{v:?}"),
        }
        // A malformed offer is a reason of its own.
        let offers2 = vec![capable(Auto, "k"), capable(Auto, "k"), offers[2].clone()];
        match c.decide(&offers2) {
            Verdict::Decline(Some(w)) => {
                assert_eq!(w, "rank 2 sent a malformed shm announcement")
            }
            v => panic!("{v:?}"),
        }
        // Rank 2 asked for shm: an error on every rank, naming it.
        let mut forced = offers.clone();
        forced[2] = incapable(Shm, "mmap failed");
        match c.decide(&forced) {
            Verdict::Fail(e) => {
                let s = e.to_string();
                assert!(s.contains("DSPARK_TRANSPORT=shm on rank(s) 2"), "{s}");
                assert!(s.contains("rank 1: no /dev/shm"), "{s}");
            }
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn another_transport_asked_for_declines_without_a_reason() {
        let c = one_host(0, &["a", "a"], Auto);
        let offers = vec![capable(Auto, "k"), incapable(Tcp, "DSPARK_TRANSPORT=tcp")];
        assert!(matches!(c.decide(&offers), Verdict::Decline(None)));
    }

    #[test]
    fn several_hosts_or_kernels_are_named_in_the_reason() {
        let c = one_host(0, &["a", "b", "a"], Shm);
        let offers = vec![incapable(Shm, "the ranks are on several hosts"); 3];
        match c.decide(&offers) {
            Verdict::Fail(e) => {
                let s = e.to_string();
                assert!(s.contains("ranks 0, 2 on a; rank 1 on b"), "{s}")
            }
            v => panic!("{v:?}"),
        }
        let c = one_host(0, &["a", "a"], Auto);
        match c.decide(&[capable(Auto, "k1"), capable(Auto, "k2")]) {
            Verdict::Decline(Some(w)) => assert!(w.contains("different boot ids"), "{w}"),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn a_failed_mapping_in_round_two_declines_naming_the_rank() {
        let c = one_host(2, &["a", "a", "a"], Auto);
        let offers = vec![capable(Auto, "k"); 3];
        let confirms = [Confirm::Ok, Confirm::Failed("ENOMEM".into()), Confirm::Ok];
        match c.settle(&offers, &confirms) {
            Verdict::Decline(Some(w)) => {
                assert_eq!(w, "rank 1: mapping the segments failed: ENOMEM")
            }
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn within_hosts_a_failing_host_keeps_tcp_and_the_others_share_memory() {
        // Hosts a (ranks 0, 1), b (2, 3), c (4): b's rank 3 cannot create its segment.
        let hosts = ["a", "a", "b", "b", "c"];
        let offers = vec![
            capable(Auto, "ka"),
            capable(Auto, "ka"),
            capable(Auto, "kb"),
            incapable(Auto, "no /dev/shm"),
            incapable(Auto, "alone on its host"),
        ];
        assert!(within(0, &hosts).applies());
        assert!(matches!(within(0, &hosts).decide(&offers), Verdict::Go));
        assert!(matches!(within(2, &hosts).decide(&offers), Verdict::Stand));
        assert!(matches!(within(4, &hosts).decide(&offers), Verdict::Stand));
        let ok = vec![Confirm::Ok; 5];
        assert!(matches!(
            within(1, &hosts).settle(&offers, &ok),
            Verdict::Go
        ));
        match within(2, &hosts).settle(&offers, &ok) {
            Verdict::Decline(Some(w)) => assert_eq!(
                w,
                "shm unavailable among the ranks of host b: rank 3: no /dev/shm"
            ),
            v => panic!("{v:?}"),
        }
        // Alone on its host: no reason worth reporting.
        assert!(matches!(
            within(4, &hosts).settle(&offers, &ok),
            Verdict::Decline(None)
        ));
        use TransportKind::{Shm as S, Tcp as T};
        assert_eq!(within(0, &hosts).intra(&offers, &ok), [S, S, T, T, T]);
        // Round two: rank 1 failed to map: host a falls back too.
        let failed = [
            Confirm::Ok,
            Confirm::Failed("EACCES".into()),
            Confirm::Ok,
            Confirm::Ok,
            Confirm::Ok,
        ];
        match within(0, &hosts).settle(&offers, &failed) {
            Verdict::Decline(Some(w)) => {
                assert!(
                    w.ends_with("rank 1: mapping the segments failed: EACCES"),
                    "{w}"
                )
            }
            v => panic!("{v:?}"),
        }
        assert_eq!(within(0, &hosts).intra(&offers, &failed), [T; 5]);
    }

    #[test]
    fn within_hosts_does_not_apply_on_one_host_or_with_every_rank_alone() {
        assert!(!within(0, &["a", "a"]).applies());
        assert!(!within(0, &["a", "b", "c"]).applies());
        assert!(!within(0, &["a"]).applies());
        // A rank that asked for one transport everywhere: TCP everywhere, no reason.
        let hosts = ["a", "a", "b", "b"];
        let mut offers = vec![capable(Auto, "k"); 4];
        offers[3] = incapable(Tcp, "DSPARK_TRANSPORT=tcp");
        assert!(matches!(
            within(0, &hosts).decide(&offers),
            Verdict::Decline(None)
        ));
        assert_eq!(
            within(0, &hosts).intra(&offers, &[]),
            [TransportKind::Tcp; 4]
        );
    }
}
