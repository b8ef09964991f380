//! The image routes: `POST /v1/predict` (a ViT's class probabilities) and `POST /v1/zero-shot`
//! (a clip model's probabilities over any labels), each reading image files uploaded as
//! multipart/form-data — what `curl -F image=@digit.png` and a browser's form send.

use super::worker::{Ask, Upload};
use super::{ApiError, App};
use axum::extract::{FromRequest, Multipart, Request, State};
use axum::http::{header, StatusCode};
use axum::Json;
use serde_json::Value;
use std::sync::Arc;

/// Images one request may carry at most.
const MAX_IMAGES: usize = 64;

/// Whether the request's body is multipart/form-data.
pub fn is_multipart(request: &Request) -> bool {
    (request.headers().get(header::CONTENT_TYPE))
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("multipart/form-data"))
}

/// A multipart/form-data body, read whole: its text fields and its files.
pub struct Form {
    texts: Vec<(String, String)>,
    files: Vec<(String, Upload)>,
}

impl Form {
    /// Reads the body; a field not in `allowed`, or one the body limit cuts, is an error.
    pub async fn read(request: Request, allowed: &[&str]) -> Result<Self, ApiError> {
        let mut multipart = Multipart::from_request(request, &())
            .await
            .map_err(|e| ApiError::status(e.status(), e.body_text()))?;
        let mut form = Self {
            texts: Vec::new(),
            files: Vec::new(),
        };
        let broken = |e: axum::extract::multipart::MultipartError| {
            ApiError::status(
                e.status(),
                format!("cannot read the form: {}", e.body_text()),
            )
        };
        while let Some(field) = multipart.next_field().await.map_err(broken)? {
            let name = field.name().unwrap_or_default().to_string();
            if !allowed.contains(&name.as_str()) {
                return Err(ApiError::status(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    format!(
                        "unknown field `{name}`: this route reads {}",
                        allowed.join(", ")
                    ),
                ));
            }
            match field.file_name().map(str::to_string) {
                Some(file) => {
                    let bytes = field.bytes().await.map_err(broken)?.to_vec();
                    form.files.push((name, Upload { name: file, bytes }));
                }
                None => form.texts.push((name, field.text().await.map_err(broken)?)),
            }
        }
        Ok(form)
    }

    /// The text field `name` (once).
    pub fn text(&self, name: &'static str) -> Result<String, ApiError> {
        let mut given = self.texts.iter().filter(|(n, _)| n == name);
        match (given.next(), given.next()) {
            (Some((_, value)), None) => Ok(value.clone()),
            (None, _) => Err(ApiError::invalid(name, format!("the form has no `{name}`"))),
            (Some(_), Some(_)) => Err(ApiError::invalid(
                name,
                format!("the form gives `{name}` twice"),
            )),
        }
    }

    /// The files of field `name`: at least one, at most `most`.
    pub fn files(&mut self, name: &'static str, most: usize) -> Result<Vec<Upload>, ApiError> {
        let files: Vec<Upload> = std::mem::take(&mut self.files)
            .into_iter()
            .filter(|(n, _)| n == name)
            .map(|(_, file)| file)
            .collect();
        if files.is_empty() || files.len() > most {
            let want = if most == 1 {
                "one file".to_string()
            } else {
                format!("1 to {most} files")
            };
            return Err(ApiError::invalid(
                name,
                format!("give {want} as `{name}` (got {})", files.len()),
            ));
        }
        Ok(files)
    }
}

/// `POST /v1/predict`: form fields `model` and `image` (one or more files) → each image's
/// class probabilities.
pub async fn predict(
    State(app): State<Arc<App>>,
    request: Request,
) -> Result<Json<Value>, ApiError> {
    let mut form = Form::read(request, &["model", "image"]).await?;
    let model = form.text("model")?;
    let worker = app.worker(&model)?;
    let images = form.files("image", MAX_IMAGES)?;
    Ok(Json(worker.ask(&model, Ask::Predict { images }).await?))
}

/// `POST /v1/zero-shot`: form fields `model`, `labels` (comma-separated, e.g. "a shirt,a
/// shoe") and `image` (one or more files) → each image's probability over the labels.
pub async fn zero_shot(
    State(app): State<Arc<App>>,
    request: Request,
) -> Result<Json<Value>, ApiError> {
    let mut form = Form::read(request, &["model", "labels", "image"]).await?;
    let model = form.text("model")?;
    let worker = app.worker(&model)?;
    let labels: Vec<String> = (form.text("labels")?.split(','))
        .map(|l| l.trim().to_string())
        .collect();
    if labels.iter().any(String::is_empty) || labels.len() > 256 {
        return Err(ApiError::invalid(
            "labels",
            "give 1 to 256 comma-separated labels, none empty (\"a shirt,a shoe,a bag\")".into(),
        ));
    }
    let images = form.files("image", MAX_IMAGES)?;
    let ask = Ask::ZeroShot { images, labels };
    Ok(Json(worker.ask(&model, ask).await?))
}
