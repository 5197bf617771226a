//! Request priority (issue 47): four classes, the arithmetic of their reserved slots and the
//! headers a priority comes in.
//!
//! A priority is an integer, as llm-d's `InferenceObjective` gives it: below 0 sheddable, 0 the
//! default, 1 interactive, 2 and above system. SMG's `x-smg-priority` class names map onto the
//! same scale (`bulk`, the class SMG evicts first, is sheddable). Four classes keep every label
//! set and every shared record bounded.
//!
//! Under a concurrency limit ([`crate::admission`]) a class may hold reserved slots: no request
//! of a lower class takes a slot while the reserve of a class above it is not in use. A higher
//! class goes ahead of queued lower ones; a sheddable request never queues.

/// The number of classes: every per-class table has this many entries.
pub const CLASSES: usize = 4;

/// kvmesh's own priority header (an integer). Not `x-kvmesh-*`: Envoy removes those from
/// clients before routing (SPEC), and RFC 6648 retires the `x-` prefix for new names.
pub const PRIORITY_HEADER: &str = "kvmesh-priority";
/// SMG's priority header: a class name (or an integer, read as kvmesh's).
pub const SMG_PRIORITY_HEADER: &str = "x-smg-priority";

/// The Gateway API Inference Extension's header naming a request's InferenceObjective, whose
/// priority ([`parse_objectives`]) gives the class when neither priority header does.
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";
/// The most objectives a configuration may name.
pub const MAX_OBJECTIVES: usize = 1024;
/// The longest objective name (a Kubernetes object name).
pub const MAX_OBJECTIVE_NAME: usize = 253;

/// A request's class, lowest first.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// Priority below 0 (SMG's `bulk`): refused, never queued, when no slot is free.
    Sheddable = 0,
    /// Priority 0 (SMG's `default`): a request that says nothing.
    #[default]
    Default = 1,
    /// Priority 1 (SMG's `interactive`).
    Interactive = 2,
    /// Priority 2 and above (SMG's `system`).
    System = 3,
}

impl Class {
    /// Every class, lowest first (its index is its position).
    pub const ALL: [Class; CLASSES] = [Class::Sheddable, Class::Default, Class::Interactive, Class::System];

    /// The class of an integer priority.
    pub fn of_priority(p: i64) -> Self {
        match p {
            ..=-1 => Class::Sheddable,
            0 => Class::Default,
            1 => Class::Interactive,
            _ => Class::System,
        }
    }

    /// Its position in per-class tables.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The label and record value (SMG's names, `sheddable` for below 0).
    pub fn name(self) -> &'static str {
        match self {
            Class::Sheddable => "sheddable",
            Class::Default => "default",
            Class::Interactive => "interactive",
            Class::System => "system",
        }
    }

    /// A class by its name (settings) or SMG's (`bulk`).
    pub fn parse(name: &str) -> Option<Self> {
        match name.trim().to_ascii_lowercase().as_str() {
            "sheddable" | "bulk" => Some(Class::Sheddable),
            "default" => Some(Class::Default),
            "interactive" => Some(Class::Interactive),
            "system" => Some(Class::System),
            _ => None,
        }
    }

    /// A priority header's value: an integer (at most 20 characters) or a class name; anything
    /// else says nothing.
    pub fn from_header(value: &str) -> Option<Self> {
        let v = value.trim();
        if v.is_empty() || v.len() > 20 {
            return None;
        }
        match v.parse::<i64>() {
            Ok(p) => Some(Self::of_priority(p)),
            Err(_) => Self::parse(v),
        }
    }

    /// The class of a request from its headers' values: kvmesh's header, else SMG's, else the
    /// default. A value that cannot be read counts as absent.
    pub fn from_headers(kvmesh: Option<&str>, smg: Option<&str>) -> Self {
        Self::from_priority_headers(kvmesh, smg).unwrap_or_default()
    }

    /// What the priority headers say (kvmesh's first), if they say anything readable.
    pub fn from_priority_headers(kvmesh: Option<&str>, smg: Option<&str>) -> Option<Self> {
        kvmesh.and_then(Self::from_header).or_else(|| smg.and_then(Self::from_header))
    }

    /// The class of the InferenceObjective `name` among `objectives` (none: not one of them).
    pub fn of_objective(objectives: &[(String, i64)], name: &str) -> Option<Self> {
        let name = name.trim();
        objectives.iter().find(|(n, _)| n == name).map(|(_, p)| Self::of_priority(*p))
    }
}

