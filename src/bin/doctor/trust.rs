//! How a job launched with this environment would authenticate its ranks: the token file or
//! token it would use, the store's published secret under a store rendezvous, or open, and
//! the fix where it is open or the token file is refused.

use dspark::{Config, JobAuth};
use serde::Serialize;

use super::kv;

/// The fix for an open job.
const FIX: &str = "umask 077; head -c32 /dev/urandom | base64 > ~/.dspark-token, then \
                   DSPARK_JOB_TOKEN_FILE=~/.dspark-token on every rank";

#[derive(Debug, Serialize)]
pub(super) struct AuthSection {
    /// In words: "token file /path", "open: any host that reaches port P can join", ...
    pub(super) how: String,
    /// Whether a stranger that reaches rank 0's port is refused.
    pub(super) authenticated: bool,
    /// What to do, where it is open or the configuration is refused.
    pub(super) fix: Option<String>,
}

/// Reads the environment as a rank would ([`Config::from_env`]); a launcher's rank, world
/// size and rendezvous address that are not set here stand in as rank 0 of 2 at an unknown
/// port, since they do not change how the job authenticates.
pub(super) fn probe_auth() -> AuthSection {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let any = |ks: &[&str]| ks.iter().any(|k| env(k).is_some());
    let has_rank = any(&[
        "DSPARK_RANK",
        "RANK",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
    ]);
    let has_world = any(&[
        "DSPARK_WORLD_SIZE",
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_SIZE",
        "SLURM_NTASKS",
    ]);
    let has_root = any(&["DSPARK_ROOT_ADDR", "MASTER_ADDR"]);
    let cfg = Config::from_lookup(|k| match k {
        "DSPARK_RANK" if !has_rank => Some("0".into()),
        "DSPARK_WORLD_SIZE" if !has_world => Some("2".into()),
        "DSPARK_ROOT_ADDR" if !has_root => Some("rank-0-host:1".into()),
        _ => env(k),
    });
    match cfg {
        Err(e) => AuthSection {
            how: format!("refused: {e}"),
            authenticated: false,
            fix: Some(format!("fix the variable the error names ({FIX})")),
        },
        Ok(c) => {
            let auth = c.auth();
            let how = match &auth {
                JobAuth::Open { .. } if !has_root => {
                    "open: any host that reaches rank 0's port can join".to_string()
                }
                a => a.to_string(),
            };
            let open = auth.is_open();
            AuthSection {
                how: if open {
                    format!(
                        "{how} (dspark-bench --ranks and dspark tune give their ranks a secret of \
                         their own; the store rendezvous publishes one)"
                    )
                } else {
                    how
                },
                authenticated: !open,
                fix: open.then(|| FIX.to_string()),
            }
        }
    }
}

pub(super) fn render_auth(o: &mut String, a: &AuthSection) {
    o.push_str("\nJob authentication (a job launched with this environment)\n");
    kv(o, "ranks authenticate with", &a.how);
    if let Some(fix) = &a.fix {
        kv(o, "fix", fix);
    }
}
