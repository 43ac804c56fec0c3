//! Sub-communicators: [`Communicator::split`], with `ncclCommSplit`'s semantics.

#![forbid(unsafe_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};

use super::Communicator;
use crate::bootstrap::auth;
use crate::config::{Config, JobAuth};
use crate::error::{Error, Result};

/// Bytes of a split record: colour, key, listener port, IP.
pub(crate) const RECORD: usize = 8 + 8 + 2 + 16;

/// Bytes each rank contributes to the split exchange: its record, then a random salt for the
/// secret of the group it leads.
const ENTRY: usize = RECORD + auth::TAG_LEN;

/// The label of a child communicator's secret: no proof of another kind verifies with it.
const LABEL_SPLIT: &[u8] = b"dspark/2 split child secret\0";

/// The secret of the group of `colour` made by split number `seq` of a communicator whose
/// secret is `parent` (its token and job id), with its first rank's random `salt`: an
/// HMAC under the parent's key, so only ranks that know the parent's secret (and got the
/// salt over the parent's authenticated connections) know it.
fn child_secret(parent: &Config, colour: i64, seq: u64, salt: &[u8]) -> String {
    derived_secret(
        parent,
        &[LABEL_SPLIT, &colour.to_le_bytes(), &seq.to_le_bytes(), salt],
    )
}

/// A secret derived from a parent communicator's: the HMAC, under the parent's key, of
/// `parts` (which start with a label of their own, so that secrets of different kinds never
/// coincide), in hex. Split children and shrunk communicators (`shrink.rs`) take theirs so.
pub(crate) fn derived_secret(parent: &Config, parts: &[&[u8]]) -> String {
    let key = auth::job_key(parent.job_token.as_deref(), parent.job_id.as_deref());
    crate::config::trust::hex(&auth::hmac_sha256(&key, parts))
}

/// A listener for a communicator made from another one, on an ephemeral port of the address
/// peers reach this rank at (`advertised`, 127.0.0.1 without one), never a wildcard unless
/// `DSPARK_LISTEN_ANY` asks; with the address the peers are to connect to. `what` names it
/// in errors.
pub(crate) fn ephemeral_listener(
    config: &Config,
    advertised: Option<IpAddr>,
    what: &str,
) -> Result<(TcpListener, SocketAddr)> {
    let advertised = advertised.unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let bind_ip = match advertised {
        ip if !config.listen_any => ip,
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    };
    let rank = Some(config.rank);
    let l = TcpListener::bind(SocketAddr::new(bind_ip, 0))
        .map_err(|e| Error::io(rank, None, format!("{what}: listening on {bind_ip}"), e))?;
    crate::bootstrap::net::widen_backlog(&l);
    let port = l
        .local_addr()
        .map_err(|e| Error::io(rank, None, format!("{what}: listener address"), e))?
        .port();
    Ok((l, SocketAddr::new(advertised, port)))
}

/// The configuration of a communicator made from `parent`'s: rank `rank` of `world`, whose
/// first rank listens at `leader`, with the derived secret `token`; `how` says in
/// [`crate::CommInfo::rendezvous`] where the address came from.
pub(crate) fn child_config(
    parent: &Config,
    rank: usize,
    world: usize,
    leader: SocketAddr,
    token: String,
    how: String,
) -> Config {
    Config {
        rank,
        world_size: world,
        root_addr: leader.to_string(),
        job_token: Some(token),
        job_auth: JobAuth::Parent,
        sources: vec![("root address".into(), how)],
        ..parent.clone()
    }
}

/// The colour of a rank that opts out.
const NO_COLOUR: i64 = i64::MIN;
/// The colour of a rank that could not take part (its listener or salt failed); its record's
/// key holds the OS error number, if one (0: none).
const FAILED_COLOUR: i64 = i64::MIN + 1;

/// The record of a rank that could not take part because of `e`.
fn encode_failed(e: &Error) -> [u8; RECORD] {
    let errno = match e {
        Error::Io { source, .. } => source.raw_os_error().unwrap_or(0),
        _ => 0,
    };
    encode(FAILED_COLOUR, i64::from(errno), None)
}

