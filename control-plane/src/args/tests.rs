use std::path::Path;

use super::*;
use kvmesh_core::policy::PolicyKind;

fn parse(args: &[&str]) -> Result<Settings, String> {
    let mut argv = vec!["kvmesh-cp"];
    argv.extend(args);
    Args::parse_from(argv).map_err(|e| e.one_line())?.load().map_err(|e| e.to_string())
}

fn args(args: &[&str]) -> Args {
    let mut argv = vec!["kvmesh-cp"];
    argv.extend(args);
    Args::parse_from(argv).map_err(|e| e.one_line()).unwrap()
}

/// A file holding `text`, removed when dropped (`name` becomes the start of its name).
fn config_file(name: &str, text: &str) -> tempfile::NamedTempFile {
    let mut file = tempfile::Builder::new().prefix(&format!("kvmesh-cp-{name}-")).tempfile().unwrap();
    std::io::Write::write_all(&mut file, text.as_bytes()).unwrap();
    file
}

fn path_str(p: &impl AsRef<Path>) -> &str {
    p.as_ref().to_str().unwrap()
}

#[test]
fn sglang_router_flags() {
    let s = parse(&[
        "--worker-urls",
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
        "--policy",
        "cache_aware",
        "--cache-threshold",
        "0.5",
    ])
    .unwrap();
    assert_eq!(s.workers.len(), 2);
    assert_eq!(s.routing.cache_threshold, Some(0.5));
    assert_eq!(s.routing.pd_disaggregation, Some(false), "the mode is always shipped");
    assert!(!s.pd);
    let s = parse(&[
        "--pd-disaggregation",
        "--prefill",
        "http://127.0.0.1:1",
        "8998",
        "--prefill",
        "http://127.0.0.1:2",
        "none",
        "--prefill",
        "http://127.0.0.1:4",
        "--decode",
        "http://127.0.0.1:3",
    ])
    .unwrap();
    assert_eq!(
        s.prefill,
        vec![
            ("http://127.0.0.1:1".into(), Some(8998)),
            ("http://127.0.0.1:2".into(), None),
            ("http://127.0.0.1:4".into(), None)
        ]
    );
    assert!(s.pd && s.routing.pd_disaggregation == Some(true));
    assert_eq!((s.routing.prefill_policy, s.routing.decode_policy), (None, None), "the filter's defaults apply");
    let s = parse(&["--pd-disaggregation", "--policy", "round_robin", "--decode-policy", "random"]).unwrap();
    assert_eq!(
        (s.routing.prefill_policy, s.routing.decode_policy),
        (Some(PolicyKind::RoundRobin), Some(PolicyKind::Random)),
        "--policy is the default of both legs"
    );
}

#[test]
fn bad_values_name_the_flag() {
    assert!(parse(&["--cache-threshold", "2"]).unwrap_err().contains("--cache-threshold"));
    assert!(parse(&["--policy", "fastest"]).unwrap_err().contains("--policy"));
    assert!(parse(&["--policy", "manual"]).unwrap_err().contains("sglang-router policy kvmesh does not have"));
    assert!(parse(&["--worker-urls", "10.0.0.1:80"]).unwrap_err().contains("--worker-urls"));
    assert!(parse(&["--prefill", "http://127.0.0.1:1", "x"]).unwrap_err().contains("--prefill"));
    assert!(parse(&["--prefill", "http://127.0.0.1:1", "1", "2"]).unwrap_err().contains("--prefill"));
    assert!(parse(&["--health-check-interval-secs", "0"]).unwrap_err().contains("--health-check-interval-secs"));
    assert!(parse(&["--balance-abs-threshold", "x"]).unwrap_err().contains("--balance-abs-threshold"));
    assert!(parse(&["--retry-jitter-factor", "3"]).unwrap_err().contains("--retry-jitter-factor"));
    assert!(parse(&["--selector", "app", "--service-discovery"]).unwrap_err().contains("--selector"));
}

