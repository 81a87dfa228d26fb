//! What a page shows, a page type with its filters: what the live updates re-query
//! (live.rs) and the pages render (pages.rs).

use crate::db::KeyFilter;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum View {
    Overview,
    Queues,
    Keys(KeyFilter),
    Dead(KeyFilter),
    Key(String),
}

impl View {
    /// The view a page's events are for: `page` and its filters, as in the page's URL.
    pub fn parse(page: &str, f: KeyFilter, key: Option<String>) -> Option<View> {
        Some(match page {
            "overview" => View::Overview,
            "queues" => View::Queues,
            "keys" => View::Keys(f),
            "dead" => View::Dead(f),
            "key" => View::Key(key?),
            _ => return None,
        })
    }

    /// Whether a notification with `payload` may change what the view shows.
    pub fn touched_by(&self, payload: &str) -> bool {
        match self {
            View::Key(k) => payload.is_empty() || payload == k || payload == digest(k),
            _ => true,
        }
    }
}

/// A key's SHA-256 in hex: what pg_once announces for keys of a namespace with
/// notify => 'digest'.
pub fn digest(key: &str) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_digest_is_the_hex_sha256_pg_once_announces() {
        // encode(once.key_hash('abc'), 'hex')
        assert_eq!(
            digest("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn a_key_page_is_touched_only_by_its_key_its_digest_or_everything() {
        let view = View::Key("a/b".into());
        assert!(view.touched_by("a/b"));
        assert!(view.touched_by(&digest("a/b")));
        assert!(view.touched_by(""));
        assert!(!view.touched_by("a/c"));
        assert!(View::Overview.touched_by("anything"));
    }
}
