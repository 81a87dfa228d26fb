// Errors pg-once throws. Every one carries the key it is about, so a caller that awaits
// many keys can tell which one went wrong, and a `kind`: the error's name in
// docs/clients.md's table, the same in the three clients.
'use strict';

/** Base class of the errors pg-once raises itself. */
class OnceError extends Error {
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
class OnceFailed extends OnceError {
  kind = 'Failed';

  constructor(key, error, retryAt) {
    super(`${key}: computation failed: ${error}`);
    this.key = key;
    this.error = error;
    this.retryAt = retryAt;
  }
}

/** Someone else kept computing the key for longer than the caller's `wait`. */
class OnceTimeout extends OnceError {
  kind = 'Timeout';

  constructor(key, waitSeconds) {
    super(`${key}: still being computed by another caller after waiting ${waitSeconds} s`);
    this.key = key;
    this.wait = waitSeconds;
  }
}

/**
 * The claim ended before the result was stored (its lease ran out and another caller took
 * the key over, or it was invalidated): the result is not stored, and not computed again.
 */
class ClaimLost extends OnceError {
  kind = 'ClaimLost';

  constructor(key) {
    super(`${key}: the claim was lost before the result was stored (lease ran out or the key was invalidated); the result was not stored`);
    this.key = key;
  }
}

/**
 * The result cannot go through the serializer unchanged (JSON by default: a Date, BigInt,
 * Map, Set, undefined, NaN or class instance would come back as something else). The
 * failure is shared with the other callers like any computation's.
 */
class NotSerializable extends OnceError {
  kind = 'NotSerializable';

  constructor(key, what, options) {
    super(`${key}: the result is not serializable: ${what}; return plain JSON values or pass serialize/deserialize`, options);
    this.key = key;
  }
}

/** The server refused to store the result (e.g. 54000, too large); `cause` is its error. */
class ResultRefused extends OnceError {
  kind = 'Refused';

  constructor(key, cause) {
    super(`${key}: the server refused the result (${cause.code ?? 'no SQLSTATE'}): ${cause.message}`, { cause });
    this.key = key;
    this.code = cause.code;
  }
}

/** The client is set up in a way that cannot work (e.g. LISTEN through a transaction pooler). */
class ConfigurationError extends OnceError {
  kind = 'Configuration';
}

module.exports = {
  OnceError, OnceFailed, OnceTimeout, ClaimLost, NotSerializable, ResultRefused, ConfigurationError,
};
