//! The worker URL policy: which addresses kvmesh-cp registers as workers, whatever the source
//! (flags, `/add_worker`, discovery). Every gateway sends prompts to what is registered, so an
//! address that is no worker — the host's own wildcard, a link-local service such as a cloud
//! metadata endpoint — is refused, and `--worker-cidrs` can restrict workers to the networks
//! they live in.
//!
//! Every URL is also canonicalised before it is compared or stored, so that one worker is one
//! worker whichever way it is spelled: `http://` + the address + `:` + the port, the scheme and
//! host lower-cased, IPv6 in its shortest form (an IPv4-mapped address as its IPv4 address),
//! the port explicit (80 when none is given) and without leading zeros, no trailing slash. The
//! host is an IP address; the one name accepted, `localhost`, is spelled `127.0.0.1` (names are
//! not resolved: `::1` stays another address). A path, query, fragment or user info is refused.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Worker URL policy: what `/add_worker`, the flags and discovery may register.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkerPolicy {
    /// When not empty, worker addresses must be in one of these networks.
    pub cidrs: Vec<Cidr>,
}

/// A network, `10.0.0.0/8` or `fd00::/8` (a bare address is a /32 or /128).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    net: IpAddr,
    bits: u8,
}

impl Cidr {
    pub fn parse(text: &str) -> Result<Self, String> {
        let bad = || format!("`{text}` is not a network (ADDRESS/BITS, e.g. 10.0.0.0/8)");
        let (addr, bits) = match text.split_once('/') {
            Some((a, b)) => (a, Some(b)),
            None => (text, None),
        };
        let net: IpAddr = addr.parse().map_err(|_| bad())?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let bits = match bits {
            Some(b) => b.parse::<u8>().ok().filter(|&b| b <= max).ok_or_else(bad)?,
            None => max,
        };
        Ok(Self { net, bits })
    }

    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.net, unmapped(ip)) {
            (IpAddr::V4(n), IpAddr::V4(a)) => {
                prefix_eq(u128::from(u32::from(n)), u128::from(u32::from(a)), 32, self.bits)
            }
            (IpAddr::V6(n), IpAddr::V6(a)) => prefix_eq(u128::from(n), u128::from(a), 128, self.bits),
            _ => false,
        }
    }
}

fn prefix_eq(a: u128, b: u128, width: u32, bits: u8) -> bool {
    let bits = u32::from(bits);
    if bits == 0 {
        return true;
    }
    let shift = width - bits;
    (a >> shift) == (b >> shift)
}

/// IPv4-mapped IPv6 addresses (`::ffff:a.b.c.d`) as the IPv4 address they are.
fn unmapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// Why an address can never be a worker, if it cannot.
fn forbidden(ip: IpAddr) -> Option<&'static str> {
    match unmapped(ip) {
        IpAddr::V4(v4) if v4.is_unspecified() => Some("the unspecified address (0.0.0.0) is no worker"),
        IpAddr::V4(v4) if v4.is_link_local() => {
            Some("link-local addresses (169.254.0.0/16: cloud metadata services) are never workers")
        }
        IpAddr::V4(v4) if v4.is_broadcast() || v4.is_multicast() => {
            Some("broadcast and multicast addresses are no workers")
        }
        IpAddr::V6(v6) if v6.is_unspecified() => Some("the unspecified address (::) is no worker"),
        IpAddr::V6(v6) if (v6.segments()[0] & 0xffc0) == 0xfe80 => {
            Some("link-local addresses (fe80::/10) are never workers")
        }
        IpAddr::V6(v6) if v6.is_multicast() => Some("multicast addresses are no workers"),
        _ => None,
    }
}

