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

/// Strings are read once: without a backslash, the text between the quotes as it stands;
/// with one, decoded — the same texts as decoding every string, for every field read so.
#[test]
fn strings_with_and_without_escapes_give_the_decoded_text() {
    for (json, text) in [
        (r#""""#, ""),
        (r#""plain é text""#, "plain é text"),
        (r#""a\"b""#, "a\"b"),
        (r#""\\""#, "\\"),
        (r#""tail\\""#, "tail\\"),
        (r#""\u0041\/""#, "A/"),
    ] {
        let expect = text.as_bytes();
        assert_eq!(text_of(Endpoint::Generate, &format!(r#"{{"text":{json}}}"#)), expect, "text {json}");
        assert_eq!(text_of(Endpoint::Completions, &format!(r#"{{"prompt":{json}}}"#)), expect, "prompt {json}");
        let chat =
            text_of(Endpoint::ChatCompletions, &format!(r#"{{"messages":[{{"role":{json},"content":{json}}}]}}"#));
        assert_eq!(chat, [expect, b": ", expect, b"\n"].concat(), "message {json}");
    }
    let borrowed = parse(Endpoint::Completions, br#"{"prompt":"no escapes here"}"#).unwrap();
    assert!(matches!(borrowed.text, Cow::Borrowed(b"no escapes here")));
    // What serde_json refuses stays refused: a raw control character, a bad escape.
    for bad in ["{\"text\":\"a\u{1}b\"}", r#"{"text":"a\qb"}"#] {
        assert!(matches!(parse(Endpoint::Generate, bad.as_bytes()), Err(RequestError::MalformedJson(_))), "{bad:?}");
    }
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
    assert_eq!(err(Endpoint::Generate, r#"{"sampling_params":{}}"#), RequestError::Missing("`text` or `input_ids`"));
    assert_eq!(err(Endpoint::ChatCompletions, r#"{}"#), RequestError::Missing("`messages`"));
}

#[test]
fn batch_fields_must_match_the_batch() {
    let ok = r#"{"text":["a","b"],"sampling_params":[{},{}],"rid":["x","y"],"return_logprob":[false,true]}"#;
    let p = parse(Endpoint::Generate, ok.as_bytes()).unwrap();
    assert!(p.return_logprob && p.client_bootstrap.is_none());
    assert_eq!(p.rid_at.map(|r| &ok.as_bytes()[r]), Some(&br#"["x","y"]"#[..]), "the client's rid, found in the body");
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
    assert!(p.return_logprob && p.client_bootstrap == Some("bootstrap_room") && p.rid_at.is_none());
    let body = br#"{"text":"a","rid" : null }"#;
    assert_eq!(
        parse(Endpoint::Generate, body).unwrap().rid_at.map(|r| &body[r]),
        Some(&b"null"[..]),
        "null is a rid too"
    );
    assert!(!parse(Endpoint::Generate, br#"{"text":"a","return_logprob":false}"#).unwrap().return_logprob);
    assert!(err(Endpoint::Generate, r#"{"text":"a","return_logprob":"yes"}"#).to_string().contains("`return_logprob`"));
}

#[test]
fn unknown_fields_are_skipped_but_validated() {
    let body = r#"{"model":"x","sampling_params":{"max_new_tokens":8,"stop":["a"]},"text":"q"}"#;
    assert_eq!(text_of(Endpoint::Generate, body), b"q");
    assert!(matches!(err(Endpoint::Generate, r#"{"x":[1,,2],"text":"q"}"#), RequestError::MalformedJson(_)));
}

#[test]
fn a_top_level_field_is_a_routing_key() {
    let body = br#"{"messages":[{"role":"user","content":"hi","user":"inner"}],"user":"alice","n":2}"#;
    assert_eq!(top_level_key(body, "user").as_deref(), Some("alice"), "not the nested one");
    assert_eq!(top_level_key(body, "n").as_deref(), Some("2"));
    assert_eq!(top_level_key(br#"{"user":"a\"b"}"#, "user").as_deref(), Some("a\"b"));
    for body in [&br#"{"user":null}"#[..], br#"{"user":""}"#, br#"{"user":{"id":1}}"#, b"[1]", b"{", br#"{}"#] {
        assert_eq!(top_level_key(body, "user"), None, "{}", String::from_utf8_lossy(body));
    }
    let long = format!(r#"{{"user":"{}"}}"#, "u".repeat(MAX_ROUTING_KEY + 1));
    assert_eq!(top_level_key(long.as_bytes(), "user"), None);
}
