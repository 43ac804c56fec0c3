//! Rendezvous through a key-value store: [`Communicator::init_with_store`], and torchrun's
//! agent store under [`Rendezvous::TorchStore`].

#![forbid(unsafe_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, UdpSocket};

use super::Communicator;
use crate::bootstrap::store::{PrefixStore, Store, TcpStore};
use crate::config::{join_host_port, split_host_port, Config, JobAuth, Rendezvous};
use crate::error::{Error, Result};

/// The key of the store rendezvous' generation record, which only compare-and-set changes:
/// `dspark-gen-v1 <generation> <ranks joined> <generation id> <last joiner>`. The ranks of one
/// init join one generation (a rank that finds it full opens the next one, with a random id
/// of its own), and meet under a key named by the generation's random id: inits through one
/// store, one after another, never mix. The record is no number, so a stray `add` on the key
/// fails (torch's servers and [`crate::store::MemStore`] refuse to add to a value that is not
/// a decimal integer) instead of moving the job to another generation; nothing else here is
/// a counter.
const GENERATION: &str = "dspark/generation";

/// The generation record's tag.
const GEN_TAG: &str = "dspark-gen-v1";

/// What a compare-and-set of a missing key with this `expected` answers (torch's semantics):
/// a read that sets nothing.
const PROBE: &[u8] = b"dspark-gen-probe";

/// What rank 0 publishes: a version tag, its listener's address and the job's secret (hex),
/// or `-` where rank 0 has a token of its own.
const ROOT_TAG: &str = "dspark-root-v2 ";

/// Joins the current generation of the store rendezvous, or opens the next one: returns the
/// key under which this init's rank 0 publishes its address.
fn join_generation(
    store: &dyn Store,
    rank: usize,
    world: usize,
    config: &Config,
) -> Result<String> {
    let me = crate::config::trust::hex(
        &crate::bootstrap::auth::nonce().map_err(|e| {
            Error::io(
                Some(rank),
                None,
                "rendezvous: reading a nonce from /dev/urandom",
                e,
            )
        })?[..12],
    );
    let parse = |v: &[u8]| -> Option<(u64, usize, String)> {
        let text = std::str::from_utf8(v).ok()?;
        let mut w = text.strip_prefix(GEN_TAG)?.split_whitespace();
        let g = w.next()?.parse().ok()?;
        let n = w.next()?.parse().ok()?;
        Some((g, n, w.next()?.to_string()))
    };
    let deadline = crate::time::deadline(std::time::Instant::now(), config.timeout);
    let mut seen = store.compare_set(GENERATION, PROBE, PROBE)?;
    // Each failed attempt means another rank joined: about `world` of them at most, unless
    // something else keeps changing the key; then pause between attempts.
    let mut attempts = 0usize;
    loop {
        attempts = attempts.saturating_add(1);
        if attempts > world.saturating_add(8) {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let (expected, g, n, id) = match parse(&seen) {
            Some((g, n, id)) if n < world => (seen.clone(), g, n + 1, id),
            // (A last generation of u64::MAX, written by no dspark, starts over at 0.)
            Some((g, _, _)) => (seen.clone(), g.checked_add(1).unwrap_or(0), 1, me.clone()),
            // Missing, or not a record (a stray add's counter): the first generation.
            None if seen == PROBE => (Vec::new(), 0, 1, me.clone()),
            None => (seen.clone(), 0, 1, me.clone()),
        };
        let desired = format!("{GEN_TAG} {g} {n} {id} {me}");
        seen = store.compare_set(GENERATION, &expected, desired.as_bytes())?;
        if seen == desired.as_bytes() {
            return Ok(format!("dspark/root/{g}-{id}"));
        }
        if std::time::Instant::now() >= deadline {
            return Err(Error::Timeout {
                rank,
                peer: None,
                op: "rendezvous".into(),
                waited: config.timeout,
                detail: format!(
                    "could not join a generation of the store rendezvous (key {GENERATION:?} \
                     keeps changing: last {:?})",
                    String::from_utf8_lossy(&seen)
                ),
            });
        }
    }
}

/// The address rank 0 publishes: the configured interface's, else the one this host uses to
/// reach `towards` (no packet is sent: a UDP socket is only connected), else loopback.
fn publish_ip(config: &Config, towards: Option<&str>) -> Result<IpAddr> {
    if let Some(ifname) = config.socket_ifname.as_deref() {
        return crate::bootstrap::interface_ip(ifname);
    }
    let route = |host: &str, port: u16| -> Result<Option<IpAddr>> {
        let t0 = std::time::Instant::now();
        let addrs = match crate::bootstrap::resolve(host, port, config.timeout) {
            Ok(a) => a,
            // A resolver that does not answer is said, not taken for "no route" (which
            // publishes loopback, and the ranks elsewhere time out without a word of it).
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                return Err(Error::Timeout {
                    rank: config.rank,
                    peer: None,
                    op: "rendezvous".into(),
                    waited: t0.elapsed(),
                    detail: format!(
                        "rank 0 looks up {host} to choose the address it publishes: {e}"
                    ),
                })
            }
            Err(_) => return Ok(None),
        };
        let Some(target) = addrs.into_iter().find(SocketAddr::is_ipv4) else {
            return Ok(None);
        };
        let routed = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0))
            .and_then(|s| s.connect(target).and_then(|()| s.local_addr()));
        Ok(routed.ok().map(|a| a.ip()))
    };
    let routed = match towards.and_then(|a| split_host_port(a).ok()) {
        Some((h, p)) => route(&h, p)?,
        None => None,
    };
    Ok(match routed {
        Some(ip) => ip,
        None => {
            // Only ranks on this host can reach it: say so, since ranks elsewhere would
            // time out trying.
            let why = towards.map_or("no address to route towards".to_string(), |a| {
                format!("no IPv4 route towards {a}")
            });
            let what = format!(
                "rank 0 publishes 127.0.0.1 for the rendezvous ({why}): only ranks on this \
                 host can join; set DSPARK_SOCKET_IFNAME to publish another interface's address"
            );
            super::setup::once::warn_once!(key: &what, "{what}");
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        }
    })
}

