//! Embeds libtorch's folder as an rpath (`build/rpath.rs`) and, with `compile`, builds
//! the small C++ shim over what tch does not expose of libtorch (`shim/grad.cpp`), as
//! torch-sys builds its own (`cc`, C++17, the new C++ ABI).

#[path = "../build/rpath.rs"]
mod rpath;

fn main() {
    rpath::main();
    println!("cargo:rerun-if-changed=shim/grad.cpp");
    if std::env::var_os("CARGO_FEATURE_COMPILE").is_none() {
        return;
    }
    let (lib_dir, torch) = rpath::libtorch_folders("nestor-frontend");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .include(torch.join("include"))
        .warnings(false)
        .file("shim/grad.cpp")
        .compile("nestor_grad");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=torch_cpu");
    println!("cargo:rustc-link-lib=dylib=c10");
}
