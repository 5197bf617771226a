//! A chat template's shape: how the served model's template lays a conversation out as the
//! prompt the engine tokenizes, in the few strings most templates reduce to (ChatML, Llama 3,
//! Mistral-like). With it, a chat's routing text is the text the engine's KV-cache events
//! spell, so engine blocks re-keyed by kvmesh-cp meet the chats the gateways route. Without
//! it, the routing text is kvmesh's own `role: content` layout (a model of the cache only).
//!
//! kvmesh-cp derives the shape by rendering the model's `chat_template` on probe
//! conversations and ships it only when the shape reproduces every probe exactly; the gateway
//! only concatenates strings (no template engine on the request path).
//!
//! A message's content is its string, or its text parts joined without a separator; roles are
//! written as the request gives them.

use serde::{Deserialize, Serialize};

/// The longest string of a shape.
pub const MAX_PART: usize = 512;
/// The longest default system message.
pub const MAX_DEFAULT_SYSTEM: usize = 8192;

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChatShape {
    /// Once, before the first message (a BOS the template or tokenizer writes).
    #[serde(default)]
    pub start: String,
    /// After `start` when the first message is not a system one: the template's default
    /// system message (Qwen's), whole.
    #[serde(default)]
    pub default_system: String,
    /// Before a message's role.
    #[serde(default)]
    pub role_before: String,
    /// After the role, before the content.
    #[serde(default)]
    pub role_after: String,
    /// After the content.
    #[serde(default)]
    pub after: String,
    /// The content with surrounding whitespace trimmed (Llama 3's templates).
    #[serde(default)]
    pub trim: bool,
    /// After the last message: the generation prompt (`add_generation_prompt`).
    #[serde(default)]
    pub generation: String,
}

impl ChatShape {
    /// A shape from its JSON (the `chat_shape` setting), every string at most [`MAX_PART`]
    /// bytes.
    pub fn parse(json: &str) -> Result<Self, String> {
        let shape: ChatShape = serde_json::from_str(json).map_err(|e| format!("not a chat shape: {e}"))?;
        let parts = [&shape.start, &shape.role_before, &shape.role_after, &shape.after, &shape.generation];
        if parts.iter().any(|p| p.len() > MAX_PART) || shape.default_system.len() > MAX_DEFAULT_SYSTEM {
            return Err(format!(
                "a chat shape's strings are at most {MAX_PART} bytes, its default system message {MAX_DEFAULT_SYSTEM}"
            ));
        }
        Ok(shape)
    }

    /// The `chat_shape` setting's shape: none when unset or blank.
    pub fn from_setting(json: Option<&str>) -> Result<Option<Self>, String> {
        match json.map(str::trim) {
            None | Some("") => Ok(None),
            Some(json) => Self::parse(json).map(Some),
        }
    }

    /// The opening of a message of `role`.
    pub fn open<'a>(&'a self, role: &'a str) -> [&'a [u8]; 3] {
        [self.role_before.as_bytes(), role.as_bytes(), self.role_after.as_bytes()]
    }

    /// The whole prompt of `messages` (`(role, content)`): what a gateway's routing text is,
    /// and what kvmesh-cp checks the template's renderings against.
    pub fn render<'a>(&self, messages: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
        let mut out = self.start.clone();
        for (i, (role, content)) in messages.into_iter().enumerate() {
            if i == 0 && role != "system" {
                out.push_str(&self.default_system);
            }
            out.push_str(&self.role_before);
            out.push_str(role);
            out.push_str(&self.role_after);
            out.push_str(if self.trim { content.trim() } else { content });
            out.push_str(&self.after);
        }
        out.push_str(&self.generation);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_renders_chatml_and_refuses_garbage() {
        let chatml = ChatShape::parse(
            r#"{"role_before":"<|im_start|>","role_after":"\n","after":"<|im_end|>\n","generation":"<|im_start|>assistant\n"}"#,
        )
        .unwrap();
        assert_eq!(
            chatml.render([("system", "Be brief."), ("user", " Hi ")]),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n<|im_start|>assistant\n"
        );
        let trimmed = ChatShape { trim: true, ..chatml };
        assert!(trimmed.render([("user", " Hi ")]).contains("user\nHi<|im_end|>"));
        assert!(ChatShape::parse(r#"{"role_before":"x","extra":1}"#).is_err(), "unknown keys");
        assert!(ChatShape::parse(&format!(r#"{{"after":"{}"}}"#, "a".repeat(MAX_PART + 1))).is_err());
        assert!(ChatShape::parse("3").is_err());
    }

    #[test]
    fn a_chats_routing_text_is_the_shapes_rendering() {
        use crate::request::{parse, parse_with, Endpoint};
        let shape = ChatShape {
            start: "<s>".into(),
            role_before: "[".into(),
            role_after: "]\n".into(),
            after: "</m>\n".into(),
            trim: true,
            generation: "[assistant]\n".into(),
            ..Default::default()
        };
        let body = br#"{"messages":[{"role":"system","content":"  Be brief. "},
            {"role":"user","content":[{"type":"text","text":"Hi "},{"type":"image_url","image_url":{"url":"x"}},{"text":"there"}]}]}"#;
        let shaped = parse_with(Endpoint::ChatCompletions, body, Some(&shape)).unwrap();
        let want = shape.render([("system", "Be brief."), ("user", "Hi there")]);
        assert_eq!(String::from_utf8_lossy(&shaped.text), want);
        assert_eq!(shaped.text_len, want.len());
        let plain = parse(Endpoint::ChatCompletions, body).unwrap();
        assert_eq!(
            String::from_utf8_lossy(&plain.text),
            "system:   Be brief. \nuser: Hi there\n",
            "no shape: kvmesh's lines"
        );
        // A default system message opens a chat that has none, and only such a chat.
        let qwen = ChatShape { default_system: "[system]\nDefault.</m>\n".into(), ..shape.clone() };
        let user_only = br#"{"messages":[{"role":"user","content":"Hi"}]}"#;
        let text = parse_with(Endpoint::ChatCompletions, user_only, Some(&qwen)).unwrap().text.into_owned();
        assert_eq!(String::from_utf8(text).unwrap(), qwen.render([("user", "Hi")]));
        assert!(qwen.render([("user", "Hi")]).starts_with("<s>[system]\nDefault."));
        let shaped = parse_with(Endpoint::ChatCompletions, body, Some(&qwen)).unwrap();
        assert_eq!(String::from_utf8_lossy(&shaped.text), want, "a chat with its own system message");
        // Other endpoints are not chats.
        let gen = parse_with(Endpoint::Generate, br#"{"text":"x"}"#, Some(&shape)).unwrap();
        assert_eq!(&gen.text[..], b"x");
    }
}
