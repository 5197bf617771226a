//! A minimal HTTP/1.1 client for the calls one simulated worker makes to another (a vLLM
//! decode pulling KV from its prefill, the llm-d sidecar's prefill request): one request per
//! connection, an answer of bounded size, in bounded time.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The largest answer read (bytes, head included).
const MAX_ANSWER: u64 = 64 << 20;

#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
}

impl Answer {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// `host` as it goes in a URL authority (IPv6 literals in brackets).
pub fn authority(host: &str, port: u16) -> String {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Sends one request to `host:port` and reads the whole answer, within `timeout`.
pub async fn request(
    method: &str,
    host: &str,
    port: u16,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
    timeout: Duration,
) -> Result<Answer, String> {
    let target = authority(host, port);
    let attempt = async {
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        let mut conn =
            tokio::net::TcpStream::connect((bare, port)).await.map_err(|e| format!("cannot connect: {e}"))?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nhost: {target}\r\nconnection: close\r\ncontent-length: {}\r\n",
            body.len()
        );
        if !body.is_empty() {
            head.push_str("content-type: application/json\r\n");
        }
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        conn.write_all(head.as_bytes()).await.map_err(|e| e.to_string())?;
        conn.write_all(body).await.map_err(|e| e.to_string())?;
        let mut raw = Vec::new();
        (&mut conn).take(MAX_ANSWER + 1).read_to_end(&mut raw).await.map_err(|e| e.to_string())?;
        if raw.len() as u64 > MAX_ANSWER {
            return Err(format!("answer over {MAX_ANSWER} bytes"));
        }
        parse(&raw)
    };
    match tokio::time::timeout(timeout, attempt).await {
        Ok(r) => r.map_err(|e| format!("{method} http://{target}{path}: {e}")),
        Err(_) => Err(format!("{method} http://{target}{path}: no answer in {} ms", timeout.as_millis())),
    }
}

fn parse(raw: &[u8]) -> Result<Answer, String> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or("no complete answer")?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| "answer head is not text")?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .strip_prefix("HTTP/1.")
        .and_then(|rest| rest.get(2..5))
        .and_then(|code| code.parse::<u16>().ok())
        .ok_or_else(|| format!("not an HTTP answer: {status_line:?}"))?;
    let mut chunked = false;
    let mut length = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") && value.eq_ignore_ascii_case("chunked") {
            chunked = true;
        } else if name.eq_ignore_ascii_case("content-length") {
            length = value.parse::<usize>().ok();
        }
    }
    let rest = &raw[end + 4..];
    let body = if chunked {
        dechunk(rest)?
    } else {
        match length {
            Some(n) if n <= rest.len() => rest[..n].to_vec(),
            Some(n) => return Err(format!("answer cut short ({} of {n} bytes)", rest.len())),
            None => rest.to_vec(),
        }
    };
    Ok(Answer { status, body })
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = rest.windows(2).position(|w| w == b"\r\n").ok_or("chunked answer cut short")?;
        let size_text = std::str::from_utf8(&rest[..eol]).map_err(|_| "bad chunk size")?;
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| format!("bad chunk size {size_text:?}"))?;
        rest = &rest[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        if rest.len() < size + 2 {
            return Err("chunked answer cut short".into());
        }
        out.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_with_a_length_or_in_chunks_are_read_whole() {
        let a = parse(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").unwrap();
        assert_eq!((a.status, a.body.as_slice()), (200, &b"{}"[..]));
        let a =
            parse(b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n")
                .unwrap();
        assert_eq!((a.status, a.text().as_str()), (404, "abcde"));
        assert!(parse(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{}").is_err());
        assert!(parse(b"SSH-2.0\r\n\r\n").is_err());
        assert!(parse(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab").is_err());
    }

    #[test]
    fn ipv6_hosts_get_brackets() {
        assert_eq!(authority("::1", 80), "[::1]:80");
        assert_eq!(authority("[::1]", 80), "[::1]:80");
        assert_eq!(authority("h", 1), "h:1");
    }

    #[tokio::test]
    async fn nothing_listening_is_an_error_naming_the_target() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let err = request("GET", "127.0.0.1", port, "/x", &[], b"", Duration::from_secs(5)).await.unwrap_err();
        assert!(err.contains(&format!("127.0.0.1:{port}/x")), "{err}");
    }
}
