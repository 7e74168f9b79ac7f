//! Kill -9 torture at CI size: the writer is killed at random moments; after each kill the store
//! reopens and must serve every acknowledged recent block, and nothing wrong. Full size:
//! `cargo run --release -p kvtier-core --bin kvtier-torture -- run --loops 500 --engine io_uring`.

mod common;

#[test]
fn kill9_loop_never_serves_wrong_bytes_nor_loses_flushed_blocks() {
    let loops = std::env::var("KVTIER_CRASH_LOOPS").unwrap_or_else(|_| "10".into());
    for engine in common::engines() {
        let name = match engine {
            kvtier_core::EngineChoice::Psync => "psync",
            _ => "io_uring",
        };
        let dir = tempfile::tempdir().unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier-torture"))
            .args(["run", "--loops", &loops, "--engine", name, "--dir", dir.path().to_str().unwrap()])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        println!("{stdout}");
        assert!(out.status.success(), "torture failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        assert!(stdout.contains("\"blocks_served_wrong\": 0"), "{stdout}");
        assert!(stdout.contains("\"blocks_lost\": 0"), "{stdout}");
    }
}

/// The same through the host service, with two ranks storing each half of every block: a kill
/// between a store's acknowledgement and its NVMe write never leaves a wrong or half block behind.
#[test]
fn kill9_of_the_service_never_serves_wrong_bytes_nor_loses_flushed_blocks() {
    let loops = std::env::var("KVTIER_CRASH_LOOPS").unwrap_or_else(|_| "10".into());
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvtier-torture"))
        .args(["run", "--loops", &loops, "--service", "--dir", dir.path().to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "torture failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("\"blocks_served_wrong\": 0") && stdout.contains("\"service\": true"), "{stdout}");
    assert!(stdout.contains("\"blocks_lost\": 0"), "{stdout}");
    assert!(!stdout.contains("\"blocks_acknowledged\": 0,"), "the writer never got a store through: {stdout}");
}
