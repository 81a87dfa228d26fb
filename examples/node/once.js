// A small pg_once client for node-postgres (pg).
//
//   const once = await OnceClient.connect(process.env.PG_ONCE_DSN);
//   const page = await once.get(url, () => scrape(url), { ttl: 3600 });
//   const cachedScrape = once.cached(scrape, { key: (url) => url, ttl: 3600 });
//
// Two ways to wait for someone else's computation, as the README describes:
// - protocol "server" (default): claim_key(wait => ...) waits inside the server; one round
//   trip, works behind PgBouncer in transaction mode.
// - protocol "listen": LISTEN once first, then claim_key; on "wait", wait for the key's
//   notification (or the owner's lease to run out) and ask again.
// While computing, the lease is extended with heartbeat_key on a second connection.

import pg from 'pg';

export class OnceFailed extends Error {
  constructor(key, error, retryAt) {
    super(`${key}: ${error}`);
    Object.assign(this, { key, error, retryAt });
  }
}

export class ClaimLost extends Error {}

const CLAIM = `SELECT outcome, token, result, error, lease_expires_at, retry_at
                 FROM once.claim_key($1, make_interval(secs => $2), make_interval(secs => $3))`;

export class OnceClient {
  static async connect(connectionString, { lease = 30, wait = 30, protocol = 'server' } = {}) {
    if (!['server', 'listen'].includes(protocol)) throw new Error("protocol must be 'server' or 'listen'");
    const client = new pg.Client({ connectionString });
    await client.connect();
    const once = new OnceClient(connectionString, client, { lease, wait, protocol });
    if (protocol === 'listen') {
      client.on('notification', (n) => once.#notified(n));
      await client.query('LISTEN once');
    }
    return once;
  }

  #waiters = new Map(); // key -> [resolve]

  constructor(connectionString, client, { lease, wait, protocol }) {
    Object.assign(this, { connectionString, client, lease, wait, protocol });
  }

  async end() {
    await this.client.end();
  }

  // The cached result of `key`, computing it with `compute()` if nobody has.
  async get(key, compute, { ttl = null, retryAfter = 0 } = {}) {
    const deadline = Date.now() + this.wait * 1000;
    const serverWait = this.protocol === 'server' ? this.wait : 0;
    for (;;) {
      const remaining = Math.max(0, deadline - Date.now()) / 1000;
      // LISTEN-first: be ready for the key's notification before asking.
      const notified = this.protocol === 'listen' ? this.#nextNotification(key) : null;
      const { rows: [c] } = await this.client.query(CLAIM, [key, this.lease, Math.min(serverWait, remaining)]);
      if (c.outcome === 'hit') return c.result;
      if (c.outcome === 'failed') throw new OnceFailed(key, c.error, c.retry_at);
      if (c.outcome === 'claimed') return this.#compute(key, c.token, compute, ttl, retryAfter);
      if (remaining <= 0) throw new Error(`${key}: still being computed after ${this.wait} s`);
      if (notified) {
        // The key's notification, or the owner's lease running out, whichever comes first.
        const leaseLeft = Math.max(0, new Date(c.lease_expires_at) - Date.now());
        let timer;
        const expired = new Promise((r) => { timer = setTimeout(r, Math.min(leaseLeft, deadline - Date.now())); });
        await Promise.race([notified, expired]);
        clearTimeout(timer);
      }
    }
  }

  // Wrap `fn` so that its result is cached under key(...args).
  cached(fn, { key = (...args) => `${fn.name}:${JSON.stringify(args)}`, ttl = null, retryAfter = 0 } = {}) {
    return (...args) => this.get(key(...args), () => fn(...args), { ttl, retryAfter });
  }

  async #compute(key, token, compute, ttl, retryAfter) {
    const beat = new pg.Client({ connectionString: this.connectionString });
    await beat.connect();
    const timer = setInterval(() => {
      beat.query('SELECT once.heartbeat_key($1, $2, make_interval(secs => $3))', [key, token, this.lease]).catch(() => {});
    }, (this.lease * 1000) / 3);
    try {
      let value;
      try {
        value = await compute();
      } catch (err) {
        await this.client.query('SELECT once.fail_key($1, $2, $3, make_interval(secs => $4))',
          [key, token, `${err.name}: ${err.message}`, retryAfter]);
        throw err;
      }
      const { rows: [r] } = await this.client.query(
        'SELECT once.complete_key($1, $2, $3, make_interval(secs => $4)) AS stored',
        [key, token, JSON.stringify(value), ttl]);
      if (!r.stored) throw new ClaimLost(key);
      return value;
    } finally {
      clearInterval(timer);
      await beat.end();
    }
  }

  #nextNotification(key) {
    return new Promise((resolve) => {
      const list = this.#waiters.get(key) ?? [];
      list.push(resolve);
      this.#waiters.set(key, list);
    });
  }

  #notified({ channel, payload }) {
    if (channel !== 'once') return;
    for (const resolve of this.#waiters.get(payload) ?? []) resolve();
    this.#waiters.delete(payload);
  }
}
