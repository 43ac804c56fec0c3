//! How a job's ranks recognise each other: [`JobAuth`], the token file
//! (`DSPARK_JOB_TOKEN_FILE`) and the random per-job secret that dspark's own spawners hand
//! their children (`DSPARK_SPAWNER_SECRET`).
//!
//! Every connection of the rendezvous proves, both ways, that it knows the job's secret (an
//! HMAC over fresh nonces: `crate::bootstrap::auth`). Where the secret comes from, strongest
//! first:
//!
//! - `DSPARK_JOB_TOKEN_FILE`: a file the launcher or the user provides, refused when group or
//!   others may read it;
//! - `DSPARK_JOB_TOKEN`: the token itself (visible to the same user in `/proc/<pid>/environ`,
//!   as every variable);
//! - `DSPARK_SPAWNER_SECRET`: 32 random bytes that `dspark-bench --ranks`, `dspark tune` and
//!   the tests' spawners generate per job and pass to their children in the environment
//!   (readable only by the same user). Users do not set it;
//! - the store rendezvous (torchrun, [`crate::Communicator::init_with_store`]) without a
//!   token: rank 0 draws a secret and publishes it in the store. It is exactly as private as
//!   the store: whoever can read the store can join;
//! - a sub-communicator ([`crate::Communicator::split`]): derived from the parent's secret
//!   and a random salt that travels over the parent's authenticated connections;
//! - none of these: the job is open, and any host that reaches rank 0's port can join. A job
//!   that is open on an interface other than loopback logs a warning once.
//!
//! [`JobAuth`] says which, in [`crate::CommInfo::auth`], the bench header, Python's `info()`
//! and `dspark doctor`.

#![forbid(unsafe_code)]

use std::fmt;
use std::path::{Path, PathBuf};

use super::{split_host_port, Config, Rendezvous};
use crate::error::{Error, Result};

/// The job token (`DSPARK_JOB_TOKEN`).
pub const TOKEN_ENV: &str = "DSPARK_JOB_TOKEN";
/// A file holding the job token (`DSPARK_JOB_TOKEN_FILE`).
pub const TOKEN_FILE_ENV: &str = "DSPARK_JOB_TOKEN_FILE";
/// The per-job secret a dspark spawner passes to its children (`DSPARK_SPAWNER_SECRET`).
pub const SPAWNER_SECRET_ENV: &str = "DSPARK_SPAWNER_SECRET";

/// The largest token file read: a token is one line.
const MAX_TOKEN_FILE: u64 = 64 << 10;

/// How the ranks of a job authenticate each other: where the secret of the handshake comes
/// from, or that there is none. Its `Display` says it in words.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum JobAuth {
    /// A random per-job secret from dspark's own spawner (`dspark-bench --ranks`,
    /// `dspark tune`), passed to the ranks in their environment (`DSPARK_SPAWNER_SECRET`).
    Spawner,
    /// A token read from this file (`DSPARK_JOB_TOKEN_FILE`).
    TokenFile(PathBuf),
    /// A token from `DSPARK_JOB_TOKEN`.
    TokenEnv,
    /// A token the program set ([`Config::job_token`]).
    #[default]
    Token,
    /// A random secret that rank 0 published in the rendezvous store: as private as the
    /// store, since every client of the store can read it.
    Store,
    /// Derived from the parent communicator's secret ([`crate::Communicator::split`]).
    Parent,
    /// No secret: any host that reaches rank 0's port can join the job.
    Open {
        /// Rank 0's rendezvous port.
        port: u16,
    },
    /// None needed: no rank joins over the network (a world of one, or a transport that was
    /// given in-process).
    Alone,
}

impl JobAuth {
    /// Whether anybody who reaches the rendezvous port can join.
    pub fn is_open(&self) -> bool {
        matches!(self, JobAuth::Open { .. })
    }

    /// How the handshake's messages name the secret ("DSPARK_JOB_TOKEN", ...).
    pub(crate) fn secret_name(&self) -> String {
        match self {
            JobAuth::TokenFile(_) => TOKEN_FILE_ENV.into(),
            JobAuth::Spawner => format!("job secret from the spawner ({SPAWNER_SECRET_ENV})"),
            JobAuth::Store => "job secret published in the store".into(),
            JobAuth::Parent => "secret derived from the parent communicator".into(),
            _ => TOKEN_ENV.into(),
        }
    }
}

