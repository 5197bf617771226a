//! The served model's chat template as a shape for the gateways ([`kvmesh_core::chat_shape`]):
//! the `chat_template` of the `tokenizer_config.json` beside `--kv-events-tokenizer`, rendered
//! (minijinja, with Python's string methods) on probe conversations. The shape is the strings
//! around a message's role and content, the start, and the generation prompt; it is shipped
//! only if it reproduces every probe byte for byte, so a template it cannot express (a default
//! system message written apart, roles rewritten, alternation rules, dates) leaves chats on kvmesh's own
//! layout, with a warning saying why. Rendering happens once, at startup.

use std::path::Path;

use kvmesh_core::chat_shape::ChatShape;
use minijinja::{context, Environment, Error, ErrorKind};
use serde_json::Value;

/// A content no template writes by itself (a private-use character).
const MARK: &str = "\u{E000}";
/// The instructions one rendering may take (a real template takes a few thousand).
const FUEL: u64 = 1_000_000;
/// The largest tokenizer_config.json read.
const MAX_CONFIG_BYTES: u64 = 16 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("{0}: {1}")]
    Read(String, String),
    #[error("no chat_template in {0}")]
    NoTemplate(String),
    #[error("the chat template does not render: {0}")]
    Render(String),
    #[error("the chat template is not one kvmesh can lay out ({0})")]
    Shape(String),
}

/// The shape of the template in the `tokenizer_config.json` beside `tokenizer` (none: there
/// is no such file).
pub fn shape_beside(tokenizer: &str) -> Result<Option<ChatShape>, ChatError> {
    let path = Path::new(tokenizer).with_file_name("tokenizer_config.json");
    let Ok(meta) = std::fs::metadata(&path) else { return Ok(None) };
    let name = path.display().to_string();
    if meta.len() > MAX_CONFIG_BYTES {
        return Err(ChatError::Read(name, format!("over {MAX_CONFIG_BYTES} bytes")));
    }
    let text = std::fs::read_to_string(&path).map_err(|e| ChatError::Read(name.clone(), e.to_string()))?;
    let config: Value = serde_json::from_str(&text).map_err(|e| ChatError::Read(name.clone(), e.to_string()))?;
    let template = match config.get("chat_template") {
        Some(Value::String(t)) => t.clone(),
        // Named templates: the default one.
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template").and_then(Value::as_str))
            .map(str::to_string)
            .ok_or_else(|| ChatError::NoTemplate(name.clone()))?,
        _ => return Err(ChatError::NoTemplate(name)),
    };
    let token = |key: &str| match config.get(key) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).unwrap_or_default().to_string(),
        _ => String::new(),
    };
    derive(&template, &token("bos_token"), &token("eos_token")).map(Some)
}

/// Sets the routing settings' `chat_shape` from the template beside `--kv-events-tokenizer`,
/// unless it is set already; a template that gives none is a warning (chats then keep
/// kvmesh's own layout).
pub fn apply(settings: &mut crate::settings::Settings) {
    let Some(tokenizer) = settings.kv_events.tokenizer.clone() else { return };
    if settings.routing.chat_shape.as_deref().is_some_and(|s| !s.trim().is_empty()) {
        return;
    }
    let why = match shape_beside(&tokenizer) {
        Ok(Some(shape)) => match serde_json::to_string(&shape) {
            Ok(json) => {
                settings.routing.chat_shape = Some(json);
                return;
            }
            Err(e) => e.to_string(),
        },
        Ok(None) => "no tokenizer_config.json beside the tokenizer".to_string(),
        Err(e) => e.to_string(),
    };
    settings.warnings.push(format!(
        "--kv-events-tokenizer {tokenizer}: {why}; chats keep kvmesh's own routing text, so only /generate and /v1/completions prompts meet the engines' blocks"
    ));
}

/// Renders `template` on `messages` (`(role, content)`).
fn render(
    env: &Environment<'_>,
    messages: &[(&str, &str)],
    generation: bool,
    special: (&str, &str),
) -> Result<String, ChatError> {
    let list: Vec<Value> = messages.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c})).collect();
    let t = env.get_template("chat").map_err(|e| ChatError::Render(e.to_string()))?;
    t.render(context! { messages => list, add_generation_prompt => generation, bos_token => special.0, eos_token => special.1 })
        .map_err(|e| ChatError::Render(e.to_string()))
}

