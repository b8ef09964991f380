//! Pictures of results, drawn with plotters into an RGB buffer and written as PNG (atomically),
//! with an embedded font so they render the same on any machine.

use anyhow::{anyhow, Context, Result};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use std::path::Path;
use std::sync::Once;

/// The font family name every picture uses (DejaVu Sans, embedded).
pub const FONT: &str = "sans-serif";

/// Registers the embedded font once per process.
pub fn ensure_font() {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        for style in [FontStyle::Normal, FontStyle::Bold] {
            let bytes = match style {
                FontStyle::Bold => dejavu::sans::bold(),
                _ => dejavu::sans::regular(),
            };
            // The embedded DejaVu files are valid TrueType fonts.
            let _ = register_font(FONT, style, bytes);
        }
    });
}

/// Draws into a `width × height` white canvas with `draw` and writes it to `path` as PNG.
pub fn render_png(
    path: &Path,
    (width, height): (u32, u32),
    draw: impl FnOnce(&DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>) -> Result<()>,
) -> Result<()> {
    ensure_font();
    let mut buffer = vec![255u8; (width * height * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buffer, (width, height)).into_drawing_area();
        draw(&root)?;
        root.present()
            .map_err(|e| anyhow!("cannot draw {}: {e}", path.display()))?;
    }
    let image = image::RgbImage::from_raw(width, height, buffer)
        .context("the canvas has the size it was made with")?;
    let mut png = std::io::Cursor::new(Vec::new());
    image
        .write_to(&mut png, image::ImageFormat::Png)
        .with_context(|| format!("cannot encode {}", path.display()))?;
    crate::files::write_atomic(path, png.get_ref())
}

/// A colour from white (0) to deep blue (1).
pub fn blues(v: f64) -> RGBColor {
    let v = v.clamp(0.0, 1.0);
    let mix = |from: f64, to: f64| (from + (to - from) * v).round() as u8;
    RGBColor(mix(247.0, 8.0), mix(251.0, 48.0), mix(255.0, 107.0))
}

/// The side in pixels of a cell of [`confusion_png`]'s matrix.
pub const CONFUSION_CELL: u32 = 56;
/// The top-left corner of [`confusion_png`]'s matrix: cell (true `i`, predicted `j`) starts at
/// `(x + CONFUSION_CELL·j, y + CONFUSION_CELL·i)`.
pub const CONFUSION_ORIGIN: (u32, u32) = (150, 70);

/// Writes a confusion matrix (rows = true class, columns = predicted class) as a PNG heatmap
/// with the count in each cell, shaded by the share of its row (darker = more).
pub fn confusion_png(
    path: &Path,
    title: &str,
    classes: &[String],
    counts: &[Vec<usize>],
) -> Result<()> {
    let n = classes.len();
    let cell = CONFUSION_CELL;
    let (left, top) = CONFUSION_ORIGIN;
    let size = (left + cell * n as u32 + 30, top + cell * n as u32 + 130);
    render_png(path, size, |root| {
        let err = |e: DrawingAreaErrorKind<_>| anyhow!("cannot draw the confusion matrix: {e:?}");
        root.draw(&Text::new(
            title,
            (20, 20),
            (FONT, 22).into_font().style(FontStyle::Bold),
        ))
        .map_err(err)?;
        for (i, row) in counts.iter().enumerate() {
            let total = row.iter().sum::<usize>().max(1) as f64;
            for (j, &count) in row.iter().enumerate() {
                let share = count as f64 / total;
                let (x, y) = (
                    (left + cell * j as u32) as i32,
                    (top + cell * i as u32) as i32,
                );
                let rect = [(x, y), (x + cell as i32, y + cell as i32)];
                root.draw(&Rectangle::new(rect, blues(share).filled()))
                    .map_err(err)?;
                root.draw(&Rectangle::new(rect, RGBColor(200, 200, 200)))
                    .map_err(err)?;
                let colour = if share > 0.5 { WHITE } else { BLACK };
                let text = count.to_string();
                let style = (FONT, 15).into_font().color(&colour);
                let (w, _) = root.estimate_text_size(&text, &style).map_err(err)?;
                let at = (x + (cell as i32 - w as i32) / 2, y + cell as i32 / 2 - 8);
                root.draw(&Text::new(text, at, style)).map_err(err)?;
            }
        }
        let label: TextStyle = (FONT, 15).into_font().into();
        for (i, name) in classes.iter().enumerate() {
            let y = (top + cell * i as u32 + cell / 2 - 8) as i32;
            let (w, _) = root.estimate_text_size(name, &label).map_err(err)?;
            root.draw(&Text::new(
                name.as_str(),
                (left as i32 - 8 - w as i32, y),
                label.clone(),
            ))
            .map_err(err)?;
            let x = (left + cell * i as u32 + cell / 2) as i32;
            let below = (top + cell * n as u32 + 8) as i32;
            let rotated = label.transform(FontTransform::Rotate90);
            root.draw(&Text::new(name.as_str(), (x + 8, below), rotated))
                .map_err(err)?;
        }
        let axis = (FONT, 16).into_font().style(FontStyle::Bold);
        root.draw(&Text::new(
            "true class ↓   predicted class →",
            (20, 48),
            axis,
        ))
        .map_err(err)?;
        Ok(())
    })
}

