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

/// `rank 3: ` where the rank is known, nothing otherwise (errors of a GPU or NIC probe run
/// outside a communicator).
fn rank_prefix(rank: &Option<usize>) -> String {
    rank.map_or(String::new(), |r| format!("rank {r}: "))
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
    #[error("{}: {op} timed out after {waited:.1?}{}{}",
        RankName(Some(*rank)),
        peer.map_or(String::new(), |p| format!(" waiting for rank {p}")),
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
    #[error("{}{what} is unavailable: {reason}", rank_prefix(rank))]
    Unavailable {
        /// The rank that asked (None outside a communicator, e.g. a probe).
        rank: Option<usize>,
        /// What was asked for.
        what: String,
        /// Why it cannot be had.
        reason: String,
    },

    /// A CUDA driver, runtime or NVRTC error.
    #[error("{}CUDA error in {op}: {what}", rank_prefix(rank))]
    Cuda {
        /// The rank (None outside a communicator: a kernel compiled or a GPU probed alone).
        rank: Option<usize>,
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

    /// Names the call an error happened in: a transport reports `send` or `receive`, a GPU
    /// stream `cuMemcpyHtoDAsync`; the engine knows it was `all_reduce #41`. Errors whose operation already carries a
    /// sequence number (most timeouts and mismatches) are left as they are; a timeout or a
    /// mismatch of a connection made on first use inside the call (`bootstrap`) is named
    /// after the call too.
    pub fn in_op(mut self, call: &str) -> Self {
        let op = match &mut self {
            Error::PeerLost { op, .. }
            | Error::Io { op, .. }
            | Error::Transport { op, .. }
            | Error::Aborted { op, .. }
            | Error::Timeout { op, .. }
            | Error::Mismatch { op, .. }
            // A device call inside a collective (`cuMemcpyHtoDAsync`): which collective.
            | Error::Cuda { op, .. } => op,
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

    /// Builds an [`Error::Unavailable`] (the rank is filled in by [`Error::at_rank`]).
    pub fn unavailable(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Unavailable {
            rank: None,
            what: what.into(),
            reason: reason.into(),
        }
    }

    /// Builds an [`Error::Cuda`] (the rank is filled in by [`Error::at_rank`]).
    pub fn cuda(op: impl Into<String>, what: impl Into<String>) -> Self {
        Error::Cuda {
            rank: None,
            op: op.into(),
            what: what.into(),
        }
    }

    /// Names the rank that saw this error. A communicator applies it to every error of its
    /// calls: layers below it (a GPU stream's completion marks, a kernel compile, a probe)
    /// do not know their rank. Every error a rank's call returns was observed by that rank,
    /// so the rank is set wherever the error has one.
    pub fn at_rank(mut self, me: usize) -> Self {
        match &mut self {
            Error::Timeout { rank, .. }
            | Error::PeerLost { rank, .. }
            | Error::Aborted { rank, .. } => *rank = me,
            Error::Mismatch { rank, .. }
            | Error::InvalidArgument { rank, .. }
            | Error::Io { rank, .. }
            | Error::Transport { rank, .. }
            | Error::Unavailable { rank, .. }
            | Error::Cuda { rank, .. } => *rank = Some(me),
            Error::Config { .. } => {}
        }
        self
    }

    /// Whether this error, returned by a collective or point-to-point operation, leaves the
    /// communicator unusable (every later call fails with it). Argument errors are local and
    /// do not. The calls that make a communicator from it (`split`, `shrink`) leave it as it
    /// was when they fail, whatever the error (as `include/dspark.h` says), except
    /// `shrink_aborting` past its argument checks.
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
    fn a_first_use_connections_timeout_is_named_after_the_call_and_a_named_one_is_kept() {
        let connect = Error::Timeout {
            rank: 3,
            peer: Some(5),
            op: "bootstrap".into(),
            waited: Duration::from_secs(5),
            detail: "connecting to rank 5".into(),
        };
        let s = connect.in_op("all_to_all #3").to_string();
        assert!(s.contains("all_to_all #3 (bootstrap)"), "{s}");
        let named = Error::Timeout {
            rank: 3,
            peer: Some(5),
            op: "all_reduce #9".into(),
            waited: Duration::from_secs(5),
            detail: String::new(),
        };
        let s = named.in_op("all_reduce #9").to_string();
        assert!(s.contains("all_reduce #9") && !s.contains("#9 ("), "{s}");
        let m = Error::Mismatch {
            rank: Some(1),
            peer: Some(0),
            op: "bootstrap".into(),
            what: "a bad proof".into(),
        };
        assert!(m
            .in_op("recv #4")
            .to_string()
            .contains("recv #4 (bootstrap)"));
    }

    /// A device call that failed inside a collective is named after the collective (it said
    /// only "CUDA error in cuMemcpyHtoDAsync"); a compile or probe outside any call keeps
    /// its own name.
    #[test]
    fn a_cuda_error_inside_a_call_names_the_call() {
        let e = Error::cuda("cuMemcpyHtoDAsync", "injected").in_op("all_reduce #12");
        let s = e.at_rank(3).to_string();
        assert!(
            s.contains("rank 3") && s.contains("all_reduce #12 (cuMemcpyHtoDAsync)"),
            "{s}"
        );
        let s = Error::cuda("nvrtcCompileProgram", "log").to_string();
        assert!(s.contains("CUDA error in nvrtcCompileProgram"), "{s}");
    }

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
    fn at_rank_names_the_rank_of_every_kind() {
        let all = [
            Error::Timeout {
                rank: 0,
                peer: Some(1),
                op: "staged synchronize".into(),
                waited: Duration::from_secs(1),
                detail: String::new(),
            },
            Error::PeerLost {
                rank: 0,
                peer: 1,
                op: "x".into(),
                detail: String::new(),
            },
            Error::Aborted {
                rank: 0,
                by: 1,
                op: "x".into(),
                reason: String::new(),
            },
            Error::invalid(None, "x", "y"),
            Error::io(None, None, "x", io::Error::other("e")),
            Error::Transport {
                rank: None,
                peer: None,
                op: "x".into(),
                what: "y".into(),
            },
            Error::Mismatch {
                rank: None,
                peer: None,
                op: "x".into(),
                what: "y".into(),
            },
            Error::unavailable("GPUDirect RDMA", "no peermem"),
            Error::cuda("cuMemAlloc", "out of memory"),
        ];
        for e in all {
            let before = e.to_string();
            let s = e.at_rank(7).to_string();
            assert!(s.contains("rank 7"), "{before} -> {s}");
        }
        // Outside a communicator a CUDA error has no rank, and says none.
        assert_eq!(
            Error::cuda("cuInit", "no driver").to_string(),
            "CUDA error in cuInit: no driver"
        );
        assert!(Error::config("DSPARK_RANK", "x")
            .at_rank(3)
            .to_string()
            .contains("DSPARK_RANK"));
    }

    #[test]
    fn argument_errors_do_not_poison() {
        assert!(!Error::invalid(Some(0), "all_gather", "bad length").is_fatal());
        assert!(Error::config("DSPARK_RANK", "x").is_fatal());
    }
}
