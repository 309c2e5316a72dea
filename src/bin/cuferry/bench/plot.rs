//! `--plot FILE.svg`: payload bandwidth against size, one line per case and parameters, with
//! each ceiling drawn as a dashed level (a per-case ceiling, the halo's same-bytes copy, once
//! per case). Rows in microseconds are left out.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

use super::report::Row;

/// Draws the rows into an SVG file.
pub fn draw(path: &Path, title: &str, rows: &[Row]) -> Result<(), String> {
    // Rows in microseconds (allocation costs) have no place on a GB/s axis.
    let rows: Vec<&Row> = rows.iter().filter(|r| r.unit == "GB/s").collect();
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in &rows {
        series
            .entry(format!("{} {} {}", r.section, r.case, r.params))
            .or_default()
            .push((r.bytes as f64, r.value));
    }
    let mut ceilings: BTreeMap<String, f64> = BTreeMap::new();
    for r in &rows {
        if let Some((name, v)) = &r.ceiling {
            // A ceiling measured per case (the halo's same-bytes copy) is that case's own; one
            // shared by a sweep (the largest pinned copy) is named the same in every row.
            let key = if r.section == "halo" { format!("{name}, {}", r.case) } else { name.clone() };
            ceilings.insert(key, *v);
        }
    }
    let (min_x, max_x) =
        rows.iter().fold((f64::MAX, 1.0f64), |(lo, hi), r| (lo.min(r.bytes as f64), hi.max(r.bytes as f64)));
    let max_y = rows.iter().map(|r| r.value).chain(ceilings.values().copied()).fold(1.0f64, f64::max) * 1.1;
    let root = SVGBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((min_x.min(max_x)..max_x * 1.5).log_scale(), 0.0..max_y)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("bytes per item")
        .y_desc("GB/s")
        .x_label_formatter(&|b| match *b {
            b if b >= (1u64 << 20) as f64 => format!("{:.0} MiB", b / (1u64 << 20) as f64),
            b => format!("{:.0} KiB", b / 1024.0),
        })
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (name, mut points)) in series.into_iter().enumerate() {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(points.iter().copied(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
        chart
            .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    for (i, (name, level)) in ceilings.into_iter().enumerate() {
        let color = BLACK.mix(0.4 + 0.2 * (i % 3) as f64);
        chart
            .draw_series(DashedLineSeries::new(
                vec![(min_x, level), (max_x * 1.5, level)],
                8,
                6,
                color.stroke_width(1),
            ))
            .map_err(|e| e.to_string())?
            .label(format!("ceiling: {name} ({level:.1} GB/s)"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}
