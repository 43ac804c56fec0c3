//! Fuzz targets (`testing` feature only; not part of the library's API): the decoders that
//! read what another process sent — the bootstrap's handshake messages, the frame header, the
//! verbs connection blob, clear-to-send entries, immediates and work-request ids, the cost model
//! rank 0 broadcasts at init, the shared-memory segment info, a split's record, TCPStore
//! replies — or a file holds — the tune file, `/proc` files — and the parsers of the
//! configuration; and, stateful, the TCP transport's frame reassembly and the data listener's
//! message reader fed streams split at random points (`tests/fuzz.rs` lists them all).
//!
//! Each target is a function of arbitrary bytes that panics only when a property fails:
//!
//! - a decoder never panics, whatever the input (a panicking decoder fails the target by
//!   itself);
//! - what decodes re-encodes to the same bytes where the encoding is canonical, and otherwise
//!   to bytes that decode to the same value;
//! - a configuration that parses is valid.
//!
//! That decoders allocate nothing beyond their input's size is checked by the harnesses, which
//! count allocations (`tests/fuzz.rs`). The same targets run under a coverage-guided fuzzer
//! (`fuzz/`, cargo-afl) and, with structure-aware random inputs, in CI (`tests/fuzz.rs`).
//! [`sample`](crate::internals::fuzzing::sample) makes a valid input of a target from random
//! numbers, as a seed to mutate.

#![forbid(unsafe_code)]

#[path = "fuzzing/files.rs"]
mod files;
#[path = "fuzzing/streams.rs"]
mod streams;

pub use crate::transport::shm::fuzz::shm_ring;
pub use files::{proc_files, shm_seg_info, split_record, tune_file};
pub use streams::{door_messages, store_replies, tcp_frames};

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::bootstrap::msg::{self, Hello, PeerHello, Reject, Reply};
use crate::bootstrap::PeerInfo;
use crate::comm::setup::crowd::{Seat, MAX_CPU};
use crate::comm::setup::offer::{mode_of, Confirm, SegOffer, ShmOffer, VerbsOffer};
use crate::config::{join_host_port, parse_size, split_host_port, Config, TransportChoice};
use crate::path::PathPolicy;
use crate::plan::model::{self, CostModel, Costs, Medium};
use crate::plan::Algorithm;
use crate::transport::verbs::parse_device;
use crate::transport::verbs::wire::{
    split_wr_id, wr_id, Blob, Cts, DirectInfo, DirectKind, Imm, LinkLayer, PortAddr, QpInfo,
    CTS_LEN,
};
use crate::transport::{FrameHeader, FrameKind, HEADER_LEN};

/// A fuzz target: checks the properties on one input.
pub type Target = fn(&[u8]);

/// Every target, by name.
pub const TARGETS: &[(&str, Target)] = &[
    ("bootstrap_hello", bootstrap_hello),
    ("bootstrap_peer_hello", bootstrap_peer_hello),
    ("bootstrap_reply", bootstrap_reply),
    ("bootstrap_proofs", bootstrap_proofs),
    ("bootstrap_blobs", bootstrap_blobs),
    ("frame_header", frame_header),
    ("verbs_blob", verbs_blob),
    ("verbs_words", verbs_words),
    ("plan_cost_model", plan_cost_model),
    ("config_env", config_env),
    ("config_values", config_values),
    ("setup_shm_offer", setup_shm_offer),
    ("setup_verbs_offer", setup_verbs_offer),
    ("setup_confirm", setup_confirm),
    ("setup_seat", setup_seat),
    ("shm_seg_info", shm_seg_info),
    ("split_record", split_record),
    ("tune_file", tune_file),
    ("proc_files", proc_files),
    ("tcp_frames", tcp_frames),
    ("door_messages", door_messages),
    ("store_replies", store_replies),
    ("shm_ring", shm_ring),
];

/// The stateful targets, which run each input over a loopback connection (a fresh
/// transport, or a TCPStore client's connection, per input): the harness gives them this
/// many times fewer inputs than the others.
pub const STATEFUL: &[&str] = &["tcp_frames", "door_messages", "store_replies", "shm_ring"];

/// What target `name` allocates at once whatever its input, beyond what the input's size
/// justifies: the TCP transport's 256 KiB receive buffer (`tcp_frames`); a TCPStore client
/// sizes a GET reply's buffer by the announced length up to 1 MiB before the bytes arrive
/// (`store_replies`; bounded, by design: larger values grow as they arrive).
pub fn fixed_allocation(name: &str) -> usize {
    match name {
        "tcp_frames" => 320 << 10,
        "store_replies" => (1 << 20) + (64 << 10),
        _ => 0,
    }
}

/// The target called `name`.
pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
}