/// The error split number `seq` returns on rank `me` when a rank of the exchange `all` could
/// not take part (the first such rank is named; `None` when every rank could). The failed rank
/// itself returns its own error before it looks.
fn failed_member(all: &[u8], me: usize, seq: u64) -> Option<Error> {
    let (r, (_, errno, _)) = all
        .chunks_exact(ENTRY)
        .map(decode)
        .enumerate()
        .find(|(_, (c, _, _))| *c == FAILED_COLOUR)?;
    let source = match i32::try_from(errno) {
        Ok(n) if n > 0 => std::io::Error::from_raw_os_error(n),
        _ => std::io::Error::other("its error has no OS error number"),
    };
    // An I/O error of that rank's, named as such: not `Aborted`, which would tell a caller
    // (and the C and Python bindings) that this communicator is dead, when it stays usable.
    Some(Error::io(
        Some(me),
        Some(r),
        format!(
            "split #{} (rank {r} could not take part: it could not listen on a port or read a \
             salt; no rank gets a new communicator, and this one stays usable)",
            seq + 1
        ),
        source,
    ))
}

pub(crate) fn encode(colour: i64, key: i64, addr: Option<SocketAddr>) -> [u8; RECORD] {
    let mut b = [0u8; RECORD];
    b[0..8].copy_from_slice(&colour.to_le_bytes());
    b[8..16].copy_from_slice(&key.to_le_bytes());
    if let Some(a) = addr {
        b[16..18].copy_from_slice(&a.port().to_le_bytes());
        let ip = match a.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        b[18..34].copy_from_slice(&ip.octets());
    }
    b
}

pub(crate) fn decode(b: &[u8]) -> (i64, i64, SocketAddr) {
    let i64_at = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[i..i + 8]);
        i64::from_le_bytes(w)
    };
    let port = u16::from_le_bytes([b[16], b[17]]);
    let mut ip = [0u8; 16];
    ip.copy_from_slice(&b[18..34]);
    let v6 = std::net::Ipv6Addr::from(ip);
    let ip = v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4);
    (i64_at(0), i64_at(8), SocketAddr::new(ip, port))
}

