//! Request parsing and routing-text extraction.
//!
//! The gateway parses each LLM request once to find the text the policies route on. Only the
//! fields that matter are decoded; the rest of the body is validated as JSON but skipped.
//! Errors name the offending field so that a client can fix its request.
//!
//! Memory is bounded whatever the body's shape: nothing is materialised per batch item or per
//! list entry (lists are streamed and counted), the routing text keeps at most
//! [`MAX_ROUTING_BYTES`] (its full length is counted), batches are capped at [`MAX_BATCH`]
//! items, and serde_json's recursion limit refuses deep nesting.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use crate::chat_shape::ChatShape;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use thiserror::Error;

/// The most routing text kept for hashing (its length is still counted in full): the prefix
/// index matches at most this much of a prompt.
pub const MAX_ROUTING_BYTES: usize = 256 * 1024;

/// The most items a batch request may have.
pub const MAX_BATCH: usize = 4096;

/// The longest routing key (`consistent_hashing`) kept, in bytes.
pub const MAX_ROUTING_KEY: usize = 1024;

/// Walks a JSON object's top level, keeping only the value of one field.
struct FieldOf<'f>(&'f str);

impl<'de> Visitor<'de> for FieldOf<'_> {
    type Value = Option<&'de RawValue>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        while let Some(key) = map.next_key::<Cow<'de, str>>()? {
            if found.is_none() && key == self.0 {
                found = Some(map.next_value::<&'de RawValue>()?);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(found)
    }
}

/// A top-level body field as a routing key: a string of 1 to [`MAX_ROUTING_KEY`] bytes, or a
/// number as written. Anything else (absent, another type, a body that is not an object) is no
/// key. Only the field's own value is kept, whatever the body holds.
pub fn top_level_key(body: &[u8], field: &str) -> Option<String> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let raw = de.deserialize_map(FieldOf(field)).ok()??;
    let text = raw.get();
    let key = match text.as_bytes().first()? {
        b'"' => serde_json::from_str::<String>(text).ok()?,
        b'-' | b'0'..=b'9' => text.to_string(),
        _ => return None,
    };
    (!key.is_empty() && key.len() <= MAX_ROUTING_KEY).then_some(key)
}

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
    #[error("field `{field}` has more than {limit} items")]
    BatchTooLarge { field: String, limit: usize },
    #[error("field `{0}` is set by the gateway in PD mode and must not be sent")]
    Reserved(&'static str),
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
            Self::WrongType { .. }
            | Self::EmptyList { .. }
            | Self::BatchLength { .. }
            | Self::BatchTooLarge { .. }
            | Self::Reserved(_) => "invalid_field",
            Self::Missing(_) => "missing_field",
        }
    }
}

/// What the router needs to know about one request.
#[derive(Debug, PartialEq)]
pub struct ParsedRequest<'a> {
    pub endpoint: Endpoint,
    /// The bytes the policies route on: the prompt text (UTF-8), or token ids as 4 bytes each;
    /// at most [`MAX_ROUTING_BYTES`] of it. A batch routes by its first item.
    pub text: Cow<'a, [u8]>,
    /// The routing text's full length (`text` may be a prefix of it).
    pub text_len: usize,
    /// Whether the client asked for a server-sent-event stream.
    pub stream: bool,
    /// `Some(n)` when the request is a batch of `n` items.
    pub batch: Option<usize>,
    /// SGLang's `return_logprob` (any item, for batches).
    pub return_logprob: bool,
    /// Where the value of the client's own `rid` is in the body (`null` included), if it set
    /// one: in PD mode the gateway writes its own there.
    pub rid_at: Option<Range<usize>>,
    /// The first field the client sent that only the gateway may set, if any (`bootstrap_*`,
    /// vLLM's `kv_transfer_params`): the request is refused, in every mode.
    pub client_bootstrap: Option<&'static str>,
    /// The `model` the request names (a string of at most
    /// [`crate::models::MAX_MODEL_NAME`] bytes), if any.
    pub model: Option<Cow<'a, str>>,
    /// Whether the body has a top-level `data_parallel_rank` (see [`crate::dp`]).
    pub client_dp_rank: bool,
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
    /// `null` included (a value the gateway replaces, see [`ParsedRequest::rid_at`]).
    #[serde(default, borrow, deserialize_with = "raw_even_null")]
    rid: Option<&'a RawValue>,
    #[serde(borrow)]
    bootstrap_host: Option<&'a RawValue>,
    #[serde(borrow)]
    bootstrap_port: Option<&'a RawValue>,
    #[serde(borrow)]
    bootstrap_room: Option<&'a RawValue>,
    #[serde(borrow)]
    kv_transfer_params: Option<&'a RawValue>,
    #[serde(borrow)]
    model: Option<&'a RawValue>,
    /// Present at all (null included).
    #[serde(default, deserialize_with = "is_present")]
    data_parallel_rank: bool,
}

