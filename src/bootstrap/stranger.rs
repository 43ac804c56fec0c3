//! Not API: the bytes a stranger sends to a data listener (`tests/adversary.rs` plays it
//! during a run). A stranger has no secret of the job: it builds its hello and its proof with
//! the same encoder and the same [`Secret`] a rank would, from what anybody can compute — the
//! launcher's job id (public), and no token or a guessed one. Nothing here knows or weakens a
//! job's secret.

#![forbid(unsafe_code)]

use super::auth::{Secret, LABEL_CONNECTOR};
use super::msg::{self, PeerHello, MSG_PEER_PROOF};
use crate::config::Config;

/// A stranger claiming rank `from` of a job of `world` ranks on a connection to rank `to`'s
/// data listener.
#[derive(Debug)]
pub struct Stranger {
    secret: Secret,
    /// Its hello, unframed (what the proof covers).
    hello: Vec<u8>,
}

/// What a data listener answered, read as a stranger reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Heard {
    /// A challenge: the listener read the hello (the stranger answers with its proof).
    Challenge,
    /// The acknowledgement: the stranger was taken as a rank.
    Ack,
    /// A refusal, with its reason.
    Reject(String),
    /// Not a message of the handshake.
    Other(String),
}

impl Stranger {
    /// A stranger who knows the launcher's `job_id` (public) and maybe a guessed `token`.
    ///
    /// # Errors
    /// Reading a nonce from `/dev/urandom`.
    pub fn new(
        job_id: Option<&str>,
        token: Option<&str>,
        world: usize,
        from: usize,
        to: usize,
    ) -> std::io::Result<Stranger> {
        // As `BootstrapOptions::from_config`: the hello carries the job id's hash alone.
        let mut id_only = Config::new(0, 1, String::new());
        id_only.job_id = job_id.map(String::from);
        let secret = Secret::new(token, job_id, id_only.job_hash());
        let hello = PeerHello {
            job: secret.job,
            world: u32::try_from(world).unwrap_or(u32::MAX),
            from: u32::try_from(from).unwrap_or(u32::MAX),
            to: u32::try_from(to).unwrap_or(u32::MAX),
            token: secret.token,
            nonce: super::auth::nonce()?,
        }
        .encode()
        .0;
        Ok(Stranger { secret, hello })
    }

    /// Its hello, framed as on the wire (length, then the message).
    pub fn hello(&self) -> Vec<u8> {
        frame(&self.hello)
    }

    /// What message `m` (unframed) of the listener says; for a challenge, also the proof the
    /// stranger answers with (framed), made under its own key.
    pub fn read(&self, m: &[u8]) -> (Heard, Option<Vec<u8>>) {
        if let Ok(c) = msg::decode_peer_challenge(m) {
            return match c {
                Ok((nonce, _)) => {
                    let tag = self.secret.peer_proof(LABEL_CONNECTOR, &self.hello, &nonce);
                    let proof = msg::encode_proof(MSG_PEER_PROOF, &tag);
                    (Heard::Challenge, Some(frame(&proof.0)))
                }
                Err(rej) => (Heard::Reject(rej.why), None),
            };
        }
        match msg::decode_peer_ack(m) {
            Ok(Ok(())) => (Heard::Ack, None),
            Ok(Err(rej)) => (Heard::Reject(rej.why), None),
            Err(w) => (Heard::Other(w), None),
        }
    }
}

/// `m` with its `u32` little-endian length in front.
fn frame(m: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + m.len());
    v.extend_from_slice(&u32::try_from(m.len()).unwrap_or(u32::MAX).to_le_bytes());
    v.extend_from_slice(m);
    v
}
