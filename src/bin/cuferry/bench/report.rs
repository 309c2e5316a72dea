//! The results: one row per measurement, printed as a table and written as JSON.

use std::path::Path;

use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};
use serde::Serialize;

/// One measured case.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// Section, e.g. "ring".
    pub section: &'static str,
    /// What was measured, e.g. "pageable source".
    pub case: String,
    /// Bytes per item (slot, copy).
    pub bytes: usize,
    /// Parameters, e.g. "depth 4, 8 threads".
    pub params: String,
    /// The figure: GB/s (1e9 bytes per second), or microseconds per operation when
    /// `unit` is "us".
    pub value: f64,
    /// "GB/s" (higher is better) or "us" (lower is better).
    pub unit: &'static str,
    /// The ceiling this is a ratio of: (name, GB/s).
    pub ceiling: Option<(String, f64)>,
    /// The baseline a user would otherwise use: (name, GB/s).
    pub baseline: Option<(String, f64)>,
}

fn size(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn ratio(r: &Row, of: &Option<(String, f64)>) -> String {
    of.as_ref().map_or_else(String::new, |(name, v)| {
        if r.unit == "us" {
            format!("{:.1}x faster than {name} ({v:.2} us)", v / r.value)
        } else {
            format!("{:.2}x {name} ({v:.1})", r.value / v)
        }
    })
}

/// The rows as a terminal table.
pub fn table(rows: &[Row]) -> Table {
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(["section", "case", "size", "params", "value", "vs ceiling", "vs baseline"]);
    for r in rows {
        t.add_row([
            r.section.to_string(),
            r.case.clone(),
            size(r.bytes),
            r.params.clone(),
            format!("{:.2} {}", r.value, r.unit),
            ratio(r, &r.ceiling),
            ratio(r, &r.baseline),
        ]);
    }
    t
}

#[derive(Serialize)]
struct Report<'a> {
    device: &'a str,
    unix_time: u64,
    rows: &'a [Row],
}

/// Writes every row as JSON.
pub fn write_json(path: &Path, device: &str, rows: &[Row]) -> std::io::Result<()> {
    let unix_time =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let text =
        serde_json::to_string_pretty(&Report { device, unix_time, rows }).map_err(std::io::Error::other)?;
    std::fs::write(path, text)
}
