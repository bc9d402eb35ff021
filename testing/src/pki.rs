//! Certificates for TLS tests, made with openssl: a CA, a server certificate for 127.0.0.1
//! and a client certificate.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{path::PathBuf, process::Command};

/// A CA, a server certificate for 127.0.0.1 and a client certificate, made with openssl.
pub struct Pki {
    dir: tempfile::TempDir,
}

impl Pki {
    /// Makes them in a temporary directory.
    #[allow(clippy::new_without_default)]
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let run = |args: &[&str]| {
            let output = Command::new("openssl")
                .args(args)
                .current_dir(dir.path())
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
                dir.path().join(format!("{name}.ext")),
                format!("subjectAltName=IP:127.0.0.1\nextendedKeyUsage={usage}\n"),
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
        Self { dir }
    }

    /// A file of it: `ca.pem`, `server.pem`, `server.key`, `client.pem`, `client.key`.
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
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
