//! Verbs as a candidate: the job uses RDMA verbs when every rank has a usable port and no rank
//! asks for TCP; otherwise TCP everywhere, or — when some rank asked for verbs —
//! [`Error::Unavailable`] on every rank, naming the rank and the reason. Round one announces
//! each rank's port, queue pairs and direct region ([`VerbsOffer`]); round two connects the
//! queue pairs and confirms. The decisions ([`Verbs::decide`], [`Verbs::settle`]) are pure.
//!
//! Also here: [`VerbsOptions::from_config`], the transport's options from the [`Config`]
//! (the transport itself reads no configuration).

use std::net::TcpStream;

use super::negotiate::{self, first_failure, Candidate, Outcome, Verdict};
use super::offer::{Confirm, VerbsOffer};
use super::region;
use crate::bootstrap::Bootstrap;
use crate::config::{Config, TransportChoice};
use crate::error::{Error, Result};
use crate::gpu::direct::DirectRegion;
use crate::plan;
use crate::transport::verbs::wire::{self, Blob};
use crate::transport::verbs::{self, Prepared, VerbsOptions, VerbsTransport};
use crate::transport::{Transport, HEADER_LEN};

// Every rank of the largest world must be a peer a work request's id can name.
const _: () = assert!(crate::config::MAX_WORLD_SIZE <= wire::MAX_PEERS);

fn unavailable(reason: &str) -> Error {
    Error::unavailable("the verbs transport (DSPARK_TRANSPORT=verbs)", reason)
}

/// The facts the verbs decision reads, and what round one set up.
#[derive(Debug)]
pub(crate) struct Verbs<'a> {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    /// Every rank's host identity (named in the reasons).
    pub(crate) hosts: Vec<String>,
    /// What this rank asked for.
    pub(crate) mode: TransportChoice,
    /// The configuration the direct region is set up from (`None` in the decision's tests).
    pub(crate) cfg: Option<&'a Config>,
    pub(crate) opts: VerbsOptions,
    /// The peers connected at init.
    pub(crate) partners: Vec<usize>,
    /// The GPU memory this rank set up as its direct region, once it found a usable port.
    pub(crate) region: Option<DirectRegion>,
}

fn blobs(offers: &[VerbsOffer]) -> Vec<Blob> {
    offers.iter().map(|o| o.blob.clone()).collect()
}

impl Verbs<'_> {
    fn host(&self, r: usize) -> String {
        self.hosts
            .get(r)
            .map_or(String::new(), |h| format!(" on {h}"))
    }

    /// Why the job cannot use verbs (None: it can), from the offers and, after round two,
    /// the confirmations.
    ///
    /// # Errors
    /// [`Error::Config`] where the ranks' slot layouts differ.
    pub(crate) fn why_not(
        &self,
        offers: &[VerbsOffer],
        confirms: &[Confirm],
    ) -> Result<Option<String>> {
        let host = |r: usize| self.host(r);
        if let Some(why) = verbs::why_not_connectable(&blobs(offers), &host)? {
            return Ok(Some(why));
        }
        Ok(first_failure(confirms).map(|(r, w)| {
            format!(
                "rank {r}{}: connecting queue pairs failed: {w}",
                self.host(r)
            )
        }))
    }

    /// A "no": an error where a rank asked for verbs, else TCP, with the reason unless every
    /// rank asked for TCP.
    fn no(&self, offers: &[VerbsOffer], why: String) -> Verdict {
        let wanted: Vec<String> = offers
            .iter()
            .enumerate()
            .filter(|(_, o)| o.mode == Some(TransportChoice::Verbs))
            .map(|(r, _)| r.to_string())
            .collect();
        if !wanted.is_empty() {
            return Verdict::Fail(unavailable(&format!(
                "{why} (DSPARK_TRANSPORT=verbs on rank(s) {})",
                wanted.join(", ")
            )));
        }
        let all_tcp = self.mode == TransportChoice::Tcp
            && offers.iter().all(|o| o.mode == Some(TransportChoice::Tcp));
        Verdict::Decline((!all_tcp).then(|| format!("verbs unavailable: {why}")))
    }

    fn verdict(&self, offers: &[VerbsOffer], confirms: &[Confirm]) -> Verdict {
        match self.why_not(offers, confirms) {
            Err(e) => Verdict::Fail(e),
            Ok(None) => Verdict::Go,
            Ok(Some(why)) => self.no(offers, why),
        }
    }

    /// Opens the port, then sets up and registers the direct region near it.
    fn prepare(&mut self, partners: &[usize]) -> std::result::Result<Prepared, String> {
        let mut p = verbs::prepare(self.rank, self.world, partners, self.opts.clone())?;
        // Only now, with a usable port, is it worth setting up device memory for the NIC.
        if let Some(cfg) = self.cfg {
            let (spec, r) = region::direct_spec(cfg, p.options(), p.device_name());
            self.region = r;
            p.register_direct(&spec);
        }
        Ok(p)
    }
}

