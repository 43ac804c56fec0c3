//! Targets over what a peer or a file hands this process outside the bootstrap's messages:
//! the shared-memory segment info ([`shm_seg_info`]), a split's all-gathered record
//! ([`split_record`]), the tune file ([`tune_file`]) and the `/proc` files the transports read
//! ([`proc_files`]).

use std::net::{IpAddr, SocketAddr};

use super::Rng;
use crate::comm::split;
use crate::plan::model::{format_tune_file, parse_tune_file, Costs, Medium};
use crate::transport::shm::{parse_mem_available, parse_proc_stat, SegInfo};
use crate::transport::tcp::stall::parse_proc_net_tcp;
use crate::transport::verbs::cap_ipc_lock_in;

/// Where a peer's shared segment is ([`SegInfo`], 32 bytes, all-gathered at init). Canonical:
/// what decodes (exactly 32 bytes) re-encodes byte for byte.
pub fn shm_seg_info(data: &[u8]) {
    match SegInfo::decode(data) {
        Some(i) => assert_eq!(i.encode(), data, "segment info does not re-encode"),
        None => assert_ne!(data.len(), 32, "32 bytes of segment info refused"),
    }
}

/// A rank's record in [`Communicator::split`](crate::Communicator::split)'s all-gather
/// (colour, key, the group leader's listener; the input's first 34 bytes, zero-padded).
/// Canonical: every record decodes, and re-encodes byte for byte (an IPv4 address travels
/// mapped into IPv6 and comes back as IPv4).
pub fn split_record(data: &[u8]) {
    let mut b = [0u8; split::RECORD];
    let n = data.len().min(split::RECORD);
    b[..n].copy_from_slice(&data[..n]);
    let (colour, key, addr) = split::decode(&b);
    assert_eq!(
        split::encode(colour, key, Some(addr)),
        b,
        "a split record does not re-encode"
    );
}

pub(super) fn split_record_sample(r: &mut dyn Rng) -> Vec<u8> {
    let colour = [i64::MIN, -1, 0, 1, 7, i64::MAX][r.below(6)];
    let key = r.next_u64() as i64 >> r.below(64);
    let addr = (r.below(4) != 0).then(|| SocketAddr::new(super::ip(r), r.next_u64() as u16));
    let b = split::encode(colour, key, addr);
    let (c, k, a) = split::decode(&b);
    assert_eq!((c, k), (colour, key));
    let want = match addr.map(|a| (a.ip(), a.port())) {
        // An IPv4-mapped IPv6 address comes back as IPv4; no address as [::]:0.
        Some((IpAddr::V6(v6), port)) => {
            SocketAddr::new(v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4), port)
        }
        Some((ip, port)) => SocketAddr::new(ip, port),
        None => SocketAddr::new(IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED), 0),
    };
    assert_eq!(a, want, "a split record's address changed");
    b.to_vec()
}

/// The tune file (`dspark tune` writes it; every rank reads it at init), as lossy UTF-8.
/// Checks: no panic (nesting is bounded); what parses has valid constants; written again
/// ([`format_tune_file`]) it parses to the same media and constants, bit for bit.
pub fn tune_file(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(entries) = parse_tune_file(&text) {
        assert!(entries.iter().all(|(_, c)| c.is_valid()), "{entries:?}");
        let again = format_tune_file(&entries, &[("note", text.chars().take(40).collect())]);
        let back = parse_tune_file(&again).expect("a written tune file parses");
        assert_eq!(
            bits(&back),
            bits(&entries),
            "the tune file changed: {again}"
        );
    }
}

fn bits(e: &[(Medium, Costs)]) -> Vec<(Medium, [u64; 4])> {
    e.iter()
        .map(|(m, c)| {
            (
                *m,
                [
                    c.alpha_us.to_bits(),
                    c.beta_us_per_byte.to_bits(),
                    c.gamma_us_per_byte.to_bits(),
                    c.alpha_oversub_us.to_bits(),
                ],
            )
        })
        .collect()
}

