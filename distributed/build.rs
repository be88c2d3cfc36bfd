//! Builds the C++ shim over c10d (`shim/`) against the libtorch that torch-sys links,
//! as torch-sys builds its own (`cc`, C++17, the new C++ ABI), and embeds libtorch's
//! folder as an rpath (`build/rpath.rs`).

#[path = "../build/rpath.rs"]
mod rpath;

use std::path::PathBuf;

/// Gloo's headers, which `ProcessGroupGloo.hpp` includes and the torch wheel lacks.
const GLOO_HEADER: &str = "/usr/include/gloo/context.h";

fn main() {
    rpath::main();
    let lib_dir = ["DEP_TCH_LIBTORCH_LIB", "DEP_TORCH_SYS_LIBTORCH_LIB"]
        .iter()
        .find_map(|name| std::env::var(name).ok())
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var("LIBTORCH")
                .ok()
                .map(|torch| PathBuf::from(torch).join("lib"))
        })
        .unwrap_or_else(|| {
            panic!("nestor-distributed: libtorch's folder is unknown (run scripts/setup.sh, which sets LIBTORCH)")
        });
    let torch = lib_dir
        .parent()
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("nestor-distributed: {} has no parent", lib_dir.display()));
    if !std::path::Path::new(GLOO_HEADER).exists() {
        panic!(
            "nestor-distributed: {GLOO_HEADER} is missing: install Debian's libgloo-dev \
             (scripts/setup.sh does)"
        );
    }
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .define("USE_C10D_GLOO", None)
        .include(torch.join("include"))
        .include(torch.join("include/torch/csrc/api/include"))
        .flag("-Wno-unused-parameter")
        .warnings(false)
        .files(["shim/c10d.cpp", "shim/gloo.cpp"])
        .compile("nestor_c10d");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    for file in [
        "shim/c10d.cpp",
        "shim/gloo.cpp",
        "shim/shim.hpp",
        GLOO_HEADER,
    ] {
        println!("cargo:rerun-if-changed={file}");
    }
}
