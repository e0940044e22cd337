//! Compiles the protos with protox (a protobuf compiler written in Rust) and feeds the
//! descriptors to tonic-prost-build, so building calix needs cargo alone: no system `protoc`
//! (issue 11: nothing may need a system tool before `cargo xtask setup` has run).
//!
//! - `calix/v1/*`: calix's own API, clients and servers.
//! - `etcd/*`: the subset of etcd's v3 API the agent's etcd datastore uses, clients only.
//!
//! Without the `grpc` feature: `calix/v1/*`'s messages only, with prost-build (no tonic).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let calix = [
        "calix/v1/ipam.proto",
        "calix/v1/endpoints.proto",
        "calix/v1/routes.proto",
        "calix/v1/policy.proto",
        "calix/v1/bgp.proto",
        "calix/v1/services.proto",
    ];
    println!("cargo:rerun-if-changed=calix");
    println!("cargo:rerun-if-changed=etcd");
    #[cfg(feature = "grpc")]
    {
        let etcd = ["etcd/etcdserverpb/rpc.proto"];
        tonic_prost_build::configure().compile_fds(protox::compile(calix, ["."])?)?;
        tonic_prost_build::configure()
            .build_server(false)
            .compile_fds(protox::compile(etcd, ["."])?)?;
    }
    #[cfg(not(feature = "grpc"))]
    prost_build::Config::new().compile_fds(protox::compile(calix, ["."])?)?;
    Ok(())
}
