//! The wrappers over a fake Envoy: this test binary defines the ABI's callbacks itself (Envoy
//! does when it loads a module), keeping one stream's headers and body in a thread-local, and
//! checks how [`Stream`] reads and writes them: both shapes of the ABI's counts, refusals,
//! absent values, and a count no buffer could hold.

use std::cell::RefCell;
use std::ffi::c_void;

use super::*;

#[derive(Default)]
struct Fake {
    headers: Vec<(Vec<u8>, Vec<u8>)>,
    chunks: Vec<Vec<u8>>,
    /// Counts written through the pointer (older ABIs) instead of returned.
    through_pointer: bool,
    /// A count Envoy claims, whatever it holds.
    claimed: Option<usize>,
    /// `get_headers` / `get_body_chunks` refuse.
    refuse: bool,
    /// A header found, but no bytes pointed at.
    null_value: bool,
    set: Vec<(u32, Vec<u8>, Vec<u8>)>,
    /// What draining finds: the running hook's chunk, Envoy's buffer.
    in_hook: bool,
    buffered: bool,
    appended: Vec<(u32, Vec<u8>)>,
}

thread_local! {
    static FAKE: RefCell<Fake> = RefCell::new(Fake::default());
}

fn with<T>(f: impl FnOnce(&mut Fake) -> T) -> T {
    FAKE.with(|fake| f(&mut fake.borrow_mut()))
}

fn stream() -> Stream<'static> {
    // SAFETY: the fake ignores the pointer.
    unsafe { Stream::new(std::ptr::null_mut()) }
}

/// A count as the fake's ABI gives it.
unsafe fn give(n: usize, out: *mut usize) -> usize {
    let (n, through) = with(|f| (f.claimed.unwrap_or(n), f.through_pointer));
    if through {
        *out = n;
        1
    } else {
        n
    }
}

#[no_mangle]
unsafe extern "C" fn envoy_dynamic_module_callback_http_get_headers_size(
    _: *mut c_void,
    _: u32,
    out: *mut usize,
) -> usize {
    give(with(|f| f.headers.len()), out)
}

#[no_mangle]
unsafe extern "C" fn envoy_dynamic_module_callback_http_get_headers(
    _: *mut c_void,
    _: u32,
    out: *mut HeaderPair,
) -> bool {
    FAKE.with(|fake| {
        let fake = fake.borrow();
        if fake.refuse {
            return false;
        }
        for (i, (k, v)) in fake.headers.iter().enumerate() {
            *out.add(i) = HeaderPair { key: k.as_ptr(), key_len: k.len(), value: v.as_ptr(), value_len: v.len() };
        }
        true
    })
}

#[no_mangle]
unsafe extern "C" fn envoy_dynamic_module_callback_http_get_header(
    _: *mut c_void,
    _: u32,
    key: Buffer,
    out: *mut Buffer,
    _: usize,
    _: *mut usize,
) -> bool {
    let key = key.bytes().to_vec();
    FAKE.with(|fake| {
        let fake = fake.borrow();
        let Some((_, v)) = fake.headers.iter().find(|(k, _)| *k == key) else { return false };
        *out = if fake.null_value { Buffer::EMPTY } else { Buffer::of(v) };
        true
    })
}

#[no_mangle]
unsafe extern "C" fn envoy_dynamic_module_callback_http_set_header(
    _: *mut c_void,
    kind: u32,
    k: Buffer,
    v: Buffer,
) -> bool {
    let (k, v) = (k.bytes().to_vec(), v.bytes().to_vec());
    with(|f| f.set.push((kind, k, v)));
    true
}

#[no_mangle]
unsafe extern "C" fn envoy_dynamic_module_callback_http_get_body_chunks_size(
    _: *mut c_void,
    _: u32,
    out: *mut usize,
) -> usize {
    give(with(|f| f.chunks.len()), out)
}

#[no_mangle]
unsafe extern "C" fn envoy_dynamic_module_callback_http_get_body_chunks(
    _: *mut c_void,
    _: u32,
    out: *mut Buffer,
) -> bool {
    FAKE.with(|fake| {
        let fake = fake.borrow();
        if fake.refuse {
            return false;
        }
        for (i, c) in fake.chunks.iter().enumerate() {
            *out.add(i) = Buffer::of(c);
        }
        true
    })
}

