//! Certificates for TLS tests, made with openssl: a CA, a server certificate for 127.0.0.1
//! (or another address) and a client certificate.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{path::PathBuf, process::Command};

/// A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl.
pub struct Pki {
    dir: PathBuf,
    _temporary: Option<tempfile::TempDir>,
}

impl Pki {
    /// Makes them in a temporary directory.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        let temporary = tempfile::tempdir().unwrap();
        let dir = temporary.path().to_path_buf();
        make(&dir, "127.0.0.1");
        Self {
            dir,
            _temporary: Some(temporary),
        }
    }

    /// The certificates kept in `dir`, the server's for `ip`: made there unless they already
    /// are (the test processes of one run share one CA; the caller serializes them).
    pub fn kept_in(dir: &std::path::Path, ip: &str) -> Self {
        if !dir.join("client.pem").is_file() {
            std::fs::create_dir_all(dir).unwrap();
            make(dir, ip);
        }
        Self {
            dir: dir.to_path_buf(),
            _temporary: None,
        }
    }

    /// A file of it: `ca.pem`, `server.pem`, `server.key`, `client.pem`, `client.key`.
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// [`Self::path`] as a string.
    pub fn arg(&self, file: &str) -> String {
        self.path(file).to_string_lossy().into_owned()
    }

    /// A nats-server `tls` block serving `server.pem`, checking clients when `verify_clients`.
    pub fn server_tls(&self, verify_clients: bool) -> String {
        format!(
            "tls {{ cert_file: {:?}, key_file: {:?}, ca_file: {:?}, verify: {verify_clients}, timeout: 5 }}",
            self.arg("server.pem"),
            self.arg("server.key"),
            self.arg("ca.pem"),
        )
    }
}

/// Makes the CA, a server certificate for `ip` and a client certificate in `dir`.
fn make(dir: &std::path::Path, ip: &str) {
    let run = |args: &[&str]| {
        let output = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("openssl (the tests need it, as the README says)");
        assert!(
            output.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    let curve = [
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
    ];
    run(&[
        &["req", "-x509", "-days", "1", "-subj", "/CN=eddy test CA"][..],
        &curve,
        &["-keyout", "ca.key", "-out", "ca.pem"],
    ]
    .concat());
    for (name, usage) in [("server", "serverAuth"), ("client", "clientAuth")] {
        std::fs::write(
            dir.join(format!("{name}.ext")),
            format!("subjectAltName=IP:{ip}\nextendedKeyUsage={usage}\n"),
        )
        .unwrap();
        run(&[
            &["req", "-subj", &format!("/CN={name}")][..],
            &curve,
            &[
                "-keyout",
                &format!("{name}.key"),
                "-out",
                &format!("{name}.csr"),
            ],
        ]
        .concat());
        run(&[
            "x509",
            "-req",
            "-days",
            "1",
            "-in",
            &format!("{name}.csr"),
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-extfile",
            &format!("{name}.ext"),
            "-out",
            &format!("{name}.pem"),
        ]);
    }
}

/// Serves `app` over HTTPS (HTTP/1.1) on a free port of `ip`, with `pki`'s server certificate
/// (made for that address), until the test ends. Its address.
pub async fn serve_tls(pki: &Pki, ip: &str, app: axum::Router) -> std::net::SocketAddr {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
    #[allow(clippy::expect_used)] // A harness that cannot serve fails the test it serves.
    let (listener, acceptor) = {
        let certs: Vec<CertificateDer<'static>> =
            CertificateDer::pem_file_iter(pki.path("server.pem"))
                .expect("the server certificate")
                .collect::<Result<_, _>>()
                .expect("the server certificate");
        let key = PrivateKeyDer::from_pem_file(pki.path("server.key")).expect("the server key");
        let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("the server certificate and key");
        let listener = tokio::net::TcpListener::bind((ip, 0))
            .await
            .expect("a free port");
        (
            listener,
            tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config)),
        )
    };
    #[allow(clippy::expect_used)]
    let addr = listener.local_addr().expect("the bound address");
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = hyper_util::service::TowerToHyperService::new(app);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    addr
}
