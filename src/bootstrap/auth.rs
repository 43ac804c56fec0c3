//! The handshake's proof of the job token: HMAC-SHA256 (RFC 2104, FIPS 180-4) over fresh
//! nonces, so that a recorded handshake cannot be replayed, and a constant-time comparison.
//!
//! Both are small enough to carry here rather than as dependencies; the test vectors are
//! those of FIPS 180-4 / NIST (SHA-256) and RFC 4231 (HMAC-SHA256).
//!
//! The key is the job's secret with the launcher's job id: a token (`DSPARK_JOB_TOKEN`, its
//! file), else a random per-job secret where a private channel exists (a dspark spawner, the
//! store rendezvous, a parent communicator: `crate::config::trust`). Without any, the key is
//! the job id alone (or nothing), which anybody can know: the handshake then only keeps ranks
//! of different jobs from joining each other by accident.
//!
//! [`Secret`] holds that key and makes the four proofs of the handshakes (a rank to rank 0,
//! rank 0 to a rank, and both ends of a data connection), each under its own label so that
//! no proof made for one purpose verifies for another, and says in words why one failed.

#![forbid(unsafe_code)]

use std::io::Read;

/// Bytes of a SHA-256 digest, of an HMAC-SHA256 tag, and of a handshake nonce.
pub(crate) const TAG_LEN: usize = 32;

/// A handshake nonce.
pub(crate) type Nonce = [u8; TAG_LEN];

const K: [u32; 64] = [
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
];

/// Incremental SHA-256.
#[derive(Clone)]
pub(crate) struct Sha256 {
    h: [u32; 8],
    buf: [u8; 64],
    buffered: usize,
    total: u64,
}

impl Sha256 {
    pub(crate) fn new() -> Self {
        Sha256 {
            h: [
                0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
                0x5be0cd19,
            ],
            buf: [0; 64],
            buffered: 0,
            total: 0,
        }
    }