/// The shape of `template`, checked against its renderings of the probe conversations.
pub fn derive(template: &str, bos: &str, eos: &str) -> Result<ChatShape, ChatError> {
    let mut env = Environment::new();
    // A template that loops without end stops here (each probe renders within this fuel).
    env.set_fuel(Some(FUEL));
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_template_owned("chat", template.to_string()).map_err(|e| ChatError::Render(e.to_string()))?;
    let special = (bos, eos);
    let shape_err = |why: &str| ChatError::Shape(why.to_string());
    // One user message: [start][before]user[after-role] MARK [after]; the generation prompt.
    let one = render(&env, &[("user", MARK)], false, special)?;
    let with_gen = render(&env, &[("user", MARK)], true, special)?;
    let generation =
        with_gen.strip_prefix(one.as_str()).ok_or_else(|| shape_err("the generation prompt is not an addition"))?;
    let (head, after) = one.split_once(MARK).ok_or_else(|| shape_err("a message's content is not written as given"))?;
    // Two messages: what lies between the first content and the second is `after`, then the
    // second message's opening, its role within it.
    let two = render(&env, &[("user", MARK), ("assistant", MARK)], false, special)?;
    let mut parts = two.split(MARK);
    let (first, between) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    if first != head {
        return Err(shape_err("the first message is written differently when another follows"));
    }
    let open = between.strip_prefix(after).ok_or_else(|| shape_err("messages are not separated the same way"))?;
    let (role_before, role_after) =
        open.split_once("assistant").ok_or_else(|| shape_err("roles are not written as given"))?;
    let start = head
        .strip_suffix(&format!("{role_before}user{role_after}"))
        .ok_or_else(|| shape_err("the user role is written differently from the assistant's"))?;
    // A system message first: what precedes it is the start proper; the rest of the user-only
    // start is the template's default system message.
    let system = render(&env, &[("system", MARK)], false, special)?;
    let own = system.strip_suffix(&format!("{role_before}system{role_after}{MARK}{after}"));
    let (start, default_system) = match own {
        Some(proper) if proper.len() < start.len() => match start.strip_prefix(proper) {
            Some(rest) => (proper, rest),
            None => return Err(shape_err("a system message changes the start")),
        },
        _ => (start, ""),
    };
    let trim = render(&env, &[("user", &format!(" {MARK} "))], false, special)?
        .contains(&format!("{role_after}{MARK}{after}"));
    let shape = ChatShape {
        start: start.to_string(),
        default_system: default_system.to_string(),
        role_before: role_before.to_string(),
        role_after: role_after.to_string(),
        after: after.to_string(),
        trim,
        generation: generation.to_string(),
    };
    let probes: [&[(&str, &str)]; 4] = [
        &[("user", "Hello there.")],
        &[("system", "You are terse."), ("user", " What is KV cache?\n")],
        &[("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Route me.")],
        &[("system", "Be kind."), ("user", "One"), ("assistant", " Two "), ("user", "Three")],
    ];
    for (i, probe) in probes.iter().enumerate() {
        for generation in [true, false] {
            let want = render(&env, probe, generation, special)?;
            let mut got = shape.render(probe.iter().copied());
            if !generation {
                got.truncate(got.len() - shape.generation.len());
            }
            if got != want {
                return Err(ChatError::Shape(format!("probe {i} renders {want:?}, the shape {got:?}")));
            }
        }
    }
    ChatShape::parse(&serde_json::to_string(&shape).unwrap_or_default()).map_err(ChatError::Shape)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
    const LLAMA3: &str = "{{ bos_token }}{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";
    /// Qwen 2.5's habit: a default system prompt when the conversation has none.
    const DEFAULT_SYSTEM: &str = "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";

    #[test]
    fn chatml_and_llama3_templates_become_shapes() {
        let s = derive(CHATML, "", "").unwrap();
        assert_eq!((s.start.as_str(), s.role_before.as_str(), s.role_after.as_str()), ("", "<|im_start|>", "\n"));
        assert_eq!(
            (s.after.as_str(), s.generation.as_str(), s.trim),
            ("<|im_end|>\n", "<|im_start|>assistant\n", false)
        );
        let l = derive(LLAMA3, "<|begin_of_text|>", "<|eot_id|>").unwrap();
        assert_eq!(l.start, "<|begin_of_text|>");
        assert!(l.trim, "Llama 3 trims contents");
        assert_eq!(l.render([("user", " Hi ")]), "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
    }

    #[test]
    fn a_default_system_message_is_part_of_the_shape() {
        let s = derive(DEFAULT_SYSTEM, "", "").unwrap();
        assert_eq!(
            (s.start.as_str(), s.default_system.as_str()),
            ("", "<|im_start|>system\nYou are helpful.<|im_end|>\n")
        );
        assert_eq!(
            s.render([("user", "Hi")]),
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
        assert!(s.render([("system", "Mine."), ("user", "Hi")]).starts_with("<|im_start|>system\nMine."));
    }

    #[test]
    fn templates_a_shape_cannot_express_are_refused_with_a_reason() {
        // The system message's role is written apart from the others'.
        let apart = "{% for m in messages %}{% if m.role == 'system' %}<<SYS>>{{ m.content }}<</SYS>>{% else %}[{{ m.role }}]{{ m.content }}\n{% endif %}{% endfor %}";
        let e = derive(apart, "", "").unwrap_err().to_string();
        assert!(e.contains("not one kvmesh can lay out"), "{e}");
        let e = derive("{{ raise_exception('no') }}", "", "").unwrap_err().to_string();
        assert!(e.contains("does not render"), "{e}");
        assert!(derive("{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}", "", "").is_err());
        assert!(derive("{{ unclosed", "", "").is_err());
        let endless = "{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}";
        assert!(derive(endless, "", "").unwrap_err().to_string().contains("does not render"), "bounded by fuel");
    }

    #[test]
    fn the_simulators_template_is_the_simulators_layout() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../sim/data/tokenizer.json");
        let shape = shape_beside(path).unwrap().expect("sim/data/tokenizer_config.json");
        assert_eq!(shape.render([("system", "Be brief."), ("user", "Hi")]), "<|system|>\nBe brief.\n<|user|>\nHi\n");
        assert_eq!(shape_beside("/no/such/dir/tokenizer.json").unwrap(), None);
    }
}
