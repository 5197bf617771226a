//! Many models behind one gateway: the names each worker serves (its base model's and its
//! loaded LoRA adapters'), the rules that map a request's `model` to a pool of workers
//! (`--model-alias`, `--enable-igw`), and the pool a request picks.
//!
//! A pool is every worker that serves one name. The gateway routes a request only within the
//! pool its `model` names, and keys its prefix-index entries by that name
//! ([`crate::blocks::model_seed`]), so that a prompt sent to two models (or to an adapter and
//! its base) is never a hit across them. Names one engine serves as its base model (vLLM's
//! `--served-model-name a b`: one KV cache) share one key, the first of them in byte order,
//! so that a prompt cached under one is a hit under the other. Only vLLM and SGLang workers
//! (`owned_by` `vllm` or `sglang`) are known to serve one model each; the base names of any
//! other server (one that serves several models, each with its own cache) keep their own keys.
//!
//! One model served under one name and no `--enable-igw` is sglang-router's single-model
//! case: every request goes to that model whatever it names (SGLang answers any name; many
//! clients send `"model": "default"`). Otherwise (several names, an adapter, aliases or
//! `--enable-igw`) a request must name a model some worker serves: an unknown name is a 404
//! `model_not_found`, and no name at all is refused while more than one is served.

use thiserror::Error;

use crate::settings::RoutingSettings;
pub use crate::worker::ServedModel;

/// The most served names a worker may announce (more are ignored by whoever reads them).
pub const MAX_MODELS_PER_WORKER: usize = 256;

/// The longest model name kept, in bytes.
pub const MAX_MODEL_NAME: usize = 256;

/// The most `--model-alias` entries.
pub const MAX_ALIASES: usize = 256;

/// How requests' model names map to pools (validated from the routing settings).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelRules {
    /// `--enable-igw`: route by model even when one model is served.
    pub igw: bool,
    /// `--model-alias alias=canonical`: a client-facing name for a served one.
    pub aliases: Vec<(String, String)>,
}

impl ModelRules {
    /// Validates `enable_igw` and `model_alias` (each `alias=canonical`, both non-empty, the
    /// alias not given twice); the error is what is wrong with `model_alias`.
    pub fn from_settings(s: &RoutingSettings) -> Result<Self, String> {
        let bad = |reason: String| reason;
        let given = s.model_alias.as_deref().unwrap_or_default();
        if given.len() > MAX_ALIASES {
            return Err(bad(format!("{} aliases: at most {MAX_ALIASES}", given.len())));
        }
        let mut aliases: Vec<(String, String)> = Vec::with_capacity(given.len());
        for entry in given {
            let Some((alias, canonical)) = entry.split_once('=') else {
                return Err(bad(format!("`{entry}` is not alias=canonical")));
            };
            let (alias, canonical) = (alias.trim(), canonical.trim());
            if alias.is_empty()
                || canonical.is_empty()
                || alias.len() > MAX_MODEL_NAME
                || canonical.len() > MAX_MODEL_NAME
            {
                return Err(bad(format!("`{entry}` needs a name of 1 to {MAX_MODEL_NAME} bytes on each side of =")));
            }
            if alias == canonical || aliases.iter().any(|(a, _)| a == alias) {
                return Err(bad(format!("alias `{alias}` given twice or naming itself")));
            }
            aliases.push((alias.to_string(), canonical.to_string()));
        }
        Ok(Self { igw: s.enable_igw.unwrap_or(false), aliases })
    }

    /// The served name a client's `name` stands for.
    fn canonical<'a>(&'a self, name: &'a str) -> &'a str {
        self.aliases.iter().find(|(a, _)| a == name).map_or(name, |(_, c)| c.as_str())
    }
}

/// Why a request's `model` names no pool.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum ModelError {
    /// No worker serves it (HTTP 404, `model_not_found`).
    #[error("The model `{0}` does not exist.")]
    Unknown(String),
    /// The request names none and several are served (HTTP 400).
    #[error("request must name a `model`: this gateway serves several ({0})")]
    Required(String),
}