impl Communicator {
    /// Joins a job through a key-value store, as Gloo and NCCL (through its unique id) do:
    /// rank 0 listens on an ephemeral port and publishes its address in `store`; the other
    /// ranks read it from there and connect. No fixed port is bound, so this works in a
    /// process where torch.distributed, torchrun's agent or another job already uses
    /// `MASTER_PORT`. `config` supplies every other setting; its `rank`, `world_size` are
    /// replaced by `rank` and `world`, and its `root_addr` (if any) only serves to choose
    /// the address rank 0 publishes (the interface that reaches it).
    ///
    /// Several communicators may be made through one store, one after another, in the same
    /// order on every rank. A stray `add` by another client of the store cannot move a rank
    /// to another init: the ranks meet under a random per-init key that only compare-and-set
    /// hands out.
    ///
    /// Unless the ranks have a token ([`Config::job_token`]), rank 0 draws a random secret
    /// and publishes it with its address, and every rank proves it in its handshakes
    /// ([`JobAuth::Store`]): a stranger that reaches the port cannot join, but every client
    /// of the store can read the secret: the job is exactly as private as the store.
    ///
    /// # Errors
    /// [`Error::Timeout`] when rank 0's address does not appear in the store by the deadline;
    /// the store's errors; the errors of [`Communicator::init`].
    pub fn init_with_store(
        store: &dyn Store,
        rank: usize,
        world: usize,
        config: Config,
    ) -> Result<Self> {
        let towards = (!config.root_addr.is_empty()).then(|| config.root_addr.clone());
        let via = config
            .sources
            .iter()
            .find(|(k, _)| k == "rendezvous")
            .map(|(_, v)| v.clone());
        let mut config = Config {
            rank,
            world_size: world,
            rendezvous: Rendezvous::Listen,
            ..config
        };
        config.sources.retain(|(k, _)| k != "rendezvous");
        config.sources.push((
            "rendezvous".into(),
            via.unwrap_or_else(|| "a key-value store (Communicator::init_with_store)".into()),
        ));
        if world <= 1 {
            return Self::init_inner(config, None);
        }
        // Rank, world and settings are checked before the store sees this rank.
        Config {
            root_addr: "127.0.0.1:1".into(),
            ..config.clone()
        }
        .validate()?;
        let key = join_generation(store, rank, world, &config)?;
        config.sources.retain(|(k, _)| k != "root address");
        config.sources.push((
            "root address".into(),
            format!("the key-value store (key {key:?})"),
        ));
        let from_store = |config: &mut Config, secret: &str| {
            // Without a token of its own, a rank takes the secret rank 0 published: as
            // private as the store.
            if config.job_token.is_none() && secret != "-" {
                config.job_token = Some(secret.to_string());
                config.job_auth = JobAuth::Store;
            }
        };
        if rank == 0 {
            let ip = publish_ip(&config, towards.as_deref())?;
            // The published address, never a wildcard (unless DSPARK_LISTEN_ANY asks): the
            // listener is reachable only where the ranks are told to connect.
            let bind_ip = match ip {
                _ if !config.listen_any => ip,
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
            };
            if !config.listen_any && !crate::bootstrap::is_local_ip(ip) {
                return Err(Error::config(
                    "DSPARK_SOCKET_IFNAME",
                    format!(
                        "rank 0 would publish {ip} for the rendezvous, which is no address of \
                         this host: set DSPARK_SOCKET_IFNAME to the interface the ranks reach \
                         (or DSPARK_LISTEN_ANY=1 to listen on every interface)"
                    ),
                ));
            }
            let listener = TcpListener::bind(SocketAddr::new(bind_ip, 0)).map_err(|e| {
                Error::io(
                    Some(0),
                    None,
                    format!("bootstrap: listening on {bind_ip}:0"),
                    e,
                )
            })?;
            crate::bootstrap::net::widen_backlog(&listener);
            let port = listener
                .local_addr()
                .map_err(|e| Error::io(Some(0), None, "bootstrap: listener address", e))?
                .port();
            let addr = join_host_port(&ip.to_string(), port);
            let secret = match config.job_token {
                Some(_) => "-".to_string(),
                None => crate::config::trust::spawner_secret().map_err(|e| {
                    Error::io(
                        Some(0),
                        None,
                        "rendezvous: reading a secret from /dev/urandom",
                        e,
                    )
                })?,
            };
            store.set(&key, format!("{ROOT_TAG}{addr} {secret}").as_bytes())?;
            tracing::debug!(%addr, %key, "rank 0 published its rendezvous address");
            from_store(&mut config, &secret);
            config.root_addr = addr;
            Self::init_inner(config, Some(listener))
        } else {
            let v = store.get(&key, config.timeout)?;
            let text = String::from_utf8_lossy(&v);
            let (addr, secret) = text
                .strip_prefix(ROOT_TAG)
                .and_then(|t| t.split_once(' '))
                .ok_or_else(|| Error::Mismatch {
                    rank: Some(rank),
                    peer: Some(0),
                    op: "bootstrap".into(),
                    what: format!(
                        "store key {key:?} does not hold a dspark rank 0 address of this version \
                         ({ROOT_TAG:?}...)"
                    ),
                })?;
            from_store(&mut config, secret);
            config.root_addr = addr.to_string();
            Self::init_inner(config, None)
        }
    }