/// A field's raw value, `null` included (`Option<&RawValue>` reads `null` as absent).
fn raw_even_null<'de: 'a, 'a, D: Deserializer<'de>>(de: D) -> Result<Option<&'a RawValue>, D::Error> {
    <&'a RawValue>::deserialize(de).map(Some)
}

/// A field's mere presence, whatever its value (`null` included).
fn is_present<'de, D: Deserializer<'de>>(de: D) -> Result<bool, D::Error> {
    IgnoredAny::deserialize(de).map(|_| true)
}

/// The per-item fields of a batch body (everything else is skipped).
#[derive(Deserialize)]
struct BatchFields<'a> {
    #[serde(borrow)]
    sampling_params: Option<&'a RawValue>,
    #[serde(borrow)]
    rid: Option<&'a RawValue>,
    #[serde(borrow)]
    return_logprob: Option<&'a RawValue>,
    #[serde(borrow)]
    logprob_start_len: Option<&'a RawValue>,
    #[serde(borrow)]
    top_logprobs_num: Option<&'a RawValue>,
    #[serde(borrow)]
    return_text_in_logprobs: Option<&'a RawValue>,
    #[serde(borrow)]
    lora_path: Option<&'a RawValue>,
    #[serde(borrow)]
    image_data: Option<&'a RawValue>,
    #[serde(borrow)]
    custom_logit_processor: Option<&'a RawValue>,
}

/// Counts the entries of a JSON list without keeping them.
struct CountItems;

impl<'de> Visitor<'de> for CountItems {
    type Value = usize;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<usize, A::Error> {
        let mut n = 0usize;
        while seq.next_element::<IgnoredAny>()?.is_some() {
            n = n.saturating_add(1);
        }
        Ok(n)
    }
}

/// Checks that every per-item list field of a batch of `n` has `n` entries.
fn check_batch_fields(body: &[u8], n: usize) -> Result<(), RequestError> {
    let f: BatchFields<'_> = serde_json::from_slice(body).map_err(|e| RequestError::MalformedJson(e.to_string()))?;
    let fields = [
        ("sampling_params", f.sampling_params),
        ("rid", f.rid),
        ("return_logprob", f.return_logprob),
        ("logprob_start_len", f.logprob_start_len),
        ("top_logprobs_num", f.top_logprobs_num),
        ("return_text_in_logprobs", f.return_text_in_logprobs),
        ("lora_path", f.lora_path),
        ("image_data", f.image_data),
        ("custom_logit_processor", f.custom_logit_processor),
    ];
    for (field, raw) in fields {
        let Some(raw) = raw.filter(|r| r.get().starts_with('[')) else { continue };
        let mut de = serde_json::Deserializer::from_str(raw.get());
        let got = de.deserialize_seq(CountItems).map_err(|_| wrong_type(field, "a list"))?;
        if got != n {
            return Err(RequestError::BatchLength { field: field.to_string(), expected: n, got });
        }
    }
    Ok(())
}

/// Whether any entry of a list of booleans is true (nothing kept).
struct AnyTrue;

impl<'de> Visitor<'de> for AnyTrue {
    type Value = bool;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of booleans")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<bool, A::Error> {
        let mut any = false;
        while let Some(b) = seq.next_element::<bool>()? {
            any |= b;
        }
        Ok(any)
    }
}

