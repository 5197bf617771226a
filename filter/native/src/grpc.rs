//! The control plane's gRPC streams for the native build, opened by this module itself (tonic
//! over one HTTP/2 connection) rather than through Envoy, whose dynamic-modules ABI has no gRPC
//! streams. Messages are opaque bytes, as the filter's `StreamHost` hands them over: the filter
//! encodes and decodes them, this only frames them.
//!
//! Each stream is a task: what the plugin sends goes through a channel to the request side;
//! what arrives, and the stream's end with its gRPC status, come back as [`Event`]s to the
//! ticker's loop, which hands them to the plugin one at a time (a bounded channel: a fast
//! control plane waits for a slow plugin instead of filling memory).

use std::cell::RefCell;
use std::collections::HashMap;

use tokio::sync::mpsc;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::metadata::{AsciiMetadataValue, MetadataKey};
use tonic::transport::{Channel, Endpoint};
use tonic::Status;

/// Largest message accepted from the control plane: a full snapshot at 10^6 index blocks is
/// about 16 MiB, so this leaves room for several times that (Envoy's own gRPC client, which
/// the `.wasm` uses, sets no limit). A larger one ends the stream with an error, logged, and
/// the link reconnects.
const MAX_MESSAGE: usize = 128 << 20;

/// Events queued towards the plugin at most: with [`MAX_MESSAGE`], what a control plane can
/// make this thread hold at once is bounded (4 × 128 MiB), however fast it sends.
pub const INBOX: usize = 4;

/// What happened on a stream.
#[derive(Debug)]
pub enum Event {
    Message(u32, Vec<u8>),
    /// The stream ended: its gRPC status code (0 when the server closed it cleanly).
    Closed(u32, u32),
}

/// Messages as bytes, framed by gRPC and nothing else.
#[derive(Clone, Copy, Debug, Default)]
struct Raw;

impl Codec for Raw {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = Raw;
    type Decoder = Raw;
    fn encoder(&mut self) -> Raw {
        Raw
    }
    fn decoder(&mut self) -> Raw {
        Raw
    }
}

impl Encoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl Decoder for Raw {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let mut out = vec![0; bytes::Buf::remaining(src)];
        bytes::Buf::copy_to_slice(src, &mut out);
        Ok(Some(out))
    }
}

/// The open streams, by the token the plugin knows them by.
pub struct Streams {
    endpoint: Endpoint,
    /// The connection new streams go over (replaced after a stream closes).
    channel: RefCell<Channel>,
    events: mpsc::Sender<Event>,
    open: RefCell<HashMap<u32, Open>>,
    next: std::cell::Cell<u32>,
}

/// Messages queued towards the control plane at most, per stream: past it the control plane is
/// not reading (HTTP/2 flow control holds them), and the send fails, which makes the link
/// reconnect rather than hold reports without bound.
const OUTBOX: usize = 64;

struct Open {
    /// Dropped to end the request side (half-close).
    outbound: Option<mpsc::Sender<Vec<u8>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Streams {
    /// Streams to `address` (`http://host:port`; connected on first use, reconnected by tonic).
    pub fn new(address: &str, events: mpsc::Sender<Event>) -> Result<Self, String> {
        let endpoint =
            Channel::from_shared(address.to_string()).map_err(|e| format!("control_plane_address `{address}`: {e}"))?;
        let channel = RefCell::new(endpoint.connect_lazy());
        Ok(Self { endpoint, channel, events, open: RefCell::default(), next: 1.into() })
    }

    /// Opens `/{service}/{method}` with `metadata`; the answer's messages and end arrive as
    /// [`Event`]s. Must run inside the ticker's runtime.
    pub fn open(&self, service: &str, method: &str, metadata: &[(&str, &[u8])]) -> Result<u32, String> {
        let path = PathAndQuery::from_maybe_shared(format!("/{service}/{method}")).map_err(|e| e.to_string())?;
        let mut headers = tonic::metadata::MetadataMap::new();
        for (key, value) in metadata {
            let key = MetadataKey::from_bytes(key.as_bytes()).map_err(|e| e.to_string())?;
            let value = AsciiMetadataValue::try_from(*value).map_err(|e| e.to_string())?;
            headers.insert(key, value);
        }
        let token = self.next.get();
        self.next.set(token.wrapping_add(1).max(1));
        let (tx, rx) = mpsc::channel::<Vec<u8>>(OUTBOX);
        let (channel, events) = (self.channel.borrow().clone(), self.events.clone());
        let task = tokio::spawn(async move {
            let status = run(channel, path, headers, rx, token, &events).await;
            let _ = events.send(Event::Closed(token, status)).await;
        });
        self.open.borrow_mut().insert(token, Open { outbound: Some(tx), task });
        Ok(token)
    }

    pub fn send(&self, token: u32, message: &[u8], end_of_stream: bool) -> Result<(), String> {
        let mut open = self.open.borrow_mut();
        let stream = open.get_mut(&token).ok_or("no such stream")?;
        let sender = stream.outbound.as_ref().ok_or("the stream's request side is closed")?;
        sender.try_send(message.to_vec()).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => format!("the control plane has not read the last {OUTBOX} messages"),
            mpsc::error::TrySendError::Closed(_) => "the stream has ended".to_string(),
        })?;
        if end_of_stream {
            stream.outbound = None;
        }
        Ok(())
    }

    /// Ends the stream at once (nothing more arrives from it).
    pub fn cancel(&self, token: u32) {
        if let Some(stream) = self.open.borrow_mut().remove(&token) {
            stream.task.abort();
        }
    }

    /// Forgets a stream that ended by itself. The next streams go over a new connection: a
    /// replica that stopped leading refuses streams on the connection it still holds, and
    /// behind a Service or Envoy's loopback link a new one reaches whichever replica serves.
    pub fn closed(&self, token: u32) {
        self.open.borrow_mut().remove(&token);
        *self.channel.borrow_mut() = self.endpoint.connect_lazy();
    }
}

impl Drop for Streams {
    fn drop(&mut self) {
        for (_, stream) in self.open.borrow_mut().drain() {
            stream.task.abort();
        }
    }
}

/// One stream from start to end; its gRPC status code.
async fn run(
    channel: Channel,
    path: PathAndQuery,
    headers: tonic::metadata::MetadataMap,
    outbound: mpsc::Receiver<Vec<u8>>,
    token: u32,
    events: &mpsc::Sender<Event>,
) -> u32 {
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(MAX_MESSAGE);
    if let Err(e) = grpc.ready().await {
        log::warn!("control plane unreachable: {e}");
        return tonic::Code::Unavailable as u32;
    }
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(outbound));
    *request.metadata_mut() = headers;
    let name = path.to_string();
    let mut inbound = match grpc.streaming(request, path, Raw).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            log::warn!("control-plane stream {name} refused: {status}");
            return status.code() as u32;
        }
    };
    loop {
        match inbound.message().await {
            Ok(Some(message)) => {
                if events.send(Event::Message(token, message)).await.is_err() {
                    return tonic::Code::Cancelled as u32;
                }
            }
            Ok(None) => return 0,
            Err(status) => {
                log::warn!("control-plane stream {name} ended: {status}");
                return status.code() as u32;
            }
        }
    }
}
