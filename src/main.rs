//! The `structured-sink` command: load the configuration, then run one subcommand.

use std::io::{self, BufReader};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use structured_sink::config::Config;

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
}

fn main() -> ExitCode {
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
        Command::Config => {
            print!("{}", config.to_masked_toml());
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("structured-sink: {e}");
            ExitCode::FAILURE
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
