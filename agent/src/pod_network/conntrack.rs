//! SNAT's conntrack table for the API (`calixctl bpf conntrack` / `bpf nat`).
use std::path::PathBuf;

use calix_common::NatConfig;

use super::Node;
use crate::error::AgentError;
use calix_dataplane::nat::{Conntrack, FlowFilter, FlowView};

impl Node {
    /// Makes the conntrack table (pinned in `pin_dir`) available to the API.
    pub fn set_conntrack(&self, pin_dir: PathBuf, cfg: NatConfig) {
        let _ = self.conntrack.set((pin_dir, cfg));
    }

    /// The flows matching `filter`, or (`flush`) removes them: (flows listed, flows removed).
    pub fn conntrack(
        &self,
        filter: &FlowFilter,
        flush: bool,
    ) -> Result<(Vec<FlowView>, usize), AgentError> {
        let Some((dir, cfg)) = self.conntrack.get() else {
            return Err(AgentError::Invalid(
                "no SNAT conntrack table on this node (dataplane = \"kernel\")".into(),
            ));
        };
        let mut ct = Conntrack::open(dir).map_err(|source| AgentError::Dataplane {
            host_ifname: String::new(),
            source,
        })?;
        if flush {
            Ok((Vec::new(), ct.flush(cfg, filter)))
        } else {
            Ok((ct.flows(cfg, filter), 0))
        }
    }
}