/// The colours of successive series (matplotlib's first ten).
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// One line of a [`Panel`].
#[derive(Clone, Debug)]
pub struct Series {
    /// Its legend entry.
    pub label: String,
    /// `(x, y)` points in x order.
    pub points: Vec<(f64, f64)>,
    /// Index into [`PALETTE`].
    pub colour: usize,
    /// A dense, noisy series (per-step training values): drawn thin and pale, without markers.
    pub faint: bool,
}

/// One chart: its axes' labels and its series.
#[derive(Clone, Debug)]
pub struct Panel {
    /// The x axis' label with its unit.
    pub x_label: String,
    /// The y axis' label with its unit.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
}

/// Draws `panels` (side by side, two to a row) under `title` and writes the PNG to `path`.
pub fn line_panels_png(path: &Path, title: &str, panels: &[Panel]) -> Result<()> {
    let columns = panels.len().clamp(1, 2);
    let rows = panels.len().div_ceil(2).max(1);
    let size = match panels.len() {
        1 => (1000, 620),
        _ => (700 * columns as u32, 60 + 440 * rows as u32),
    };
    render_png(path, size, |root| {
        let err = |e: String| anyhow!("cannot draw {}: {e}", path.display());
        let (top, body) = root.split_vertically(60);
        top.draw(&Text::new(
            title.to_string(),
            (20, 18),
            (FONT, 22).into_font().style(FontStyle::Bold),
        ))
        .map_err(|e| err(format!("{e:?}")))?;
        let areas = body.split_evenly((rows, columns));
        for (area, panel) in areas.iter().zip(panels) {
            draw_panel(area, panel).map_err(err)?;
        }
        Ok(())
    })
}