/// Whether `name` can be an InferenceObjective's name: 1 to [`MAX_OBJECTIVE_NAME`] lowercase
/// letters, digits, `-` and `.` (a Kubernetes object name).
pub fn valid_objective(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_OBJECTIVE_NAME
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

/// Parses `name=N` entries (`priority_objective`): at most [`MAX_OBJECTIVES`], one per name,
/// N an integer priority within ±1,000,000 (GIE's `spec.priority`).
pub fn parse_objectives(entries: &[String]) -> Result<Vec<(String, i64)>, String> {
    if entries.len() > MAX_OBJECTIVES {
        return Err(format!("{} entries: at most {MAX_OBJECTIVES}", entries.len()));
    }
    let mut out: Vec<(String, i64)> = Vec::with_capacity(entries.len());
    for entry in entries {
        let (name, p) = entry.rsplit_once('=').ok_or_else(|| format!("`{entry}` is not name=N"))?;
        let name = name.trim();
        if !valid_objective(name) {
            return Err(format!("`{name}` is not an InferenceObjective name"));
        }
        let p: i64 = p.trim().parse().map_err(|_| format!("`{}` is not an integer priority", p.trim()))?;
        if p.unsigned_abs() > 1_000_000 {
            return Err(format!("priority {p} of `{name}` is not within ±1000000"));
        }
        if out.iter().any(|(n, _)| n == name) {
            return Err(format!("objective `{name}` given twice"));
        }
        out.push((name.to_string(), p));
    }
    Ok(out)
}

/// What each class is given under the concurrency limit (all zero/none: one FIFO as before,
/// where only sheddable requests differ).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClassLimits {
    /// Slots no lower class may take while this class does not use them.
    pub reserved: [u32; CLASSES],
    /// A class's own queue bound (none: it shares `queue_size` with the other classes).
    pub queue_size: [Option<u32>; CLASSES],
    /// A class's own queue timeout in ms (none: `queue_timeout_ms`).
    pub queue_timeout_ms: [Option<u64>; CLASSES],
}

/// Parses `class=N` entries (settings such as `priority_reserved`), one per class at most.
pub fn parse_per_class(field: &str, entries: &[String]) -> Result<[Option<u64>; CLASSES], String> {
    let mut out = [None; CLASSES];
    for entry in entries {
        let (name, n) = entry.split_once('=').ok_or_else(|| format!("{field}: `{entry}` is not class=N"))?;
        let class = Class::parse(name).ok_or_else(|| {
            format!("{field}: unknown class `{}` (sheddable, default, interactive, system)", name.trim())
        })?;
        let n: u64 = n.trim().parse().map_err(|_| format!("{field}: `{}` is not a whole number", n.trim()))?;
        let slot = out.get_mut(class.index()).ok_or_else(|| format!("{field}: no such class"))?;
        if slot.replace(n).is_some() {
            return Err(format!("{field}: class `{}` given twice", class.name()));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn priorities_and_smg_names_map_to_four_classes() {
        assert_eq!(Class::from_header("-5"), Some(Class::Sheddable));
        assert_eq!(Class::from_header(" 0 "), Some(Class::Default));
        assert_eq!(Class::from_header("1"), Some(Class::Interactive));
        assert_eq!(Class::from_header("100"), Some(Class::System));
        assert_eq!(Class::from_header("BULK"), Some(Class::Sheddable));
        assert_eq!(Class::from_header("interactive"), Some(Class::Interactive));
        assert_eq!(Class::from_header("urgent"), None);
        assert_eq!(Class::from_header(&"9".repeat(40)), None, "long values are not read");
        assert_eq!(Class::from_headers(Some("junk"), Some("system")), Class::System);
        assert_eq!(Class::from_headers(Some("-1"), Some("system")), Class::Sheddable, "kvmesh's first");
        assert_eq!(Class::from_headers(None, None), Class::Default);
    }

    #[test]
    fn objectives_give_a_class_by_name_and_refuse_garbage() {
        let o = parse_objectives(&["batch=-1".into(), " chat.v2 = 1".into(), "critical=5".into()]).unwrap();
        assert_eq!(Class::of_objective(&o, "batch"), Some(Class::Sheddable));
        assert_eq!(Class::of_objective(&o, " chat.v2 "), Some(Class::Interactive));
        assert_eq!(Class::of_objective(&o, "critical"), Some(Class::System));
        assert_eq!(Class::of_objective(&o, "Batch"), None, "names are exact");
        assert_eq!(Class::of_objective(&o, "unknown"), None);
        assert_eq!(Class::from_priority_headers(Some("junk"), None), None);
        for bad in ["batch", "Batch=1", "=1", "a b=1", "batch=x", "batch=2000000", "a;b=1"] {
            assert!(parse_objectives(&[bad.into()]).is_err(), "{bad}");
        }
        let long = format!("{}=1", "a".repeat(MAX_OBJECTIVE_NAME + 1));
        assert!(parse_objectives(&[long]).is_err());
        assert!(parse_objectives(&["a=1".into(), "a=2".into()]).unwrap_err().contains("twice"));
        let many: Vec<String> = (0..=MAX_OBJECTIVES).map(|i| format!("o{i}=0")).collect();
        assert!(parse_objectives(&many).unwrap_err().contains("at most"));
    }

    #[test]
    fn per_class_entries_parse_and_refuse_garbage() {
        let ok = parse_per_class("f", &["interactive=2".into(), " system = 1".into()]).unwrap();
        assert_eq!(ok, [None, None, Some(2), Some(1)]);
        assert!(parse_per_class("f", &["vip=1".into()]).unwrap_err().contains("unknown class"));
        assert!(parse_per_class("f", &["system".into()]).is_err());
        assert!(parse_per_class("f", &["system=-1".into()]).is_err());
        assert!(parse_per_class("f", &["system=1".into(), "system=2".into()]).unwrap_err().contains("twice"));
    }
}