    /// Rendezvous through the c10d TCPStore at `config.root_addr` (torchrun's agent store).
    pub(super) fn init_through_torch_store(config: Config, prefix: &str) -> Result<Self> {
        let (host, port) = split_host_port(&config.root_addr)
            .map_err(|w| Error::config("MASTER_ADDR/MASTER_PORT", w))?;
        let store = TcpStore::connect(&host, port, config.timeout)?.with_rank(config.rank);
        let store = PrefixStore::new(prefix, store);
        let (rank, world) = (config.rank, config.world_size);
        Self::init_with_store(&store, rank, world, config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::store::MemStore;

    /// A record at the last generation a u64 holds (left by something that is not dspark: no
    /// init gets there) is full like any other: the next init opens generation 0 instead of
    /// overflowing.
    #[test]
    fn a_full_record_at_the_last_generation_starts_over() {
        let store = MemStore::new();
        let config = Config::new(0, 2, "127.0.0.1:1");
        store
            .set(
                GENERATION,
                format!("{GEN_TAG} {} 2 old x", u64::MAX).as_bytes(),
            )
            .unwrap();
        let key = join_generation(&store, 0, 2, &config).unwrap();
        assert!(key.starts_with("dspark/root/0-"), "{key}");
        // And the next rank of the world joins that generation.
        let again = join_generation(&store, 1, 2, &config).unwrap();
        assert_eq!(again, key);
    }
}
