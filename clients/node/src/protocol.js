// The pg_once statements every client sends through the pool, and the heartbeat.
// Each is one autocommit statement, sent unnamed (no prepared statement outlives it), so
// they work through PgBouncer in transaction mode. Durations are seconds, passed as
// numbers and turned into intervals by make_interval.
import { OnceError } from './errors.js';

export const HEARTBEAT_SQL = 'SELECT once.heartbeat_key($1, $2, lease => make_interval(secs => $3)) AS expires';
export const COMPLETE_SQL = 'SELECT once.complete_key($1, $2, $3::jsonb, ttl => make_interval(secs => $4)) AS stored';
// With stale/beta/jitter (pg_once 0.2.0); calls without them send COMPLETE_SQL, which
// older servers also take.
export const COMPLETE_FRESHNESS_SQL = `SELECT once.complete_key($1, $2, $3::jsonb, ttl => make_interval(secs => $4),
  stale => make_interval(secs => $5), beta => $6::float8, jitter => $7::float8) AS stored`;
export const FAIL_SQL = 'SELECT once.fail_key($1, $2, $3, retry_after => make_interval(secs => $4)) AS failed';
export const RELEASE_SQL = 'SELECT once.release_key($1, $2) AS released';

/**
 * Extends a claim's lease every lease/3 through the pool, so a computation may outlast
 * its lease; records `lost` when heartbeat_key says the claim is no longer ours. A beat
 * that fails (no connection) is reported and tried again at the next interval: the lease
 * is three intervals long.
 */
export class Heartbeat {
  lost = false;
  #timer = null;
  #stopped = false;

  constructor(query, onError, key, token, lease, onLost = () => {}) {
    const beat = async () => {
      try {
        const { rows: [{ expires }] } = await query(HEARTBEAT_SQL, [key, token, lease]);
        if (expires === null) {
          this.lost = true;
          this.#stopped = true;
          onLost();
        }
      } catch (err) {
        onError(new OnceError(`pg-once: heartbeat of ${key} failed: ${err.message}`, { cause: err }));
      }
      if (!this.#stopped) this.#timer = setTimeout(beat, (lease * 1000) / 3);
    };
    this.#timer = setTimeout(beat, (lease * 1000) / 3);
  }

  stop() {
    this.#stopped = true;
    clearTimeout(this.#timer);
  }
}
