//! Where the rows go as they are measured: each one reaches stdout and the JSON file as soon
//! as a section adds it, so a run stopped mid-section (a time limit's TERM, then KILL) keeps
//! every row it finished.
//!
//! Rules:
//! - [`Rows::push`] prints the row as one line (its table cells, `|`-separated; stdout is
//!   flushed at every newline), then rewrites the JSON file whole: written beside it and renamed
//!   over it, so the file is complete, valid JSON after every row whenever the process dies.
//! - A row is final when added: a section measures the ceilings its rows name before the
//!   rows (the copy section times its largest pinned copies first), so each line carries its
//!   ratios. [`Rows::end_section`] rewrites the JSON once more and returns the section's rows
//!   for its table.
//! - A JSON file that cannot be written is reported once; measuring goes on, and the run
//!   fails at its end.
//! - A progress bar made by [`Rows::progress`] is hidden while a line prints (both share the
//!   terminal) and dropped at the section's end.

use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressStyle};

use super::report::{self, Row};

/// Every row of a run, and where each goes as it is added.
pub struct Rows {
    rows: Vec<Row>,
    /// Where this section's rows start.
    section_start: usize,
    device_name: String,
    json: Option<PathBuf>,
    /// The first JSON write that failed, if one did.
    json_error: Option<String>,
    bar: Option<ProgressBar>,
}

impl Rows {
    /// No rows yet; `json`, when given, is rewritten with every row.
    pub fn new(device_name: &str, json: Option<PathBuf>) -> Self {
        Rows {
            rows: Vec::new(),
            section_start: 0,
            device_name: device_name.to_string(),
            json,
            json_error: None,
            bar: None,
        }
    }

    /// Adds a measured row: printed now and written to the JSON file now.
    pub fn push(&mut self, row: Row) {
        let text = report::line(&row);
        match &self.bar {
            Some(bar) => bar.suspend(|| println!("{text}")),
            None => println!("{text}"),
        }
        self.rows.push(row);
        self.write_json();
    }

    /// A progress bar of `len` steps named `message`, hidden while rows print; the section
    /// advances it and [`Rows::end_section`] clears it.
    pub fn progress(&mut self, len: u64, message: &'static str) -> ProgressBar {
        let bar = ProgressBar::new(len).with_message(message);
        if let Ok(style) = ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} {elapsed}") {
            bar.set_style(style);
        }
        self.bar = Some(bar.clone());
        bar
    }

    /// Starts a section: its rows are the ones added from now on.
    pub fn start_section(&mut self) {
        self.section_start = self.rows.len();
    }

    /// Ends a section: clears its progress bar, rewrites the JSON and returns the section's
    /// rows.
    pub fn end_section(&mut self) -> &[Row] {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        self.write_json();
        &self.rows[self.section_start..]
    }

    /// Every row so far.
    pub fn all(&self) -> &[Row] {
        &self.rows
    }

    /// The first JSON write that failed, if one did.
    pub fn json_error(&self) -> Option<&str> {
        self.json_error.as_deref()
    }

    /// Rewrites the JSON file with every row, reporting the first failure only.
    fn write_json(&mut self) {
        let Some(path) = &self.json else { return };
        if let Err(e) = report::write_json(path, &self.device_name, &self.rows) {
            if self.json_error.is_none() {
                eprintln!("cuferry bench: cannot write {}: {e}", path.display());
                self.json_error = Some(e.to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(value: f64) -> Row {
        Row {
            section: "ring",
            case: "pinned source".into(),
            bytes: 1 << 20,
            params: "depth 2".into(),
            value,
            unit: "GB/s",
            ceiling: None,
            baseline: None,
            same_threads: None,
        }
    }

    #[test]
    fn the_json_file_holds_every_row_after_each_push() {
        let dir = std::env::temp_dir().join(format!("cuferry-bench-rows-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bench.json");
        let mut rows = Rows::new("host", Some(path.clone()));
        rows.start_section();
        for (i, value) in [1.0, 2.0, 3.0].into_iter().enumerate() {
            rows.push(row(value));
            let text = std::fs::read_to_string(&path).unwrap();
            let json: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(json["rows"].as_array().unwrap().len(), i + 1);
            assert!(json["rows"][i].get("same_threads").is_none(), "absent, not null");
        }
        assert_eq!(rows.end_section().len(), 3);
        assert!(rows.json_error().is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_json_file_that_cannot_be_written_is_remembered() {
        let path = std::env::temp_dir().join("cuferry-no-such-dir-for-rows").join("out.json");
        let mut rows = Rows::new("host", Some(path));
        rows.push(row(1.0));
        rows.push(row(2.0));
        assert!(rows.json_error().is_some());
        assert_eq!(rows.all().len(), 2);
    }
}