/// The input's first byte, and the rest (`(0, [])` for an empty input).
fn split_first(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((&b, rest)) => (b, rest),
        None => (0, &[]),
    }
}

// ------------------------------------------------------------------------- bootstrap

/// A rank's hello to rank 0 (canonical: what decodes re-encodes byte for byte).
pub fn bootstrap_hello(data: &[u8]) {
    if let Ok(h) = Hello::decode(data) {
        assert_eq!(h.encode().0, data, "hello does not re-encode to its bytes");
    }
}

/// A data connection's hello (canonical).
pub fn bootstrap_peer_hello(data: &[u8]) {
    if let Ok(h) = PeerHello::decode(data) {
        assert_eq!(
            h.encode().0,
            data,
            "peer hello does not re-encode to its bytes"
        );
    }
}

/// Rank 0's replies: challenge, welcome (the rank table) or reject. The first byte is the
/// world size the reader expects.
pub fn bootstrap_reply(data: &[u8]) {
    let (w, m) = split_first(data);
    let world = usize::from(w);
    match Reply::decode(m, world) {
        Ok(Reply::Challenge(n)) => {
            assert_eq!(Reply::encode_challenge(&n).0, m);
        }
        Ok(Reply::Welcome { peers, signed, tag }) => {
            // The whole table, or a partial one (rank 0's links of a rank) in rank order.
            assert!(peers.len() <= world);
            assert!(peers.windows(2).all(|w| w[0].rank < w[1].rank));
            assert!(peers.iter().all(|p| p.rank < world));
            if peers.len() == world {
                assert!(peers.iter().enumerate().all(|(i, p)| p.rank == i));
            }
            assert_eq!(signed + tag.len(), m.len());
            assert_eq!(&m[signed..], &tag);
            // Addresses have several spellings: the re-encoding decodes to the same table.
            let again = msg::encode_welcome(&peers).raw(&tag).0;
            match Reply::decode(&again, world) {
                Ok(Reply::Welcome {
                    peers: p2, tag: t2, ..
                }) => assert!(p2 == peers && t2 == tag, "welcome changed on re-encoding"),
                other => panic!("a re-encoded welcome decodes as {other:?}"),
            }
        }
        Ok(Reply::Reject(r)) => {
            assert_eq!(Reply::decode(&r.encode().0, world), Ok(Reply::Reject(r)));
        }
        Err(_) => {}
    }
}

/// Proofs, a data connection's challenge and acknowledgement (canonical where they decode;
/// a reject decodes leniently and re-encodes to the same reject).
pub fn bootstrap_proofs(data: &[u8]) {
    for kind in [msg::MSG_PROOF, msg::MSG_PEER_PROOF] {
        match msg::decode_proof(data, kind) {
            Ok(Ok(tag)) => assert_eq!(msg::encode_proof(kind, &tag).0, data),
            Ok(Err(r)) => assert_eq!(msg::decode_proof(&r.encode().0, kind), Ok(Err(r.clone()))),
            Err(_) => {}
        }
    }
    match msg::decode_peer_challenge(data) {
        Ok(Ok((n, t))) => assert_eq!(msg::encode_peer_challenge(&n, &t).0, data),
        Ok(Err(r)) => assert_eq!(
            msg::decode_peer_challenge(&r.encode().0),
            Ok(Err(r.clone()))
        ),
        Err(_) => {}
    }
    if let Ok(Ok(())) = msg::decode_peer_ack(data) {
        assert_eq!(data, [msg::MSG_PEER_ACK]);
    }
}

/// [`crate::bootstrap::Bootstrap::all_gather`]'s blobs: one rank's, and everybody's (the
/// first two bytes are the world size the reader expects).
pub fn bootstrap_blobs(data: &[u8]) {
    if let Ok(b) = msg::decode_blob(data) {
        assert_eq!(msg::encode_blob(&b).0, data);
    }
    let (world, m) = if data.len() >= 2 {
        (
            usize::from(u16::from_le_bytes([data[0], data[1]])),
            &data[2..],
        )
    } else {
        (0, data)
    };
    if let Ok(all) = msg::decode_blobs(m, world) {
        assert_eq!(all.len(), world);
        assert_eq!(msg::encode_blobs(&all).0, m);
    }
}

// ------------------------------------------------------------------------- transport

/// The 32-byte frame header every TCP and verbs frame starts with (canonical). Shorter
/// inputs are padded with zeros.
pub fn frame_header(data: &[u8]) {
    let mut b = [0u8; HEADER_LEN];
    let n = data.len().min(HEADER_LEN);
    b[..n].copy_from_slice(&data[..n]);
    if let Ok(h) = FrameHeader::decode(&b) {
        assert_eq!(
            h.encode(),
            b,
            "frame header does not re-encode to its bytes"
        );
    }
}

