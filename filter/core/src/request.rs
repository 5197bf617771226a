//! Request parsing and routing-text extraction.
//!
//! The gateway parses each LLM request once to find the text the policies route on. Only the
//! fields that matter are decoded; the rest of the body is validated as JSON but skipped.
//! Errors name the offending field so that a client can fix its request.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;
use thiserror::Error;

/// The LLM endpoints the gateway routes by content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// SGLang native `POST /generate`.
    Generate,
    /// OpenAI `POST /v1/chat/completions`.
    ChatCompletions,
    /// OpenAI `POST /v1/completions`.
    Completions,
}

impl Endpoint {
    /// The endpoint a request path (with or without a query string) addresses, if any.
    pub fn from_path(path: &str) -> Option<Self> {
        let path = path.split(['?', '#']).next().unwrap_or(path);
        match path {
            "/generate" => Some(Self::Generate),
            "/v1/chat/completions" => Some(Self::ChatCompletions),
            "/v1/completions" => Some(Self::Completions),
            _ => None,
        }
    }
}

/// Why a request body cannot be routed. Every variant maps to a client error.
#[derive(Debug, Error, PartialEq)]
pub enum RequestError {
    #[error("request body is empty")]
    EmptyBody,
    #[error("request body is not valid JSON: {0}")]
    MalformedJson(String),
    #[error("request body must be a JSON object")]
    NotAnObject,
    #[error("field `{field}` must be {expected}")]
    WrongType { field: String, expected: &'static str },
    #[error("field `{field}` must not be an empty list")]
    EmptyList { field: String },
    #[error("request must contain {0}")]
    Missing(&'static str),
    #[error("field `{field}` has {got} entries but the batch has {expected} items")]
    BatchLength { field: String, expected: usize, got: usize },
    #[error("request body is larger than the limit of {limit} bytes")]
    TooLarge { limit: u64 },
}

impl RequestError {
    /// The HTTP status the gateway answers with.
    pub fn status(&self) -> u16 {
        match self {
            Self::TooLarge { .. } => 413,
            _ => 400,
        }
    }

    /// The OpenAI-style error `code`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::TooLarge { .. } => "payload_too_large",
            Self::EmptyBody | Self::MalformedJson(_) | Self::NotAnObject => "invalid_json",
            Self::WrongType { .. } | Self::EmptyList { .. } | Self::BatchLength { .. } => "invalid_field",
            Self::Missing(_) => "missing_field",
        }
    }
}

/// What the router needs to know about one request.
#[derive(Debug, PartialEq)]
pub struct ParsedRequest<'a> {
    pub endpoint: Endpoint,
    /// The bytes the policies route on: the prompt text (UTF-8), or token ids as 4 bytes each.
    /// A batch routes by its first item.
    pub text: Cow<'a, [u8]>,
    /// Whether the client asked for a server-sent-event stream.
    pub stream: bool,
    /// `Some(n)` when the request is a batch of `n` items.
    pub batch: Option<usize>,
    /// SGLang's `return_logprob` (any item, for batches).
    pub return_logprob: bool,
    /// Whether the client set `rid` itself.
    pub has_rid: bool,
    /// Whether the client sent any `bootstrap_*` field (the gateway sets them in PD mode).
    pub has_bootstrap: bool,
}

/// The fields of any of the three endpoints that routing looks at; all else is skipped.
#[derive(Deserialize)]
struct Fields<'a> {
    #[serde(borrow)]
    text: Option<&'a RawValue>,
    #[serde(borrow)]
    input_ids: Option<&'a RawValue>,
    #[serde(borrow)]
    messages: Option<&'a RawValue>,
    #[serde(borrow)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    stream: Option<&'a RawValue>,
    #[serde(borrow)]
    return_logprob: Option<&'a RawValue>,
    #[serde(borrow)]
    rid: Option<&'a RawValue>,
    #[serde(borrow)]
    bootstrap_host: Option<&'a RawValue>,
    #[serde(borrow)]
    bootstrap_port: Option<&'a RawValue>,
    #[serde(borrow)]
    bootstrap_room: Option<&'a RawValue>,
}

/// Per-item fields of SGLang's batch requests: when a batch carries one as a list, the list
/// must have one entry per item.
const BATCH_FIELDS: [&str; 9] = [
    "sampling_params",
    "rid",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "lora_path",
    "image_data",
    "custom_logit_processor",
];

