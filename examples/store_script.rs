//! Prints the shared-store script as admitd loads it into Redis: `src/store/admitd.lua` with the
//! engine's constants written in (`admitd::store::script`), or the script at the path given, for
//! tools that run the script outside admitd (`scripts/script_cost.py`).
//!
//!     cargo run -q --example store_script [-- path/to/admitd.lua] > script.lua

use std::process::ExitCode;

fn main() -> ExitCode {
    let text = match std::env::args_os().nth(1) {
        None => admitd::store::script::text().map(str::to_string),
        Some(path) => std::fs::read_to_string(&path)
            .map_err(|e| format!("{}: {e}", path.to_string_lossy()))
            .and_then(|t| admitd::store::script::render(&t)),
    };
    match text {
        Ok(t) => {
            print!("{t}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}
