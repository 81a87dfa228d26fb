// What the Express and Fastify idempotency middlewares share (docs/clients.md, rule I):
// the decision a request gets from pg_once (I4) and the claim it runs under (I5, I8). The
// adapters (express.cjs, fastify.cjs) only move bytes between their framework and this.
'use strict';

const { OnceClient } = require('./client.cjs');
const { ClaimLost } = require('./errors.cjs');
const {
  defaultScope, entryKey, headerPairs, idempotencyOptions, parseKeyHeader, problem, replay, requestFingerprint, storedResponse,
  untrusted, untrustedEntry,
} = require('./idempotency.cjs');

const defaultOnError = (err) => console.warn(`pg-once idempotency: ${err?.message ?? err}`);

/**
 * One middleware's options and client. `check(method, headers)` says whether a request is
 * covered (I1); `begin(...)` claims it and answers `{ answer }` (a response to send as it
 * is), or `{ claim }` (a RequestClaim: run the handler).
 */
class Gate {
  #client = null; // Promise<OnceClient>
  #ownsClient = false;

  constructor(options) {
    this.options = idempotencyOptions(options);
    this.onError = this.options.onError ?? defaultOnError;
    if (this.options.client) this.#client = Promise.resolve(this.options.client);
  }

  /** The client, connected on first use when the middleware was given a connection string. */
  client() {
    if (!this.#client) {
      this.#ownsClient = true;
      this.#client = OnceClient.connect(this.options.connectionString, { onError: (err) => this.onError(err) });
      this.#client.catch(() => { this.#client = null; }); // the next request tries again
    }
    return this.#client;
  }

  /** Ends the client if this middleware made it (from connectionString). */
  async close() {
    if (this.#ownsClient && this.#client) await (await this.#client.catch(() => null))?.end();
  }

  /**
   * What a request is to the middleware before its body is read (I1): `{ pass: true }`
   * (not covered: hand it on untouched), `{ answer }` (400), or `{ key }`.
   */
  check(method, headers) {
    const o = this.options;
    if (!o.methods.has(method.toUpperCase())) return { pass: true };
    const value = headers[o.header];
    if (value === undefined) {
      if (!o.required) return { pass: true };
      return { answer: problem('key_missing', `This endpoint needs an ${o.header} header: a unique key per operation (e.g. a UUID), sent again with each retry of it.`) };
    }
    const key = parseKeyHeader(value);
    if (key === null) {
      return { answer: problem('key_invalid', `The ${o.header} header must be 1 to 255 visible ASCII characters (a structured-field string "..." is unquoted first).`) };
    }
    return { key };
  }

  /** The 413 answer for a request body past maxRequestBody. */
  tooLarge() {
    return problem('body_too_large', `The request body is over ${this.options.maxRequestBody} bytes, the most this endpoint reads to recognise a retry.`);
  }

  /**
   * Claim the request's entry (I2, I3, I4). `request` is the framework's, for the scope
   * function; `url` the raw request target; `body` the bytes the handler will get.
   */
  async begin({ key, method, url, headers, body, request }) {
    const o = this.options;
    const scope = o.scope ? o.scope(request) : defaultScope(headers.authorization);
    const entry = entryKey(o.namespace, scope ?? null, key, o.secret);
    const fingerprint = requestFingerprint(o, { method, url, body });
    const asked = await this.#claim(entry, fingerprint, o.inFlight === 'wait' ? o.wait : 0);
    if (asked.answer) return asked;
    return { claim: new RequestClaim(this, entry, key, fingerprint, asked.claim) };
  }

  /**
   * A request whose claim was lost before its response went out is answered as a
   * concurrent duplicate whose claim_key said 'wait' (I8, I4): 409 at once, or with
   * inFlight 'wait' the response of whoever took the key over, once stored.
   */
  async afterLost(entry, fingerprint) {
    const o = this.options;
    if (o.inFlight === 'conflict') return inFlight();
    const asked = await this.#claim(entry, fingerprint, o.wait);
    if (asked.answer) return asked.answer;
    await asked.claim.release(); // taken over, then given up: we cannot run the handler twice
    return inFlight();
  }

  /** claim_key and its answers (I4); `{ claim }` (a Claim) when it is ours. */
  async #claim(entry, fingerprint, wait) {
    let asked;
    try {
      const client = await this.client();
      asked = await client.claim(entry, { lease: this.options.lease, wait, fingerprint });
    } catch (err) {
      if (err instanceof TypeError || err instanceof RangeError) throw err; // ours to fix, not the server's
      this.onError(err);
      return { answer: problem('unavailable', 'The idempotency store (pg_once) cannot be reached; retry with the same key.', { retryAfter: 1 }) };
    }
    switch (asked.outcome) {
      case 'claimed': return { claim: asked.claim };
      case 'hit': {
        let why;
        try {
          why = untrusted(this.options, entry, fingerprint, asked.result);
        } catch (err) {
          // Whatever a planted entry makes the check throw, it is not what we wrote.
          why = `checking it threw ${err}`;
        }
        if (why === null) return { answer: replay(asked.result) };
        this.onError(new Error(`pg-once: not replaying the entry ${entry}: ${why}; something other than this middleware wrote it (a role with pg_once's rights in its key space?)`));
        return { answer: untrustedEntry(this.options.header) };
      }
      case 'mismatch':
        return { answer: problem('fingerprint_mismatch', 'This idempotency key was used with another request (method, path, query or body); use a new key for a new request.') };
      case 'failed': {
        const seconds = Math.max(1, Math.ceil((new Date(asked.retryAt).getTime() - Date.now()) / 1000));
        // The failure's text stays on the server: it may say more than a client should read.
        return { answer: problem('in_flight', `The work behind this idempotency key failed; retry with the same key after ${seconds} s.`, { retryAfter: seconds }) };
      }
      default: return { answer: inFlight() };
    }
  }
}

