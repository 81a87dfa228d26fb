// Types of pg-once, the node-postgres client of the pg_once PostgreSQL extension.
// Durations are seconds (numbers; fractions allowed).
import type { Pool, PoolConfig } from 'pg';

/** Anything JSON.stringify turns into JSON (what a computation may return). */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

export interface CallOptions {
  /** How long the result is served, in seconds; null (default) until invalidated. */
  ttl?: number | null;
  /** The claim's lease in seconds (default 30); heartbeats extend it every lease/3. */
  lease?: number;
  /** How long to wait for another caller's computation, in seconds (default 30). */
  wait?: number;
  /** How long a failure is shared before the key is computed again, in seconds (default 5). */
  retryAfter?: number;
  /** How often a waiting call asks the server again without a notification (default 1 s, jittered). */
  recheck?: number;
  /**
   * Stale-while-revalidate (pg_once 0.2.0; needs ttl): for this many seconds after ttl the
   * old result is still returned at once, while one caller (in one process) recomputes it
   * in the background. A failed refresh keeps the old result served until the window ends.
   */
  stale?: number | null;
  /**
   * XFetch early refresh (pg_once 0.2.0; needs ttl), 0 (off) to 100; 1 is the usual value: a hit
   * may draw a background refresh before expiry, the likelier the closer to expiry and the
   * longer the last computation took.
   */
  beta?: number | null;
  /** 0 to below 1 (needs ttl): the ttl used is ttl * (1 - jitter * random()), so keys filled together expire apart. */
  jitter?: number | null;
}

export interface OnceClientOptions extends CallOptions {
  /** The pool every call goes through: direct, PgBouncer (any mode), RDS Proxy, ... */
  pool: Pool;
  /** Where the listener connects when listenConnectionString is not given. */
  connectionString?: string;
  /**
   * The process's one LISTEN connection, which also owns its claims: direct or
   * session-pooled, never transaction-pooled. Default: connectionString, else the pool's settings.
   */
  listenConnectionString?: string;
  /** false: no LISTEN connection; waiters poll, claims end only with their lease. Default true. */
  listen?: boolean;
  /** How long to keep trying to (re)connect the listener before a call fails, in seconds (default 10). */
  connectTimeout?: number;
  /** Background errors (listener reconnects, failed heartbeats). Default: console.warn. */
  onError?: (err: Error) => void;
}

export interface ConnectOptions extends Omit<OnceClientOptions, 'pool' | 'connectionString'> {
  /** The pool's max (default 10). */
  poolSize?: number;
  /** More pg.Pool settings. */
  poolOptions?: PoolConfig;
}

export interface CachedOptions<A extends unknown[]> extends CallOptions {
  /** The key of a call: a function of its arguments, or a prefix (default fn.name) followed by the arguments as JSON. */
  key?: string | ((...args: A) => string);
}

export interface Job<P = Json> {
  key: string;
  /** The claim's fencing token (int8, as a string). */
  token: string;
  payload: P;
  /** 1 for the first attempt. */
  attempt: number;
  queue: string;
  /** Aborted when the claim is lost, or when stop() gives up waiting for this job. */
  signal: AbortSignal;
}

export interface WorkOptions {
  /** How many jobs run at once (1 to 1000, default 1). */
  concurrency?: number;
  /** Lease of each job in seconds (default: the client's, 30). */
  lease?: number;
  /** How long results are served (default: the client's, null = until invalidated). */
  ttl?: number | null;
  /** Minimum delay before a failed job is retried (the queue's backoff applies too; default 0). */
  retryAfter?: number;
  /** Server-side wait for work when the queue is empty, in seconds (default 1). */
  idleWait?: number;
  /** How long stop() lets jobs in hand finish before releasing them, in seconds (default 10). */
  stopTimeout?: number;
  /** The worker name recorded in once.attempts (default host:pid). */
  worker?: string;
  /** Stop gracefully on SIGTERM / SIGINT (a second signal stops at once). Default true. */
  handleSignals?: boolean;
  /** Stop when this signal aborts. */
  signal?: AbortSignal;
}

export interface WorkerStats {
  completed: number;
  /** The handler threw, or its result could not be stored. */
  failed: number;
  /** Handed back at stop (due again at once, the attempt not counted). */
  released: number;
  /** The claim was taken over (lease expired) before the job finished. */
  lost: number;
}

export declare class Worker {
  readonly stats: WorkerStats;
  readonly stopping: boolean;
  /** Resolves with the stats once stopped and every job is finished or released. */
  readonly done: Promise<WorkerStats>;
  /** Stop claiming; finish jobs in hand, releasing those still running after `timeout` seconds. */
  stop(options?: { timeout?: number }): Promise<WorkerStats>;
}

export declare class OnceClient {
  constructor(options: OnceClientOptions);
  /** A client with its own pg.Pool (ended by end()), connected and listening. */
  static connect(connectionString: string, options?: ConnectOptions): Promise<OnceClient>;
  readonly pool: Pool;
  /** The pid owning this process's claims (0 with listen: false; null while reconnecting). */
  readonly ownerPid: number | null;
  /** Check the server and connect the listener (calls do it when needed). */
  ready(): Promise<void>;
  /**
   * The cached result of `key`, computing it with `compute()` exactly once across every
   * process if nobody has. Concurrent calls for one key in this process share one outcome.
   * Rejects with OnceFailed (a failure shared by another caller), OnceTimeout, the
   * compute function's own error, or a TypeError for a result that is not JSON.
   */
  getOrCompute<T = any>(key: string, compute: () => T | Promise<T>, options?: CallOptions): Promise<T>;
  /** `fn` wrapped so that its results are cached by key. */
  cached<A extends unknown[], T>(fn: (...args: A) => T | Promise<T>, options?: CachedOptions<A>): (...args: A) => Promise<Awaited<T>>;
  /** Work a queue until stopped; the handler's result completes the job, a throw fails it. */
  work<P = Json>(queue: string, handler: (job: Job<P>) => unknown, options?: WorkOptions): Worker;
  /**
   * Stop workers, let background refreshes finish for up to `refreshTimeout` seconds (default
   * 10) and give back the claims of those still running, close the listener, and the pool if
   * connect() made it.
   */
  end(options?: { refreshTimeout?: number }): Promise<void>;
}

export declare class OnceError extends Error {}

export declare class OnceFailed extends OnceError {
  readonly key: string;
  /** The failing computation's error text. */
  readonly error: string;
  /** When the key will be computed again. */
  readonly retryAt: Date;
}

export declare class OnceTimeout extends OnceError {
  readonly key: string;
  /** The caller's wait, in seconds. */
  readonly wait: number;
}
