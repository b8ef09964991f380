//! The models that answer one request at a time — translators, classifiers, ViTs, clip
//! models — each on its own thread, which loads the model and then runs what the HTTP handlers
//! send it, in order. Their routes: `/v1/translate`, `/v1/classify`, `/v1/attention`,
//! `/v1/embed`, and the image routes of [`super::upload`] (`/v1/predict`, `/v1/zero-shot`).
//!
//! Nothing a client sends is read as a path on this machine: an image is always an upload.

use super::upload::{is_multipart, Form};
use super::{ApiError, ApiJson, App};
use crate::artifact::ArtifactDir;
use crate::classify::{class_names, image_from_bytes, image_probabilities, text_probabilities};
use crate::config::{ClipConfig, ModelSection, VitConfig};
use crate::embed::word_vectors;
use crate::inspect::AttentionMaps;
use crate::kernels::LabBackend;
use crate::kinds::{clip_image_maps, clip_text_maps, vit_image_maps, zero_shot_pixels, AnyTrained};
use crate::translate::{translate_texts, SearchConfig};
use axum::extract::{FromRequest, Request, State};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use tokio::sync::oneshot;

/// What a worker is asked.
pub enum Ask {
    /// Translate each text (translators).
    Translate {
        /// The sentences.
        texts: Vec<String>,
        /// Beam size (1: greedy).
        beam: usize,
    },
    /// Class probabilities of each text (text classifiers).
    Classify {
        /// The texts.
        texts: Vec<String>,
    },
    /// The attention maps of every layer and head, as `attention --json` writes them.
    Attention {
        /// A text, or (ViT, clip) an uploaded image.
        input: Input,
        /// Translators: the target the decoder reads (default: its own translation).
        target: Option<String>,
    },
    /// A word's contextual vector in a sentence (any model that reads text).
    Embed {
        /// The sentence.
        sentence: String,
        /// The word (its first whole-word occurrence).
        word: String,
    },
    /// Class probabilities of each image (ViTs).
    Predict {
        /// The uploaded image files.
        images: Vec<Upload>,
    },
    /// Each image's probability over the labels (clip models).
    ZeroShot {
        /// The uploaded image files.
        images: Vec<Upload>,
        /// Any words.
        labels: Vec<String>,
    },
}

/// What the attention is of.
pub enum Input {
    /// A text (a translator's source).
    Text(String),
    /// An image file.
    Image(Upload),
}

/// An uploaded file.
pub struct Upload {
    /// Its file name, as the client gave it.
    pub name: String,
    /// Its contents.
    pub bytes: Vec<u8>,
}

type Reply = oneshot::Sender<Result<Value, String>>;

/// A worker as the handlers see it.
#[derive(Clone)]
pub struct WorkerHandle {
    jobs: SyncSender<(Ask, Reply)>,
    /// The kind of model it holds.
    pub kind: &'static str,
}

impl WorkerHandle {
    /// Asks the worker and waits for its answer (503 when its queue is full).
    pub async fn ask(&self, model: &str, ask: Ask) -> Result<Value, ApiError> {
        let (reply, answer) = oneshot::channel();
        match self.jobs.try_send((ask, reply)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                return Err(ApiError::busy(model))
            }
        }
        match answer.await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(message)) => Err(ApiError::invalid("input", message)),
            Err(_) => Err(ApiError::busy(model)),
        }
    }
}

