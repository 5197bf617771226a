//! The workers given on the command line (regular, prefill with their bootstrap ports,
//! decode), and whether prefill and decode are disaggregated.

use clap::ArgAction;

use super::{Args, BadArgs};

/// The workers named by flag.
#[derive(Clone, Debug, Default, PartialEq, clap::Args)]
pub struct WorkerFlags {
    /// Regular workers (URLs).
    #[arg(long, num_args = 0..)]
    pub worker_urls: Vec<String>,
    /// A prefill worker and its bootstrap port (or `none`); repeatable.
    #[arg(long = "prefill", id = "prefill", num_args = 1.., action = ArgAction::Append, value_names = ["URL", "BOOTSTRAP_PORT"])]
    pub prefill_flat: Vec<String>,
    /// `--prefill` occurrences, grouped (filled by [`Args::parse_from`]).
    #[arg(skip)]
    pub prefill: Vec<Vec<String>>,
    /// A decode worker (URL); repeatable.
    #[arg(long, action = ArgAction::Append)]
    pub decode: Vec<String>,
}

impl Args {
    /// Whether prefill and decode are disaggregated (then no regular workers); the regular
    /// and decode workers' URLs are checked to be ones.
    pub(super) fn pd(&self) -> Result<bool, BadArgs> {
        let pd = self.routing.pd_disaggregation.unwrap_or(false)
            || !self.workers.prefill.is_empty()
            || !self.workers.decode.is_empty();
        if pd && !self.workers.worker_urls.is_empty() {
            return Err(self.bad("worker_urls", "not with --pd-disaggregation (use --prefill and --decode)"));
        }
        for url in &self.workers.worker_urls {
            crate::urls::canonical(url).map_err(|e| self.bad("worker_urls", e))?;
        }
        for url in &self.workers.decode {
            crate::urls::canonical(url).map_err(|e| self.bad("decode", e))?;
        }
        Ok(pd)
    }

    /// The prefill workers (`--prefill URL [BOOTSTRAP_PORT|none]`) with their bootstrap ports.
    pub(super) fn prefill(&self) -> Result<Vec<(String, Option<u16>)>, BadArgs> {
        let mut prefill = Vec::new();
        for entry in &self.workers.prefill {
            let (url, port) =
                match entry.as_slice() {
                    [url] => (url.clone(), None),
                    [url, p] if p.eq_ignore_ascii_case("none") => (url.clone(), None),
                    [url, p] => (
                        url.clone(),
                        Some(p.parse::<u16>().map_err(|_| {
                            self.bad("prefill", format!("bootstrap port `{p}` is not a port or `none`"))
                        })?),
                    ),
                    _ => return Err(self.bad("prefill", "takes URL [BOOTSTRAP_PORT|none]")),
                };
            crate::urls::canonical(&url).map_err(|e| self.bad("prefill", e))?;
            prefill.push((url, port));
        }
        Ok(prefill)
    }
}

/// The workers given on the command line, under their canonical URLs.
#[derive(Default)]
pub(super) struct Workers {
    pub(super) regular: Vec<String>,
    pub(super) prefill: Vec<(String, Option<u16>)>,
    pub(super) decode: Vec<String>,
}
