//! The interactive page: one self-contained HTML file (inline script and style, no network)
//! with a head view (lines from each query to the keys it attends to, opacity = weight, per
//! layer and chosen heads) and a model view (every layer × head as a thumbnail), and for a
//! translator a choice of encoder, decoder or cross-attention.

use super::AttentionMaps;
use anyhow::Result;

const TEMPLATE: &str = include_str!("attention.html");

/// The page for `maps`.
pub fn page(maps: &AttentionMaps) -> Result<String> {
    // Inside <script>, "</script>" or "<!--" in a token would end or confuse the element;
    // `\u003c` is the same character to the JSON parser.
    let data = maps.to_json()?.replace('<', "\\u003c");
    let title = maps
        .model
        .replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;");
    Ok(TEMPLATE
        .replacen("__TITLE__", &title, 1)
        .replacen("__DATA__", &data, 1))
}
