//! Reading values out of Prometheus text (Envoy's `/stats/prometheus`, `kvmesh-cp`'s
//! `/metrics`).

/// The value of the first sample named `name` (any labels) in `text`.
pub fn value(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|line| {
        let rest = line.strip_prefix(name)?;
        let rest = match rest.strip_prefix('{') {
            Some(labelled) => labelled.split_once('}')?.1,
            None => rest,
        };
        // The name must end here (not be a prefix of a longer name).
        if !rest.starts_with([' ', '\t']) {
            return None;
        }
        rest.split_whitespace().next()?.parse().ok()
    })
}

/// One sample of the text format: its name, its labels (values unescaped) and its value.
#[derive(Debug, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

/// Every sample of `text`, read as strictly as a scraper reads them: a line that is neither a
/// comment nor one well-formed sample (name, `{label="value",...}` with `\\`, `\"` and `\n`
/// the only escapes, a value) is an error naming it.
pub fn samples(text: &str) -> Result<Vec<Sample>, String> {
    text.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| sample(l).ok_or_else(|| l.to_string()))
        .collect()
}

fn sample(line: &str) -> Option<Sample> {
    let name_end = line.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')).unwrap_or(line.len());
    let (name, mut rest) = line.split_at(name_end);
    if name.is_empty() || name.starts_with(|c: char| c.is_ascii_digit()) {
        return None;
    }
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        let mut chars = after.char_indices();
        loop {
            let (start, c) = chars.next()?;
            if c == '}' {
                rest = after.get(start + 1..)?;
                break;
            }
            let eq = after.get(start..)?.find('=')? + start;
            let key = after.get(start..eq)?;
            if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return None;
            }
            while chars.next()?.0 < eq {}
            if chars.next()?.1 != '"' {
                return None;
            }
            let mut value = String::new();
            loop {
                match chars.next()?.1 {
                    '"' => break,
                    '\\' => value.push(match chars.next()?.1 {
                        '\\' => '\\',
                        '"' => '"',
                        'n' => '\n',
                        _ => return None,
                    }),
                    '\n' => return None,
                    c => value.push(c),
                }
            }
            labels.push((key.to_string(), value));
            let mut peek = chars.clone();
            if peek.next()?.1 == ',' {
                chars = peek;
            }
        }
    }
    let mut fields = rest.strip_prefix(' ')?.split(' ');
    let value = fields.next()?.parse().ok()?;
    if fields.next().is_some_and(|t| t.parse::<i64>().is_err()) || fields.next().is_some() {
        return None;
    }
    Some(Sample { name: name.to_string(), labels, value })
}

#[cfg(test)]
mod tests {
    use super::{samples, value};

    #[test]
    fn samples_are_read_strictly() {
        let text = "# HELP x y\na_total 3\nb{x=\"1\",y=\"q\\\"\\\\\\n\"} 2.5\nc{} 4 17\n";
        let got = samples(text).unwrap();
        assert_eq!(got.len(), 3);
        assert_eq!(got[1].labels, vec![("x".into(), "1".into()), ("y".into(), "q\"\\\n".into())]);
        for bad in ["a{x=\"1} 2", "a{x=\"\\q\"} 1", "a 1 2 3", "{x=\"1\"} 1", "a{x=1} 1", "a"] {
            assert!(samples(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn finds_plain_and_labelled_samples_by_exact_name() {
        let text = "# TYPE a counter\na_total 3\na 7 1700000000\nb{x=\"1\",y=\"2\"} 2.5\nc{} 4\n";
        assert_eq!(value(text, "a"), Some(7.0));
        assert_eq!(value(text, "a_total"), Some(3.0));
        assert_eq!(value(text, "b"), Some(2.5));
        assert_eq!(value(text, "c"), Some(4.0));
        assert_eq!(value(text, "d"), None);
    }
}
