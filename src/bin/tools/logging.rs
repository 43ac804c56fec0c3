//! The command-line tools' log printer (`dspark`, `dspark-bench`): `DSPARK_LOG` directives
//! (default `warn`) to stderr, coloured only where stderr is a terminal, so that a log file
//! or a launcher's captured output holds plain text (`grep` on a cluster's logs); a value
//! that does not parse is said, not silently replaced.

use std::io::IsTerminal;

/// Installs the printer for `tool` (the name that prefixes its own complaint).
pub(crate) fn init(tool: &str) {
    let filter = match std::env::var("DSPARK_LOG") {
        Ok(v) if !v.trim().is_empty() => {
            tracing_subscriber::EnvFilter::try_new(&v).unwrap_or_else(|e| {
                eprintln!("{tool}: DSPARK_LOG={v:?} ignored ({e}); logging warnings");
                tracing_subscriber::EnvFilter::new("warn")
            })
        }
        _ => tracing_subscriber::EnvFilter::new("warn"),
    };
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(filter)
        .try_init();
}
