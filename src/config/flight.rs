//! The flight recorder's settings: `DSPARK_FR_ENTRIES` and `DSPARK_FR_DUMP`
//! ([`crate::engine::flight`]).

use std::path::PathBuf;

use crate::engine::flight::MAX_ENTRIES;
use crate::error::{Error, Result};

/// `(entries, dump directory)` from the environment; `default` entries when
/// `DSPARK_FR_ENTRIES` is unset or empty.
pub(super) fn from_env(
    get: &dyn Fn(&str) -> Option<String>,
    default: usize,
) -> Result<(usize, Option<PathBuf>)> {
    let entries = match get("DSPARK_FR_ENTRIES").filter(|v| !v.trim().is_empty()) {
        None => default,
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if n <= MAX_ENTRIES => n,
            _ => {
                return Err(Error::config(
                    "DSPARK_FR_ENTRIES",
                    format!(
                        "{v:?}: expected the number of operations the flight recorder keeps, \
                         0 (off) to {MAX_ENTRIES}"
                    ),
                ))
            }
        },
    };
    let dump = get("DSPARK_FR_DUMP")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    Ok((entries, dump))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(list: &[(&str, &str)]) -> Result<(usize, Option<PathBuf>)> {
        let list: Vec<(String, String)> = list
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        from_env(
            &|k| list.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()),
            2000,
        )
    }

    #[test]
    fn the_recorder_is_on_by_default_and_zero_turns_it_off() {
        assert_eq!(with(&[]).unwrap(), (2000, None));
        assert_eq!(with(&[("DSPARK_FR_ENTRIES", " 0 ")]).unwrap(), (0, None));
        assert_eq!(
            with(&[("DSPARK_FR_ENTRIES", "64"), ("DSPARK_FR_DUMP", "/tmp/fr")]).unwrap(),
            (64, Some(PathBuf::from("/tmp/fr")))
        );
    }

    #[test]
    fn a_bad_entry_count_names_the_variable() {
        for bad in ["-1", "many", "99999999999"] {
            let e = with(&[("DSPARK_FR_ENTRIES", bad)]).unwrap_err().to_string();
            assert!(e.contains("DSPARK_FR_ENTRIES"), "{e}");
        }
    }
}