#[test]
fn worker_urls_from_flags_and_config_are_canonical() {
    let path = config_file("canon.yaml", "worker-urls: [HTTP://LocalHost:05/, http://127.0.0.1:6]\n");
    let s = parse(&["--config", path_str(&path)]).unwrap();
    assert_eq!(s.workers, ["http://127.0.0.1:5", "http://127.0.0.1:6"]);
    let s = parse(&["--prefill", "http://localhost:1/", "8998", "--decode", "http://[::FFFF:10.0.0.2]:2"]).unwrap();
    assert_eq!(s.prefill, [("http://127.0.0.1:1".to_string(), Some(8998))]);
    assert_eq!(s.decode, ["http://10.0.0.2:2"]);
    let s = parse(&["--worker-urls", "http://127.0.0.1:7", "http://localhost:007/"]).unwrap();
    assert_eq!(s.workers, ["http://127.0.0.1:7"], "one worker, given twice");
    assert!(s.warnings.iter().any(|w| w.contains("http://localhost:007/")), "{:?}", s.warnings);
    let s = parse(&["--worker-kv-capacity", "http://LOCALHOST:8/=4096"]).unwrap();
    assert_eq!(s.kv_capacity.get("http://127.0.0.1:8"), Some(&4096));
    for bad in ["http://127.0.0.1:9/v1", "http://127.0.0.1:9?x=1", "http://127.0.0.1:9#f", "http://me@127.0.0.1:9"] {
        assert!(parse(&["--worker-urls", bad]).unwrap_err().starts_with("--worker-urls:"), "{bad}");
    }
}

#[test]
fn config_file_under_flags() {
    let path = config_file("cp.yaml", "worker-urls: [http://127.0.0.1:5]\npolicy: round_robin\ncache_threshold: 0.4\n");
    let s = parse(&["--config", path_str(&path), "--cache-threshold", "0.6"]).unwrap();
    assert_eq!(s.workers, vec!["http://127.0.0.1:5".to_string()]);
    assert_eq!(s.routing.policy, Some(PolicyKind::RoundRobin));
    assert_eq!(s.routing.cache_threshold, Some(0.6), "the flag wins");
    // Lists too: the command line's list replaces the file's.
    let s = parse(&["--config", path_str(&path), "--worker-urls", "http://127.0.0.1:6", "http://127.0.0.1:7"]).unwrap();
    assert_eq!(s.workers.len(), 2);
    let path = config_file("bad1.yaml", "polcy: random\n");
    let e = parse(&["--config", path_str(&path)]).unwrap_err();
    assert!(e.contains("--config") && e.contains("unknown key `polcy`"), "{e}");
    let path = config_file("bad2.yaml", "cache_threshold: 7\n");
    let e = parse(&["--config", path_str(&path)]).unwrap_err();
    assert!(e.contains("--config") && e.contains("--cache-threshold"), "{e}");
    let path = config_file("bad3.yaml", "balance-abs-threshold: lots\n");
    let e = parse(&["--config", path_str(&path)]).unwrap_err();
    assert!(e.contains("--config") && e.contains("--balance-abs-threshold"), "{e}");
    let path = config_file("bad4.yaml", "service-discovery: yes please\n");
    assert!(parse(&["--config", path_str(&path)]).unwrap_err().contains("true or false"));
    let path = config_file("bad5.yaml", "policy: [a, b]\n");
    assert!(parse(&["--config", path_str(&path)]).unwrap_err().contains("single value"));
    let path = config_file("bad6.yaml", ": not yaml [");
    assert_eq!(parse(&["--config", path_str(&path)]).unwrap_err().lines().count(), 1);
    assert!(parse(&["--config", "/nonexistent/kvmesh.yaml"]).unwrap_err().contains("--config"));
}

#[test]
fn the_discovery_keys_take_effect_from_the_config_file() {
    let path = config_file(
        "discovery.yaml",
        "service_discovery: true\nservice_discovery_namespace: llm\nservice-discovery-port: 8000\n\
         bootstrap_port_annotation: example.com/bootstrap\nrole_label: example.com/role\n\
         selector: [app=sglang, tier=gpu]\npd-disaggregation: true\n",
    );
    let s = parse(&["--config", path_str(&path)]).unwrap();
    let d = s.discovery.expect("--service-discovery from the file");
    assert_eq!(d.namespace.as_deref(), Some("llm"));
    assert_eq!(d.ports, [8000]);
    assert_eq!(d.bootstrap_annotation, "example.com/bootstrap");
    assert_eq!(d.role_label, "example.com/role");
    assert_eq!(d.selector.len(), 2);
    assert!(d.pd);
}

/// A value each argument accepts (the first of a few that clap takes for it).
fn sample(cmd: &Command, arg: &clap::Arg) -> String {
    if let Some(v) = arg.get_possible_values().first() {
        return v.get_name().to_string();
    }
    let long = format!("--{}", arg.get_long().unwrap());
    ["1", "round_robin", "prefix", "0.5", "llm-d"]
        .into_iter()
        .find(|v| cmd.clone().try_get_matches_from(["kvmesh-cp", long.as_str(), v]).is_ok())
        .unwrap_or_else(|| panic!("no sample value for {long}"))
        .to_string()
}

fn yaml_scalar(v: &str) -> serde_norway::Value {
    serde_norway::from_str(v).unwrap()
}

