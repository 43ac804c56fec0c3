//! The one error type of the library.
//!
//! Every variant a caller can act on names the rank that saw it and, where there is one, the
//! peer and the operation. Errors are `Clone` because the first error *poisons* a communicator:
//! every later call returns the same error at once.

use std::fmt;
use std::io;
use std::sync::Arc;
use std::time::Duration;

/// Result alias used throughout dspark.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A rank number in [`Display`](fmt::Display) output: `rank 3`, or `rank ?` before it is known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankName(pub Option<usize>);

impl fmt::Display for RankName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(r) => write!(f, "rank {r}"),
            None => f.write_str("rank ?"),
        }
    }
}

fn peer_suffix(peer: &Option<usize>) -> String {
    match peer {
        Some(p) => format!(" (peer rank {p})"),
        None => String::new(),
    }
}

/// Everything that can go wrong in dspark.
#[non_exhaustive]
#[derive(Clone, Debug, thiserror::Error)]
pub enum Error {
    /// A blocking operation did not finish before its deadline; `peer` is the rank it was
    /// waiting for (a silent, stopped or overloaded process).
    #[error("{}: {op} timed out after {waited:.1?} waiting for rank {}{}",
        RankName(Some(*rank)),
        peer.map_or("?".to_string(), |p| p.to_string()),
        if detail.is_empty() { String::new() } else { format!(": {detail}") })]
    Timeout {
        /// The rank that timed out.
        rank: usize,
        /// The peer it was waiting for, if one.
        peer: Option<usize>,
        /// The operation (`all_reduce`, `bootstrap`, ...).
        op: String,
        /// How long it waited.
        waited: Duration,
        /// What was outstanding.
        detail: String,
    },

    /// A peer closed its connection or died.
    #[error("{}: lost rank {peer} during {op}: {detail}", RankName(Some(*rank)))]
    PeerLost {
        /// The rank that noticed.
        rank: usize,
        /// The peer that went away.
        peer: usize,
        /// The operation.
        op: String,
        /// What was seen (EOF, connection reset, ...).
        detail: String,
    },

    /// Ranks disagree about a call: collective, count, data type, op or root, or about the
    /// job (world size, protocol version, job token).
    #[error("{}: mismatch in {op}{}: {what}", RankName(*rank), peer_suffix(peer))]
    Mismatch {
        /// The rank that detected it (None during bootstrap before ranks are known).
        rank: Option<usize>,
        /// The peer that disagrees.
        peer: Option<usize>,
        /// The operation.
        op: String,
        /// What differs, with both values.
        what: String,
    },

    /// An argument is invalid (buffer lengths, root or peer out of range, ...). Local; does not
    /// poison the communicator.
    #[error("{}: invalid argument to {op}: {what}", RankName(*rank))]
    InvalidArgument {
        /// The rank.
        rank: Option<usize>,
        /// The call.
        op: String,
        /// What is wrong.
        what: String,
    },

    /// Bad configuration: names the variable (or `Config` field) and the problem.
    #[error("configuration error in {var}: {what}")]
    Config {
        /// The environment variable or config field.
        var: String,
        /// What is wrong and how to fix it.
        what: String,
    },

    /// An operating-system I/O error.
    #[error("{}: I/O error in {op}{}: {source}", RankName(*rank), peer_suffix(peer))]
    Io {
        /// The rank.
        rank: Option<usize>,
        /// The peer, if the error concerns one connection.
        peer: Option<usize>,
        /// The operation.
        op: String,
        /// The OS error.
        #[source]
        source: Arc<io::Error>,
    },

    /// Another rank failed and told this one to stop; `reason` is its error.
    #[error("{}: {op} aborted by rank {by}: {reason}", RankName(Some(*rank)))]
    Aborted {
        /// The rank that received the abort.
        rank: usize,
        /// The rank that failed first.
        by: usize,
        /// The operation in progress here.
        op: String,
        /// The failing rank's error, as text.
        reason: String,
    },

    /// A transport-level failure that is not plain I/O: a verbs call or work completion that
    /// failed, a protocol violation by a peer.
    #[error("{}: {op}{} failed: {what}", RankName(*rank), peer_suffix(peer))]
    Transport {
        /// The rank.
        rank: Option<usize>,
        /// The peer.
        peer: Option<usize>,
        /// The operation or verb (`ibv_post_send`, `RDMA_WRITE completion`, ...).
        op: String,
        /// The status or detail.
        what: String,
    },

    /// Something requested cannot be had on this machine (verbs transport, GPUDirect RDMA,
    /// CUDA): `reason` says why.
    #[error("{what} is unavailable: {reason}")]
    Unavailable {
        /// What was asked for.
        what: String,
        /// Why it cannot be had.
        reason: String,
    },

    /// A CUDA driver, runtime or NVRTC error.
    #[error("CUDA error in {op}: {what}")]
    Cuda {
        /// The call.
        op: String,
        /// The error text (for NVRTC compile errors, the compiler log).
        what: String,
    },
}

