//! Runs a test body on several MPI ranks: the test launches `mpirun -np N` on its own test
//! binary, filtered to itself, and each rank runs the body.
//!
//! Rules:
//! - `ranks("name", n)` returns true in a rank (the body runs there) and false in the
//!   launcher, which has already asserted that every rank passed.
//! - Without `mpirun` the test prints SKIP and passes, unless CUFERRY_REQUIRE_MPI=1 (the test
//!   script sets it once it installed Open MPI).
//! - A panic in a rank aborts the job at once (`MPI_Abort`); the launcher also kills the job
//!   after a deadline, so a hang fails the test instead of CI.
#![allow(dead_code)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The variable telling a process it is a rank of the named test.
const MARKER: &str = "CUFERRY_MPI_RANK_OF";

/// The longest a whole mpirun job may take.
const JOB_DEADLINE: Duration = Duration::from_secs(240);

/// True inside the ranks of `test`; in the launcher, runs `np` ranks and asserts they passed.
pub fn ranks(test: &str, np: usize) -> bool {
    if std::env::var(MARKER).is_ok_and(|t| t == test) {
        abort_job_on_panic();
        return true;
    }
    let Some(openmpi) = mpirun_flavour() else {
        assert!(
            std::env::var("CUFERRY_REQUIRE_MPI").map_or(true, |v| v != "1"),
            "CUFERRY_REQUIRE_MPI=1 but mpirun is not on PATH"
        );
        eprintln!("SKIP {test}: mpirun not found (install openmpi-bin libopenmpi-dev)");
        return false;
    };
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new("mpirun");
    // Open MPI writes each rank's output to a file of its own (ranks' lines interleave in
    // mpirun's stdout, seen mid-line on a 16-core machine): the pass count reads those.
    // No colons in it: Open MPI reads one as the start of an option (`dir:nojobid`), and unit
    // tests' names have them (`module::test`).
    let dir_name = format!("cuferry-mpi-{}-{}", std::process::id(), test.replace(':', "_"));
    let per_rank = std::env::temp_dir().join(dir_name);
    let _ = std::fs::remove_dir_all(&per_rank);
    if openmpi {
        cmd.args(["--allow-run-as-root", "--oversubscribe", "-x", MARKER, "--output-filename"]);
        cmd.arg(&per_rank);
    }
    cmd.arg("-np").arg(np.to_string()).arg(exe).args([test, "--exact", "--nocapture", "--test-threads=1"]);
    cmd.env(MARKER, test).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("mpirun starts");
    // Drained on threads: a full pipe would stop the ranks.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_string(&mut text);
            }
            text
        })
    };
    let out_reader = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let err_reader = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for mpirun") {
            break Some(status);
        }
        if start.elapsed() > JOB_DEADLINE {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = out_reader.join().unwrap_or_default();
    let err = err_reader.join().unwrap_or_default();
    println!("{out}");
    eprintln!("{err}");
    match status {
        Some(s) => assert!(s.success(), "mpirun -np {np} {test} failed ({s})"),
        None => panic!("mpirun -np {np} {test} did not finish in {JOB_DEADLINE:?}: a hang"),
    }
    let rank_outputs = if openmpi { rank_stdouts(&per_rank) } else { vec![out] };
    let _ = std::fs::remove_dir_all(&per_rank);
    let passed: usize = rank_outputs.iter().map(|o| o.matches("test result: ok. 1 passed").count()).sum();
    if openmpi {
        for (rank, text) in rank_outputs.iter().enumerate() {
            println!("--- rank output {rank} ---\n{text}");
        }
    }
    assert!(passed == np, "expected {np} ranks to pass {test}, saw {passed}; output above");
    false
}

/// The text of every `stdout` file under `dir` (Open MPI's `--output-filename` layout:
/// `dir/1/rank.N/stdout`), in path order.
fn rank_stdouts(dir: &std::path::Path) -> Vec<String> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
            } else if path.file_name().is_some_and(|n| n == "stdout") {
                files.push(path);
            }
        }
    }
    files.sort();
    files.iter().map(|f| std::fs::read_to_string(f).unwrap_or_default()).collect()
}

/// In a rank, a panic aborts the whole job (`MPI_Abort`): the other ranks would otherwise wait
/// for the panicking one in a collective until the launcher's deadline.
fn abort_job_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        if mpi::environment::is_initialized() && !mpi::environment::is_finalized() {
            // SAFETY: MPI is initialised and not finalised; MPI_Abort ends every rank.
            unsafe {
                mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 1);
            }
        }
    }));
}

/// `Some(true)` for Open MPI's mpirun, `Some(false)` for another, `None` when absent.
fn mpirun_flavour() -> Option<bool> {
    let out = Command::new("mpirun").arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    Some(text.contains("Open MPI") || text.contains("OpenRTE"))
}
