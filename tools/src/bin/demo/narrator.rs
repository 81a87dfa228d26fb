//! Timestamped narration: every line says how far into the current act it happened.

use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

/// Cloned into every request task; the clones share the start of the current act.
#[derive(Clone)]
pub struct Narrator {
    start: Arc<Mutex<Instant>>,
}

impl Narrator {
    pub fn new() -> Self {
        Narrator {
            start: Arc::new(Mutex::new(Instant::now())),
        }
    }

    /// Open an act: print its title and explanation, and restart the clock.
    pub async fn act(&self, title: &str, explanation: &str) {
        *self.start.lock().await = Instant::now();
        println!("\n\x1b[1m{title}\x1b[0m");
        for line in explanation.lines() {
            println!("  {line}");
        }
        println!();
    }

    /// Time since the current act began.
    pub async fn elapsed(&self) -> Duration {
        self.start.lock().await.elapsed()
    }

    pub async fn say(&self, line: impl AsRef<str>) {
        let t = self.elapsed().await;
        println!("  [+{:>6.3}s] {}", t.as_secs_f64(), line.as_ref());
    }
}
