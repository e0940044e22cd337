//! Compiles the calix.v1 protos with protox (a pure-Rust protobuf compiler) and feeds the
//! descriptors to tonic-prost-build, so building calix needs cargo alone: no system `protoc`
//! (issue 11: `cargo xtask setup` must be able to run before anything is installed).
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "calix/v1/ipam.proto",
        "calix/v1/endpoints.proto",
        "calix/v1/routes.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["."])?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