/// The worker address `url` names: `http://HOST[:PORT][/]`, HOST an IP address (IPv6 in
/// brackets) or `localhost`, PORT decimal digits (80 when left out).
fn address(url: &str) -> Result<SocketAddr, String> {
    let only_http = || format!("{url}: only http:// worker URLs are supported");
    let (scheme, rest) = url.split_once("://").ok_or_else(only_http)?;
    if !scheme.eq_ignore_ascii_case("http") {
        return Err(only_http());
    }
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    if !tail.is_empty() && tail != "/" {
        return Err(format!("{url}: a worker URL is http://HOST:PORT, without a path, query or fragment"));
    }
    if authority.contains('@') {
        return Err(format!("{url}: a worker URL has no user info"));
    }
    let bad_host = || format!("{url}: the host must be an IP address (IPv6 in brackets) or localhost");
    let (ip, port) = if let Some(bracketed) = authority.strip_prefix('[') {
        let (host, after) = bracketed.split_once(']').ok_or_else(bad_host)?;
        let ip = host.parse::<Ipv6Addr>().map_err(|_| bad_host())?;
        let port = match after {
            "" => None,
            p => Some(p.strip_prefix(':').ok_or_else(bad_host)?),
        };
        (IpAddr::V6(ip), port)
    } else {
        let (host, port) = match authority.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        };
        let ip = if host.eq_ignore_ascii_case("localhost") {
            Ipv4Addr::LOCALHOST
        } else {
            host.parse::<Ipv4Addr>().map_err(|_| bad_host())?
        };
        (IpAddr::V4(ip), port)
    };
    let port = match port {
        None | Some("") => 80,
        Some(digits) => digits
            .bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| digits.trim_start_matches('0'))
            .and_then(|d| if d.is_empty() { Some(0) } else { d.parse::<u16>().ok() })
            .ok_or_else(|| format!("{url}: `{digits}` is not a port"))?,
    };
    Ok(SocketAddr::new(unmapped(ip), port))
}

/// The one spelling of the worker `url` names (see the module's documentation).
pub fn canonical(url: &str) -> Result<String, String> {
    address(url).map(|a| format!("http://{a}"))
}

