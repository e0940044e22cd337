//! `calix-probe`: the chart's `helm test` (templates/tests/). A DaemonSet of echo servers
//! ([`echo::serve`]) runs one pod on every node; a client pod reads the DaemonSet and its pods
//! from the Kubernetes API ([`api`]), waits until every server is ready, and reaches each one
//! over TCP with a fresh token ([`echo::exchange`]), checking that every address is in a calix
//! pool. Pod-to-pod, same node and across nodes, with nothing in between.
pub mod api;
pub mod check;
pub mod echo;