/// `return_logprob`: a boolean, or (batches) a list of booleans; true if any is true.
fn logprob_requested(raw: Option<&RawValue>) -> Result<bool, RequestError> {
    const EXPECTED: &str = "a boolean or a list of booleans";
    let Some(raw) = present(raw) else { return Ok(false) };
    if raw.get().starts_with('[') {
        let mut de = serde_json::Deserializer::from_str(raw.get());
        return de.deserialize_seq(AnyTrue).map_err(|_| wrong_type("return_logprob", EXPECTED));
    }
    serde_json::from_str(raw.get()).map_err(|_| wrong_type("return_logprob", EXPECTED))
}

/// Parses `body` for `endpoint` and extracts its routing text.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<ParsedRequest<'_>, RequestError> {
    parse_with(endpoint, body, None)
}

/// [`parse`], a chat's routing text laid out as the model's template lays its prompt out
/// (`shape`: [`ChatShape`]; none: kvmesh's `role: content` lines).
pub fn parse_with<'b>(
    endpoint: Endpoint,
    body: &'b [u8],
    shape: Option<&ChatShape>,
) -> Result<ParsedRequest<'b>, RequestError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(RequestError::EmptyBody);
    }
    let fields = parse_object(body)?;
    let stream = match present(fields.stream) {
        None => false,
        Some(raw) => serde_json::from_str::<bool>(raw.get()).map_err(|_| wrong_type("stream", "a boolean"))?,
    };
    let routing = match endpoint {
        Endpoint::Generate => generate_text(&fields)?,
        Endpoint::Completions => match present(fields.prompt) {
            Some(raw) => prompt_text("prompt", raw)?,
            None => return Err(RequestError::Missing("`prompt`")),
        },
        Endpoint::ChatCompletions => match present(fields.messages) {
            Some(raw) => chat_text(raw, shape)?,
            None => return Err(RequestError::Missing("`messages`")),
        },
    };
    if let Some(n) = routing.batch {
        check_batch_fields(body, n)?;
    }
    Ok(ParsedRequest {
        endpoint,
        text: routing.text,
        text_len: routing.len,
        stream,
        batch: routing.batch,
        return_logprob: logprob_requested(fields.return_logprob)?,
        rid_at: fields.rid.and_then(|raw| span_in(body, raw.get())),
        client_bootstrap: [
            ("bootstrap_host", fields.bootstrap_host),
            ("bootstrap_port", fields.bootstrap_port),
            ("bootstrap_room", fields.bootstrap_room),
            ("kv_transfer_params", fields.kv_transfer_params),
        ]
        .into_iter()
        .find_map(|(name, f)| f.map(|_| name)),
        model: model_name(fields.model)?,
        client_dp_rank: fields.data_parallel_rank,
    })
}

/// `model`: absent or null, or a string of 1 to [`crate::models::MAX_MODEL_NAME`] bytes.
fn model_name(raw: Option<&RawValue>) -> Result<Option<Cow<'_, str>>, RequestError> {
    let Some(raw) = present(raw) else { return Ok(None) };
    let expected = "a model name (a string of 1 to 256 bytes)";
    match json_str(raw) {
        Some(name) if !name.is_empty() && name.len() <= crate::models::MAX_MODEL_NAME => Ok(Some(name)),
        _ => Err(wrong_type("model", expected)),
    }
}

/// The routing text (at most [`MAX_ROUTING_BYTES`]), its full length, and the batch size.
struct Routing<'a> {
    text: Cow<'a, [u8]>,
    len: usize,
    batch: Option<usize>,
}

impl<'a> Routing<'a> {
    fn new(text: Cow<'a, [u8]>, batch: Option<usize>) -> Self {
        let len = text.len();
        let text = match text {
            Cow::Borrowed(b) => Cow::Borrowed(b.get(..MAX_ROUTING_BYTES).unwrap_or(b)),
            Cow::Owned(mut o) => {
                o.truncate(MAX_ROUTING_BYTES);
                Cow::Owned(o)
            }
        };
        Self { text, len, batch }
    }
}

