//! The attention page in a real headless Chromium, driven through ChromeDriver's WebDriver
//! API: it loads without console errors, shows one panel per layer and head, draws each
//! query–key line with the exported weight as its opacity, and choosing another layer redraws
//! it with that layer's weights.
//!
//! Needs Debian's `chromium` and `chromium-driver` (`.ci/run` installs them). Without them the
//! test says so and passes, unless `CI_EXPECT_BROWSER` is set, as in CI, where it fails.

use crate::common::lm_artifact;
use burn::backend::NdArray;
use serde_json::{json, Value};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use transformer_lab::artifact::ArtifactDir;
use transformer_lab::inspect::html;

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A WebDriver session; the driver process dies with it.
pub struct Browser {
    agent: ureq::Agent,
    base: String,
    session: String,
    driver: Child,
}

impl Browser {
    pub fn start(profile: &Path) -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("chromedriver starts");
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            .build()
            .into();
        let base = format!("http://127.0.0.1:{port}");
        let began = Instant::now();
        loop {
            let ready = agent
                .get(&format!("{base}/status"))
                .call()
                .ok()
                .and_then(|mut r| r.body_mut().read_to_string().ok())
                .and_then(|t| serde_json::from_str::<Value>(&t).ok())
                .is_some_and(|v| v["value"]["ready"] == true);
            if ready {
                break;
            }
            assert!(
                began.elapsed() < Duration::from_secs(30),
                "chromedriver did not start"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut browser = Self {
            agent,
            base,
            session: String::new(),
            driver,
        };
        let args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            &format!("--user-data-dir={}", profile.display()),
        ];
        let created = browser.post(
            "/session",
            json!({"capabilities": {"alwaysMatch": {
                "browserName": "chrome",
                "goog:chromeOptions": {"binary": CHROMIUM, "args": args},
                "goog:loggingPrefs": {"browser": "ALL"}
            }}}),
        );
        browser.session = created["sessionId"]
            .as_str()
            .expect("a session")
            .to_string();
        browser
    }

    pub fn post(&self, path: &str, body: Value) -> Value {
        let url = if path == "/session" {
            format!("{}{path}", self.base)
        } else {
            format!("{}/session/{}{path}", self.base, self.session)
        };
        let text = self
            .agent
            .post(&url)
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .unwrap()
            .body_mut()
            .read_to_string()
            .unwrap();
        let value: Value = serde_json::from_str(&text).unwrap();
        assert!(
            value["value"]["error"].is_null(),
            "WebDriver {path}: {text}"
        );
        value["value"].clone()
    }

    pub fn script(&self, script: &str) -> Value {
        self.post("/execute/sync", json!({"script": script, "args": []}))
    }

    /// The browser's console messages since the last call.
    pub fn console(&self) -> Vec<Value> {
        self.post("/se/log", json!({"type": "browser"}))
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    fn element(&self, css: &str) -> String {
        let found = self.post("/element", json!({"using": "css selector", "value": css}));
        found
            .as_object()
            .and_then(|o| o.values().next())
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("no element {css}"))
            .to_string()
    }

    pub fn click(&self, css: &str) {
        let id = self.element(css);
        self.post(&format!("/element/{id}/click"), json!({}));
    }

    /// Types `text` into the element, key by key, as a user does.
    pub fn type_into(&self, css: &str, text: &str) {
        let id = self.element(css);
        self.post(&format!("/element/{id}/value"), json!({"text": text}));
    }

    /// Waits (up to a minute) until `script` returns `want`.
    pub fn wait_for(&self, script: &str, want: Value) {
        let began = Instant::now();
        loop {
            let got = self.script(script);
            if got == want {
                return;
            }
            assert!(
                began.elapsed() < Duration::from_secs(60),
                "waited a minute for {script} to give {want}; it gives {got}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The console's errors and warnings since the last read.
    pub fn errors(&self) -> Vec<Value> {
        (self.console().into_iter())
            .filter(|m| m["level"] == "SEVERE" || m["level"] == "WARNING")
            .collect()
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = self
                .agent
                .delete(&format!("{}/session/{}", self.base, self.session))
                .call();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// `[head, query, key, opacity]` of every line the head view draws.
const LINES: &str = "return Array.from(document.querySelectorAll('#head-view line')).map(l => \
    [Number(l.dataset.head), Number(l.dataset.query), Number(l.dataset.key), Number(l.getAttribute('stroke-opacity'))]);";

fn assert_lines_show(lines: &Value, weights: &[Vec<Vec<f32>>]) {
    let lines = lines.as_array().unwrap();
    let expected = weights
        .iter()
        .flatten()
        .flatten()
        .filter(|&&w| w >= 0.01)
        .count();
    assert_eq!(
        lines.len(),
        expected,
        "one line per weight of at least 0.01"
    );
    for line in lines {
        let v: Vec<f64> = line
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        let w = weights[v[0] as usize][v[1] as usize][v[2] as usize] as f64;
        assert!(
            (v[3] - w).abs() < 1e-4,
            "line {v:?} should have opacity {w}"
        );
    }
}

/// Whether Chromium and ChromeDriver are here; without them a test skips, saying so (in CI,
/// where `CI_EXPECT_BROWSER` is set, it fails).
pub fn have_browser() -> bool {
    if Path::new(CHROMEDRIVER).exists() && Path::new(CHROMIUM).exists() {
        return true;
    }
    assert!(
        std::env::var_os("CI_EXPECT_BROWSER").is_none(),
        "CI_EXPECT_BROWSER is set but {CHROMIUM} or {CHROMEDRIVER} is missing"
    );
    crate::common::skip("no browser: install Debian's chromium and chromium-driver");
    false
}

#[test]
fn the_attention_page_works_in_a_real_browser() {
    if !have_browser() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let text = "to be, or not to be: that is the question";
    lm_artifact(dir.path(), text);
    let model = transformer_lab::kinds::load::<NdArray<f32>>(
        &ArtifactDir::new(dir.path().join("lm")),
        &Default::default(),
    )
    .unwrap();
    let maps = model.attention(text, None, &Default::default()).unwrap();
    let page = dir.path().join("attention.html");
    std::fs::write(&page, html::page(&maps).unwrap()).unwrap();
    let weights = &maps.groups[0].weights;

    let browser = Browser::start(&dir.path().join("profile"));
    browser.post("/url", json!({"url": format!("file://{}", page.display())}));
    let errors = browser.errors();
    assert!(errors.is_empty(), "console errors on load: {errors:?}");

    let panels = browser.script("return document.querySelectorAll('#model-view .panel').length;");
    assert_eq!(panels, json!(2 * 4), "one panel per layer and head");
    let toggles = browser.script("return document.querySelectorAll('.head-toggle').length;");
    assert_eq!(toggles, json!(4), "one toggle per head");

    let layer0 = browser.script(LINES);
    assert_lines_show(&layer0, &weights[0]);
    browser.click("#layer option[value='1']");
    let layer1 = browser.script(LINES);
    assert_ne!(layer0, layer1, "choosing layer 1 redraws the head view");
    assert_lines_show(&layer1, &weights[1]);

    // The console check above can fail: an error raised now is seen.
    browser.script("console.error('sentinel');");
    let seen = browser.console();
    assert!(
        seen.iter()
            .any(|m| m["message"].as_str().unwrap_or("").contains("sentinel")),
        "the browser log is read: {seen:?}"
    );
}
