//! traffic
