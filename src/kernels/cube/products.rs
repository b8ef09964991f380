//! `bench matmul` on burn's CubeCL backends: each product of a training step through burn's
//! autotuned matmul (what the step runs), then through every candidate kernel that autotune
//! chooses among, each launched directly (`bench matmul`, [`crate::kernels::matmul`]).

use super::composed::{prim, tensor};
use crate::kernels::matmul::{MatmulPlan, ProductShape, ProductTiming};
use burn::prelude::*;
use burn::tensor::{DType, Distribution};
use burn_cubecl::kernel::matmul::{init_matmul_output, matmul, MatmulStrategy};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubek::matmul::components::tile::TileMatmulKind;
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::{launch_ref, Strategy};
use cubek::matmul::routines::double_buffering::DoubleBufferingArgs;
use cubek::matmul::routines::double_unit::DoubleUnitSelectionArgs;
use cubek::matmul::routines::ordered_double_buffering::OrderedSelectionArgs;
use cubek::matmul::routines::simple::SimpleArgs;
use cubek::matmul::routines::simple_unit::SimpleUnitSelectionArgs;
use cubek::matmul::routines::{BlueprintStrategy, Routine, TileSizeSelection};
use cubek::std::InputBinding;
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

/// Outputs compared with the host's sums, per product.
const SAMPLES: usize = 256;
/// Launches per timed sample (the sample's time divided by them).
const LAUNCHES: usize = 4;

/// The candidates of burn's matmul autotune (burn-cubecl 0.21's `matmul_autotune`, in its
/// order): the matrix–vector kernels (for a decoding step's one row a sequence), the unit
/// kernels, then the tensor-core kernels — `cmma` and `mma` tiles, simple and double-buffered
/// stages, and the TMA loaders of Hopper and later.
fn candidates() -> Vec<Strategy> {
    use BlueprintStrategy::Inferred;
    let mut all = vec![
        Strategy::DoubleVecMat(Inferred(().into())),
        Strategy::SimpleVecMat(Inferred(().into())),
        Strategy::GemvPlaneParallel(Inferred(Default::default())),
        Strategy::GemvUnitPerpendicular(Inferred(Default::default())),
    ];
    for tile_size in [
        TileSizeSelection::MaxTileSize,
        TileSizeSelection::MinTileSize,
    ] {
        all.push(Strategy::SimpleUnit(Inferred(SimpleUnitSelectionArgs {
            tile_size,
        })));
        all.push(Strategy::DoubleUnit(Inferred(DoubleUnitSelectionArgs {
            tile_size,
        })));
    }
    for tile_matmul in [TileMatmulKind::Cmma, TileMatmulKind::Mma] {
        // Each family's variant for this kind of tile.
        let cmma = matches!(tile_matmul, TileMatmulKind::Cmma);
        let simple_cyclic = pick(cmma, Strategy::SimpleCyclicCmma, Strategy::SimpleCyclicMma);
        let simple_tma = pick(cmma, Strategy::SimpleTmaCmma, Strategy::SimpleTmaMma);
        let ordered = pick(
            cmma,
            Strategy::OrderedDoubleCmma,
            Strategy::OrderedDoubleMma,
        );
        let double_cyclic = pick(cmma, Strategy::DoubleCyclicCmma, Strategy::DoubleCyclicMma);
        let specialized_cyclic = pick(
            cmma,
            Strategy::SpecializedCyclicCmma,
            Strategy::SpecializedCyclicMma,
        );
        let specialized_tma = pick(
            cmma,
            Strategy::SpecializedTmaCmma,
            Strategy::SpecializedTmaMma,
        );
        for multi_rows in [false, true] {
            let args = SimpleArgs {
                multi_rows,
                tile_matmul,
            };
            all.push(simple_cyclic(Inferred(args.clone())));
            all.push(simple_tma(Inferred(args)));
        }
        for row_count in [4, 8] {
            all.push(ordered(Inferred(OrderedSelectionArgs {
                partition_k: Some(2),
                row_count: Some(row_count),
                rows_per_plane: Some(2),
                tile_matmul,
            })));
        }
        for specialized in [false, true] {
            all.push(double_cyclic(Inferred(DoubleBufferingArgs {
                specialized,
                tile_matmul,
            })));
        }
        all.push(specialized_cyclic(Inferred(().into())));
        all.push(specialized_tma(Inferred(().into())));
    }
    all
}

