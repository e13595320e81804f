//! PNG line charts with plotters (bitmap backend, text through ab_glyph with
//! a TrueType font found at run time, e.g. Debian's fonts-dejavu-core).

use std::path::Path;
use std::sync::OnceLock;

use plotters::prelude::*;

use super::BenchError;

/// Fonts tried in order (after `$CORRAL_BENCH_FONT`).
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
];

/// Registers a font for plotters' "sans-serif" family once; false (and a
/// warning on stderr) when none was found: the plots are drawn without text.
pub fn fonts() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        let env = std::env::var("CORRAL_BENCH_FONT").ok();
        for p in env
            .iter()
            .map(String::as_str)
            .chain(FONT_PATHS.iter().copied())
        {
            if let Ok(bytes) = std::fs::read(p) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return true;
                }
            }
        }
        eprintln!(
            "corral bench: no TrueType font found (install fonts-dejavu-core or set \
             CORRAL_BENCH_FONT): the plots will have no text"
        );
        false
    })
}

/// One line of a chart.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Points.
    pub points: Vec<(f64, f64)>,
    /// Draw a marker at every point.
    pub markers: bool,
    /// Colour (default: the palette by position).
    pub color: Option<RGBColor>,
}

impl Series {
    /// A line.
    pub fn line(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            name: name.into(),
            points,
            markers: false,
            color: None,
        }
    }

    /// A line with markers.
    pub fn marked(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Self {
            markers: true,
            ..Self::line(name, points)
        }
    }

    /// The same in a fixed colour.
    pub fn colored(mut self, c: RGBColor) -> Self {
        self.color = Some(c);
        self
    }
}

/// One chart of a figure.
#[derive(Debug, Clone)]
pub struct Panel {
    /// Caption.
    pub title: String,
    /// X axis description.
    pub x_label: String,
    /// Y axis description.
    pub y_label: String,
    /// Lines.
    pub series: Vec<Series>,
    /// Y range starts at 0.
    pub y_from_zero: bool,
    /// X range starts at 0.
    pub x_from_zero: bool,
    /// X values are whole numbers (runs): label only those.
    pub x_integer: bool,
    /// Legend in the upper left corner (else upper right).
    pub legend_left: bool,
}

impl Panel {
    /// A panel with both ranges from zero, legend upper right.
    pub fn new(
        title: impl Into<String>,
        x_label: impl Into<String>,
        y_label: impl Into<String>,
        series: Vec<Series>,
    ) -> Self {
        Self {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            series,
            y_from_zero: true,
            x_from_zero: true,
            x_integer: false,
            legend_left: false,
        }
    }
}

const PALETTE: [RGBColor; 6] = [
    RGBColor(0xd6, 0x27, 0x28),
    RGBColor(0x1f, 0x77, 0xb4),
    RGBColor(0x2c, 0xa0, 0x2c),
    RGBColor(0x94, 0x67, 0xbd),
    RGBColor(0xff, 0x7f, 0x0e),
    RGBColor(0x8c, 0x56, 0x4b),
];

fn pe(path: &Path) -> impl Fn(&dyn std::fmt::Display) -> BenchError + '_ {
    move |e| BenchError(format!("drawing {}: {e}", path.display()))
}

fn bounds(p: &Panel) -> (f64, f64, f64, f64) {
    let pts = p.series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1, mut y0, mut y1) = (
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::INFINITY,
        f64::NEG_INFINITY,
    );
    for &(x, y) in pts {
        if x.is_finite() && y.is_finite() {
            x0 = x0.min(x);
            x1 = x1.max(x);
            y0 = y0.min(y);
            y1 = y1.max(y);
        }
    }
    if !x0.is_finite() {
        return (0.0, 1.0, 0.0, 1.0);
    }
    if p.y_from_zero {
        y0 = y0.min(0.0);
    }
    if p.x_from_zero {
        x0 = x0.min(0.0);
    }
    if p.x_integer {
        x0 -= 0.25;
        x1 += 0.25;
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    if y1 <= y0 {
        y1 = y0 + 1.0;
    }
    // Headroom for the legend.
    let h = (y1 - y0) * 0.30;
    (x0, x1, y0, y1 + h)
}

fn int_label(v: &f64) -> String {
    if (v - v.round()).abs() < 1e-6 {
        format!("{v:.0}")
    } else {
        String::new()
    }
}

/// Draws `panels` in a grid of `cols` columns under `title` into a PNG.
pub fn draw(path: &Path, title: &str, panels: &[Panel], cols: usize) -> Result<(), BenchError> {
    let text = fonts();
    let cols = cols.max(1);
    let rows = panels.len().div_ceil(cols).max(1);
    let size = (
        620 * cols as u32,
        400 * rows as u32 + if text { 40 } else { 0 },
    );
    let root = BitMapBackend::new(path, size).into_drawing_area();
    let e = pe(path);
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let body = if text {
        root.titled(title, ("sans-serif", 26)).map_err(|x| e(&x))?
    } else {
        root.clone()
    };
    let areas = body.split_evenly((rows, cols));
    for (p, area) in panels.iter().zip(areas.iter()) {
        let (x0, x1, y0, y1) = bounds(p);
        let mut b = ChartBuilder::on(area);
        b.margin(14)
            .x_label_area_size(if text { 42 } else { 4 })
            .y_label_area_size(if text { 64 } else { 4 });
        if text {
            b.caption(&p.title, ("sans-serif", 19));
        }
        let mut chart = b.build_cartesian_2d(x0..x1, y0..y1).map_err(|x| e(&x))?;
        {
            let mut mesh = chart.configure_mesh();
            mesh.light_line_style(WHITE.mix(0.0));
            if p.x_integer {
                mesh.x_labels(((x1 - x0).round() as usize + 1).min(20))
                    .x_label_formatter(&int_label);
            }
            if x1 - x0 >= 20.0 {
                mesh.x_label_formatter(&int_label);
            }
            if y1 - y0 >= 20.0 {
                mesh.y_label_formatter(&int_label);
            }
            if text {
                mesh.x_desc(p.x_label.as_str())
                    .y_desc(p.y_label.as_str())
                    .label_style(("sans-serif", 14));
            } else {
                mesh.x_labels(0).y_labels(0);
            }
            mesh.draw().map_err(|x| e(&x))?;
        }
        for (i, s) in p.series.iter().enumerate() {
            let color = s.color.unwrap_or(PALETTE[i % PALETTE.len()]);
            let ann = chart
                .draw_series(LineSeries::new(
                    s.points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(|x| e(&x))?;
            if text && !s.name.is_empty() {
                ann.label(s.name.as_str()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(3))
                });
            }
            if s.markers {
                chart
                    .draw_series(
                        s.points
                            .iter()
                            .map(|&(x, y)| Circle::new((x, y), 4, color.filled())),
                    )
                    .map_err(|x| e(&x))?;
            }
        }
        if text && p.series.iter().any(|s| !s.name.is_empty()) {
            chart
                .configure_series_labels()
                .position(if p.legend_left {
                    SeriesLabelPosition::UpperLeft
                } else {
                    SeriesLabelPosition::UpperRight
                })
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK.mix(0.4))
                .label_font(("sans-serif", 14))
                .draw()
                .map_err(|x| e(&x))?;
        }
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}
