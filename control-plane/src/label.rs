//! Label values as the Prometheus text format requires them. prometheus-client 0.24 writes a
//! label value as it is, so a worker that announced a model name with a quote, a backslash or
//! a newline would end the value (or the line) early and add series of its own to `/metrics`.
//! Every label that a worker or a gateway can choose goes through [`LabelValue`].

use std::fmt::Write;

use prometheus_client::encoding::{EncodeLabelValue, LabelValueEncoder};

/// A label value, escaped when encoded: `\` as `\\`, `"` as `\"`, a line feed as `\n`.
#[derive(Clone, Debug, Default, Hash, PartialEq, Eq)]
pub struct LabelValue(String);

impl From<String> for LabelValue {
    fn from(s: String) -> Self {
        Self(s)
    }
}

impl From<&str> for LabelValue {
    fn from(s: &str) -> Self {
        Self(s.to_string())
    }
}

impl EncodeLabelValue for LabelValue {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        let mut rest = self.0.as_str();
        while let Some(at) = rest.find(['\\', '"', '\n']) {
            let (plain, tail) = rest.split_at(at);
            encoder.write_str(plain)?;
            let mut chars = tail.chars();
            encoder.write_str(match chars.next() {
                Some('\\') => "\\\\",
                Some('"') => "\\\"",
                _ => "\\n",
            })?;
            rest = chars.as_str();
        }
        encoder.write_str(rest)
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;
    use prometheus_client::encoding::EncodeLabelSet;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::registry::Registry;

    use super::LabelValue;

    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct Labels {
        model: LabelValue,
    }

    #[test]
    fn hostile_values_stay_inside_their_label() {
        let mut registry = Registry::default();
        let family = Family::<Labels, Gauge>::default();
        registry.register("kvmesh_worker_model", "help", family.clone());
        let hostile = "m\"} 1\nkvmesh_injected_total{a=\"b\\";
        family.get_or_create(&Labels { model: hostile.into() }).set(1);
        family.get_or_create(&Labels { model: "plain/model-1".into() }).set(1);
        let mut out = String::new();
        encode(&mut out, &registry).unwrap();
        let samples: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(samples.len(), 2, "{out}");
        assert!(samples.iter().all(|l| l.starts_with("kvmesh_worker_model{model=\"")), "{out}");
        assert!(out.contains(r#"{model="m\"} 1\nkvmesh_injected_total{a=\"b\\"} 1"#), "{out}");
        assert!(out.contains(r#"{model="plain/model-1"} 1"#), "{out}");
    }
}