/// Checks that every per-item list field of a batch of `n` has `n` entries.
fn check_batch_fields(body: &[u8], n: usize) -> Result<(), RequestError> {
    let all: std::collections::HashMap<&str, &RawValue> =
        serde_json::from_slice(body).map_err(|e| RequestError::MalformedJson(e.to_string()))?;
    for field in BATCH_FIELDS {
        let Some(raw) = all.get(field) else { continue };
        if raw.get().starts_with('[') {
            let items: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(|_| wrong_type(field, "a list"))?;
            if items.len() != n {
                return Err(RequestError::BatchLength { field: field.to_string(), expected: n, got: items.len() });
            }
        }
    }
    Ok(())
}

/// `return_logprob`: a boolean, or (batches) a list of booleans; true if any is true.
fn logprob_requested(raw: Option<&RawValue>) -> Result<bool, RequestError> {
    let Some(raw) = present(raw) else { return Ok(false) };
    if raw.get().starts_with('[') {
        let flags: Vec<bool> = serde_json::from_str(raw.get())
            .map_err(|_| wrong_type("return_logprob", "a boolean or a list of booleans"))?;
        return Ok(flags.contains(&true));
    }
    serde_json::from_str(raw.get()).map_err(|_| wrong_type("return_logprob", "a boolean or a list of booleans"))
}

/// Parses `body` for `endpoint` and extracts its routing text.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest<'_>, RequestError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(RequestError::EmptyBody);
    }
    let fields = parse_object(body)?;
    let stream = match present(fields.stream) {
        None => false,
        Some(raw) => serde_json::from_str::<bool>(raw.get()).map_err(|_| wrong_type("stream", "a boolean"))?,
    };
    let (text, batch) = match endpoint {
        Endpoint::Generate => generate_text(&fields)?,
        Endpoint::Completions => match present(fields.prompt) {
            Some(raw) => prompt_text("prompt", raw)?,
            None => return Err(RequestError::Missing("`prompt`")),
        },
        Endpoint::ChatCompletions => match present(fields.messages) {
            Some(raw) => (Cow::Owned(chat_text(raw)?), None),
            None => return Err(RequestError::Missing("`messages`")),
        },
    };
    if let Some(n) = batch {
        check_batch_fields(body, n)?;
    }
    Ok(ParsedRequest {
        endpoint,
        text,
        stream,
        batch,
        return_logprob: logprob_requested(fields.return_logprob)?,
        has_rid: present(fields.rid).is_some(),
        has_bootstrap: [fields.bootstrap_host, fields.bootstrap_port, fields.bootstrap_room]
            .iter()
            .any(|f| f.is_some()),
    })
}

fn parse_object(body: &[u8]) -> Result<Fields<'_>, RequestError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        // Validate first so that broken JSON is reported as such, not as "not an object".
        return match serde_json::from_slice::<serde::de::IgnoredAny>(body) {
            Ok(_) => Err(RequestError::NotAnObject),
            Err(e) => Err(RequestError::MalformedJson(e.to_string())),
        };
    }
    serde_json::from_slice::<Fields<'_>>(body).map_err(|e| RequestError::MalformedJson(e.to_string()))
}

/// A field that is present and not `null`.
fn present(raw: Option<&RawValue>) -> Option<&RawValue> {
    raw.filter(|r| r.get() != "null")
}

fn wrong_type(field: impl Into<String>, expected: &'static str) -> RequestError {
    RequestError::WrongType { field: field.into(), expected }
}

fn generate_text<'a>(fields: &Fields<'a>) -> Result<(Cow<'a, [u8]>, Option<usize>), RequestError> {
    if let Some(raw) = present(fields.text) {
        return string_or_list("text", raw, "a string or a list of strings");
    }
    if let Some(raw) = present(fields.input_ids) {
        return ids_or_batch("input_ids", raw);
    }
    Err(RequestError::Missing("`text` or `input_ids`"))
}

/// `prompt` of `/v1/completions`: a string, a list of strings, a list of token ids, or a list
/// of lists of token ids.
fn prompt_text<'a>(field: &str, raw: &'a RawValue) -> Result<(Cow<'a, [u8]>, Option<usize>), RequestError> {
    const EXPECTED: &str = "a string, a list of strings, or (lists of) token ids";
    match raw.get().as_bytes().first() {
        Some(b'"') => string_or_list(field, raw, EXPECTED),
        Some(b'[') => {
            let items: Vec<&RawValue> = serde_json::from_str(raw.get()).map_err(|_| wrong_type(field, EXPECTED))?;
            match items.first().and_then(|i| i.get().as_bytes().first()) {
                Some(b'"') => string_or_list(field, raw, EXPECTED),
                None => Err(RequestError::EmptyList { field: field.into() }),
                _ => ids_or_batch(field, raw),
            }
        }
        _ => Err(wrong_type(field, EXPECTED)),
    }
}

