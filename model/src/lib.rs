//! eddy's model: what a Function and a Subscription are and when they are valid, how events are
//! named in JetStream, and how what publishers send becomes a stored event.
//!
//! Everything here is pure (no async runtime, NATS client or web framework), so the rules are
//! tested directly, the fuzz targets build in seconds, and the CRDs are generated from the same
//! types the services use.

pub mod admin;
pub mod apirule;
pub mod backoff;
pub mod conditions;
pub mod event;
pub mod ext_authz;
pub mod headers;
pub mod istio;
pub mod kyma;
pub mod legacy;
pub mod ratelimit;
pub mod resources;
pub mod subject;
