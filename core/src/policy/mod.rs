//! NetworkPolicy, calculated: which policies select an endpoint, what each direction allows,
//! as rules over address sets, and the sets' members; kept up to date one change at a time.
//! Pure: the Kubernetes adapter feeds it plain values ([`model`]), the dataplanes program what
//! it answers.
//!
//! - [`model`]: policies, pods, namespaces, and the checks of a rule;
//! - [`sets`]: the address sets rules name (a pod selector in its namespaces, an ipBlock, a
//!   named port) and who is in them;
//! - [`endpoint`]: one endpoint's policy (Kubernetes' isolation and union of rules);
//! - [`cluster`]: the state, and what each change touches;
//! - [`report`]: one endpoint's policy as `calixctl policy` shows it;
//! - [`tables`]: this node's endpoints' policies as the eBPF dataplane looks them up
//!   (identities and entries), and the order to change them in;
//! - [`ranges`]: the identities as address ranges (kernel mode's nftables sets);
//! - [`trace`]: what `calixctl trace` answers, step by step.
pub mod cluster;
pub mod compiler;
pub mod endpoint;
pub mod model;
pub mod ranges;
pub mod report;
pub mod sets;
pub mod tables;
#[cfg(test)]
mod tables_tests;
#[cfg(test)]
mod tests;
pub mod trace;
