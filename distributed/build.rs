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
    let (lib_dir, torch) = rpath::libtorch_folders("nestor-distributed");
    if !std::path::Path::new(GLOO_HEADER).exists() {
        panic!(
            "nestor-distributed: {GLOO_HEADER} is missing: install Debian's libgloo-dev \
             (scripts/setup.sh does)"
        );
    }
    let nccl = std::env::var_os("CARGO_FEATURE_NCCL").is_some();
    let build = || {
        let mut build = cc::Build::new();
        build
            .cpp(true)
            .std("c++17")
            .define("_GLIBCXX_USE_CXX11_ABI", "1")
            .include(torch.join("include"))
            .include(torch.join("include/torch/csrc/api/include"))
            .warnings(false);
        build
    };
    let mut shim = build();
    shim.define("USE_C10D_GLOO", None)
        .files(["shim/c10d.cpp", "shim/gloo.cpp"]);
    if nccl {
        shim.define("NESTOR_WITH_NCCL", None);
        let mut nccl_shim = build();
        nccl_shim
            .define("USE_C10D_NCCL", None)
            .define("USE_CUDA", None)
            .file("shim/nccl.cpp");
        for folder in cuda_includes(&torch) {
            nccl_shim.include(folder);
        }
        nccl_shim.compile("nestor_c10d_nccl");
    }
    shim.compile("nestor_c10d");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    if nccl {
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
    }
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
    for file in [
        "shim/c10d.cpp",
        "shim/gloo.cpp",
        "shim/nccl.cpp",
        "shim/shim.hpp",
        GLOO_HEADER,
    ] {
        println!("cargo:rerun-if-changed={file}");
    }
}

/// The CUDA, NCCL and CCCL headers of the torch wheel's nvidia/ packages (beside
/// `torch`), and the CUDA runtime's `crt/` headers that triton ships.
fn cuda_includes(torch: &std::path::Path) -> Vec<PathBuf> {
    let packages = torch.parent().map(PathBuf::from).unwrap_or_default();
    let needed = [
        ("nvidia/cu13/include", "cuda_runtime.h"),
        ("nvidia/cu13/include", "nv/target"),
        ("nvidia/nccl/include", "nccl.h"),
        ("triton/backends/nvidia/include", "crt/host_config.h"),
    ];
    let mut folders = Vec::new();
    for (folder, header) in needed {
        let path = packages.join(folder).join(header);
        if !path.exists() {
            panic!(
                "nestor-distributed's `nccl` feature: {} is missing (scripts/setup.sh installs \
                 torch with its CUDA packages and nvidia-cuda-cccl)",
                path.display()
            );
        }
        if !folders.contains(&packages.join(folder)) {
            folders.push(packages.join(folder));
        }
    }
    folders
}