/// Starts a worker thread on the artifact; returns once the model is loaded.
pub fn start<B: LabBackend>(
    name: &str,
    artifact: ArtifactDir,
    queue: usize,
    device: B::Device,
) -> anyhow::Result<WorkerHandle> {
    let (jobs, inbox) = sync_channel::<(Ask, Reply)>(queue.max(1));
    let (ready, loaded) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(format!("worker {name}"))
        .spawn(move || {
            let trained = match crate::kinds::load::<B>(&artifact, &device) {
                Ok(trained) => {
                    let _ = ready.send(Ok(trained.config().model.kind()));
                    trained
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            for (ask, reply) in inbox {
                // Translating and classifying read no attention weights (the fused kernels
                // run); the attention maps and the embeddings do.
                let answer = match ask {
                    Ask::Translate { .. }
                    | Ask::Classify { .. }
                    | Ask::Predict { .. }
                    | Ask::ZeroShot { .. } => {
                        crate::nn::without_weights(|| answer(&trained, ask, &device))
                    }
                    _ => answer(&trained, ask, &device),
                };
                let _ = reply.send(answer.map_err(|e| format!("{e:#}")));
            }
        })?;
    let kind = loaded
        .recv()
        .map_err(|_| anyhow::anyhow!("the worker of {name} stopped while loading"))??;
    Ok(WorkerHandle { jobs, kind })
}

fn answer<B: LabBackend>(
    trained: &AnyTrained<B>,
    ask: Ask,
    device: &B::Device,
) -> anyhow::Result<Value> {
    let kind = trained.config().model.kind();
    let wrong = |route: &str| anyhow::anyhow!("{route} is not for a {kind} model");
    match ask {
        Ask::Translate { texts, beam } => {
            let AnyTrained::Seq2seq(translator) = trained else {
                return Err(wrong("translate"));
            };
            let search = SearchConfig::resolve(beam, 0.6, None, translator.model.max_len())?;
            let max_tokens = translator.config.data.max_tokens;
            let (translations, _) = translate_texts(
                &translator.model,
                translator.tokenizers(),
                &texts,
                &search,
                32,
                max_tokens,
                device,
            )?;
            Ok(json!({"translations": translations}))
        }
        Ask::Classify { texts } => {
            let AnyTrained::Classifier(classifier) = trained else {
                return Err(wrong("classify"));
            };
            let classes = class_names(&classifier.config.data.dataset)?;
            let probabilities = floats(text_probabilities(classifier, &texts, device)?)?;
            let results: Vec<Value> = (probabilities.chunks(classes.len()))
                .map(|row| ranked(&classes, row))
                .collect();
            Ok(json!({"results": results}))
        }
        Ask::Predict { images } => {
            let AnyTrained::Vit(vit) = trained else {
                return Err(wrong("predict"));
            };
            let size = vit.config.model_as::<VitConfig>()?.image_size;
            let classes = class_names(&vit.config.data.dataset)?;
            let read = (images.iter())
                .map(|image| image_from_bytes(&image.bytes, &image.name, size))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let pixels: Vec<Vec<u8>> = read.iter().map(|r| r.pixels.clone()).collect();
            let probabilities = floats(image_probabilities(vit, &pixels, size, device))?;
            let results: Vec<Value> = (images.iter().zip(&read))
                .zip(probabilities.chunks(classes.len()))
                .map(|((image, read), row)| {
                    let mut result = ranked(&classes, row);
                    result["image"] = json!(image.name);
                    result["inverted"] = json!(read.inverted);
                    result
                })
                .collect();
            Ok(json!({"results": results}))
        }
        Ask::ZeroShot { images, labels } => {
            let AnyTrained::Clip(clip) = trained else {
                return Err(wrong("zero-shot"));
            };
            let size = clip.config.model_as::<ClipConfig>()?.image.image_size;
            let mut pixels = Vec::new();
            for image in &images {
                pixels.extend(image_from_bytes(&image.bytes, &image.name, size)?.pixels);
            }
            let probabilities = zero_shot_pixels(clip, &labels, &pixels, device)?;
            let results: Vec<Value> = (images.iter().zip(probabilities))
                .map(|(image, row)| {
                    let mut result = ranked(&labels, &row);
                    result["image"] = json!(image.name);
                    result
                })
                .collect();
            Ok(json!({"results": results}))
        }
        Ask::Attention { input, target } => {
            let maps = match input {
                Input::Image(image) => image_attention(trained, &image, device)?,
                // A ViT's or clip model's `attention` reads a path: never one a client sends.
                Input::Text(_) if kind == VitConfig::KIND => anyhow::bail!(
                    "a vit model's attention is over an image: send multipart/form-data with \
                     `model` and an `image` file"
                ),
                Input::Text(text) => match trained {
                    AnyTrained::Clip(clip) => clip_text_maps(clip, &text, device)?,
                    _ => trained.attention(&text, target.as_deref(), device)?,
                },
            };
            Ok(serde_json::from_str(&maps.to_json()?)?)
        }
        Ask::Embed { sentence, word } => {
            let model = trained.text_model()?;
            let Some(vectors) = word_vectors(&model, &sentence, &word, device)? else {
                anyhow::bail!("the word {word:?} is not in the sentence");
            };
            Ok(json!({
                "word": word, "tokens": vectors.tokens,
                "contextual": vectors.contextual, "static": vectors.static_,
            }))
        }
    }
}

/// The attention of a ViT or of a clip model's image encoder on an uploaded image.
fn image_attention<B: LabBackend>(
    trained: &AnyTrained<B>,
    image: &Upload,
    device: &B::Device,
) -> anyhow::Result<AttentionMaps> {
    match trained {
        AnyTrained::Vit(vit) => {
            let size = vit.config.model_as::<VitConfig>()?.image_size;
            let read = image_from_bytes(&image.bytes, &image.name, size)?;
            vit_image_maps(vit, &image.name, read.pixels, device)
        }
        AnyTrained::Clip(clip) => {
            let size = clip.config.model_as::<ClipConfig>()?.image.image_size;
            let read = image_from_bytes(&image.bytes, &image.name, size)?;
            clip_image_maps(clip, &image.name, read.pixels, device)
        }
        _ => {
            let kind = trained.config().model.kind();
            anyhow::bail!(
                "a {kind} model reads text, not images: send JSON {{\"model\", \"input\"}}"
            )
        }
    }
}

/// `{"label": the most probable, "probabilities": {name: p, ...}}` of one row.
fn ranked(names: &[String], row: &[f32]) -> Value {
    // Ties go to the first, as the commands rank them.
    let best = crate::classify::top_classes(row, 1)
        .first()
        .map_or(0, |t| t.0);
    let each: serde_json::Map<String, Value> = (names.iter().zip(row))
        .map(|(name, &p)| (name.clone(), json!(p)))
        .collect();
    json!({"label": names[best], "probabilities": each})
}

fn floats<B: LabBackend>(probabilities: burn::tensor::Tensor<B, 2>) -> anyhow::Result<Vec<f32>> {
    probabilities
        .into_data()
        .convert::<f32>()
        .to_vec()
        .map_err(|e| anyhow::anyhow!("cannot read probabilities: {e:?}"))
}

/// `POST /v1/translate`: `{"model", "texts": [...], "beam"?}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TranslateRequest {
    model: String,
    texts: Vec<String>,
    #[serde(default = "greedy")]
    beam: usize,
}

fn greedy() -> usize {
    1
}

/// `POST /v1/classify`: `{"model", "texts": [...]}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassifyRequest {
    model: String,
    texts: Vec<String>,
}

