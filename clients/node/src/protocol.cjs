// The pg_once statements every client sends through the pool, and the heartbeat.
// Each is one autocommit statement, sent unnamed (no prepared statement outlives it), so
// they work through PgBouncer in transaction mode. Durations are seconds, passed as
// numbers and turned into intervals by make_interval.
'use strict';

const { OnceError } = require('./errors.cjs');

const HEARTBEAT_SQL = 'SELECT once.heartbeat_key($1, $2, lease => make_interval(secs => $3)) AS expires';
const COMPLETE_SQL = 'SELECT once.complete_key($1, $2, $3::jsonb, ttl => make_interval(secs => $4)) AS stored';
// With stale/beta/jitter (pg_once 0.2.0); calls without them send COMPLETE_SQL, which
// older servers also take.
const COMPLETE_FRESHNESS_SQL = `SELECT once.complete_key($1, $2, $3::jsonb, ttl => make_interval(secs => $4),
  stale => make_interval(secs => $5), beta => $6::float8, jitter => $7::float8) AS stored`;
const FAIL_SQL = 'SELECT once.fail_key($1, $2, $3, retry_after => make_interval(secs => $4)) AS failed';
const RELEASE_SQL = 'SELECT once.release_key($1, $2) AS released';

const INVALIDATE_SQL = 'SELECT once.invalidate_key($1) AS invalidated';
const REFRESH_SQL = 'SELECT once.refresh_key($1, stale => make_interval(secs => $2)) AS refreshed';
const ENQUEUE_SQL = `SELECT once.enqueue_key($1, $2::jsonb, queue => $3, priority => $4, run_at => $5::timestamptz,
  refresh => $6, max_attempts => $7) AS enqueued`;
// payloads: JSON texts (null for none), as text[], each element cast to jsonb.
const ENQUEUE_MANY_SQL = `SELECT key, outcome FROM once.enqueue_keys($1::text[], payloads => $2::text[]::jsonb[],
  queue => $3, priority => $4, run_at => $5::timestamptz, refresh => $6, max_attempts => $7)`;

/** After a beat that failed, the next one comes within this (ms) or lease/6, not lease/3 later. */
const HEARTBEAT_RETRY_MS = 1000;

/**
 * Extends a claim's lease every lease/3 through the pool, so a computation may outlast
 * its lease; records `lost` and calls onLost when heartbeat_key says the claim is no
 * longer ours. A beat that fails (no connection) is reported and tried again within a
 * second (or lease/6): waiting a full lease/3 would let two blips in a row lose the claim.
 */
class Heartbeat {
  lost = false;
  #timer = null;
  #stopped = false;

  constructor(query, onError, key, token, lease, onLost = () => {}) {
    const interval = (lease * 1000) / 3;
    const beat = async () => {
      let next = interval;
      try {
        const { rows: [{ expires }] } = await query(HEARTBEAT_SQL, [key, token, lease]);
        if (expires === null && !this.#stopped) {
          this.lost = true;
          this.#stopped = true;
          onLost();
        }
      } catch (err) {
        onError(new OnceError(`pg-once: heartbeat of ${key} failed: ${err.message}`, { cause: err }));
        next = Math.min(HEARTBEAT_RETRY_MS, interval / 2); // docs/clients.md, H2
      }
      if (!this.#stopped) this.#timer = setTimeout(beat, next);
    };
    this.#timer = setTimeout(beat, interval);
  }

  stop() {
    this.#stopped = true;
    clearTimeout(this.#timer);
  }
}

module.exports = {
  HEARTBEAT_SQL, COMPLETE_SQL, COMPLETE_FRESHNESS_SQL, FAIL_SQL, RELEASE_SQL, INVALIDATE_SQL, REFRESH_SQL, ENQUEUE_SQL, ENQUEUE_MANY_SQL,
  HEARTBEAT_RETRY_MS, Heartbeat,
};
