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

/// Writes a confusion matrix (rows = true class, columns = predicted class) as a PNG heatmap
/// with the count in each cell, shaded by the share of its row.
pub fn confusion_png(
    path: &Path,
    title: &str,
    classes: &[String],
    counts: &[Vec<usize>],
) -> Result<()> {
    let n = classes.len();
    let cell = 56u32;
    let (left, top) = (150u32, 70u32);
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
