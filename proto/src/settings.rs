//! Conversions between the `RoutingSettings` message and
//! [`kvmesh_core::settings::RoutingSettings`] (the one declaration of the routing settings),
//! generated from the message's fields: a setting on one side and not on the other does not
//! compile (see `conversions!`).

use kvmesh_core::policy::PolicyKind;
use kvmesh_core::settings::{PdDecider, PdProtocol, RoutingSettings};

use crate::v1;

include!(concat!(env!("OUT_DIR"), "/routing_settings_fields.rs"));

/// A message the core settings cannot represent (a newer control plane's enum value).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SettingsError {
    #[error("routing setting `{field}`: unknown value {value}")]
    UnknownValue { field: &'static str, value: i32 },
}

/// How a setting's core type travels in the message: itself, an enum's number, or a list in
/// a message (as `optional` cannot wrap `repeated`).
trait Wire<W>: Sized {
    fn to_wire(self) -> W;
    fn from_wire(w: W, field: &'static str) -> Result<Self, SettingsError>;
}

impl<T> Wire<T> for T {
    fn to_wire(self) -> T {
        self
    }
    fn from_wire(w: T, _: &'static str) -> Result<T, SettingsError> {
        Ok(w)
    }
}

/// The enums travel as their numbers, which the core declares with their names
/// (`named_enum!`); the message's enums number the same values
/// (`every_enum_matches_its_message_enum`).
macro_rules! wire_by_number {
    ($($ty:ty),*) => {$(
        impl Wire<i32> for $ty {
            fn to_wire(self) -> i32 {
                self.number()
            }
            fn from_wire(value: i32, field: &'static str) -> Result<Self, SettingsError> {
                <$ty>::from_number(value).ok_or(SettingsError::UnknownValue { field, value })
            }
        }
    )*};
}

wire_by_number!(PolicyKind, PdDecider, PdProtocol);

/// A worker's PD protocol on the wire (`Worker.pd_protocol`).
pub fn pd_protocol_to_wire(p: PdProtocol) -> i32 {
    p.to_wire()
}

/// A worker's PD protocol from the wire: none for a value this build does not know (the
/// worker then speaks the deployment's).
pub fn pd_protocol_from_wire(value: i32) -> Option<PdProtocol> {
    PdProtocol::from_wire(value, "pd_protocol").ok()
}

impl Wire<v1::PathList> for Vec<String> {
    fn to_wire(self) -> v1::PathList {
        v1::PathList { paths: self }
    }
    fn from_wire(w: v1::PathList, _: &'static str) -> Result<Self, SettingsError> {
        Ok(w.paths)
    }
}

impl Wire<v1::StringList> for Vec<String> {
    fn to_wire(self) -> v1::StringList {
        v1::StringList { values: self }
    }
    fn from_wire(w: v1::StringList, _: &'static str) -> Result<Self, SettingsError> {
        Ok(w.values)
    }
}

/// Both conversions, field for field, from the message's field list (`build.rs`). Each names
/// every field of the struct it builds (no `..`), so a setting in the core struct and not in
/// the message ("missing field `x` in initializer of `RoutingSettings`"), or the reverse ("no
/// field `x` on type `&RoutingSettings`"), or of another type ("`Wire<..>` is not
/// implemented"), does not compile.
macro_rules! conversions {
    ($($field:ident = $number:literal,)*) => {
        impl From<&RoutingSettings> for v1::RoutingSettings {
            fn from(s: &RoutingSettings) -> Self {
                Self { $($field: s.$field.clone().map(Wire::to_wire),)* }
            }
        }

        impl TryFrom<v1::RoutingSettings> for RoutingSettings {
            type Error = SettingsError;

            fn try_from(m: v1::RoutingSettings) -> Result<Self, SettingsError> {
                Ok(Self { $($field: m.$field.map(|w| Wire::from_wire(w, stringify!($field))).transpose()?,)* })
            }
        }
    };
}

routing_settings_fields!(conversions);

#[cfg(test)]
mod tests {
    use super::*;

    /// A value for a setting of this type, from its field number: distinct where the type allows.
    trait Sample {
        fn sample(n: u32) -> Self;
    }
    impl Sample for u64 {
        fn sample(n: u32) -> Self {
            1000 + u64::from(n)
        }
    }
    impl Sample for u32 {
        fn sample(n: u32) -> Self {
            2000 + n
        }
    }
    impl Sample for i64 {
        fn sample(n: u32) -> Self {
            -i64::from(n)
        }
    }
    impl Sample for f64 {
        fn sample(n: u32) -> Self {
            f64::from(n) + 0.25
        }
    }
    impl Sample for bool {
        fn sample(n: u32) -> Self {
            n % 2 == 1
        }
    }
    impl Sample for String {
        fn sample(n: u32) -> Self {
            format!("s{n}")
        }
    }
    impl Sample for Vec<String> {
        fn sample(n: u32) -> Self {
            vec![format!("/a{n}"), format!("/b{n}/*")]
        }
    }
    impl Sample for PolicyKind {
        fn sample(n: u32) -> Self {
            PolicyKind::ALL[n as usize % PolicyKind::ALL.len()]
        }
    }
    impl Sample for PdDecider {
        fn sample(n: u32) -> Self {
            PdDecider::ALL[n as usize % PdDecider::ALL.len()]
        }
    }
    impl Sample for PdProtocol {
        fn sample(n: u32) -> Self {
            PdProtocol::ALL[n as usize % PdProtocol::ALL.len()]
        }
    }

