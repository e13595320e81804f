//! The `corral serve` options of the API's access control and limits
//! (flattened into `ServeArgs`).

use std::path::PathBuf;
use std::time::Duration;

use super::http::HttpLimits;

/// Where the daemon keeps its state (and its lock) by default.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/corral";

fn secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim_end_matches('s')
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(v > 0.0 && v <= 86_400.0) {
        return Err(format!("{s}: expected 0 < seconds <= 86400"));
    }
    Ok(Duration::from_secs_f64(v))
}

/// Access and limits of the API.
#[derive(clap::Args, Debug, Clone)]
pub struct ApiArgs {
    /// Where the TCP listener's bearer token is written (mode 0600; a new
    /// token at every start). Default: `token` beside the socket.
    #[arg(long, value_name = "PATH")]
    pub token_file: Option<PathBuf>,
    /// Another Host header name the TCP listener accepts (besides its
    /// address, localhost, 127.0.0.1 and [::1]); repeatable.
    #[arg(long, value_name = "NAME")]
    pub allow_host: Vec<String>,
    /// Members of this group (name or gid) may use the Unix socket too: it
    /// is then mode 0660 and owned by the group.
    #[arg(long, value_name = "GROUP")]
    pub socket_group: Option<String>,
    /// State directory (created 0700); one daemon per directory, held by a
    /// lock on `corral.lock` in it.
    #[arg(long, value_name = "DIR", default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// Seconds a client may take to send a request head.
    #[arg(long, value_name = "SECS", default_value = "10", value_parser = secs)]
    pub header_timeout: Duration,
    /// Seconds a client may take to send a request body.
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = secs)]
    pub body_timeout: Duration,
    /// Seconds a keep-alive connection may stay idle.
    #[arg(long, value_name = "SECS", default_value = "60", value_parser = secs)]
    pub idle_timeout: Duration,
    /// Seconds a response may wait for a client that does not read it
    /// (console followers included) before the connection is dropped.
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = secs)]
    pub write_timeout: Duration,
    /// Most open connections per listener (Unix socket and TCP each).
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_connections: usize,
    /// Seconds SIGTERM waits for the VMs to stop and requests to finish
    /// before the daemon exits anyway.
    #[arg(long, value_name = "SECS", default_value = "10", value_parser = secs)]
    pub shutdown_timeout: Duration,
}

impl ApiArgs {
    /// The connection limits.
    pub fn limits(&self) -> HttpLimits {
        HttpLimits {
            header_timeout: self.header_timeout,
            body_timeout: self.body_timeout,
            idle_timeout: self.idle_timeout,
            write_timeout: self.write_timeout,
            max_connections: self.max_connections.max(1),
        }
    }
}
