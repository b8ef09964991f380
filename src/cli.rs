//! Command-line types (clap derive). The doc comments are the `--help` text.

use crate::kernels::Op;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

pub use crate::backend::BackendKind;
pub use crate::config::DEFAULT_EXPERIMENT;
pub use crate::kernels::Precision;

/// Build, train, inspect and sample transformer models.
#[derive(Parser, Debug)]
#[command(name = "transformer-lab", version, about, long_about = None)]
pub struct Cli {
    /// The backend options, for every command that computes (also accepted after the
    /// command's name, where its --help lists them).
    #[command(flatten)]
    pub compute: ComputeArgs,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Where a command computes: the backend, and whether the fused kernels run (checked first).
#[derive(Args, Debug, Clone, Default, PartialEq)]
#[command(next_help_heading = "Backend")]
pub struct ComputeArgs {
    /// Compute backend (the ones compiled in; default: wgpu when built with it and a GPU is present, else flex, else ndarray).
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// Use the composed tensor ops instead of the fused kernels (attention, packed
    /// self-attention, LayerNorm, GELU, softmax, dropout, cross-entropy, AdamW, the linear
    /// layer): the reference the kernels are tested against, for comparisons.
    #[arg(long)]
    pub no_fused: bool,
    /// Check the fused kernels against their composed forms on the device before using them
    /// (once per device, driver and binary; cached in ~/.cache/transformer-lab): auto = on a
    /// GPU (cuda, wgpu on a hardware adapter). An operation that disagrees warns and runs
    /// composed. [default: auto]
    #[arg(long, value_enum, env = "TRANSFORMER_LAB_KERNEL_CHECK")]
    pub kernel_check: Option<KernelCheck>,
}

impl ComputeArgs {
    /// These options, each taken from `outer` (given before the command's name) where not given
    /// here.
    pub fn or(self, outer: &ComputeArgs) -> ComputeArgs {
        ComputeArgs {
            backend: self.backend.or(outer.backend),
            no_fused: self.no_fused || outer.no_fused,
            kernel_check: self.kernel_check.or(outer.kernel_check),
        }
    }
}

/// The backend alone, for commands that compare the fused and composed forms themselves.
#[derive(Args, Debug, Clone, Default)]
#[command(next_help_heading = "Backend")]
pub struct BackendArgs {
    /// Compute backend (the ones compiled in; default: wgpu when built with it and a GPU is present, else flex, else ndarray).
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
}

/// When the fused kernels are checked on the device before a command uses them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum KernelCheck {
    /// On a GPU: cuda, and wgpu on a hardware adapter (not on a CPU driver such as lavapipe).
    Auto,
    /// On every backend.
    Always,
    /// Never (`doctor` still checks).
    Never,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Train a model from an experiment config (default: experiments/shakespeare-char.json).
    ///
    /// Shows burn's dashboard in a terminal and plain log lines otherwise. Checkpoints go to
    /// ARTIFACT_DIR/checkpoint after every epoch (and mid-epoch with `train.checkpoint_every`);
    /// `--resume` continues from the newest complete one, optimizer, learning-rate schedule,
    /// data order and dropout masks included, to the bit.
    ///
    /// Stopping never costs more than the step in progress: SIGTERM, Ctrl-C (SIGINT) or q in the
    /// dashboard let the step finish, save a checkpoint of that step and exit with status 75
    /// and a line naming the step and the command that continues it. The stop takes one step
    /// plus one checkpoint write (well under a second for the default experiment on a CPU); a
    /// second signal exits at once (status 128 + signal), keeping the newest complete
    /// checkpoint. A warning says when a step alone outlasts the 10 s a scheduler may wait
    /// before SIGKILL.
    Train(TrainArgs),
    /// Generate text from a trained language model, streaming it to stdout.
    Generate(GenerateArgs),
    /// Serve trained language models over HTTP: an OpenAI-compatible API
    /// (/v1/completions, /v1/chat/completions, /v1/models; streamed or not), concurrent
    /// requests decoded together (continuous batching), /metrics (Prometheus) and /health.
    /// Ctrl-C or SIGTERM stops it cleanly.
    Serve(ServeArgs),
    /// Evaluate a trained model: a language model's loss and perplexity over the whole
    /// validation split; a translator's corpus BLEU on its test split (sacreBLEU-compatible);
    /// a classifier's test accuracy, with a confusion-matrix PNG; a clip model's zero-shot
    /// accuracy with held-out prompts, retrieval recall@1/@5, and the similarity-matrix and
    /// embedding-map PNGs.
    Eval(EvalArgs),
    /// Translate with a trained translator: each TEXT argument, or else each line of stdin.
    ///
    /// Output is one line per input line (an empty line gives an empty line). An input longer
    /// than the model's maximum is cut to it, with a warning on stderr.
    Translate(TranslateArgs),
    /// Classify image files (PNG/JPEG, any size) with a trained Vision Transformer: each is
    /// made the model's grey 28×28 input (inverted when its background is light) and the top
    /// classes are printed with their probabilities.
    Predict(PredictArgs),
    /// Classify image files with a trained clip model over labels chosen now — any words, not
    /// only the classes it was trained on: prints each image's probability for every label
    /// (the softmax of the scaled cosine similarities of its embedding with theirs).
    #[command(name = "zero-shot")]
    ZeroShot(ZeroShotArgs),
    /// Classify texts with a trained text classifier: each TEXT argument, or else each line of
    /// stdin; prints the label and its probability.
    Classify(ClassifyArgs),
    /// Fill in the blanks with a trained masked language model: each TEXT argument, or else
    /// each line of stdin, with `[MASK]` where a word is missing; prints each mask's most
    /// probable tokens with their probabilities.
    #[command(name = "fill-mask")]
    FillMask(FillMaskArgs),
    /// The contextual vector of one word in several sentences, from a trained language model
    /// or classifier, and the cosine similarity of every pair beside that of the static input
    /// embeddings (always 1: the input embedding ignores context).
    Embed(EmbedArgs),
    /// Measure training speed: tokens/s of an experiment's training step on the chosen backend.
    Bench(BenchArgs),
    /// Show the attention weights of every layer and head of a trained model on one input.
    ///
    /// Prints one head as a heatmap (--layer, --head; --group picks a translator's encoder,
    /// decoder or cross-attention) and writes, when asked, a PNG grid of every layer × head (for
    /// a ViT: the classification token's attention laid over the image), a self-contained
    /// interactive HTML page and a JSON export ([layer][head][query][key] with the tokens).
    Attention(AttentionArgs),
    /// Walk through single-head scaled dot-product attention step by step: on small matrices,
    /// or (with --artifact-dir and a TEXT) on a real head of a trained model.
    ///
    /// Matrices are written row by row: rows separated by ';', values by ','. Tokens are row
    /// vectors, so Q = X·W_Q. The defaults are the textbook three-token example.
    Explain(ExplainArgs),
    /// What each attention head is worth, and pruning: for every layer × head, the held-out
    /// loss with that head gated off and its gradient importance |∂L/∂ξ| (Michel et al. 2019),
    /// how the two rank the heads alike (Spearman), and the loss (and accuracy) as heads are
    /// removed least important first — a table and a PNG curve.
    ///
    /// Judged on batches spread over the validation split. With --prune N --out DIR, writes an
    /// artifact without the first N heads the greedy curve removed (smaller projections, not a
    /// mask) that every command loads.
    Heads(HeadsArgs),
    /// Import a Hugging Face GPT-2 or BERT checkpoint as an artifact every command uses.
    ///
    /// DIR holds config.json, model.safetensors and the tokenizer (GPT-2: tokenizer.json, or
    /// vocab.json and merges.txt; BERT: its WordPiece tokenizer.json), as `save_pretrained`
    /// writes them or the Hub serves them.
    Import(ImportArgs),
    /// Export a trained language model as a Hugging Face GPT-2 checkpoint (config.json,
    /// model.safetensors, tokenizer.json) that `GPT2LMHeadModel.from_pretrained` loads.
    Export(ExportArgs),
    /// Draw the training curves of several runs on one chart: one metric (validation by
    /// default), one line per run, labelled by the run's directory name.
    ///
    /// Reads each run's metrics.csv (every step's training values and each epoch's validation
    /// means), or burn's epoch logs (train/epoch-N/*.log) for runs older than metrics.csv.
    /// Runs of different kinds overlay where they share the metric.
    Curves(CurvesArgs),
    /// Check every fused kernel (attention, LayerNorm, GELU, dropout, cross-entropy, AdamW,
    /// the linear layer, softmax) against its composed form on this backend's device: outputs
    /// and gradients on small random inputs, one row per operation with its largest relative
    /// error. Exits non-zero when one disagrees (runs then use its composed form).
    Doctor(DoctorArgs),
}

