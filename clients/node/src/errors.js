// Errors pg-once throws. Every one carries the key it is about, so a caller that awaits
// many keys can tell which one went wrong.

/** Base class of the errors pg-once raises itself. */
export class OnceError extends Error {
  constructor(message, options) {
    super(message, options);
    this.name = new.target.name;
  }
}

/**
 * The key's last computation failed (in this process or another one) and the failure is
 * shared until `retryAt`: asking again before then gets the same error without
 * computing. `error` is the failing computation's error text.
 */
export class OnceFailed extends OnceError {
  constructor(key, error, retryAt) {
    super(`${key}: computation failed: ${error}`);
    this.key = key;
    this.error = error;
    this.retryAt = retryAt;
  }
}

/** Someone else kept computing the key for longer than the caller's `wait`. */
export class OnceTimeout extends OnceError {
  constructor(key, waitSeconds) {
    super(`${key}: still being computed by another caller after waiting ${waitSeconds} s`);
    this.key = key;
    this.wait = waitSeconds;
  }
}
