//! The one negotiation every job-wide choice at init goes through, whatever it chooses
//! (shared memory on one host, verbs, shared memory within each host of a job on several):
//!
//! 1. **announce**: each rank prepares what it can offer and says so ([`Candidate::offer`]);
//! 2. **all-gather** the offers through the bootstrap;
//! 3. **decide**, on every rank alike, from every rank's offer ([`Candidate::decide`], a pure
//!    function: unit-tested without sockets);
//! 4. **connect** on the ranks that go ahead ([`Candidate::connect`]);
//! 5. **confirm**: all-gather whether connecting worked and decide again
//!    ([`Candidate::settle`], pure too).
//!
//! At most two bootstrap rounds per candidate; a candidate that is declined in step 3 costs
//! one. Because every rank decides from the same gathered bytes, every rank reaches the same
//! job-wide verdict, or the same error.

use std::net::TcpStream;

use super::offer::{Confirm, Wire};
use crate::bootstrap::Bootstrap;
use crate::error::{Error, Result};

/// The job's verdict on a candidate, as one rank sees it.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// Go on: after the offers, connect on this rank; after the confirmations, use it.
    Go,
    /// After the offers only: take part in the confirming round without connecting here
    /// (the candidate goes ahead for other ranks, not for this one).
    Stand,
    /// Not this candidate, with why where the reason is worth reporting (`None`: it was
    /// never a candidate, e.g. another transport was asked for).
    Decline(Option<String>),
    /// An error on every rank (a transport that was asked for and cannot be had, settings
    /// the ranks disagree on).
    Fail(Error),
}

/// One way the job may connect, as the negotiation driver sees it.
pub(crate) trait Candidate {
    /// What a rank announces (its bytes: [`Wire`]).
    type Offer: Wire;
    /// What this rank set up for its offer, kept until the verdict.
    type Prepared;
    /// What connecting made on this rank.
    type Connected;

    /// Round one on this rank: its offer, and the resources it set up for it (`None` when it
    /// has nothing to offer).
    ///
    /// # Errors
    /// Only what must fail init on this rank (a bad setting); anything the job can do without
    /// belongs in the offer.
    fn offer(&mut self) -> Result<(Self::Offer, Option<Self::Prepared>)>;

    /// Pure: from every rank's offer, whether to connect ([`Verdict::Go`] or
    /// [`Verdict::Stand`] on every rank) or not. Must give every rank a round two or none.
    fn decide(&self, offers: &[Self::Offer]) -> Verdict;

    /// Round two on this rank.
    ///
    /// # Errors
    /// Why connecting failed, announced to every rank.
    fn connect(
        &mut self,
        prepared: &mut Self::Prepared,
        offers: &[Self::Offer],
    ) -> std::result::Result<Self::Connected, String>;

    /// Pure: from the offers and every rank's confirmation, whether this rank uses the
    /// candidate ([`Verdict::Go`]) or not.
    fn settle(&self, offers: &[Self::Offer], confirms: &[Confirm]) -> Verdict;

    /// The error for a verdict to connect where this rank prepared nothing (an internal
    /// inconsistency: `decide` said go for a rank without resources).
    fn unprepared(&self) -> Error;
}

/// How a negotiation ended on this rank.
#[derive(Debug)]
pub(crate) enum Outcome<P, C> {
    /// The job uses the candidate here: what was prepared and connected.
    Won(P, C),
    /// Not here, and why where worth reporting.
    Declined(Option<String>),
}

/// What a negotiation gathered and how it ended.
#[derive(Debug)]
pub(crate) struct Negotiation<O, P, C> {
    /// Every rank's offer.
    pub(crate) offers: Vec<O>,
    /// Every rank's confirmation (empty when the job did not go on to connect).
    pub(crate) confirms: Vec<Confirm>,
    /// How it ended here.
    pub(crate) outcome: Outcome<P, C>,
}

/// Every rank's negotiation result for candidate `C`.
pub(crate) type NegotiationOf<C> =
    Negotiation<<C as Candidate>::Offer, <C as Candidate>::Prepared, <C as Candidate>::Connected>;

/// Runs the negotiation of `c` with every other rank over the bootstrap's `streams`.
///
/// # Errors
/// A [`Verdict::Fail`] (the same on every rank); bootstrap errors ([`Error::Timeout`],
/// [`Error::PeerLost`]); [`Candidate::offer`]'s errors.
pub(crate) fn negotiate<C: Candidate>(
    c: &mut C,
    boot: &mut Bootstrap,
    streams: &mut [Option<TcpStream>],
) -> Result<NegotiationOf<C>> {
    let (offer, mut prepared) = c.offer()?;
    let offers: Vec<C::Offer> = boot
        .all_gather(streams, &offer.encode())?
        .iter()
        .enumerate()
        .map(|(r, m)| C::Offer::decode(r, m))
        .collect();
    let declined = |offers, why| Negotiation {
        offers,
        confirms: Vec::new(),
        outcome: Outcome::Declined(why),
    };
    let connect_here = match c.decide(&offers) {
        Verdict::Fail(e) => return Err(e),
        Verdict::Decline(why) => return Ok(declined(offers, why)),
        Verdict::Go => true,
        Verdict::Stand => false,
    };
    let connected = match (connect_here, prepared.as_mut()) {
        (false, _) => None,
        (true, Some(p)) => Some(c.connect(p, &offers)),
        (true, None) => return Err(c.unprepared()),
    };
    let mine = match &connected {
        Some(Err(why)) => Confirm::Failed(why.clone()),
        _ => Confirm::Ok,
    };
    let confirms: Vec<Confirm> = boot
        .all_gather(streams, &mine.encode())?
        .iter()
        .map(|m| Confirm::decode(m))
        .collect();
    let outcome = match c.settle(&offers, &confirms) {
        Verdict::Fail(e) => return Err(e),
        Verdict::Go => match (prepared, connected) {
            (Some(p), Some(Ok(conn))) => Outcome::Won(p, conn),
            _ => return Err(c.unprepared()),
        },
        Verdict::Stand => Outcome::Declined(None),
        Verdict::Decline(why) => Outcome::Declined(why),
    };
    Ok(Negotiation {
        offers,
        confirms,
        outcome,
    })
}

/// The first rank whose confirmation failed, and why.
pub(crate) fn first_failure(confirms: &[Confirm]) -> Option<(usize, &str)> {
    confirms.iter().enumerate().find_map(|(r, c)| match c {
        Confirm::Failed(w) => Some((r, w.as_str())),
        Confirm::Ok => None,
    })
}
