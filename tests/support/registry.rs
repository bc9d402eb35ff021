//! A private package registry for tests of Kyma's `serverless-package-registry-config`: npm's
//! registry protocol and PyPI's simple index, one package each, served only with a token.
#![allow(dead_code, clippy::unwrap_used)]

use serde_json::json;

/// A private package registry on `ip`, npm-compatible and PyPI-compatible (the simple
/// index), serving one package each and only to callers with its token: npm's bearer token,
/// pip's basic credentials. Returns its base URL and the paths it refused.
pub async fn serve(
    ip: &str,
    token: &'static str,
) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use axum::response::IntoResponse as _;
    use base64::Engine as _;
    use sha2::Digest as _;
    let work = tempfile::tempdir().unwrap();
    // The npm package: a tarball with package/package.json and package/index.js.
    let package = work.path().join("package");
    std::fs::create_dir_all(&package).unwrap();
    std::fs::write(
        package.join("package.json"),
        r#"{"name": "@eddy-private/greeting", "version": "1.0.0", "main": "index.js"}"#,
    )
    .unwrap();
    std::fs::write(
        package.join("index.js"),
        "exports.hello = (who) => `hello ${who}, from the private registry`;\n",
    )
    .unwrap();
    let tarball = work.path().join("greeting-1.0.0.tgz");
    let tarred = std::process::Command::new("tar")
        .args(["czf", tarball.to_str().unwrap(), "-C"])
        .arg(work.path())
        .arg("package")
        .status()
        .unwrap();
    assert!(tarred.success());
    let tarball = std::fs::read(&tarball).unwrap();
    let integrity = format!(
        "sha512-{}",
        base64::engine::general_purpose::STANDARD.encode(sha2::Sha512::digest(&tarball))
    );
    // The Python package: a pure wheel, zipped by Python's own zipfile.
    let wheel_path = work
        .path()
        .join("eddy_private_greeting-1.0.0-py3-none-any.whl");
    let zipped = std::process::Command::new("python3")
        .arg("-c")
        .arg(
            r#"import sys, zipfile
files = {
  "eddy_private_greeting/__init__.py": "def hello(who):\n    return f'hello {who}, from the private index'\n",
  "eddy_private_greeting-1.0.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: eddy-private-greeting\nVersion: 1.0.0\n",
  "eddy_private_greeting-1.0.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: eddy-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
}
records = [f"{name},," for name in files] + ["eddy_private_greeting-1.0.0.dist-info/RECORD,,"]
with zipfile.ZipFile(sys.argv[1], "w") as wheel:
    for name, text in files.items():
        wheel.writestr(name, text)
    wheel.writestr("eddy_private_greeting-1.0.0.dist-info/RECORD", "\n".join(records) + "\n")
"#,
        )
        .arg(&wheel_path)
        .status()
        .unwrap();
    assert!(zipped.success());
    let wheel = std::fs::read(&wheel_path).unwrap();
    let wheel_sha256: String = sha2::Sha256::digest(&wheel)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let listener = tokio::net::TcpListener::bind(format!("{ip}:0"))
        .await
        .unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let refused: std::sync::Arc<std::sync::Mutex<Vec<String>>> = Default::default();
    let kept = refused.clone();
    let basic = format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("eddy:{token}"))
    );
    let url = base.clone();
    let app = axum::Router::new().fallback(move |request: axum::extract::Request| {
        let (kept, url, tarball, wheel) = (kept.clone(), url.clone(), tarball.clone(), wheel.clone());
        let (integrity, wheel_sha256, basic) =
            (integrity.clone(), wheel_sha256.clone(), basic.clone());
        async move {
            let path = request.uri().path().to_owned();
            let authorization = request
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .unwrap_or_default()
                .to_owned();
            if authorization != format!("Bearer {token}") && authorization != basic {
                kept.lock().unwrap().push(path);
                return (http::StatusCode::UNAUTHORIZED, "a token is required").into_response();
            }
            match path.as_str() {
                "/@eddy-private%2fgreeting" | "/@eddy-private%2Fgreeting" | "/@eddy-private/greeting" => {
                    axum::Json(json!({
                        "name": "@eddy-private/greeting",
                        "dist-tags": {"latest": "1.0.0"},
                        "versions": {"1.0.0": {
                            "name": "@eddy-private/greeting", "version": "1.0.0", "main": "index.js",
                            "dist": {"tarball": format!("{url}/tarballs/greeting-1.0.0.tgz"), "integrity": integrity},
                        }},
                    }))
                    .into_response()
                }
                "/tarballs/greeting-1.0.0.tgz" => tarball.into_response(),
                "/simple/eddy-private-greeting/" | "/simple/eddy-private-greeting" => {
                    axum::response::Html(format!(
                        "<html><body><a href=\"{url}/wheels/eddy_private_greeting-1.0.0-py3-none-any.whl#sha256={wheel_sha256}\">eddy_private_greeting-1.0.0-py3-none-any.whl</a></body></html>"
                    ))
                    .into_response()
                }
                "/wheels/eddy_private_greeting-1.0.0-py3-none-any.whl" => wheel.into_response(),
                _ => http::StatusCode::NOT_FOUND.into_response(),
            }
        }
    });
    tokio::spawn(async move { axum::serve(listener, app).await });
    drop(work);
    (base, refused)
}
