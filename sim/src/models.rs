//! The model names a worker serves (`--served-model-name`, `--lora`): what `/v1/models` lists
//! and which `model` a request may name.

use std::sync::RwLock;

use serde_json::{json, Value};

use crate::cli::{Args, EngineKind};

/// The model a request runs on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// The name answers carry: the first served name for the base model (as vLLM answers), the
    /// adapter's own name for a LoRA adapter.
    pub name: String,
    /// Mixed into the prefix cache's keys and the KV a prefill hands over: 0 for the base
    /// model, the adapter's own value for an adapter, so no prompt hits across them.
    pub seed: u64,
}

pub struct Models {
    served: Vec<String>,
    /// The adapters loaded: the `--lora` ones, then those loaded at run time.
    loras: RwLock<Vec<String>>,
    /// Whether a request naming another model is refused (always for vLLM; for SGLang only
    /// when names were configured, so that the default stays as it was).
    enforce: bool,
    engine: EngineKind,
    root: String,
}

/// An OpenAI-style refusal: HTTP status, error type, message.
pub type Refusal = (u16, &'static str, String);

impl Models {
    pub fn new(args: &Args) -> Self {
        let served =
            if args.served_model_names.is_empty() { vec![args.model.clone()] } else { args.served_model_names.clone() };
        let enforce = args.engine == EngineKind::Vllm || !args.served_model_names.is_empty() || !args.loras.is_empty();
        Self { served, loras: RwLock::new(args.loras.clone()), enforce, engine: args.engine, root: args.model.clone() }
    }

    /// The base model's name in answers and metrics.
    pub fn first(&self) -> &str {
        self.served.first().map_or("", String::as_str)
    }

    fn base(&self) -> Target {
        Target { name: self.first().to_string(), seed: 0 }
    }

    /// The model `body["model"]` names; none (or null) is the base model.
    pub fn resolve(&self, body: &Value) -> Result<Target, Refusal> {
        if !self.enforce && self.loras.read().unwrap_or_else(|e| e.into_inner()).is_empty() {
            return Ok(self.base());
        }
        let name = match body.get("model") {
            None | Some(Value::Null) => return Ok(self.base()),
            Some(Value::String(s)) => s,
            Some(_) => return Err((400, "BadRequestError", "field `model` must be a string".into())),
        };
        if self.served.contains(name) {
            return Ok(self.base());
        }
        if self.loras.read().unwrap_or_else(|e| e.into_inner()).contains(name) {
            return Ok(Target { name: name.clone(), seed: xxhash_rust::xxh3::xxh3_64(name.as_bytes()) | 1 });
        }
        Err((404, "NotFoundError", format!("The model `{name}` does not exist.")))
    }

    /// Loads adapter `name` at run time (vLLM's `/v1/load_lora_adapter`, SGLang's
    /// `/load_lora_adapter`): a 400 when it is loaded already or names a served model.
    pub fn load(&self, name: &str) -> Result<(), String> {
        let mut loras = self.loras.write().unwrap_or_else(|e| e.into_inner());
        if name.is_empty() || loras.iter().any(|l| l == name) || self.served.iter().any(|s| s == name) {
            return Err(format!("The lora adapter '{name}' has already been loaded or is not a valid name."));
        }
        loras.push(name.to_string());
        Ok(())
    }

    /// Unloads adapter `name` (a 404 when it is not loaded).
    pub fn unload(&self, name: &str) -> Result<(), String> {
        let mut loras = self.loras.write().unwrap_or_else(|e| e.into_inner());
        let before = loras.len();
        loras.retain(|l| l != name);
        if loras.len() == before {
            return Err(format!("The lora adapter '{name}' cannot be found."));
        }
        Ok(())
    }

    /// `/v1/models`' `data`: the served names, then the adapters with their `parent`.
    pub fn list(&self, created: u64) -> Value {
        let owned_by = match self.engine {
            EngineKind::Sglang => "sglang",
            EngineKind::Vllm => "vllm",
        };
        let vllm = self.engine == EngineKind::Vllm;
        let base = self.served.iter().map(|id| {
            let mut card = json!({"id": id, "object": "model", "created": created, "owned_by": owned_by});
            if vllm {
                card["root"] = json!(self.root);
                card["parent"] = Value::Null;
            }
            card
        });
        let loras = self.loras.read().unwrap_or_else(|e| e.into_inner()).clone();
        let adapters = loras.iter().map(|id| {
            json!({"id": id, "object": "model", "created": created, "owned_by": owned_by, "root": id, "parent": self.first()})
        });
        Value::Array(base.chain(adapters).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn models(args: &[&str]) -> Models {
        Models::new(&Args::parse_from(std::iter::once("kvmesh-sim").chain(args.iter().copied())))
    }

    #[test]
    fn sglang_by_default_takes_any_model_and_lists_one() {
        let m = models(&[]);
        assert_eq!(m.resolve(&json!({"model": "whatever"})), Ok(Target { name: "kvmesh-sim".into(), seed: 0 }));
        assert_eq!(m.resolve(&json!({"model": 3})).map(|t| t.seed), Ok(0));
        assert_eq!(
            m.list(7),
            json!([{"id": "kvmesh-sim", "object": "model", "created": 7, "owned_by": "sglang"}]),
            "the default listing is what it was"
        );
    }

    #[test]
    fn served_names_and_adapters_are_listed_and_enforced() {
        let m = models(&["--engine", "vllm", "--served-model-name", "a", "--served-model-name", "b", "--lora", "l"]);
        let list = m.list(1);
        let ids: Vec<_> = list.as_array().unwrap().iter().map(|c| (c["id"].clone(), c["parent"].clone())).collect();
        assert_eq!(ids, vec![(json!("a"), Value::Null), (json!("b"), Value::Null), (json!("l"), json!("a"))]);
        assert!(list.as_array().unwrap().iter().all(|c| c["owned_by"] == "vllm"));
        assert_eq!(m.resolve(&json!({"model": "b"})), Ok(Target { name: "a".into(), seed: 0 }));
        assert_eq!(m.resolve(&json!({})).map(|t| t.name), Ok("a".into()));
        let lora = m.resolve(&json!({"model": "l"})).unwrap();
        assert_eq!(lora.name, "l");
        assert_ne!(lora.seed, 0);
        let (status, kind, msg) = m.resolve(&json!({"model": "kvmesh-sim"})).unwrap_err();
        assert_eq!((status, kind), (404, "NotFoundError"));
        assert!(msg.contains("`kvmesh-sim` does not exist"), "{msg}");
        assert_eq!(m.resolve(&json!({"model": ["a"]})).unwrap_err().0, 400);
    }

    #[test]
    fn sglang_enforces_names_once_configured() {
        let m = models(&["--lora", "ad"]);
        assert_eq!(m.resolve(&json!({"model": "kvmesh-sim"})).map(|t| t.seed), Ok(0));
        assert_eq!(m.resolve(&json!({"model": "other"})).unwrap_err().0, 404);
        assert_eq!(
            m.list(0)[1],
            json!({"id": "ad", "object": "model", "created": 0, "owned_by": "sglang", "root": "ad", "parent": "kvmesh-sim"})
        );
    }

    #[test]
    fn adapters_load_and_unload_at_run_time() {
        let m = models(&[]);
        assert_eq!(m.resolve(&json!({"model": "late"})).map(|t| t.seed), Ok(0), "unenforced: any name is the base");
        m.load("late").unwrap();
        assert!(m.load("late").is_err() && m.load("kvmesh-sim").is_err());
        assert_ne!(m.resolve(&json!({"model": "late"})).unwrap().seed, 0);
        assert_eq!(m.list(0)[1]["parent"], "kvmesh-sim");
        m.unload("late").unwrap();
        assert!(m.unload("late").is_err());
        assert_eq!(m.list(0).as_array().unwrap().len(), 1);
    }
}
