//! Interface, address and name helpers of the rendezvous: this host's name, the IPv4
//! address of a named interface (`DSPARK_SOCKET_IFNAME`), name resolution, and whether an
//! address is this host's. Kept apart from the handshakes, which only call them.

#![forbid(unsafe_code)]

use std::io::{self, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

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

/// The least time a lookup is given, even at a deadline: a name in /etc/hosts or a healthy
/// nameserver answers well within it, so a last try at the deadline says why it failed
/// (refused, unreachable) instead of only that the lookup ran out of time.
pub(crate) const RESOLVE_FLOOR: Duration = Duration::from_millis(250);

/// The addresses `host:port` resolves to, within `within`: an address literal at once, a
/// name through the system's resolver on a thread of its own, given up on (`TimedOut`) when
/// the resolver has not answered by then. A nameserver that does not answer holds the
/// resolver for its timeout times its attempts (`options timeout:30 attempts:5` in
/// resolv.conf: minutes), and a rank must fail by its deadline, naming why; the thread is
/// left to finish on its own.
pub(crate) fn resolve(host: &str, port: u16, within: Duration) -> io::Result<Vec<SocketAddr>> {
    resolve_with(host, port, within, |h, p| {
        Ok((h, p).to_socket_addrs()?.collect())
    })
}

/// [`resolve`] through `lookup` (the system's resolver, or a test's).
fn resolve_with(
    host: &str,
    port: u16,
    within: Duration,
    lookup: fn(&str, u16) -> io::Result<Vec<SocketAddr>>,
) -> io::Result<Vec<SocketAddr>> {
    // `[::1]` as `::1` (a scoped `[fe80::1%eth0]` goes to the resolver unbracketed).
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let (tx, rx) = std::sync::mpsc::channel();
    let name = host.to_string();
    std::thread::Builder::new()
        .name("dspark-resolve".into())
        .spawn(move || {
            let _ = tx.send(lookup(&name, port));
        })?;
    match rx.recv_timeout(within) {
        Ok(answer) => answer,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "the system's resolver did not answer for {host:?} within {:.1} s (a \
                 nameserver in /etc/resolv.conf that does not answer? an address instead of \
                 a name avoids the lookup)",
                within.as_secs_f64()
            ),
        )),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(io::Error::other(format!(
            "the lookup of {host:?} ended without an answer"
        ))),
    }
}

/// Whether `ip` is one of this host's addresses (a listener can bind it).
pub(crate) fn is_local_ip(ip: IpAddr) -> bool {
    TcpListener::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// Lets `l` queue as many connections as the system allows (`SOMAXCONN`: 4096 on current
/// kernels) instead of std's 128: every rank dials rank 0 at init, and a rank busy outside
/// dspark is dialled by every peer that first needs it, so a job of more than 128 ranks
/// filled the queue and the kernel dropped the rest of the dials.
pub(crate) fn widen_backlog(l: &TcpListener) {
    let _ = nix::sys::socket::listen(l, nix::sys::socket::Backlog::MAXCONN);
}

/// The socket timeout for an I/O call now: what is left before `deadline` (at least 1 ms: a
/// zero timeout would mean none), or `TimedOut` once it has passed.
fn left(deadline: Instant) -> io::Result<Duration> {
    let now = Instant::now();
    if now >= deadline {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "nothing more before the deadline",
        ));
    }
    Ok((deadline - now).max(Duration::from_millis(1)))
}