/// A routing text built piece by piece: keeps the first [`MAX_ROUTING_BYTES`], counts all.
#[derive(Default)]
struct Text {
    kept: Vec<u8>,
    len: usize,
}

impl Text {
    fn push(&mut self, bytes: &[u8]) {
        self.len = self.len.saturating_add(bytes.len());
        let room = MAX_ROUTING_BYTES.saturating_sub(self.kept.len());
        self.kept.extend_from_slice(bytes.get(..room).unwrap_or(bytes));
    }

    fn into_routing<'a>(self, batch: Option<usize>) -> Routing<'a> {
        Routing { text: Cow::Owned(self.kept), len: self.len, batch }
    }
}

fn parse_object(body: &[u8]) -> Result<Fields<'_>, RequestError> {
    let first = body.iter().find(|b| !b.is_ascii_whitespace());
    if first != Some(&b'{') {
        // Validate first so that broken JSON is reported as such, not as "not an object".
        return match serde_json::from_slice::<IgnoredAny>(body) {
            Ok(_) => Err(RequestError::NotAnObject),
            Err(e) => Err(RequestError::MalformedJson(e.to_string())),
        };
    }
    serde_json::from_slice::<Fields<'_>>(body).map_err(|e| RequestError::MalformedJson(e.to_string()))
}

/// Where `value` (a slice of `body`, as serde_json's borrowed values are) lies in `body`.
fn span_in(body: &[u8], value: &str) -> Option<Range<usize>> {
    let start = (value.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let span = start..start.checked_add(value.len())?;
    (body.get(span.clone()) == Some(value.as_bytes())).then_some(span)
}

/// A field that is present and not `null`.
fn present(raw: Option<&RawValue>) -> Option<&RawValue> {
    raw.filter(|r| r.get() != "null")
}

fn wrong_type(field: impl Into<String>, expected: &'static str) -> RequestError {
    RequestError::WrongType { field: field.into(), expected }
}

/// Checks a batch's item count.
fn batch_of(field: &str, n: usize) -> Result<Option<usize>, RequestError> {
    match n {
        0 => Err(RequestError::EmptyList { field: field.into() }),
        n if n > MAX_BATCH => Err(RequestError::BatchTooLarge { field: field.into(), limit: MAX_BATCH }),
        n => Ok(Some(n)),
    }
}

/// What a JSON list starts with, without parsing it: its first non-blank character after `[`.
fn first_item_char(raw: &RawValue) -> Option<char> {
    raw.get().get(1..)?.trim_start().chars().next()
}

fn generate_text<'a>(fields: &Fields<'a>) -> Result<Routing<'a>, RequestError> {
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
fn prompt_text<'a>(field: &str, raw: &'a RawValue) -> Result<Routing<'a>, RequestError> {
    const EXPECTED: &str = "a string, a list of strings, or (lists of) token ids";
    match raw.get().as_bytes().first() {
        Some(b'"') => string_or_list(field, raw, EXPECTED),
        Some(b'[') => match first_item_char(raw) {
            Some('"') => string_or_list(field, raw, EXPECTED),
            Some(']') => Err(RequestError::EmptyList { field: field.into() }),
            _ => ids_or_batch(field, raw),
        },
        _ => Err(wrong_type(field, EXPECTED)),
    }
}

/// The first string of a list (borrowed when it has no escapes), and how many strings the list
/// holds; the others are checked to be strings and dropped at once.
struct FirstString;

impl<'de> Visitor<'de> for FirstString {
    type Value = (Option<Cow<'de, str>>, usize);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of strings")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let first = seq.next_element::<BorrowedStr<'de>>()?.map(|s| s.0);
        let mut n = usize::from(first.is_some());
        while seq.next_element::<BorrowedStr<'de>>()?.is_some() {
            n = n.saturating_add(1);
        }
        Ok((first, n))
    }
}

