//! The benches' charts: one [`chart`] draws every bench's SVG from its [`Panel`]s of grouped
//! bars; [`traffic_panels`] are the traffic benches' three (TCP_CRR, TCP_RR, iperf3).
use std::path::Path;

use anyhow::Result;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::report::{fmt_0, fmt_1, fmt_ms, median, Traffic};

/// The colours of the charts (matplotlib's tab10 and its light shades).
pub const BLUE: RGBColor = RGBColor(0x1f, 0x77, 0xb4);
pub const ORANGE: RGBColor = RGBColor(0xff, 0x7f, 0x0e);
pub const GREEN: RGBColor = RGBColor(0x2c, 0xa0, 0x2c);
pub const RED: RGBColor = RGBColor(0xd6, 0x27, 0x28);
pub const PURPLE: RGBColor = RGBColor(0x94, 0x67, 0xbd);
pub const GREY: RGBColor = RGBColor(0x7f, 0x7f, 0x7f);
pub const LIGHT_GREY: RGBColor = RGBColor(0xc7, 0xc7, 0xc7);
pub const CYAN: RGBColor = RGBColor(0x17, 0xbe, 0xcf);
pub const LIGHT_BLUE: RGBColor = RGBColor(0xae, 0xc7, 0xe8);
pub const PALE_BLUE: RGBColor = RGBColor(0x9e, 0xc9, 0xe2);
pub const LIGHT_GREEN: RGBColor = RGBColor(0x98, 0xdf, 0x8a);

/// One series of a bar chart: name, colour, one value per group (None: no bar).
pub type Series<'a> = (&'a str, RGBColor, Vec<Option<f64>>);

/// The label over a bar: `(series, group, value)`.
pub type Label<'a> = Box<dyn Fn(usize, usize, f64) -> String + 'a>;

/// One panel: grouped bars, one group per label and one bar per series, a label on top of
/// each bar, `unit` on the y axis, and an optional dashed reference line.
pub struct Panel<'a> {
    pub title: String,
    pub unit: &'a str,
    pub groups: Vec<String>,
    pub series: Vec<Series<'a>>,
    pub label: Label<'a>,
    pub reference: Option<(&'a str, f64)>,
}

impl<'a> Panel<'a> {
    pub fn new(
        title: impl Into<String>,
        unit: &'a str,
        groups: &[&str],
        series: Vec<Series<'a>>,
        label: impl Fn(usize, usize, f64) -> String + 'a,
    ) -> Self {
        Self {
            title: title.into(),
            unit,
            groups: groups.iter().map(|g| g.to_string()).collect(),
            series,
            label: Box::new(label),
            reference: None,
        }
    }

    /// With a dashed line at `value`, named `name` in the legend.
    pub fn reference(mut self, name: &'a str, value: f64) -> Self {
        self.reference = Some((name, value));
        self
    }
}

/// Where the panels go.
pub enum Layout {
    /// Rows × columns of equal size, filled row by row.
    Grid(usize, usize),
    /// Side by side, each but the last this many pixels wide; the last takes the rest.
    Columns(&'static [u32]),
}

/// A bench's chart: a white SVG of `size` pixels at `path`, titled, its panels laid out.
pub fn chart(
    path: &Path,
    size: (u32, u32),
    title: &str,
    layout: Layout,
    panels: &[Panel],
) -> Result<()> {
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 18))?;
    let areas = match layout {
        Layout::Grid(1, 1) => vec![root.clone()],
        Layout::Grid(rows, cols) => root.split_evenly((rows, cols)),
        Layout::Columns(widths) => {
            let mut areas = Vec::new();
            let mut rest = root.clone();
            for &w in widths {
                let (left, right) = rest.split_horizontally(w);
                areas.push(left);
                rest = right;
            }
            areas.push(rest);
            areas
        }
    };
    anyhow::ensure!(
        panels.len() <= areas.len(),
        "{} panels for {} places",
        panels.len(),
        areas.len()
    );
    for (area, p) in areas.iter().zip(panels) {
        draw(area, p)?;
    }
    root.present()?;
    Ok(())
}

/// A traffic bench's chart: [`traffic_panels`] side by side (title: [`traffic_title`]).
pub fn traffic_chart(
    path: &Path,
    size: (u32, u32),
    title: &str,
    variants: &[(&str, RGBColor, Option<&Traffic>)],
) -> Result<()> {
    chart(
        path,
        size,
        title,
        Layout::Grid(1, 3),
        &traffic_panels("TCP_CRR", variants),
    )
}

/// The title of a traffic bench's chart.
pub fn traffic_title(what: &str, reps: usize, secs: u64, date: &str) -> String {
    format!("{what}, medians of {reps} reps × {secs} s ({date})")
}

