//! The set-up scripts' path logic on fake virtual environments: a first run (no venv
//! when `env.sh` is sourced) finds libtorch after the install, a second run installs
//! nothing, and a venv without libtorch is a clear error. The install itself is faked by
//! a `python3` whose `-m venv` writes a venv whose `pip` lays out a torch package.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A fresh folder under the system's temporary folder, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let path = std::env::temp_dir().join(format!("nestor-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path).expect("create a scratch folder");
        Scratch(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scripts() -> PathBuf {
    Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("scripts")
}

fn write_executable(path: &Path, text: &str) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).expect("write a fake tool");
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .expect("make a fake tool executable");
}

/// A `python3` whose `-m venv DIR` creates `DIR/bin/pip`; that `pip install` lays out
/// torch under `lib/python3.12/site-packages` (with `libtorch_cpu.so` when `with_lib`),
/// or CUDA's C++ headers when asked for `nvidia-cuda-cccl`, or torchvision and
/// transformers, and writes each install's packages to `DIR/installs`.
fn fake_python(folder: &Path, with_lib: bool) -> PathBuf {
    let lib = if with_lib {
        r#"mkdir -p "$site/torch/lib" && touch "$site/torch/lib/libtorch_cpu.so""#
    } else {
        r#"mkdir -p "$site/torch""#
    };
    let pip = format!(
        r#"#!/usr/bin/env bash
venv=$(cd "$(dirname "$0")/.." && pwd)
site="$venv/lib/python3.12/site-packages"
case "$*" in
  *nvidia-cuda-cccl*)
    mkdir -p "$site/nvidia/cu13/include/nv/target"
    echo cccl >> "$venv/installs"
    exit 0;;
  *torchvision*)
    mkdir -p "$site/torchvision-0.28.0.dist-info" "$site/transformers-5.23.0.dist-info"
    echo torchvision transformers >> "$venv/installs"
    exit 0;;
esac
mkdir -p "$site/torch-2.13.0.dist-info"
{lib}
echo torch >> "$venv/installs"
"#
    );
    let python = folder.join("python3");
    write_executable(
        &python,
        &format!(
            r#"#!/usr/bin/env bash
[ "$1" = -m ] && [ "$2" = venv ] || exit 2
mkdir -p "$3/bin"
cat > "$3/bin/pip" <<'PIP'
{pip}PIP
chmod +x "$3/bin/pip"
"#
        ),
    );
    python
}

/// Runs `script` in bash with nestor's cache in `cache`, the fake `python`, no apt step
/// and no inherited LIBTORCH or venv.
fn run(script: &str, cache: &Path, python: &Path) -> Output {
    Command::new("bash")
        .arg("-c")
        .arg(script)
        .env("NESTOR_CACHE", cache)
        .env("NESTOR_PYTHON", python)
        .env("NESTOR_SETUP_APT", "0")
        .env("SCRIPTS", scripts())
        .env_remove("LIBTORCH")
        .env_remove("NESTOR_VENV")
        .env_remove("CARGO_TARGET_DIR")
        .output()
        .expect("run bash")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn a_first_run_installs_then_finds_libtorch_and_a_second_run_installs_nothing() {
    let scratch = Scratch::new("setup-first-run");
    let cache = scratch.0.join("cache");
    let python = fake_python(&scratch.0, true);
    let torch = cache.join("venv/lib/python3.12/site-packages/torch");

    // Before the install, env.sh knows no libtorch (and invents no path).
    let before = run(
        r#"source "$SCRIPTS/env.sh"; echo "[$LIBTORCH]""#,
        &cache,
        &python,
    );
    assert_eq!(text(&before.stdout), "[]\n", "{}", text(&before.stderr));

    // The first run: env.sh is sourced before the venv exists, as on a fresh machine.
    let first = run(
        r#""$SCRIPTS/setup.sh" && source "$SCRIPTS/env.sh" && echo "$LIBTORCH""#,
        &cache,
        &python,
    );
    assert!(first.status.success(), "{}", text(&first.stderr));
    assert_eq!(text(&first.stdout).trim(), torch.display().to_string());
    assert!(text(&first.stderr).contains("installing torch==2.13.0"));

    let second = run(r#""$SCRIPTS/setup.sh""#, &cache, &python);
    assert!(second.status.success(), "{}", text(&second.stderr));
    assert_eq!(text(&second.stderr), "", "a second run has nothing to say");
    let installs = std::fs::read_to_string(cache.join("venv/installs")).expect("installs");
    assert_eq!(
        installs.lines().collect::<Vec<_>>(),
        ["torch", "cccl", "torchvision transformers"],
        "torch, CUDA's C++ headers, torchvision and transformers are installed once"
    );

    // scripts/cargo runs cargo in that environment.
    let cargo = run(
        r#"source "$SCRIPTS/env.sh"; echo "$LIBTORCH $CARGO_TARGET_DIR""#,
        &cache,
        &python,
    );
    assert_eq!(
        text(&cargo.stdout).trim(),
        format!("{} {}", torch.display(), cache.join("target").display())
    );
}

#[test]
fn a_venv_without_libtorch_is_an_error_naming_the_missing_library() {
    let scratch = Scratch::new("setup-no-lib");
    let cache = scratch.0.join("cache");
    let python = fake_python(&scratch.0, false);
    let output = run(r#""$SCRIPTS/setup.sh""#, &cache, &python);
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("no libtorch_cpu.so under") && stderr.contains("venv/lib/python3"),
        "{stderr}"
    );
}

#[test]
fn an_explicit_libtorch_wins_over_the_venv() {
    let scratch = Scratch::new("setup-explicit");
    let cache = scratch.0.join("cache");
    let python = fake_python(&scratch.0, true);
    let output = run(
        r#"LIBTORCH=/opt/libtorch; source "$SCRIPTS/env.sh"; echo "$LIBTORCH""#,
        &cache,
        &python,
    );
    assert_eq!(text(&output.stdout), "/opt/libtorch\n");
}