impl Communicator {
    /// Splits the communicator into groups, as `ncclCommSplit` and torch's `new_group` do:
    /// ranks that pass the same `colour` form a new communicator, ordered by `key`, then by
    /// their rank here. A rank that passes `None` or a negative colour opts out and gets
    /// `Ok(None)`. Every rank of this communicator must call it (it is a collective here).
    ///
    /// The new communicators need no rendezvous port: each group's first rank listens on an
    /// ephemeral port and the address travels through this communicator. Each has its own
    /// sequence numbers, mismatch checks, progress thread and connections, so groups run
    /// collectives at the same time, and this communicator stays usable.
    ///
    /// Each new communicator has its own secret, which its handshakes prove
    /// ([`crate::JobAuth::Parent`]): an HMAC, under this communicator's secret, of the colour,
    /// the number of this split and a random salt of the group's first rank that travels
    /// over this communicator's connections. A stranger that reaches the group's ephemeral
    /// port cannot join it, even where this communicator is open.
    ///
    /// # Errors
    /// The errors of a collective on this communicator (then no rank gets a new one), and
    /// those of [`Communicator::init`] for the new one. A rank that cannot take part (it
    /// cannot listen on a port or read a salt: EMFILE, say) still joins the exchange, so
    /// that no rank waits for it: it returns its own [`Error::Io`], every other rank an
    /// [`Error::Io`] naming it as the peer (with its OS error), no rank gets a new
    /// communicator, and this one stays usable on every rank.
    pub fn split(&self, colour: Option<i32>, key: i32) -> Result<Option<Communicator>> {
        let colour = colour.filter(|&c| c >= 0).map(i64::from);
        // What this rank needs before the exchange: a salt, and where it has a colour, a
        // listener at the address peers reach it at (never a wildcard unless
        // DSPARK_LISTEN_ANY asks). A rank that cannot have them still takes part in the
        // exchange, marked as failed: every rank then returns an error at once (this one its
        // own, the others one naming it), rather than the others waiting for it until
        // their deadline; and this communicator stays as usable on every rank as before.
        let prepared = self.prepare_split(colour.is_some());
        let mut mine = [0u8; ENTRY];
        match &prepared {
            Ok((salt, listener)) => {
                let addr = listener.as_ref().map(|(_, a)| *a);
                mine[..RECORD].copy_from_slice(&encode(
                    colour.unwrap_or(NO_COLOUR),
                    i64::from(key),
                    addr,
                ));
                mine[RECORD..].copy_from_slice(salt);
            }
            Err(e) => mine[..RECORD].copy_from_slice(&encode_failed(e)),
        }
        let mut all = vec![0u8; ENTRY * self.world_size()];
        if let Err(e) = self.all_gather(&mine, &mut all) {
            if let Err(own) = &prepared {
                // The exchange's error is what the caller gets (the communicator failed);
                // the reason this rank could not have taken part anyway is said here.
                tracing::warn!(rank = self.rank(), "split: {own}");
            }
            return Err(e);
        }
        // The split's number, counted once the exchange succeeded: every rank past it counts
        // it, a failed one included. Counted before it, a rank that failed alone counted a
        // split the others never saw, so that its retry (paired with their first exchange)
        // proved another secret to the new group, and every later split too.
        let seq = self
            .splits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let (_, listener) = prepared?;
        if let Some(e) = failed_member(&all, self.rank(), seq) {
            return Err(e);
        }
        let Some(colour) = colour else {
            return Ok(None);
        };
        // Members of this rank's colour, ordered by (key, old rank).
        let mut members: Vec<(i64, usize, SocketAddr)> = all
            .chunks_exact(ENTRY)
            .enumerate()
            .map(|(r, b)| (r, decode(b)))
            .filter(|(_, (c, _, _))| *c == colour)
            .map(|(r, (_, k, a))| (k, r, a))
            .collect();
        members.sort_unstable_by_key(|&(k, r, _)| (k, r));
        let new_rank = members
            .iter()
            .position(|&(_, r, _)| r == self.rank())
            .ok_or_else(|| {
                Error::invalid(
                    Some(self.rank()),
                    "split",
                    "this rank is not in its own group",
                )
            })?;
        let leader = members[0].2;
        let leader_salt = &all[members[0].1 * ENTRY + RECORD..(members[0].1 + 1) * ENTRY];
        let config = child_config(
            &self.config,
            new_rank,
            members.len(),
            leader,
            child_secret(&self.config, colour, seq, leader_salt),
            format!(
                "the split of rank {}'s communicator (colour {colour})",
                self.rank()
            ),
        );
        let root = match listener {
            Some((l, _)) if new_rank == 0 => Some(l),
            _ => None,
        };
        Communicator::init_inner(config, root).map(Some)
    }

    /// A split's salt and, for a rank with a colour, its listener and the address peers are
    /// to reach it at.
    fn prepare_split(
        &self,
        listen: bool,
    ) -> Result<(auth::Nonce, Option<(TcpListener, SocketAddr)>)> {
        #[cfg(feature = "testing")]
        if FAIL_NEXT_SPLIT.with(|f| f.replace(false)) {
            return Err(Error::io(
                Some(self.rank()),
                None,
                "split: listening (a failure injected by the test hook)",
                std::io::Error::from_raw_os_error(libc::EMFILE),
            ));
        }
        let salt = auth::nonce().map_err(|e| {
            Error::io(
                Some(self.rank()),
                None,
                "split: reading a salt from /dev/urandom",
                e,
            )
        })?;
        let listener = if listen {
            Some(ephemeral_listener(&self.config, self.data_ip, "split")?)
        } else {
            None
        };
        Ok((salt, listener))
    }
}

#[cfg(feature = "testing")]
thread_local! {
    /// [`fail_next_split_on_this_thread`]'s flag.
    static FAIL_NEXT_SPLIT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Makes the next [`Communicator::split`] on this thread fail before its exchange, as a rank
/// whose listener or salt cannot be had (EMFILE) fails: a test hook (`testing` feature).
#[cfg(feature = "testing")]
pub fn fail_next_split_on_this_thread() {
    FAIL_NEXT_SPLIT.with(|f| f.set(true));
}
