//! The commands that use one kind of trained model on the user's input: `generate` (language
//! model), `translate` (translator), `predict` (ViT), `classify` (text classifier), `fill-mask`
//! (masked language model), and `embed` (any text model).

use super::texts_or_stdin;
use crate::artifact::ArtifactDir;
use crate::classify::{
    class_names, image_probabilities, load_image, text_probabilities, top_classes,
};
use crate::cli::{
    ClassifyArgs, EmbedArgs, FillMaskArgs, GenerateArgs, PredictArgs, ServeArgs, TranslateArgs,
    ZeroShotArgs,
};
use crate::config::{ClassifierConfig, ClipConfig, LmConfig, MlmConfig, Seq2SeqConfig, VitConfig};
use crate::embed::{best_threshold, cosine, read_pairs, word_vectors};
use crate::generate::{check_prompt, generate, Decoding, Penalties, Sampling};
use crate::kernels::LabBackend;
use crate::kinds::{fill_mask, load_as, zero_shot};
use crate::serve::ServeOptions;
use crate::translate::{translate_texts, warn_truncated, SearchConfig};
use anyhow::{bail, Context, Result};
use std::io::Write;

pub(super) fn run_generate<B: LabBackend>(args: GenerateArgs, device: B::Device) -> Result<()> {
    let sampling = Sampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        greedy: args.greedy,
        penalties: Penalties {
            repetition: args.repetition_penalty,
            frequency: args.frequency_penalty,
            presence: args.presence_penalty,
            bias: Vec::new(),
        },
    };
    sampling.validate()?;
    let trained = load_as::<LmConfig, B>(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let tokenizer = trained.tokenizer();
    let prompt_text = match args.prompt {
        Some(text) => text,
        None if tokenizer.encode("\n").is_ok() => "\n".to_string(),
        None => tokenizer.decode(&[0]),
    };
    let prompt = tokenizer.encode(&prompt_text)?;
    let lm = trained.config.model_as::<LmConfig>()?;
    check_prompt(prompt.len(), lm.context, lm.position)?;
    let mut out = std::io::stdout().lock();
    write!(out, "{prompt_text}")?;
    out.flush()?;
    generate(
        &trained.model,
        &prompt,
        args.max_new_tokens,
        &sampling,
        args.seed,
        if args.no_cache {
            Decoding::Recompute
        } else {
            Decoding::Cached
        },
        &device,
        |token, _| {
            write!(out, "{}", tokenizer.decode(&[token]))?;
            out.flush()?;
            Ok(())
        },
    )?;
    writeln!(out)?;
    Ok(())
}

pub(super) fn run_serve<B: LabBackend>(args: ServeArgs, device: B::Device) -> Result<()> {
    if !(args.grace >= 0.0 && args.grace.is_finite()) {
        bail!(
            "--grace must be a number of seconds >= 0, got {}",
            args.grace
        );
    }
    crate::serve::serve::<B>(
        ServeOptions {
            artifacts: args.artifact_dirs,
            host: args.host,
            port: args.port,
            api_key: args.api_key.filter(|k| !k.is_empty()),
            max_batch: args.max_batch,
            queue: args.queue,
            max_tokens: args.max_tokens,
            max_body: args.max_body,
            grace: std::time::Duration::from_secs_f64(args.grace),
        },
        device,
    )
}

