//! Multi-process tests: a test starts copies of its own binary, one per rank, that run
//! the same test function as workers (told by `NESTOR_TEST_WORKER`), on loopback, with
//! a deadline.
#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(dead_code)]

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The variable that makes a copy of the test binary a worker of the named test.
pub const WORKER: &str = "NESTOR_TEST_WORKER";

/// Whether this process is a worker of `test`.
pub fn is_worker(test: &str) -> bool {
    std::env::var(WORKER).is_ok_and(|name| name == test)
}

/// A free port on 127.0.0.1 (bound and released: another process could take it first,
/// which on a test machine does not happen).
pub fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}

/// The arguments that make the test binary run only test `test`.
pub fn worker_args(test: &str) -> [&str; 5] {
    ["--exact", test, "--nocapture", "--test-threads", "1"]
}

/// A command that runs test `test` of this binary as a worker.
pub fn worker_command(program: &std::path::Path, test: &str) -> Command {
    let mut command = Command::new(program);
    command
        .args(worker_args(test))
        .env(WORKER, test)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

/// Starts `world` workers of `test` with torchrun's variables set by hand (rank 0
/// serves the store); `extra(rank)` adds variables.
pub fn spawn_ranks(
    test: &str,
    world: usize,
    extra: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<Child> {
    let program = std::env::current_exe().expect("the test binary");
    let port = free_port();
    (0..world)
        .map(|rank| {
            let mut command = worker_command(&program, test);
            command
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env_remove("TORCHELASTIC_USE_AGENT_STORE")
                .envs(extra(rank));
            command.spawn().expect("a worker process")
        })
        .collect()
}

/// torchrun of the torch venv (`NESTOR_VENV`, which scripts/env.sh sets).
pub fn torchrun() -> std::path::PathBuf {
    let venv = std::env::var("NESTOR_VENV").expect("NESTOR_VENV: run the tests with scripts/cargo");
    let torchrun = std::path::Path::new(&venv).join("bin/torchrun");
    assert!(
        torchrun.exists(),
        "{} is missing: run scripts/setup.sh",
        torchrun.display()
    );
    torchrun
}

/// torchrun starting `world` workers of `test` on this machine (`--standalone`: its
/// own store on a free port).
pub fn spawn_torchrun(test: &str, world: usize) -> Child {
    let program = std::env::current_exe().expect("the test binary");
    Command::new(torchrun())
        .args([
            "--standalone",
            "--nproc-per-node",
            &world.to_string(),
            "--no-python",
        ])
        .arg(program)
        .args(worker_args(test))
        .env(WORKER, test)
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("torchrun")
}

/// Waits for `child` at most until `deadline` (then kills it); its output.
pub fn finish(mut child: Child, deadline: Instant) -> Output {
    loop {
        match child.try_wait().expect("the worker's status") {
            Some(_) => break,
            None if Instant::now() >= deadline => {
                let _ = child.kill();
                break;
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    child.wait_with_output().expect("the worker's output")
}

/// Every worker's output, each waited for at most `limit` from now.
pub fn finish_all(children: Vec<Child>, limit: Duration) -> Vec<Output> {
    let deadline = Instant::now() + limit;
    children
        .into_iter()
        .map(|child| finish(child, deadline))
        .collect()
}

/// Panics with the workers' output unless every one succeeded.
pub fn assert_all_succeeded(outputs: &[Output]) {
    for (rank, output) in outputs.iter().enumerate() {
        assert!(
            output.status.success(),
            "rank {rank}: {:?}\nstdout:\n{}\nstderr:\n{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}