/// The verbs connection blob exchanged at init. Not canonical (a flag byte reads any non-zero
/// value as true, strings are read lossily): what decodes re-encodes to the same blob.
pub fn verbs_blob(data: &[u8]) {
    if let Ok(b) = Blob::decode(data) {
        assert_eq!(
            Blob::decode(&b.encode()).as_ref(),
            Ok(&b),
            "verbs blob changed on re-encoding"
        );
    }
}

/// Clear-to-send entries (the first 32 bytes, zero-padded), immediates (the first 4) and
/// work-request ids (the first 8).
pub fn verbs_words(data: &[u8]) {
    let mut c = [0u8; CTS_LEN];
    let n = data.len().min(CTS_LEN);
    c[..n].copy_from_slice(&data[..n]);
    if let Some(e) = Cts::decode(&c) {
        assert_eq!(
            e.encode(),
            c,
            "clear-to-send entry does not re-encode to its bytes"
        );
    }
    let mut w = [0u8; 8];
    let n = data.len().min(8);
    w[..n].copy_from_slice(&data[..n]);
    let v = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
    let imm = Imm::decode(v);
    assert_eq!(
        Imm::decode(imm.encode()),
        imm,
        "immediate changed on re-encoding"
    );
    // Only a control immediate has bits (its 4 sequence bits) that nothing reads.
    let read = if matches!(imm, Imm::Ctrl { .. }) {
        v & !(0xf << 26)
    } else {
        v
    };
    assert_eq!(imm.encode(), read);
    let id = u64::from_le_bytes(w);
    let (peer, kind, index) = split_wr_id(id);
    use crate::transport::verbs::wire::{INDEX_BITS, MAX_PEERS};
    assert!(peer < MAX_PEERS && index < 1 << INDEX_BITS);
    assert_eq!(split_wr_id(wr_id(peer, kind, index)), (peer, kind, index));
}

// ------------------------------------------------------------------------- plan

/// The cost model rank 0 broadcasts at init ([`model::decode`]). Not canonical (the source is
/// read lossily as UTF-8): what decodes re-encodes to bytes that decode to the same model, bit
/// for bit, and source; and to the input itself where its source is UTF-8.
pub fn plan_cost_model(data: &[u8]) {
    if let Some((m, source)) = model::decode(data) {
        let again = model::encode(&m, &source);
        // The source follows the link: its tag at byte 65 (0: none, 1: 16 bytes of α and β).
        let source_at = if data.get(65) == Some(&1) { 82 } else { 66 };
        if data
            .get(source_at..)
            .is_some_and(|s| std::str::from_utf8(s).is_ok())
        {
            assert_eq!(
                again, data,
                "the cost model does not re-encode to its bytes"
            );
        }
        let (m2, source2) = model::decode(&again).expect("a re-encoded cost model decodes");
        assert_eq!(source2, source);
        assert_eq!(
            model::encode(&m2, &source2),
            again,
            "the cost model decodes to another model"
        );
    }
}

// ------------------------------------------------------------------------- configuration

/// The variables [`config_env`] draws names from: every one `Config::from_lookup` and the
/// transports read.
pub const ENV_NAMES: &[&str] = &[
    "DSPARK_RANK",
    "DSPARK_WORLD_SIZE",
    "RANK",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_ID",
    "SLURM_STEPID",
    "DSPARK_ROOT_ADDR",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DSPARK_RENDEZVOUS",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_JOB_ID",
    "DSPARK_TIMEOUT",
    "DSPARK_TRANSPORT",
    "DSPARK_SOCKET_IFNAME",
    "DSPARK_IB_DEVICE",
    "DSPARK_IB_GID_INDEX",
    "DSPARK_JOB_TOKEN",
    "DSPARK_ALGO",
    "DSPARK_CHUNK_BYTES",
    "DSPARK_SOCKET_BUFFER",
    "DSPARK_DATA_PATH",
    "DSPARK_CUDA_DEVICE",
    "LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "SLURM_LOCALID",
    "DSPARK_EMULATE_GPU_DIRECT",
    "DSPARK_SPIN_US",
    "DSPARK_IB_SLOTS",
    "DSPARK_IB_SLOT_BYTES",
    "DSPARK_IB_SPIN_US",
    "DSPARK_IB_ZERO_COPY_MIN",
    "DSPARK_IB_TIMEOUT",
    "DSPARK_IB_RETRY_CNT",
    "DSPARK_IB_RNR_RETRY",
    "DSPARK_IB_SL",
    "DSPARK_IB_TC",
    "DSPARK_CACHE_DIR",
];

