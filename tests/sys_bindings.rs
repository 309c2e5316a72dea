//! The committed FFI (src/sys/bindings.rs) must be exactly what bindgen makes of
//! csrc/cuferry_cuda.h, with the configuration of tools/gen-bindings (scripts/gen-bindings.sh
//! regenerates it). `CUFERRY_BLESS_BINDINGS=1` rewrites the file instead of comparing. Without libclang the test prints SKIP (it fails instead under
//! `CUFERRY_REQUIRE_LIBCLANG=1`, which scripts/test.sh sets once it has installed libclang).

use std::path::PathBuf;

#[path = "../tools/gen-bindings/src/config.rs"]
mod config;

#[test]
fn bindings_match_header() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let header = root.join("csrc/cuferry_cuda.h");
    let committed_path = root.join("src/sys/bindings.rs");
    if !header.exists() {
        println!("SKIP: {} is not here (run from a bundle?)", header.display());
        return;
    }
    // bindgen panics when it cannot load libclang; that is a missing tool, not drift.
    let header_str = header.to_string_lossy().into_owned();
    let generated = match std::panic::catch_unwind(|| config::generate(&header_str)) {
        Ok(Ok(text)) => text,
        Ok(Err(err)) => panic!("bindgen failed on {header_str}: {err}"),
        Err(_) => {
            assert!(
                std::env::var("CUFERRY_REQUIRE_LIBCLANG").as_deref() != Ok("1"),
                "CUFERRY_REQUIRE_LIBCLANG=1 but bindgen could not load libclang"
            );
            println!("SKIP: libclang not found; install libclang-dev (scripts/test.sh does)");
            return;
        }
    };
    if std::env::var("CUFERRY_BLESS_BINDINGS").as_deref() == Ok("1") {
        std::fs::write(&committed_path, &generated).expect("write bindings");
        println!("wrote {}", committed_path.display());
        return;
    }
    let committed = std::fs::read_to_string(&committed_path).unwrap_or_default();
    assert!(
        committed == generated,
        "src/sys/bindings.rs drifted from csrc/cuferry_cuda.h: run scripts/gen-bindings.sh and \
         commit the result"
    );
}
