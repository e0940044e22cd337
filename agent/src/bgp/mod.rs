//! BGP with the data centre's routers (issue 23, started): the sockets around calix-bgp's
//! pure speaker. `md5.rs` sets a connection's TCP MD5 password (RFC 2385); `conn.rs` reads
//! and writes whole messages on one connection and drives a `Session` with its timers.
//! The peers' configuration, the routes advertised from IPAM and the learned routes' kernel
//! side come next.
pub mod conn;
pub mod md5;