impl fmt::Display for JobAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            JobAuth::Spawner => write!(f, "job secret from the spawner"),
            JobAuth::TokenFile(p) => write!(f, "token file {}", p.display()),
            JobAuth::TokenEnv => write!(f, "token ({TOKEN_ENV})"),
            JobAuth::Token => write!(f, "token (Config::job_token)"),
            JobAuth::Store => write!(
                f,
                "secret published in the store (as private as the store: its clients can join)"
            ),
            JobAuth::Parent => write!(f, "derived from the parent communicator"),
            JobAuth::Open { port } => {
                write!(f, "open: any host that reaches port {port} can join")
            }
            JobAuth::Alone => write!(f, "none needed (no rank joins over the network)"),
        }
    }
}

impl Config {
    /// A 64-bit identity of the job for the handshake: FNV-1a of the token and the launcher's
    /// job id (0 when neither is set). Not a cryptographic protection: it keeps ranks of
    /// different jobs from joining each other by accident.
    pub fn job_hash(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        let mut eat = |bytes: &[u8]| {
            for &b in bytes {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        };
        if let Some(t) = &self.job_token {
            eat(b"token:");
            eat(t.as_bytes());
        }
        if let Some(j) = &self.job_id {
            eat(b"job:");
            eat(j.as_bytes());
        }
        if self.job_token.is_none() && self.job_id.is_none() {
            0
        } else {
            h
        }
    }

    /// How a job with this configuration authenticates: its token's source where it has
    /// one, the store's published secret under a store rendezvous, else open on rank 0's
    /// port. [`crate::CommInfo::auth`] says what init did.
    pub fn auth(&self) -> JobAuth {
        if self.world_size <= 1 {
            JobAuth::Alone
        } else if self.job_token.is_some() {
            self.job_auth.clone()
        } else if matches!(self.rendezvous, Rendezvous::TorchStore { .. }) {
            JobAuth::Store
        } else {
            JobAuth::Open {
                port: split_host_port(&self.root_addr).map_or(0, |(_, p)| p),
            }
        }
    }
}

/// A fresh random per-job secret (32 bytes from the kernel, hex): what a spawner passes to
/// its children as `DSPARK_SPAWNER_SECRET`.
///
/// # Errors
/// When `/dev/urandom` cannot be read.
pub fn spawner_secret() -> std::io::Result<String> {
    Ok(hex(&crate::bootstrap::auth::nonce()?))
}

/// Lower-case hex of `b`.
pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The job token from the environment and where it came from: `DSPARK_JOB_TOKEN_FILE`'s
/// file, else `DSPARK_JOB_TOKEN`, else a spawner's `DSPARK_SPAWNER_SECRET`; `None` without
/// any.
///
/// # Errors
/// [`Error::Config`] naming the variable: a token file that is missing, empty, too large,
/// not text or readable by group or others, or a token file and a token that differ.
pub(crate) fn token_from(
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<(String, JobAuth)>> {
    let nonempty = |k: &str| get(k).filter(|v| !v.is_empty());
    let token = nonempty(TOKEN_ENV);
    if let Some(path) = nonempty(TOKEN_FILE_ENV) {
        let path = PathBuf::from(path);
        let from_file = read_token_file(&path)?;
        if token.as_ref().is_some_and(|t| *t != from_file) {
            return Err(Error::config(
                TOKEN_FILE_ENV,
                format!(
                    "{} holds another token than {TOKEN_ENV}: set only one of them",
                    path.display()
                ),
            ));
        }
        return Ok(Some((from_file, JobAuth::TokenFile(path))));
    }
    if let Some(t) = token {
        return Ok(Some((t, JobAuth::TokenEnv)));
    }
    Ok(nonempty(SPAWNER_SECRET_ENV).map(|s| (s, JobAuth::Spawner)))
}

/// The token in the file at `path`: its text without one trailing newline.
///
/// # Errors
/// [`Error::Config`] naming `DSPARK_JOB_TOKEN_FILE` when the file cannot be read, is not a
/// regular file, belongs to another user, is not private to its owner (`chmod 600`), is
/// empty, larger than 64 KiB or not UTF-8.
pub(crate) fn read_token_file(path: &Path) -> Result<String> {
    use std::io::Read;
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
    let bad = |what: String| Error::config(TOKEN_FILE_ENV, format!("{}: {what}", path.display()));
    // Non-blocking: opening a FIFO with no writer (or a one-shot one another rank read
    // already) must not wait forever before any deadline exists; a regular file reads the
    // same either way.
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| bad(format!("cannot be read: {e}")))?;
    let meta = f
        .metadata()
        .map_err(|e| bad(format!("cannot be read: {e}")))?;
    if !meta.is_file() {
        return Err(bad("is not a regular file".into()));
    }
    // Another user who owns the file (or can write it) knows the token.
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return Err(bad(format!(
            "belongs to user {} and this process runs as user {me}: its owner knows the \
             token, so any job of theirs could join this one (a token file is the job owner's \
             own, chmod 600)",
            meta.uid()
        )));
    }
    let mode = meta.permissions().mode();
    if mode & 0o077 != 0 {
        return Err(bad(format!(
            "group or others may access it (mode {:04o}): a token file must be private to its \
             owner (chmod 600 {})",
            mode & 0o7777,
            path.display()
        )));
    }
    let mut bytes = Vec::new();
    f.by_ref()
        .take(MAX_TOKEN_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| bad(format!("cannot be read: {e}")))?;
    if bytes.len() as u64 > MAX_TOKEN_FILE {
        return Err(bad("is larger than 64 KiB: a token is one line".into()));
    }
    let mut text = String::from_utf8(bytes).map_err(|_| bad("is not UTF-8 text".into()))?;
    if text.ends_with('\n') {
        text.pop();
        if text.ends_with('\r') {
            text.pop();
        }
    }
    if text.is_empty() {
        return Err(bad("is empty: it must hold the job token".into()));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::env;
    use std::os::unix::fs::PermissionsExt;

    /// A file with `text` and `mode` in a fresh directory of the test's own.
    fn token_file(name: &str, text: &[u8], mode: u32) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("dspark-token-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("token");
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    fn with_file(p: &Path, more: &[(&str, &str)]) -> Result<Option<(String, JobAuth)>> {
        let ps = p.to_str().unwrap().to_string();
        let mut vars: Vec<(&str, &str)> = vec![(TOKEN_FILE_ENV, &ps)];
        vars.extend_from_slice(more);
        token_from(&env(&vars))
    }

    #[test]
    fn a_private_token_file_gives_its_line_without_the_newline() {
        let p = token_file("ok", b"s3cret\n", 0o600);
        assert_eq!(
            with_file(&p, &[]).unwrap(),
            Some(("s3cret".into(), JobAuth::TokenFile(p.clone())))
        );
        // Only one newline goes; a CRLF file too.
        let p2 = token_file("two", b"abc\n\n", 0o400);
        assert_eq!(with_file(&p2, &[]).unwrap().unwrap().0, "abc\n");
        let p3 = token_file("crlf", b"abc\r\n", 0o600);
        assert_eq!(with_file(&p3, &[]).unwrap().unwrap().0, "abc");
        // The same token in both variables is fine: the file is named as the source.
        let both = with_file(&p, &[(TOKEN_ENV, "s3cret")]).unwrap().unwrap();
        assert_eq!(both.1, JobAuth::TokenFile(p));
    }

    #[test]
    fn a_missing_empty_or_shared_token_file_is_a_config_error_naming_the_variable() {
        let missing = std::env::temp_dir().join("dspark-no-such-token-file");
        let p_empty = token_file("empty", b"", 0o600);
        let p_nl = token_file("newline", b"\n", 0o600);
        let p_group = token_file("group", b"tok\n", 0o640);
        let p_other = token_file("other", b"tok\n", 0o604);
        let p_gw = token_file("gw", b"tok\n", 0o620);
        let p_bin = token_file("bin", &[0xff, 0xfe, 0x00], 0o600);
        for (p, says) in [
            (&missing, "cannot be read"),
            (&p_empty, "empty"),
            (&p_nl, "empty"),
            (&p_group, "chmod 600"),
            (&p_other, "chmod 600"),
            (&p_gw, "mode 0620"),
            (&p_bin, "UTF-8"),
        ] {
            let e = with_file(p, &[]).unwrap_err();
            assert!(matches!(e, Error::Config { .. }), "{}: {e}", p.display());
            let s = e.to_string();
            assert!(s.contains(TOKEN_FILE_ENV) && s.contains(says), "{s}");
        }
        // A FIFO with no writer: refused at once (opening it waited forever).
        let fifo = p_empty.parent().unwrap().join("fifo");
        let _ = std::fs::remove_file(&fifo);
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let t0 = std::time::Instant::now();
        let e = with_file(&fifo, &[]).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        assert!(t0.elapsed() < std::time::Duration::from_secs(5));
        // Another user's file: its owner knows the token (where this test may chown).
        let theirs = token_file("theirs", b"tok\n", 0o600);
        let other = nix::unistd::geteuid().as_raw().wrapping_add(1);
        if std::os::unix::fs::chown(&theirs, Some(other), None).is_ok() {
            let e = with_file(&theirs, &[]).unwrap_err().to_string();
            assert!(e.contains("belongs to user"), "{e}");
        } else {
            println!("skipped: another user's token file (this process cannot chown)");
        }
        // A directory is no token file.
        let dir = p_empty.parent().unwrap().to_path_buf();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(with_file(&dir, &[])
            .unwrap_err()
            .to_string()
            .contains(TOKEN_FILE_ENV));
    }

    #[test]
    fn config_from_the_environment_takes_the_token_file_and_names_it() {
        let p = token_file("config", b"abc\n", 0o600);
        let ps = p.to_str().unwrap();
        let base = [
            ("DSPARK_RANK", "0"),
            ("DSPARK_WORLD_SIZE", "2"),
            ("DSPARK_ROOT_ADDR", "h:9"),
        ];
        let mut vars = base.to_vec();
        vars.push((TOKEN_FILE_ENV, ps));
        let c = Config::from_lookup(env(&vars)).unwrap();
        assert_eq!(c.job_token.as_deref(), Some("abc"));
        assert_eq!(c.auth(), JobAuth::TokenFile(p.clone()));
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o660)).unwrap();
        let e = Config::from_lookup(env(&vars)).unwrap_err();
        assert!(e.to_string().contains(TOKEN_FILE_ENV), "{e}");
        // Nothing set: open on rank 0's port.
        let c = Config::from_lookup(env(&base)).unwrap();
        assert_eq!((c.auth(), c.job_token), (JobAuth::Open { port: 9 }, None));
    }

