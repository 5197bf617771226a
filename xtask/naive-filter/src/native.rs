//! The same naive filter as a native Envoy dynamic module (`libkvmesh_naive_filter.so`, built
//! for the host): the same pause, body read, parse, hash and header write, with no Wasm VM —
//! what the boundary costs a filter that does nothing else.

#![allow(unsafe_code)]

use std::ffi::c_void;

use envoy_dynamic_module::{
    borrow_from_envoy, drop_from_envoy, empty_hooks, into_envoy, BodyKind, Buffer, HeaderKind, Stream, CONTINUE, STOP,
};

empty_hooks!();
envoy_dynamic_module::empty_scheduled_and_callout_hooks!();

struct Config {
    workers: Vec<String>,
}

/// # Safety
/// Envoy passes its buffers, valid during the call.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_new(
    _envoy: *mut c_void,
    _name: Buffer,
    config: Buffer,
) -> *const c_void {
    let workers = super::workers(config.bytes());
    into_envoy((!workers.is_empty()).then_some(Config { workers }))
}

/// # Safety
/// `config` came from `config_new`.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_config_destroy(config: *mut c_void) {
    drop_from_envoy::<Config>(config);
}

/// The filter keeps nothing of its own: its "instance" is the configuration.
#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_new(config: *mut c_void, _envoy: *mut c_void) -> *mut c_void {
    config
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_destroy(_m: *mut c_void) {}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_request_headers(
    _f: *mut c_void,
    _m: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    if end_of_stream {
        CONTINUE
    } else {
        STOP
    }
}

/// # Safety
/// `f` is the stream this hook runs for; `m` the configuration `filter_new` returned.
#[no_mangle]
pub unsafe extern "C" fn envoy_dynamic_module_on_http_filter_request_body(
    f: *mut c_void,
    m: *mut c_void,
    end_of_stream: bool,
) -> u32 {
    if !end_of_stream {
        return STOP;
    }
    let Some(config) = borrow_from_envoy::<Config>(m) else { return CONTINUE };
    let stream = Stream::new(f);
    let body: Vec<u8> = [BodyKind::BufferedRequest, BodyKind::ReceivedRequest]
        .into_iter()
        .flat_map(|k| stream.body(k))
        .fold(Vec::new(), |mut all, chunk| {
            all.extend_from_slice(chunk);
            all
        });
    if let Some(dst) = super::pick(&config.workers, &body) {
        stream.set_header(HeaderKind::Request, "x-gateway-destination-endpoint", Some(dst.as_bytes()));
        // The route is chosen by that header: match again (Wasm's header writes do this).
        stream.clear_route_cache();
    }
    CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_headers() -> u32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_response_body() -> u32 {
    CONTINUE
}

#[no_mangle]
pub extern "C" fn envoy_dynamic_module_on_http_filter_stream_complete() {}