/// `POST /v1/attention`: `{"model", "input", "target"?}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionRequest {
    model: String,
    input: String,
    target: Option<String>,
    /// A language model's input longer than its context is cut to its last `context` tokens:
    /// the window the model attends over as it writes the next token.
    #[serde(default)]
    window: bool,
}

/// `POST /v1/embed`: `{"model", "sentence", "word"}`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbedRequest {
    model: String,
    sentence: String,
    word: String,
}

fn non_empty(texts: &[String]) -> Result<(), ApiError> {
    if texts.is_empty() || texts.len() > 256 {
        return Err(ApiError::invalid(
            "texts",
            format!("give 1 to 256 texts (got {})", texts.len()),
        ));
    }
    Ok(())
}

/// `POST /v1/translate`.
pub async fn translate(
    State(app): State<Arc<App>>,
    ApiJson(request): ApiJson<TranslateRequest>,
) -> Result<Json<Value>, ApiError> {
    non_empty(&request.texts)?;
    if !(1..=16).contains(&request.beam) {
        return Err(ApiError::invalid(
            "beam",
            format!("beam must be 1 to 16, got {}", request.beam),
        ));
    }
    let worker = app.worker(&request.model)?;
    let ask = Ask::Translate {
        texts: request.texts,
        beam: request.beam,
    };
    Ok(Json(worker.ask(&request.model, ask).await?))
}

/// `POST /v1/classify`.
pub async fn classify(
    State(app): State<Arc<App>>,
    ApiJson(request): ApiJson<ClassifyRequest>,
) -> Result<Json<Value>, ApiError> {
    non_empty(&request.texts)?;
    let worker = app.worker(&request.model)?;
    let ask = Ask::Classify {
        texts: request.texts,
    };
    Ok(Json(worker.ask(&request.model, ask).await?))
}

/// `POST /v1/attention`: JSON `{"model", "input", "target"?}`, or for an image
/// multipart/form-data with `model` and one `image` file.
pub async fn attention(
    State(app): State<Arc<App>>,
    request: Request,
) -> Result<Json<Value>, ApiError> {
    let (model, ask) = if is_multipart(&request) {
        let mut form = Form::read(request, &["model", "image"]).await?;
        let mut images = form.files("image", 1)?;
        let input = Input::Image(images.remove(0));
        let target = None;
        (form.text("model")?, Ask::Attention { input, target })
    } else {
        let ApiJson(request) = ApiJson::<AttentionRequest>::from_request(request, &()).await?;
        let input = match request.window {
            true => Input::Text(app.model(&request.model)?.window(request.input)?),
            false => Input::Text(request.input),
        };
        let target = request.target;
        (request.model, Ask::Attention { input, target })
    };
    let worker = app.worker(&model)?;
    Ok(Json(worker.ask(&model, ask).await?))
}

/// `POST /v1/embed`.
pub async fn embed(
    State(app): State<Arc<App>>,
    ApiJson(request): ApiJson<EmbedRequest>,
) -> Result<Json<Value>, ApiError> {
    let worker = app.worker(&request.model)?;
    let ask = Ask::Embed {
        sentence: request.sentence,
        word: request.word,
    };
    Ok(Json(worker.ask(&request.model, ask).await?))
}