/// Every flag, given on the command line or as a `--config` key (alternately spelt with `_`
/// and `-`), parses to the same arguments.
#[test]
fn every_flag_means_the_same_in_the_config_file() {
    let cmd = built();
    let mut checked = 0;
    for (n, arg) in cmd.get_arguments().enumerate() {
        let Some(long) = arg.get_long() else { continue };
        if matches!(long, "config" | "help" | "version") {
            continue;
        }
        let flag = format!("--{long}");
        let key = if n % 2 == 0 { long.replace('-', "_") } else { long.to_string() };
        let range = arg.get_num_args().unwrap_or_default();
        let (argv, value): (Vec<String>, serde_norway::Value) = if range.max_values() == 0 {
            (vec![flag], serde_norway::Value::Bool(true))
        } else if long == "prefill" {
            let a = ["http://127.0.0.1:1", "8998"];
            let b = ["http://127.0.0.1:2"];
            let argv = [&["--prefill"][..], &a, &["--prefill"], &b].concat();
            let yaml = serde_norway::from_str("[[http://127.0.0.1:1, 8998], [http://127.0.0.1:2]]").unwrap();
            (argv.into_iter().map(String::from).collect(), yaml)
        } else {
            let v = sample(&cmd, arg);
            if range.max_values() > 1 {
                let yaml = serde_norway::Value::Sequence(vec![yaml_scalar(&v), yaml_scalar(&v)]);
                (vec![flag, v.clone(), v], yaml)
            } else if matches!(arg.get_action(), ArgAction::Append) {
                let yaml = serde_norway::Value::Sequence(vec![yaml_scalar(&v), yaml_scalar(&v)]);
                (vec![flag.clone(), v.clone(), flag, v], yaml)
            } else {
                (vec![flag, v.clone()], yaml_scalar(&v))
            }
        };
        let by_flag = args(&argv.iter().map(String::as_str).collect::<Vec<_>>());
        let mut doc = serde_norway::Mapping::new();
        doc.insert(key.clone().into(), value);
        let path = config_file(&format!("flag-{long}.yaml"), &serde_norway::to_string(&doc).unwrap());
        let mut by_file = args(&["--config", path_str(&path)]);
        assert_eq!(by_file.from_file, vec![arg.get_id().to_string()], "{key}");
        by_file.config = None;
        by_file.from_file.clear();
        by_file.given.retain(|id| id != "config");
        assert_eq!(by_file, by_flag, "`{key}` in the file means what {argv:?} means");
        let mut set = by_flag.clone();
        set.given.clear();
        assert_ne!(set, Args::default(), "{argv:?} sets something");
        checked += 1;
    }
    assert!(checked > 100, "{checked} flags");
}

#[test]
fn every_routing_setting_is_a_flag_under_its_own_name() {
    let cmd = built();
    for field in RoutingSettings::FIELDS {
        let long = field.replace('_', "-");
        assert!(cmd.get_arguments().any(|a| a.get_long() == Some(long.as_str())), "--{long}");
    }
}

#[test]
fn no_effect_flags_warn_and_refused_flags_name_the_equivalent() {
    let s = parse(&["--port", "30000", "--model-path", "m", "--retry-jitter-factor", "0.3", "--dp-aware"]).unwrap();
    assert_eq!(s.warnings.len(), 3, "--dp-aware takes effect: {:?}", s.warnings);
    assert!(s.warnings.iter().any(|w| w.starts_with("--port: No effect in kvmesh: clients reach the gateway")));
    assert!(s.warnings.iter().any(|w| w.starts_with("--retry-jitter-factor: No effect in kvmesh: Envoy's")));
    assert_eq!(s.routing.retry_jitter_factor, Some(0.3), "carried to the filters all the same");
    assert!(parse(&["--cache-threshold", "0.5"]).unwrap().warnings.is_empty());
    let igw = parse(&["--enable-igw", "--model-alias", "llama=meta-llama/Llama-3.1-8B"]).unwrap();
    assert_eq!(igw.routing.enable_igw, Some(true), "multi-model mode is kvmesh's own");
    assert_eq!(igw.routing.model_alias.as_deref(), Some(&["llama=meta-llama/Llama-3.1-8B".to_string()][..]));
    assert!(parse(&["--model-alias", "no-equals"]).unwrap_err().contains("alias=canonical"));
    assert!(parse(&["--jwt-issuer", "https://idp"]).unwrap_err().contains("--control-plane-api-keys"));
    assert!(parse(&["--backend", "openai"]).unwrap_err().starts_with("--backend: `openai` is refused"));
    assert!(parse(&["--backend", "sglang"]).is_ok());
}

