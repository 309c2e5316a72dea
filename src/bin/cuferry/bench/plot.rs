//! `--plot FILE.svg`: payload bandwidth against size, one line per case and parameters, with
//! each ceiling drawn as a dashed level (a per-case ceiling, the halo's same-bytes copy, once
//! per case). Rows in microseconds are left out.

use std::collections::BTreeMap;
use std::path::Path;

use plotters::prelude::*;

use super::report::{size, Row};

/// The dashed levels, by label. A ceiling measured per case (the halo's same-bytes copy) is
/// that case's own. Otherwise a ceiling name with one value (the largest pinned copy, shared by
/// a sweep) is one level; a name measured anew per row (the ring's memcpy into as many bytes
/// as each slot size and depth) is one level per distinct value, labelled by its first row.
fn ceiling_levels(rows: &[&Row]) -> BTreeMap<String, f64> {
    let mut levels = BTreeMap::new();
    let mut by_name: BTreeMap<&str, Vec<(f64, &Row)>> = BTreeMap::new();
    for r in rows {
        if let Some((name, v)) = &r.ceiling {
            if r.section == "halo" {
                levels.insert(format!("{name}, {}", r.case), *v);
                continue;
            }
            let values = by_name.entry(name).or_default();
            if !values.iter().any(|(seen, _)| seen == v) {
                values.push((*v, r));
            }
        }
    }
    for (name, values) in by_name {
        for &(v, r) in &values {
            let label = if values.len() == 1 {
                name.to_string()
            } else {
                format!("{name}, {} {} ({})", r.case, size(r.bytes), r.params)
            };
            levels.insert(label, v);
        }
    }
    levels
}

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
    let ceilings = ceiling_levels(&rows);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn row(section: &'static str, case: &str, bytes: usize, ceiling: (&str, f64)) -> Row {
        Row {
            section,
            case: case.into(),
            bytes,
            params: "depth 4".into(),
            value: 20.0,
            unit: "GB/s",
            ceiling: Some((ceiling.0.into(), ceiling.1)),
            baseline: None,
            same_threads: None,
        }
    }

    /// A ceiling name measured anew per row keeps every value; one shared by a sweep is drawn
    /// once; the halo's are per case.
    #[test]
    fn every_distinct_ceiling_is_drawn() {
        let rows = [
            row("ring", "pageable source", 1 << 20, ("memcpy into the ring", 30.0)),
            row("ring", "pageable source", 4 << 20, ("memcpy into the ring", 40.0)),
            row("ring", "pinned source", 1 << 20, ("pinned copy", 50.0)),
            row("ring", "pinned source", 4 << 20, ("pinned copy", 50.0)),
            row("halo", "10 arrays", 1 << 20, ("D2D same bytes", 60.0)),
            row("halo", "4 arrays", 1 << 20, ("D2D same bytes", 60.0)),
        ];
        let refs: Vec<&Row> = rows.iter().collect();
        let levels = ceiling_levels(&refs);
        let mut values: Vec<f64> = levels.values().copied().collect();
        values.sort_by(f64::total_cmp);
        assert_eq!(values, [30.0, 40.0, 50.0, 60.0, 60.0], "{levels:?}");
        assert_eq!(levels.get("pinned copy"), Some(&50.0));
        assert_eq!(levels.get("memcpy into the ring, pageable source 4 MiB (depth 4)"), Some(&40.0));
        assert_eq!(levels.get("D2D same bytes, 4 arrays"), Some(&60.0));
    }
}
