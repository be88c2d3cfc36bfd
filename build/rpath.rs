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

/// libtorch's `lib` folder and its root (which holds `include/`), for build scripts that
/// compile against libtorch's headers (included as a module); panics naming `package`
/// when they are unknown, since such a build cannot go on.
#[allow(dead_code)] // Packages whose build script is this file compile nothing.
pub fn libtorch_folders(package: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let lib_dir = libtorch_lib_dir().map(std::path::PathBuf::from).unwrap_or_else(|| {
        panic!("{package}: libtorch's folder is unknown (run scripts/setup.sh, which sets LIBTORCH)")
    });
    let root = lib_dir
        .parent()
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| panic!("{package}: {} has no parent", lib_dir.display()));
    (lib_dir, root)
}