    fn block(h: &mut [u32; 8], b: &[u8; 64]) {
        let mut w = [0u32; 64];
        for (i, c) in b.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([c[0], c[1], c[2], c[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut bb, mut c, mut d, mut e, mut f, mut g, mut hh] = *h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & bb) ^ (a & c) ^ (bb & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = bb;
            bb = a;
            a = t1.wrapping_add(t2);
        }
        for (x, y) in h.iter_mut().zip([a, bb, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }

    pub(crate) fn update(&mut self, mut data: &[u8]) {
        self.total = self.total.wrapping_add(data.len() as u64);
        if self.buffered > 0 {
            let n = (64 - self.buffered).min(data.len());
            self.buf[self.buffered..self.buffered + n].copy_from_slice(&data[..n]);
            self.buffered += n;
            data = &data[n..];
            if self.buffered < 64 {
                return;
            }
            let b = self.buf;
            Self::block(&mut self.h, &b);
            self.buffered = 0;
        }
        let mut blocks = data.chunks_exact(64);
        for b in &mut blocks {
            let mut a = [0u8; 64];
            a.copy_from_slice(b);
            Self::block(&mut self.h, &a);
        }
        let rest = blocks.remainder();
        self.buf[..rest.len()].copy_from_slice(rest);
        self.buffered = rest.len();
    }

    pub(crate) fn finish(mut self) -> [u8; TAG_LEN] {
        let bits = self.total.wrapping_mul(8);
        let mut pad = [0u8; 72];
        pad[0] = 0x80;
        // Pad to 56 mod 64, then the 64-bit big-endian bit length.
        let n = if self.buffered < 56 {
            56 - self.buffered
        } else {
            120 - self.buffered
        };
        pad[n..n + 8].copy_from_slice(&bits.to_be_bytes());
        let total = self.total;
        self.update(&pad[..n + 8]);
        self.total = total;
        debug_assert_eq!(self.buffered, 0);
        let mut out = [0u8; TAG_LEN];
        for (o, v) in out.chunks_exact_mut(4).zip(self.h) {
            o.copy_from_slice(&v.to_be_bytes());
        }
        out
    }
}

/// SHA-256 of `data`.
pub(crate) fn sha256(data: &[u8]) -> [u8; TAG_LEN] {
    let mut h = Sha256::new();
    h.update(data);
    h.finish()
}

/// HMAC-SHA256 of the concatenation of `parts` under `key`.
pub(crate) fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; TAG_LEN] {
    let mut k0 = [0u8; 64];
    if key.len() > 64 {
        k0[..TAG_LEN].copy_from_slice(&sha256(key));
    } else {
        k0[..key.len()].copy_from_slice(key);
    }
    let mut inner = Sha256::new();
    inner.update(&k0.map(|b| b ^ 0x36));
    for p in parts {
        inner.update(p);
    }
    let inner = inner.finish();
    let mut outer = Sha256::new();
    outer.update(&k0.map(|b| b ^ 0x5c));
    outer.update(&inner);
    outer.finish()
}

/// Whether `a` and `b` are equal, in time that depends on their lengths only.
pub(crate) fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// A fresh random nonce from the kernel (`/dev/urandom`).
pub(crate) fn nonce() -> std::io::Result<Nonce> {
    let mut n = [0u8; TAG_LEN];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut n)?;
    Ok(n)
}

/// The handshake key of a job: its token and its launcher job id, each length-prefixed so
/// that no two different pairs give the same key.
pub(crate) fn job_key(token: Option<&str>, job_id: Option<&str>) -> Vec<u8> {
    let mut k = b"dspark job key v2\0".to_vec();
    for part in [token, job_id] {
        match part {
            Some(s) => {
                k.push(1);
                k.extend_from_slice(&(s.len() as u64).to_le_bytes());
                k.extend_from_slice(s.as_bytes());
            }
            None => k.push(0),
        }
    }
    k
}

/// The job's handshake secret and what the hellos carry in the clear.
#[derive(Clone)]
pub(crate) struct Secret {
    /// HMAC key: the job token and the launcher's job id.
    key: Vec<u8>,
    /// Hash of the launcher's job id alone (0 without one): the token never travels, not
    /// even hashed.
    pub(crate) job: u64,
    /// Whether this rank has a job token.
    pub(crate) token: bool,
    /// How messages name the secret (`DSPARK_JOB_TOKEN`, the spawner's secret, ...).
    name: String,
}

impl Secret {
    /// The secret of a job with `token` (`DSPARK_JOB_TOKEN`) and the launcher's `job_id`;
    /// `job` is the hash of the job id alone (0 without one), which the hellos carry.
    pub(crate) fn new(token: Option<&str>, job_id: Option<&str>, job: u64) -> Secret {
        Secret {
            key: job_key(token, job_id),
            job,
            token: token.is_some(),
            name: "DSPARK_JOB_TOKEN".into(),
        }
    }

    /// The same secret, named `name` in the messages of a failed handshake.
    pub(crate) fn named(mut self, name: String) -> Secret {
        self.name = name;
        self
    }

    /// A rank's proof to rank 0: over rank 0's nonce and the rank's whole hello (its own
    /// nonce, rank, world size, address).
    pub(crate) fn rank_proof(&self, nonce0: &Nonce, hello: &[u8]) -> [u8; TAG_LEN] {
        hmac_sha256(&self.key, &[LABEL_RANK, nonce0, hello])
    }

    /// Rank 0's proof to a rank: over that rank's hello, rank 0's nonce and the welcome
    /// (the rank table) it sends.
    pub(crate) fn root_proof(&self, hello: &[u8], nonce0: &Nonce, welcome: &[u8]) -> [u8; TAG_LEN] {
        hmac_sha256(&self.key, &[LABEL_ROOT, nonce0, hello, welcome])
    }

    /// A data connection's proofs, by the accepting (`LABEL_ACCEPTOR`) or the connecting
    /// (`LABEL_CONNECTOR`) rank: over the connecting rank's hello and the acceptor's nonce.
    pub(crate) fn peer_proof(&self, label: &[u8], hello: &[u8], nonce: &Nonce) -> [u8; TAG_LEN] {
        hmac_sha256(&self.key, &[label, nonce, hello])
    }