/// `doctor` options.
#[derive(Args, Debug)]
pub struct DoctorArgs {
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Check only these operations (comma-separated: gelu, layer_norm, softmax, attention,
    /// packed_attention, dropout, cross_entropy, adamw, linear, embedding, decode_linear).
    /// Their rows are printed but not
    /// cached: what runs read is a check of every operation. A GPU backend compiles one kernel
    /// at a time in each process, so several such runs at once share out a new GPU's
    /// compilation (the compiled kernels are cached for the whole check after them).
    #[arg(long, value_name = "OPS", value_delimiter = ',', value_parser = parse_op)]
    pub only: Vec<Op>,
}

fn parse_op(name: &str) -> Result<Op, String> {
    Op::from_name(name.trim()).ok_or_else(|| {
        let names: Vec<&str> = Op::ALL.iter().map(|op| op.name()).collect();
        format!("no fused operation `{name}` (one of {})", names.join(", "))
    })
}

/// `curves` options.
#[derive(Args, Debug)]
pub struct CurvesArgs {
    /// Artifact directories written by `train`.
    #[arg(required = true, value_name = "DIR")]
    pub dirs: Vec<PathBuf>,
    /// The metric: loss, accuracy, perplexity or lr.
    #[arg(long, default_value = "loss")]
    pub metric: String,
    /// Which values: valid (each epoch's validation mean) or train (every step).
    #[arg(long, default_value = "valid")]
    pub split: String,
    /// Where the PNG goes. Default: beside the runs, DIR/../curves-SPLIT-METRIC.png for the
    /// first DIR (e.g. artifacts/curves-valid-loss.png).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Also write every run's metrics as one CSV (a leading `run` column).
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,
}

/// Where data comes from.
#[derive(Args, Debug, Clone)]
pub struct DataArgs {
    /// Directory holding the datasets (e.g. DIR/tinyshakespeare/input.txt); missing files are
    /// downloaded there and verified. Default: $TRANSFORMER_LAB_DATA, else ./data.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
}

/// `train` options.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Experiment config (JSON). Default: the built-in shakespeare-char experiment.
    #[arg(long, short, value_name = "FILE")]
    pub experiment: Option<PathBuf>,
    /// Where checkpoints, config, tokenizer and the final model go. Default: artifacts/NAME.
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: Option<PathBuf>,
    /// Continue the run in the artifact dir from its latest complete checkpoint.
    #[arg(long, conflicts_with = "force")]
    pub resume: bool,
    /// Replace a previous run in the artifact dir.
    #[arg(long)]
    pub force: bool,
    /// Plain log lines even in a terminal (no dashboard).
    #[arg(long)]
    pub plain: bool,
    /// The number type of the linear layers' products, replacing the experiment's
    /// `train.precision`: f32, or on a GPU backend f16 (gradients scaled) or bf16; parameters,
    /// optimizer state, norms, attention and the loss stay f32.
    #[arg(long, value_enum)]
    pub precision: Option<Precision>,
    /// The peak learning rate for this invocation, replacing the experiment's `train.lr`
    /// (`min_lr` scaled with it); allowed with --resume: how a run that diverged continues
    /// from its last good checkpoint.
    #[arg(long, value_name = "LR")]
    pub lr: Option<f64>,
    /// Train data-parallel on these devices of the backend (e.g. `0,1,2,3`), replacing the
    /// experiment's `train.devices`: each step's batch is split evenly across them and their
    /// gradients averaged (burn-collective's all-reduce) before one optimizer step.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub devices: Option<Vec<usize>>,
    /// Train on several machines: how many take part, one `train` process on each (with the
    /// same experiment and binary), like torchrun's --nnodes.
    #[arg(long, value_name = "N", env = "TRANSFORMER_LAB_NODES", requires_all = ["node_rank", "coordinator"])]
    pub nodes: Option<usize>,
    /// This machine's number among --nodes, from 0; node 0 hosts the coordinator and writes the
    /// artifact (node R keeps its copy of the run in ARTIFACT_DIR-node-R, to resume from).
    #[arg(
        long,
        value_name = "R",
        env = "TRANSFORMER_LAB_NODE_RANK",
        requires = "nodes"
    )]
    pub node_rank: Option<usize>,
    /// Where node 0 listens for the others (HOST:PORT, HOST as the other nodes reach node 0);
    /// node R also uses PORT + 1 + R.
    #[arg(
        long,
        value_name = "HOST:PORT",
        env = "TRANSFORMER_LAB_COORDINATOR",
        requires = "nodes"
    )]
    pub coordinator: Option<String>,
    #[command(flatten)]
    pub data: DataArgs,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `generate` options.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// Directory written by `train`.
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: PathBuf,
    /// Text to continue. Default: a newline (or, for a vocabulary without one, its first
    /// character), so the model starts a fresh passage.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Number of tokens to generate.
    #[arg(long, default_value_t = 500)]
    pub max_new_tokens: usize,
    /// Softmax temperature: below 1 sharper, above 1 flatter; 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Sample only among the K most likely tokens.
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Nucleus sampling: only among the most likely tokens whose probabilities sum to P.
    #[arg(long, value_name = "P")]
    pub top_p: Option<f64>,
    /// Always take the most likely token (deterministic).
    #[arg(long)]
    pub greedy: bool,
    /// Discourage repeats, as Hugging Face's `repetition_penalty` (the CTRL paper's): the logit
    /// of every token already in the prompt or the text is divided by R where positive and
    /// multiplied by R where not. 1 = off; 1.1–1.3 is usual.
    #[arg(
        long,
        value_name = "R",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub repetition_penalty: f32,
    /// As OpenAI's `frequency_penalty`: F times the number of times a token was generated so
    /// far is taken from its logit (−2 to 2; 0 = off).
    #[arg(
        long,
        value_name = "F",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub frequency_penalty: f32,
    /// As OpenAI's `presence_penalty`: P is taken from the logit of every token generated at
    /// least once (−2 to 2; 0 = off).
    #[arg(
        long,
        value_name = "P",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub presence_penalty: f32,
    /// Random seed: the same seed gives the same text.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    /// Run the whole window again for every token instead of decoding from the key–value
    /// cache: the model then always sees exactly the last `context` tokens at positions
    /// 0..context (nanoGPT's sliding window). With the cache (the default, ~10× faster) the
    /// output is the same up to the context length. Past it, a model with rope or alibi
    /// positions rolls its cache (every layer attends over its last `context` positions); one
    /// with learned or sinusoidal positions refills the cache from the last context/2 tokens
    /// whenever it is full, so it sees between context/2 and context tokens.
    #[arg(long)]
    pub no_cache: bool,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `serve` options.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Directory written by `train` (a language model); repeat to serve several. A model's
    /// id in the API is its directory's name.
    #[arg(long = "artifact-dir", value_name = "DIR", required = true)]
    pub artifact_dirs: Vec<PathBuf>,
    /// Address to listen on. The default accepts connections from this machine only.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free one; the first line printed says which).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on every request but /health.
    #[arg(
        long,
        value_name = "KEY",
        env = "TRANSFORMER_LAB_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<String>,
    /// Requests decoded together on one model at most.
    #[arg(long, default_value_t = 32)]
    pub max_batch: usize,
    /// Requests waiting per model at most; more get 503 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Largest max_tokens a request may ask for.
    #[arg(long, default_value_t = 2048)]
    pub max_tokens: usize,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body: usize,
    /// Seconds running generations may go on after Ctrl-C or SIGTERM before they are cut.
    #[arg(long, default_value_t = 10.0)]
    pub grace: f64,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `eval` options.
