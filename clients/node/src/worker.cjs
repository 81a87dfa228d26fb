// The queue worker loop (docs/clients.md): claim up to `concurrency` keys at once with
// claim_next(n => free slots, owner_pid => P), run the handler on each with a heartbeat,
// complete or fail each, wait for work with a short server-side wait when idle, and stop
// gracefully on SIGTERM/SIGINT or stop(): jobs in hand are finished (or, after
// stopTimeout, released so another worker takes them at once).
'use strict';

const os = require('node:os');
const { OnceError } = require('./errors.cjs');
const { describeError, isConnectionError, jitter, seconds } = require('./util.cjs');
const { serializer, toText } = require('./values.cjs');
const { Heartbeat, COMPLETE_SQL, FAIL_SQL, RELEASE_SQL } = require('./protocol.cjs');

const claimNextSql = ({ owner, wait }) => `
SELECT key, token, payload, attempt
  FROM once.claim_next($1, lease => make_interval(secs => $2), worker => $3, n => $4${
  wait ? ', wait => make_interval(secs => $5)' : ''}${owner ? `, owner_pid => $${wait ? 6 : 5}` : ''})`;

class Worker {
  #queue;
  #handler;
  #o;
  #ops;
  #active = new Map(); // token -> job state
  #stopping = false;
  #stopTimeout;
  #poke = null; // wakes the loop early: a slot freed, or stop()
  #signals = [];
  #done;
  /** Jobs completed, failed (handler threw or result unstorable), released at stop, lost (lease taken over). */
  stats = { completed: 0, failed: 0, released: 0, lost: 0 };

