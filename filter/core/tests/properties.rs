//! Properties of the parts that read hostile bytes — request parsing, bootstrap injection,
//! the SSE logprob merger: whatever the input, no panic, and no output larger than a bound of
//! the input.

use kvmesh_core::bootstrap::Bootstrap;
use kvmesh_core::logprobs::{PrefillLogprobs, SseMerger, MAX_MERGE_BYTES};
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
    prop::collection::vec((keys, any_json()), 0..6)
        .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect::<Map<_, _>>()))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn parsing_any_bytes_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        for endpoint in ENDPOINTS {
            if let Ok(p) = parse(endpoint, &bytes) {
                prop_assert!(p.text.len() <= MAX_ROUTING_BYTES && p.text.len() <= p.text_len.max(p.text.len()));
            }
        }
    }

    #[test]
    fn parsing_any_json_never_panics_and_keeps_its_bounds(body in request_body()) {
        let bytes = body.to_string().into_bytes();
        for endpoint in ENDPOINTS {
            if let Ok(p) = parse(endpoint, &bytes) {
                prop_assert!(p.text.len() <= MAX_ROUTING_BYTES);
                prop_assert!(p.text.len() <= bytes.len().max(4), "the routing text is no larger than the body");
                prop_assert!(p.batch.is_none_or(|n| (1..=MAX_BATCH).contains(&n)));
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
        rid in prop::option::of("[!-~]{1,128}"),
    ) {
        let text = if batch { json!(items) } else { json!(items[0]) };
        let body = json!({"text": text, "extra": extra}).to_string().into_bytes();
        let parsed = parse(Endpoint::Generate, &body).unwrap();
        let n = parsed.batch.unwrap_or(1);
        let boot = Bootstrap { host: host.clone(), port, rooms: (0..n as u64).collect(), request_id: rid.clone() };
        let out = boot.inject(&body, &parsed).unwrap();
        // Per item: a host, a port, a room and an rid, each with its JSON punctuation.
        let per_item = host.len() + 6 + 20 + rid.as_ref().map_or(0, |r| r.len() + 12) + 8;
        prop_assert!(out.len() <= body.len() + 128 + n * per_item, "{} > bound", out.len());
        // Every byte the client sent is kept, in place: the fields go before the closing brace.
        let kept = body.strip_suffix(b"}").unwrap();
        prop_assert!(out.starts_with(kept), "the body's bytes are kept");
        let v: Value = serde_json::from_slice(&out).unwrap();
        prop_assert_eq!(v["bootstrap_host"].clone(), if batch { json!(vec![host; n]) } else { json!(host) });
    }

    #[test]
    fn the_sse_merger_never_panics_and_its_output_is_bounded(
        chunks in prop::collection::vec(
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..64),
                "data: \\{\"index\":[0-9],\"meta_info\":\\{\"input_token_logprobs\":\\[\\[-1,2,null\\]\\]\\}\\}\n\n"
                    .prop_map(String::into_bytes),
                Just(b"\r\n\r\n".to_vec()),
                Just(b"data: [DONE]\n\n".to_vec()),
            ],
            0..24,
        ),
    ) {
        let prefill = json!([
            {"meta_info": {"input_token_logprobs": [[-0.5, 1, null]]}},
            {"meta_info": {"input_token_logprobs": [[-0.5, 1, null], [-0.25, 2, null]]}},
        ]);
        let mut m = SseMerger::new(PrefillLogprobs::from_response(prefill.to_string().as_bytes()).unwrap());
        let input: usize = chunks.iter().map(Vec::len).sum();
        let mut output = 0usize;
        for c in &chunks {
            output += m.push(c).len();
        }
        output += m.finish().len();
        // At most every event gains the largest prefill list (and JSON reformatting).
        let events = chunks.len() + 1;
        prop_assert!(output <= 2 * input + events * 64, "{output} from {input}");
        prop_assert!(MAX_MERGE_BYTES > input);
    }
}
