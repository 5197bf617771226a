//! Enums that travel by name: [`named_enum!`] declares one from a single table (variant, wire
//! number, name), and derives from it everything that names its values: `ALL`, `name()`,
//! `Display`, `FromStr` (an unknown name is an error listing the known ones), serde through
//! the names (plugin JSON, `--config` YAML), and the wire number (`number()`,
//! `from_number()`) that `kvmesh-proto` converts through. The protobuf enum in
//! `proto/kvmesh.proto` numbers the same values; `kvmesh-proto`'s tests compare the two.
//!
//! Used for [`crate::policy::PolicyKind`], [`crate::settings::PdDecider`] and
//! [`crate::pd_protocol::PdProtocol`].

/// Declares a `Copy` enum from one table: `Variant = wire number => "name",` per value. `as
/// "what"` names the kind of value in messages; an optional `hint = f;` (`fn(&str) ->
/// Option<&'static str>`) explains a refused name better than "unknown".
macro_rules! named_enum {
    (
        $(#[$attr:meta])*
        $vis:vis enum $ty:ident as $what:literal {
            $($(#[$vattr:meta])* $variant:ident = $number:literal => $name:literal,)+
        }
        $(hint = $hint:path;)?
    ) => {
        $(#[$attr])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        $vis enum $ty {
            $($(#[$vattr])* $variant = $number,)+
        }

        impl $ty {
            /// Every value, in declaration order.
            pub const ALL: [$ty; [$($name),+].len()] = [$(Self::$variant),+];

            /// The value's name: flags, plugin JSON, YAML, metrics and logs.
            pub fn name(self) -> &'static str {
                match self {
                    $(Self::$variant => $name,)+
                }
            }

            /// The value's number in kvmesh.proto's enum of the same values.
            pub fn number(self) -> i32 {
                self as i32
            }

            /// The value numbered `n` in kvmesh.proto; none for 0 (unspecified) and numbers
            /// this build does not know.
            pub fn from_number(n: i32) -> Option<Self> {
                Self::ALL.into_iter().find(|v| v.number() == n)
            }

            /// The known names, comma-separated (for messages).
            fn names() -> String {
                Self::ALL.map(Self::name).join(", ")
            }
        }

        impl ::std::fmt::Display for $ty {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.name())
            }
        }

        impl ::std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<Self, String> {
                Self::ALL.into_iter().find(|v| v.name() == s).ok_or_else(|| {
                    let hint: Option<&'static str> = None $(.or_else(|| $hint(s)))?;
                    match hint {
                        Some(why) => format!("`{s}` {why} (expected one of {})", Self::names()),
                        None => format!("unknown {} `{s}` (expected one of {})", $what, Self::names()),
                    }
                })
            }
        }

        impl ::serde::Serialize for $ty {
            fn serialize<S: ::serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.name())
            }
        }

        impl<'de> ::serde::Deserialize<'de> for $ty {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct Name;
                impl ::serde::de::Visitor<'_> for Name {
                    type Value = $ty;
                    fn expecting(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                        write!(f, "a {} ({})", $what, $ty::names())
                    }
                    fn visit_str<E: ::serde::de::Error>(self, v: &str) -> Result<$ty, E> {
                        v.parse().map_err(E::custom)
                    }
                }
                d.deserialize_str(Name)
            }
        }
    };
}

pub(crate) use named_enum;

#[cfg(test)]
mod tests {
    named_enum! {
        /// A test enum.
        enum Fruit as "fruit" {
            Apple = 1 => "apple",
            /// Documented.
            BloodOrange = 3 => "blood-orange",
        }
        hint = refused;
    }

    fn refused(s: &str) -> Option<&'static str> {
        (s == "tomato").then_some("is a vegetable here")
    }

    #[test]
    fn one_table_gives_names_numbers_parsing_and_serde() {
        assert_eq!(Fruit::ALL, [Fruit::Apple, Fruit::BloodOrange]);
        for f in Fruit::ALL {
            assert_eq!(f.name().parse::<Fruit>(), Ok(f));
            assert_eq!(f.to_string(), f.name());
            assert_eq!(Fruit::from_number(f.number()), Some(f));
            let json = serde_json::to_string(&f).unwrap();
            assert_eq!(json, format!("\"{}\"", f.name()));
            assert_eq!(serde_json::from_str::<Fruit>(&json).unwrap(), f);
        }
        assert_eq!((Fruit::BloodOrange.number(), Fruit::from_number(0), Fruit::from_number(2)), (3, None, None));
        assert_eq!("kiwi".parse::<Fruit>().unwrap_err(), "unknown fruit `kiwi` (expected one of apple, blood-orange)");
        assert_eq!(
            "tomato".parse::<Fruit>().unwrap_err(),
            "`tomato` is a vegetable here (expected one of apple, blood-orange)"
        );
        let e = serde_json::from_str::<Fruit>("3").unwrap_err().to_string();
        assert!(e.contains("expected a fruit (apple, blood-orange)"), "{e}");
    }
}