/// A strategy family's variant with `cmma` tiles or with `mma` tiles.
fn pick<A: Routine<()>>(cmma: bool, c: Make<A>, m: Make<A>) -> Make<A> {
    if cmma {
        c
    } else {
        m
    }
}

/// A strategy of one family, from its selection.
type Make<A> = fn(BlueprintStrategy<(), A>) -> Strategy;

/// Times `plan` on `device` (`bench matmul`); `progress` sees each timing as it
/// is made.
pub(super) fn time_products<B, R>(
    device: &B::Device,
    plan: &MatmulPlan,
    progress: &mut dyn FnMut(&ProductTiming),
) -> Vec<ProductTiming>
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    let mut out = Vec::new();
    let mut rng = StdRng::seed_from_u64(0);
    for (index, shape) in plan.products.iter().enumerate() {
        let operands = Operands::<B, R>::new(shape, plan, device);
        let samples: Vec<(usize, usize)> = (0..SAMPLES)
            .map(|_| (rng.random_range(0..shape.m), rng.random_range(0..shape.n)))
            .collect();
        let reference = operands.sums(&samples);
        let mut run = |kernel: String, launch: &dyn Fn(CubeTensor<R>) -> Result<(), String>| {
            let (seconds, error) =
                match time_one::<B, R>(&operands, &samples, &reference, plan.runs, launch) {
                    Ok((seconds, error)) => (Ok(seconds), error),
                    Err(why) => (Err(why), 0.0),
                };
            let timing = ProductTiming {
                product: index,
                kernel,
                seconds,
                error,
            };
            progress(&timing);
            out.push(timing);
        };
        run("autotune".into(), &|o| {
            matmul(
                operands.a.clone(),
                operands.b.clone(),
                Some(o),
                MatmulStrategy::default(),
                DType::F32,
            )
            .map(|_| ())
            .map_err(|e| format!("{e:?}"))
        });
        if plan.all {
            let chosen = |name: &str| {
                plan.kernels.is_empty() || plan.kernels.iter().any(|w| name.contains(w.as_str()))
            };
            for strategy in candidates().into_iter().filter(|s| chosen(&s.to_string())) {
                run(strategy.to_string(), &|o| {
                    launch_strategy(&strategy, &operands.a, &operands.b, o)
                });
            }
        }
    }
    out
}

/// The candidate [`crate::kernels::pinned_matmul`] names, if any (said on stderr when the name
/// is first met; a name no candidate has is ignored with a warning).
pub(super) fn pinned() -> Option<Strategy> {
    static MET: std::sync::Mutex<Option<(String, Option<Strategy>)>> = std::sync::Mutex::new(None);
    let name = crate::kernels::pinned_matmul()?;
    let mut met = MET.lock().unwrap_or_else(|p| p.into_inner());
    if met.as_ref().is_none_or(|(known, _)| *known != name) {
        let found = candidates().into_iter().find(|s| s.to_string() == name);
        match &found {
            Some(_) => eprintln!(
                "note: the linear layers' products by {name}, where it takes them ({})",
                crate::kernels::MATMUL_ENV
            ),
            None => eprintln!(
                "warning: {}={name} names no matmul kernel (`bench matmul` lists them); autotune chooses",
                crate::kernels::MATMUL_ENV
            ),
        }
        *met = Some((name, found));
    }
    met.as_ref().and_then(|(_, strategy)| strategy.clone())
}

/// Products the named kernel ([`pinned`]) has made in this process (for tests).
static PINNED_LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many products the kernel named by [`crate::kernels::pinned_matmul`] has made in this
/// process (for tests, which must know that it ran).
#[doc(hidden)]
pub fn pinned_launches() -> u64 {
    PINNED_LAUNCHES.load(std::sync::atomic::Ordering::Relaxed)
}

