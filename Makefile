# The two commands of the README: `make demo` and `make test`. Each installs what is
# missing first (scripts/setup.sh), then builds and runs.
.PHONY: setup demo test lint

setup:
	@scripts/setup.sh

demo: setup
	scripts/cargo run --example quickstart

test: setup
	scripts/cargo test --workspace --all-targets
	scripts/cargo test --workspace --doc

lint: setup
	cargo fmt --all -- --check
	scripts/cargo clippy --workspace --all-targets -- -D warnings