fn draw_panel(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    panel: &Panel,
) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<_>| format!("{e:?}");
    let points = || panel.series.iter().flat_map(|s| s.points.iter());
    let (mut x_min, mut x_max, mut y_min, mut y_max) = (
        f64::INFINITY,
        f64::NEG_INFINITY,
        f64::INFINITY,
        f64::NEG_INFINITY,
    );
    for &(x, y) in points().filter(|(x, y)| x.is_finite() && y.is_finite()) {
        (x_min, x_max) = (x_min.min(x), x_max.max(x));
        (y_min, y_max) = (y_min.min(y), y_max.max(y));
    }
    if !x_min.is_finite() {
        (x_min, x_max, y_min, y_max) = (0.0, 1.0, 0.0, 1.0);
    }
    let pad = ((y_max - y_min) * 0.05).max(1e-9);
    let mut chart = ChartBuilder::on(area)
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(75)
        .build_cartesian_2d(x_min..x_max.max(x_min + 1.0), (y_min - pad)..(y_max + pad))
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc(panel.x_label.as_str())
        .y_desc(panel.y_label.as_str())
        .label_style((FONT, 14))
        .x_label_formatter(&|v| format!("{v:.0}"))
        .draw()
        .map_err(e)?;
    for series in &panel.series {
        let colour = PALETTE[series.colour % PALETTE.len()];
        let style = if series.faint {
            colour.mix(0.35).stroke_width(1)
        } else {
            colour.stroke_width(2)
        };
        chart
            .draw_series(LineSeries::new(series.points.clone(), style))
            .map_err(e)?
            .label(series.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        if !series.faint && series.points.len() <= 60 {
            let markers = series
                .points
                .iter()
                .map(|&p| Circle::new(p, 3, colour.filled()));
            chart.draw_series(markers).map_err(e)?;
        }
    }
    // The legend goes where the lines end up not being: low when they end high.
    let ends_high = {
        let tail: Vec<f64> = points()
            .filter(|(x, _)| *x >= x_min + 0.66 * (x_max - x_min))
            .map(|&(_, y)| (y - y_min) / (y_max - y_min).max(1e-12))
            .collect();
        !tail.is_empty() && tail.iter().sum::<f64>() / tail.len() as f64 > 0.5
    };
    chart
        .configure_series_labels()
        .position(if ends_high {
            SeriesLabelPosition::LowerRight
        } else {
            SeriesLabelPosition::UpperRight
        })
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()
        .map_err(e)?;
    Ok(())
}

/// A grey image drawn above a column of [`similarity_png`].
#[derive(Clone, Debug)]
pub struct Thumbnail {
    /// Side in pixels.
    pub size: usize,
    /// `size²` grey pixels, 0 = background (drawn dark, as the datasets show them).
    pub pixels: Vec<u8>,
}

/// Writes a matrix of similarities as a PNG heatmap: one row per caption (labelled with it),
/// one column per image (its thumbnail on top), each cell shaded by its value relative to the
/// matrix's range and printed to two decimals.
pub fn similarity_png(
    path: &Path,
    title: &str,
    captions: &[String],
    images: &[Thumbnail],
    values: &[Vec<f32>],
) -> Result<()> {
    let (rows, cols) = (captions.len(), images.len());
    let cell = 46u32;
    let (left, top) = (330u32, 120u32);
    let size = (
        left + cell * cols as u32 + 30,
        top + cell * rows as u32 + 40,
    );
    let (lo, hi) = values
        .iter()
        .flatten()
        .fold((f32::MAX, f32::MIN), |(lo, hi), &v| (lo.min(v), hi.max(v)));
    let span = (hi - lo).max(1e-6);
    render_png(path, size, |root| {
        let err = |e: DrawingAreaErrorKind<_>| anyhow!("cannot draw the similarities: {e:?}");
        let bold = (FONT, 20).into_font().style(FontStyle::Bold);
        root.draw(&Text::new(title, (20, 16), bold)).map_err(err)?;
        let note = "rows: captions · columns: images · cosine similarity";
        root.draw(&Text::new(note, (20, 44), (FONT, 14).into_font()))
            .map_err(err)?;
        for (j, thumb) in images.iter().enumerate() {
            let scale = (cell as usize - 6) / thumb.size.max(1);
            let (x0, y0) = ((left + cell * j as u32 + 3) as i32, (top - cell) as i32);
            for (k, &p) in thumb.pixels.iter().enumerate() {
                let (r, c) = ((k / thumb.size) as i32, (k % thumb.size) as i32);
                let (x, y) = (x0 + c * scale as i32, y0 + r * scale as i32);
                let rect = [(x, y), (x + scale as i32, y + scale as i32)];
                root.draw(&Rectangle::new(rect, RGBColor(p, p, p).filled()))
                    .map_err(err)?;
            }
        }
        let label: TextStyle = (FONT, 13).into_font().into();
        for (i, caption) in captions.iter().enumerate() {
            let y = (top + cell * i as u32) as i32;
            let (w, _) = root.estimate_text_size(caption, &label).map_err(err)?;
            let at = (left as i32 - 8 - w as i32, y + cell as i32 / 2 - 7);
            root.draw(&Text::new(caption.as_str(), at, label.clone()))
                .map_err(err)?;
            for (j, &v) in values[i].iter().enumerate() {
                let share = f64::from((v - lo) / span);
                let x = (left + cell * j as u32) as i32;
                let rect = [(x, y), (x + cell as i32, y + cell as i32)];
                root.draw(&Rectangle::new(rect, blues(share).filled()))
                    .map_err(err)?;
                let colour = if share > 0.5 { WHITE } else { BLACK };
                let text = format!("{v:.2}");
                let style = (FONT, 11).into_font().color(&colour);
                let (w, _) = root.estimate_text_size(&text, &style).map_err(err)?;
                let at = (x + (cell as i32 - w as i32) / 2, y + cell as i32 / 2 - 6);
                root.draw(&Text::new(text, at, style)).map_err(err)?;
            }
        }
        Ok(())
    })
}

