//! A minimal ZMTP 3 peer (NULL security) for the two sockets the subscribers need — SUB on an
//! engine's publisher, DEALER on its replay ROUTER — that bounds every frame before it
//! allocates: the `zeromq` crate's decoder reserves whatever length a frame header claims (a
//! publisher that sends a 2^60-byte header aborts the process) and buffers any number of
//! frames per message. Here a frame over [`MAX_FRAME_BYTES`], a message of more than
//! [`MAX_FRAMES`] frames or a malformed header ends the connection; nothing larger is ever
//! read into memory.
//!
//! What is spoken (ZMTP 3.0, which libzmq 4 and the `zeromq` crate accept): the 64-byte
//! greeting with the NULL mechanism, a READY command with `Socket-Type`, a SUB's subscription
//! as a message frame (`0x01` + the topic), multipart messages. Commands after the handshake
//! are read within the bound; a 3.1 peer's heartbeat PING is answered PONG, others ignored.

use std::time::Duration;

use bytes::Bytes;
use thiserror::Error;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

use super::wire::MAX_PAYLOAD_BYTES;

/// The largest frame read: a batch at its bound ([`MAX_PAYLOAD_BYTES`]) and a little more.
pub const MAX_FRAME_BYTES: u64 = MAX_PAYLOAD_BYTES as u64 + 4096;
/// The most frames one message may have (a publisher's are 3, a replay answer's 3 or 4).
pub const MAX_FRAMES: usize = 8;
/// How long the handshake may take.
const HANDSHAKE: Duration = Duration::from_secs(5);

#[derive(Debug, Error)]
pub enum ZmtpError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("`{0}` is not tcp://HOST:PORT")]
    Endpoint(String),
    #[error("the peer's greeting is not ZMTP 3 with the NULL mechanism")]
    Greeting,
    #[error("the peer did not answer READY")]
    Ready,
    #[error("handshake timed out")]
    Timeout,
    #[error("a frame of {0} bytes (at most {MAX_FRAME_BYTES})")]
    FrameTooLarge(u64),
    #[error("a message of more than {MAX_FRAMES} frames")]
    TooManyFrames,
    #[error("a frame header with reserved flags {0:#04x}")]
    Flags(u8),
}

/// One connection to a ZMTP peer.
pub struct Peer {
    read: BufReader<OwnedReadHalf>,
    write: OwnedWriteHalf,
}

/// One frame: whether it is a command, whether more follow, its body.
struct Frame {
    command: bool,
    more: bool,
    body: Bytes,
}

fn greeting() -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// The READY command's body for `socket_type`.
fn ready(socket_type: &str) -> Vec<u8> {
    let mut b = vec![5];
    b.extend_from_slice(b"READY");
    b.push(11);
    b.extend_from_slice(b"Socket-Type");
    b.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    b.extend_from_slice(socket_type.as_bytes());
    b
}

impl Peer {
    /// Connects to `endpoint` (`tcp://host:port`) as a `socket_type` (`SUB`, `DEALER`) and
    /// completes the handshake.
    pub async fn connect(endpoint: &str, socket_type: &str) -> Result<Self, ZmtpError> {
        let addr = endpoint.strip_prefix("tcp://").ok_or_else(|| ZmtpError::Endpoint(endpoint.to_string()))?;
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let (read, write) = stream.into_split();
        let mut peer = Self { read: BufReader::new(read), write };
        tokio::time::timeout(HANDSHAKE, peer.handshake(socket_type)).await.map_err(|_| ZmtpError::Timeout)??;
        Ok(peer)
    }

    async fn handshake(&mut self, socket_type: &str) -> Result<(), ZmtpError> {
        self.write.write_all(&greeting()).await?;
        let mut theirs = [0u8; 64];
        self.read.read_exact(&mut theirs).await?;
        let null = theirs.get(12..16) == Some(b"NULL".as_slice());
        if theirs[0] != 0xff || theirs[9] & 1 != 1 || theirs[10] < 3 || !null {
            return Err(ZmtpError::Greeting);
        }
        self.write_frame(true, false, &ready(socket_type)).await?;
        let frame = self.read_frame().await?;
        if !(frame.command && frame.body.get(..6) == Some(b"\x05READY".as_slice())) {
            return Err(ZmtpError::Ready);
        }
        Ok(())
    }