    #[test]
    fn a_token_file_and_a_different_token_are_a_config_error() {
        let p = token_file("differ", b"one\n", 0o600);
        let s = with_file(&p, &[(TOKEN_ENV, "two")])
            .unwrap_err()
            .to_string();
        assert!(
            s.contains(TOKEN_FILE_ENV) && s.contains(TOKEN_ENV) && s.contains("only one"),
            "{s}"
        );
    }

    #[test]
    fn the_token_wins_over_the_spawner_secret_and_each_is_named() {
        assert_eq!(token_from(&env(&[])).unwrap(), None);
        assert_eq!(
            token_from(&env(&[(SPAWNER_SECRET_ENV, "abc")])).unwrap(),
            Some(("abc".into(), JobAuth::Spawner))
        );
        assert_eq!(
            token_from(&env(&[(SPAWNER_SECRET_ENV, "abc"), (TOKEN_ENV, "t")])).unwrap(),
            Some(("t".into(), JobAuth::TokenEnv))
        );
        let s = spawner_secret().unwrap();
        assert_eq!(s.len(), 64);
        assert_ne!(s, spawner_secret().unwrap());
    }

    #[test]
    fn the_auth_of_a_configuration_is_said_in_words() {
        let mut c = Config::new(0, 2, "10.0.0.1:29500");
        assert_eq!(c.auth(), JobAuth::Open { port: 29500 });
        assert_eq!(
            c.auth().to_string(),
            "open: any host that reaches port 29500 can join"
        );
        c.rendezvous = Rendezvous::TorchStore { prefix: "p".into() };
        assert_eq!(c.auth(), JobAuth::Store);
        c.job_token = Some("t".into());
        assert_eq!(c.auth().to_string(), "token (Config::job_token)");
        c.job_auth = JobAuth::Spawner;
        assert_eq!(c.auth().to_string(), "job secret from the spawner");
        c.job_auth = JobAuth::TokenFile("/run/tok".into());
        assert_eq!(c.auth().to_string(), "token file /run/tok");
        assert_eq!(Config::new(0, 1, "").auth(), JobAuth::Alone);
    }

    #[test]
    fn job_hash_depends_on_token() {
        let mut a = Config::new(0, 2, "h:1");
        let mut b = a.clone();
        assert_eq!(a.job_hash(), b.job_hash());
        a.job_token = Some("s3cret".into());
        b.job_token = Some("other".into());
        assert_ne!(a.job_hash(), b.job_hash());
    }
}