    /// What to say when a peer's token flag differs from this rank's.
    pub(crate) fn token_disagreement(&self, me: &str, them: &str) -> String {
        let (has, hasnt) = if self.token { (me, them) } else { (them, me) };
        let name = &self.name;
        format!("{has} has {name} set but {hasnt} has none (set the same {name} on every rank)")
    }

    /// What to say when a proof did not verify.
    pub(crate) fn bad_proof(&self, who: &str, than: &str) -> String {
        if self.token {
            format!(
                "{who} did not prove that it knows the job token: its {} differs from {than}'s \
                 (or a recorded handshake was replayed)",
                self.name
            )
        } else {
            format!(
                "{who}'s handshake proof did not verify (no DSPARK_JOB_TOKEN is set: a replayed \
                 or forged handshake, or a broken peer?)"
            )
        }
    }
}

/// Says whether there is a token, never the key.
impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secret")
            .field("job", &self.job)
            .field("token", &self.token)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

// The labels of the four proofs: no proof made for one purpose verifies for another.
const LABEL_RANK: &[u8] = b"dspark/2 rank proves to rank 0\0";
const LABEL_ROOT: &[u8] = b"dspark/2 rank 0 proves to a rank\0";
pub(crate) const LABEL_ACCEPTOR: &[u8] = b"dspark/2 data acceptor proves\0";
pub(crate) const LABEL_CONNECTOR: &[u8] = b"dspark/2 data connector proves\0";

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn sha256_matches_the_nist_vectors() {
        assert_eq!(
            hex(&sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        assert_eq!(
            hex(&sha256(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            hex(&sha256(
                b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"
            )),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
        );
        assert_eq!(
            hex(&sha256(&[b'a'; 1_000_000])),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"
        );
    }

    #[test]
    fn sha256_is_the_same_however_the_input_is_split() {
        let data: Vec<u8> = (0..300u32).map(|i| (i * 7 + 3) as u8).collect();
        let whole = sha256(&data);
        for cut in [0, 1, 55, 56, 63, 64, 65, 127, 128, 200, 300] {
            let mut h = Sha256::new();
            h.update(&data[..cut]);
            h.update(&data[cut..]);
            assert_eq!(h.finish(), whole, "cut at {cut}");
        }
    }

    /// RFC 4231, test cases 1-4, 6 and 7 (case 5 is a truncated tag).
    #[test]
    fn hmac_sha256_matches_rfc_4231() {
        let cases: [(Vec<u8>, Vec<u8>, &str); 6] = [
            (
                vec![0x0b; 20],
                b"Hi There".to_vec(),
                "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
            ),
            (
                b"Jefe".to_vec(),
                b"what do ya want for nothing?".to_vec(),
                "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
            ),
            (
                vec![0xaa; 20],
                vec![0xdd; 50],
                "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe",
            ),
            (
                (1..=25).collect(),
                vec![0xcd; 50],
                "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
            ),
            (
                vec![0xaa; 131],
                b"Test Using Larger Than Block-Size Key - Hash Key First".to_vec(),
                "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
            ),
            (
                vec![0xaa; 131],
                b"This is a test using a larger than block-size key and a larger than \
                  block-size data. The key needs to be hashed before being used by the \
                  HMAC algorithm."
                    .to_vec(),
                "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2",
            ),
        ];
        for (i, (key, data, want)) in cases.iter().enumerate() {
            assert_eq!(hex(&hmac_sha256(key, &[data])), *want, "case {i}");
            // Split input gives the same tag.
            let (a, b) = data.split_at(data.len() / 2);
            assert_eq!(hex(&hmac_sha256(key, &[a, b])), *want, "case {i}, split");
        }
    }

    #[test]
    fn constant_time_compare_and_keys() {
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"ab"));
        assert_ne!(job_key(Some("a"), None), job_key(None, Some("a")));
        assert_ne!(
            job_key(Some("ab"), Some("c")),
            job_key(Some("a"), Some("bc"))
        );
        assert_ne!(nonce().unwrap(), nonce().unwrap());
    }
}
