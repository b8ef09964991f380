//! One head's attention as a heatmap in the terminal: rows are queries, columns are keys, both
//! labelled with their tokens; 24-bit colour where the terminal has it, shade characters
//! otherwise.

use super::AttentionGroup;
use crate::plot::blues;
use anyhow::Result;
use std::fmt::Write;

/// Shades from no weight to all of it, for terminals without colour.
const SHADES: [char; 6] = [' ', '·', '░', '▒', '▓', '█'];
/// The longest token label printed (longer ones end in `…`).
const LABEL_CHARS: usize = 10;

/// Whether stdout gets colour: a terminal, and no `NO_COLOR` in the environment.
pub fn colour_wanted() -> bool {
    use std::io::IsTerminal;
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none()
}

fn clip(label: &str) -> Vec<char> {
    let chars: Vec<char> = label.chars().collect();
    if chars.len() <= LABEL_CHARS {
        chars
    } else {
        chars[..LABEL_CHARS - 1]
            .iter()
            .copied()
            .chain(['…'])
            .collect()
    }
}

/// The heatmap of head `head` in layer `layer`, with each query's three strongest keys below.
/// Weights are scaled to the head's largest so that faint structure shows; the legend says so.
pub fn heatmap(group: &AttentionGroup, layer: usize, head: usize, colour: bool) -> Result<String> {
    let weights = group.head(layer, head)?;
    let peak = weights
        .iter()
        .flatten()
        .fold(0.0f32, |m, &w| m.max(w))
        .max(1e-12);
    let row_labels: Vec<Vec<char>> = group.queries.iter().map(|l| clip(l)).collect();
    let col_labels: Vec<Vec<char>> = group.keys.iter().map(|l| clip(l)).collect();
    let margin = row_labels.iter().map(Vec::len).max().unwrap_or(0) + 1;
    let mut out = String::new();
    writeln!(
        out,
        "{} attention, layer {layer}, head {head}: rows = queries, columns = keys; {} = weight {:.3} (the head's largest)",
        group.name,
        if colour { "darkest" } else { "█" },
        peak
    )?;
    // Column labels, written downwards, one character per line.
    let depth = col_labels.iter().map(Vec::len).max().unwrap_or(0);
    for line in 0..depth {
        out.push_str(&" ".repeat(margin));
        for label in &col_labels {
            let c = label.get(line).copied().unwrap_or(' ');
            write!(out, "{c} ")?;
        }
        out.push('\n');
    }
    for (label, row) in row_labels.iter().zip(weights) {
        let text: String = label.iter().collect();
        write!(out, "{:>width$} ", text, width = margin - 1)?;
        for &w in row {
            let v = (w / peak).clamp(0.0, 1.0);
            if colour {
                let c = blues(v as f64);
                write!(out, "\x1b[48;2;{};{};{}m  ", c.0, c.1, c.2)?;
            } else {
                let shade = SHADES[((v * (SHADES.len() - 1) as f32).round()) as usize];
                write!(out, "{shade}{shade}")?;
            }
        }
        if colour {
            out.push_str("\x1b[0m");
        }
        out.push('\n');
    }
    writeln!(out, "\nstrongest keys of each query:")?;
    for (query, row) in group.queries.iter().zip(weights) {
        let top = super::strongest_keys(row, &group.keys);
        writeln!(out, "  {query:>width$} → {top}", width = margin - 1)?;
    }
    Ok(out)
}
