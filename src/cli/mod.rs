//! Client verbs of the `eddy` command line.

pub mod publish;
