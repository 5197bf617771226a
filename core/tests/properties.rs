//! Properties of the parts that read hostile bytes — request parsing, bootstrap injection,
//! the SSE logprob merger: whatever the input, no panic, and no output larger than a bound of
//! the input (the routing text is cut at its cap; the merger adds only the prefill logprobs).

use kvmesh_core::bootstrap::Bootstrap;
use kvmesh_core::logprobs::{MergeRoom, PrefillLogprobs, SseMerger};
use kvmesh_core::request::{parse, Endpoint, MAX_BATCH, MAX_ROUTING_BYTES};
use proptest::prelude::*;
use serde_json::{json, Map, Value};

const ENDPOINTS: [Endpoint; 3] = [Endpoint::Generate, Endpoint::ChatCompletions, Endpoint::Completions];

/// JSON values of any shape, a few levels deep.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(("[a-z_]{1,8}", inner), 0..6).prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// A prompt a little shorter or longer than the routing cap, of 1-, 2- or 3-byte characters
/// (the cap may cut one).
fn long_text() -> impl Strategy<Value = String> {
    (prop::sample::select(vec!['a', 'é', '€']), 0..48usize)
        .prop_map(|(c, extra)| c.to_string().repeat((MAX_ROUTING_BYTES - 48) / c.len_utf8() + extra))
}

/// A well-formed field the parser routes on: a prompt (now and then around the routing cap)
/// as a string, a batch of strings or a chat message, or token ids.
fn prompt_field() -> impl Strategy<Value = (&'static str, Value)> {
    let text = || prop_oneof![".{0,40}", long_text()];
    let key = || prop::sample::select(vec!["text", "prompt"]);
    prop_oneof![
        (key(), text()).prop_map(|(k, t)| (k, Value::from(t))),
        (key(), prop::collection::vec(text(), 1..4)).prop_map(|(k, items)| (k, json!(items))),
        prop::collection::vec(any::<u32>(), 1..64).prop_map(|ids| ("input_ids", json!(ids))),
        text().prop_map(|t| ("messages", json!([{"role": "user", "content": t}]))),
    ]
}

/// The routing text the parser must find in `body` for `endpoint`, where it is a plain
/// string (or a list of them: a batch routes by its first item); `None` for other shapes.
fn plain_prompt(endpoint: Endpoint, body: &Value) -> Option<&str> {
    let field = match endpoint {
        Endpoint::Generate => body.get("text")?,
        Endpoint::Completions => body.get("prompt")?,
        Endpoint::ChatCompletions => return None,
    };
    match field {
        Value::String(s) => Some(s),
        Value::Array(items) if items.iter().all(Value::is_string) => items.first()?.as_str(),
        _ => None,
    }
}