/// The traffic benches' three panels: connections/s (TCP_CRR, one group named `crr_group`),
/// the TCP_RR round trip (p50, p99) and iperf3 throughput, with one series per variant (label,
/// colour, samples; no samples: no bars).
pub fn traffic_panels<'a>(
    crr_group: &str,
    variants: &[(&'a str, RGBColor, Option<&Traffic>)],
) -> Vec<Panel<'a>> {
    let series = |f: &dyn Fn(&Traffic) -> Vec<f64>| -> Vec<Series<'a>> {
        variants
            .iter()
            .map(|&(label, color, samples)| {
                let values = match samples {
                    Some(s) => f(s).into_iter().map(Some).collect(),
                    None => f(&Traffic::default()).iter().map(|_| None).collect(),
                };
                (label, color, values)
            })
            .collect()
    };
    vec![
        Panel::new(
            "connections/s (TCP_CRR), higher is better",
            "conn/s",
            &[crr_group],
            series(&|s| vec![median(&s.crr)]),
            |_, _, v| fmt_0(v),
        ),
        Panel::new(
            "TCP_RR round trip (µs), lower is better",
            "µs",
            &["p50", "p99"],
            series(&|s| vec![median(&s.rr_p50), median(&s.rr_p99)]),
            |_, _, v| fmt_1(v),
        ),
        Panel::new(
            "throughput (iperf3 cubic), higher is better",
            "Gbit/s",
            &["1 stream"],
            series(&|s| vec![median(&s.gbps)]),
            |_, _, v| fmt_1(v),
        ),
    ]
}

/// Draws one panel in `area`.
fn draw<DB: DrawingBackend>(area: &DrawingArea<DB, Shift>, p: &Panel) -> Result<()>
where
    DB::ErrorType: 'static,
{
    let err = |what: &'static str| move |e| anyhow::anyhow!("chart {what}: {e:?}");
    let (groups, series, unit) = (&p.groups, &p.series, p.unit);
    let n = groups.len();
    let ymax = series
        .iter()
        .flat_map(|s| s.2.iter().flatten())
        .copied()
        .chain(p.reference.map(|r| r.1))
        .filter(|v| v.is_finite())
        .fold(1.0f64, f64::max)
        * 1.4;
    let mut chart = ChartBuilder::on(area)
        .caption(&p.title, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(48)
        .build_cartesian_2d(-0.5f64..(n as f64 - 0.5), 0f64..ymax)
        .map_err(err("axes"))?;
    let group_label = |x: &f64| {
        let i = x.round();
        if (x - i).abs() < 1e-6 && i >= 0.0 && (i as usize) < n {
            groups[i as usize].to_string()
        } else {
            String::new()
        }
    };
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&group_label)
        .y_label_formatter(&|v: &f64| format!("{v:.0}"))
        .y_desc(unit)
        .draw()
        .map_err(err("mesh"))?;
    let width = 0.8 / series.len() as f64;
    for (si, (name, color, values)) in series.iter().enumerate() {
        let color = *color;
        let bars: Vec<(usize, f64, f64)> = values
            .iter()
            .enumerate()
            .filter_map(|(g, v)| {
                v.filter(|v| v.is_finite())
                    .map(|v| (g, g as f64 - 0.4 + si as f64 * width, v))
            })
            .collect();
        chart
            .draw_series(bars.iter().map(|&(_, x0, v)| {
                Rectangle::new([(x0, 0.0), (x0 + width * 0.9, v)], color.filled())
            }))
            .map_err(err("bars"))?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
        let style = TextStyle::from(("sans-serif", 11).into_font())
            .color(&BLACK)
            .pos(Pos::new(HPos::Center, VPos::Bottom));
        chart
            .draw_series(bars.iter().map(|&(g, x0, v)| {
                Text::new((p.label)(si, g, v), (x0 + width * 0.45, v), style.clone())
            }))
            .map_err(err("labels"))?;
    }
    if let Some((name, y)) = p.reference.filter(|r| r.1.is_finite()) {
        let line = BLACK.stroke_width(1);
        // A dashed horizontal line across the panel.
        let step = n as f64 / 60.0;
        let dashes = (0..30).map(|i| {
            let a = -0.5 + 2.0 * i as f64 * step;
            PathElement::new(vec![(a, y), (a + step, y)], line)
        });
        chart
            .draw_series(dashes)
            .map_err(err("line"))?
            .label(format!("{name} ({} {unit})", fmt_ms(y)))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 10, y)], line));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err("legend"))?;
    Ok(())
}
