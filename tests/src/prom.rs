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

#[cfg(test)]
mod tests {
    use super::value;

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
