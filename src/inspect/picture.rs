//! Attention as pictures: a grid of every layer × head heatmap with token labels, and for a
//! ViT the classification token's attention over the patches laid over the image.

use super::{AttentionGroup, AttentionMaps, ImageInput};
use crate::plot::{blues, render_png, FONT};
use anyhow::{anyhow, Result};
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::path::{Path, PathBuf};

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn draw_err<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> anyhow::Error {
    anyhow!("cannot draw the attention picture: {e:?}")
}

/// Writes the pictures of `maps` and returns their paths: for a ViT one overlay grid at `path`;
/// for text one heatmap grid per attention group (`path` itself when there is one group, else
/// `STEM-GROUP.png` beside it).
pub fn write_pngs(maps: &AttentionMaps, path: &Path) -> Result<Vec<PathBuf>> {
    if let Some(image) = &maps.image {
        overlay_png(maps, &maps.groups[0], image, path)?;
        return Ok(vec![path.to_path_buf()]);
    }
    let mut written = Vec::new();
    for group in &maps.groups {
        let target = if maps.groups.len() == 1 {
            path.to_path_buf()
        } else {
            let stem = path
                .file_stem()
                .and_then(|s| s.to_str())
                .unwrap_or("attention");
            path.with_file_name(format!("{stem}-{}.png", group.name))
        };
        heatmap_grid_png(maps, group, &target)?;
        written.push(target);
    }
    Ok(written)
}

/// Geometry of one heatmap panel.
struct Panel {
    cell: u32,
    font: u32,
    /// Label every `stride`-th token (all of them when the cells are big enough).
    stride: usize,
    left: u32,
    top: u32,
}

impl Panel {
    fn new(group: &AttentionGroup, root: &Area<'_>) -> Result<Self> {
        let n = group.queries.len().max(group.keys.len()).max(1) as u32;
        let cell = (420 / n).clamp(4, 26);
        let font = (cell.saturating_sub(2)).clamp(8, 14);
        let stride = (font as usize + 1).div_ceil(cell as usize).max(1);
        let style: TextStyle = (FONT, font).into_font().into();
        let widest = group
            .queries
            .iter()
            .chain(&group.keys)
            .map(|l| root.estimate_text_size(l, &style).map(|(w, _)| w))
            .collect::<Result<Vec<u32>, _>>()
            .map_err(draw_err)?
            .into_iter()
            .max()
            .unwrap_or(0)
            .min(110);
        Ok(Self {
            cell,
            font,
            stride,
            left: widest + 6,
            top: widest + 6 + 22,
        })
    }

    fn size(&self, group: &AttentionGroup) -> (u32, u32) {
        (
            self.left + self.cell * group.keys.len() as u32 + 16,
            self.top + self.cell * group.queries.len() as u32 + 16,
        )
    }
}

/// Every layer (rows) × head (columns) of one group as labelled heatmaps.
fn heatmap_grid_png(maps: &AttentionMaps, group: &AttentionGroup, path: &Path) -> Result<()> {
    // The panel geometry depends on text sizes, which need a drawing area: measure on a tiny one.
    let mut probe = vec![255u8; 3];
    crate::plot::ensure_font();
    let panel = {
        let root = BitMapBackend::with_buffer(&mut probe, (1, 1)).into_drawing_area();
        Panel::new(group, &root)?
    };
    let (pw, ph) = panel.size(group);
    let (layers, heads) = (group.n_layers() as u32, group.n_heads() as u32);
    let header = 60u32;
    let size = (pw * heads + 20, header + ph * layers + 10);
    render_png(path, size, |root| {
        let total: usize = group.weights.iter().map(Vec::len).sum();
        let shape = if total == (layers * heads) as usize {
            format!("{layers} layers × {heads} heads")
        } else {
            format!("{layers} layers, {total} heads (pruned)")
        };
        let title = format!(
            "{}: {} attention, {shape} (rows = queries, columns = keys; each panel shaded to its own largest weight)",
            maps.model, group.name
        );
        root.draw(&Text::new(
            title,
            (10, 10),
            (FONT, 16).into_font().style(FontStyle::Bold),
        ))
        .map_err(draw_err)?;
        let subtitle = match &maps.output {
            Some(output) => format!(
                "input: {}   →   {}",
                short(&maps.input, 80),
                short(output, 60)
            ),
            None => format!("input: {}", short(&maps.input, 120)),
        };
        root.draw(&Text::new(subtitle, (10, 34), (FONT, 13).into_font()))
            .map_err(draw_err)?;
        for layer in 0..layers {
            // A pruned layer leaves its missing heads' places blank.
            for head in 0..group.heads_in(layer as usize) as u32 {
                let x = 10 + pw * head;
                let y = header + ph * layer;
                let area = root.clone().shrink((x, y), (pw, ph));
                let weights = &group.weights[layer as usize][head as usize];
                draw_panel(
                    &area,
                    &panel,
                    group,
                    weights,
                    &format!("layer {layer}, head {head}"),
                )?;
            }
        }
        Ok(())
    })
}

fn short(text: &str, max: usize) -> String {
    let chars: Vec<char> = text.chars().collect();
    if chars.len() <= max {
        text.replace('\n', "↵")
    } else {
        chars[..max - 1]
            .iter()
            .collect::<String>()
            .replace('\n', "↵")
            + "…"
    }
}

