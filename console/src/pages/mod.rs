//! The dashboard's pages, one module each: what the page asks the server for.

pub(crate) mod dead_letters;
pub(crate) mod events;
pub(crate) mod invoke;
pub(crate) mod overview;
pub(crate) mod publish;