#[test]
fn implemented_sglang_flags_take_effect() {
    let s = parse(&[
        "--host",
        "0.0.0.0",
        "--allow-insecure",
        "--prometheus-port",
        "29000",
        "--prometheus-host",
        "127.0.0.2",
        "--disable-health-check",
        "--log-level",
        "debug",
        "--max-concurrent-requests",
        "-1",
    ])
    .unwrap();
    assert_eq!((s.host.as_str(), s.prometheus_host.as_str(), s.prometheus_port), ("0.0.0.0", "127.0.0.2", Some(29000)));
    assert!(!s.health_checks);
    assert_eq!(s.log_level, "debug");
    assert_eq!(s.routing.max_concurrent_requests, Some(-1));
    let s = parse(&[]).unwrap();
    assert_eq!((s.prometheus_host.as_str(), s.health_checks, s.log_level.as_str()), ("127.0.0.1", true, "info"));
}

#[test]
fn a_non_loopback_host_needs_a_token_and_api_keys_or_allow_insecure() {
    let token = config_file("grpc.token", "  s3cret-token\n");
    let token = path_str(&token);
    let e = parse(&["--host", "0.0.0.0"]).unwrap_err();
    assert!(e.starts_with("--host: 0.0.0.0 is not a loopback address"), "{e}");
    assert!(
        e.contains("--grpc-token-file") && e.contains("--control-plane-api-keys") && e.contains("--allow-insecure")
    );
    let e = parse(&["--host", "10.0.0.3", "--grpc-token-file", token]).unwrap_err();
    assert!(e.contains("the admin API") && !e.contains("the gRPC streams"), "{e}");
    let e = parse(&["--host", "10.0.0.3", "--control-plane-api-keys", "k"]).unwrap_err();
    assert!(e.contains("the gRPC streams") && !e.contains("the admin API"), "{e}");
    let s = parse(&["--host", "10.0.0.3", "--grpc-token-file", token, "--control-plane-api-keys", "k"]).unwrap();
    assert_eq!(s.auth.grpc_token.as_deref(), Some("s3cret-token"), "trimmed");
    assert!(!s.auth.insecure && s.warnings.is_empty(), "{:?}", s.warnings);
    let s = parse(&["--host", "0.0.0.0", "--allow-insecure"]).unwrap();
    assert!(s.auth.insecure);
    assert!(s.warnings.iter().any(|w| w.starts_with("INSECURE")), "{:?}", s.warnings);
    // The admin API on loopback needs no keys while the gRPC port is exposed with a token; the
    // other way round, the admin API needs keys.
    let s = parse(&["--host", "0.0.0.0", "--grpc-token-file", token, "--http-host", "127.0.0.1"]).unwrap();
    assert_eq!((s.http_host.as_str(), s.auth.insecure), ("127.0.0.1", false));
    let e = parse(&["--http-host", "0.0.0.0"]).unwrap_err();
    assert!(e.starts_with("--http-host: 0.0.0.0 is not a loopback address") && e.contains("the admin API"), "{e}");
    assert!(!e.contains("gRPC"), "{e}");
    // Loopback needs nothing.
    for host in ["127.0.0.1", "localhost", "::1", "127.0.0.2"] {
        let s = parse(&["--host", host]).unwrap();
        assert!(s.auth.grpc_token.is_none() && s.auth.api_keys.is_empty() && !s.auth.insecure, "{host}");
    }
}