fn draw_panel(
    area: &Area<'_>,
    panel: &Panel,
    group: &AttentionGroup,
    weights: &[Vec<f32>],
    title: &str,
) -> Result<()> {
    let peak = weights
        .iter()
        .flatten()
        .fold(0.0f32, |m, &w| m.max(w))
        .max(1e-12);
    area.draw(&Text::new(
        title.to_string(),
        (panel.left as i32, 2),
        (FONT, 13).into_font().style(FontStyle::Bold),
    ))
    .map_err(draw_err)?;
    let c = panel.cell as i32;
    let (left, top) = (panel.left as i32, panel.top as i32);
    for (i, row) in weights.iter().enumerate() {
        for (j, &w) in row.iter().enumerate() {
            let (x, y) = (left + c * j as i32, top + c * i as i32);
            let colour = blues((w / peak) as f64);
            area.draw(&Rectangle::new([(x, y), (x + c, y + c)], colour.filled()))
                .map_err(draw_err)?;
        }
    }
    let frame = [
        (left, top),
        (
            left + c * group.keys.len() as i32,
            top + c * group.queries.len() as i32,
        ),
    ];
    area.draw(&Rectangle::new(frame, RGBColor(160, 160, 160)))
        .map_err(draw_err)?;
    let style: TextStyle = (FONT, panel.font).into_font().into();
    for (i, label) in group.queries.iter().enumerate().step_by(panel.stride) {
        let (w, h) = area.estimate_text_size(label, &style).map_err(draw_err)?;
        let y = top + c * i as i32 + (c - h as i32) / 2;
        area.draw(&Text::new(
            label.as_str(),
            (left - 4 - w as i32, y),
            style.clone(),
        ))
        .map_err(draw_err)?;
    }
    let rotated = style.transform(FontTransform::Rotate270);
    for (j, label) in group.keys.iter().enumerate().step_by(panel.stride) {
        let (_, h) = area.estimate_text_size(label, &style).map_err(draw_err)?;
        let x = left + c * j as i32 + (c - h as i32) / 2;
        area.draw(&Text::new(label.as_str(), (x, top - 4), rotated.clone()))
            .map_err(draw_err)?;
    }
    Ok(())
}

/// A colour from dark blue (0) through cyan and yellow to red (1).
fn heat(v: f64) -> (f64, f64, f64) {
    let v = v.clamp(0.0, 1.0);
    let r = (1.5 - (4.0 * v - 3.0).abs()).clamp(0.0, 1.0);
    let g = (1.5 - (4.0 * v - 2.0).abs()).clamp(0.0, 1.0);
    let b = (1.5 - (4.0 * v - 1.0).abs()).clamp(0.0, 1.0);
    (r, g, b)
}

/// The classification token's attention over the patches, per layer (rows) and head (columns,
/// then the mean over heads), laid over the input image.
fn overlay_png(
    maps: &AttentionMaps,
    group: &AttentionGroup,
    image: &ImageInput,
    path: &Path,
) -> Result<()> {
    let scale = 4u32;
    let side = image.size as u32 * scale;
    let grid = image.size / image.patch_size;
    let (layers, heads) = (group.n_layers() as u32, group.n_heads() as u32);
    let (pw, ph) = (side + 16, side + 26);
    let (header, left) = (62u32, 70u32);
    let size = (left + pw * (heads + 1) + 10, header + ph * layers + 10);
    render_png(path, size, |root| {
        let title = format!(
            "{}: attention of the classification token over the patches (layers ↓, heads →, then their mean)",
            maps.model
        );
        root.draw(&Text::new(
            title,
            (10, 10),
            (FONT, 16).into_font().style(FontStyle::Bold),
        ))
        .map_err(draw_err)?;
        let subtitle = format!(
            "{}   →   {}",
            maps.input,
            maps.output.as_deref().unwrap_or("")
        );
        root.draw(&Text::new(subtitle, (10, 34), (FONT, 13).into_font()))
            .map_err(draw_err)?;
        for layer in 0..layers as usize {
            let y0 = header + ph * layer as u32;
            root.draw(&Text::new(
                format!("layer {layer}"),
                (10, (y0 + side / 2) as i32),
                (FONT, 13).into_font(),
            ))
            .map_err(draw_err)?;
            let per_head: Vec<Vec<f32>> = group.weights[layer]
                .iter()
                .map(|head| head[0][1..].to_vec())
                .collect();
            let mean: Vec<f32> = (0..grid * grid)
                .map(|p| per_head.iter().map(|w| w[p]).sum::<f32>() / per_head.len() as f32)
                .collect();
            // The mean stays in the last column when a pruned layer has fewer heads.
            let columns = (0..per_head.len()).chain([heads as usize]);
            for (column, patches) in columns.zip(per_head.iter().chain([&mean])) {
                let x0 = left + pw * column as u32;
                let label = if column < per_head.len() {
                    format!("head {column}")
                } else {
                    "mean".to_string()
                };
                root.draw(&Text::new(
                    label,
                    (x0 as i32, y0 as i32),
                    (FONT, 12).into_font(),
                ))
                .map_err(draw_err)?;
                let peak = patches.iter().fold(0.0f32, |m, &w| m.max(w)).max(1e-12);
                for py in 0..image.size {
                    for px in 0..image.size {
                        let grey = image.pixels[py * image.size + px] as f64 / 255.0;
                        let patch = (py / image.patch_size) * grid + px / image.patch_size;
                        let v = (patches[patch] / peak) as f64;
                        let (r, g, b) = heat(v);
                        let alpha = 0.25 + 0.5 * v;
                        let mix =
                            |c: f64| (255.0 * ((1.0 - alpha) * grey + alpha * c)).round() as u8;
                        let colour = RGBColor(mix(r), mix(g), mix(b));
                        let (x, y) = (
                            (x0 + px as u32 * scale) as i32,
                            (y0 + 16 + py as u32 * scale) as i32,
                        );
                        root.draw(&Rectangle::new(
                            [(x, y), (x + scale as i32, y + scale as i32)],
                            colour.filled(),
                        ))
                        .map_err(draw_err)?;
                    }
                }
            }
        }
        Ok(())
    })
}
