//! dspark's log on stderr for programs that have no tracing subscriber of their own: a Python
//! process (`dspark._dspark` installs it at import) and a C program
//! (`dspark_comm_init_from_env`). Without it, every degraded path those programs take (GPUDirect
//! falling back to staging, device calls run as blocking ones, a forced algorithm that does not
//! apply) went unseen. The binaries keep tracing-subscriber's printer.
//!
//! No thread-locals: an event raised from a C `atexit` handler, after glibc destroyed the
//! thread's locals, still prints (tracing-subscriber's printer formats into a thread-local
//! buffer and panicked there). One `write` per line, so ranks sharing a pipe do not interleave
//! within a line.

use std::fmt::Write as _;
use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::{span, Event, Level, Metadata, Subscriber};

/// `DSPARK_LOG` as this printer reads it: comma-separated directives, each a level for every
/// target (`warn`) or `target=level` for a target and the modules under it
/// (`dspark::transport=debug`); the longest matching target wins; levels `off`, `error`,
/// `warn`, `info`, `debug`, `trace`. A directive it cannot read is ignored, and said so once
/// on stderr when the printer is installed ([`Directives::ignored`]). Default: `warn`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Directives {
    default: LevelFilter,
    targets: Vec<(String, LevelFilter)>,
    ignored: Vec<String>,
}

impl Directives {
    /// Parses `DSPARK_LOG`'s value (`None`: unset).
    pub fn parse(s: Option<&str>) -> Self {
        let mut d = Directives {
            default: LevelFilter::WARN,
            targets: Vec::new(),
            ignored: Vec::new(),
        };
        // (`LevelFilter::from_str` reads "" as `error`: empty parts are skipped.)
        for part in s.unwrap_or("").split(',').map(str::trim) {
            match part.split_once('=') {
                _ if part.is_empty() => {}
                Some((t, l)) => {
                    let (t, l) = (t.trim(), l.trim());
                    match (t.is_empty(), l.is_empty(), l.parse()) {
                        (false, false, Ok(l)) => d.targets.push((t.to_string(), l)),
                        _ => d.ignored.push(part.to_string()),
                    }
                }
                None => match part.parse::<LevelFilter>() {
                    Ok(l) => d.default = l,
                    Err(_) => d.ignored.push(part.to_string()),
                },
            }
        }
        d
    }

    /// The directives it could not read (a typo such as `dspark=degub`), which it ignored.
    pub fn ignored(&self) -> &[String] {
        &self.ignored
    }

    /// Whether an event of `level` from `target` prints.
    pub fn allows(&self, target: &str, level: &Level) -> bool {
        let under =
            |t: &str| target == t || (target.starts_with(t) && target[t.len()..].starts_with("::"));
        let filter = self
            .targets
            .iter()
            .filter(|(t, _)| under(t))
            .max_by_key(|(t, _)| t.len())
            .map_or(self.default, |(_, l)| *l);
        *level <= filter
    }

    /// The most verbose level any directive lets through.
    pub fn max(&self) -> LevelFilter {
        self.targets
            .iter()
            .map(|(_, l)| *l)
            .fold(self.default, LevelFilter::max)
    }
}

/// The printer: `2026-12-06T03:15:30.125177Z  WARN dspark::engine: message key=value`.
#[derive(Debug)]
struct Stderr {
    directives: Directives,
}

/// Collects an event's message and its other fields.
struct Line<'a> {
    message: &'a mut String,
    fields: &'a mut String,
}

impl Visit for Line<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={value}", field.name());
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={value:?}", field.name());
        }
    }
}

impl Subscriber for Stderr {
    fn enabled(&self, m: &Metadata<'_>) -> bool {
        self.directives.allows(m.target(), m.level())
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(self.directives.max())
    }

    fn new_span(&self, _: &span::Attributes<'_>) -> span::Id {
        span::Id::from_u64(1)
    }

