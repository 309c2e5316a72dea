//! The results: one row per measurement, printed as a line when measured and in its section's
//! table, and written as JSON.

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
    /// The same work's limit with as many copying threads as this case used: (name, GB/s).
    /// Only the ring's pageable rows have one (their headline ceiling is the best memcpy,
    /// whatever its thread count); left out of the JSON when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub same_threads: Option<(String, f64)>,
}

/// `bytes` in the largest binary unit it reaches: whole when exact, else with one decimal
/// (3640320 bytes is "3.5 MiB", not "3 MiB").
pub fn size(bytes: usize) -> String {
    let unit = |shift: u32, name: &str| {
        if bytes % (1 << shift) == 0 {
            format!("{} {name}", bytes >> shift)
        } else {
            format!("{:.1} {name}", bytes as f64 / f64::from(1u32 << shift))
        }
    };
    match bytes {
        b if b >= 1 << 30 => unit(30, "GiB"),
        b if b >= 1 << 20 => unit(20, "MiB"),
        b if b >= 1 << 10 => unit(10, "KiB"),
        b => format!("{b} B"),
    }
}

/// How far past its ceiling a figure may land (run-to-run spread) before the table flags it:
/// a figure well above its ceiling means the ceiling measured something else (a cache-resident
/// copy, a smaller working set), so its ratio proves nothing.
const CEILING_SLACK: f64 = 1.05;

/// The ratio of `r` to `of`, flagged when `of` is the ceiling and `r` is above it by more than
/// [`CEILING_SLACK`].
fn ratio(r: &Row, of: &Option<(String, f64)>, is_ceiling: bool) -> String {
    of.as_ref().map_or_else(String::new, |(name, v)| {
        let above = is_ceiling && above_ceiling(r.unit, r.value, *v);
        let flag = if above { " (above its ceiling)" } else { "" };
        if r.unit == "us" {
            // `v / value` is the speed-up: below 1 the row is slower, and the words hold.
            format!("{:.2}x the speed of {name} ({v:.2} us){flag}", v / r.value)
        } else {
            format!("{:.2}x {name} ({v:.1}){flag}", r.value / v)
        }
    })
}

/// Whether `value` beats the ceiling `ceiling` by more than [`CEILING_SLACK`] (for "us", lower
/// is better).
fn above_ceiling(unit: &str, value: f64, ceiling: f64) -> bool {
    if unit == "us" {
        value * CEILING_SLACK < ceiling
    } else {
        value > ceiling * CEILING_SLACK
    }
}

/// The table's column names; the last only for rows that have a same-threads ceiling.
const HEADER: [&str; 8] =
    ["section", "case", "size", "params", "value", "vs ceiling", "vs baseline", "vs same threads"];

/// A row's cells, in [`HEADER`]'s order, with the same-threads one when `same_threads`.
fn cells(r: &Row, same_threads: bool) -> Vec<String> {
    let mut cells = vec![
        r.section.to_string(),
        r.case.clone(),
        size(r.bytes),
        r.params.clone(),
        format!("{:.2} {}", r.value, r.unit),
        ratio(r, &r.ceiling, true),
        ratio(r, &r.baseline, false),
    ];
    if same_threads {
        cells.push(ratio(r, &r.same_threads, false));
    }
    cells
}

/// The column names of the lines [`line`] prints, as one line.
pub fn line_header() -> String {
    HEADER.join(" | ")
}

/// One row as a line: the cells of its table row, separated by ` | ` (an empty one as `-`).
pub fn line(r: &Row) -> String {
    let cells = cells(r, r.same_threads.is_some());
    let cells: Vec<&str> = cells.iter().map(|c| if c.is_empty() { "-" } else { c.as_str() }).collect();
    cells.join(" | ")
}

/// The rows as a terminal table (with the same-threads column when a row has that ceiling).
pub fn table(rows: &[Row]) -> Table {
    let same_threads = rows.iter().any(|r| r.same_threads.is_some());
    let columns = if same_threads { HEADER.len() } else { HEADER.len() - 1 };
    let mut t = Table::new();
    t.load_preset(UTF8_FULL_CONDENSED);
    t.set_header(&HEADER[..columns]);
    for r in rows {
        t.add_row(cells(r, same_threads));
    }
    t
}