/// A string, or a non-empty list of strings (a batch routed by its first item).
fn string_or_list<'a>(
    field: &str,
    raw: &'a RawValue,
    expected: &'static str,
) -> Result<(Cow<'a, [u8]>, Option<usize>), RequestError> {
    if raw.get().starts_with('[') {
        let items: Vec<Cow<'a, str>> = serde_json::from_str(raw.get()).map_err(|_| wrong_type(field, expected))?;
        let n = items.len();
        let first = items.into_iter().next().ok_or_else(|| RequestError::EmptyList { field: field.into() })?;
        return Ok((cow_bytes(first), Some(n)));
    }
    let text: BorrowedStr<'a> = serde_json::from_str(raw.get()).map_err(|_| wrong_type(field, expected))?;
    Ok((cow_bytes(text.0), None))
}

#[derive(Deserialize)]
struct BorrowedStr<'a>(#[serde(borrow)] Cow<'a, str>);

fn cow_bytes(s: Cow<'_, str>) -> Cow<'_, [u8]> {
    match s {
        Cow::Borrowed(b) => Cow::Borrowed(b.as_bytes()),
        Cow::Owned(o) => Cow::Owned(o.into_bytes()),
    }
}

/// Token ids (a list of non-negative integers), or a batch (a non-empty list of such lists).
fn ids_or_batch<'a>(field: &str, raw: &RawValue) -> Result<(Cow<'a, [u8]>, Option<usize>), RequestError> {
    const EXPECTED: &str = "a list of token ids or a list of lists of token ids";
    let nested = raw.get()[1..].trim_start().starts_with('[');
    if nested {
        let batch: Vec<Vec<u32>> = serde_json::from_str(raw.get()).map_err(|_| wrong_type(field, EXPECTED))?;
        let n = batch.len();
        let first = batch.first().ok_or_else(|| RequestError::EmptyList { field: field.into() })?;
        return Ok((Cow::Owned(ids_bytes(first)), Some(n)));
    }
    let ids: Vec<u32> = serde_json::from_str(raw.get()).map_err(|_| wrong_type(field, EXPECTED))?;
    if ids.is_empty() {
        return Err(RequestError::EmptyList { field: field.into() });
    }
    Ok((Cow::Owned(ids_bytes(&ids)), None))
}

fn ids_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|id| id.to_le_bytes()).collect()
}

#[derive(Deserialize)]
struct Message<'a> {
    #[serde(borrow)]
    role: Option<&'a RawValue>,
    #[serde(borrow)]
    content: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Part<'a> {
    #[serde(borrow, rename = "type")]
    kind: Option<Cow<'a, str>>,
    #[serde(borrow)]
    text: Option<Cow<'a, str>>,
}

/// The chat's routing text: `role: content\n` per message, in order, with only the text parts
/// of multi-part contents.
fn chat_text(raw: &RawValue) -> Result<Vec<u8>, RequestError> {
    let messages: Vec<&RawValue> =
        serde_json::from_str(raw.get()).map_err(|_| wrong_type("messages", "a list of message objects"))?;
    if messages.is_empty() {
        return Err(RequestError::EmptyList { field: "messages".into() });
    }
    let mut out = Vec::with_capacity(raw.get().len());
    for (i, m) in messages.iter().enumerate() {
        let msg: Message<'_> =
            serde_json::from_str(m.get()).map_err(|_| wrong_type(format!("messages[{i}]"), "an object"))?;
        if let Some(role) = present(msg.role) {
            let role: BorrowedStr<'_> =
                serde_json::from_str(role.get()).map_err(|_| wrong_type(format!("messages[{i}].role"), "a string"))?;
            out.extend_from_slice(role.0.as_bytes());
        }
        out.extend_from_slice(b": ");
        if let Some(content) = present(msg.content) {
            append_content(&mut out, i, content)?;
        }
        out.push(b'\n');
    }
    Ok(out)
}

