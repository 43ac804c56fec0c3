//! The tune file: the constants `dspark tune` measured, per transport, as a small JSON
//! object that the communicator reads at init ([`parse_tune_file`]) and the tuner writes
//! ([`format_tune_file`]), with just enough of a JSON reader for it (no dependency).

use super::{Costs, Medium};

/// The tune file's format version.
pub const TUNE_FILE_VERSION: u32 = 1;

/// The constants in a tune file (`dspark tune` writes it; the communicator reads it at init):
/// a JSON object with `"version": 1` and one object per transport,
/// `"tcp": {"alpha_us": 4.1, "beta_us_per_byte": 0.0005, "gamma_us_per_byte": 0.0001,
/// "alpha_oversub_us": 9}`. Other keys (`"measured"`, notes) are ignored; a transport's
/// missing keys keep their defaults.
///
/// # Errors
/// What is wrong with the text (not JSON of that shape, another version, a constant that is
/// negative or not a number), as a sentence.
pub fn parse_tune_file(text: &str) -> Result<Vec<(Medium, Costs)>, String> {
    let mut p = Json {
        s: text.as_bytes(),
        i: 0,
    };
    let top = p.value(0)?;
    p.ws();
    if p.i != p.s.len() {
        return Err(format!(
            "unexpected text after the JSON object at byte {}",
            p.i
        ));
    }
    let JsonValue::Object(fields) = top else {
        return Err("expected a JSON object".into());
    };
    let mut version = None;
    let mut out = Vec::new();
    for (k, v) in &fields {
        if k == "version" {
            match v {
                JsonValue::Number(x) => version = Some(*x),
                _ => return Err("\"version\" must be a number".into()),
            }
            continue;
        }
        let Some(m) = Medium::from_name(k) else {
            continue;
        };
        let JsonValue::Object(consts) = v else {
            return Err(format!("\"{k}\" must be an object of constants"));
        };
        let mut c = Costs::defaults(m);
        for (name, val) in consts {
            let slot = match name.as_str() {
                "alpha_us" => &mut c.alpha_us,
                "beta_us_per_byte" => &mut c.beta_us_per_byte,
                "gamma_us_per_byte" => &mut c.gamma_us_per_byte,
                "alpha_oversub_us" => &mut c.alpha_oversub_us,
                _ => continue,
            };
            match val {
                JsonValue::Number(x) => *slot = *x,
                _ => return Err(format!("\"{k}\".\"{name}\" must be a number")),
            }
        }
        if !c.is_valid() {
            return Err(format!(
                "\"{k}\": constants must be finite, α and β positive, none negative ({c:?})"
            ));
        }
        out.push((m, c));
    }
    match version {
        Some(v) if v == f64::from(TUNE_FILE_VERSION) => Ok(out),
        Some(v) => Err(format!(
            "version {v}, this build reads version {TUNE_FILE_VERSION} (run `dspark tune` again)"
        )),
        None => Err("no \"version\"".into()),
    }
}

/// The tune file's text for `entries` ([`parse_tune_file`] reads it back), with `notes`
/// (key, text) pairs recorded beside the constants (what was measured, when, where).
pub fn format_tune_file(entries: &[(Medium, Costs)], notes: &[(&str, String)]) -> String {
    let esc = |s: &str| {
        s.replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', " ")
    };
    let mut out = format!("{{\n  \"version\": {TUNE_FILE_VERSION}");
    for (k, v) in notes {
        out += &format!(",\n  \"{}\": \"{}\"", esc(k), esc(v));
    }
    for (m, c) in entries {
        out += &format!(
            ",\n  \"{}\": {{\"alpha_us\": {:e}, \"beta_us_per_byte\": {:e}, \"gamma_us_per_byte\": {:e}, \"alpha_oversub_us\": {:e}}}",
            m.name(),
            c.alpha_us,
            c.beta_us_per_byte,
            c.gamma_us_per_byte,
            c.alpha_oversub_us
        );
    }
    out + "\n}\n"
}

enum JsonValue {
    Object(Vec<(String, JsonValue)>),
    Number(f64),
    Other,
}

/// Just enough JSON for the tune file: objects, strings, numbers, literals, arrays skipped.
struct Json<'a> {
    s: &'a [u8],
    i: usize,
}