    async fn write_frame(&mut self, command: bool, more: bool, body: &[u8]) -> Result<(), ZmtpError> {
        let long = body.len() > 255;
        let flags = u8::from(more) | (u8::from(long) << 1) | (u8::from(command) << 2);
        let mut head = vec![flags];
        if long {
            head.extend_from_slice(&(body.len() as u64).to_be_bytes());
        } else {
            head.push(body.len() as u8);
        }
        self.write.write_all(&head).await?;
        self.write.write_all(body).await?;
        Ok(())
    }

    async fn read_frame(&mut self) -> Result<Frame, ZmtpError> {
        let flags = self.read.read_u8().await?;
        if flags & 0xf8 != 0 {
            return Err(ZmtpError::Flags(flags));
        }
        let len = if flags & 2 != 0 { self.read.read_u64().await? } else { u64::from(self.read.read_u8().await?) };
        if len > MAX_FRAME_BYTES {
            return Err(ZmtpError::FrameTooLarge(len));
        }
        let mut body = vec![0u8; len as usize];
        self.read.read_exact(&mut body).await?;
        Ok(Frame { command: flags & 4 != 0, more: flags & 1 != 0, body: Bytes::from(body) })
    }

    /// Sends a multipart message.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ZmtpError> {
        for (i, f) in frames.iter().enumerate() {
            self.write_frame(false, i + 1 < frames.len(), f).await?;
        }
        self.write.flush().await?;
        Ok(())
    }

    /// A SUB's subscription to every topic starting with `topic`.
    pub async fn subscribe(&mut self, topic: &str) -> Result<(), ZmtpError> {
        let mut body = vec![1u8];
        body.extend_from_slice(topic.as_bytes());
        self.send(&[&body]).await
    }

    /// The next message (commands skipped); an error when the peer closed or broke a bound.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ZmtpError> {
        let mut frames = Vec::new();
        loop {
            let f = self.read_frame().await?;
            if f.command {
                // A 3.1 peer's heartbeat: PING (TTL, context) is answered PONG (context).
                if let Some(rest) = f.body.strip_prefix(b"\x04PING") {
                    let mut pong = b"\x04PONG".to_vec();
                    pong.extend_from_slice(rest.get(2..).unwrap_or_default());
                    self.write_frame(true, false, &pong).await?;
                    self.write.flush().await?;
                }
                continue;
            }
            if frames.len() == MAX_FRAMES {
                return Err(ZmtpError::TooManyFrames);
            }
            frames.push(f.body);
            if !f.more {
                return Ok(frames);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;
    use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    #[test]
    fn it_subscribes_to_a_zmq_publisher_and_asks_a_router() {
        rt().block_on(async {
            let mut publisher = PubSocket::new();
            let ep = publisher.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
            let mut sub = Peer::connect(&ep, "SUB").await.unwrap();
            sub.subscribe("").await.unwrap();
            // The publisher learns the subscription asynchronously: publish until one arrives.
            let got = loop {
                let mut m = ZmqMessage::from(Bytes::from_static(b"topic"));
                m.push_back(Bytes::from_static(b"\0\0\0\0\0\0\0\x07"));
                m.push_back(Bytes::from(vec![7u8; 300]));
                publisher.send(m).await.unwrap();
                if let Ok(r) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
                    break r.unwrap();
                }
            };
            assert_eq!(got.len(), 3);
            assert_eq!((&got[0][..], got[2].len()), (&b"topic"[..], 300), "a long frame too");

            let mut router = RouterSocket::new();
            let ep = router.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
            let mut dealer = Peer::connect(&ep, "DEALER").await.unwrap();
            dealer.send(&[b"", b"\0\0\0\0\0\0\0\0"]).await.unwrap();
            let req = router.recv().await.unwrap().into_vec();
            assert_eq!(req.last().map(|b| b.len()), Some(8));
            let mut answer = ZmqMessage::from(req[0].clone());
            answer.push_back(Bytes::new());
            answer.push_back(Bytes::from_static(b"done"));
            router.send(answer).await.unwrap();
            assert_eq!(dealer.recv().await.unwrap(), vec![Bytes::new(), Bytes::from_static(b"done")]);
        });
    }

    /// A hostile publisher: its handshake is right, then a frame header claims 2^60 bytes, or a
    /// message never ends. The connection ends with nothing of that size allocated.
    #[test]
    fn a_frame_over_the_bound_or_endless_frames_end_the_connection() {
        for (what, tail) in [
            ("huge", {
                let mut t = vec![0x02u8];
                t.extend_from_slice(&(1u64 << 60).to_be_bytes());
                t
            }),
            ("endless", [0x01u8, 1, b'x'].repeat(MAX_FRAMES + 1)),
            ("flags", vec![0x80u8, 0]),
        ] {
            rt().block_on(async {
                let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
                let ep = format!("tcp://{}", listener.local_addr().unwrap());
                let server = tokio::spawn(async move {
                    let (mut s, _) = listener.accept().await.unwrap();
                    s.write_all(&greeting()).await.unwrap();
                    let mut r = ready("PUB");
                    let mut cmd = vec![0x04u8, r.len() as u8];
                    cmd.append(&mut r);
                    s.write_all(&cmd).await.unwrap();
                    s.write_all(&tail).await.unwrap();
                    let mut sink = vec![0u8; 4096];
                    while s.read(&mut sink).await.is_ok_and(|n| n > 0) {}
                });
                let mut sub = Peer::connect(&ep, "SUB").await.unwrap();
                let e = sub.recv().await.unwrap_err();
                let ok = match what {
                    "huge" => matches!(e, ZmtpError::FrameTooLarge(n) if n == 1 << 60),
                    "endless" => matches!(e, ZmtpError::TooManyFrames),
                    _ => matches!(e, ZmtpError::Flags(0x80)),
                };
                assert!(ok, "{what}: {e}");
                server.abort();
            });
        }
    }

    #[test]
    fn a_heartbeat_ping_is_answered_pong_with_its_context() {
        rt().block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let ep = format!("tcp://{}", listener.local_addr().unwrap());
            let server = tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                s.write_all(&greeting()).await.unwrap();
                let mut theirs = [0u8; 64];
                s.read_exact(&mut theirs).await.unwrap();
                let mut r = ready("PUB");
                let mut cmd = vec![0x04u8, r.len() as u8];
                cmd.append(&mut r);
                s.write_all(&cmd).await.unwrap();
                // Their READY, then: PING (TTL 10, context "ab"), then a message.
                let mut head = [0u8; 2];
                s.read_exact(&mut head).await.unwrap();
                let mut body = vec![0u8; head[1] as usize];
                s.read_exact(&mut body).await.unwrap();
                s.write_all(&[0x04, 9, 4, b'P', b'I', b'N', b'G', 0, 10, b'a', b'b']).await.unwrap();
                s.write_all(&[0x00, 1, b'm']).await.unwrap();
                let mut pong = [0u8; 9];
                s.read_exact(&mut pong).await.unwrap();
                pong
            });
            let mut sub = Peer::connect(&ep, "SUB").await.unwrap();
            assert_eq!(sub.recv().await.unwrap(), vec![Bytes::from_static(b"m")]);
            assert_eq!(&server.await.unwrap(), b"\x04\x07\x04PONGab");
        });
    }

    #[test]
    fn a_peer_that_is_not_zmtp_is_refused() {
        rt().block_on(async {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let ep = format!("tcp://{}", listener.local_addr().unwrap());
            tokio::spawn(async move {
                let (mut s, _) = listener.accept().await.unwrap();
                s.write_all(&[b'H'; 64]).await.unwrap();
                let mut sink = vec![0u8; 64];
                let _ = s.read(&mut sink).await;
            });
            assert!(matches!(Peer::connect(&ep, "SUB").await, Err(ZmtpError::Greeting)));
            assert!(matches!(Peer::connect("udp://x:1", "SUB").await, Err(ZmtpError::Endpoint(_))));
        });
    }
}
