//! The driver shared by the randomized stress tests (`tests/stress_*.rs`).
//!
//! Rules:
//! - `$CUFERRY_STRESS_ITERS` seeds run (default: the test's own count), from
//!   `$CUFERRY_STRESS_SEED` (default 1), so a failing seed reruns alone.
//! - A failure whose message starts with `HANG` stops the run at once (its threads may still
//!   be blocked); otherwise it stops after six failures. Every failure is printed and listed.
//! - `CUFERRY_STRESS_NO_*` variables switch a mode off, to narrow a failing seed down.

use std::time::Duration;

use super::Rng;

/// Runs `run_one` for each seed as the module rules say; panics listing the failures.
pub fn run_seeds(default_iters: u64, run_one: impl Fn(u64) -> Result<(), String>) {
    let var = |name: &str| std::env::var(name).ok().and_then(|s| s.parse::<u64>().ok());
    let iters = var("CUFERRY_STRESS_ITERS").unwrap_or(default_iters);
    let base = var("CUFERRY_STRESS_SEED").unwrap_or(1);
    let mut failures = Vec::new();
    for i in 0..iters {
        if let Err(e) = run_one(base + i) {
            println!("FAIL {e}");
            let hang = e.starts_with("HANG");
            failures.push(e);
            if hang || failures.len() > 5 {
                break;
            }
        }
        if i % 100 == 0 {
            println!("iter {i} ({} failures)", failures.len());
        }
    }
    assert!(failures.is_empty(), "{} failures: {failures:#?}", failures.len());
}

/// A mode of the stress run, on unless `off_var` is set.
pub fn mode(off_var: &str) -> bool {
    std::env::var_os(off_var).is_none()
}

/// Sleeps 21-200 us about nine times in ten, to vary interleavings.
pub fn pause(rng: &mut Rng) {
    let us = rng.below(201) as u64;
    if us > 20 {
        std::thread::sleep(Duration::from_micros(us));
    }
}
