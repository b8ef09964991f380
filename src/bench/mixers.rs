//! `bench mixers`: what each token mixer costs as the sequence grows — forward and
//! forward+backward time (median of several runs) and the peak heap memory of a training pass,
//! for one causal self-attention layer (projections included) from 128 tokens up to 16k or
//! until the next length would not fit. Writes a CSV and a log-log PNG, and prints each
//! variant's growth exponent and the length where it overtakes full attention.

use super::median;
use crate::kernels::{LabAutodiff, LabBackend};
use crate::memory::{peak_since, reset_peak};
use crate::nn::{AttentionMask, Hyena, Mixer, MultiHeadAttention, MultiHeadAttentionConfig};
use crate::plot::{render_png, FONT};
use anyhow::{anyhow, Result};
use burn::nn::Initializer;
use burn::prelude::*;
use burn::tensor::Distribution;
use plotters::prelude::*;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

/// What to measure.
#[derive(Clone, Debug)]
pub struct MixerPlan {
    /// Sequence lengths, increasing.
    pub lengths: Vec<usize>,
    /// Layer width and heads.
    pub d_model: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// Sequences per batch.
    pub batch: usize,
    /// Timed runs per point (after one untimed warm-up).
    pub runs: usize,
    /// A mixer stops at the first length whose warm-up pass took longer than this (seconds).
    pub budget_s: f64,
    /// A mixer stops before a length its memory growth predicts to need more than this (bytes).
    pub memory_limit: usize,
}

/// One mixer at one length.
#[derive(Clone, Debug)]
pub struct Point {
    /// Mixer name.
    pub mixer: String,
    /// Sequence length.
    pub length: usize,
    /// Median forward time, seconds.
    pub forward_s: f64,
    /// Median forward + backward time, seconds.
    pub train_s: f64,
    /// Peak heap bytes of a forward + backward pass (CPU backends, counting allocator).
    pub peak_bytes: Option<usize>,
}

/// One causal self-attention layer of a given mixer.
enum Layer<B: LabBackend> {
    Attention(MultiHeadAttention<B>),
    Hyena(Hyena<B>),
}

impl<B: LabBackend> Layer<B> {
    fn new(mixer: &Mixer, plan: &MixerPlan, max_len: usize, device: &B::Device) -> Self {
        match mixer {
            Mixer::Hyena(config) => Layer::Hyena(config.init(
                plan.d_model,
                max_len,
                Initializer::Normal {
                    mean: 0.0,
                    std: 0.02,
                },
                device,
            )),
            mixer => Layer::Attention(
                MultiHeadAttentionConfig::new(plan.d_model, plan.n_heads)
                    .with_mixer(mixer.clone())
                    .init(device),
            ),
        }
    }

    /// `[b, t, d]` → `[b, t, d]`, causally.
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match self {
            Layer::Attention(attention) => {
                let mask = AttentionMask::causal(x.dims()[1], &x.device());
                attention.forward_self(x, Some(&mask)).context
            }
            Layer::Hyena(hyena) => hyena.forward(x),
        }
    }
}

fn sync<B: LabBackend>(device: &B::Device) -> Result<()> {
    B::sync(device).map_err(|e| anyhow!("the backend failed: {e:?}"))
}

/// Seconds of one forward pass without autodiff.
fn time_forward<B: LabBackend>(
    layer: &Layer<B>,
    x: &Tensor<B, 3>,
    device: &B::Device,
) -> Result<f64> {
    let began = Instant::now();
    let out = layer.forward(x.clone());
    sync::<B>(device)?;
    drop(out);
    Ok(began.elapsed().as_secs_f64())
}

/// Seconds and peak heap bytes of one forward + backward pass.
fn time_train<B: LabAutodiff>(
    layer: &Layer<B>,
    x: &Tensor<B, 3>,
    device: &B::Device,
) -> Result<(f64, Option<usize>)> {
    let base = reset_peak();
    let began = Instant::now();
    let x = x.clone().require_grad();
    let grads = layer.forward(x.clone()).sum().backward();
    sync::<B>(device)?;
    let seconds = began.elapsed().as_secs_f64();
    drop(grads);
    Ok((seconds, peak_since(base)))
}

