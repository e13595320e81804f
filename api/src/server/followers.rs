//! Console followers: at most [`MAX_FOLLOWERS`] streams at once, and at most
//! [`MAX_FOLLOWERS_PER_CLIENT`] of them for one client, so one client that
//! opens streams and never reads them does not lock the others out. (A
//! stream whose client stops reading is also dropped by the connection's
//! write timeout, see `http.rs`.)

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::http::StatusCode;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::error::ApiError;

/// Most concurrent console followers.
pub const MAX_FOLLOWERS: usize = 64;
/// Most concurrent console followers of one client (a Unix socket peer
/// uid, or a TCP peer address).
pub const MAX_FOLLOWERS_PER_CLIENT: usize = 16;

/// The follower counts.
pub struct Followers {
    all: Arc<Semaphore>,
    per_client: Arc<Mutex<HashMap<String, usize>>>,
}

impl Default for Followers {
    fn default() -> Self {
        Self {
            all: Arc::new(Semaphore::new(MAX_FOLLOWERS)),
            per_client: Arc::default(),
        }
    }
}

/// One follower's place; given back when dropped.
pub struct FollowerPermit {
    _all: OwnedSemaphorePermit,
    client: String,
    per_client: Arc<Mutex<HashMap<String, usize>>>,
}

impl Drop for FollowerPermit {
    fn drop(&mut self) {
        let mut m = self.per_client.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.client) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.client);
            }
        }
    }
}

fn too_many(msg: String) -> ApiError {
    ApiError::new(StatusCode::TOO_MANY_REQUESTS, "too_many_requests", msg)
}

impl Followers {
    /// A place for a new follower of `client`, or 429.
    pub fn acquire(&self, client: &str) -> Result<FollowerPermit, ApiError> {
        let mut m = self.per_client.lock().unwrap_or_else(|e| e.into_inner());
        if m.get(client).copied().unwrap_or(0) >= MAX_FOLLOWERS_PER_CLIENT {
            return Err(too_many(format!(
                "at most {MAX_FOLLOWERS_PER_CLIENT} console streams per client ({client})"
            )));
        }
        let all =
            self.all.clone().try_acquire_owned().map_err(|_| {
                too_many(format!("at most {MAX_FOLLOWERS} console streams at once"))
            })?;
        *m.entry(client.to_string()).or_insert(0) += 1;
        Ok(FollowerPermit {
            _all: all,
            client: client.to_string(),
            per_client: self.per_client.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_client_cannot_take_every_place() {
        let f = Followers::default();
        let mut mine: Vec<_> = (0..MAX_FOLLOWERS_PER_CLIENT)
            .map(|_| f.acquire("uid 1").unwrap())
            .collect();
        assert_eq!(
            f.acquire("uid 1").err().unwrap().status,
            StatusCode::TOO_MANY_REQUESTS
        );
        let other = f.acquire("uid 2").unwrap();
        mine.pop();
        let again = f.acquire("uid 1").unwrap();
        drop((mine, other, again));
        assert!(f.per_client.lock().unwrap().is_empty());
        let many: Vec<_> = (0..MAX_FOLLOWERS)
            .map(|i| {
                f.acquire(&format!("uid {}", i / MAX_FOLLOWERS_PER_CLIENT))
                    .unwrap()
            })
            .collect();
        assert!(f.acquire("uid 99").is_err());
        drop(many);
    }
}