/// The pool a request goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pool<'a> {
    /// The served name of the pool; none when no worker has said what it serves.
    pub name: Option<&'a str>,
    /// Only workers serving `name` may take the request (false in the single-model case,
    /// where a worker that has not said what it serves still takes it).
    pub only_serving: bool,
    /// What the prefix index keys the pool's prompts by (its seed): `name`, or the name it
    /// shares its workers' KV caches with (see [`Pools`]).
    pub key: Option<&'a str>,
}

impl Pool<'_> {
    /// Every worker, unkeyed: what a gateway that knows no model names routes on.
    pub const ANY: Pool<'static> = Pool { name: None, only_serving: false, key: None };
}

/// The names the workers of one table serve: what requests are resolved against.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pools {
    /// Every name some worker serves, sorted, once each.
    names: Vec<String>,
    /// For each of `names`, the index in `names` of its prefix-index key: the least name
    /// served as a base model by one engine with it (linked through any worker), itself for
    /// an adapter's name and for a base name served alone.
    keys: Vec<usize>,
    /// Whether some name is an adapter's (then a request's name always picks the pool).
    adapters: bool,
    rules: ModelRules,
}

impl Pools {
    /// The pools of workers serving `served` (one list per worker), under `rules`.
    pub fn new<'a>(served: impl IntoIterator<Item = &'a [ServedModel]>, rules: &ModelRules) -> Self {
        let served: Vec<&[ServedModel]> = served.into_iter().collect();
        let mut names: Vec<String> = Vec::new();
        let mut adapters = false;
        for models in &served {
            for m in *models {
                adapters |= m.parent.is_some();
                names.push(m.id.clone());
            }
        }
        names.sort_unstable();
        names.dedup();
        let keys = shared_keys(&names, &served);
        Self { names, keys, adapters, rules: rules.clone() }
    }

    /// Every name some worker serves, sorted.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Whether the gateway routes by model: several names, an adapter, an alias or
    /// `--enable-igw` (the single-model case is sglang-router's: any name goes).
    pub fn by_model(&self) -> bool {
        self.rules.igw || self.adapters || !self.rules.aliases.is_empty() || self.names.len() > 1
    }

    /// The pool a request naming `requested` (its body's `model`, if any) goes to.
    pub fn resolve<'a>(&'a self, requested: Option<&'a str>) -> Result<Pool<'a>, ModelError> {
        let Some(only) = self.names.first() else { return Ok(Pool::ANY) };
        if !self.by_model() {
            return Ok(Pool { name: Some(only), only_serving: false, key: Some(only) });
        }
        let name = match requested {
            Some(r) => self.rules.canonical(r),
            None if self.names.len() == 1 => only,
            None => return Err(ModelError::Required(self.names.join(", "))),
        };
        match self.names.binary_search_by(|n| n.as_str().cmp(name)) {
            Ok(at) => {
                let key = self.keys.get(at).and_then(|&k| self.names.get(k)).map_or(name, String::as_str);
                Ok(Pool { name: Some(name), only_serving: true, key: Some(key) })
            }
            Err(_) => Err(ModelError::Unknown(requested.unwrap_or(name).to_string())),
        }
    }
}

/// For each of `names` (sorted), the index of its key (see [`Pools`]'s `keys`): the base names
/// each vLLM or SGLang worker serves are linked, and each takes the least name it is linked to.
/// A name some worker serves as an adapter is never linked (an adapter's KV is its own).
fn shared_keys(names: &[String], served: &[&[ServedModel]]) -> Vec<usize> {
    let at = |id: &str| names.binary_search_by(|n| n.as_str().cmp(id)).ok();
    // One pass over what every worker serves (a look-up each): bounded by the workers' lists.
    let mut adapter = vec![false; names.len()];
    for m in served.iter().flat_map(|w| w.iter()).filter(|m| m.parent.is_some()) {
        if let Some(flag) = at(&m.id).and_then(|i| adapter.get_mut(i)) {
            *flag = true;
        }
    }
    // Union-find over indices, the least index as each set's root.
    let mut root: Vec<usize> = (0..names.len()).collect();
    fn find(root: &mut [usize], mut i: usize) -> usize {
        while let Some(&r) = root.get(i) {
            if r == i {
                break;
            }
            let up = root.get(r).copied().unwrap_or(r);
            if let Some(slot) = root.get_mut(i) {
                *slot = up;
            }
            i = r;
        }
        i
    }
    for models in served {
        let bases: Vec<usize> = models
            .iter()
            .filter(|m| m.parent.is_none() && one_model_engine(&m.owned_by))
            .filter_map(|m| at(&m.id))
            .filter(|&i| !adapter.get(i).copied().unwrap_or(true))
            .collect();
        for pair in bases.windows(2) {
            if let [a, b] = *pair {
                let (ra, rb) = (find(&mut root, a), find(&mut root, b));
                let (low, high) = (ra.min(rb), ra.max(rb));
                if let Some(slot) = root.get_mut(high) {
                    *slot = low;
                }
            }
        }
    }
    (0..names.len()).map(|i| find(&mut root, i)).collect()
}

