//! nftables over netlink, from Rust: no `nft` binary, no libnftnl.
//!
//! ```text
//!   model (Table, Chain, Set, Rule)        rule::RuleBuilder: the matches nft's syntax has,
//!        |                                  compiled to the expressions nft would emit
//!        v
//!   batch::replace  -- one nfnetlink batch: BEGIN, add table, delete table,
//!        |             table + sets + chains + (anonymous sets, rule)..., END
//!        v
//!   Socket::apply   -- send, read every ack; an error names the refused message and errno
//!
//!   Socket::read    -- generation, table, chains, sets + elements, rules, generation
//!        |             (again if it changed): the model back, comparable with `==`
//!        v             after Table::canonical
//!   drift detection (the agent's OwnedTable)
//! ```
//!
//! - [`model`]: what a table is; [`data`]: verdicts, sets, elements; [`expr`]: the kernel's
//!   expressions; [`rule`]: matches.
//! - [`Socket`]: create it in the namespace it acts on (a netlink socket belongs to the
//!   namespace it was created in): the agent in the node's, tests on a thread that entered a
//!   test namespace ([`crate::netns::run_in`]).
//!
//! Supported: tables of any family, base chains (filter, nat, route) and regular chains,
//! named and anonymous sets and maps (plain or interval keys, verdict or value data), and the
//! expressions payload, meta, ct, cmp, bitwise, lookup, fib, masq, immediate, counter, limit
//! and log (to a group: [`log`] reads what it sends).
//! Anything else another tool writes reads back as [`Expr::Other`] (so it is seen as drift).
mod batch;
pub mod data;
pub mod expr;
pub mod log;
pub mod model;
mod read;
pub mod rule;
mod show;
mod socket;
#[cfg(test)]
mod tests;
mod wire;

use nix::errno::Errno;

pub use data::{Data, Element, KeyType, MapData, Set, Verdict};
pub use expr::{CmpOp, CtKey, Expr, MetaKey, PayloadBase, Reg, SetRef};
pub use log::{LogListener, Logged};
pub use model::{priority, BaseChain, Chain, ChainType, Family, Hook, Rule, Table};
pub use read::RuleCount;
pub use rule::{Addr, CtDirection, RuleBuilder};
pub use socket::Socket;
pub use wire::{Malformed, NAME_MAX};

/// How often a read starts over because the ruleset changed while it was read.
const READ_TRIES: usize = 5;

/// Talking to the kernel went wrong (which table: [`NftError`] says).
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    #[error("{op} on the netfilter netlink socket failed")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Malformed(#[from] Malformed),
    #[error("the kernel answered {0}")]
    Errno(Errno),
    #[error("the kernel did not answer within {0:?}")]
    Timeout(std::time::Duration),
}

#[derive(Debug, thiserror::Error)]
pub enum NftError {
    /// The model holds something the kernel would refuse (or refuse less clearly).
    #[error("nftables table {table}: {what} {why}")]
    Invalid {
        table: String,
        what: String,
        why: &'static str,
    },
    #[error("cannot open a netfilter netlink socket")]
    Socket {
        #[source]
        source: std::io::Error,
    },
    /// The kernel refused the batch (nothing of it was applied): `message` is what the
    /// first refused message did, `others` how many more were refused after it.
    #[error("nftables table {table}: the kernel refused {message} ({errno}){}",
        if *others > 0 { format!(" and {others} later message(s)") } else { String::new() })]
    Refused {
        table: String,
        message: String,
        errno: Errno,
        others: usize,
    },
    #[error("nftables table {table}: {doing} failed")]
    Netlink {
        table: String,
        doing: &'static str,
        #[source]
        source: NetlinkError,
    },
    #[error("nftables table {table}: the ruleset changed each of the {tries} times it was read")]
    Unsettled { table: String, tries: usize },
}

impl NftError {
    /// The kernel's errno, when it refused.
    pub fn errno(&self) -> Option<Errno> {
        match self {
            NftError::Refused { errno, .. } => Some(*errno),
            NftError::Netlink {
                source: NetlinkError::Errno(e),
                ..
            } => Some(*e),
            _ => None,
        }
    }
}

impl Socket {
    /// Makes the kernel's table `t.family t.name` exactly `t`, in one transaction: created
    /// when missing, else deleted and created again. No packet sees a half-made table.
    pub fn apply(&mut self, t: &Table) -> Result<(), NftError> {
        t.validate()?;
        if let Some(chain) = t.chains.iter().find(|c| {
            c.rules
                .iter()
                .flat_map(|r| &r.exprs)
                .any(|e| matches!(e, Expr::Other { .. }))
        }) {
            return Err(NftError::Invalid {
                table: t.id(),
                what: format!("chain {}", chain.name),
                why: "holds an expression read back undecoded, which cannot be written",
            });
        }
        let first = self.seqs(0);
        let batch = batch::replace(t, first);
        self.seqs(batch.what.len() as u32);
        self.transact(&t.id(), batch)
    }

