//! TLS for the pool and the LISTEN connection: rustls (with the `ring` provider) behind the
//! `tls` feature, on by default, verifying as libpq's `sslmode` says (see
//! [`crate::SslMode`]). Without the feature, `disable` and `prefer` connect in plain TCP
//! and the other modes are a configuration error.

use crate::error::{Error, Result};
use std::path::PathBuf;

/// libpq's `sslmode`. As in libpq, the default is `prefer`, and `require` with a
/// `sslrootcert` verifies the server's certificate chain as `verify-ca` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// Plain TCP only.
    Disable,
    /// TLS if the server offers it, unverified; plain TCP otherwise.
    Prefer,
    /// TLS, unverified (verified as `VerifyCa` when `sslrootcert` is given).
    Require,
    /// TLS with a certificate chain from a trusted CA, whatever name it is for.
    VerifyCa,
    /// TLS with a certificate from a trusted CA for the host connected to.
    VerifyFull,
}

impl std::str::FromStr for SslMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "prefer" | "allow" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(Error::Configuration(format!(
                    "sslmode={other:?}: expected disable, prefer, require, verify-ca or verify-full"
                )))
            }
        })
    }
}

/// The CAs a verified connection trusts: libpq's `sslrootcert`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCerts {
    /// A PEM file of one or more CA certificates.
    File(PathBuf),
    /// `sslrootcert=system`: the platform's trusted roots (the `native-roots` feature).
    System,
}

#[cfg(feature = "tls")]
pub type Connector = tokio_postgres_rustls::MakeRustlsConnect;
#[cfg(not(feature = "tls"))]
pub type Connector = tokio_postgres::NoTls;

#[cfg(not(feature = "tls"))]
pub(crate) fn connector(mode: SslMode, _roots: Option<&RootCerts>) -> Result<Connector> {
    match mode {
        SslMode::Disable | SslMode::Prefer => Ok(tokio_postgres::NoTls),
        _ => Err(Error::Configuration(format!(
            "sslmode={mode:?} needs TLS: build pg_once_client with its `tls` feature"
        ))),
    }
}

#[cfg(feature = "tls")]
pub(crate) fn connector(mode: SslMode, roots: Option<&RootCerts>) -> Result<Connector> {
    use rustls::client::danger::ServerCertVerifier;
    use rustls::client::WebPkiServerVerifier;
    use std::sync::Arc;

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier: Arc<dyn ServerCertVerifier> =
        match (mode, roots) {
            // libpq verifies nothing in these modes; `require` with a CA verifies the chain.
            (SslMode::Disable | SslMode::Prefer, _) | (SslMode::Require, None) => {
                Arc::new(verify::Unverified(provider.clone()))
            }
            (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
                return Err(Error::Configuration(format!(
                "sslmode={} needs the CA to trust: sslrootcert=<PEM file> (or sslrootcert=system \
                 for the platform's roots)",
                if mode == SslMode::VerifyCa { "verify-ca" } else { "verify-full" }
            )))
            }
            (_, Some(roots)) => {
                let webpki = WebPkiServerVerifier::builder_with_provider(
                    Arc::new(root_store(roots)?),
                    provider.clone(),
                )
                .build()
                .map_err(|e| Error::Configuration(format!("sslrootcert: {e}")))?;
                if mode == SslMode::VerifyFull {
                    webpki
                } else {
                    Arc::new(verify::AnyName(webpki))
                }
            }
        };
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Configuration(format!("TLS: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

#[cfg(feature = "tls")]
fn root_store(roots: &RootCerts) -> Result<rustls::RootCertStore> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut store = rustls::RootCertStore::empty();
    match roots {
        RootCerts::File(path) => {
            let unreadable = |e: &dyn std::fmt::Display| {
                Error::Configuration(format!("sslrootcert={}: {e}", path.display()))
            };
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| unreadable(&e))? {
                store
                    .add(cert.map_err(|e| unreadable(&e))?)
                    .map_err(|e| unreadable(&e))?;
            }
            if store.is_empty() {
                return Err(unreadable(&"no PEM certificate in it"));
            }
        }
        #[cfg(feature = "native-roots")]
        RootCerts::System => {
            let found = rustls_native_certs::load_native_certs();
            store.add_parsable_certificates(found.certs);
            if store.is_empty() {
                return Err(Error::Configuration(format!(
                    "sslrootcert=system: no trusted root found on this system ({:?})",
                    found.errors
                )));
            }
        }
        #[cfg(not(feature = "native-roots"))]
        RootCerts::System => {
            return Err(Error::Configuration(
                "sslrootcert=system needs pg_once_client's `native-roots` feature".into(),
            ))
        }
    }
    Ok(store)
}

/// The two verifiers rustls does not have: libpq's unverified TLS and its `verify-ca`.
#[cfg(feature = "tls")]
mod verify {
    use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
    use rustls::client::WebPkiServerVerifier;
    use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
    use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
    use rustls::{CertificateError, DigitallySignedStruct, Error, SignatureScheme};
    use std::sync::Arc;

    /// `sslmode=prefer` or `require` without a CA: encrypted, the certificate unchecked
    /// (the handshake's signatures still are).
    #[derive(Debug)]
    pub struct Unverified(pub Arc<CryptoProvider>);

    impl ServerCertVerifier for Unverified {
        fn verify_server_cert(
            &self,
            _: &CertificateDer<'_>,
            _: &[CertificateDer<'_>],
            _: &ServerName<'_>,
            _: &[u8],
            _: UnixTime,
        ) -> Result<ServerCertVerified, Error> {
            Ok(ServerCertVerified::assertion())
        }
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, Error> {
            verify_tls12_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }
        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, Error> {
            verify_tls13_signature(
                message,
                cert,
                dss,
                &self.0.signature_verification_algorithms,
            )
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.signature_verification_algorithms.supported_schemes()
        }
    }

    /// `sslmode=verify-ca`: the chain must lead to a trusted CA; the name is not checked.
    #[derive(Debug)]
    pub struct AnyName(pub Arc<WebPkiServerVerifier>);

    impl ServerCertVerifier for AnyName {
        fn verify_server_cert(
            &self,
            end_entity: &CertificateDer<'_>,
            intermediates: &[CertificateDer<'_>],
            server_name: &ServerName<'_>,
            ocsp: &[u8],
            now: UnixTime,
        ) -> Result<ServerCertVerified, Error> {
            match self
                .0
                .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
            {
                Err(Error::InvalidCertificate(
                    CertificateError::NotValidForName
                    | CertificateError::NotValidForNameContext { .. },
                )) => Ok(ServerCertVerified::assertion()),
                other => other,
            }
        }
        fn verify_tls12_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, Error> {
            self.0.verify_tls12_signature(message, cert, dss)
        }
        fn verify_tls13_signature(
            &self,
            message: &[u8],
            cert: &CertificateDer<'_>,
            dss: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, Error> {
            self.0.verify_tls13_signature(message, cert, dss)
        }
        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.0.supported_verify_schemes()
        }
    }
}