#[derive(Args, Debug)]
pub struct EvalArgs {
    /// Directory written by `train`.
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: PathBuf,
    /// Sequences per evaluation batch.
    #[arg(long, default_value_t = 64)]
    pub batch_size: usize,
    /// Translators, classifiers and ViTs: evaluate only the first N test examples; clip
    /// models: the first N of each dataset's test images.
    #[arg(long, value_name = "N")]
    pub limit: Option<usize>,
    /// Translators: also write source, reference and translation of every test sentence here
    /// (tab-separated). Classifiers and ViTs: where the confusion-matrix PNG goes (default:
    /// ARTIFACT_DIR/confusion.png). Clip models: the folder for similarity.png and
    /// embeddings.png (default: ARTIFACT_DIR).
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Language models: evaluate on windows of N tokens instead of the model's context. Above
    /// the context only models with rope or alibi positions can run (length extrapolation);
    /// learned and sinusoidal tables end at the context.
    #[arg(long, value_name = "N")]
    pub context: Option<usize>,
    #[command(flatten)]
    pub search: SearchArgs,
    #[command(flatten)]
    pub data: DataArgs,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// The checkpoint formats `import` and `export` speak.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointFormat {
    /// Hugging Face transformers' GPT-2 (`GPT2LMHeadModel`).
    Gpt2,
    /// Hugging Face transformers' BERT (`BertForMaskedLM`, or `BertModel`), with its WordPiece
    /// `tokenizer.json`; import only.
    Bert,
}