pub(super) fn tune_file_sample(r: &mut dyn Rng) -> Vec<u8> {
    let n = r.below(5);
    let entries: Vec<(Medium, Costs)> = (0..n)
        .map(|_| {
            let m = Medium::ALL[r.below(Medium::ALL.len())];
            let x = |r: &mut dyn Rng| (1 + r.below(1 << 20)) as f64 / (1u64 << r.below(40)) as f64;
            let c = Costs {
                alpha_us: x(r),
                beta_us_per_byte: x(r),
                gamma_us_per_byte: x(r),
                alpha_oversub_us: x(r),
            };
            (m, c)
        })
        .collect();
    let note = super::text(r, 30);
    let text = format_tune_file(&entries, &[("measured", note)]);
    let back = parse_tune_file(&text).expect("a written tune file parses");
    assert_eq!(bits(&back), bits(&entries));
    text.into_bytes()
}

/// The `/proc` files the transports parse, on the input as (lossy) UTF-8: a process's
/// `stat` (state and start time: how a shared-memory peer's death is seen), `meminfo`
/// (`MemAvailable`, sizing the shared segments), `status` (`CapEff`: whether the verbs
/// transport's memlock limit applies) and `net/tcp` (retransmission timers: stalled
/// TCP peers; the sockets asked for are the input's bytes 1 to 4 as inode numbers). Checks:
/// no panic; what they find is there: a start time printed in the text, every socket found
/// one asked for, and at most one per line.
pub fn proc_files(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Some((state, start)) = parse_proc_stat(&text) {
        let after = &text[text.rfind(')').expect("a stat line has a ')'") + 1..];
        assert!(after.contains(state), "state {state:?} is not in {after:?}");
        assert!(after.contains(&start.to_string()), "start {start}");
    }
    if let Some(b) = parse_mem_available(&text) {
        assert!(b.is_multiple_of(1024), "{b} bytes");
    }
    if cap_ipc_lock_in(&text) {
        assert!(
            text.contains("CapEff:"),
            "CAP_IPC_LOCK without a CapEff line"
        );
    }
    let inodes: Vec<u64> = data.iter().skip(1).take(4).map(|&b| u64::from(b)).collect();
    let found = parse_proc_net_tcp(&text, &inodes);
    assert!(found.len() <= text.lines().count());
    for (inode, t) in &found {
        assert!(inodes.contains(inode), "inode {inode} was not asked for");
        let _ = t.stalled();
    }
}

pub(super) fn proc_files_sample(r: &mut dyn Rng) -> Vec<u8> {
    match r.below(4) {
        3 => {
            let caps = r.next_u64() >> r.below(64);
            let text = format!("Name:\tdspark\nCapInh:\t0000000000000000\nCapEff:\t{caps:016x}\n");
            assert_eq!(cap_ipc_lock_in(&text), caps & (1 << 14) != 0);
            text.into_bytes()
        }
        0 => {
            let comm = ["bash", "a) b", "x (y) z", "", "python3"][r.below(5)];
            let state = ['R', 'S', 'Z', 'D', 'T'][r.below(5)];
            let mut f: Vec<String> = (0..50)
                .map(|i| (i * 7 + r.below(100)).to_string())
                .collect();
            let start = r.next_u64() >> r.below(64);
            f[18] = start.to_string(); // field 22 (f[0] is field 4)
            let line = format!("{} ({comm}) {state} {}\n", r.below(1 << 22), f.join(" "));
            assert_eq!(parse_proc_stat(&line), Some((state, start)));
            line.into_bytes()
        }
        1 => {
            let kib = r.next_u64() >> (10 + r.below(54));
            let text = format!(
                "MemTotal:       32768000 kB\nMemFree:         1000 kB\nMemAvailable:   {kib} kB\n"
            );
            assert_eq!(parse_mem_available(&text), Some(kib * 1024));
            text.into_bytes()
        }
        _ => {
            let mut text = String::from(
                "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n",
            );
            for _ in 0..1 + r.below(4) {
                text += &format!(
                    "   0: 0100007F:{:04X} 0100007F:9C40 01 00000000:00000000 {:02X}:{:08X} {:08X}  1000        {} {} 1 0000000000000000 20 4 30 10 -1\n",
                    r.below(1 << 16),
                    r.below(5),
                    r.below(1 << 20),
                    r.below(16),
                    r.below(10),
                    [32, 115, 108, r.below(256)][r.below(4)],
                );
            }
            text.into_bytes()
        }
    }
}