#[test]
fn api_keys_and_tokens_parse_without_echoing_secrets() {
    let s =
        parse(&["--control-plane-api-keys", "k1:ops:admin:key-one", "k2:dashboard:user:key:two", "bare-key"]).unwrap();
    let keys: Vec<(&str, bool, &str)> =
        s.auth.api_keys.iter().map(|k| (k.id.as_str(), k.admin, k.key.as_str())).collect();
    assert_eq!(keys, [("k1", true, "key-one"), ("k2", false, "key:two"), ("key2", true, "bare-key")]);
    assert!(!format!("{:?}", s.auth).contains("key-one"), "Debug leaves keys out");
    let e = parse(&["--control-plane-api-keys", "a:b:secret"]).unwrap_err();
    assert!(e.contains("--control-plane-api-keys") && !e.contains("secret"), "{e}");
    assert!(parse(&["--control-plane-api-keys", "k1:ops:admin:"]).unwrap_err().contains("empty"));
    let e = parse(&["--grpc-token-file", "/nonexistent/token"]).unwrap_err();
    assert!(e.starts_with("--grpc-token-file: /nonexistent/token"), "{e}");
    let spaced = config_file("spaced.token", "two words\n");
    assert!(parse(&["--grpc-token-file", path_str(&spaced)]).unwrap_err().contains("visible ASCII"));
    let empty = config_file("empty.token", "\n");
    assert!(parse(&["--grpc-token-file", path_str(&empty)]).unwrap_err().contains("empty"));
    assert!(parse(&["--protect-read-endpoints"]).unwrap_err().contains("needs --control-plane-api-keys"));
    // The workers' key goes into a header: nothing that could end the line, and never logged.
    let s = parse(&["--api-key", "sk-w0rker"]).unwrap();
    assert_eq!(s.worker_key(), Some("sk-w0rker"));
    assert!(!format!("{s:?}").contains("sk-w0rker"), "Debug leaves the workers' key out");
    for bad in ["", "two words", "a\r\nx-injected: 1", "caf\u{e9}"] {
        let e = parse(&["--api-key", bad]).unwrap_err();
        assert!(e.contains("--api-key") && e.contains("visible ASCII"), "{bad:?}: {e}");
    }
    let s = parse(&["--protect-read-endpoints", "--control-plane-api-keys", "k"]).unwrap();
    assert!(s.auth.protect_reads);
}

#[test]
fn worker_urls_follow_the_policy_and_limits_parse() {
    let e = parse(&["--worker-urls", "http://169.254.169.254:80"]).unwrap_err();
    assert!(e.starts_with("--worker-urls:") && e.contains("link-local"), "{e}");
    assert!(parse(&["--decode", "http://0.0.0.0:80"]).unwrap_err().starts_with("--decode:"));
    assert!(parse(&["--prefill", "http://[fe80::1]:80", "8998"]).unwrap_err().starts_with("--prefill:"));
    let e = parse(&["--worker-cidrs", "10.0.0.0/8", "--worker-urls", "http://127.0.0.1:1"]).unwrap_err();
    assert!(e.contains("outside --worker-cidrs"), "{e}");
    let s = parse(&["--worker-cidrs", "10.0.0.0/8", "--worker-urls", "http://10.1.2.3:1"]).unwrap();
    assert_eq!(s.worker_policy.cidrs.len(), 1);
    assert!(parse(&["--worker-cidrs", "10.0.0.0/40"]).unwrap_err().starts_with("--worker-cidrs:"));
    let s = parse(&[
        "--max-message-bytes",
        "1000",
        "--max-inserts-per-report",
        "10",
        "--max-inserts-per-sec",
        "20",
        "--max-index-entries",
        "30",
    ])
    .unwrap();
    assert_eq!(
        s.limits,
        crate::settings::Limits {
            max_message_bytes: 1000,
            max_inserts_per_report: 10,
            max_inserts_per_sec: 20,
            max_index_entries: 30
        }
    );
    assert_eq!(parse(&[]).unwrap().limits, crate::settings::Limits::default());
    assert!(parse(&["--max-index-entries", "0"]).unwrap_err().starts_with("--max-index-entries"));
}

/// `--flag ARITY [CHOICES]` lines from `launch_router --help`.
fn peer_flags(help: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in help.lines() {
        let Some(rest) = line.strip_prefix("  ").map(|l| l.strip_prefix("-h, ").unwrap_or(l)) else { continue };
        let Some(rest) = rest.strip_prefix("--") else { continue };
        let name_len = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '-')).unwrap_or(rest.len());
        let (name, rest) = rest.split_at(name_len);
        if name == "help" || name.is_empty() {
            continue;
        }
        let spec = if rest.is_empty() || rest.starts_with("  ") {
            ""
        } else {
            let spec = &rest[1..];
            spec.find("  ").map_or(spec, |i| &spec[..i])
        };
        let (arity, choices) = if spec.is_empty() {
            ("0", String::new())
        } else if spec.starts_with('[') {
            ("*", String::new())
        } else if spec.contains('[') {
            ("+", String::new())
        } else if spec.starts_with('{') {
            // Sorted: some of the peer's choice lists come from Python sets.
            let mut choices: Vec<&str> = spec.trim_matches(|c| c == '{' || c == '}').split(',').collect();
            choices.sort_unstable();
            ("1", choices.join(","))
        } else {
            ("1", String::new())
        };
        let line = [format!("--{name}"), arity.to_string(), choices];
        out.push(line.iter().filter(|s| !s.is_empty()).cloned().collect::<Vec<_>>().join(" "));
    }
    out
}

fn fixture() -> Vec<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/sglang_router_0.3.2_flags.txt");
    let text = std::fs::read_to_string(path).unwrap();
    text.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()).map(String::from).collect()
}

