//! TLS for the dashboard's connections, as `pg_once_client` does it (rustls with the
//! `ring` provider, verifying as libpq's `sslmode` says). `pg_once_client::Conninfo`
//! parses the connection string, the `PG*` variables, `sslmode` and `sslrootcert`; its
//! connector is crate-private and its `connect()` drops notifications, which the LISTEN
//! connection needs, so the verifiers are mirrored here (clients/rust/src/tls.rs).

use pg_once_client::{Conninfo, RootCerts, SslMode};
use rustls::client::danger::ServerCertVerifier;
use rustls::client::WebPkiServerVerifier;
use std::sync::Arc;

pub type Connector = tokio_postgres_rustls::MakeRustlsConnect;

pub fn connector(conninfo: &Conninfo) -> Result<Connector, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mode = conninfo.ssl_mode();
    let verifier: Arc<dyn ServerCertVerifier> = match (mode, conninfo.root_certs()) {
        (SslMode::Disable | SslMode::Prefer, _) | (SslMode::Require, None) => {
            Arc::new(verify::Unverified(provider.clone()))
        }
        (SslMode::VerifyCa | SslMode::VerifyFull, None) => {
            return Err(format!(
                "sslmode={mode:?} needs the CA to trust: sslrootcert=<PEM file>"
            ))
        }
        (_, Some(roots)) => {
            let webpki = WebPkiServerVerifier::builder_with_provider(
                Arc::new(root_store(roots)?),
                provider.clone(),
            )
            .build()
            .map_err(|e| format!("sslrootcert: {e}"))?;
            if mode == SslMode::VerifyFull {
                webpki
            } else {
                Arc::new(verify::AnyName(webpki))
            }
        }
    };
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(tokio_postgres_rustls::MakeRustlsConnect::new(config))
}

fn root_store(roots: &RootCerts) -> Result<rustls::RootCertStore, String> {
    use rustls::pki_types::{pem::PemObject, CertificateDer};
    let mut store = rustls::RootCertStore::empty();
    match roots {
        RootCerts::File(path) => {
            let unreadable =
                |e: &dyn std::fmt::Display| format!("sslrootcert={}: {e}", path.display());
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| unreadable(&e))? {
                store
                    .add(cert.map_err(|e| unreadable(&e))?)
                    .map_err(|e| unreadable(&e))?;
            }
            if store.is_empty() {
                return Err(unreadable(&"no PEM certificate in it"));
            }
        }
        RootCerts::System => return Err("sslrootcert=system is not supported by pg-once-ui".into()),
    }
    Ok(store)
}

/// The two verifiers rustls does not have: libpq's unverified TLS and its `verify-ca`.
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