/// `a·b` into `out` by the named kernel ([`pinned`]), if one is named and takes the product.
pub(super) fn launch_pinned<R: CubeRuntime>(
    a: &CubeTensor<R>,
    b: &CubeTensor<R>,
    out: CubeTensor<R>,
) -> bool {
    let ran = pinned().is_some_and(|strategy| launch_strategy(&strategy, a, b, out).is_ok());
    if ran {
        PINNED_LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
    ran
}

/// `a·b` into `out` by one candidate.
fn launch_strategy<R: CubeRuntime>(
    strategy: &Strategy,
    a: &CubeTensor<R>,
    b: &CubeTensor<R>,
    out: CubeTensor<R>,
) -> Result<(), String> {
    let mut dtypes = MatmulElems::from_globals(&MatmulGlobalElems {
        lhs: a.dtype.into(),
        rhs: b.dtype.into(),
        out: out.dtype.into(),
    });
    let client = out.client.clone();
    launch_ref(
        strategy,
        &client,
        InputBinding::new(a.clone().binding(), a.dtype.into()),
        InputBinding::new(b.clone().binding(), b.dtype.into()),
        out.binding(),
        &mut dtypes,
    )
    .map_err(|e| format!("{e:?}"))
}

/// A product's operands on the device (in the plan's type, transposed views where the step
/// has them) and on the host (row-major, as the device's values).
struct Operands<B: Backend<FloatTensorPrimitive = CubeTensor<R>>, R: CubeRuntime> {
    a: CubeTensor<R>,
    b: CubeTensor<R>,
    host_a: Vec<f32>,
    host_b: Vec<f32>,
    shape: ProductShape,
    device: B::Device,
}

impl<B: Backend<FloatTensorPrimitive = CubeTensor<R>>, R: CubeRuntime> Operands<B, R> {
    fn new(shape: &ProductShape, plan: &MatmulPlan, device: &B::Device) -> Self {
        let operand = |rows: usize, cols: usize, transposed: bool| {
            let normal = Distribution::Normal(0.0, 1.0);
            let x = if transposed {
                Tensor::<B, 2>::random([cols, rows], normal, device).transpose()
            } else {
                Tensor::<B, 2>::random([rows, cols], normal, device)
            };
            let x = match plan.precision.half() {
                Some(half) => x.cast(half),
                None => x,
            };
            // The host's copy of the values the device holds (rounded to the half type).
            let host = x
                .clone()
                .cast(burn::tensor::FloatDType::F32)
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .expect("f32 data");
            (prim(x), host)
        };
        let (a, host_a) = operand(shape.m, shape.k, shape.a_transposed);
        let (b, host_b) = operand(shape.k, shape.n, shape.b_transposed);
        Self {
            a,
            b,
            host_a,
            host_b,
            shape: shape.clone(),
            device: device.clone(),
        }
    }

    /// The product's elements at `samples`, summed on the host in `f64`.
    fn sums(&self, samples: &[(usize, usize)]) -> Vec<f64> {
        let (n, k) = (self.shape.n, self.shape.k);
        samples
            .iter()
            .map(|&(i, j)| {
                (0..k)
                    .map(|l| self.host_a[i * k + l] as f64 * self.host_b[l * n + j] as f64)
                    .sum()
            })
            .collect()
    }

    /// A new `f32` output.
    fn output(&self) -> CubeTensor<R> {
        init_matmul_output(&self.a, &self.b, DType::F32)
    }

    fn sync(&self) -> Result<(), String> {
        B::sync(&self.device).map_err(|e| format!("the device failed: {e:?}"))
    }
}

/// One kernel: launched once (compiling it) and checked at `samples` against `reference`, then
/// `runs` samples of [`LAUNCHES`] launches timed. `(median seconds a launch, relative error)`.
fn time_one<B, R>(
    operands: &Operands<B, R>,
    samples: &[(usize, usize)],
    reference: &[f64],
    runs: usize,
    launch: &dyn Fn(CubeTensor<R>) -> Result<(), String>,
) -> Result<(f64, f64), String>
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    let guarded = |out: CubeTensor<R>| {
        catch_unwind(AssertUnwindSafe(|| launch(out)))
            .unwrap_or_else(|panic| Err(panic_text(panic)))
    };
    let out = operands.output();
    guarded(out.clone())?;
    operands.sync()?;
    let values = tensor::<B, 2>(out)
        .into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| format!("cannot read the output: {e:?}"))?;
    let n = operands.shape.n;
    let scale = reference
        .iter()
        .fold(0.0f64, |m, r| m.max(r.abs()))
        .max(1e-30);
    let error = samples
        .iter()
        .zip(reference)
        .map(|(&(i, j), r)| {
            let v = values[i * n + j] as f64;
            if v.is_finite() {
                (v - r).abs() / scale
            } else {
                f64::INFINITY
            }
        })
        .fold(0.0, f64::max);
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let out = operands.output();
        operands.sync()?;
        let start = Instant::now();
        for _ in 0..LAUNCHES {
            guarded(out.clone())?;
        }
        operands.sync()?;
        times.push(start.elapsed().as_secs_f64() / LAUNCHES as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], error))
}

/// What a caught panic said.
fn panic_text(panic: Box<dyn std::any::Any + Send>) -> String {
    let text = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panicked".into());
    format!("panicked: {text}")
}