pub(super) fn run_translate<B: LabBackend>(args: TranslateArgs, device: B::Device) -> Result<()> {
    let translator = load_as::<Seq2SeqConfig, B>(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let search = SearchConfig::resolve(
        args.search.beam,
        args.search.length_penalty,
        args.search.max_len,
        translator.model.max_len(),
    )?;
    let search = SearchConfig {
        cached: !args.search.no_cache,
        ..search
    };
    let texts = texts_or_stdin(args.texts)?;
    let max_tokens = translator.config.data.max_tokens;
    let (translations, truncated) = translate_texts(
        &translator.model,
        translator.tokenizers(),
        &texts,
        &search,
        args.batch_size,
        max_tokens,
        &device,
    )?;
    warn_truncated(&truncated, max_tokens);
    let mut out = std::io::stdout().lock();
    for line in translations {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

pub(super) fn run_predict<B: LabBackend>(args: PredictArgs, device: B::Device) -> Result<()> {
    let trained = load_as::<VitConfig, B>(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let size = trained.config.model_as::<VitConfig>()?.image_size;
    let classes = class_names(&trained.config.data.dataset)?;
    let prepared = args
        .images
        .iter()
        .map(|path| load_image(path, size))
        .collect::<Result<Vec<_>>>()?;
    let pixels: Vec<Vec<u8>> = prepared.iter().map(|p| p.pixels.clone()).collect();
    let probabilities = image_probabilities(&trained, &pixels, size, &device)
        .into_data()
        .into_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("cannot read probabilities: {e:?}"))?;
    for ((path, image), row) in args
        .images
        .iter()
        .zip(&prepared)
        .zip(probabilities.chunks(classes.len()))
    {
        let top: Vec<String> = top_classes(row, args.top as usize)
            .into_iter()
            .map(|(class, p)| format!("{} {:.1}%", classes[class], 100.0 * p))
            .collect();
        let note = if image.inverted {
            " (inverted: light background)"
        } else {
            ""
        };
        println!("{}: {}{note}", path.display(), top.join(", "));
    }
    Ok(())
}

pub(super) fn run_zero_shot<B: LabBackend>(args: ZeroShotArgs, device: B::Device) -> Result<()> {
    let labels: Vec<String> = args.labels.iter().map(|l| l.trim().to_string()).collect();
    let trained = load_as::<ClipConfig, B>(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let probabilities = zero_shot(&trained, &labels, &args.images, &device)?;
    let width = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0);
    for (path, row) in args.images.iter().zip(probabilities) {
        println!("{}:", path.display());
        let mut order: Vec<usize> = (0..labels.len()).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        for i in order {
            println!("  {:<width$}  {:5.1}%", labels[i], 100.0 * row[i]);
        }
    }
    Ok(())
}

pub(super) fn run_classify<B: LabBackend>(args: ClassifyArgs, device: B::Device) -> Result<()> {
    let trained = load_as::<ClassifierConfig, B>(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let classes = class_names(&trained.config.data.dataset)?;
    let texts = texts_or_stdin(args.texts)?;
    if texts.is_empty() {
        bail!("no text to classify: give TEXT arguments or lines on stdin");
    }
    let probabilities = text_probabilities(&trained, &texts, &device)?
        .into_data()
        .into_vec::<f32>()
        .map_err(|e| anyhow::anyhow!("cannot read probabilities: {e:?}"))?;
    let mut out = std::io::stdout().lock();
    for (text, row) in texts.iter().zip(probabilities.chunks(classes.len())) {
        let (class, p) = top_classes(row, 1)[0];
        writeln!(out, "{}	{:.3}	{text}", classes[class], p)?;
    }
    Ok(())
}

pub(super) fn run_fill_mask<B: LabBackend>(args: FillMaskArgs, device: B::Device) -> Result<()> {
    let trained = load_as::<MlmConfig, B>(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let texts = texts_or_stdin(args.texts)?;
    if texts.is_empty() {
        bail!("no text to fill in: give TEXT arguments with [MASK], or lines on stdin");
    }
    let mut out = std::io::stdout().lock();
    for text in &texts {
        let filled = fill_mask(&trained, text, args.top as usize, &device)?;
        writeln!(out, "{text}")?;
        for mask in filled {
            let tokens: Vec<String> = (mask.tokens.iter())
                .map(|(token, p)| format!("{token:?} {p:.3}"))
                .collect();
            writeln!(out, "  [MASK] {}: {}", mask.index + 1, tokens.join("  "))?;
        }
    }
    Ok(())
}

pub(super) fn run_embed<B: LabBackend>(args: EmbedArgs, device: B::Device) -> Result<()> {
    let trained = crate::kinds::load::<B>(&ArtifactDir::new(&args.artifact_dir), &device)?;
    let model = trained.text_model()?;
    if let Some(path) = &args.pairs {
        return run_pairs(&model, path, &device);
    }
    let word = args.word.clone().unwrap_or_default();
    let mut vectors = Vec::new();
    let mut lacking = Vec::new();
    for (i, sentence) in args.sentences.iter().enumerate() {
        match word_vectors(&model, sentence, &word, &device)? {
            Some(v) => vectors.push(v),
            None => lacking.push(format!("{} {sentence:?}", i + 1)),
        }
    }
    if !lacking.is_empty() {
        bail!(
            "the word {:?} is not in sentence {}",
            word,
            lacking.join(", sentence ")
        );
    }
    let d = vectors[0].contextual.len();
    let shown = if args.dims == 0 { d } else { args.dims.min(d) };
    println!(
        "contextual vector of {:?} (first {shown} of {d} dimensions; mean over its tokens):",
        word
    );
    for (i, (sentence, v)) in args.sentences.iter().zip(&vectors).enumerate() {
        let values: Vec<String> = v.contextual[..shown]
            .iter()
            .map(|x| format!("{x:+.3}"))
            .collect();
        let more = if shown < d { " …" } else { "" };
        println!(
            "  [{}] {sentence}
      ({} token{}) [{}{more}]",
            i + 1,
            v.tokens,
            if v.tokens == 1 { "" } else { "s" },
            values.join(", ")
        );
    }
    println!("cosine similarity, contextual (static input embedding in brackets):");
    for i in 0..vectors.len() {
        for j in i + 1..vectors.len() {
            println!(
                "  [{}] vs [{}]: {:.3}  ({:.3})",
                i + 1,
                j + 1,
                cosine(&vectors[i].contextual, &vectors[j].contextual),
                cosine(&vectors[i].static_, &vectors[j].static_)
            );
        }
    }
    Ok(())
}

/// `embed --pairs`: the WiC protocol on a TSV of sense pairs.
fn run_pairs<B: LabBackend>(
    model: &crate::inspect::TextModel<'_, B>,
    path: &std::path::Path,
    device: &B::Device,
) -> Result<()> {
    let pairs = read_pairs(path)?;
    let (mut contextual, mut fixed) = (Vec::new(), Vec::new());
    let mut out = std::io::stdout().lock();
    let same = pairs.iter().filter(|p| p.same).count();
    writeln!(
        out,
        "{} pairs ({same} same sense, {} different) from {}",
        pairs.len(),
        pairs.len() - same,
        path.display()
    )?;
    writeln!(out, "  cosine  static  sense      pair")?;
    let cut = |s: &str| -> String {
        match s.char_indices().nth(40) {
            Some((at, _)) => format!("{}…", &s[..at]),
            None => s.to_string(),
        }
    };
    for pair in &pairs {
        let vectors = |sentence: &str| -> Result<crate::embed::WordVectors> {
            word_vectors(model, sentence, &pair.word, device)?
                .with_context(|| format!("{:?} is not in {sentence:?}", pair.word))
        };
        let (a, b) = (vectors(&pair.a)?, vectors(&pair.b)?);
        contextual.push(cosine(&a.contextual, &b.contextual));
        fixed.push(cosine(&a.static_, &b.static_));
        writeln!(
            out,
            "  {:6.3}  {:6.3}  {:<9}  {}: {} | {}",
            contextual.last().unwrap_or(&0.0),
            fixed.last().unwrap_or(&0.0),
            if pair.same { "same" } else { "different" },
            pair.word,
            cut(&pair.a),
            cut(&pair.b)
        )?;
    }
    let senses: Vec<bool> = pairs.iter().map(|p| p.same).collect();
    let mean = |want: bool| {
        let chosen: Vec<f64> = (contextual.iter().zip(&senses))
            .filter(|(_, &s)| s == want)
            .map(|(c, _)| *c)
            .collect();
        chosen.iter().sum::<f64>() / chosen.len().max(1) as f64
    };
    writeln!(
        out,
        "mean cosine: same sense {:.3}, different sense {:.3}",
        mean(true),
        mean(false)
    )?;
    let n = pairs.len() as f64;
    let (threshold, right) = best_threshold(&contextual, &senses);
    let (_, right_static) = best_threshold(&fixed, &senses);
    let chance = same.max(pairs.len() - same) as f64 / n;
    writeln!(
        out,
        "best single threshold (cosine ≥ {threshold:.3} → same sense): {:.1}% right ({right} of {}); \
         static embeddings: {:.1}%; always the commoner answer: {:.1}%",
        100.0 * right as f64 / n,
        pairs.len(),
        100.0 * right_static as f64 / n,
        100.0 * chance
    )?;
    Ok(())
}