const inFlight = () => problem('in_flight', 'A request with this idempotency key is still being processed; retry with the same key shortly.', { retryAfter: 1 });

/**
 * The claim a request runs under: the framework's request carries it (`req.idempotency`,
 * `request.idempotency`) for the handler's complete() (I8). It ends exactly once: stored
 * by the middleware (finish), completed by the handler, or given back (abandon).
 */
class RequestClaim {
  #gate;
  #claim;
  #fingerprint;
  #completedByHandler = false;
  #settled = null; // the promise of how it ended

  constructor(gate, entry, idempotencyKey, fingerprint, claim) {
    this.#gate = gate;
    this.#claim = claim;
    this.#fingerprint = fingerprint;
    /** The pg_once key of this request's entry. */
    this.key = entry;
    /** The Idempotency-Key header's value. */
    this.idempotencyKey = idempotencyKey;
  }

  /** Aborts, with ClaimLost, when a heartbeat finds the claim taken over. */
  get signal() {
    return this.#claim.signal;
  }

  /**
   * Store the response `status`, `headers`, `body` as this request's result on
   * `pgClient`, the handler's own connection, inside its transaction, before it commits
   * (I8): the side effects and the stored response commit together. Throws ClaimLost when
   * the claim was taken over meanwhile: roll back then (the middleware answers as for a
   * concurrent duplicate). Send the same status, headers and body as the response.
   */
  async complete(pgClient, status, headers, body) {
    if (!Number.isInteger(status) || status < 100 || status > 999) throw new TypeError(`pg-once: complete: status must be an HTTP status code, got ${status}`);
    if (!(body === null || body === undefined || typeof body === 'string' || body instanceof Uint8Array)) {
      throw new TypeError('pg-once: complete: body is the bytes sent (a string, Buffer or Uint8Array): serialize it once (JSON.stringify) and send that same string');
    }
    if (this.#settled) throw new ClaimLost(this.key);
    const bytes = Buffer.from(body ?? '');
    const o = this.#gate.options;
    const stored = storedResponse(status, headerPairs(headers), bytes.length > o.maxBody ? null : bytes, this.#form());
    await this.#claim.completeOn(pgClient, stored, { ttl: o.ttl });
    this.#completedByHandler = true;
  }

  /**
   * The response went out (or is about to): store it (I5) unless the handler did (I8).
   * Resolves to null, or, when the claim turned out lost, to the answer a concurrent
   * duplicate gets (send it instead, if the response has not started).
   * `body`: the bytes collected, or null past maxBody or when the stream broke after its head.
   */
  finish(status, headers, body) {
    this.#settled ??= this.#finish(status, headers, body);
    return this.#settled;
  }

  /** The handler threw, or the response broke: give the claim back so that a retry runs (I5). */
  abandon() {
    this.#settled ??= this.#claim.release().then(() => null);
    return this.#settled;
  }

  /** The handler threw ClaimLost: nothing to give back; the answer for a duplicate. */
  lost() {
    this.#settled ??= this.#claim.release().then(() => this.#gate.afterLost(this.key, this.#fingerprint));
    return this.#settled;
  }

  /** What the stored form of this request's response is keyed with (I5). */
  #form() {
    const { storeCookies, secret } = this.#gate.options;
    return { storeCookies, secret, entry: this.key, fingerprint: this.#fingerprint };
  }

  async #finish(status, headers, body) {
    const o = this.#gate.options;
    // Completed in the handler's transaction: nothing to store. If that transaction rolled
    // back, the claim is still ours and goes back; if it committed, release answers false.
    if (this.#completedByHandler || !o.store(status)) {
      await this.#claim.release();
      return null;
    }
    if (this.#claim.lost) return this.#gate.afterLost(this.key, this.#fingerprint);
    const stored = storedResponse(status, headers, body, this.#form());
    try {
      await this.#claim.complete(stored, { ttl: o.ttl });
    } catch (err) {
      if (err instanceof ClaimLost) return this.#gate.afterLost(this.key, this.#fingerprint);
      if (err.code === '54000' && stored.body !== null) {
        // Past the server's once.max_result_size: stored without its body, as past maxBody.
        return this.#retryWithoutBody(stored);
      }
      this.#gate.onError(new Error(`pg-once: could not store the response of ${this.key} (a retry gets 409 until its lease ends): ${err.message}`, { cause: err }));
    }
    return null;
  }

  async #retryWithoutBody(stored) {
    try {
      const { status, headers } = stored;
      await this.#claim.complete(storedResponse(status, headers, null, this.#form()), { ttl: this.#gate.options.ttl });
    } catch (err) {
      if (err instanceof ClaimLost) return this.#gate.afterLost(this.key, this.#fingerprint);
      this.#gate.onError(err);
    }
    return null;
  }
}

module.exports = { Gate, RequestClaim };
