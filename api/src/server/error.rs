//! The API's error type and the rule that an error message quotes at most
//! [`MAX_QUOTE`] bytes of anything the client sent.

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use corral_vmm::manager::{ErrorKind, ManagerError};

use crate::dto;

/// Most bytes of client input that an error message repeats.
pub const MAX_QUOTE: usize = 64;
/// Longest error message (the rest is cut).
const MAX_MESSAGE: usize = 1024;

/// An API error: status plus `{"error":{"code","message"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) code: &'static str,
    pub(super) message: String,
}

impl ApiError {
    /// A new error.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    pub(super) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub(super) fn forbidden(message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", message)
    }
}

impl From<ManagerError> for ApiError {
    fn from(e: ManagerError) -> Self {
        let (status, code) = match e.kind() {
            ErrorKind::Invalid => (StatusCode::BAD_REQUEST, "bad_request"),
            ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
            ErrorKind::Conflict => (StatusCode::CONFLICT, "conflict"),
            ErrorKind::Refused => (StatusCode::UNPROCESSABLE_ENTITY, "refused"),
            ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            ErrorKind::Storage => (StatusCode::INSUFFICIENT_STORAGE, "state_not_saved"),
            ErrorKind::Unavailable => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("{}", clip_words(&e.to_string()));
        }
        // The message may repeat client input at any length: the request
        // guard clips it (`scrub`) on its way out.
        Self::new(status, e.code().unwrap_or(code), e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = dto::ErrorBody {
            error: dto::ErrorDetail {
                code: self.code.to_string(),
                // Clipped by the request guard, which knows the input.
                message: self.message,
            },
        };
        (self.status, Json(body)).into_response()
    }
}

/// `s` cut to at most [`MAX_QUOTE`] bytes (on a character boundary), with
/// "…" when something was cut.
pub fn clip(s: &str) -> String {
    if s.len() <= MAX_QUOTE {
        return s.to_string();
    }
    let mut end = MAX_QUOTE;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Every whitespace-free run longer than [`MAX_QUOTE`] bytes clipped, and
/// the whole message cut to [`MAX_MESSAGE`] bytes: a catch-all for input
/// that reached a message in a form [`scrub`] did not recognise.
pub fn clip_words(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len().min(MAX_MESSAGE + 4));
    let mut word = String::new();
    for c in msg.chars() {
        if c.is_whitespace() {
            out.push_str(&clip(&word));
            word.clear();
            out.push(c);
        } else {
            word.push(c);
        }
    }
    out.push_str(&clip(&word));
    if out.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE;
        while !out.is_char_boundary(end) {
            end -= 1;
        }
        out.truncate(end);
        out.push('…');
    }
    out
}

/// `msg` with every long piece of client input in it (`inputs`: the
/// request's decoded path segments, query values, JSON keys and strings)
/// clipped, in the forms a message shows them: as sent, `{:?}`-escaped and
/// JSON-escaped.
pub fn scrub(msg: &str, inputs: &[String]) -> String {
    let mut out = msg.to_string();
    let mut long: Vec<&String> = inputs.iter().filter(|s| s.len() > MAX_QUOTE).collect();
    // Longest first, so that a piece of input contained in another is not
    // replaced inside it first.
    long.sort_by_key(|s| std::cmp::Reverse(s.len()));
    for s in long {
        let debug = format!("{s:?}");
        let json = serde_json::to_string(s).unwrap_or_default();
        for form in [s.as_str(), trim_quotes(&debug), trim_quotes(&json)] {
            if form.len() > MAX_QUOTE && out.contains(form) {
                out = out.replace(form, &clip(form));
            }
        }
    }
    clip_words(&out)
}

fn trim_quotes(s: &str) -> &str {
    s.strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_input_is_clipped_in_every_form() {
        let name = format!("a b\"{}", "x".repeat(500));
        let msg = format!("invalid VM name {name:?}: too long; path {name}: no");
        let s = scrub(&msg, std::slice::from_ref(&name));
        assert!(!s.contains(&"x".repeat(MAX_QUOTE + 1)), "{s}");
        assert!(s.len() < 300, "{s}");
        assert!(s.starts_with("invalid VM name \"a b\\\""), "{s}");
    }

    #[test]
    fn short_messages_are_kept() {
        let m = "no VM named \"web\"";
        assert_eq!(scrub(m, &["web".into()]), m);
        assert_eq!(clip_words(m), m);
        assert_eq!(clip(&"€".repeat(30)).len(), 63 + "…".len());
    }
}