    /// Deletes table `family name`; nothing to do when there is none.
    pub fn delete(&mut self, family: Family, name: &str) -> Result<(), NftError> {
        let table = format!("{family} {name}");
        if name.is_empty() || name.len() > NAME_MAX {
            return Err(NftError::Invalid {
                table,
                what: "the name".into(),
                why: "is empty or longer than the kernel's 255 bytes",
            });
        }
        let first = self.seqs(0);
        let batch = batch::delete(family, name, first);
        self.seqs(batch.what.len() as u32);
        self.transact(&table, batch)
    }

    /// The namespace's nftables ruleset generation: the kernel moves it at every committed
    /// transaction (any table, any tool) and at nothing else; a read does not move it. While
    /// it stands still, no table changed, so a drift check need not read them.
    pub fn generation(&mut self) -> Result<u32, NftError> {
        read::generation(self).map_err(|source| NftError::Netlink {
            table: "(the ruleset)".into(),
            doing: "reading its generation",
            source,
        })
    }

    /// Table `family name` as the kernel holds it now; `None` when there is none.
    pub fn read(&mut self, family: Family, name: &str) -> Result<Option<Table>, NftError> {
        for _ in 0..READ_TRIES {
            match read::read_once(self, family, name) {
                Ok(read::Read::Done(t)) => return Ok(t),
                Ok(read::Read::Unsettled) => continue,
                Err(source) => {
                    return Err(NftError::Netlink {
                        table: format!("{family} {name}"),
                        doing: "reading it",
                        source,
                    })
                }
            }
        }
        Err(NftError::Unsettled {
            table: format!("{family} {name}"),
            tries: READ_TRIES,
        })
    }

    /// The counts of table `family name`'s rules that have a counter (none when there is no
    /// such table). One dump: a table written meanwhile gives the old rules' counts or the
    /// new ones', each rule whole.
    pub fn counters(&mut self, family: Family, name: &str) -> Result<Vec<RuleCount>, NftError> {
        read::counters(self, family, name).map_err(|source| NftError::Netlink {
            table: format!("{family} {name}"),
            doing: "reading its counters",
            source,
        })
    }

    /// Sends a batch and reads an answer to every message that asked for one. The kernel
    /// answers while it handles the `send`, so once one error is in, the rest are queued.
    fn transact(&mut self, table: &str, batch: batch::Batch) -> Result<(), NftError> {
        let fail = |doing, source| NftError::Netlink {
            table: table.to_string(),
            doing,
            source,
        };
        self.reserve(batch.bytes.len(), batch.acked.len());
        self.send(&batch.bytes)
            .map_err(|source| fail("sending its batch", NetlinkError::Io { op: "send", source }))?;
        let mut pending: std::collections::BTreeSet<u32> = batch.acked.iter().copied().collect();
        let mut refused: Vec<(u32, Errno)> = Vec::new();
        let ours = |seq: u32| batch.what.iter().any(|(s, _)| *s == seq);
        while !pending.is_empty() {
            let got = self
                .recv(refused.is_empty(), &mut |m| {
                    if m.ty != wire::NLMSG_ERROR {
                        return Ok(());
                    }
                    let (code, seq) = m.error()?;
                    if !ours(seq) {
                        return Ok(());
                    }
                    pending.remove(&seq);
                    if code != 0 {
                        refused.push((seq, Errno::from_raw(-code)));
                    }
                    Ok(())
                })
                .map_err(|e| fail("reading the kernel's answers", e))?;
            if !got {
                break;
            }
        }
        refused.sort_by_key(|(seq, _)| *seq);
        let Some((seq, errno)) = refused.first().copied() else {
            return Ok(());
        };
        let message = batch
            .what
            .iter()
            .find(|(s, _)| *s == seq)
            .map_or_else(|| format!("message {seq}"), |(_, w)| w.clone());
        Err(NftError::Refused {
            table: table.to_string(),
            message,
            errno,
            others: refused.len() - 1,
        })
    }
}

/// [`Socket::apply`] on a socket opened in the calling thread's network namespace.
pub fn apply(t: &Table) -> Result<(), NftError> {
    Socket::open()?.apply(t)
}

/// [`Socket::delete`] on a socket opened in the calling thread's network namespace.
pub fn delete(family: Family, name: &str) -> Result<(), NftError> {
    Socket::open()?.delete(family, name)
}

/// [`Socket::generation`] on a socket opened in the calling thread's network namespace.
pub fn generation() -> Result<u32, NftError> {
    Socket::open()?.generation()
}

/// [`Socket::counters`] on a socket opened in the calling thread's network namespace.
pub fn counters(family: Family, name: &str) -> Result<Vec<RuleCount>, NftError> {
    Socket::open()?.counters(family, name)
}

/// [`Socket::read`] on a socket opened in the calling thread's network namespace.
pub fn read(family: Family, name: &str) -> Result<Option<Table>, NftError> {
    Socket::open()?.read(family, name)
}