/// The canonical spelling of `url` if it may be registered under `policy`.
pub fn check(url: &str, policy: &WorkerPolicy) -> Result<String, String> {
    let addr = address(url)?;
    if addr.port() == 0 {
        return Err(format!("{url}: port 0 is no worker"));
    }
    if let Some(why) = forbidden(addr.ip()) {
        return Err(format!("{url}: {why}"));
    }
    if !policy.cidrs.is_empty() && !policy.cidrs.iter().any(|c| c.contains(addr.ip())) {
        return Err(format!("{url}: {} is outside --worker-cidrs", addr.ip()));
    }
    Ok(format!("http://{addr}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open() -> WorkerPolicy {
        WorkerPolicy::default()
    }

    fn within(cidrs: &[&str]) -> WorkerPolicy {
        WorkerPolicy { cidrs: cidrs.iter().map(|c| Cidr::parse(c).unwrap()).collect() }
    }

    #[test]
    fn ordinary_worker_addresses_pass() {
        for url in ["http://10.0.0.5:30000", "http://127.0.0.1:30001", "http://[fd00::1]:8000", "http://localhost:80"] {
            assert!(check(url, &open()).is_ok(), "{url}");
        }
    }

    #[test]
    fn other_schemes_are_refused() {
        for url in
            ["https://10.0.0.5:443", "file:///etc/passwd", "gopher://10.0.0.5:70", "ftp://10.0.0.5:21", "10.0.0.5:80"]
        {
            let e = check(url, &open()).unwrap_err();
            assert!(e.contains("http://"), "{url}: {e}");
        }
    }

    #[test]
    fn unspecified_addresses_are_refused() {
        for url in ["http://0.0.0.0:9901", "http://[::]:9901", "http://[::ffff:0.0.0.0]:80"] {
            assert!(check(url, &open()).unwrap_err().contains("unspecified"), "{url}");
        }
    }

    #[test]
    fn link_local_and_cloud_metadata_are_refused() {
        for url in [
            "http://169.254.169.254:80",
            "http://169.254.0.1:8000",
            "http://[fe80::1]:80",
            "http://[febf::1]:80",
            "http://[::ffff:169.254.169.254]:80",
        ] {
            assert!(check(url, &open()).unwrap_err().contains("link-local"), "{url}");
        }
        assert!(check("http://[fec0::1]:80", &open()).is_ok(), "fec0:: is outside fe80::/10");
    }

    #[test]
    fn multicast_broadcast_and_port_zero_are_refused() {
        for url in ["http://224.0.0.1:80", "http://255.255.255.255:80", "http://[ff02::1]:80", "http://10.0.0.1:0"] {
            assert!(check(url, &open()).is_err(), "{url}");
        }
    }

    #[test]
    fn worker_cidrs_restrict_the_networks() {
        let p = within(&["10.0.0.0/8", "fd00::/8", "192.168.1.7"]);
        assert!(check("http://10.20.30.40:8000", &p).is_ok());
        assert!(check("http://[fd12::3]:8000", &p).is_ok());
        assert!(check("http://192.168.1.7:8000", &p).is_ok());
        assert!(check("http://[::ffff:10.1.1.1]:8000", &p).is_ok(), "an IPv4-mapped address is its IPv4 address");
        for url in ["http://127.0.0.1:8000", "http://192.168.1.8:8000", "http://11.0.0.1:80", "http://[fe00::1]:80"] {
            assert!(check(url, &p).unwrap_err().contains("--worker-cidrs"), "{url}");
        }
        assert!(check("http://1.2.3.4:80", &within(&["0.0.0.0/0"])).is_ok());
    }

    #[test]
    fn urls_are_canonical() {
        for (spelled, one) in [
            ("http://127.0.0.1:30001", "http://127.0.0.1:30001"),
            ("http://127.0.0.1:030001/", "http://127.0.0.1:30001"),
            ("HTTP://LOCALHOST:30001", "http://127.0.0.1:30001"),
            ("Http://localhost", "http://127.0.0.1:80"),
            ("http://10.0.0.5:/", "http://10.0.0.5:80"),
            ("http://[FD00:0:0::1]:0008000/", "http://[fd00::1]:8000"),
            ("http://[fd00::1]", "http://[fd00::1]:80"),
            ("http://[::FFFF:10.1.2.3]:80", "http://10.1.2.3:80"),
            ("http://[::1]:5", "http://[::1]:5"),
        ] {
            assert_eq!(canonical(spelled).as_deref(), Ok(one), "{spelled}");
            assert_eq!(check(spelled, &open()).as_deref(), Ok(one), "{spelled}");
        }
    }

    #[test]
    fn anything_but_scheme_host_and_port_is_refused() {
        for url in [
            "http://127.0.0.1:1/v1",
            "http://127.0.0.1:1//",
            "http://127.0.0.1:1?a=b",
            "http://127.0.0.1:1/?a=b",
            "http://127.0.0.1:1#top",
            "http://user@127.0.0.1:1",
            "http://user:pw@127.0.0.1:1",
            "http://127.0.0.1:+1",
            "http://127.0.0.1:-1",
            "http://127.0.0.1:65536",
            "http://127.0.0.1:1:2",
            "http://worker.example:80",
            "http://127.0.0.01:80",
            "http://fd00::1:80",
            "http://[fd00::1]x:80",
            "http://[fe80::1%eth0]:80",
            "http://:80",
        ] {
            assert!(canonical(url).is_err(), "{url}: {:?}", canonical(url));
        }
    }

    #[test]
    fn networks_parse_or_say_why_not() {
        assert!(Cidr::parse("10.0.0.0/8").is_ok());
        assert!(Cidr::parse("::/0").is_ok());
        for bad in ["10.0.0.0/33", "fd00::/129", "10.0.0/8", "ten/8", "10.0.0.0/x", ""] {
            assert!(Cidr::parse(bad).unwrap_err().contains("not a network"), "{bad}");
        }
    }
}
