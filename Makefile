# The two commands of the README: `make demo` and `make test`. Each installs what is
# missing first (scripts/setup.sh), then builds and runs.
.PHONY: setup demo test lint report fuzz

setup:
	@scripts/setup.sh

# The eager NestedTensor (examples/quickstart.rs), then the compiler's job
# (benches/examples/demo.rs: compiled vs eager vs padded, dumps, compiled training).
demo: setup
	scripts/cargo run --release --example quickstart
	scripts/cargo run --release -p nestor-bench --example demo

test: setup
	scripts/cargo test --workspace --all-targets
	scripts/cargo test --workspace --doc
	scripts/cargo test -p nestor-distributed --features nccl --test nccl

# The property tests with many more cases (PROPTEST_CASES, default 256) and a million
# mutated .nir texts (NESTOR_FUZZ_TEXTS) and 100,000 arbitrary sizes and indices
# (NESTOR_FUZZ_INPUTS), optimized but with overflow checks and debug assertions (the
# `fuzz` profile of Cargo.toml): well over an hour on two cores (at 256 cases
# tests/compile.rs alone takes about 40 minutes, tests/parallel.rs about 20); a lower
# PROPTEST_CASES, or one test target (`--test NAME` after the same command), is quicker.
fuzz: setup
	PROPTEST_CASES=$${PROPTEST_CASES:-256} NESTOR_FUZZ_TEXTS=$${NESTOR_FUZZ_TEXTS:-1000000} NESTOR_FUZZ_INPUTS=$${NESTOR_FUZZ_INPUTS:-100000} \
		scripts/cargo test --workspace --all-targets --profile fuzz --no-fail-fast

lint: setup
	cargo fmt --all -- --check
	scripts/cargo clippy --workspace --all-targets -- -D warnings
	scripts/cargo clippy -p nestor-distributed --features nccl --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" scripts/cargo doc --no-deps --workspace --quiet
	scripts/check-layers.sh

# The benchmark report (docs/benchmarks/report.md and its charts), from scratch:
# builds the counting malloc the report preloads for peak memory, then runs the suite.
report: setup
	scripts/cargo build --release -p nestor-memcount -p nestor-bench
	scripts/cargo run --release -p nestor-bench --bin report -- --out docs/benchmarks