impl Json<'_> {
    fn ws(&mut self) {
        while self.s.get(self.i).is_some_and(|c| c.is_ascii_whitespace()) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> Result<(), String> {
        self.ws();
        if self.s.get(self.i) == Some(&c) {
            self.i += 1;
            Ok(())
        } else {
            Err(format!("expected '{}' at byte {}", c as char, self.i))
        }
    }

    fn string(&mut self) -> Result<String, String> {
        self.eat(b'"')?;
        let mut out = Vec::new();
        loop {
            match self.s.get(self.i) {
                None => return Err("unterminated string".into()),
                Some(b'"') => {
                    self.i += 1;
                    return String::from_utf8(out).map_err(|_| "a string is not UTF-8".into());
                }
                Some(b'\\') => {
                    let c = *self.s.get(self.i + 1).ok_or("unterminated string")?;
                    out.push(c);
                    self.i += 2;
                }
                Some(&c) => {
                    out.push(c);
                    self.i += 1;
                }
            }
        }
    }

    fn value(&mut self, depth: usize) -> Result<JsonValue, String> {
        if depth > 8 {
            return Err("nested too deeply".into());
        }
        self.ws();
        match self.s.get(self.i) {
            Some(b'{') => {
                self.i += 1;
                let mut fields = Vec::new();
                self.ws();
                if self.s.get(self.i) == Some(&b'}') {
                    self.i += 1;
                    return Ok(JsonValue::Object(fields));
                }
                loop {
                    let k = self.string()?;
                    self.eat(b':')?;
                    let v = self.value(depth + 1)?;
                    fields.push((k, v));
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(JsonValue::Object(fields));
                        }
                        _ => return Err(format!("expected ',' or '}}' at byte {}", self.i)),
                    }
                }
            }
            Some(b'[') => {
                self.i += 1;
                self.ws();
                if self.s.get(self.i) == Some(&b']') {
                    self.i += 1;
                    return Ok(JsonValue::Other);
                }
                loop {
                    self.value(depth + 1)?;
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(JsonValue::Other);
                        }
                        _ => return Err(format!("expected ',' or ']' at byte {}", self.i)),
                    }
                }
            }
            Some(b'"') => self.string().map(|_| JsonValue::Other),
            Some(_) => {
                let start = self.i;
                while self
                    .s
                    .get(self.i)
                    .is_some_and(|c| c.is_ascii_alphanumeric() || b"+-.".contains(c))
                {
                    self.i += 1;
                }
                let word = std::str::from_utf8(&self.s[start..self.i]).unwrap_or("");
                match word {
                    "true" | "false" | "null" => Ok(JsonValue::Other),
                    _ => word
                        .parse::<f64>()
                        .map(JsonValue::Number)
                        .map_err(|_| format!("not a JSON value at byte {start}: {word:?}")),
                }
            }
            None => Err("unexpected end of the file".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tune_file_round_trips_and_bad_ones_are_refused_with_a_reason() {
        let tcp = Costs {
            alpha_us: 5.5,
            beta_us_per_byte: 4e-4,
            gamma_us_per_byte: 7e-5,
            alpha_oversub_us: 3.0,
        };
        let text = format_tune_file(
            &[
                (Medium::Tcp, tcp),
                (Medium::Shm, Costs::defaults(Medium::Shm)),
            ],
            &[("measured", "2 ranks \"tcp\", 1 MiB".into())],
        );
        let back = parse_tune_file(&text).unwrap();
        assert_eq!(
            back,
            vec![
                (Medium::Tcp, tcp),
                (Medium::Shm, Costs::defaults(Medium::Shm))
            ]
        );
        // Missing constants keep their defaults; unknown keys are ignored.
        let back =
            parse_tune_file(r#"{"version": 1, "x": [1, {"a": null}], "tcp": {"alpha_us": 2}}"#)
                .unwrap();
        assert_eq!(back[0].1.alpha_us, 2.0);
        assert_eq!(
            back[0].1.beta_us_per_byte,
            Costs::defaults(Medium::Tcp).beta_us_per_byte
        );
        for (bad, why) in [
            ("", "end"),
            ("{", "expected"),
            (r#"{"version": 2, "tcp": {}}"#, "version"),
            (r#"{"tcp": {}}"#, "version"),
            (r#"{"version": 1, "tcp": {"alpha_us": -1}}"#, "negative"),
            (
                r#"{"version": 1, "tcp": {"beta_us_per_byte": "fast"}}"#,
                "number",
            ),
            (r#"{"version": 1} trailing"#, "after"),
            ("[1, 2]", "object"),
        ] {
            let e = parse_tune_file(bad).expect_err(bad);
            assert!(e.contains(why), "{bad:?}: {e}");
        }
    }
}
