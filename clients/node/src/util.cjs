// Small helpers shared by the client, the listener and the worker loop.
'use strict';

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/**
 * `promise`, or a rejection with `signal.reason` as soon as `signal` aborts, or with
 * `onTimeout()` after `ms`: how a call keeps its own bound while it awaits something it
 * shares with others (a computation, a notification). Timer and listener are removed
 * when it settles.
 */
function bounded(promise, { signal, ms, onTimeout } = {}) {
  if (!signal && ms === undefined) return promise;
  if (signal?.aborted) return Promise.reject(signal.reason);
  return new Promise((resolve, reject) => {
    let timer;
    const onAbort = () => settle(reject, signal.reason);
    const settle = (fn, v) => {
      clearTimeout(timer);
      signal?.removeEventListener('abort', onAbort);
      fn(v);
    };
    if (ms !== undefined) timer = setTimeout(() => settle(reject, onTimeout()), Math.max(0, ms));
    signal?.addEventListener('abort', onAbort, { once: true });
    promise.then((v) => settle(resolve, v), (e) => settle(reject, e));
  });
}

/** `ms` spread over ±25%, so that many processes that started together drift apart. */
const jitter = (ms) => ms * (0.75 + Math.random() * 0.5);

// SQLSTATE classes after which the same statement may simply be sent again on another
// connection: connection exceptions (08: also what PgBouncer reports when it loses a
// server connection) and the server shutting a backend down (57P01..57P03).
const RETRYABLE_SQLSTATE = /^(08...|57P0[123])$/;
const RETRYABLE_SOCKET = new Set(['ECONNRESET', 'ECONNREFUSED', 'EPIPE', 'ETIMEDOUT', 'EHOSTUNREACH', 'ECONNABORTED']);

/**
 * Whether `err` says the connection went away (rather than that the statement is wrong):
 * a pooled connection that PgBouncer or an administrator closed, a restarting server.
 */
function isConnectionError(err) {
  const code = err?.code;
  if (typeof code === 'string' && (RETRYABLE_SQLSTATE.test(code) || RETRYABLE_SOCKET.has(code))) return true;
  // node-postgres reports a socket that closed mid-query without a code.
  return !code && /Connection terminated|connection error|Connection timeout|timeout exceeded when trying to connect/i
    .test(String(err?.message));
}

/** The text stored with a failure, and shown to the callers it is shared with. */
function describeError(err) {
  const text = err instanceof Error ? (err.message ? `${err.name}: ${err.message}` : err.name) : String(err);
  // A stack-sized message is no use to the other callers and bloats the row.
  return text.length > 4000 ? `${text.slice(0, 4000)}…` : text;
}

/** Seconds (a number) as a positive millisecond count, refusing nonsense early. */
function seconds(name, value, { allowZero = false, allowNull = false } = {}) {
  if (value === null || value === undefined) {
    if (allowNull) return null;
    throw new TypeError(`pg-once: ${name} is required (seconds)`);
  }
  if (typeof value !== 'number' || !Number.isFinite(value) || value < 0 || (!allowZero && value === 0)) {
    throw new TypeError(`pg-once: ${name} must be a ${allowZero ? 'non-negative' : 'positive'} number of seconds, got ${value}`);
  }
  return value;
}

/**
 * The freshness options of a call (pg_once 0.2.0), checked before anything is claimed: the
 * server checks the same ranges (22023) in complete_key, but only after the computation,
 * which a typo would then cost, leaving the key failed for retryAfter.
 */
function freshness(stale, beta, jitter) {
  const number = (name, value, ok, range) => {
    if (value === null || value === undefined) return null;
    if (typeof value !== 'number' || !ok(value)) {
      throw new TypeError(`pg-once: ${name} must be ${range}, got ${value}`);
    }
    return value;
  };
  const opts = {
    stale: seconds('stale', stale, { allowZero: true, allowNull: true }),
    beta: number('beta', beta, (b) => b >= 0 && b <= 100, 'a number from 0 (off) to 100 (1 is XFetch\'s usual value)'),
    jitter: number('jitter', jitter, (j) => j >= 0 && j < 1, 'a number at least 0 and below 1 (a share of ttl)'),
  };
  return {
    ...opts,
    // Any of them given: complete_key gets them (else the pre-0.2 statement).
    freshness: opts.stale !== null || opts.beta !== null || opts.jitter !== null,
    // A stale window or early refreshes: the caller takes stale answers.
    serveStale: opts.stale !== null || Boolean(opts.beta),
  };
}

module.exports = { sleep, bounded, jitter, isConnectionError, describeError, seconds, freshness };