#[derive(Serialize)]
struct Report<'a> {
    device: &'a str,
    unix_time: u64,
    rows: &'a [Row],
}

/// Writes every row as JSON (beside `path`, then renamed over it: see [`partial_path`]).
pub fn write_json(path: &Path, device: &str, rows: &[Row]) -> std::io::Result<()> {
    let unix_time =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let text =
        serde_json::to_string_pretty(&Report { device, unix_time, rows }).map_err(std::io::Error::other)?;
    let partial = partial_path(path);
    std::fs::write(&partial, text)?;
    std::fs::rename(&partial, path)
}

/// A file next to `path` to write first and then rename to `path`: a run killed mid-write
/// leaves the last complete file, not a truncated one.
pub fn partial_path(path: &Path) -> std::path::PathBuf {
    let mut name = path.file_name().map(std::ffi::OsStr::to_os_string).unwrap_or_default();
    name.push(".partial");
    path.with_file_name(name)
}

#[cfg(test)]
mod tests {
    use super::{above_ceiling, line, ratio, size, table, Row};

    #[test]
    fn sizes_keep_their_fraction() {
        assert_eq!(size(512), "512 B");
        assert_eq!(size(64 << 10), "64 KiB");
        assert_eq!(size(3_640_320), "3.5 MiB");
        assert_eq!(size(1 << 30), "1 GiB");
        assert_eq!(size(3 << 29), "1.5 GiB");
    }

    #[test]
    fn figures_above_their_ceiling_are_flagged() {
        assert!(above_ceiling("GB/s", 42.6, 32.3));
        assert!(!above_ceiling("GB/s", 33.0, 32.3));
        assert!(above_ceiling("us", 10.0, 12.0));
        assert!(!above_ceiling("us", 12.0, 12.4));
        let row = |value| Row {
            section: "ring",
            case: "pageable source".into(),
            bytes: 1 << 22,
            params: String::new(),
            value,
            unit: "GB/s",
            ceiling: Some(("16-thread memcpy".into(), 32.3)),
            baseline: Some(("direct pageable copy".into(), 7.3)),
            same_threads: None,
        };
        let high = row(42.6);
        assert!(ratio(&high, &high.ceiling, true).ends_with("(above its ceiling)"));
        assert!(!ratio(&high, &high.baseline, false).contains("above"));
        let fair = row(30.0);
        assert!(!ratio(&fair, &fair.ceiling, true).contains("above"));
    }

    #[test]
    fn microsecond_ratios_read_right_both_ways() {
        let row = |value| Row {
            section: "managed",
            case: "pool alloc+free".into(),
            bytes: 1 << 20,
            params: String::new(),
            value,
            unit: "us",
            ceiling: None,
            baseline: Some(("cudaMallocManaged".into(), 10.0)),
            same_threads: None,
        };
        let faster = row(5.0);
        assert_eq!(
            ratio(&faster, &faster.baseline, false),
            "2.00x the speed of cudaMallocManaged (10.00 us)"
        );
        let slower = row(20.0);
        assert_eq!(
            ratio(&slower, &slower.baseline, false),
            "0.50x the speed of cudaMallocManaged (10.00 us)"
        );
    }

    #[test]
    fn lines_hold_the_table_cells() {
        let mut r = Row {
            section: "ring",
            case: "pageable source".into(),
            bytes: 1 << 20,
            params: "depth 2, 4 copy threads".into(),
            value: 8.0,
            unit: "GB/s",
            ceiling: Some(("host copy".into(), 10.0)),
            baseline: None,
            same_threads: None,
        };
        assert_eq!(line(&r), "ring | pageable source | 1 MiB | depth 2, 4 copy threads | 8.00 GB/s | 0.80x host copy (10.0) | -");
        r.same_threads = Some(("4-thread memcpy".into(), 16.0));
        assert!(line(&r).ends_with(" | 0.50x 4-thread memcpy (16.0)"), "{}", line(&r));
        assert_eq!(table(std::slice::from_ref(&r)).column_count(), 8);
        r.same_threads = None;
        assert_eq!(table(std::slice::from_ref(&r)).column_count(), 7);
    }
}