/// An environment from bytes: a sequence of (name, value) records. A record is a name byte
/// (an index into [`ENV_NAMES`]; past its end, a raw name of the next `byte % 16` bytes
/// follows), a length byte and that many bytes of value (read lossily as UTF-8).
pub fn env_of(mut data: &[u8]) -> HashMap<String, String> {
    let mut env = HashMap::new();
    let take = |n: usize, d: &mut &[u8]| -> Vec<u8> {
        let n = n.min(d.len());
        let (a, b) = d.split_at(n);
        *d = b;
        a.to_vec()
    };
    while let Some((&k, rest)) = data.split_first() {
        data = rest;
        let name = match ENV_NAMES.get(usize::from(k)) {
            Some(n) => n.to_string(),
            None => {
                let n = usize::from(k % 16);
                String::from_utf8_lossy(&take(n, &mut data)).into_owned()
            }
        };
        let len = data.first().map_or(0, |&b| usize::from(b));
        data = data.get(1..).unwrap_or(&[]);
        let value = String::from_utf8_lossy(&take(len, &mut data)).into_owned();
        env.insert(name, value);
    }
    env
}

/// The inverse of [`env_of`] for names of [`ENV_NAMES`] and values under 256 bytes.
pub fn env_bytes(vars: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (k, v) in vars {
        let Some(i) = ENV_NAMES.iter().position(|n| n == k) else {
            continue;
        };
        let v = &v.as_bytes()[..v.len().min(255)];
        out.push(i as u8);
        out.push(v.len() as u8);
        out.extend_from_slice(v);
    }
    out
}

/// `Config::from_lookup` over the environment [`env_of`] makes: it never panics, and a
/// configuration it returns is valid.
pub fn config_env(data: &[u8]) {
    let env = env_of(data);
    if let Ok(c) = Config::from_lookup(|k| env.get(k).cloned()) {
        assert!(
            c.validate().is_ok(),
            "from_lookup returned an invalid {c:?}"
        );
        assert!(c.rank < c.world_size && !c.timeout.is_zero());
    }
}

/// The small parsers, on the input as (lossy) UTF-8: sizes, `host:port`, the transport,
/// verbs device, algorithm and data path names. What parses, printed again, parses to the
/// same value.
pub fn config_values(data: &[u8]) {
    let s = String::from_utf8_lossy(data);
    let s = s.as_ref();
    if let Some(n) = parse_size(s) {
        assert_eq!(parse_size(&n.to_string()), Some(n));
    }
    if let Ok((host, port)) = split_host_port(s) {
        assert!(!host.is_empty() && port != 0);
        // Hosts that are names or addresses survive being joined again; not strings with
        // brackets in them, nor a bracketed host with blanks at its ends (`[ h]:1`, whose
        // blank the join leaves unbracketed and the split trims).
        if !host.contains(['[', ']']) && host.trim() == host {
            assert_eq!(
                split_host_port(&join_host_port(&host, port)),
                Ok((host.clone(), port)),
                "{s:?}"
            );
        }
    }
    let _ = join_host_port(s, 1);
    if let Some(t) = TransportChoice::parse(s) {
        assert_eq!(TransportChoice::parse(&t.to_string()), Some(t));
    }
    if let Ok((name, port)) = parse_device(s) {
        assert!(!name.is_empty());
        let again = match port {
            Some(p) => format!("{name}:{p}"),
            None => name.clone(),
        };
        assert_eq!(parse_device(&again), Ok((name, port)), "{s:?}");
    }
    if let Some(a) = Algorithm::from_name(s) {
        assert_eq!(Algorithm::from_name(a.name()), Some(a));
    }
    if let Ok(p) = s.parse::<PathPolicy>() {
        assert_eq!(p.to_string().parse::<PathPolicy>().ok(), Some(p));
    }
}

// ------------------------------------------------------------------------- samples

/// xorshift64*: small, fast, reproducible (seed it with an odd number). The harnesses'
/// (`tests/fuzz.rs`, `fuzz/`) and the stateful targets' source of randomness.
#[derive(Clone, Debug)]
pub struct XorShift(pub u64);