/// A string, or a non-empty list of strings (a batch routed by its first item).
fn string_or_list<'a>(field: &str, raw: &'a RawValue, expected: &'static str) -> Result<Routing<'a>, RequestError> {
    if raw.get().starts_with('[') {
        let mut de = serde_json::Deserializer::from_str(raw.get());
        let (first, n) = de.deserialize_seq(FirstString).map_err(|_| wrong_type(field, expected))?;
        let batch = batch_of(field, n)?;
        let first = first.ok_or_else(|| RequestError::EmptyList { field: field.into() })?;
        return Ok(Routing::new(cow_bytes(first), batch));
    }
    let text = json_str(raw).ok_or_else(|| wrong_type(field, expected))?;
    Ok(Routing::new(cow_bytes(text), None))
}

/// A JSON value as a string (`None`: it is not one). `serde_json` checked the token when it
/// cut it out of the body (quotes, escapes, no control characters, UTF-8), so a string with
/// no backslash is exactly the text between its quotes: borrowed without a second scan (the
/// prompt is most of a body). One with escapes is decoded.
fn json_str(raw: &RawValue) -> Option<Cow<'_, str>> {
    let token = raw.get();
    if let Some(inner) = token.strip_prefix('"').and_then(|t| t.strip_suffix('"')) {
        if !inner.as_bytes().contains(&b'\\') {
            return Some(Cow::Borrowed(inner));
        }
    }
    serde_json::from_str::<BorrowedStr<'_>>(token).ok().map(|s| s.0)
}

#[derive(Deserialize)]
struct BorrowedStr<'a>(#[serde(borrow)] Cow<'a, str>);

fn cow_bytes(s: Cow<'_, str>) -> Cow<'_, [u8]> {
    match s {
        Cow::Borrowed(b) => Cow::Borrowed(b.as_bytes()),
        Cow::Owned(o) => Cow::Owned(o.into_bytes()),
    }
}

/// A list of token ids, checked to be u32s; kept (as 4 little-endian bytes each, up to the
/// routing cap) only when `keep`.
struct Ids {
    keep: bool,
}

impl<'de> Visitor<'de> for Ids {
    type Value = Text;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of token ids")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Text, A::Error> {
        let mut text = Text::default();
        while let Some(id) = seq.next_element::<u32>()? {
            if self.keep {
                text.push(&id.to_le_bytes());
            }
        }
        Ok(text)
    }
}

impl<'de> DeserializeSeed<'de> for Ids {
    type Value = Text;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Text, D::Error> {
        d.deserialize_seq(self)
    }
}

/// A list of lists of token ids: the first one's bytes and how many lists there are.
struct IdBatch;

impl<'de> Visitor<'de> for IdBatch {
    type Value = (Option<Text>, usize);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of lists of token ids")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let first = seq.next_element_seed(Ids { keep: true })?;
        let mut n = usize::from(first.is_some());
        while seq.next_element_seed(Ids { keep: false })?.is_some() {
            n = n.saturating_add(1);
        }
        Ok((first, n))
    }
}

/// Token ids (a list of non-negative integers), or a batch (a non-empty list of such lists).
fn ids_or_batch<'a>(field: &str, raw: &RawValue) -> Result<Routing<'a>, RequestError> {
    const EXPECTED: &str = "a list of token ids or a list of lists of token ids";
    let mut de = serde_json::Deserializer::from_str(raw.get());
    if first_item_char(raw) == Some('[') {
        let (first, n) = de.deserialize_seq(IdBatch).map_err(|_| wrong_type(field, EXPECTED))?;
        let batch = batch_of(field, n)?;
        let first = first.ok_or_else(|| RequestError::EmptyList { field: field.into() })?;
        return Ok(first.into_routing(batch));
    }
    let ids = de.deserialize_seq(Ids { keep: true }).map_err(|_| wrong_type(field, EXPECTED))?;
    if ids.len == 0 {
        return Err(RequestError::EmptyList { field: field.into() });
    }
    Ok(ids.into_routing(None))
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

/// Streams the messages of a chat into its routing text, one at a time.
struct Messages<'t> {
    text: &'t mut Text,
    shape: Option<&'t ChatShape>,
}

/// Why a message could not be read (the field is named by position).
enum MessageError {
    Json,
    Field(RequestError),
}

