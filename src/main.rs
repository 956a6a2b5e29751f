fn main() -> std::process::ExitCode {
    admitd::cli::main()
}