impl Error {
    /// Builds an [`Error::Io`].
    pub fn io(
        rank: Option<usize>,
        peer: Option<usize>,
        op: impl Into<String>,
        e: io::Error,
    ) -> Self {
        Error::Io {
            rank,
            peer,
            op: op.into(),
            source: Arc::new(e),
        }
    }

    /// Builds an [`Error::Config`].
    pub fn config(var: impl Into<String>, what: impl Into<String>) -> Self {
        Error::Config {
            var: var.into(),
            what: what.into(),
        }
    }

    /// Names the call an error happened in: a transport reports `send` or `receive`; the
    /// engine knows it was `all_reduce #41`. Errors whose operation already carries a
    /// sequence number (timeouts, mismatches) are left as they are.
    pub fn in_op(mut self, call: &str) -> Self {
        let op = match &mut self {
            Error::PeerLost { op, .. }
            | Error::Io { op, .. }
            | Error::Transport { op, .. }
            | Error::Aborted { op, .. } => op,
            _ => return self,
        };
        if !op.contains('#') {
            *op = if op.is_empty() {
                call.to_string()
            } else {
                format!("{call} ({op})")
            };
        }
        self
    }

    /// Builds an [`Error::InvalidArgument`].
    pub fn invalid(rank: Option<usize>, op: impl Into<String>, what: impl Into<String>) -> Self {
        Error::InvalidArgument {
            rank,
            op: op.into(),
            what: what.into(),
        }
    }

    /// Builds an [`Error::Unavailable`].
    pub fn unavailable(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Unavailable {
            what: what.into(),
            reason: reason.into(),
        }
    }

    /// Whether this error leaves the communicator unusable (every later call fails with it).
    /// Argument errors are local and do not.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, Error::InvalidArgument { .. })
    }

    /// The peer this error is about, if one.
    pub fn peer(&self) -> Option<usize> {
        match self {
            Error::Timeout { peer, .. }
            | Error::Mismatch { peer, .. }
            | Error::Io { peer, .. }
            | Error::Transport { peer, .. } => *peer,
            Error::PeerLost { peer, .. } => Some(*peer),
            Error::Aborted { by, .. } => Some(*by),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_rank_peer_and_operation() {
        let e = Error::Timeout {
            rank: 2,
            peer: Some(3),
            op: "all_reduce".into(),
            waited: Duration::from_secs(5),
            detail: String::new(),
        };
        let s = e.to_string();
        assert!(
            s.contains("rank 2") && s.contains("rank 3") && s.contains("all_reduce"),
            "{s}"
        );

        let e = Error::PeerLost {
            rank: 0,
            peer: 1,
            op: "broadcast".into(),
            detail: "EOF".into(),
        };
        let s = e.to_string();
        assert!(
            s.contains("rank 0") && s.contains("rank 1") && s.contains("broadcast"),
            "{s}"
        );

        let e = Error::Mismatch {
            rank: Some(1),
            peer: Some(0),
            op: "all_reduce".into(),
            what: "count 10 here, 12 at rank 0".into(),
        };
        let s = e.to_string();
        assert!(
            s.contains("rank 1") && s.contains("peer rank 0") && s.contains("count"),
            "{s}"
        );
    }

    #[test]
    fn argument_errors_do_not_poison() {
        assert!(!Error::invalid(Some(0), "all_gather", "bad length").is_fatal());
        assert!(Error::config("DSPARK_RANK", "x").is_fatal());
    }
}
