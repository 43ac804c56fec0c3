//! Retransmission-stall detection (see "Dead hosts" in the module docs of [`super`]): the
//! kernel's per-connection timers, read from `/proc/net/tcp` by a `wait` that heard nothing
//! for its whole timeout, fail a peer whose host stopped acknowledging unacknowledged data
//! (or zero-window probes). Kept apart from the transport's frame handling: it only reads
//! the kernel's counters.

use std::time::Instant;

use super::{PeerState, TcpTransport, STALL_RETRANSMITS};
use crate::error::Result;

/// What the kernel says about one connection's timers (a line of `/proc/net/tcp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TimerState {
    /// `tr`: 1 retransmission, 2 keepalive, 4 zero-window probe, 0 none.
    timer: u32,
    /// `retrnsmt`: consecutive retransmission timeouts without an acknowledgement.
    retransmits: u32,
    /// `timeout`: unanswered (keepalive or zero-window) probes.
    probes: u32,
}

impl TimerState {
    /// Whether the peer's host has answered nothing for long enough to be given up.
    pub(crate) fn stalled(&self) -> Option<String> {
        match self.timer {
            1 if self.retransmits >= STALL_RETRANSMITS => Some(format!(
                "no acknowledgement from its host for {} retransmissions of unacknowledged \
                 data (at least {} s): host down or network cut",
                self.retransmits,
                stall_seconds(self.retransmits)
            )),
            4 if self.probes >= STALL_RETRANSMITS => Some(format!(
                "no answer from its host to {} zero-window probes: host down or network cut",
                self.probes
            )),
            _ => None,
        }
    }
}

/// The least time `n` consecutive retransmission timeouts take (RTO from 200 ms, doubling).
fn stall_seconds(n: u32) -> u64 {
    (200u64 * ((1u64 << n.min(20)) - 1)) / 1000
}

/// Parses `/proc/net/tcp` (or `tcp6`) text into the timer state of the sockets in `inodes`.
pub(crate) fn parse_proc_net_tcp(text: &str, inodes: &[u64]) -> Vec<(u64, TimerState)> {
    let mut found = Vec::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 10 {
            continue;
        }
        let Ok(inode) = f[9].parse::<u64>() else {
            continue;
        };
        if !inodes.contains(&inode) {
            continue;
        }
        let timer = f[5]
            .split(':')
            .next()
            .and_then(|t| u32::from_str_radix(t, 16).ok());
        let retransmits = u32::from_str_radix(f[6], 16).ok();
        let probes = f[8].parse::<u32>().ok();
        if let (Some(timer), Some(retransmits), Some(probes)) = (timer, retransmits, probes) {
            found.push((
                inode,
                TimerState {
                    timer,
                    retransmits,
                    probes,
                },
            ));
        }
    }
    found
}

impl TcpTransport {
    /// Fails the first open peer whose host has stopped acknowledging (see the module docs).
    /// Without `/proc/net/tcp` it finds nothing and the deadline stays the only limit.
    pub(super) fn check_stalls(&mut self) -> Result<()> {
        self.stall_checked = Instant::now();
        for v6 in [false, true] {
            let inodes: Vec<u64> = self
                .peers
                .iter()
                .flatten()
                .filter(|p| p.v6 == v6 && p.state == PeerState::Open)
                .filter_map(|p| p.inode)
                .collect();
            if inodes.is_empty() {
                continue;
            }
            let file = if v6 {
                "/proc/net/tcp6"
            } else {
                "/proc/net/tcp"
            };
            let Ok(text) = std::fs::read_to_string(file) else {
                continue;
            };
            for (inode, st) in parse_proc_net_tcp(&text, &inodes) {
                let Some(detail) = st.stalled() else { continue };
                let Some(peer) = self
                    .peers
                    .iter()
                    .position(|p| p.as_ref().is_some_and(|p| p.inode == Some(inode)))
                else {
                    continue;
                };
                if let Some(p) = self.peers[peer].as_mut() {
                    p.state = PeerState::Lost(detail.clone());
                }
                return Err(self.lost(peer, "communicator", detail));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Lines as Linux 6.x prints them: an established connection retransmitting (tr 1, 7
    // timeouts), one probing a zero window (tr 4, 2 unanswered probes), and a listener.
    const TEXT: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100E80A:7445 0200E80A:D1C2 01 00040000:00000000 01:00000C80 00000007     0        0 4242 2 0000000000000000 3200 4 30 10 -1
   1: 0100E80A:7445 0300E80A:D1C4 01 00040000:00000000 04:00000C80 00000000     0        2 4343 2 0000000000000000 201 4 30 10 -1
   2: 00000000:7445 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 4444 1 0000000000000000 100 0 0 10 0
";

    #[test]
    fn proc_net_tcp_lines_give_timer_retransmissions_and_probes_of_the_asked_sockets() {
        let got = parse_proc_net_tcp(TEXT, &[4242, 4343]);
        assert_eq!(
            got,
            vec![
                (
                    4242,
                    TimerState {
                        timer: 1,
                        retransmits: 7,
                        probes: 0
                    }
                ),
                (
                    4343,
                    TimerState {
                        timer: 4,
                        retransmits: 0,
                        probes: 2
                    }
                ),
            ]
        );
        assert!(parse_proc_net_tcp(TEXT, &[9]).is_empty());
        assert!(parse_proc_net_tcp("header only\n", &[4242]).is_empty());
    }

    #[test]
    fn a_connection_is_stalled_only_after_seven_unanswered_retransmissions_or_probes() {
        let st = |timer, retransmits, probes| TimerState {
            timer,
            retransmits,
            probes,
        };
        assert!(st(1, 6, 0).stalled().is_none());
        let d = st(1, 7, 0).stalled().expect("stalled");
        assert!(d.contains("at least 25 s"), "{d}");
        assert!(st(4, 0, 6).stalled().is_none());
        assert!(st(4, 0, 7).stalled().is_some());
        // Keepalive is the kernel's own business; no timer is nothing.
        assert!(st(2, 0, 9).stalled().is_none());
        assert!(st(0, 9, 9).stalled().is_none());
    }
}
