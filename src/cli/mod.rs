//! Client verbs of the `eddy` command line.

pub mod dlq;
pub mod publish;
pub mod resources;