/// Twenty distinct colours (a class's colour in [`embedding_png`]): [`PALETTE`], then the
/// same hues lighter.
pub fn class_colour(class: usize) -> RGBColor {
    let RGBColor(r, g, b) = PALETTE[class % 10];
    if (class / 10).is_multiple_of(2) {
        RGBColor(r, g, b)
    } else {
        let light = |c: u8| (c as u16 + (255 - c as u16) / 2) as u8;
        RGBColor(light(r), light(g), light(b))
    }
}

/// Writes a 2-D projection of embeddings as a PNG scatter: small dots (`points`: x, y,
/// class) and large labelled diamonds (`markers`: x, y, class, label), coloured by class,
/// with a legend of `classes`.
pub fn embedding_png(
    path: &Path,
    title: &str,
    axes: (&str, &str),
    points: &[(f64, f64, usize)],
    markers: &[(f64, f64, usize, String)],
    classes: &[String],
) -> Result<()> {
    let xs = points
        .iter()
        .map(|p| p.0)
        .chain(markers.iter().map(|m| m.0));
    let ys = points
        .iter()
        .map(|p| p.1)
        .chain(markers.iter().map(|m| m.1));
    let range = |v: Vec<f64>| {
        let (lo, hi) = v
            .iter()
            .fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
        let pad = ((hi - lo) * 0.05).max(1e-3);
        (lo - pad)..(hi + pad)
    };
    let (x_range, y_range) = (range(xs.collect()), range(ys.collect()));
    render_png(path, (1100, 800), |root| {
        let err = |e: DrawingAreaErrorKind<_>| anyhow!("cannot draw the embeddings: {e:?}");
        let (plot, legend) = root.split_horizontally(860);
        let mut chart = ChartBuilder::on(&plot)
            .caption(title, (FONT, 20).into_font().style(FontStyle::Bold))
            .margin(16)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(x_range, y_range)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(axes.0)
            .y_desc(axes.1)
            .label_style((FONT, 13))
            .draw()
            .map_err(err)?;
        chart
            .draw_series(points.iter().map(|&(x, y, class)| {
                Circle::new((x, y), 2, class_colour(class).mix(0.6).filled())
            }))
            .map_err(err)?;
        for (x, y, class, label) in markers {
            // A black triangle under a smaller one in the class's colour: an outlined marker.
            let style = (FONT, 13).into_font().color(&BLACK);
            let marker = EmptyElement::at((*x, *y))
                + TriangleMarker::new((0, 0), 11, BLACK.filled())
                + TriangleMarker::new((0, 1), 7, class_colour(*class).filled())
                + Text::new(label.clone(), (11, -6), style);
            chart.draw_series(std::iter::once(marker)).map_err(err)?;
        }
        let label: TextStyle = (FONT, 13).into_font().into();
        for (i, name) in classes.iter().enumerate() {
            let y = 60 + 22 * i as i32;
            legend
                .draw(&Circle::new((14, y + 7), 6, class_colour(i).filled()))
                .map_err(err)?;
            legend
                .draw(&Text::new(name.as_str(), (28, y), label.clone()))
                .map_err(err)?;
        }
        let note = "• image  ▲ class prompt";
        legend
            .draw(&Text::new(note, (8, 30), label.clone()))
            .map_err(err)?;
        Ok(())
    })
}