/// Every flag of sglang-router 0.3.2 parses, with the peer's arity; against the live peer
/// when `SGLANG_ROUTER_PYTHON` names a python with `sglang-router` installed.
#[test]
fn every_sglang_router_flag_parses() {
    let flags = fixture();
    assert_eq!(flags.len(), 98);
    let cmd = built();
    for line in &flags {
        let mut parts = line.split(' ');
        let (flag, arity, choices) = (parts.next().unwrap(), parts.next().unwrap(), parts.next());
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_long() == flag.strip_prefix("--"))
            .unwrap_or_else(|| panic!("{flag} is not a kvmesh-cp flag"));
        let with = |values: &[&str]| {
            let mut argv = vec!["kvmesh-cp", flag];
            argv.extend(values);
            cmd.clone().try_get_matches_from(argv)
        };
        let v = match choices {
            // Every choice parses, but sglang-router's policies kvmesh does not have.
            Some(c) => {
                let (ok, refused): (Vec<&str>, Vec<&str>) = c.split(',').partition(|v| with(&[v]).is_ok());
                for v in refused {
                    let e = with(&[v]).unwrap_err().to_string();
                    assert!(e.contains("sglang-router policy kvmesh does not have"), "{flag} {v}: {e}");
                }
                ok.first().unwrap_or_else(|| panic!("{flag}: no choice parses")).to_string()
            }
            None if arity == "0" => String::new(),
            None => sample(&cmd, arg),
        };
        match arity {
            "0" => {
                assert!(with(&[]).is_ok(), "{flag}");
                assert!(with(&["x"]).is_err(), "{flag} takes no value");
            }
            "1" => {
                assert!(with(&[&v]).is_ok(), "{flag} {v}");
                assert!(with(&[]).is_err(), "{flag} needs a value");
            }
            "*" => assert!(with(&[]).is_ok() && with(&[&v, &v]).is_ok(), "{flag}"),
            "+" => assert!(with(&[]).is_err() && with(&[&v, &v]).is_ok(), "{flag}"),
            other => panic!("arity {other}"),
        }
    }
    if let Some(python) = std::env::var_os("SGLANG_ROUTER_PYTHON") {
        let out = std::process::Command::new(&python)
            .args(["-m", "sglang_router.launch_router", "--help"])
            .env("COLUMNS", "80")
            .output()
            .unwrap_or_else(|e| panic!("cannot run {python:?}: {e}"));
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(peer_flags(&String::from_utf8_lossy(&out.stdout)), flags, "the fixture is the live peer's --help");
    }
}

#[test]
fn the_saved_help_gives_the_fixture() {
    // The parser used against the live peer, on the help text the fixture was made from.
    let help = "  -h, --help            show this help message and exit\n  --host HOST           Host\n  --worker-urls [WORKER_URLS ...]\n                        List\n  --policy {random,manual}\n  --dp-aware            Enable\n  --prefill PREFILL [PREFILL ...]\n";
    assert_eq!(
        peer_flags(help),
        ["--host 1", "--worker-urls *", "--policy 1 manual,random", "--dp-aware 0", "--prefill +"]
    );
}

/// A command line written for sglang-router runs kvmesh-cp unchanged.
#[test]
fn a_copied_sglang_router_command_line_loads() {
    let s = parse(&[
        "--host",
        "0.0.0.0",
        "--control-plane-api-keys",
        "k1:ops:admin:an-admin-key",
        "--grpc-token-file",
        path_str(&config_file("copied.token", "a-token\n")),
        "--port",
        "30000",
        "--pd-disaggregation",
        "--prefill",
        "http://127.0.0.1:8000",
        "9000",
        "--prefill",
        "http://127.0.0.1:8001",
        "--decode",
        "http://127.0.0.1:8002",
        "--prefill-policy",
        "cache_aware",
        "--decode-policy",
        "power_of_two",
        "--worker-startup-timeout-secs",
        "600",
        "--request-id-headers",
        "--cors-allowed-origins",
        "http://localhost:3000",
        "--log-level",
        "info",
    ])
    .unwrap();
    assert!(s.pd);
    assert_eq!(s.prefill.len(), 2);
}

/// docs/configuration.md lists every flag with the status its help text gives.
#[test]
fn every_flag_is_documented_with_its_status() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md");
    let docs = std::fs::read_to_string(path).unwrap();
    let cmd = built();
    for arg in cmd.get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        if matches!(long, "help" | "version") {
            continue;
        }
        let row = docs
            .lines()
            .find(|l| l.starts_with(&format!("| `--{long}`")))
            .unwrap_or_else(|| panic!("--{long} has no row in docs/configuration.md"));
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let status = if help.starts_with(NO_EFFECT) {
            "accepted, no effect"
        } else if help.starts_with(NOT_YET) {
            "accepted, not yet enforced"
        } else if help.starts_with(REFUSED) {
            "refused"
        } else {
            "implemented"
        };
        assert!(row.contains(status), "--{long}: the docs row should say `{status}`: {row}");
    }
}