impl<'de> Visitor<'de> for Messages<'_> {
    type Value = Result<usize, RequestError>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of message objects")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut i = 0usize;
        while let Some(m) = seq.next_element::<&'de RawValue>()? {
            if let Err(e) = append_message(self.text, self.shape, i, m) {
                return Ok(Err(match e {
                    MessageError::Json => wrong_type(format!("messages[{i}]"), "an object"),
                    MessageError::Field(e) => e,
                }));
            }
            i = i.saturating_add(1);
        }
        Ok(Ok(i))
    }
}

fn append_message(text: &mut Text, shape: Option<&ChatShape>, i: usize, m: &RawValue) -> Result<(), MessageError> {
    let msg: Message<'_> = serde_json::from_str(m.get()).map_err(|_| MessageError::Json)?;
    let role = match present(msg.role) {
        Some(role) => Some(
            json_str(role).ok_or_else(|| MessageError::Field(wrong_type(format!("messages[{i}].role"), "a string")))?,
        ),
        None => None,
    };
    let Some(shape) = shape else {
        if let Some(role) = role {
            text.push(role.as_bytes());
        }
        text.push(b": ");
        if let Some(content) = present(msg.content) {
            append_content(text, i, content).map_err(MessageError::Field)?;
        }
        text.push(b"\n");
        return Ok(());
    };
    if i == 0 && role.as_deref() != Some("system") {
        text.push(shape.default_system.as_bytes());
    }
    for part in shape.open(role.as_deref().unwrap_or_default()) {
        text.push(part);
    }
    if let Some(content) = present(msg.content) {
        if shape.trim {
            let mut whole = Text::default();
            append_content(&mut whole, i, content).map_err(MessageError::Field)?;
            text.push(trim_ascii_and_unicode(&whole.kept));
        } else {
            append_content(text, i, content).map_err(MessageError::Field)?;
        }
    }
    text.push(shape.after.as_bytes());
    Ok(())
}

/// `bytes` without surrounding whitespace (as Python's `str.strip()`, for valid UTF-8).
fn trim_ascii_and_unicode(bytes: &[u8]) -> &[u8] {
    match std::str::from_utf8(bytes) {
        Ok(s) => s.trim().as_bytes(),
        Err(_) => bytes.trim_ascii(),
    }
}

/// The chat's routing text: `role: content\n` per message, in order, with only the text parts
/// of multi-part contents; with a template's `shape`, its layout (start, each message, the
/// generation prompt).
fn chat_text(raw: &RawValue, shape: Option<&ChatShape>) -> Result<Routing<'static>, RequestError> {
    let mut text = Text::default();
    if let Some(s) = shape {
        text.push(s.start.as_bytes());
    }
    let mut de = serde_json::Deserializer::from_str(raw.get());
    let n = de
        .deserialize_seq(Messages { text: &mut text, shape })
        .map_err(|_| wrong_type("messages", "a list of message objects"))??;
    if n == 0 {
        return Err(RequestError::EmptyList { field: "messages".into() });
    }
    if let Some(s) = shape {
        text.push(s.generation.as_bytes());
    }
    Ok(text.into_routing(None))
}

/// Streams the parts of a multi-part content, appending the text parts.
struct Parts<'t> {
    text: &'t mut Text,
}

impl<'de> Visitor<'de> for Parts<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of content parts")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while let Some(part) = seq.next_element::<Part<'de>>()? {
            if part.kind.as_deref().unwrap_or("text") == "text" {
                if let Some(t) = part.text {
                    self.text.push(t.as_bytes());
                }
            }
        }
        Ok(())
    }
}

fn append_content(text: &mut Text, i: usize, content: &RawValue) -> Result<(), RequestError> {
    const EXPECTED: &str = "a string or a list of content parts";
    let bad = || wrong_type(format!("messages[{i}].content"), EXPECTED);
    if content.get().starts_with('"') {
        let s = json_str(content).ok_or_else(bad)?;
        text.push(s.as_bytes());
        return Ok(());
    }
    let mut de = serde_json::Deserializer::from_str(content.get());
    de.deserialize_seq(Parts { text }).map_err(|_| bad())
}

#[cfg(test)]
mod tests;
