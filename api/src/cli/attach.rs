//! `corral vm console NAME --attach`: the guest's console, interactive. The
//! output streams as with `--follow`; what you type goes to the guest's
//! serial port (`POST /v1/vms/{name}/console`), the terminal in raw mode so
//! that every key (Ctrl-C included) reaches the guest. Ctrl-] detaches, as
//! in telnet and `virsh console`.

use std::io::{Read, Write};
use std::time::Duration;

use http_body_util::BodyExt;
use hyper::Method;

use super::R;
use crate::client::{Client, ClientError, seg};

/// The detach key: Ctrl-].
const DETACH: u8 = 0x1d;

/// The terminal in raw mode while it lives (restored on drop, also on
/// error); nothing when stdin is not a terminal.
struct RawMode(Option<libc::termios>);

impl RawMode {
    fn enter() -> Self {
        // SAFETY: isatty on fd 0 only reads.
        if unsafe { libc::isatty(0) } != 1 {
            return Self(None);
        }
        // SAFETY: termios is plain data, filled by tcgetattr below.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd 0 is a terminal; `t` is a valid termios to fill.
        if unsafe { libc::tcgetattr(0, &mut t) } != 0 {
            return Self(None);
        }
        let saved = t;
        // SAFETY: cfmakeraw edits the termios we own.
        unsafe { libc::cfmakeraw(&mut t) };
        // SAFETY: fd 0 is a terminal; `t` is a valid termios.
        if unsafe { libc::tcsetattr(0, libc::TCSANOW, &t) } != 0 {
            return Self(None);
        }
        Self(Some(saved))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            // SAFETY: restores the settings read from fd 0 in `enter`.
            unsafe { libc::tcsetattr(0, libc::TCSANOW, t) };
        }
    }
}

/// Sends `data` to the guest, again and again for what its receive FIFO
/// did not take yet (it holds a few bytes; the guest drains it).
async fn type_all(c: &Client, path: &str, mut data: &[u8]) -> Result<(), ClientError> {
    let mut idle = 0;
    while !data.is_empty() {
        // Whole UTF-8 characters only (the API takes text).
        let mut n = data
            .len()
            .min(crate::server::vm_lifecycle::MAX_CONSOLE_INPUT);
        while n > 0 && std::str::from_utf8(&data[..n]).is_err() {
            n -= 1;
        }
        let chunk = if n == 0 {
            // Not UTF-8 at all: send it as replacement characters.
            n = 1;
            String::from_utf8_lossy(&data[..1]).into_owned()
        } else {
            String::from_utf8_lossy(&data[..n]).into_owned()
        };
        let body = serde_json::json!({ "data": chunk });
        let a: crate::server::vm_lifecycle::ConsoleAccepted =
            c.json(Method::POST, path, Some(&body)).await?;
        let took = a.accepted.min(n);
        data = &data[took..];
        if took == 0 {
            idle += 1;
            if idle > 500 {
                return Err(ClientError::Http(
                    "the guest does not read its console input".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        } else {
            idle = 0;
        }
    }
    Ok(())
}

/// Runs the interactive console until the VM stops or Ctrl-] is typed.
pub async fn attach(c: &Client, name: &str) -> R {
    let out_path = format!("/v1/vms/{}/console?follow=true&tail=20", seg(name));
    let in_path = format!("/v1/vms/{}/console", seg(name));
    let mut body = c.stream(&out_path).await?;
    eprintln!("attached to {name}'s console; Ctrl-] detaches\r");
    let raw = RawMode::enter();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(64);
    // stdin is read on a thread of its own (a blocking read).
    std::thread::spawn(move || {
        let mut buf = [0u8; 1024];
        let mut stdin = std::io::stdin().lock();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            }
        }
    });
    let mut out = std::io::stdout();
    let mut stdin_open = true;
    let result: R = loop {
        tokio::select! {
            frame = body.frame() => match frame {
                None => break Ok(()),
                Some(Err(e)) => break Err(super::CliError(format!("console stream: {e}"))),
                Some(Ok(f)) => {
                    if let Some(d) = f.data_ref() {
                        let _ = out.write_all(d);
                        let _ = out.flush();
                    }
                }
            },
            input = rx.recv(), if stdin_open => match input {
                None => stdin_open = false,
                Some(bytes) => {
                    let (keys, detach) = match bytes.iter().position(|b| *b == DETACH) {
                        Some(i) => (&bytes[..i], true),
                        None => (&bytes[..], false),
                    };
                    if let Err(e) = type_all(c, &in_path, keys).await {
                        break Err(e.into());
                    }
                    if detach {
                        break Ok(());
                    }
                }
            },
        }
    };
    drop(raw);
    eprintln!("\ndetached from {name}'s console");
    result
}