impl Candidate for Verbs<'_> {
    type Offer = VerbsOffer;
    type Prepared = Prepared;
    type Connected = ();

    fn offer(&mut self) -> Result<(VerbsOffer, Option<Prepared>)> {
        let (blob, prep) = if self.mode == TransportChoice::Tcp {
            let reason = "DSPARK_TRANSPORT=tcp".into();
            (Blob::Incapable { reason }, None)
        } else {
            // Queue pairs and slot memory now only for the pairs the collectives' schedules
            // use (the rendezvous connected the same pairs); the others connect on first use.
            let partners = self.partners.clone();
            match self.prepare(&partners) {
                Ok(p) => (p.blob(), Some(p)),
                Err(reason) => (Blob::Incapable { reason }, None),
            }
        };
        let mode = Some(self.mode);
        Ok((VerbsOffer { mode, blob }, prep))
    }

    fn decide(&self, offers: &[VerbsOffer]) -> Verdict {
        self.verdict(offers, &[])
    }

    fn connect(
        &mut self,
        prepared: &mut Prepared,
        offers: &[VerbsOffer],
    ) -> std::result::Result<(), String> {
        prepared.connect(self.rank, &blobs(offers))
    }

    fn settle(&self, offers: &[VerbsOffer], confirms: &[Confirm]) -> Verdict {
        self.verdict(offers, confirms)
    }

    fn unprepared(&self) -> Error {
        unavailable("internal: capable without resources")
    }
}

/// Agrees with every other rank on whether the job uses verbs (see the module docs):
/// `Ok(transport)`, or why not (`None` where every rank asked for TCP). The direct region
/// this rank set up, if any, is left in `region` for the caller to keep or free.
///
/// # Errors
/// [`Error::Unavailable`] where a rank asked for verbs, bootstrap errors ([`Error::Timeout`],
/// [`Error::PeerLost`]), [`Error::Config`] for bad `DSPARK_IB_*` settings.
pub(crate) fn select(
    boot: &mut Bootstrap,
    cfg: &Config,
    streams: &mut Vec<Option<TcpStream>>,
    region: &mut Option<DirectRegion>,
) -> Result<std::result::Result<Box<VerbsTransport>, Option<String>>> {
    let (rank, world) = (cfg.rank, cfg.world_size);
    let mut c = Verbs {
        rank,
        world,
        hosts: boot.peers.iter().map(|p| p.host.clone()).collect(),
        mode: cfg.transport,
        cfg: Some(cfg),
        opts: VerbsOptions::from_config(cfg)?,
        partners: plan::algo::standing_partners(world, rank),
        region: None,
    };
    if world == 1 {
        if cfg.transport != TransportChoice::Verbs {
            return Ok(Err(None));
        }
        let prep = c.prepare(&[]).map_err(|r| unavailable(&r));
        *region = c.region.take();
        let t = VerbsTransport::build(rank, world, prep?, &[], std::mem::take(streams));
        return Ok(Ok(Box::new(t)));
    }
    let n = negotiate::negotiate(&mut c, boot, streams);
    *region = c.region.take();
    let n = n?;
    match n.outcome {
        Outcome::Won(prep, ()) => {
            // A connection beside each queue pair (the rendezvous made them already), and
            // the other pairs on first use.
            let partners = &c.partners;
            boot.complete_mesh(streams, &|p| partners.binary_search(&p).is_ok())?;
            let blobs = blobs(&n.offers);
            let mut t = VerbsTransport::build(rank, world, prep, &blobs, std::mem::take(streams));
            match boot.links() {
                Some(l) => t = t.with_links(Box::new(l)),
                None if partners.len() + 1 < world => {
                    return Err(unavailable(
                        "internal: the bootstrap has no listener left for connections on \
                         first use",
                    ))
                }
                None => {}
            }
            tracing::info!(rank, transport = %t.describe(), "using RDMA verbs");
            Ok(Ok(Box::new(t)))
        }
        Outcome::Declined(reason) => {
            let why = c
                .why_not(&n.offers, &n.confirms)
                .ok()
                .flatten()
                .unwrap_or_default();
            let any_capable = n
                .offers
                .iter()
                .any(|o| matches!(o.blob, Blob::Capable { .. }));
            let asked_tcp = n
                .offers
                .iter()
                .any(|o| o.mode == Some(TransportChoice::Tcp));
            if any_capable && !asked_tcp {
                // Some ranks could do RDMA but not all: the job silently runs slower. Say so.
                super::once::warn_once!(
                    key: &format!("verbs fallback: {why}"),
                    rank,
                    reason = %why,
                    "falling back to TCP on every rank: not every rank can use RDMA verbs"
                );
            } else {
                tracing::info!(rank, reason = %why, "using TCP");
            }
            Ok(Err(reason))
        }
    }
}