/// Measures every mixer in `mixers` at every length of `plan` (stopping a mixer early as the
/// plan says), calling `progress` after each point.
pub fn bench_mixers<B: LabAutodiff>(
    mixers: &[Mixer],
    plan: &MixerPlan,
    device: &B::Device,
    mut progress: impl FnMut(&Point),
) -> Result<Vec<Point>> {
    let mut points = Vec::new();
    for mixer in mixers {
        let mut mine: Vec<Point> = Vec::new();
        for &length in &plan.lengths {
            if let [.., a, b] = &mine[..] {
                if let (Some(pa), Some(pb)) = (a.peak_bytes, b.peak_bytes) {
                    // Extrapolate the growth of the last two points: peak ∝ lengthᵖ.
                    let p = (pb.max(1) as f64 / pa.max(1) as f64).ln()
                        / (b.length as f64 / a.length as f64).ln();
                    let predicted = pb as f64 * (length as f64 / b.length as f64).powf(p);
                    if predicted > plan.memory_limit as f64 {
                        break;
                    }
                }
            }
            B::seed(device, 7);
            let layer = Layer::<B>::new(mixer, plan, length, device);
            let x = Tensor::<B, 3>::random(
                [plan.batch, length, plan.d_model],
                Distribution::Normal(0.0, 1.0),
                device,
            );
            let inner = Layer::<B::InnerBackend>::new(mixer, plan, length, device);
            let x_inner = x.clone().inner();
            let (warm_train, warm_peak) = time_train(&layer, &x, device)?;
            let warm_forward = time_forward(&inner, &x_inner, device)?;
            let over_budget = warm_train > plan.budget_s;
            let (mut forward, mut train, mut peak) = (vec![], vec![], warm_peak);
            if over_budget {
                (forward, train) = (vec![warm_forward], vec![warm_train]);
            } else {
                for _ in 0..plan.runs {
                    forward.push(time_forward(&inner, &x_inner, device)?);
                    let (seconds, bytes) = time_train(&layer, &x, device)?;
                    train.push(seconds);
                    peak = peak.max(bytes);
                }
            }
            let point = Point {
                mixer: mixer.name().to_string(),
                length,
                forward_s: median(&forward),
                train_s: median(&train),
                peak_bytes: peak,
            };
            progress(&point);
            mine.push(point);
            if over_budget {
                break;
            }
        }
        points.extend(mine);
    }
    Ok(points)
}