    fn record(&self, _: &span::Id, _: &span::Record<'_>) {}

    fn record_follows_from(&self, _: &span::Id, _: &span::Id) {}

    fn event(&self, e: &Event<'_>) {
        let m = e.metadata();
        let (mut message, mut fields) = (String::new(), String::new());
        e.record(&mut Line {
            message: &mut message,
            fields: &mut fields,
        });
        let line = format!(
            "{} {:>5} {}: {message}{fields}\n",
            utc_now(),
            m.level(),
            m.target()
        );
        let _ = std::io::stderr().write_all(line.as_bytes());
    }

    fn enter(&self, _: &span::Id) {}

    fn exit(&self, _: &span::Id) {}
}

/// Now as `YYYY-MM-DDTHH:MM:SS.ffffffZ` (UTC).
fn utc_now() -> String {
    let t = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let secs = t.as_secs();
    let (y, mo, d) = civil_from_days((secs / 86_400) as i64);
    let s = secs % 86_400;
    format!(
        "{y:04}-{mo:02}-{d:02}T{:02}:{:02}:{:02}.{:06}Z",
        s / 3600,
        s / 60 % 60,
        s % 60,
        t.subsec_micros()
    )
}

/// The proleptic Gregorian date of `days` since 1970-01-01 (Howard Hinnant's
/// `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// Installs the printer as the process's tracing subscriber, with `DSPARK_LOG` read at the
/// first call (later calls do nothing); does nothing where `DSPARK_LOG=off`, or where this
/// library's tracing already has a subscriber (installed by the Rust program this library is
/// linked into).
pub fn install() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let directives = Directives::parse(std::env::var("DSPARK_LOG").ok().as_deref());
        if !directives.ignored().is_empty() {
            // Not through the printer: it may be off, and a typo must not pass unseen.
            let _ = writeln!(
                std::io::stderr(),
                "dspark: DSPARK_LOG: ignored what is not a level or target=level: {:?}",
                directives.ignored()
            );
        }
        if directives.max() != LevelFilter::OFF {
            let _ = tracing::subscriber::set_global_default(Stderr { directives });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directives_choose_the_most_specific_target_and_default_to_warn() {
        let d = Directives::parse(None);
        assert!(d.allows("dspark::engine", &Level::WARN));
        assert!(d.allows("other", &Level::ERROR));
        assert!(!d.allows("dspark::engine", &Level::INFO));
        assert_eq!(d.max(), LevelFilter::WARN);

        let d = Directives::parse(Some("error, dspark=debug,dspark::transport=trace,junk=,=x"));
        assert!(d.allows("dspark", &Level::DEBUG));
        assert!(d.allows("dspark::engine", &Level::DEBUG));
        assert!(!d.allows("dspark::engine", &Level::TRACE));
        assert!(d.allows("dspark::transport::tcp", &Level::TRACE));
        // A prefix that is not a module boundary does not match.
        assert!(!d.allows("dsparkle", &Level::WARN));
        assert!(d.allows("dsparkle", &Level::ERROR));
        assert_eq!(d.max(), LevelFilter::TRACE);

        // Unreadable directives change nothing: the default stays; they are kept to be said.
        let junk = Directives::parse(Some(",, junk=, =debug, loud"));
        assert_eq!(junk.ignored(), ["junk=", "=debug", "loud"]);
        assert_eq!(
            Directives {
                ignored: Vec::new(),
                ..junk
            },
            Directives::parse(None)
        );
        assert!(Directives::parse(Some("dspark=debug")).ignored().is_empty());
        let d = Directives::parse(Some("off"));
        assert_eq!(d.max(), LevelFilter::OFF);
        assert!(!d.allows("dspark", &Level::ERROR));
        let d = Directives::parse(Some("off,dspark::comm=info"));
        assert!(d.allows("dspark::comm::setup", &Level::INFO));
        assert!(!d.allows("dspark::engine", &Level::ERROR));
    }

    #[test]
    fn dates_are_the_calendars() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_793), (2026, 12, 6));
        assert_eq!(civil_from_days(20_818), (2026, 12, 31));
        assert_eq!(civil_from_days(20_819), (2027, 1, 1));
    }
}
