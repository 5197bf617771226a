//! The `--config` YAML file, translated into command-line arguments for the same clap
//! command: a key `worker-urls`/`worker_urls` becomes `--worker-urls a b`, `true` the bare
//! flag, `prefill: [[url, port], [url]]` repeated `--prefill`, leaving out the keys whose flag
//! is on the real command line (flags win).

use std::ffi::OsString;

use clap::parser::ValueSource;
use clap::{ArgAction, ArgMatches, Command};

/// A YAML scalar as a command-line value.
fn scalar(key: &str, v: &serde_norway::Value) -> Result<String, String> {
    match v {
        serde_norway::Value::String(s) => Ok(s.clone()),
        serde_norway::Value::Number(n) => Ok(n.to_string()),
        serde_norway::Value::Bool(b) => Ok(b.to_string()),
        _ => Err(format!("`{key}` takes a single value here, not a list or a mapping")),
    }
}

fn items(v: &serde_norway::Value) -> Vec<serde_norway::Value> {
    match v {
        serde_norway::Value::Sequence(s) => s.clone(),
        other => vec![other.clone()],
    }
}

/// The `--config` file as command-line arguments for `cmd`, leaving out what `cli` (the real
/// command line) gives. Returns the arguments and the ids they set.
pub(super) fn file_args(cmd: &Command, cli: &ArgMatches, text: &str) -> Result<(Vec<OsString>, Vec<String>), String> {
    let doc: serde_norway::Value = serde_norway::from_str(text).map_err(|e| e.to_string().replace('\n', " "))?;
    let map = match doc {
        serde_norway::Value::Mapping(m) => m,
        serde_norway::Value::Null => serde_norway::Mapping::new(),
        _ => return Err("the configuration must be a mapping of flag names to values".into()),
    };
    let mut out: Vec<OsString> = Vec::new();
    let mut ids = Vec::new();
    for (k, v) in &map {
        let key = k.as_str().ok_or("keys must be strings")?;
        let flag = key.replace('_', "-");
        let arg = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(flag.as_str()) && !matches!(flag.as_str(), "config" | "help" | "version"))
            .ok_or_else(|| format!("unknown key `{key}`"))?;
        let id = arg.get_id().as_str();
        if cli.value_source(id) == Some(ValueSource::CommandLine) || v.is_null() {
            continue;
        }
        ids.push(id.to_string());
        let long = format!("--{flag}");
        let range = arg.get_num_args().unwrap_or_default();
        if range.max_values() == 0 {
            match v {
                serde_norway::Value::Bool(true) => out.push(long.into()),
                serde_norway::Value::Bool(false) => {}
                _ => return Err(format!("`{key}` takes true or false")),
            }
        } else if id == "prefill" {
            for item in items(v) {
                out.push(long.clone().into());
                for part in items(&item) {
                    out.push(scalar(key, &part)?.into());
                }
            }
        } else if range.max_values() > 1 {
            out.push(long.into());
            for item in items(v) {
                out.push(scalar(key, &item)?.into());
            }
        } else if matches!(arg.get_action(), ArgAction::Append) {
            for item in items(v) {
                out.push(format!("{long}={}", scalar(key, &item)?).into());
            }
        } else {
            out.push(format!("{long}={}", scalar(key, v)?).into());
        }
    }
    Ok((out, ids))
}