#[no_mangle]
unsafe extern "C" fn envoy_dynamic_module_callback_http_get_body_size(
    _: *mut c_void,
    _: u32,
    out: *mut usize,
) -> usize {
    give(with(|f| f.chunks.iter().map(Vec::len).sum()), out)
}

#[no_mangle]
unsafe extern "C" fn envoy_dynamic_module_callback_http_drain_body(_: *mut c_void, kind: u32, _: usize) -> bool {
    with(|f| if kind == BodyKind::ReceivedRequest as u32 { f.in_hook } else { f.buffered })
}

#[no_mangle]
unsafe extern "C" fn envoy_dynamic_module_callback_http_append_body(_: *mut c_void, kind: u32, data: Buffer) -> bool {
    let data = data.bytes().to_vec();
    with(|f| f.appended.push((kind, data)));
    true
}

/// The callbacks these tests do not reach, defined as Envoy would (doing nothing).
macro_rules! unused_callbacks {
    ($($name:ident($($arg:ty),*) -> $ret:ty = $value:expr;)*) => {$(
        #[no_mangle]
        extern "C" fn $name($(_: $arg),*) -> $ret {
            $value
        }
    )*};
}

unused_callbacks! {
    envoy_dynamic_module_callback_http_clear_route_cache(*mut c_void) -> () = ();
    envoy_dynamic_module_callback_http_set_filter_state_bytes(*mut c_void, Buffer, Buffer) -> bool = false;
    envoy_dynamic_module_callback_http_filter_get_attribute_string(*mut c_void, u32, *mut Buffer) -> bool = false;
    envoy_dynamic_module_callback_http_send_response(*mut c_void, u32, *const HeaderPair, usize, Buffer, Buffer) -> () = ();
    envoy_dynamic_module_callback_http_filter_continue_decoding(*mut c_void) -> () = ();
    envoy_dynamic_module_callback_http_filter_continue_encoding(*mut c_void) -> () = ();
    envoy_dynamic_module_callback_http_filter_config_define_counter(*mut c_void, Buffer, *const Buffer, usize, *mut usize) -> u32 = 1;
    envoy_dynamic_module_callback_http_filter_config_define_gauge(*mut c_void, Buffer, *const Buffer, usize, *mut usize) -> u32 = 1;
    envoy_dynamic_module_callback_http_filter_config_define_histogram(*mut c_void, Buffer, *const Buffer, usize, *mut usize) -> u32 = 1;
    envoy_dynamic_module_callback_http_filter_increment_counter(*mut c_void, usize, *const Buffer, usize, u64) -> u32 = 0;
    envoy_dynamic_module_callback_http_filter_set_gauge(*mut c_void, usize, *const Buffer, usize, u64) -> u32 = 0;
    envoy_dynamic_module_callback_http_filter_record_histogram_value(*mut c_void, usize, *const Buffer, usize, u64) -> u32 = 0;
    envoy_dynamic_module_callback_http_filter_config_increment_counter(*mut c_void, usize, *const Buffer, usize, u64) -> u32 = 0;
    envoy_dynamic_module_callback_http_filter_config_set_gauge(*mut c_void, usize, *const Buffer, usize, u64) -> u32 = 0;
    envoy_dynamic_module_callback_http_filter_config_record_histogram_value(*mut c_void, usize, *const Buffer, usize, u64) -> u32 = 0;
    envoy_dynamic_module_callback_http_filter_http_callout(*mut c_void, *mut u64, Buffer, *const HeaderPair, usize, Buffer, u64) -> u32 = 1;
    envoy_dynamic_module_callback_log_enabled(u32) -> bool = false;
    envoy_dynamic_module_callback_log(u32, Buffer) -> () = ();
    envoy_dynamic_module_callback_http_filter_scheduler_new(*mut c_void) -> *mut c_void = std::ptr::null_mut();
    envoy_dynamic_module_callback_http_filter_scheduler_commit(*mut c_void, u64) -> () = ();
    envoy_dynamic_module_callback_http_filter_scheduler_delete(*mut c_void) -> () = ();
    envoy_dynamic_module_callback_http_filter_config_scheduler_new(*mut c_void) -> *mut c_void = std::ptr::null_mut();
    envoy_dynamic_module_callback_http_filter_config_scheduler_commit(*mut c_void, u64) -> () = ();
    envoy_dynamic_module_callback_http_filter_config_scheduler_delete(*mut c_void) -> () = ();
    envoy_dynamic_module_callback_http_filter_config_http_callout(*mut c_void, *mut u64, Buffer, *const HeaderPair, usize, Buffer, u64) -> u32 = 1;
}