  constructor(queue, handler, options, ops) {
    if (typeof queue !== 'string' || !queue) throw new TypeError('pg-once: work(queue, ...) needs a queue name');
    if (typeof handler !== 'function') throw new TypeError('pg-once: work(queue, handler) needs a handler function');
    const {
      concurrency = 1, lease, ttl, retryAfter = 0, idleWait = 1, stopTimeout = 30,
      worker = `${os.hostname()}:${process.pid}`, handleSignals = true, signal, serialize, deserialize,
    } = options;
    if (!Number.isInteger(concurrency) || concurrency < 1 || concurrency > 1000) {
      throw new TypeError(`pg-once: concurrency must be an integer from 1 to 1000, got ${concurrency}`);
    }
    this.#queue = queue;
    this.#handler = handler;
    this.#ops = ops;
    this.#o = {
      concurrency,
      worker,
      lease: seconds('lease', lease),
      ttl: seconds('ttl', ttl, { allowNull: true }),
      // A queue's own backoff applies on top of this (fail_key uses the larger).
      retryAfter: seconds('retryAfter', retryAfter, { allowZero: true }),
      idleWait: seconds('idleWait', idleWait),
      // The client's unless the worker has its own: the readers of these keys deserialize them.
      serializer: serialize === undefined ? options.serializer : serializer({ serialize, deserialize }),
    };
    this.#stopTimeout = seconds('stopTimeout', stopTimeout, { allowZero: true });
    if (handleSignals) {
      for (const sig of ['SIGTERM', 'SIGINT']) {
        const onSignal = () => {
          if (!this.#stopping) {
            this.stop();
            return;
          }
          // A second signal while stopping: give up on a graceful stop, as if we had not
          // been listening at all.
          this.#removeSignalHandlers();
          process.kill(process.pid, sig);
        };
        process.on(sig, onSignal);
        this.#signals.push([sig, onSignal]);
      }
    }
    signal?.addEventListener('abort', () => this.stop(), { once: true });
    this.#done = this.#run().finally(() => this.#removeSignalHandlers());
    // An error that ends the loop also went to onError: not awaiting done must not crash
    // the process with an unhandled rejection.
    this.#done.catch(() => {});
  }

  /**
   * Resolves with `stats` once the worker has stopped and every job is finished or
   * released; rejects with the error that stopped it, if one did (W4).
   */
  get done() {
    return this.#done;
  }

  get stopping() {
    return this.#stopping;
  }

  /** Stop claiming; finish the jobs in hand (releasing those still running after `timeout` s). */
  stop({ timeout } = {}) {
    if (!this.#stopping) {
      this.#stopping = true;
      if (timeout !== undefined) this.#stopTimeout = seconds('timeout', timeout, { allowZero: true });
      this.#poke?.();
    }
    return this.#done;
  }

  async #run() {
    let idle = false; // the last claim found nothing: wait for work on the server
    let fatal = null; // an error that retrying will not cure ends the loop (docs/clients.md, W4)
    while (!this.#stopping) {
      const free = this.#o.concurrency - this.#active.size;
      if (free === 0) {
        await this.#nap(60_000); // until a job ends (or stop)
        continue;
      }
      let rows;
      let caps;
      let owner = null;
      try {
        caps = await this.#ops.capabilities();
        owner = caps.claim_owner ? await this.#ops.owner() : null;
        const wait = idle && caps.claim_next_wait ? this.#o.idleWait : 0;
        const params = [this.#queue, this.#o.lease, this.#o.worker, free];
        if (caps.claim_next_wait) params.push(wait);
        if (owner !== null) params.push(owner);
        ({ rows } = await this.#ops.query(claimNextSql({ owner: owner !== null, wait: caps.claim_next_wait }), params));
      } catch (err) {
        if (err.code === '22023' && owner) {
          // Our listener may have just died (R3): asked again at once if it has a new pid.
          await this.#ops.verifyOwner();
          if ((await this.#ops.owner().catch(() => owner)) !== owner) continue;
        }
        if (!isConnectionError(err)) {
          fatal = new OnceError(`pg-once: the worker on ${this.#queue} stops: claim_next failed: ${err.message}`, { cause: err });
          this.#ops.onError(fatal);
          this.#stopping = true;
          break;
        }
        this.#ops.onError(new OnceError(`pg-once: claim_next on ${this.#queue} failed, trying again: ${err.message}`, { cause: err }));
        await this.#nap(jitter(1000));
        continue;
      }
      if (this.#stopping) {
        // Claimed while stop() was called: hand them straight back.
        await Promise.all(rows.map((row) => this.#release(row)));
        break;
      }
      for (const row of rows) this.#start(row);
      idle = rows.length === 0;
      // A server without claim_next(wait => ...): poll, interruptibly.
      if (idle && !caps.claim_next_wait) await this.#nap(jitter(this.#o.idleWait * 1000));
    }
    // Stopping: give the jobs in hand stopTimeout to finish, then release the rest.
    const deadline = Date.now() + this.#stopTimeout * 1000;
    while (this.#active.size > 0 && Date.now() < deadline) await this.#nap(deadline - Date.now());
    await Promise.all([...this.#active.values()].map((job) => {
      job.released = true;
      job.abort.abort(new OnceError('pg-once: worker stopped; the job was released'));
      return this.#release(job.row).then(() => job.settled);
    }));
    if (fatal) throw fatal;
    return this.stats;
  }

  #start(row) {
    const abort = new AbortController();
    const job = { row, abort, released: false, settled: null };
    const heartbeat = new Heartbeat(this.#ops.query, this.#ops.onError, row.key, row.token, this.#o.lease, () => {
      abort.abort(new OnceError(`pg-once: the claim on ${row.key} was lost`));
    });
    this.#active.set(row.token, job);
    const input = {
      key: row.key, token: row.token, payload: row.payload, attempt: row.attempt,
      queue: this.#queue, signal: abort.signal,
    };
    job.settled = (async () => {
      let value;
      try {
        value = await this.#handler(input);
      } catch (err) {
        heartbeat.stop();
        if (heartbeat.lost || job.released) return;
        await this.#finish(FAIL_SQL, [row.key, row.token, describeError(err), this.#o.retryAfter], row.key);
        this.stats.failed += 1;
        return;
      }
      heartbeat.stop();
      if (heartbeat.lost || job.released) {
        if (heartbeat.lost) this.#lostJob(row.key);
        return;
      }
      let json;
      try {
        json = toText(row.key, value, this.#o.serializer);
      } catch (err) {
        this.#ops.onError(err);
        await this.#finish(FAIL_SQL, [row.key, row.token, describeError(err), this.#o.retryAfter], row.key);
        this.stats.failed += 1;
        return;
      }
      const stored = await this.#finish(COMPLETE_SQL, [row.key, row.token, json, this.#o.ttl], row.key);
      if (stored === false) this.#lostJob(row.key);
      else if (stored === true) this.stats.completed += 1;
    })().finally(() => {
      this.#active.delete(row.token);
      this.#poke?.();
    });
  }

  /** complete_key / fail_key; returns its boolean, or undefined if it could not be sent. */
  async #finish(sql, params, key) {
    try {
      const { rows: [row] } = await this.#ops.query(sql, params);
      return Object.values(row)[0];
    } catch (err) {
      this.#ops.onError(new OnceError(`pg-once: could not finish ${key}: ${err.message}`, { cause: err }));
      if (sql === COMPLETE_SQL && !isConnectionError(err)) {
        // The server refused the value: fail the job rather than leave it claimed.
        await this.#finish(FAIL_SQL, [key, params[1], describeError(err), this.#o.retryAfter], key);
      }
      return undefined;
    }
  }

  /** A job whose claim ended before its result was stored (L2): counted and logged. */
  #lostJob(key) {
    this.stats.lost += 1;
    this.#ops.onError(new OnceError(`pg-once: the claim on job ${key} was lost (lease taken over or invalidated); its result was not stored`));
  }

  async #release(row) {
    try {
      await this.#ops.query(RELEASE_SQL, [row.key, row.token]);
      this.stats.released += 1;
    } catch (err) {
      this.#ops.onError(new OnceError(`pg-once: could not release ${row.key}: ${err.message}`, { cause: err }));
    }
  }

  /** Sleep up to `ms`, or until poked (a job ended, or stop()). */
  #nap(ms) {
    return new Promise((resolve) => {
      const done = () => {
        clearTimeout(timer);
        if (this.#poke === done) this.#poke = null;
        resolve();
      };
      const timer = setTimeout(done, ms);
      this.#poke = done;
    });
  }

  #removeSignalHandlers() {
    for (const [sig, fn] of this.#signals) process.removeListener(sig, fn);
    this.#signals = [];
  }
}

module.exports = { Worker };