/// Request bodies built from the fields the parser looks at, with values of any shape.
fn request_body() -> impl Strategy<Value = Value> {
    let keys = prop_oneof![
        Just("text"),
        Just("input_ids"),
        Just("messages"),
        Just("prompt"),
        Just("stream"),
        Just("rid"),
        Just("return_logprob"),
        Just("sampling_params"),
        Just("bootstrap_room"),
        Just("model"),
    ];
    // A prompt field first (so that many bodies parse), then fields of any shape (which may
    // replace it).
    (prompt_field(), prop::collection::vec((keys, any_json()), 0..4)).prop_map(|(prompt, kv)| {
        Value::Object(std::iter::once(prompt).chain(kv).map(|(k, v)| (k.to_string(), v)).collect::<Map<_, _>>())
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn parsing_any_bytes_never_panics(
        bytes in prop_oneof![
            prop::collection::vec(any::<u8>(), 0..256),
            // A request, as it is or with one byte overwritten (often still JSON): the bounds
            // are checked.
            (request_body(), prop::option::of((any::<prop::sample::Index>(), any::<u8>()))).prop_map(
                |(body, change)| {
                    let mut bytes = body.to_string().into_bytes();
                    if let Some((at, byte)) = change {
                        let i = at.index(bytes.len());
                        bytes[i] = byte;
                    }
                    bytes
                }
            ),
        ],
    ) {
        for endpoint in ENDPOINTS {
            if let Ok(p) = parse(endpoint, &bytes) {
                // The routing text is its full length cut at the cap: no more, and no less.
                prop_assert_eq!(p.text.len(), p.text_len.min(MAX_ROUTING_BYTES));
            }
        }
    }

    #[test]
    fn parsing_any_json_never_panics_and_keeps_its_bounds(body in request_body()) {
        let bytes = body.to_string().into_bytes();
        for endpoint in ENDPOINTS {
            if let Ok(p) = parse(endpoint, &bytes) {
                prop_assert_eq!(p.text.len(), p.text_len.min(MAX_ROUTING_BYTES));
                prop_assert!(p.text.len() <= bytes.len().max(4), "the routing text is no larger than the body");
                prop_assert!(p.batch.is_none_or(|n| (1..=MAX_BATCH).contains(&n)));
                if let Some(prompt) = plain_prompt(endpoint, &body) {
                    // A plain prompt: its first bytes up to the cap are kept, all are counted.
                    prop_assert_eq!(p.text_len, prompt.len());
                    prop_assert!(*p.text == prompt.as_bytes()[..p.text.len()], "not the prompt's first bytes");
                }
            }
        }
    }

    #[test]
    fn injection_adds_a_bounded_amount_and_keeps_every_field(
        items in prop::collection::vec(".{0,20}", 1..40),
        batch in any::<bool>(),
        extra in any_json(),
        host in "[a-z0-9.-]{1,40}",
        port in prop::option::of(any::<u16>()),
        rid in any::<u64>(),
        client_rid in prop::option::of(any_json()),
    ) {
        let text = if batch { json!(items) } else { json!(items[0]) };
        let mut fields = json!({"text": text, "extra": extra});
        if let Some(r) = &client_rid {
            fields["rid"] = r.clone();
        }
        let body = fields.to_string().into_bytes();
        let Ok(parsed) = parse(Endpoint::Generate, &body) else {
            // A client rid list of the wrong length for a batch: refused before routing.
            prop_assert!(batch && client_rid.as_ref().is_some_and(Value::is_array));
            return Ok(());
        };
        let n = parsed.batch.unwrap_or(1);
        let boot = Bootstrap { host: host.clone(), port, rooms: (0..n as u64).collect(), rid };
        let out = boot.inject(&body, &parsed).unwrap();
        // Per item: a host, a port, a room and an rid, each with its JSON punctuation.
        let per_item = host.len() + 6 + 20 + 28 + 12 + 8;
        prop_assert!(out.len() <= body.len() + 128 + n * per_item, "{} > bound", out.len());
        if client_rid.is_none() {
            // Every byte the client sent is kept, in place: the fields go before the closing brace.
            let kept = body.strip_suffix(b"}").unwrap();
            prop_assert!(out.starts_with(kept), "the body's bytes are kept");
        }
        let v: Value = serde_json::from_slice(&out).unwrap();
        prop_assert_eq!(v["bootstrap_host"].clone(), if batch { json!(vec![host; n]) } else { json!(host) });
        // The gateway's rids, whatever the client sent: the ones the prefill leg is aborted by.
        let rids = boot.injected_rids(&parsed, usize::MAX);
        prop_assert_eq!(v["rid"].clone(), if batch { json!(rids) } else { json!(rids[0]) });
    }

    #[test]
    fn the_sse_merger_never_panics_and_only_adds_the_prefill_logprobs(
        chunks in prop::collection::vec(
            prop_oneof![
                1 => prop::collection::vec(any::<u8>(), 0..64),
                2 => ".{0,16}".prop_map(String::into_bytes),
                3 => (0..10u8).prop_map(|i| event(i).into_bytes()),
                1 => Just(b"\r\n\r\n".to_vec()),
                1 => Just(b"data: [DONE]\n\n".to_vec()),
            ],
            0..24,
        ),
    ) {
        let prefill = json!([
            {"meta_info": {"input_token_logprobs": [[-0.5, 1, null]]}},
            {"meta_info": {"input_token_logprobs": [[-0.5, 1, null], [-0.25, 2, null]]}},
        ]);
        let mut m = SseMerger::new(PrefillLogprobs::from_response(prefill.to_string().as_bytes(), &MergeRoom::default()).unwrap());
        let input: Vec<u8> = chunks.concat();
        let mut output = Vec::new();
        for c in &chunks {
            output.extend(m.push(c));
        }
        output.extend(m.finish());
        // The prefill entries the merger puts in front of an event's own, per item.
        let added = ["[-0.5,1,null],[-0.25,2,null],", "[-0.5,1,null],"];
        // Every byte comes out, in order (held-back partial events too); only the prefill
        // entries are added (and no give-up error: the stream is far under the merge bound).
        prop_assert_eq!(without(&output, &added).escape_ascii().to_string(), input.escape_ascii().to_string());
        // Each complete event of item 0 or 1 gains its item's entries, when the stream is text
        // (invalid UTF-8 passes through unmerged).
        if std::str::from_utf8(&input).is_ok() {
            let expected: Vec<u8> = input
                .split_inclusive(|&b| b == b'\n')
                .flat_map(|line| match (0..2).find(|&i| line == first_line(i).as_bytes()) {
                    Some(i) => merged(i).into_bytes(),
                    None => line.to_vec(),
                })
                .collect();
            prop_assert_eq!(output.escape_ascii().to_string(), expected.escape_ascii().to_string());
        }
    }
}

/// An SSE event of batch item `index` carrying its own input logprobs.
fn event(index: u8) -> String {
    format!("data: {{\"index\":{index},\"meta_info\":{{\"input_token_logprobs\":[[-1,2,null]]}}}}\n\n")
}

/// `event(index)`'s first line (the event is that line and a blank one).
fn first_line(index: u8) -> String {
    event(index).trim_end_matches('\n').to_string() + "\n"
}

/// `event(index)`'s first line once item `index`'s prefill logprobs are merged in.
fn merged(index: u8) -> String {
    let prefill = ["[-0.5,1,null],", "[-0.5,1,null],[-0.25,2,null],"][usize::from(index)];
    format!("data: {{\"index\":{index},\"meta_info\":{{\"input_token_logprobs\":[{prefill}[-1,2,null]]}}}}\n")
}

/// `bytes` with every occurrence of the `patterns` (tried in order at each position) removed.
fn without(bytes: &[u8], patterns: &[&str]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len());
    let mut rest = bytes;
    while let Some((&first, tail)) = rest.split_first() {
        match patterns.iter().find(|p| rest.starts_with(p.as_bytes())) {
            Some(p) => rest = &rest[p.len()..],
            None => {
                out.push(first);
                rest = tail;
            }
        }
    }
    out
}
