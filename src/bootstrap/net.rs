//! Interface, address and name helpers of the rendezvous: this host's name, the IPv4
//! address of a named interface (`DSPARK_SOCKET_IFNAME`), name resolution, and whether an
//! address is this host's. Kept apart from the handshakes, which only call them.

#![forbid(unsafe_code)]

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, ToSocketAddrs};

use crate::error::{Error, Result};

/// This host's name (`unknown-host` when it has none that is UTF-8).
pub(super) fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .unwrap_or_else(|| "unknown-host".into())
}

/// The IPv4 address of interface `name`.
pub(crate) fn interface_ip(name: &str) -> Result<IpAddr> {
    let addrs = nix::ifaddrs::getifaddrs().map_err(|e| {
        Error::config(
            "DSPARK_SOCKET_IFNAME",
            format!("cannot list interfaces: {e}"),
        )
    })?;
    let mut names = Vec::new();
    for a in addrs {
        if !names.contains(&a.interface_name) {
            names.push(a.interface_name.clone());
        }
        if a.interface_name != name {
            continue;
        }
        if let Some(sin) = a.address.as_ref().and_then(|s| s.as_sockaddr_in()) {
            return Ok(IpAddr::V4(sin.ip()));
        }
    }
    Err(Error::config(
        "DSPARK_SOCKET_IFNAME",
        format!(
            "interface {name:?} has no IPv4 address (interfaces here: {})",
            names.join(", ")
        ),
    ))
}

/// The addresses `host:port` resolves to.
pub(super) fn resolve(host: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
    Ok((host, port).to_socket_addrs()?.collect())
}

/// Whether `ip` is one of this host's addresses (a listener can bind it).
pub(crate) fn is_local_ip(ip: IpAddr) -> bool {
    TcpListener::bind(SocketAddr::new(ip, 0)).is_ok()
}