impl VerbsOptions {
    /// The options for `cfg` (its `DSPARK_IB_*` settings, [`Config::ib`]); no environment is
    /// read.
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable.
    pub fn from_config(cfg: &Config) -> Result<Self> {
        cfg.ib.validate(cfg.segment_bytes)?;
        let device = match &cfg.ib_device {
            None => None,
            Some(spec) => {
                Some(verbs::parse_device(spec).map_err(|w| Error::config("DSPARK_IB_DEVICE", w))?)
            }
        };
        let seg = cfg.segment_bytes.max(64);
        let slot_payload = cfg.ib.slot_bytes.unwrap_or(seg).max(seg);
        if (slot_payload + HEADER_LEN) as u64 > u64::from(wire::MAX_FRAME) {
            return Err(Error::config(
                "DSPARK_CHUNK_BYTES",
                format!(
                    "verbs slots hold at most {} payload bytes; {slot_payload} is too large",
                    wire::MAX_FRAME as usize - HEADER_LEN
                ),
            ));
        }
        let ib = &cfg.ib;
        Ok(VerbsOptions {
            device,
            gid_index: cfg.ib_gid_index,
            slots: ib.slots,
            slot_payload,
            reliability: verbs::ib::Reliability {
                timeout: ib.timeout,
                retry_cnt: ib.retry_cnt,
                rnr_retry: ib.rnr_retry,
                min_rnr_timer: 12,
                service_level: ib.service_level,
                traffic_class: ib.traffic_class,
            },
            spin: ib.spin,
            zero_copy_min: ib.zero_copy_min,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::verbs::wire::{LinkLayer, PortAddr};

    fn opts_of(vars: &[(&str, &str)]) -> Result<VerbsOptions> {
        let m: std::collections::HashMap<String, String> = [
            ("DSPARK_RANK", "0"),
            ("DSPARK_WORLD_SIZE", "2"),
            ("DSPARK_ROOT_ADDR", "h:1"),
        ]
        .iter()
        .chain(vars)
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let cfg = Config::from_lookup(|k| m.get(k).cloned())?;
        VerbsOptions::from_config(&cfg)
    }

    #[test]
    fn default_ack_budget_rides_out_congestion_like_nccls() {
        let o = opts_of(&[]).unwrap();
        let r = o.reliability;
        // The ACK timeout is 4.096 µs × 2^t, tried retry_cnt + 1 times: about 34 s, NCCL's
        // budget (a dead peer is found by the liveness connection, not by this).
        let worst_ms = 4.096e-3 * f64::from(1u32 << r.timeout) * f64::from(r.retry_cnt + 1);
        assert!((20_000.0..60_000.0).contains(&worst_ms), "{worst_ms} ms");
        assert!(r.rnr_retry < 7, "RNR retry 7 means forever");
        assert_eq!((r.service_level, r.traffic_class), (0, 0));
        assert_eq!(o.slot_payload, 512 * 1024);
        assert_eq!(o.slot_bytes() % 64, 0);
        assert!(o.slot_bytes() >= o.slot_payload + HEADER_LEN);
        let o = opts_of(&[("DSPARK_IB_SL", "5"), ("DSPARK_IB_TC", "106")]).unwrap();
        assert_eq!(
            (o.reliability.service_level, o.reliability.traffic_class),
            (5, 106)
        );
    }

    #[test]
    fn bad_tunables_name_their_variable() {
        let e = opts_of(&[("DSPARK_IB_SLOTS", "1")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("DSPARK_IB_SLOTS"), "{e}");
        let e = opts_of(&[("DSPARK_IB_SLOT_BYTES", "4K")])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("DSPARK_IB_SLOT_BYTES") && e.contains("segment"),
            "{e}"
        );
        let e = opts_of(&[("DSPARK_IB_RETRY_CNT", "8")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("DSPARK_IB_RETRY_CNT"), "{e}");
        let o = opts_of(&[("DSPARK_IB_SLOTS", "4"), ("DSPARK_IB_SLOT_BYTES", "1M")]).unwrap();
        assert_eq!((o.slots, o.slot_payload), (4, 1 << 20));
    }

    fn verbs(rank: usize, world: usize, mode: TransportChoice) -> Verbs<'static> {
        Verbs {
            rank,
            world,
            hosts: (0..world).map(|r| format!("h{r}")).collect(),
            mode,
            cfg: None,
            opts: opts_of(&[]).unwrap(),
            partners: Vec::new(),
            region: None,
        }
    }

    fn offer(mode: TransportChoice, blob: Blob) -> VerbsOffer {
        VerbsOffer {
            mode: Some(mode),
            blob,
        }
    }

    fn incapable(mode: TransportChoice, why: &str) -> VerbsOffer {
        offer(mode, Blob::Incapable { reason: why.into() })
    }

    use TransportChoice::{Auto, Tcp, Verbs as V};

    #[test]
    fn one_rank_without_rdma_sends_the_job_to_tcp_with_the_reason() {
        let c = verbs(0, 3, Auto);
        let offers = [
            incapable(Auto, "no RDMA device"),
            incapable(Auto, "no RDMA device"),
            incapable(Auto, "libibverbs.so.1 not found"),
        ];
        match c.decide(&offers) {
            Verdict::Decline(Some(w)) => {
                assert_eq!(w, "verbs unavailable: rank 0 on h0: no RDMA device")
            }
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn a_rank_that_asked_for_verbs_turns_the_reason_into_an_error_on_every_rank() {
        let offers = [
            incapable(Auto, "no RDMA device"),
            incapable(V, "no ACTIVE port"),
        ];
        for r in 0..2 {
            match verbs(r, 2, Auto).decide(&offers) {
                Verdict::Fail(e) => {
                    let s = e.to_string();
                    assert!(s.contains("rank 0 on h0: no RDMA device"), "{s}");
                    assert!(s.contains("DSPARK_TRANSPORT=verbs on rank(s) 1"), "{s}");
                }
                v => panic!("{v:?}"),
            }
        }
    }

    #[test]
    fn every_rank_asking_for_tcp_declines_without_a_reason() {
        let offers = [
            incapable(Tcp, "DSPARK_TRANSPORT=tcp"),
            incapable(Tcp, "DSPARK_TRANSPORT=tcp"),
        ];
        assert!(matches!(
            verbs(0, 2, Tcp).decide(&offers),
            Verdict::Decline(None)
        ));
        // One rank asked for TCP, the other left it to auto: the reason is reported.
        let mixed = [
            incapable(Tcp, "DSPARK_TRANSPORT=tcp"),
            incapable(Auto, "no RDMA device"),
        ];
        assert!(matches!(
            verbs(1, 2, Auto).decide(&mixed),
            Verdict::Decline(Some(_))
        ));
    }

    fn capable(link: LinkLayer, slots: u32) -> Blob {
        Blob::Capable {
            device: "rxe0:1".into(),
            port: PortAddr {
                link,
                lid: 0,
                gid: [0; 16],
                gid_index: Some(0),
                mtu: 3,
            },
            slots,
            slot_bytes: 4096,
            ctrl_bytes: 64,
            qps: Vec::new(),
            direct: wire::DirectInfo::None,
        }
    }

    #[test]
    fn capable_ranks_connect_and_a_failed_connection_is_named_after_round_two() {
        let offers = [
            offer(Auto, capable(LinkLayer::Ethernet, 8)),
            offer(Auto, capable(LinkLayer::Ethernet, 8)),
        ];
        let c = verbs(0, 2, Auto);
        assert!(matches!(c.decide(&offers), Verdict::Go));
        assert!(matches!(
            c.settle(&offers, &[Confirm::Ok, Confirm::Ok]),
            Verdict::Go
        ));
        match c.settle(
            &offers,
            &[Confirm::Ok, Confirm::Failed("RTR: EINVAL".into())],
        ) {
            Verdict::Decline(Some(w)) => assert_eq!(
                w,
                "verbs unavailable: rank 1 on h1: connecting queue pairs failed: RTR: EINVAL"
            ),
            v => panic!("{v:?}"),
        }
    }

    #[test]
    fn ports_of_two_link_layers_or_two_slot_layouts_do_not_connect() {
        let c = verbs(0, 2, Auto);
        let links = [
            offer(Auto, capable(LinkLayer::Ethernet, 8)),
            offer(Auto, capable(LinkLayer::InfiniBand, 8)),
        ];
        match c.decide(&links) {
            Verdict::Decline(Some(w)) => assert!(w.contains("cannot be connected"), "{w}"),
            v => panic!("{v:?}"),
        }
        let slots = [
            offer(Auto, capable(LinkLayer::Ethernet, 8)),
            offer(Auto, capable(LinkLayer::Ethernet, 4)),
        ];
        match c.decide(&slots) {
            Verdict::Fail(e) => assert!(e.to_string().contains("DSPARK_IB_SLOTS"), "{e}"),
            v => panic!("{v:?}"),
        }
    }
}