impl Rng for XorShift {
    fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// A source of random numbers for [`sample`].
pub trait Rng {
    /// The next 64 random bits.
    fn next_u64(&mut self) -> u64;
    /// A number below `n` (0 when `n` is 0).
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
    /// Random bytes.
    fn fill(&mut self, b: &mut [u8]) {
        for x in b {
            *x = self.next_u64() as u8;
        }
    }
}

fn nonce(r: &mut dyn Rng) -> [u8; 32] {
    let mut n = [0u8; 32];
    r.fill(&mut n);
    n
}

fn text(r: &mut dyn Rng, max: usize) -> String {
    const WORDS: &[&str] = &[
        "node-1",
        "gpu07.cluster",
        "localhost",
        "é",
        "日本",
        "",
        "mlx5_0",
        "rxe0",
        "a b",
        "x:y",
    ];
    if r.below(3) == 0 {
        let n = r.below(max + 1);
        (0..n)
            .map(|_| char::from(b' ' + r.below(95) as u8))
            .collect()
    } else {
        WORDS[r.below(WORDS.len())].to_string()
    }
}

fn ip(r: &mut dyn Rng) -> IpAddr {
    if r.below(2) == 0 {
        IpAddr::V4(Ipv4Addr::from(r.next_u64() as u32))
    } else {
        IpAddr::V6(Ipv6Addr::from(
            u128::from(r.next_u64()) << 64 | u128::from(r.next_u64()),
        ))
    }
}

fn edgy(r: &mut dyn Rng) -> u64 {
    const EDGES: [u64; 8] = [0, 1, 2, 0xff, 0xffff, 0xffff_ffff, u64::MAX, 1 << 40];
    if r.below(2) == 0 {
        EDGES[r.below(EDGES.len())]
    } else {
        r.next_u64()
    }
}

fn hello_value(r: &mut dyn Rng) -> Hello {
    Hello {
        world: edgy(r) as u32,
        rank: edgy(r) as u32,
        job: edgy(r),
        data_port: edgy(r) as u16,
        host: text(r, 40),
        segment: edgy(r),
        token: r.below(2) == 0,
        nonce: nonce(r),
        pid: edgy(r) as u32,
    }
}

fn peer_hello_value(r: &mut dyn Rng) -> PeerHello {
    PeerHello {
        job: edgy(r),
        world: edgy(r) as u32,
        from: edgy(r) as u32,
        to: edgy(r) as u32,
        token: r.below(2) == 0,
        nonce: nonce(r),
    }
}

/// A reply of rank 0 to a rank of a `world`-rank job, and its encoding.
fn reply_value(r: &mut dyn Rng, world: usize) -> (Reply, Vec<u8>) {
    match r.below(3) {
        0 => {
            let n = nonce(r);
            (Reply::Challenge(n), Reply::encode_challenge(&n).0)
        }
        1 => {
            // The whole table, or a partial one (rank 0, the rank and its links).
            let partial = r.below(2) == 0;
            let ranks: Vec<usize> = (0..world)
                .filter(|&q| !partial || q == 0 || r.below(2) == 0)
                .collect();
            let peers: Vec<PeerInfo> = ranks
                .into_iter()
                .map(|rank| PeerInfo {
                    rank,
                    host: text(r, 20),
                    addr: SocketAddr::new(ip(r), edgy(r) as u16),
                    pid: edgy(r) as u32,
                })
                .collect();
            let tag = nonce(r);
            let m = msg::encode_welcome(&peers).raw(&tag).0;
            let signed = m.len() - tag.len();
            (Reply::Welcome { peers, signed, tag }, m)
        }
        _ => {
            let rej = Reject {
                class: r.below(4) as u8,
                var: text(r, 20),
                why: text(r, 60),
            };
            let m = rej.encode().0;
            (Reply::Reject(rej), m)
        }
    }
}

fn blobs_value(r: &mut dyn Rng) -> Vec<Vec<u8>> {
    (0..r.below(6))
        .map(|_| {
            let mut b = vec![0u8; r.below(40)];
            r.fill(&mut b);
            b
        })
        .collect()
}

fn header_value(r: &mut dyn Rng) -> FrameHeader {
    let kinds = [FrameKind::Data, FrameKind::Abort, FrameKind::Bye];
    FrameHeader {
        kind: kinds[r.below(3)],
        coll: r.next_u64() as u8,
        dtype: r.next_u64() as u8,
        op: r.next_u64() as u8,
        root: edgy(r) as u32,
        len: edgy(r) as u32,
        seq: edgy(r),
        count: edgy(r),
    }
}

fn cost_model_value(r: &mut dyn Rng) -> CostModel {
    // Plausible constants and sizes, or any bits.
    let f = |r: &mut dyn Rng, typical: f64| {
        if r.below(4) == 0 {
            f64::from_bits(edgy(r))
        } else {
            typical * (1.0 + r.below(1000) as f64 / 100.0)
        }
    };
    let costs = Costs {
        alpha_us: f(r, 1.0),
        beta_us_per_byte: f(r, 1e-4),
        gamma_us_per_byte: f(r, 1e-4),
        alpha_oversub_us: f(r, 9.0),
    };
    CostModel {
        medium: Medium::ALL[r.below(Medium::ALL.len())],
        costs,
        segment_bytes: edgy(r) as usize,
        local_ranks: edgy(r) as usize,
        cores: edgy(r) as usize,
        hier_min_bytes: edgy(r) as usize,
        link: (r.below(2) == 0).then(|| model::Link {
            alpha_us: f(r, 50.0),
            beta_us_per_byte: f(r, 8e-3),
        }),
    }
}

fn cts_value(r: &mut dyn Rng) -> Cts {
    Cts {
        seq: edgy(r),
        addr: edgy(r),
        rkey: edgy(r) as u32,
        size: edgy(r) as u32,
    }
}

/// Whether `name` is the name of a target of messages (whose valid inputs [`round_trip`]
/// makes), not of the configuration.
pub fn is_message_target(name: &str) -> bool {
    !name.starts_with("config_")
}

/// A valid input of one of the targets in `files` and `streams` (empty for other names).
fn more_samples(name: &str, r: &mut dyn Rng) -> Vec<u8> {
    match name {
        "shm_seg_info" => {
            let v = shm_offer_seg(r);
            let b = v.encode();
            assert_eq!(crate::transport::shm::SegInfo::decode(&b), Some(v));
            b
        }
        "split_record" => files::split_record_sample(r),
        "tune_file" => files::tune_file_sample(r),
        "proc_files" => files::proc_files_sample(r),
        "tcp_frames" => streams::tcp_frames_sample(r),
        "door_messages" => streams::door_messages_sample(r),
        "store_replies" => streams::store_replies_sample(r),
        "shm_ring" => crate::transport::shm::fuzz::shm_ring_sample(r),
        _ => Vec::new(),
    }
}

/// Makes a random valid value for message target `name`, encodes it, decodes that, and
/// panics unless the result is the value. Returns the encoding (a seed to mutate).
pub fn round_trip(name: &str, r: &mut dyn Rng) -> Vec<u8> {
    match name {
        "setup_shm_offer" => {
            let v = shm_offer_value(r);
            let b = v.encode();
            // A boot id is sent cut to 255 bytes and read lossily; these are shorter.
            assert_eq!(ShmOffer::decode(&b), v);
            b
        }
        "setup_verbs_offer" => {
            let v = VerbsOffer {
                mode: mode_of(r.below(5) as u8),
                blob: verbs_sample(r),
            };
            let rank = r.below(256) as u8;
            let b = v.encode();
            assert_eq!(VerbsOffer::decode(usize::from(rank), &b), v);
            let mut out = vec![rank];
            out.extend_from_slice(&b);
            out
        }
        "setup_seat" => {
            let cpus = (0..r.below(6))
                .map(|_| {
                    let a = r.below(MAX_CPU / 2);
                    (a, a + r.below(40))
                })
                .collect();
            let quota = (r.below(2) == 0).then(|| crate::comm::setup::quota::Quota {
                cgroup: r.below(usize::MAX) as u64,
                quota_us: 1 + r.below(1 << 30) as u64,
                period_us: 1 + r.below(1 << 20) as u64,
            });
            let v = Seat {
                quota,
                ..Seat::new(text(r, 40), cpus)
            };
            let b = v.encode();
            assert_eq!(Seat::decode(&b), v);
            b
        }
        "setup_confirm" => {
            let v = if r.below(2) == 0 {
                Confirm::Ok
            } else {
                Confirm::Failed(text(r, 80))
            };
            let b = v.encode();
            assert_eq!(Confirm::decode(&b), v);
            b
        }
        "bootstrap_hello" => {
            let v = hello_value(r);
            let b = v.encode().0;
            assert_eq!(Hello::decode(&b), Ok(v));
            b
        }
        "bootstrap_peer_hello" => {
            let v = peer_hello_value(r);
            let b = v.encode().0;
            assert_eq!(PeerHello::decode(&b), Ok(v));
            b
        }
        "bootstrap_reply" => {
            let world = r.below(9);
            let (v, m) = reply_value(r, world);
            assert_eq!(Reply::decode(&m, world).as_ref(), Ok(&v));
            let mut out = vec![world as u8];
            out.extend_from_slice(&m);
            out
        }
        "bootstrap_proofs" => {
            let (n, t) = (nonce(r), nonce(r));
            let kind = [msg::MSG_PROOF, msg::MSG_PEER_PROOF][r.below(2)];
            let proof = msg::encode_proof(kind, &t).0;
            assert_eq!(msg::decode_proof(&proof, kind), Ok(Ok(t)));
            let ch = msg::encode_peer_challenge(&n, &t).0;
            assert_eq!(msg::decode_peer_challenge(&ch), Ok(Ok((n, t))));
            assert_eq!(msg::decode_peer_ack(&[msg::MSG_PEER_ACK]), Ok(Ok(())));
            vec![proof, ch, vec![msg::MSG_PEER_ACK]].swap_remove(r.below(3))
        }
        "bootstrap_blobs" => {
            let all = blobs_value(r);
            let m = msg::encode_blobs(&all).0;
            assert_eq!(msg::decode_blobs(&m, all.len()).as_ref(), Ok(&all));
            if let Some(one) = all.first() {
                assert_eq!(msg::decode_blob(&msg::encode_blob(one).0).as_ref(), Ok(one));
            }
            let mut out = (all.len() as u16).to_le_bytes().to_vec();
            out.extend_from_slice(&m);
            out
        }
        "frame_header" => {
            let v = header_value(r);
            let b = v.encode();
            assert_eq!(FrameHeader::decode(&b), Ok(v));
            b.to_vec()
        }
        "verbs_blob" => {
            let v = verbs_sample(r);
            let b = v.encode();
            assert_eq!(Blob::decode(&b).as_ref(), Ok(&v));
            b
        }
        "verbs_words" => {
            let c = cts_value(r);
            let b = c.encode();
            assert_eq!(Cts::decode(&b), Some(c));
            let imm = match r.below(4) {
                0 => Imm::Data {
                    seq: r.below(16) as u8,
                    len: r.below(1 << 26) as u32,
                },
                1 => Imm::Cts {
                    seq: r.below(1 << 30) as u32,
                },
                2 => Imm::Ctrl {
                    len: r.below(1 << 26) as u32,
                },
                _ => Imm::Direct {
                    seq: r.below(16) as u8,
                    len: r.below(1 << 26) as u32,
                },
            };
            assert_eq!(Imm::decode(imm.encode()), imm);
            let kinds = [
                crate::transport::verbs::wire::WrKind::Data,
                crate::transport::verbs::wire::WrKind::Cts,
                crate::transport::verbs::wire::WrKind::Ctrl,
                crate::transport::verbs::wire::WrKind::Recv,
            ];
            use crate::transport::verbs::wire::{INDEX_BITS, MAX_PEERS};
            let (p, k, i) = (
                r.below(MAX_PEERS),
                kinds[r.below(4)],
                r.next_u64() >> (64 - INDEX_BITS),
            );
            assert_eq!(split_wr_id(wr_id(p, k, i)), (p, k, i));
            let mut out = b.to_vec();
            if r.below(2) == 0 {
                out[..4].copy_from_slice(&imm.encode().to_le_bytes());
            }
            out
        }
        "plan_cost_model" => {
            let (m, source) = (cost_model_value(r), text(r, 60));
            let b = model::encode(&m, &source);
            let (back, back_source) = model::decode(&b).expect("an encoded cost model decodes");
            assert_eq!(back_source, source);
            // Bit for bit (a NaN constant is not equal to itself).
            assert_eq!(model::encode(&back, &back_source), b);
            assert_eq!(back.costs.alpha_us.to_bits(), m.costs.alpha_us.to_bits());
            assert_eq!(
                (
                    back.medium,
                    back.segment_bytes,
                    back.local_ranks,
                    back.cores,
                    back.hier_min_bytes
                ),
                (
                    m.medium,
                    m.segment_bytes,
                    m.local_ranks,
                    m.cores,
                    m.hier_min_bytes
                )
            );
            b
        }
        n => more_samples(n, r),
    }
}

/// A plausible input of configuration target `name` (mostly valid settings, some not).
pub fn sample(name: &str, r: &mut dyn Rng) -> Vec<u8> {
    match name {
        "config_env" => {
            const VALUES: &[&str] = &[
                "0",
                "1",
                "2",
                "3",
                "-1",
                "18446744073709551616",
                "127.0.0.1",
                "29500",
                "127.0.0.1:29500",
                "[::1]:1",
                "host:0",
                "True",
                "false",
                "store",
                "listen",
                "tcp",
                "verbs",
                "auto",
                "ring",
                "tree",
                "hier",
                "64",
                "63",
                "1G",
                "2G",
                "512K",
                "0.5",
                "1e308",
                "NaN",
                "inf",
                "mlx5_0:1",
                "gpu-direct",
                "host_staged",
                " ",
                "é",
                "1\u{0}",
            ];
            let n = r.below(12);
            let mut vars = vec![("DSPARK_RANK", "0"), ("DSPARK_WORLD_SIZE", "2")];
            if r.below(2) == 0 {
                vars.push(("DSPARK_ROOT_ADDR", "127.0.0.1:29500"));
            }
            for _ in 0..n {
                vars.push((
                    ENV_NAMES[r.below(ENV_NAMES.len())],
                    VALUES[r.below(VALUES.len())],
                ));
            }
            env_bytes(&vars)
        }
        "config_values" => {
            const VALUES: &[&str] = &[
                "64K",
                "1MiB",
                "2gb",
                "12",
                " 7 ",
                "18446744073709551615K",
                "host:80",
                "[::1]:8080",
                "[::1]80",
                "a:b:c",
                ":1",
                "h:",
                "h:65536",
                "tcp",
                "IB",
                "mlx5_0:1",
                "mlx5_0:0",
                "dev:",
                "ring",
                "RD",
                "binomial-tree",
                "gdr",
                "host_staged",
                "K",
                "KiB",
                "é:1",
                "ßK",
            ];
            VALUES[r.below(VALUES.len())].as_bytes().to_vec()
        }
        n => round_trip(n, r),
    }
}

// ------------------------------------------------------------------------- setup

/// A rank's shared-memory offer in the transport negotiation. Total (every input decodes);
/// not canonical (reasons are read lossily, a boot id is cut to 255 bytes): what decodes
/// re-encodes to bytes that decode to the same offer.
pub fn setup_shm_offer(data: &[u8]) {
    let o = ShmOffer::decode(data);
    assert_eq!(
        ShmOffer::decode(&o.encode()),
        o,
        "shm offer changed on re-encoding"
    );
}

/// A rank's verbs offer (the first input byte is the sender's rank). Total: an unreadable blob
/// is an incapable offer naming the rank, which re-encodes to itself.
pub fn setup_verbs_offer(data: &[u8]) {
    let (rank, rest) = split_first(data);
    let o = VerbsOffer::decode(usize::from(rank), rest);
    assert_eq!(
        VerbsOffer::decode(usize::from(rank), &o.encode()),
        o,
        "verbs offer changed on re-encoding"
    );
}

/// A rank's confirmation of the negotiation's second round. Total.
pub fn setup_confirm(data: &[u8]) {
    let c = Confirm::decode(data);
    assert_eq!(Confirm::decode(&c.encode()), c, "confirmation changed");
}

/// A rank's seat (its kernel's boot id and allowed CPUs, all-gathered at init). Total, and
/// never more than [`MAX_CPU`] CPUs whatever the text; what decodes re-encodes to itself.
pub fn setup_seat(data: &[u8]) {
    let s = Seat::decode(data);
    assert!(
        s.cpus.iter().all(|&(a, b)| a <= b && b < MAX_CPU),
        "a range out of bounds"
    );
    assert!(
        s.cpus.windows(2).all(|w| w[0].1 + 1 < w[1].0),
        "ranges not sorted, disjoint and apart"
    );
    assert_eq!(Seat::decode(&s.encode()), s, "seat changed on re-encoding");
}

fn shm_offer_value(r: &mut dyn Rng) -> ShmOffer {
    let seg = match r.below(3) {
        0 => SegOffer::Incapable(text(r, 60)),
        1 => SegOffer::Malformed,
        _ => SegOffer::Capable {
            boot_id: text(r, 40),
            info: shm_offer_seg(r),
        },
    };
    ShmOffer {
        mode: mode_of(r.below(5) as u8),
        seg,
    }
}

fn shm_offer_seg(r: &mut dyn Rng) -> crate::transport::shm::SegInfo {
    crate::transport::shm::SegInfo {
        pid: edgy(r) as u32,
        fd: edgy(r) as u32,
        len: edgy(r),
        ring: edgy(r),
        nonce: r.next_u64(),
    }
}

fn verbs_sample(r: &mut dyn Rng) -> Blob {
    if r.below(4) == 0 {
        return Blob::Incapable {
            reason: text(r, 80),
        };
    }
    let direct = match r.below(3) {
        0 => DirectInfo::None,
        1 => DirectInfo::Region {
            kind: [
                DirectKind::HostEmulated,
                DirectKind::DmaBuf,
                DirectKind::PeerMem,
            ][r.below(3)],
            addr: edgy(r),
            rkey: edgy(r) as u32,
            slot_bytes: edgy(r) as u32,
        },
        _ => DirectInfo::Unavailable(text(r, 60)),
    };
    let mut gid = [0u8; 16];
    r.fill(&mut gid);
    Blob::Capable {
        device: text(r, 20),
        port: PortAddr {
            link: if r.below(2) == 0 {
                LinkLayer::InfiniBand
            } else {
                LinkLayer::Ethernet
            },
            lid: edgy(r) as u16,
            gid,
            gid_index: (r.below(2) == 0).then(|| r.next_u64() as u8),
            mtu: r.below(7) as u8,
        },
        slots: edgy(r) as u32,
        slot_bytes: edgy(r) as u32,
        ctrl_bytes: edgy(r) as u32,
        qps: (0..r.below(5))
            .map(|_| {
                (
                    edgy(r) as u32,
                    QpInfo {
                        qpn: edgy(r) as u32,
                        psn: edgy(r) as u32,
                        rkey: edgy(r) as u32,
                        rx_addr: edgy(r),
                        ctrl_addr: edgy(r),
                        cts_addr: edgy(r),
                    },
                )
            })
            .collect(),
        direct,
    }
}