/// docs/migrating-from-sglang-router.md has a row for every flag of sglang-router 0.3.2, with
/// the status kvmesh-cp's help text gives it.
#[test]
fn every_sglang_router_flag_is_in_the_migration_guide() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/migrating-from-sglang-router.md");
    let docs = std::fs::read_to_string(path).unwrap();
    let cmd = built();
    for line in fixture() {
        let flag = line.split_whitespace().next().unwrap();
        let long = flag.trim_start_matches("--");
        let arg = cmd.get_arguments().find(|a| a.get_long() == Some(long)).unwrap();
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        let status = if help.starts_with(NO_EFFECT) {
            "accepted, no effect"
        } else if help.starts_with(NOT_YET) {
            "accepted, not yet enforced"
        } else if help.starts_with(REFUSED) {
            "refused"
        } else {
            "implemented"
        };
        let row = docs
            .lines()
            .find(|l| l.starts_with(&format!("| `{flag}`")))
            .unwrap_or_else(|| panic!("{flag} has no row in docs/migrating-from-sglang-router.md"));
        assert!(row.contains(&format!("| {status}")), "{flag}: the migration guide should say `{status}`: {row}");
    }
}

#[test]
fn kv_capacity_entries() {
    assert_eq!(kv_capacity_entry("http://10.0.0.1:8000/=4096"), Ok(("http://10.0.0.1:8000".into(), 4096)));
    assert!(kv_capacity_entry("http://10.0.0.1:8000").is_err());
    assert!(kv_capacity_entry("http://10.0.0.1:8000=0").is_err());
    assert!(kv_capacity_entry("http://10.0.0.1:8000=lots").is_err());
    let s = parse(&["--worker-kv-capacity", "http://10.0.0.1:8000/=4096"]).unwrap();
    assert_eq!(s.kv_capacity.get("http://10.0.0.1:8000"), Some(&4096));
    assert!(parse(&["--worker-kv-capacity", "x"]).unwrap_err().starts_with("--worker-kv-capacity:"));
}

/// The multi-model Istio overlay's kvmesh-cp configuration loads, with routing by model on and
/// each alias naming the model its Deployment serves.
#[test]
fn the_multi_model_overlays_configuration_loads_with_its_aliases() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../istio/overlays/multi-model");
    let map: serde_norway::Value =
        serde_norway::from_str(&std::fs::read_to_string(format!("{dir}/control-plane-config.yaml")).unwrap()).unwrap();
    // Where it listens and its token are the cluster's (the Secret's file): left out here.
    let text: String = map["data"]["kvmesh-cp.yaml"]
        .as_str()
        .unwrap()
        .lines()
        .filter(|l| !l.starts_with("host:") && !l.starts_with("grpc-token-file:"))
        .map(|l| format!("{l}\n"))
        .collect();
    let path = config_file("multi-model.yaml", &text);
    let s = parse(&["--config", path_str(&path), "--worker-cidrs", "10.0.0.0/8"]).unwrap();
    assert_eq!(s.routing.enable_igw, Some(true));
    let aliases = s.routing.model_alias.clone().unwrap();
    assert_eq!(aliases.len(), 2);
    for alias in aliases {
        let (short, model) = alias.split_once('=').unwrap();
        let deployment = std::fs::read_to_string(format!("{dir}/{short}.yaml")).unwrap();
        assert!(deployment.contains(&format!("- {model}\n")), "{short}.yaml serves no {model}");
    }
}

#[test]
fn inference_pool_implies_discovery_and_replaces_the_selector_and_port() {
    let d = parse(&["--inference-pool", "vllm-llama3-8b-instruct"]).unwrap().discovery.expect("discovery on");
    assert_eq!(d.inference_pool.as_deref(), Some("vllm-llama3-8b-instruct"));
    assert!(d.selector.is_empty());
    let path = config_file("pool.yaml", "inference-pool: pool-a\nservice-discovery-namespace: llm\n");
    let d = parse(&["--config", path_str(&path)]).unwrap().discovery.unwrap();
    assert_eq!((d.inference_pool.as_deref(), d.namespace.as_deref()), (Some("pool-a"), Some("llm")));
    let e = parse(&["--inference-pool", "p", "--selector", "app=x"]).unwrap_err();
    assert!(e.contains("--inference-pool") && e.contains("--selector"), "{e}");
    let e = parse(&["--inference-pool", "p", "--service-discovery-port", "8000"]).unwrap_err();
    assert!(e.contains("--service-discovery-port"), "{e}");
    for bad in ["", "Pool", "a,metadata.name=b", "a-", "a..b"] {
        assert!(parse(&["--inference-pool", bad]).unwrap_err().contains("--inference-pool"), "{bad}");
    }
    // PD: one pool, roles from the role label (or selectors within the pool).
    let d = parse(&["--inference-pool", "p", "--pd-disaggregation", "--prefill-selector", "tier=p"]).unwrap();
    assert!(d.discovery.unwrap().pd);
}

