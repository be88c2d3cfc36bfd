//! Build script shared by every package whose binaries link libtorch.
//!
//! torch-sys reports the folder holding `libtorch_cpu.so` as build metadata
//! (`cargo:libtorch_lib=...`, seen by direct dependents as `DEP_TCH_LIBTORCH_LIB`).
//! Embedding it as an rpath lets tests, examples and demos find libtorch without
//! `LD_LIBRARY_PATH`.

fn main() {
    let lib_dir = ["DEP_TCH_LIBTORCH_LIB", "DEP_TORCH_SYS_LIBTORCH_LIB"]
        .iter()
        .find_map(|name| std::env::var(name).ok());
    if let Some(lib_dir) = lib_dir {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
}