/// Whether a worker whose model list says `owned_by` is an engine that serves one model (its
/// several base names are aliases of it).
fn one_model_engine(owned_by: &str) -> bool {
    matches!(owned_by, "vllm" | "sglang")
}

/// Whether a worker serving `models` belongs to `pool`.
pub fn serves(models: &[ServedModel], pool: &Pool<'_>) -> bool {
    match pool.name {
        Some(name) if pool.only_serving => models.iter().any(|m| m.id == name),
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(id: &str, parent: Option<&str>) -> ServedModel {
        ServedModel { id: id.into(), parent: parent.map(Into::into), owned_by: "vllm".into() }
    }

    fn rules(igw: bool, aliases: &[&str]) -> ModelRules {
        let s = RoutingSettings {
            enable_igw: Some(igw),
            model_alias: Some(aliases.iter().map(|a| a.to_string()).collect()),
            ..Default::default()
        };
        ModelRules::from_settings(&s).unwrap()
    }

    #[test]
    fn one_model_takes_every_request_whatever_it_names() {
        let w = [model("llama", None)];
        let pools = Pools::new([&w[..], &w[..]], &ModelRules::default());
        let pool = Pool { name: Some("llama"), only_serving: false, key: Some("llama") };
        assert_eq!(pools.resolve(Some("default")), Ok(pool));
        assert_eq!(pools.resolve(None), Ok(pool));
        assert!(serves(&[], &pool), "a worker that has not said what it serves still serves");
    }

    #[test]
    fn no_names_known_is_the_unkeyed_pool_of_every_worker() {
        let pools = Pools::new([&[][..]], &rules(true, &[]));
        assert_eq!(pools.resolve(Some("x")), Ok(Pool::ANY));
        assert_eq!(Pool::ANY.name, None);
    }

    #[test]
    fn several_models_pick_their_pool_and_unknown_or_missing_names_are_refused() {
        let (a, b) = ([model("a", None), model("a-lora", Some("a"))], [model("b", None)]);
        let pools = Pools::new([&a[..], &b[..]], &ModelRules::default());
        assert!(pools.by_model());
        assert_eq!(pools.names(), ["a", "a-lora", "b"]);
        let lora = pools.resolve(Some("a-lora")).unwrap();
        assert_eq!(lora, Pool { name: Some("a-lora"), only_serving: true, key: Some("a-lora") });
        assert!(serves(&a, &lora) && !serves(&b, &lora));
        assert_eq!(pools.resolve(Some("c")), Err(ModelError::Unknown("c".into())));
        assert_eq!(pools.resolve(None), Err(ModelError::Required("a, a-lora, b".into())));
    }

    #[test]
    fn an_adapter_alone_or_igw_routes_by_model_and_a_sole_model_is_the_default() {
        let a = [model("a", None), model("l", Some("a"))];
        assert!(Pools::new([&a[..]], &ModelRules::default()).by_model());
        let one = [model("m", None)];
        let igw = Pools::new([&one[..]], &rules(true, &[]));
        assert_eq!(igw.resolve(Some("other")), Err(ModelError::Unknown("other".into())));
        assert_eq!(igw.resolve(None), Ok(Pool { name: Some("m"), only_serving: true, key: Some("m") }));
    }

    #[test]
    fn names_one_engine_serves_share_a_key_and_adapters_keep_their_own() {
        // Engine 1 serves `llama` and `chat` (one KV cache); engine 2 `chat` and `assistant`:
        // the three are one key, the least name. An adapter, and a model served alone, are not.
        let one = [model("llama", None), model("chat", None), model("sql", Some("llama"))];
        let two = [model("chat", None), model("assistant", None)];
        let three = [model("other", None)];
        let four = [model("mixed", None), model("sql", None)];
        let pools = Pools::new([&one[..], &two[..], &three[..], &four[..]], &ModelRules::default());
        let key = |name: &'static str| pools.resolve(Some(name)).unwrap().key;
        for name in ["llama", "chat", "assistant"] {
            assert_eq!(key(name), Some("assistant"), "{name}");
            assert_eq!(pools.resolve(Some(name)).unwrap().name, Some(name), "the pool stays the name's");
        }
        assert_eq!(key("other"), Some("other"));
        assert_eq!(key("sql"), Some("sql"), "an adapter somewhere: never shared");
        assert_eq!(key("mixed"), Some("mixed"), "linked only through an adapter's name");
        // A server of several models (Ollama's `owned_by` is `library`): a cache each.
        let library = |id: &str| ServedModel { owned_by: "library".into(), ..model(id, None) };
        let ollama = [library("qwen"), library("gemma")];
        let separate = Pools::new([&ollama[..]], &ModelRules::default());
        assert_eq!(separate.resolve(Some("qwen")).unwrap().key, Some("qwen"));
        assert_eq!(separate.resolve(Some("gemma")).unwrap().key, Some("gemma"));
        // Worker order does not matter.
        let reversed = Pools::new([&four[..], &three[..], &two[..], &one[..]], &ModelRules::default());
        for name in ["llama", "chat", "assistant", "other", "sql", "mixed"] {
            assert_eq!(reversed.resolve(Some(name)).unwrap().key, key(name), "{name}");
        }
    }

    /// The most a table can carry: 64 workers of 256 names each, every worker sharing one name
    /// with the next, so all are linked into one key; an adapter name on the last worker.
    #[test]
    fn the_largest_tables_link_names_through_every_worker() {
        let workers: Vec<Vec<ServedModel>> = (0..64)
            .map(|w| {
                let mut names: Vec<ServedModel> =
                    (0..MAX_MODELS_PER_WORKER - 1).map(|i| model(&format!("m{:05}", w * 255 + i), None)).collect();
                names.push(if w == 63 {
                    model("adapter", Some("m00000"))
                } else {
                    model(&format!("m{:05}", w * 255 + 255), None)
                });
                names
            })
            .collect();
        let pools = Pools::new(workers.iter().map(Vec::as_slice), &ModelRules::default());
        assert_eq!(pools.names().len(), 64 * 255 + 1);
        for name in ["m00000", "m08000", "m16319"] {
            assert_eq!(pools.resolve(Some(name)).unwrap().key, Some("m00000"), "{name}");
        }
        assert_eq!(pools.resolve(Some("adapter")).unwrap().key, Some("adapter"));
    }

    #[test]
    fn aliases_name_a_served_model_and_are_validated() {
        let one = [model("meta-llama/Llama-3.1-8B", None)];
        let pools = Pools::new([&one[..]], &rules(false, &["llama=meta-llama/Llama-3.1-8B"]));
        assert_eq!(pools.resolve(Some("llama")).unwrap().name, Some("meta-llama/Llama-3.1-8B"));
        assert_eq!(pools.resolve(Some("gpt-4")), Err(ModelError::Unknown("gpt-4".into())));
        for bad in [&["x"][..], &["=b"], &["a="], &["a=a"], &["a=b", "a=c"]] {
            let s = RoutingSettings {
                model_alias: Some(bad.iter().map(|a| a.to_string()).collect()),
                ..Default::default()
            };
            assert!(ModelRules::from_settings(&s).is_err(), "{bad:?} accepted");
        }
    }
}