/// `import` options.
#[derive(Args, Debug)]
pub struct ImportArgs {
    /// The checkpoint's format.
    #[arg(value_enum)]
    pub format: CheckpointFormat,
    /// The checkpoint's directory.
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// Where the artifact goes (a new or empty directory).
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: PathBuf,
}

/// `export` options.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// Directory written by `train` (or `import`).
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: PathBuf,
    /// Where the checkpoint goes (a new or empty directory).
    #[arg(long, value_name = "DIR")]
    pub to: PathBuf,
    /// The checkpoint's format.
    #[arg(long, value_enum, default_value = "gpt2")]
    pub format: CheckpointFormat,
}

/// `heads` options.
#[derive(Args, Debug)]
pub struct HeadsArgs {
    /// Directory written by `train`.
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: PathBuf,
    /// Examples per held-out batch.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    /// Held-out batches (their examples spread over the validation split).
    #[arg(long, default_value_t = 8)]
    pub batches: usize,
    /// Heads the pruning curves remove at most. Default: all but one per layer.
    #[arg(long, value_name = "N")]
    pub steps: Option<usize>,
    /// Write an artifact without the first N heads the greedy curve removes (needs --out).
    #[arg(long, value_name = "N")]
    pub prune: Option<usize>,
    /// Where --prune writes the pruned artifact (a new or empty directory).
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Where the pruning curves' PNG goes. Default: ARTIFACT_DIR/heads.png.
    #[arg(long, value_name = "FILE")]
    pub png: Option<PathBuf>,
    #[command(flatten)]
    pub data: DataArgs,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// How a translator searches.
#[derive(Args, Debug, Clone)]
pub struct SearchArgs {
    /// Beam size; 1 = greedy decoding.
    #[arg(long, default_value_t = 4)]
    pub beam: usize,
    /// GNMT length penalty α (scores are log p / ((5+len)/6)^α); 0 = none.
    #[arg(long, default_value_t = 0.6)]
    pub length_penalty: f64,
    /// Most tokens to generate per sentence. Default: the model's maximum length.
    #[arg(long, value_name = "N")]
    pub max_len: Option<usize>,
    /// Re-run the decoder over the whole prefix at every step instead of decoding from the
    /// key–value cache (the same translations, slower; for comparison).
    #[arg(long)]
    pub no_cache: bool,
}

/// `translate` options.
#[derive(Args, Debug)]
pub struct TranslateArgs {
    /// Directory written by `train` for a seq2seq experiment.
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: PathBuf,
    /// Texts to translate; none = read stdin line by line.
    pub texts: Vec<String>,
    /// Sentences decoded together.
    #[arg(long, default_value_t = 32)]
    pub batch_size: usize,
    #[command(flatten)]
    pub search: SearchArgs,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `predict` options.
#[derive(Args, Debug)]
pub struct PredictArgs {
    /// Directory written by `train` for a vit experiment.
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: PathBuf,
    /// Image files (PNG or JPEG).
    #[arg(required = true)]
    pub images: Vec<PathBuf>,
    /// How many classes to show per image.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub top: u64,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `zero-shot` options.
#[derive(Args, Debug)]
pub struct ZeroShotArgs {
    /// Directory written by `train` for a clip experiment.
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: PathBuf,
    /// The labels, comma-separated ("a shirt,a shoe,a bag").
    #[arg(long, value_delimiter = ',', required = true)]
    pub labels: Vec<String>,
    /// Image files (PNG or JPEG).
    #[arg(required = true)]
    pub images: Vec<PathBuf>,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `classify` options.
#[derive(Args, Debug)]
pub struct ClassifyArgs {
    /// Directory written by `train` for a classifier experiment.
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: PathBuf,
    /// Texts to classify; none = read stdin line by line.
    pub texts: Vec<String>,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `fill-mask` options.
#[derive(Args, Debug)]
pub struct FillMaskArgs {
    /// Directory written by `train` for an mlm experiment.
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: PathBuf,
    /// Tokens shown per mask.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub top: u64,
    /// Texts with `[MASK]` where a word is missing ("the [MASK] sat on the mat"); none = read
    /// stdin line by line.
    pub texts: Vec<String>,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `embed` options.
#[derive(Args, Debug)]
pub struct EmbedArgs {
    /// Directory written by `train` for a language model, classifier or clip model (its text
    /// encoder).
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: PathBuf,
    /// The word to follow (matched as a whole word, ignoring case).
    #[arg(long, required_unless_present = "pairs")]
    pub word: Option<String>,
    /// Sentences that contain the word (at least two).
    #[arg(required_unless_present = "pairs", num_args = 2..)]
    pub sentences: Vec<String>,
    /// Instead: score a word-in-context set (the WiC protocol) — a TSV of word, sentence A,
    /// sentence B, same|different per line (e.g. datasets/word-senses.tsv): each pair's cosine,
    /// the mean cosine of same- and different-sense pairs, and the accuracy of the best single
    /// threshold.
    #[arg(long, value_name = "TSV", conflicts_with_all = ["word", "sentences"])]
    pub pairs: Option<PathBuf>,
    /// How many leading dimensions of each vector to print (0 = all).
    #[arg(long, default_value_t = 8)]
    pub dims: usize,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `bench` options.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// What to measure.
    #[command(subcommand)]
    pub what: BenchCommand,
}

/// The benchmarks.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Train an experiment (any kind) for a few steps and print its throughput (median of
    /// several runs, warm-up excluded) and the forward / backward / optimizer split of a step.
    Train(BenchTrainArgs),
    /// Time (forward, forward+backward) and peak memory of one causal self-attention layer per
    /// token mixer against sequence length; writes a CSV and a log-log PNG and prints growth
    /// exponents and where each mixer overtakes full attention.
    Mixers(BenchMixersArgs),
    /// Time each fused kernel (GELU, LayerNorm, causal attention, the masked softmax, the
    /// linear layer, the cross-entropy) against the composed ops it replaces, forward +
    /// backward at a language-model experiment's shapes: the per-operation profile of a
    /// training step.
    Kernels(BenchKernelsArgs),
    /// Time every matrix-product kernel a GPU backend chooses among on the products of a
    /// language model's training step (forward, input and weight gradients of each linear
    /// layer): burn's autotuned choice, as the step runs it, then each candidate, with each one's
    /// error against sums made on the host, and what the fastest correct kernels would make of
    /// the step's products.
    Matmul(BenchMatmulArgs),
    /// Load `serve` with concurrent streamed completions on loopback: requests/s, tokens/s,
    /// latency to the first token and between tokens (p50, p99) at each number of clients,
    /// with the server decoding one request at a time and batching them.
    Serve(BenchServeArgs),
    /// Time greedy generation of a language model — an experiment's shape with random weights,
    /// or a trained artifact — with the key–value cache and recomputing every window: prefill,
    /// per-token time and tokens/s at each batch size.
    Generate(BenchGenerateArgs),
}

/// `bench serve` options.
#[derive(Args, Debug)]
pub struct BenchServeArgs {
    /// Directory written by `train` (a language model): the model served.
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: PathBuf,
    /// Numbers of concurrent clients, one row each.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub clients: Vec<usize>,
    /// Requests each client sends, one after the other.
    #[arg(long, default_value_t = 4)]
    pub requests: usize,
    /// Tokens each request asks for.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// The prompt of every request.
    #[arg(long, default_value = "\n")]
    pub prompt: String,
    /// The batching server's `--max-batch`.
    #[arg(long, default_value_t = 32)]
    pub max_batch: usize,
    /// A row stops sending new requests after this many seconds.
    #[arg(long, default_value_t = 120.0)]
    pub seconds: f64,
    /// Write the rows here as CSV too.
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// `bench generate` options.
#[derive(Args, Debug)]
pub struct BenchGenerateArgs {
    /// Language-model experiment whose shape to build with random weights. Default: the
    /// built-in shakespeare-char.
    #[arg(long, short, value_name = "FILE", conflicts_with = "artifact_dir")]
    pub experiment: Option<PathBuf>,
    /// A trained language model to time instead.
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: Option<PathBuf>,
    /// Vocabulary size of the random model (65 = Tiny Shakespeare's characters).
    #[arg(long, default_value_t = 65)]
    pub vocab: usize,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 1)]
    pub prompt_len: usize,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 255)]
    pub tokens: usize,
    /// Batch sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub batch: Vec<usize>,
    /// Measure only the cached path (the recomputing one is slow at long contexts).
    #[arg(long)]
    pub cached_only: bool,
    /// Timed runs per point (after one warm-up); medians are reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `bench kernels` options.
#[derive(Args, Debug)]
pub struct BenchKernelsArgs {
    /// Language-model experiment whose shapes to use. Default: the built-in shakespeare-char.
    #[arg(long, short, value_name = "FILE")]
    pub experiment: Option<PathBuf>,
    /// Timed repetitions per operation (after two warm-ups); the median is reported.
    #[arg(long, default_value_t = 30)]
    pub reps: usize,
    /// Vocabulary size for the loss (the experiment's comes from its data; 65 = Tiny
    /// Shakespeare's characters).
    #[arg(long, default_value_t = 65)]
    pub vocab: usize,
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// `bench matmul` options.
#[derive(Args, Debug)]
pub struct BenchMatmulArgs {
    /// Language-model experiment whose step to take the products of. Default: the built-in
    /// shakespeare-char.
    #[arg(long, short, value_name = "FILE")]
    pub experiment: Option<PathBuf>,
    /// The operands' type: f32, or f16/bf16 read by the products and accumulated in f32, as
    /// `train --precision` runs them.
    #[arg(long, value_enum, default_value = "f32")]
    pub precision: crate::kernels::Precision,
    /// Only the products whose name contains one of these words, comma-separated: the layers
    /// qkv, out, ff1, ff2, head; the products forward, dX, dW (e.g. `ff1` or `dW`).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Time only burn's autotuned choice, not every candidate.
    #[arg(long)]
    pub autotune_only: bool,
    /// Only the candidates whose name contains one of these words, comma-separated (e.g.
    /// `tma` or `cyclic_mma`); burn's autotuned choice is always timed.
    #[arg(long, value_delimiter = ',')]
    pub kernels: Vec<String>,
    /// Timed samples per kernel (after one launch that compiles and checks it); medians are
    /// reported.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// Vocabulary size of the output layer (65 = Tiny Shakespeare's characters).
    #[arg(long, default_value_t = 65)]
    pub vocab: usize,
    /// Rows of the products: the experiment's batch × context by default; a decoding step's
    /// are its sequences (e.g. `--rows 1 --only forward`).
    #[arg(long)]
    pub rows: Option<usize>,
    #[command(flatten)]
    pub backend: BackendArgs,
}

/// `bench mixers` options.
#[derive(Args, Debug)]
pub struct BenchMixersArgs {
    /// Mixers to measure, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "full,local,strided,linear,hyena"
    )]
    pub mixers: Vec<String>,
    /// Sequence lengths, comma-separated, increasing.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "128,256,512,1024,2048,4096,8192,16384"
    )]
    pub lengths: Vec<usize>,
    /// Window of the local mixer.
    #[arg(long, default_value_t = 128)]
    pub window: usize,
    /// Block length of the strided mixer.
    #[arg(long, default_value_t = 128)]
    pub stride: usize,
    /// Chunk of the causal linear mixer.
    #[arg(long, default_value_t = 64)]
    pub chunk: usize,
    /// Layer width.
    #[arg(long, default_value_t = 128)]
    pub d_model: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Timed runs per point (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// A mixer stops at the first length whose warm-up pass took longer (seconds).
    #[arg(long, default_value_t = 60.0)]
    pub budget_s: f64,
    /// A mixer stops before a length predicted to need more heap than this share of the
    /// machine's available memory.
    #[arg(long, default_value_t = 0.6)]
    pub memory_share: f64,
    /// Where `mixers.csv` and `mixers.png` go.
    #[arg(long, value_name = "DIR", default_value = "artifacts/bench")]
    pub out: PathBuf,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `bench train` options.
#[derive(Args, Debug)]
pub struct BenchTrainArgs {
    /// Experiment config (JSON). Default: the built-in shakespeare-char experiment.
    #[arg(long, short, value_name = "FILE")]
    pub experiment: Option<PathBuf>,
    /// Timed steps per run.
    #[arg(long, default_value_t = 50)]
    pub steps: usize,
    /// Untimed steps before them.
    #[arg(long, default_value_t = 5)]
    pub warmup: usize,
    /// Runs, each from a fresh model; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Group variable-length batches by length (`on`) or not (`off`), whatever the experiment's
    /// `train.batch_by_length` says.
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    pub by_length: Option<bool>,
    /// The precision of the linear layers' products, whatever the experiment's
    /// `train.precision` says (f32; f16 or bf16 on a GPU backend).
    #[arg(long, value_enum)]
    pub precision: Option<Precision>,
    /// Also time every fused kernel call of the timed steps and print where each phase's
    /// time goes: each operation's calls and ms per step, the linear layers' product work
    /// (MFLOP a step) and rate (GFLOP/s) against this machine's multiply-add peak, and the
    /// time outside the kernels (flex backend only).
    #[arg(long)]
    pub profile: bool,
    #[command(flatten)]
    pub data: DataArgs,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

fn parse_on_off(text: &str) -> Result<bool, String> {
    match text {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("expected on or off, not {text:?}")),
    }
}

/// `attention` options.
#[derive(Args, Debug)]
pub struct AttentionArgs {
    /// Directory written by `train` (any model kind).
    #[arg(long, value_name = "DIR")]
    pub artifact_dir: PathBuf,
    /// The text to run the model on; for a ViT, an image file (PNG or JPEG).
    pub input: String,
    /// Translators: the target sentence to attend over (default: the model's own greedy
    /// translation).
    #[arg(long)]
    pub target: Option<String>,
    /// Which attention to show: self (LM, classifier, ViT) or encoder, decoder, cross
    /// (translator). Default: the first.
    #[arg(long)]
    pub group: Option<String>,
    /// Layer of the terminal heatmap (from 0).
    #[arg(long, default_value_t = 0)]
    pub layer: usize,
    /// Head of the terminal heatmap (from 0).
    #[arg(long, default_value_t = 0)]
    pub head: usize,
    /// Write every layer × head as a PNG grid (a translator gets one file per attention,
    /// FILE's stem + -encoder/-decoder/-cross).
    #[arg(long, value_name = "FILE")]
    pub png: Option<PathBuf>,
    /// Write the interactive page (one self-contained HTML file).
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
    /// Write the weights and tokens as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write attention.png, attention.html and attention.json into DIR.
    #[arg(long, value_name = "DIR")]
    pub out: Option<PathBuf>,
    /// Print per-head statistics: row entropy, mean attention distance, weight on the
    /// previous, same and first token, and position-or-content (against a shuffled input).
    #[arg(long)]
    pub stats: bool,
    /// Seed of the shuffle behind --stats.
    #[arg(long, default_value_t = 1337)]
    pub seed: u64,
    #[command(flatten)]
    pub compute: ComputeArgs,
}

/// `explain` options.
#[derive(Args, Debug)]
pub struct ExplainArgs {
    /// A trained text model (language model, classifier, or a translator's encoder): walk
    /// through one of its real heads on TEXT instead of the small matrices.
    #[arg(long, value_name = "DIR", requires = "text")]
    pub artifact_dir: Option<PathBuf>,
    /// The text for --artifact-dir.
    #[arg(requires = "artifact_dir")]
    pub text: Option<String>,
    /// Layer of the head (from 0), with --artifact-dir.
    #[arg(long, default_value_t = 0)]
    pub layer: usize,
    /// Head within the layer (from 0), with --artifact-dir.
    #[arg(long, default_value_t = 0)]
    pub head: usize,
    /// Input tokens X, one row per token.
    #[arg(long, default_value = crate::explain::DEFAULT_X, allow_hyphen_values = true)]
    pub x: String,
    /// Query projection W_Q.
    #[arg(long, default_value = crate::explain::DEFAULT_WQ, allow_hyphen_values = true)]
    pub wq: String,
    /// Key projection W_K.
    #[arg(long, default_value = crate::explain::DEFAULT_WK, allow_hyphen_values = true)]
    pub wk: String,
    /// Value projection W_V.
    #[arg(long, default_value = crate::explain::DEFAULT_WV, allow_hyphen_values = true)]
    pub wv: String,
    #[command(flatten)]
    pub compute: ComputeArgs,
}
