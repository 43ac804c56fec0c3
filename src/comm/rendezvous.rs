//! Rendezvous through a key-value store: [`Communicator::init_with_store`], and torchrun's
//! agent store under [`Rendezvous::TorchStore`].

#![forbid(unsafe_code)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, ToSocketAddrs, UdpSocket};

use super::Communicator;
use crate::bootstrap::store::{PrefixStore, Store, TcpStore};
use crate::config::{join_host_port, split_host_port, Config, Rendezvous};
use crate::error::{Error, Result};

/// The key every rank adds 1 to at each init: init `g` (0, 1, ...) through one store is
/// told apart from the others by `(value - 1) / world`. No rank can begin init `g + 1`
/// before every rank added for init `g` (init `g` needs all of them), so the generations
/// never mix.
const INIT_COUNT: &str = "dspark/inits";

/// What rank 0 publishes: a version tag and its listener's address.
const ROOT_TAG: &str = "dspark-root-v1 ";

/// The address rank 0 publishes: the configured interface's, else the one this host uses to
/// reach `towards` (no packet is sent: a UDP socket is only connected), else loopback.
fn publish_ip(config: &Config, towards: Option<&str>) -> Result<IpAddr> {
    if let Some(ifname) = config.socket_ifname.as_deref() {
        return crate::bootstrap::interface_ip(ifname);
    }
    let route = |host: &str, port: u16| -> Option<IpAddr> {
        let target = (host, port)
            .to_socket_addrs()
            .ok()?
            .find(SocketAddr::is_ipv4)?;
        let s = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).ok()?;
        s.connect(target).ok()?;
        Some(s.local_addr().ok()?.ip())
    };
    let routed = towards
        .and_then(|a| split_host_port(a).ok())
        .and_then(|(h, p)| route(&h, p));
    Ok(match routed {
        Some(ip) => ip,
        None => {
            // Only ranks on this host can reach it: say so, since ranks elsewhere would
            // time out trying.
            let why = towards.map_or("no address to route towards".to_string(), |a| {
                format!("no IPv4 route towards {a}")
            });
            tracing::warn!(
                "rank 0 publishes 127.0.0.1 for the rendezvous ({why}): only ranks on this \
                 host can join; set DSPARK_SOCKET_IFNAME to publish another interface's address"
            );
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
    /// order on every rank.
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
        let n = store.add(INIT_COUNT, 1)?;
        let generation = (n.max(1) as u64 - 1) / world as u64;
        let key = format!("dspark/root/{generation}");
        config.sources.retain(|(k, _)| k != "root address");
        config.sources.push((
            "root address".into(),
            format!("the key-value store (key {key:?})"),
        ));
        if rank == 0 {
            let ip = publish_ip(&config, towards.as_deref())?;
            let bind_ip = if crate::bootstrap::is_local_ip(ip) {
                ip
            } else {
                IpAddr::V4(Ipv4Addr::UNSPECIFIED)
            };
            let listener = TcpListener::bind(SocketAddr::new(bind_ip, 0)).map_err(|e| {
                Error::io(
                    Some(0),
                    None,
                    format!("bootstrap: listening on {bind_ip}:0"),
                    e,
                )
            })?;
            let port = listener
                .local_addr()
                .map_err(|e| Error::io(Some(0), None, "bootstrap: listener address", e))?
                .port();
            let addr = join_host_port(&ip.to_string(), port);
            store.set(&key, format!("{ROOT_TAG}{addr}").as_bytes())?;
            tracing::debug!(%addr, %key, "rank 0 published its rendezvous address");
            config.root_addr = addr;
            Self::init_inner(config, Some(listener))
        } else {
            let v = store.get(&key, config.timeout)?;
            let text = String::from_utf8_lossy(&v);
            let addr = text.strip_prefix(ROOT_TAG).ok_or_else(|| Error::Mismatch {
                rank: Some(rank),
                peer: Some(0),
                op: "bootstrap".into(),
                what: format!(
                    "store key {key:?} holds {text:?}, not a dspark rank 0 address of this \
                     version ({ROOT_TAG:?}...)"
                ),
            })?;
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
