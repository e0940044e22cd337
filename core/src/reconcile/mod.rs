//! The reconcile planners, pure: desired state and the kernel's state as read, in; what the
//! kernel should have, out. The agent's reconciler reads the kernel, runs them, and writes the
//! difference.
//!
//! - [`remote`]: routes to pods on other nodes, and the VXLAN devices that carry them.
pub mod remote;