fn headers(pairs: &[(&str, &str)]) {
    with(|f| f.headers = pairs.iter().map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec())).collect());
}

#[test]
fn headers_are_read_whatever_shape_the_count_has() {
    headers(&[(":path", "/generate"), ("x-a", ""), ("x-b", "é")]);
    for through in [false, true] {
        with(|f| f.through_pointer = through);
        let got = stream().headers(HeaderKind::Request);
        let want: Vec<(&[u8], &[u8])> = vec![(b":path", b"/generate"), (b"x-a", b""), (b"x-b", "é".as_bytes())];
        assert_eq!(got, want, "count through the pointer: {through}");
    }
}

#[test]
fn a_refusal_or_a_count_no_map_has_reads_as_no_headers() {
    headers(&[("a", "1")]);
    with(|f| f.refuse = true);
    assert!(stream().headers(HeaderKind::Request).is_empty());
    with(|f| {
        f.refuse = false;
        f.claimed = Some(MAX_ENTRIES + 1);
    });
    // Not a buffer of 2^20 pairs allocated and read past the map: nothing.
    assert!(stream().headers(HeaderKind::Response).is_empty());
    assert!(stream().body(BodyKind::BufferedRequest).is_empty());
}

#[test]
fn one_header_is_found_or_absent_and_a_value_with_no_bytes_is_absent() {
    headers(&[("x-kvmesh-worker", "10.0.0.1:8000")]);
    assert_eq!(stream().header(HeaderKind::Response, "x-kvmesh-worker"), Some(&b"10.0.0.1:8000"[..]));
    assert_eq!(stream().header(HeaderKind::Response, "x-other"), None);
    with(|f| f.null_value = true);
    assert_eq!(stream().header(HeaderKind::Response, "x-kvmesh-worker"), None);
}

#[test]
fn a_header_set_or_removed_reaches_envoy_as_given() {
    assert!(stream().set_header(HeaderKind::Request, "content-length", Some(b"12")));
    assert!(stream().set_header(HeaderKind::Response, "x-gone", None));
    let set = with(|f| std::mem::take(&mut f.set));
    assert_eq!(set, vec![(0, b"content-length".to_vec(), b"12".to_vec()), (2, b"x-gone".to_vec(), Vec::new())]);
}

#[test]
fn a_body_is_read_in_its_chunks_and_sized_in_either_shape() {
    with(|f| f.chunks = vec![b"{\"text\":".to_vec(), Vec::new(), b"\"hi\"}".to_vec()]);
    for through in [false, true] {
        with(|f| f.through_pointer = through);
        let chunks = stream().body(BodyKind::BufferedRequest);
        assert_eq!(chunks.concat(), b"{\"text\":\"hi\"}", "through the pointer: {through}");
        assert_eq!(stream().body_size(BodyKind::BufferedRequest), 13);
    }
}

#[test]
fn a_body_is_replaced_where_the_stream_goes_on_from() {
    let s = stream();
    with(|f| (f.in_hook, f.buffered) = (true, true));
    assert!(s.replace_body(BodyKind::BufferedRequest, BodyKind::ReceivedRequest, b"new"));
    with(|f| (f.in_hook, f.buffered) = (false, true));
    assert!(s.replace_body(BodyKind::BufferedRequest, BodyKind::ReceivedRequest, b"again"));
    with(|f| (f.in_hook, f.buffered) = (false, false));
    assert!(!s.replace_body(BodyKind::BufferedRequest, BodyKind::ReceivedRequest, b"lost"));
    let appended = with(|f| std::mem::take(&mut f.appended));
    assert_eq!(appended, vec![(0, b"new".to_vec()), (1, b"again".to_vec())], "the hook's chunk, else the buffer");
}

#[test]
fn a_null_buffer_is_empty() {
    // SAFETY: null is allowed.
    assert!(unsafe { Buffer::EMPTY.bytes() }.is_empty());
    // SAFETY: the slice outlives the read.
    assert_eq!(unsafe { Buffer::of(b"abc").bytes() }, b"abc");
}