    macro_rules! from_the_message {
        ($($field:ident = $number:literal,)*) => {
            /// Every setting set, each to a value of its own.
            fn everything() -> RoutingSettings {
                RoutingSettings { $($field: Some(Sample::sample($number)),)* }
            }

            /// The message's fields, `(name, number)`, in kvmesh.proto's order.
            const MESSAGE_FIELDS: &[(&str, u32)] = &[$((stringify!($field), $number),)*];
        };
    }
    routing_settings_fields!(from_the_message);

    #[test]
    fn every_field_survives_the_round_trip_through_bytes() {
        use prost::Message;
        let s = everything();
        let keys = serde_json::to_value(&s).unwrap().as_object().unwrap().len();
        assert_eq!(keys, RoutingSettings::FIELDS.len(), "the sample sets every field");
        let bytes = v1::RoutingSettings::from(&s).encode_to_vec();
        let back = RoutingSettings::try_from(v1::RoutingSettings::decode(bytes.as_slice()).unwrap()).unwrap();
        let (sent, got) = (serde_json::to_value(&s).unwrap(), serde_json::to_value(&back).unwrap());
        for field in RoutingSettings::FIELDS {
            assert_eq!(sent.get(field), got.get(field), "routing setting `{field}` does not survive the message");
        }
        assert_eq!(back, s);
        let empty = RoutingSettings::default();
        assert_eq!(RoutingSettings::try_from(v1::RoutingSettings::from(&empty)).unwrap(), empty);
    }

    /// Checks that the core's `$core` and the message's `$wire` (values `$prefix` + the
    /// name in capitals) hold the same values under the same numbers, and that each value
    /// round-trips through its name, serde and the wire.
    macro_rules! same_enum {
        ($core:ty, $wire:ty, $prefix:literal, $field:literal) => {{
            let mut numbers = std::collections::BTreeSet::new();
            for v in <$core>::ALL {
                let n: i32 = v.to_wire();
                assert!(numbers.insert(n), "{v} shares {n}");
                assert_eq!(<$core>::from_wire(n, $field), Ok(v));
                assert_eq!(v.name().parse::<$core>(), Ok(v));
                assert_eq!(serde_json::from_value::<$core>(serde_json::to_value(v).unwrap()).unwrap(), v);
                let wire = <$wire>::try_from(n).unwrap_or_else(|_| panic!("{v} ({n}) is not in kvmesh.proto"));
                let name = format!("{}{}", $prefix, v.name().to_uppercase().replace('-', "_"));
                assert_eq!(wire.as_str_name(), name, "{v}'s number in kvmesh.proto");
            }
            for n in 1..=64 {
                if let Ok(w) = <$wire>::try_from(n) {
                    assert!(
                        numbers.contains(&n),
                        "kvmesh.proto's {} is not in the core's {}",
                        w.as_str_name(),
                        stringify!($core)
                    );
                }
            }
            assert_eq!(<$wire>::try_from(0).map(|w| w.as_str_name()), Ok(concat!($prefix, "UNSPECIFIED")));
        }};
    }

    #[test]
    fn every_enum_matches_its_message_enum() {
        same_enum!(PolicyKind, v1::Policy, "POLICY_", "policy");
        same_enum!(PdDecider, v1::PdDecider, "PD_DECIDER_", "pd_decider");
        same_enum!(PdProtocol, v1::PdProtocol, "PD_PROTOCOL_", "pd_protocol");
    }

    #[test]
    fn unknown_enum_values_are_errors_naming_the_field() {
        let m = v1::RoutingSettings { decode_policy: Some(42), ..Default::default() };
        assert_eq!(
            RoutingSettings::try_from(m).unwrap_err(),
            SettingsError::UnknownValue { field: "decode_policy", value: 42 }
        );
        let m = v1::RoutingSettings { pd_decider: Some(0), ..Default::default() };
        assert!(RoutingSettings::try_from(m).unwrap_err().to_string().contains("`pd_decider`"));
    }

    /// Wire numbers never change: setting i of `routing_settings!` is field i + 1 of the
    /// message, so a new setting goes last in both.
    #[test]
    fn the_message_numbers_the_core_fields_in_their_order() {
        let names: Vec<&str> = MESSAGE_FIELDS.iter().map(|&(name, _)| name).collect();
        assert_eq!(names, RoutingSettings::FIELDS, "the same settings in the same order");
        for (i, &(name, number)) in MESSAGE_FIELDS.iter().enumerate() {
            assert_eq!(number, i as u32 + 1, "`{name}`'s field number");
        }
    }
}
