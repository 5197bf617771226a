//! The routing settings as the filters get them, validated by the core exactly as the filters
//! will, and the worker roles each policy applies to.

use kvmesh_core::policy::PolicyKind;
use kvmesh_core::RoutingSettings;
use kvmesh_proto::v1::Role;

use super::{Args, BadArgs};

impl Args {
    /// What the filters get, and the configuration the core validates from it exactly as the
    /// filters will.
    pub(super) fn routing(&self, pd: bool) -> Result<(RoutingSettings, kvmesh_core::Config), BadArgs> {
        let mut routing = self.routing.clone();
        routing.pd_disaggregation = Some(pd);
        if pd {
            // `--policy` is both legs' default (as in sglang-router): said explicitly, so that it
            // also wins over leg policies in a filter's plugin configuration.
            routing.prefill_policy = routing.prefill_policy.or(routing.policy);
            routing.decode_policy = routing.decode_policy.or(routing.policy);
        }
        let checked = kvmesh_core::Config::from_settings(&routing).map_err(|e| match e {
            kvmesh_core::ConfigError::Invalid { field, reason } => self.bad(field, reason),
            other => BadArgs(other.to_string()),
        })?;
        Ok((routing, checked))
    }
}

/// The worker roles whose policy is `kind`.
pub(super) fn roles_of(config: &kvmesh_core::Config, kind: PolicyKind) -> Vec<Role> {
    match &config.pd {
        None if config.policy == kind => vec![Role::Regular],
        None => Vec::new(),
        Some(pd) => [(pd.prefill_policy, Role::Prefill), (pd.decode_policy, Role::Decode)]
            .into_iter()
            .filter(|(p, _)| *p == kind)
            .map(|(_, r)| r)
            .collect(),
    }
}
