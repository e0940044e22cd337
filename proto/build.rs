fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "calix/v1/ipam.proto",
        "calix/v1/endpoints.proto",
        "calix/v1/routes.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure().compile_protos(&protos, &["."])?;
    Ok(())
}