fn append_content(out: &mut Vec<u8>, i: usize, content: &RawValue) -> Result<(), RequestError> {
    const EXPECTED: &str = "a string or a list of content parts";
    if content.get().starts_with('"') {
        let s: BorrowedStr<'_> =
            serde_json::from_str(content.get()).map_err(|_| wrong_type(format!("messages[{i}].content"), EXPECTED))?;
        out.extend_from_slice(s.0.as_bytes());
        return Ok(());
    }
    let parts: Vec<Part<'_>> =
        serde_json::from_str(content.get()).map_err(|_| wrong_type(format!("messages[{i}].content"), EXPECTED))?;
    for part in parts {
        if part.kind.as_deref().unwrap_or("text") == "text" {
            if let Some(text) = part.text {
                out.extend_from_slice(text.as_bytes());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text_of(endpoint: Endpoint, body: &str) -> Vec<u8> {
        parse(endpoint, body.as_bytes()).map(|p| p.text.into_owned()).unwrap_or_default()
    }

    #[test]
    fn endpoints_from_paths() {
        assert_eq!(Endpoint::from_path("/generate"), Some(Endpoint::Generate));
        assert_eq!(Endpoint::from_path("/v1/chat/completions?x=1"), Some(Endpoint::ChatCompletions));
        assert_eq!(Endpoint::from_path("/v1/completions"), Some(Endpoint::Completions));
        assert_eq!(Endpoint::from_path("/v1/models"), None);
        assert_eq!(Endpoint::from_path("/generate/x"), None);
    }

    #[test]
    fn generate_text_single_and_batch() {
        let p = parse(Endpoint::Generate, br#"{"text":"hello world","stream":true}"#).unwrap();
        assert_eq!(&*p.text, b"hello world");
        assert!(p.stream);
        assert_eq!(p.batch, None);
        assert!(matches!(p.text, Cow::Borrowed(_)), "a plain string is not copied");

        let p = parse(Endpoint::Generate, br#"{"text":["first","second","third"]}"#).unwrap();
        assert_eq!(&*p.text, b"first");
        assert_eq!(p.batch, Some(3));
    }

    #[test]
    fn escaped_text_is_decoded() {
        assert_eq!(text_of(Endpoint::Generate, r#"{"text":"a\nb\u00e9"}"#), "a\nbé".as_bytes());
    }

    #[test]
    fn generate_input_ids() {
        let p = parse(Endpoint::Generate, br#"{"input_ids":[1,2,258]}"#).unwrap();
        assert_eq!(&*p.text, &[1, 0, 0, 0, 2, 0, 0, 0, 2, 1, 0, 0]);
        let p = parse(Endpoint::Generate, br#"{"input_ids":[[7],[8,9]]}"#).unwrap();
        assert_eq!(&*p.text, &[7, 0, 0, 0]);
        assert_eq!(p.batch, Some(2));
    }

    #[test]
    fn text_wins_over_input_ids_and_null_is_absent() {
        assert_eq!(text_of(Endpoint::Generate, r#"{"text":"t","input_ids":[1]}"#), b"t");
        assert_eq!(text_of(Endpoint::Generate, r#"{"text":null,"input_ids":[1]}"#), [1, 0, 0, 0]);
    }

    #[test]
    fn chat_messages_with_roles_and_parts() {
        let body = r#"{"model":"m","messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"hi "},{"type":"image_url","image_url":{"url":"x"}},{"type":"text","text":"there"}]},
            {"role":"assistant","content":null}
        ]}"#;
        assert_eq!(text_of(Endpoint::ChatCompletions, body), b"system: be brief\nuser: hi there\nassistant: \n");
    }

    #[test]
    fn completions_prompt_forms() {
        assert_eq!(text_of(Endpoint::Completions, r#"{"prompt":"abc"}"#), b"abc");
        let p = parse(Endpoint::Completions, br#"{"prompt":["x","y"]}"#).unwrap();
        assert_eq!((&*p.text, p.batch), (&b"x"[..], Some(2)));
        assert_eq!(text_of(Endpoint::Completions, r#"{"prompt":[5]}"#), [5, 0, 0, 0]);
        let p = parse(Endpoint::Completions, br#"{"prompt":[[5],[6]]}"#).unwrap();
        assert_eq!(p.batch, Some(2));
    }

    fn err(endpoint: Endpoint, body: &str) -> RequestError {
        match parse(endpoint, body.as_bytes()) {
            Err(e) => e,
            Ok(p) => panic!("expected an error, parsed {p:?}"),
        }
    }

    #[test]
    fn errors_name_the_field() {
        let e = err(Endpoint::Generate, r#"{"text": 5}"#);
        assert_eq!(e.to_string(), "field `text` must be a string or a list of strings");
        assert_eq!(e.status(), 400);
        assert!(err(Endpoint::Generate, r#"{"text":[1]}"#).to_string().contains("`text`"));
        assert!(err(Endpoint::Generate, r#"{"input_ids":["a"]}"#).to_string().contains("`input_ids`"));
        assert!(err(Endpoint::Generate, r#"{"input_ids":[-1]}"#).to_string().contains("`input_ids`"));
        assert!(err(Endpoint::Generate, r#"{"text":"x","stream":"yes"}"#).to_string().contains("`stream`"));
        assert!(err(Endpoint::ChatCompletions, r#"{"messages":"hi"}"#).to_string().contains("`messages`"));
        assert!(err(Endpoint::ChatCompletions, r#"{"messages":[{"role":"user","content":7}]}"#)
            .to_string()
            .contains("`messages[0].content`"));
        assert!(err(Endpoint::ChatCompletions, r#"{"messages":[{"role":1,"content":"a"}]}"#)
            .to_string()
            .contains("`messages[0].role`"));
        assert!(err(Endpoint::Completions, r#"{"prompt":{}}"#).to_string().contains("`prompt`"));
        assert_eq!(err(Endpoint::Generate, r#"{"text":[]}"#), RequestError::EmptyList { field: "text".into() });
        assert_eq!(err(Endpoint::ChatCompletions, r#"{"messages":[]}"#).status(), 400);
    }

    #[test]
    fn malformed_empty_and_non_objects() {
        assert_eq!(err(Endpoint::Generate, ""), RequestError::EmptyBody);
        assert_eq!(err(Endpoint::Generate, "  \n"), RequestError::EmptyBody);
        assert!(matches!(err(Endpoint::Generate, r#"{"text": "#), RequestError::MalformedJson(_)));
        assert!(matches!(err(Endpoint::Generate, "[1,"), RequestError::MalformedJson(_)));
        assert!(matches!(err(Endpoint::Generate, r#"{"text":"a"} x"#), RequestError::MalformedJson(_)));
        assert_eq!(err(Endpoint::Generate, "[1,2]"), RequestError::NotAnObject);
        assert_eq!(
            err(Endpoint::Generate, r#"{"sampling_params":{}}"#),
            RequestError::Missing("`text` or `input_ids`")
        );
        assert_eq!(err(Endpoint::ChatCompletions, r#"{}"#), RequestError::Missing("`messages`"));
    }

    #[test]
    fn batch_fields_must_match_the_batch() {
        let ok = r#"{"text":["a","b"],"sampling_params":[{},{}],"rid":["x","y"],"return_logprob":[false,true]}"#;
        let p = parse(Endpoint::Generate, ok.as_bytes()).unwrap();
        assert!(p.return_logprob && p.has_rid && !p.has_bootstrap);
        let e = err(Endpoint::Generate, r#"{"text":["a","b","c"],"sampling_params":[{},{}]}"#);
        assert_eq!(e, RequestError::BatchLength { field: "sampling_params".into(), expected: 3, got: 2 });
        assert!(e.to_string().contains("`sampling_params`"));
        assert!(err(Endpoint::Completions, r#"{"prompt":["a","b"],"rid":["x"]}"#).to_string().contains("`rid`"));
        // A single dict of sampling params applies to every item.
        assert!(parse(Endpoint::Generate, br#"{"text":["a","b"],"sampling_params":{"temperature":0}}"#).is_ok());
    }

    #[test]
    fn logprob_and_bootstrap_flags() {
        let p = parse(Endpoint::Generate, br#"{"text":"a","return_logprob":true,"bootstrap_room":5}"#).unwrap();
        assert!(p.return_logprob && p.has_bootstrap && !p.has_rid);
        assert!(!parse(Endpoint::Generate, br#"{"text":"a","return_logprob":false}"#).unwrap().return_logprob);
        assert!(err(Endpoint::Generate, r#"{"text":"a","return_logprob":"yes"}"#)
            .to_string()
            .contains("`return_logprob`"));
    }

    #[test]
    fn unknown_fields_are_skipped_but_validated() {
        let body = r#"{"model":"x","sampling_params":{"max_new_tokens":8,"stop":["a"]},"text":"q"}"#;
        assert_eq!(text_of(Endpoint::Generate, body), b"q");
        assert!(matches!(err(Endpoint::Generate, r#"{"x":[1,,2],"text":"q"}"#), RequestError::MalformedJson(_)));
    }
}
