//! The model names a worker serves, read from what the worker answers: its `/v1/models` (vLLM
//! and SGLang list their base model and loaded LoRA adapters there, an adapter with its
//! `parent`), else SGLang's `/get_model_info`. `probe.rs` asks with the health checks, so that
//! adapters loaded or unloaded at run time are followed.

use kvmesh_core::models::{ServedModel, MAX_MODELS_PER_WORKER, MAX_MODEL_NAME};
use serde_json::Value;

/// A name kept: 1 to [`MAX_MODEL_NAME`] bytes.
fn name(v: &Value) -> Option<String> {
    v.as_str().filter(|s| !s.is_empty() && s.len() <= MAX_MODEL_NAME).map(str::to_string)
}

/// The names an OpenAI model list (`{"data": [{"id", "parent", "owned_by"}, ...]}`) gives, at
/// most [`MAX_MODELS_PER_WORKER`], once each; none when it is not such a list.
pub fn parse_models(body: &str) -> Option<Vec<ServedModel>> {
    let v: Value = serde_json::from_str(body).ok()?;
    let mut out: Vec<ServedModel> = Vec::new();
    for card in v.get("data")?.as_array()? {
        let Some(id) = card.get("id").and_then(name) else { continue };
        if out.iter().any(|m| m.id == id) {
            continue;
        }
        let parent = card.get("parent").and_then(name).filter(|p| *p != id);
        let owned_by = card.get("owned_by").and_then(Value::as_str).filter(|o| o.len() <= 64).unwrap_or("");
        out.push(ServedModel { id, parent, owned_by: owned_by.to_string() });
        if out.len() == MAX_MODELS_PER_WORKER {
            break;
        }
    }
    Some(out)
}

/// SGLang's `/get_model_info`: its `model_path` is the one name it serves.
pub fn parse_model_info(body: &str) -> Option<Vec<ServedModel>> {
    let v: Value = serde_json::from_str(body).ok()?;
    let id = v.get("model_path").and_then(name)?;
    Some(vec![ServedModel { id, parent: None, owned_by: "sglang".into() }])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_list_gives_names_and_parents() {
        let body = r#"{"object":"list","data":[
            {"id":"llama","object":"model","owned_by":"vllm","root":"/m","parent":null},
            {"id":"sql-lora","owned_by":"vllm","root":"/a","parent":"llama"},
            {"id":"llama"}, {"id":""}, {"id":3}, {"object":"model"}]}"#;
        let got = parse_models(body).unwrap();
        assert_eq!(
            got,
            vec![
                ServedModel { id: "llama".into(), parent: None, owned_by: "vllm".into() },
                ServedModel { id: "sql-lora".into(), parent: Some("llama".into()), owned_by: "vllm".into() },
            ]
        );
        assert_eq!(parse_models("{}"), None);
        assert_eq!(parse_models("not json"), None);
        let many: Vec<String> = (0..1000).map(|i| format!(r#"{{"id":"m{i}"}}"#)).collect();
        assert_eq!(parse_models(&format!(r#"{{"data":[{}]}}"#, many.join(","))).unwrap().len(), MAX_MODELS_PER_WORKER);
    }

    #[test]
    fn sglang_model_info_names_its_model_path() {
        let got = parse_model_info(r#"{"model_path":"Qwen/Qwen3-8B","is_generation":true}"#).unwrap();
        assert_eq!(got[0].id, "Qwen/Qwen3-8B");
        assert_eq!(parse_model_info(r#"{"model_path":""}"#), None);
    }
}
