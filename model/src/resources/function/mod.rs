//! Function: its runtimes, source, access, env, resources, status, and its validation.

use super::*;

mod quantity;
mod runtime;
mod spec;
mod status;
mod validate;

pub use self::{quantity::*, runtime::*, spec::*, status::*, validate::*};
