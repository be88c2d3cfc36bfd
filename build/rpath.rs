//! Build script shared by every package whose binaries link libtorch.
//!
//! torch-sys reports the folder holding `libtorch_cpu.so` as build metadata
//! (`cargo:libtorch_lib=...`, seen by direct dependents as `DEP_TCH_LIBTORCH_LIB`).
//! Embedding it as an rpath lets tests, examples and demos find libtorch without
//! `LD_LIBRARY_PATH`. Packages whose tests alone use libtorch find it through
//! `LIBTORCH` (set by scripts/env.sh).

/// Embeds libtorch's folder as an rpath of the package's binaries.
pub fn main() {
    if let Some(lib_dir) = libtorch_lib_dir() {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib_dir}");
    }
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    println!("cargo:rerun-if-env-changed=LIBTORCH");
}

/// The folder holding `libtorch_cpu.so`: torch-sys's metadata, or for packages that use
/// libtorch only in tests (a dev-dependency, whose metadata build scripts do not see)
/// `LIBTORCH`'s `lib`, which scripts/env.sh sets.
pub fn libtorch_lib_dir() -> Option<String> {
    ["DEP_TCH_LIBTORCH_LIB", "DEP_TORCH_SYS_LIBTORCH_LIB"]
        .iter()
        .find_map(|name| std::env::var(name).ok())
        .or_else(|| {
            std::env::var("LIBTORCH")
                .ok()
                .map(|torch| format!("{torch}/lib"))
        })
}
