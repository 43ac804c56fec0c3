//! What the bootstrap reads of the configuration: [`BootstrapOptions`], built and checked once
//! from a [`Config`] by [`BootstrapOptions::from_config`].
//!
//! The rest of the bootstrap takes these options, never the `Config`, so that it depends on
//! the handful of settings it uses (rank, world, rank 0's address, deadline, the job's secret,
//! the interface, the host identity, the segment size that the hello carries) and not on every
//! setting of the library. This file is the only one in `bootstrap/` that reads `Config`.

#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use super::auth::Secret;
use crate::config::{split_host_port, Config};
use crate::error::{Error, Result};

/// The settings of one rendezvous, checked: the rank, the world, where rank 0 listens, the
/// deadline, the job's secret, the interface, the host identity and the pipeline segment size
/// (which the ranks must agree on).
#[derive(Clone, Debug)]
pub struct BootstrapOptions {
    /// This rank, below `world`.
    pub(crate) rank: usize,
    /// Number of ranks, at least 1.
    pub(crate) world: usize,
    /// Rank 0's rendezvous address as configured (`host:port`), for messages.
    pub(crate) root_addr: String,
    /// Its host and port (unused, empty and 0, for a world of one).
    pub(crate) root: (String, u16),
    /// Where the root address came from (`DSPARK_ROOT_ADDR`, `MASTER_ADDR/MASTER_PORT`, a
    /// store's key, ...), for the errors that name it.
    pub(crate) root_source: String,
    /// Deadline of every blocking step, from its start.
    pub(crate) timeout: Duration,
    /// The job's handshake secret (from `Config::job_token`: `DSPARK_JOB_TOKEN`, its file, a
    /// spawner's, the store's or the parent's secret; and the launcher's job id).
    pub(crate) secret: Secret,
    /// The network interface whose address the data listener binds (`DSPARK_SOCKET_IFNAME`).
    pub(crate) socket_ifname: Option<String>,
    /// This rank's host identity (`DSPARK_HOST_ID`; `None`: the host name).
    pub(crate) host_id: Option<String>,
    /// The pipeline segment size in bytes (`DSPARK_CHUNK_BYTES`), which every rank's hello
    /// carries: ranks that differ are refused at the rendezvous.
    pub(crate) segment_bytes: usize,
    /// Listeners bind every interface instead of the address the rank advertises
    /// (`DSPARK_LISTEN_ANY`).
    pub(crate) listen_any: bool,
    /// Data listeners accept connections from any address, not only the ranks' own
    /// (`DSPARK_ACCEPT_ANY_SOURCE`, for multi-homed hosts).
    pub(crate) any_source: bool,
}

impl BootstrapOptions {
    /// The bootstrap's settings of `cfg`, after checking the whole configuration
    /// ([`Config::validate`]).
    ///
    /// # Errors
    /// [`Error::Config`] naming the variable, as [`Config::validate`].
    pub fn from_config(cfg: &Config) -> Result<Self> {
        cfg.validate()?;
        let root_source = cfg
            .sources
            .iter()
            .find(|(k, _)| k == "root address")
            .map_or("DSPARK_ROOT_ADDR".to_string(), |(_, v)| v.clone());
        let root = if cfg.world_size > 1 {
            split_host_port(&cfg.root_addr).map_err(|w| Error::config(root_source.clone(), w))?
        } else {
            (String::new(), 0)
        };
        // `job_hash` of a configuration with the job id and no token: the job id's hash.
        let mut id_only = Config::new(0, 1, String::new());
        id_only.job_id = cfg.job_id.clone();
        Ok(BootstrapOptions {
            rank: cfg.rank,
            world: cfg.world_size,
            root_addr: cfg.root_addr.clone(),
            root,
            root_source,
            timeout: cfg.timeout,
            secret: Secret::new(
                cfg.job_token.as_deref(),
                cfg.job_id.as_deref(),
                id_only.job_hash(),
            )
            .named(cfg.job_auth.secret_name()),
            socket_ifname: cfg.socket_ifname.clone(),
            host_id: cfg.host_id.clone(),
            segment_bytes: cfg.segment_bytes,
            listen_any: cfg.listen_any,
            any_source: cfg.accept_any_source,
        })
    }

    /// Test options: rank `rank` of `world` with job token `token` and a 10 s deadline.
    #[cfg(test)]
    pub(crate) fn for_test(rank: usize, world: usize, token: &str) -> Self {
        let mut c = Config::new(rank, world, "127.0.0.1:1");
        c.timeout = Duration::from_secs(10);
        c.job_token = Some(token.into());
        Self::from_config(&c).unwrap()
    }

    /// The deadline of a step that starts at `start`.
    pub(crate) fn deadline(&self, start: Instant) -> Instant {
        crate::time::deadline(start, self.timeout)
    }
}
