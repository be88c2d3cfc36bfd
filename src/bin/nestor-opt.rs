//! `nestor-opt`: reads a `.nir` graph, runs passes over it and prints each stage, in the
//! spirit of `mlir-opt` and cranelift's `clif-util`.
//!
//! ```sh
//! nestor-opt tests/filetests/encoder_layer.nir --print-after-all
//! nestor-opt ffn.nir --passes dce,cse --emit llvm
//! cat ffn.nir | nestor-opt --dot ffn.dot --svg ffn.svg
//! ```
//!
//! Exit status: 0 on success, 1 when the graph is rejected (parse or verifier error, a
//! pass, lowering or the backend failed), 2 on a usage error.

use std::io::{Read, Write};
use std::process::ExitCode;

use nestor::ir::Graph;
use nestor::passes::{annotated, lower_with, Limits, LowerOptions, Pipeline};
use nestor_backend_cuda::Arch;

const USAGE: &str = "\
usage: nestor-opt [FILE | -] [options]

Reads a .nir graph (FILE, or stdin when FILE is - or missing), runs a pipeline of passes
and prints the result.

options:
  --passes LIST        comma-separated passes, run in order: decompose, dce, cse, optimize;
                       `none` for none (default: decompose,dce,cse,optimize,dce)
  --print-after-all    print the graph after every pass (pass notes as // comments)
  --report             print what the passes had to say (the optimizer's report)
  --emit KIND          what to print at the end: nir (default), program (the lowered
                       kernel program), llvm (the kernels' optimized LLVM IR for this
                       host), ptx (the kernels' PTX for --arch), none
  --arch ARCH          the GPU architecture of --emit ptx: sm_80 or sm_90 (default)
  --ptxas              with --emit ptx, assemble it with ptxas and print each kernel's
                       registers and spills
  --per-element-fallback
                       lower per-element regions to host steps (as compile's
                       .per_element_fallback(true)) instead of failing
  --dot FILE           write the resulting graph as Graphviz DOT
  --svg FILE           draw the resulting graph with Graphviz's `dot`
  -h, --help           this text

exit status: 0 ok, 1 the graph was rejected, 2 usage error
";

/// What the final stage prints.
#[derive(Clone, Copy, PartialEq)]
enum Emit {
    Nir,
    Program,
    Llvm,
    Ptx,
    Nothing,
}

/// The parsed command line.
struct Options {
    input: Option<String>,
    passes: Option<Vec<String>>,
    print_after_all: bool,
    report: bool,
    emit: Emit,
    per_element_fallback: bool,
    dot: Option<String>,
    svg: Option<String>,
    arch: Arch,
    ptxas: bool,
}

/// Why nestor-opt stopped.
enum Failure {
    /// A bad command line (exit status 2).
    Usage(String),
    /// The graph or a stage rejected it (exit status 1).
    Rejected(String),
}

fn parse_options(mut args: impl Iterator<Item = String>) -> Result<Options, Failure> {
    let mut options = Options {
        input: None,
        passes: None,
        print_after_all: false,
        report: false,
        emit: Emit::Nir,
        per_element_fallback: false,
        dot: None,
        svg: None,
        arch: Arch::Sm90,
        ptxas: false,
    };
    let value = |args: &mut dyn Iterator<Item = String>, flag: &str| {
        args.next()
            .ok_or_else(|| Failure::Usage(format!("{flag} needs a value")))
    };
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-h" | "--help" => return Err(Failure::Usage(String::new())),
            "--passes" => {
                let list = value(&mut args, "--passes")?;
                options.passes = Some(if list == "none" {
                    Vec::new()
                } else {
                    list.split(',').map(|name| name.trim().to_owned()).collect()
                });
            }
            "--print-after-all" => options.print_after_all = true,
            "--report" => options.report = true,
            "--per-element-fallback" => options.per_element_fallback = true,
            "--emit" => {
                options.emit = match value(&mut args, "--emit")?.as_str() {
                    "nir" => Emit::Nir,
                    "program" => Emit::Program,
                    "llvm" => Emit::Llvm,
                    "ptx" => Emit::Ptx,
                    "none" => Emit::Nothing,
                    other => {
                        return Err(Failure::Usage(format!(
                            "--emit {other}: expected nir, program, llvm, ptx or none"
                        )))
                    }
                }
            }
            "--arch" => {
                options.arch = value(&mut args, "--arch")?.parse().map_err(
                    |error: nestor_backend_cuda::CudaError| Failure::Usage(error.to_string()),
                )?
            }
            "--ptxas" => options.ptxas = true,
            "--dot" => options.dot = Some(value(&mut args, "--dot")?),
            "--svg" => options.svg = Some(value(&mut args, "--svg")?),
            flag if flag.starts_with('-') && flag != "-" => {
                return Err(Failure::Usage(format!("unknown option {flag}")))
            }
            _ if options.input.is_some() => {
                return Err(Failure::Usage(format!("a second input file {arg}")))
            }
            _ => options.input = Some(arg),
        }
    }
    Ok(options)
}

/// The input's name (for messages) and text.
fn read_input(input: Option<&str>) -> Result<(String, String), Failure> {
    let mut text = String::new();
    match input {
        None | Some("-") => std::io::stdin()
            .read_to_string(&mut text)
            .map(|_| ("<stdin>".to_owned(), text))
            .map_err(|error| Failure::Rejected(format!("cannot read stdin: {error}"))),
        Some(path) => std::fs::read_to_string(path)
            .map(|text| (path.to_owned(), text))
            .map_err(|error| Failure::Rejected(format!("cannot read {path}: {error}"))),
    }
}

fn pipeline(passes: Option<&[String]>) -> Result<Pipeline, Failure> {
    match passes {
        None => Ok(Pipeline::optimizing(Limits::untimed())),
        Some(names) => Pipeline::named(names.iter().map(String::as_str), Limits::untimed())
            .map_err(|error| Failure::Usage(error.to_string())),
    }
}

/// Writes `text` to stdout; a closed pipe (`nestor-opt ... | head`) is not an error.
fn print(out: &mut impl Write, text: &str) -> Result<(), Failure> {
    match out.write_all(text.as_bytes()) {
        Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => Err(Failure::Rejected(
            format!("cannot write the output: {error}"),
        )),
        _ => Ok(()),
    }
}

fn run(options: &Options) -> Result<(), Failure> {
    let (name, text) = read_input(options.input.as_deref())?;
    let graph =
        nestor::ir::parse(&text).map_err(|error| Failure::Rejected(format!("{name}: {error}")))?;
    graph
        .verify()
        .map_err(|error| Failure::Rejected(format!("{name}: {error}")))?;
    let pipeline = pipeline(options.passes.as_deref())?;
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    // Stages are printed even when a later pass fails: they show what it was given.
    let mut stages = String::new();
    let mut notes = String::new();
    let result = pipeline.run_observed(&graph, |pass, graph, note| {
        if options.print_after_all {
            stages.push_str(&format!("// -- after {pass}\n{}", annotated(note, graph)));
        }
        notes.extend(note.lines().map(|line| format!("// {line}\n")));
        Ok(())
    });
    print(&mut out, &stages)?;
    let graph = result.map_err(|error| Failure::Rejected(format!("{name}: {error}")))?;
    if options.report && !options.print_after_all {
        print(&mut out, &notes)?;
    }
    write_pictures(&graph, options)?;
    let final_text = match options.emit {
        Emit::Nothing => None,
        // The last stage was printed already.
        Emit::Nir if options.print_after_all && !pipeline.pass_names().is_empty() => None,
        Emit::Nir => Some(nestor::ir::print(&graph)),
        Emit::Program | Emit::Llvm | Emit::Ptx => Some(lowered(&graph, options)?),
    };
    if let Some(text) = final_text {
        print(&mut out, &text)?;
    }
    Ok(())
}

/// The lowered program (`--emit program`), its kernels' LLVM IR (`--emit llvm`) or PTX
/// (`--emit ptx`, with ptxas's report of each kernel after `--ptxas`).
fn lowered(graph: &Graph, options: &Options) -> Result<String, Failure> {
    let lower_options = LowerOptions {
        host_per_element: options.per_element_fallback,
        // PTX is a GPU's program: attention's gradients read saved statistics, in two
        // parts; the CPU computes self-attention's three at once.
        attention_statistics: options.emit == Emit::Ptx,
        attention_gradients_at_once: options.emit != Emit::Ptx,
        // Epilogues of the GEMMs the optimizer's rule leaves out, where it ran.
        fold_epilogues: options
            .passes
            .as_ref()
            .is_none_or(|passes| passes.iter().any(|pass| pass == "optimize")),
    };
    let program = lower_with(graph, lower_options)
        .map_err(|error| Failure::Rejected(format!("lowering: {error}")))?;
    match options.emit {
        Emit::Program => return Ok(program.to_string()),
        Emit::Ptx => return ptx(&program, options),
        _ => {}
    }
    let executable = nestor_backend_cpu::executable(program)
        .map_err(|error| Failure::Rejected(format!("backend: {error}")))?;
    Ok(executable.code().to_owned())
}

fn ptx(program: &nestor::passes::Program, options: &Options) -> Result<String, Failure> {
    let failed = |error: nestor_backend_cuda::CudaError| Failure::Rejected(error.to_string());
    let module = nestor_backend_cuda::ptx(program, options.arch).map_err(failed)?;
    let mut text = module.ptx;
    if options.ptxas {
        for kernel in nestor_backend_cuda::ptxas::assemble(&text, options.arch).map_err(failed)? {
            text.push_str(&format!(
                "// ptxas {}: {} registers, {} bytes spill stores, {} bytes spill loads\n",
                kernel.name, kernel.registers, kernel.spill_stores, kernel.spill_loads
            ));
        }
    }
    Ok(text)
}

fn write_pictures(graph: &Graph, options: &Options) -> Result<(), Failure> {
    let dot = nestor::ir::to_dot(graph);
    if let Some(path) = &options.dot {
        std::fs::write(path, &dot)
            .map_err(|error| Failure::Rejected(format!("cannot write {path}: {error}")))?;
    }
    if let Some(path) = &options.svg {
        draw_svg(&dot, path)?;
    }
    Ok(())
}

/// Runs Graphviz's `dot -Tsvg -o path` on `dot`.
fn draw_svg(dot: &str, path: &str) -> Result<(), Failure> {
    let mut child = std::process::Command::new("dot")
        .args(["-Tsvg", "-o", path])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .map_err(|error| {
            Failure::Rejected(format!(
                "--svg needs Graphviz's `dot` ({error}); install graphviz or use --dot"
            ))
        })?;
    let written = child
        .stdin
        .take()
        .map(|mut stdin| stdin.write_all(dot.as_bytes()));
    let status = child
        .wait()
        .map_err(|error| Failure::Rejected(format!("Graphviz: {error}")))?;
    match (written, status.success()) {
        (Some(Ok(())), true) => Ok(()),
        _ => Err(Failure::Rejected(format!(
            "Graphviz could not draw {path} ({status})"
        ))),
    }
}

fn main() -> ExitCode {
    let result = parse_options(std::env::args().skip(1)).and_then(|options| run(&options));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::Usage(message)) if message.is_empty() => {
            print!("{USAGE}");
            ExitCode::SUCCESS
        }
        Err(Failure::Usage(message)) => {
            eprintln!("nestor-opt: {message}\n\n{USAGE}");
            ExitCode::from(2)
        }
        Err(Failure::Rejected(message)) => {
            eprintln!("nestor-opt: {message}");
            ExitCode::from(1)
        }
    }
}
