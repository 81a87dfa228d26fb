// A claim held by the caller rather than by getOrCompute: what OnceClient.claim() hands
// over when claim_key answered 'claimed', for code that runs its own computation and
// stores its own result (the idempotency middleware, rule I). It heartbeats while held
// (H1), and ends exactly once: complete (through the pool, or on the caller's own
// connection inside its transaction, rule I8) or release.
'use strict';

const { ClaimLost, OnceError } = require('./errors.cjs');
const { COMPLETE_SQL, Heartbeat, RELEASE_SQL } = require('./protocol.cjs');
const { seconds } = require('./util.cjs');
const { serializer, toText } = require('./values.cjs');

const JSON_TEXT = serializer();

class Claim {
  #query;
  #onError;
  #heartbeat;
  #lost = new AbortController();
  #ended = false;

  /**
   * @param {string} key
   * @param {string} token  the fencing token claim_key answered (int8, as a string)
   * @param {number} lease  seconds; heartbeats extend it every lease/3
   * @param {{ query: Function, onError: Function }} io  the client's pooled, retried query
   */
  constructor(key, token, lease, { query, onError }) {
    this.key = key;
    this.token = token;
    this.#query = query;
    this.#onError = onError;
    this.#heartbeat = new Heartbeat(query, onError, key, token, lease, () => this.#lost.abort(new ClaimLost(key)));
  }

  /** Aborts (with ClaimLost) when a heartbeat finds the claim taken over (L1, L3). */
  get signal() {
    return this.#lost.signal;
  }

  /** Whether a heartbeat found the claim lost. */
  get lost() {
    return this.#lost.signal.aborted;
  }

  /** Whether complete or release was called (the heartbeats have stopped). */
  get ended() {
    return this.#ended;
  }

  /**
   * Store `value` (a JSON value, refused with NotSerializable otherwise) as the key's
   * result, fresh for `ttl` seconds (null: until invalidated), through the pool.
   * ClaimLost when the claim is no longer ours.
   */
  async complete(value, { ttl = null } = {}) {
    return this.#complete((sql, params) => this.#query(sql, params), value, ttl);
  }

  /**
   * The same on `pgClient`, the caller's own connection (a pg.Client or a client checked
   * out of a pg.Pool), typically inside the transaction that makes the side effects the
   * result describes: both commit together, and a ClaimLost here is the caller's cue to
   * roll back. A rollback after this undoes the completion too; release() then gives the
   * claim back (it answers false when the completion committed).
   */
  async completeOn(pgClient, value, { ttl = null } = {}) {
    if (typeof pgClient?.query !== 'function') {
      throw new TypeError('pg-once: completeOn(pgClient, ...) needs a pg.Client or a pooled client (something with query())');
    }
    return this.#complete((sql, params) => pgClient.query(sql, params), value, ttl);
  }

  /**
   * Give the claim back: the key becomes absent and the next caller claims it at once.
   * False when the claim was no longer ours (lost, or completed in a committed
   * transaction). A failure to send it is reported to onError, never thrown.
   */
  async release() {
    this.#end();
    try {
      const { rows: [{ released }] } = await this.#query(RELEASE_SQL, [this.key, this.token]);
      return released;
    } catch (err) {
      this.#onError(new OnceError(`pg-once: could not give back the claim on ${this.key}: ${err.message}`, { cause: err }));
      return false;
    }
  }

  async #complete(query, value, ttl) {
    const text = toText(this.key, value, JSON_TEXT);
    seconds('ttl', ttl, { allowNull: true });
    // No heartbeat from here on: complete_key locks the key's row, and a beat sent through
    // the pool meanwhile would wait for the caller's transaction, holding a connection.
    this.#end();
    const { rows: [{ stored }] } = await query(COMPLETE_SQL, [this.key, this.token, text, ttl]);
    if (!stored) throw new ClaimLost(this.key);
    return true;
  }

  #end() {
    this.#ended = true;
    this.#heartbeat.stop();
  }
}

module.exports = { Claim };
