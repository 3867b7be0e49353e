//! The `structured-sink` command: load the configuration, then run one subcommand.

use std::io::{self, BufReader};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use structured_sink::config::Config;

/// mimalloc: events are decoded on the dispatcher's thread and freed on a shard worker's, a
/// pattern glibc's allocator handles poorly (see BENCHMARKS.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Filters structured blocks out of streamed LLM text on NATS and republishes the visible text
/// and typed events.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// A TOML configuration file (defaults, then this file, then STRUCTURED_SINK__* variables,
    /// then --set flags).
    #[arg(long, short, global = true, env = "STRUCTURED_SINK_CONFIG")]
    config: Option<PathBuf>,
    /// Override one key, such as `--set shards.count=4` (the value in TOML syntax or a bare
    /// string). May be repeated.
    #[arg(long = "set", global = true, value_name = "KEY=VALUE")]
    overrides: Vec<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the pipeline offline over JSON Lines of geppetto events (a file, or standard input)
    /// and print one JSON object per published message.
    Replay {
        /// The input file; standard input when absent or `-`.
        input: Option<PathBuf>,
    },
    /// Print the effective configuration as TOML, secrets masked.
    Config,
    /// Run the service until SIGINT or SIGTERM.
    Serve,
    /// Print system-prompt instructions for block types declared in `.proto` files: the exact
    /// tags, a YAML example generated from the schema, and the rules. All types when no tag is
    /// given.
    Prompt {
        /// Tags such as `geppetto:citations:v1`.
        tags: Vec<String>,
    },
    /// Start (or use, with NATS_URL) a NATS server, run the service, publish an example
    /// conversation as an agent would, and print what a downstream handler receives.
    Demo,
}

fn main() -> ExitCode {
    withhold_panic_messages();
    let cli = Cli::parse();
    let config = match Config::load(cli.config.as_deref(), &cli.overrides) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("structured-sink: {e}");
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Replay { input } => run_replay(&config, input),
        // The settings as loaded, then what they amount to here; a configuration that start-up
        // would refuse fails after the settings are printed.
        Command::Config => {
            print!("{}", config.to_masked_toml());
            config.effective().map(|effective| print!("{effective}")).map_err(|e| io::Error::other(e.to_string()))
        }
        Command::Prompt { tags } => config
            .load_schemas()
            .map_err(|e| io::Error::other(e.to_string()))
            .and_then(|registry| {
                structured_sink::typed::render_prompt(&registry, &tags).map_err(|e| io::Error::other(e.to_string()))
            })
            .map(|text| print!("{text}")),
        Command::Serve => runtime().and_then(|rt| rt.block_on(serve(config))),
        Command::Demo => runtime().and_then(|rt| {
            rt.block_on(structured_sink::demo::run(config)).map_err(|e| io::Error::other(e.to_string()))
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("structured-sink: {e}");
            ExitCode::FAILURE
        }
    }
}

fn runtime() -> io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build()
}

/// Runs the service until a signal, then shuts down in order; telemetry is flushed last.
async fn serve(config: Config) -> io::Result<()> {
    // Listening first: the service subscribes, and may take input, before its start-up is over,
    // and a signal then must start the graceful shutdown (once start-up is done), not kill the
    // process mid-stream as the default action would.
    let mut signals = ShutdownSignals::listen()?;
    let telemetry = structured_sink::telemetry::init(&config.telemetry).map_err(|e| io::Error::other(e.to_string()))?;
    let service =
        structured_sink::service::RunningService::start(config).await.map_err(|e| io::Error::other(e.to_string()))?;
    tracing::info!(version = env!("CARGO_PKG_VERSION"), "structured-sink is running");
    signals.recv().await;
    tracing::info!("shutting down");
    let stopped = service.shutdown().await;
    if let Err(e) = telemetry.shutdown() {
        eprintln!("structured-sink: telemetry shutdown: {e}");
    }
    stopped.map_err(|e| io::Error::other(e.to_string()))
}

/// SIGTERM (an orchestrator's stop) and SIGINT (Ctrl-C), caught from [`ShutdownSignals::listen`]
/// on: one that arrives before [`ShutdownSignals::recv`] is kept for it.
struct ShutdownSignals {
    terminate: tokio::signal::unix::Signal,
    interrupt: tokio::signal::unix::Signal,
}

impl ShutdownSignals {
    fn listen() -> io::Result<ShutdownSignals> {
        use tokio::signal::unix::{signal, SignalKind};
        Ok(ShutdownSignals { terminate: signal(SignalKind::terminate())?, interrupt: signal(SignalKind::interrupt())? })
    }

    /// Waits for either signal (at once if one came already).
    async fn recv(&mut self) {
        tokio::select! {
            _ = self.terminate.recv() => {}
            _ = self.interrupt.recv() => {}
        }
    }
}

fn run_replay(config: &Config, input: Option<PathBuf>) -> io::Result<()> {
    let stdout = io::stdout().lock();
    let stderr = io::stderr().lock();
    let out = io::BufWriter::new(stdout);
    match input.filter(|p| p.as_os_str() != "-") {
        Some(path) => {
            let file = std::fs::File::open(&path)
                .map_err(|e| io::Error::new(e.kind(), format!("cannot open {}: {e}", path.display())))?;
            structured_sink::replay::replay(config, BufReader::new(file), out, stderr)?;
        }
        None => {
            structured_sink::replay::replay(config, io::stdin().lock(), out, stderr)?;
        }
    }
    Ok(())
}

/// Reports panics by location only. A panic message may quote the data being processed (a string
/// slicing error prints the string), and payload text must never reach the logs; the location is
/// enough to find the bug, and the input that caused it is on the dead-letter or input subject.
fn withhold_panic_messages() {
    std::panic::set_hook(Box::new(|info| {
        let location =
            info.location().map_or_else(|| "an unknown location".to_owned(), |l| format!("{}:{}", l.file(), l.line()));
        let thread = std::thread::current().name().unwrap_or("unnamed").to_owned();
        eprintln!(
            "structured-sink: panic at {location} in thread {thread} (message withheld: it may quote payload text)"
        );
    }));
}