/// The least-squares slope of `log y` against `log x`: the exponent `p` of `y ∝ xᵖ`.
pub fn growth_exponent(points: &[(f64, f64)]) -> Option<f64> {
    if points.len() < 2 {
        return None;
    }
    let logs: Vec<(f64, f64)> = points.iter().map(|&(x, y)| (x.ln(), y.ln())).collect();
    let n = logs.len() as f64;
    let (mx, my) = (
        logs.iter().map(|p| p.0).sum::<f64>() / n,
        logs.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxy: f64 = logs.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = logs.iter().map(|p| (p.0 - mx).powi(2)).sum();
    (sxx > 0.0).then(|| sxy / sxx)
}

/// The shortest length from which `variant` is faster than `reference` at every length both
/// were measured; `None` if it never is. Pairs are `(length, seconds)`.
pub fn crossover(variant: &[(usize, f64)], reference: &[(usize, f64)]) -> Option<usize> {
    let shared: Vec<(usize, bool)> = variant
        .iter()
        .filter_map(|&(l, v)| {
            reference
                .iter()
                .find(|r| r.0 == l)
                .map(|&(_, r)| (l, v < r))
        })
        .collect();
    let last_slower = shared.iter().rposition(|&(_, faster)| !faster);
    match last_slower {
        None => shared.first().map(|p| p.0),
        Some(i) => shared.get(i + 1).map(|p| p.0),
    }
}

/// Exponents are fitted over lengths from this on (where the asymptotic term dominates), or
/// over the last three points when fewer reach it.
const FIT_FROM: usize = 1024;

fn fit_points(points: &[&Point], value: impl Fn(&Point) -> Option<f64>) -> Vec<(f64, f64)> {
    let long: Vec<&&Point> = points.iter().filter(|p| p.length >= FIT_FROM).collect();
    let chosen: Vec<&&Point> = if long.len() >= 2 {
        long
    } else {
        points.iter().rev().take(3).collect()
    };
    chosen
        .into_iter()
        .filter_map(|p| value(p).map(|v| (p.length as f64, v)))
        .collect()
}

/// The per-point table, then each mixer's exponents and crossover with `full`.
pub fn render(points: &[Point], mixers: &[Mixer]) -> String {
    let mut out = format!(
        "{:<8} {:>7} {:>12} {:>14} {:>10}\n",
        "mixer", "length", "forward ms", "fwd+bwd ms", "peak MiB"
    );
    for p in points {
        let peak = p
            .peak_bytes
            .map_or("n/a".to_string(), |b| format!("{:.1}", b as f64 / MIB));
        let _ = writeln!(
            out,
            "{:<8} {:>7} {:>12.2} {:>14.2} {:>10}",
            p.mixer,
            p.length,
            p.forward_s * 1e3,
            p.train_s * 1e3,
            peak
        );
    }
    let of = |name: &str| -> Vec<&Point> { points.iter().filter(|p| p.mixer == name).collect() };
    let full: Vec<(usize, f64)> = of("full").iter().map(|p| (p.length, p.train_s)).collect();
    out.push_str(
        "\ngrowth exponents (fitted over lengths >= 1024, else the last three) and the crossover \
         with full attention (fwd+bwd)\n",
    );
    for mixer in mixers {
        let mine = of(mixer.name());
        let time = growth_exponent(&fit_points(&mine, |p| Some(p.train_s)));
        let memory = growth_exponent(&fit_points(&mine, |p| p.peak_bytes.map(|b| b as f64)));
        let show = |e: Option<f64>| e.map_or("n/a".to_string(), |e| format!("{e:.2}"));
        let longest = mine.last().map_or(0, |p| p.length);
        let cross = if mixer.name() == "full" {
            String::new()
        } else {
            let pairs: Vec<(usize, f64)> = mine.iter().map(|p| (p.length, p.train_s)).collect();
            match crossover(&pairs, &full) {
                Some(l) => format!(", faster than full from {l} tokens"),
                None => ", never faster than full where both ran".to_string(),
            }
        };
        let _ = writeln!(
            out,
            "{:<8} time ~ t^{}, memory ~ t^{} (up to {longest} tokens){cross}",
            mixer.name(),
            show(time),
            show(memory)
        );
    }
    out
}

const MIB: f64 = 1024.0 * 1024.0;

/// What a plot panel reads from a point.
type Measure = Box<dyn Fn(&Point) -> Option<f64>>;

/// The points as CSV: `mixer,length,forward_ms,forward_backward_ms,peak_mib`.
pub fn to_csv(points: &[Point]) -> String {
    let mut out = "mixer,length,forward_ms,forward_backward_ms,peak_mib\n".to_string();
    for p in points {
        let peak = p
            .peak_bytes
            .map_or(String::new(), |b| format!("{:.3}", b as f64 / MIB));
        let _ = writeln!(
            out,
            "{},{},{:.4},{:.4},{peak}",
            p.mixer,
            p.length,
            p.forward_s * 1e3,
            p.train_s * 1e3
        );
    }
    out
}

/// Two log-log panels — forward+backward time and peak memory against length — one line per
/// mixer.
pub fn write_png(path: &Path, points: &[Point], mixers: &[Mixer], title: &str) -> Result<()> {
    let colours = [
        RGBColor(31, 119, 180),
        RGBColor(255, 127, 14),
        RGBColor(44, 160, 44),
        RGBColor(214, 39, 40),
        RGBColor(148, 103, 189),
    ];
    let lengths = || points.iter().map(|p| p.length as f64);
    let (x_min, x_max) = (
        lengths().fold(f64::INFINITY, f64::min),
        lengths().fold(0.0, f64::max) * 1.05,
    );
    let panels: [(&str, Measure); 2] = [
        (
            "forward + backward (ms)",
            Box::new(|p| Some(p.train_s * 1e3)),
        ),
        (
            "peak memory (MiB)",
            Box::new(|p| p.peak_bytes.map(|b| b as f64 / MIB)),
        ),
    ];
    render_png(path, (1400, 620), |root| {
        let err = |e: String| anyhow!("cannot draw the mixer curves: {e}");
        let (top, body) = root.split_vertically(50);
        top.draw(&Text::new(
            title.to_string(),
            (20, 15),
            (FONT, 22).into_font().style(FontStyle::Bold),
        ))
        .map_err(|e| err(format!("{e:?}")))?;
        for (area, (label, value)) in body.split_evenly((1, 2)).iter().zip(&panels) {
            let values: Vec<f64> = points.iter().filter_map(value).collect();
            if values.is_empty() {
                continue;
            }
            let y_min = values.iter().cloned().fold(f64::INFINITY, f64::min) * 0.8;
            let y_max = values.iter().cloned().fold(0.0, f64::max) * 1.25;
            let mut chart = ChartBuilder::on(area)
                .margin(15)
                .x_label_area_size(45)
                .y_label_area_size(70)
                .build_cartesian_2d((x_min..x_max).log_scale(), (y_min..y_max).log_scale())
                .map_err(|e| err(format!("{e:?}")))?;
            chart
                .configure_mesh()
                .x_desc("sequence length (tokens)")
                .y_desc(*label)
                .label_style((FONT, 14))
                .x_label_formatter(&|v| format!("{v:.0}"))
                .draw()
                .map_err(|e| err(format!("{e:?}")))?;
            for (i, mixer) in mixers.iter().enumerate() {
                let colour = colours[i % colours.len()];
                let line: Vec<(f64, f64)> = points
                    .iter()
                    .filter(|p| p.mixer == mixer.name())
                    .filter_map(|p| value(p).map(|v| (p.length as f64, v)))
                    .collect();
                chart
                    .draw_series(LineSeries::new(line.clone(), colour.stroke_width(2)))
                    .map_err(|e| err(format!("{e:?}")))?
                    .label(mixer.name())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
                    });
                chart
                    .draw_series(line.into_iter().map(|p| Circle::new(p, 3, colour.filled())))
                    .map_err(|e| err(format!("{e:?}")))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.8))
                .border_style(BLACK)
                .label_font((FONT, 15))
                .draw()
                .map_err(|e| err(format!("{e:?}")))?;
        }
        Ok(())
    })
}
