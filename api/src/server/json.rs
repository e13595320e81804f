//! Extractors with the API's error shape: a strict JSON body (duplicate keys
//! at any depth are refused), path and query parameters.

use axum::body::Bytes;
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::{self, DeserializeOwned, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use super::MAX_BODY_BYTES;
use super::error::{ApiError, clip};

/// A JSON body parsed with our error shape (unknown fields, wrong types,
/// duplicate keys and trailing data are 400). The content type is checked
/// before, by the request guard.
pub struct ApiJson<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            let status = e.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(
                    status,
                    "payload_too_large",
                    format!("request body larger than {MAX_BODY_BYTES} bytes"),
                )
            } else {
                ApiError::bad_request(format!("cannot read the request body: {}", e.body_text()))
            }
        })?;
        parse(&bytes).map(ApiJson)
    }
}

/// Parses a request body: a JSON object without duplicate keys, then `T`.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "a JSON object is required as the request body",
        ));
    }
    let v = serde_json::from_slice::<Unique>(bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))?
        .0;
    if !v.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    serde_json::from_value(v)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
}

/// A JSON value that refuses an object with the same key twice, at any
/// depth (serde_json's own `Value` keeps the last one silently).
struct Unique(Value);

impl<'de> de::Deserialize<'de> for Unique {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(UniqueVisitor).map(Unique)
    }
}

struct UniqueVisitor;

impl<'de> Visitor<'de> for UniqueVisitor {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        Number::from_f64(v)
            .map(Value::Number)
            .ok_or_else(|| E::custom("a number that is not finite"))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut v = Vec::new();
        while let Some(Unique(x)) = seq.next_element()? {
            v.push(x);
        }
        Ok(Value::Array(v))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut m = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            if m.contains_key(&k) {
                return Err(de::Error::custom(format!("duplicate key {:?}", clip(&k))));
            }
            let Unique(v) = map.next_value()?;
            m.insert(k, v);
        }
        Ok(Value::Object(m))
    }
}

/// Path parameters with our error shape.
pub struct ApiPath<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|p| ApiPath(p.0))
            .map_err(|e| ApiError::bad_request(format!("bad path: {}", e.body_text())))
    }
}

/// Query parameters with our error shape.
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| ApiQuery(q.0))
            .map_err(|e| ApiError::bad_request(format!("bad query: {}", e.body_text())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct T {
        a: Option<u32>,
        b: Option<Value>,
    }

    #[test]
    fn duplicate_keys_are_refused_at_any_depth() {
        for body in [
            r#"{"a":1,"a":2}"#,
            r#"{"b":{"x":1,"x":1}}"#,
            r#"{"b":[{"y":[{"z":1,"z":2}]}]}"#,
        ] {
            let e = parse::<T>(body.as_bytes()).expect_err(body);
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
            assert!(e.message.contains("duplicate key"), "{}", e.message);
        }
        let ok = parse::<T>(br#"{"a":1,"b":{"a":1,"x":[1.5,null,true,"s"]}}"#).unwrap();
        assert_eq!(ok.a, Some(1));
        assert!(parse::<T>(b"[1]").is_err());
        assert!(parse::<T>(br#"{"a":1} x"#).is_err());
    }
}
