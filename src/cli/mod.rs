//! Client verbs of the `eddy` command line.

pub mod dlq;
pub mod functions;
pub mod publish;
pub mod resources;
