//! The stream decoder and encoder of `calix.v1.Routes`, which live in calix-core (pure, and
//! fuzzed there: fuzz/fuzz_targets/route_stream.rs); re-exported where the agent uses them.
pub use calix_core::wire::*;