#[test]
fn lora_adapters_name_the_adapter_its_base_and_its_path() {
    let s = parse(&[
        "--worker-urls",
        "http://127.0.0.1:1",
        "--lora-adapter",
        "sql@llama=/a/sql",
        "--lora-adapter",
        "chat@llama=/a/chat",
    ])
    .unwrap();
    let names: Vec<&str> = s.lora_adapters.iter().map(|a| a.name.as_str()).collect();
    assert_eq!(names, ["sql", "chat"]);
    assert!(parse(&["--lora-adapter", "sql=/a"]).unwrap_err().contains("NAME@BASE=PATH"));
}

/// Traces: off unless --enable-trace or OTEL_EXPORTER_OTLP_ENDPOINT; sglang-router's host:port
/// becomes a URL; a bad endpoint is one line naming the flag.
#[test]
fn trace_export_is_off_by_default_and_follows_sglang_routers_flags() {
    let env = || Some("http://collector:4317".to_string());
    assert_eq!(args(&[]).otlp_endpoint(None).unwrap(), None);
    assert_eq!(args(&[]).otlp_endpoint(env()).unwrap().as_deref(), Some("http://collector:4317"));
    assert_eq!(args(&["--otlp-traces-endpoint", "h:1"]).otlp_endpoint(None).unwrap(), None, "needs --enable-trace");
    let on = args(&["--enable-trace"]);
    assert_eq!(on.otlp_endpoint(None).unwrap().as_deref(), Some("http://localhost:4317"));
    assert_eq!(on.otlp_endpoint(env()).unwrap().as_deref(), Some("http://collector:4317"));
    let given = args(&["--enable-trace", "--otlp-traces-endpoint", "10.0.0.9:4317"]);
    assert_eq!(given.otlp_endpoint(env()).unwrap().as_deref(), Some("http://10.0.0.9:4317"), "the flag wins");
    let tls = args(&["--enable-trace", "--otlp-traces-endpoint", "https://otel.example:4317"]);
    assert_eq!(tls.otlp_endpoint(None).unwrap().as_deref(), Some("https://otel.example:4317"));
    let bad = args(&["--enable-trace", "--otlp-traces-endpoint", "grpc://c:4317"]).otlp_endpoint(None).unwrap_err();
    assert!(bad.to_string().starts_with("--otlp-traces-endpoint: "), "{bad}");
    let warned = parse(&["--worker-urls", "http://127.0.0.1:1", "--otlp-traces-endpoint", "h:1"]).unwrap();
    assert!(warned.warnings.iter().any(|w| w.contains("without --enable-trace")), "{:?}", warned.warnings);
}

/// docs/configuration.md's default column says what the flag's definition does: a flag with
/// a default value has exactly that value in its row (values joined by spaces), a switch
/// `off` (or `—`).
#[test]
fn every_documented_default_is_the_flags_own() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/configuration.md");
    let docs = std::fs::read_to_string(path).unwrap();
    let mut wrong = Vec::new();
    for arg in built().get_arguments() {
        let Some(long) = arg.get_long() else { continue };
        let defaults: Vec<String> = arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
        if defaults.is_empty() || matches!(long, "help" | "version") {
            continue;
        }
        let Some(row) = docs.lines().find(|l| l.starts_with(&format!("| `--{long}`"))) else { continue };
        let column = row.split(" | ").nth(1).unwrap_or_default().trim();
        // A switch is off unless given: the docs say so in words.
        let switch = matches!(arg.get_action(), clap::ArgAction::SetTrue) && defaults == ["false"];
        let off = column == "off" || column == "—" || column.starts_with("off (");
        if (switch && !off) || (!switch && column != defaults.join(" ")) {
            wrong.push(format!("--{long}: the docs say `{column}`, the flag `{}`", defaults.join(" ")));
        }
    }
    assert!(wrong.is_empty(), "docs/configuration.md's defaults:\n{}", wrong.join("\n"));
}