/// Whether an I/O error only says the call's time (or a signal) ran out.
fn retry(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Reads exactly `buf.len()` bytes by `deadline`: each read gets what is left of it, so a
/// peer that stops mid-message, or sends a byte now and then, fails at the deadline (a
/// socket timeout applies to one read: `read_exact` under one could run past it as often
/// as bytes came). Errors: `TimedOut` at the deadline, `UnexpectedEof` when the peer
/// closes, or the OS error.
pub(crate) fn read_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        stream.set_read_timeout(Some(left(deadline)?))?;
        match stream.read(&mut buf[filled..]) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection",
                ))
            }
            Ok(n) => filled += n,
            Err(e) if retry(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes all of `buf` by `deadline`, as [`read_by`] reads.
pub(crate) fn write_by(stream: &mut TcpStream, buf: &[u8], deadline: Instant) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        stream.set_write_timeout(Some(left(deadline)?))?;
        match stream.write(&buf[done..]) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(e) if retry(&e) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that sends a byte every 100 ms, forever: a read of 64 bytes by a deadline
    /// 300 ms away fails at it (one socket timeout per read would have let it go on for as
    /// long as the bytes came).
    #[test]
    fn a_trickling_peer_fails_a_read_at_its_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let feeder = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            for _ in 0..20 {
                if s.write_all(&[7]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let mut c = TcpStream::connect(addr).unwrap();
        let t0 = Instant::now();
        let mut buf = [0u8; 64];
        let e = read_by(&mut c, &mut buf, t0 + Duration::from_millis(300)).unwrap_err();
        let took = t0.elapsed();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(took < Duration::from_millis(1000), "{took:?}");
        drop(c);
        feeder.join().unwrap();
    }

    /// A peer that reads nothing: a write of more than the socket buffers hold fails at
    /// the deadline.
    #[test]
    fn a_peer_that_reads_nothing_fails_a_write_at_its_deadline() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mut c = TcpStream::connect(addr).unwrap();
        let (_idle, _) = l.accept().unwrap();
        let t0 = Instant::now();
        let big = vec![0u8; 64 << 20];
        let e = write_by(&mut c, &big, t0 + Duration::from_millis(300)).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(
            t0.elapsed() < Duration::from_millis(1500),
            "{:?}",
            t0.elapsed()
        );
    }
}

#[cfg(test)]
mod backlog_tests {
    use super::*;

    /// 200 dials of a listener that accepts none of them yet (a rank busy outside dspark,
    /// or rank 0 at the start of a large job): all are queued (std's queue of 128 dropped
    /// the rest, which then waited for SYN retransmits or failed).
    #[test]
    fn a_widened_listener_queues_more_than_128_dials() {
        let somaxconn = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok())
            .unwrap_or(0);
        if somaxconn < 256 {
            println!("skipped: net.core.somaxconn is {somaxconn}, below the 200 dials");
            return;
        }
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        widen_backlog(&l);
        let at = l.local_addr().unwrap();
        let mut held = Vec::new();
        for i in 0..200 {
            match TcpStream::connect_timeout(&at, Duration::from_secs(2)) {
                Ok(s) => held.push(s),
                Err(e) => panic!("dial {i} of a listener that accepts later: {e}"),
            }
        }
        assert_eq!(held.len(), 200);
    }
}

#[cfg(test)]
mod resolve_tests {
    use super::*;

    fn hangs(_: &str, _: u16) -> io::Result<Vec<SocketAddr>> {
        std::thread::sleep(Duration::from_secs(30));
        Ok(Vec::new())
    }

    #[test]
    fn a_resolver_that_does_not_answer_is_given_up_on_by_the_deadline() {
        let t0 = Instant::now();
        let e = resolve_with("hangs.invalid", 1, Duration::from_millis(200), hangs)
            .expect_err("no answer");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut, "{e}");
        assert!(e.to_string().contains("\"hangs.invalid\""), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }

    #[test]
    fn addresses_need_no_resolver_and_names_get_its_answer() {
        let a = resolve_with("10.1.2.3", 7, Duration::ZERO, hangs).expect("a literal");
        assert_eq!(a, ["10.1.2.3:7".parse().expect("addr")]);
        let a = resolve_with("[::1]", 7, Duration::ZERO, hangs).expect("a literal");
        assert_eq!(a, ["[::1]:7".parse().expect("addr")]);
        let a = resolve("localhost", 9, Duration::from_secs(10)).expect("localhost");
        assert!(
            a.iter().all(|a| a.ip().is_loopback() && a.port() == 9),
            "{a:?}"
        );
    }
}
