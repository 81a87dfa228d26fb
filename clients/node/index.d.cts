// Types of pg-once, the node-postgres client of the pg_once PostgreSQL extension, for
// require() (index.d.mts gives import the same). Durations are seconds (numbers;
// fractions allowed).
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
  /**
   * Turns a result into the JSON text the server stores (default: JSON.stringify, refusing
   * with NotSerializable what JSON would not give back unchanged: Date, BigInt, Map, Set,
   * undefined, NaN, class instances). Pass deserialize with it.
   */
  serialize?: (value: any) => string;
  /** Turns stored JSON text back into a value; every caller, the computing one included, gets its result. */
  deserialize?: (text: string) => any;
  /** Called once per finished call with how it went (a call's replaces the client's). */
  onOutcome?: ((event: OutcomeEvent) => void) | null;
}

/** What the outcome hook gets. */
export interface OutcomeEvent {
  /**
   * hit (stored value), stale (old value, someone else refreshes), refresh (old value,
   * this process refreshes), claimed (computed here), waited (another process's result),
   * coalesced (shared a call of this process), failed (the call threw: `error`).
   */
  kind: 'hit' | 'stale' | 'refresh' | 'claimed' | 'waited' | 'coalesced' | 'failed';
  key: string;
  /** Milliseconds from the call to its answer. */
  duration: number;
  error?: unknown;
}

export interface GetOrComputeOptions extends CallOptions {
  /**
   * Stop waiting when it aborts (rejecting with its reason); also passed to compute. The
   * computation is cancelled, and its claim given back, only when every caller waiting
   * for it in this process has stopped.
   */
  signal?: AbortSignal;
}

/** What compute gets: a signal that aborts when every caller gave up or the claim was lost. */
export interface ComputeContext {
  signal: AbortSignal;
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
  /** Background errors (listener reconnects, failed heartbeats, a throwing onOutcome). Default: console.warn. */
  onError?: (err: Error) => void;
}

/** Without a connection string, libpq's PG* environment variables (PGSSLROOTCERT included). */
export interface ConnectOptions extends Omit<OnceClientOptions, 'pool' | 'connectionString'> {
  /** The pool's max (default 10). */
  poolSize?: number;
  /** More pg.Pool settings. */
  poolOptions?: PoolConfig;
}

/**
 * Either `name` (keys are derived from it and the arguments, docs/clients.md rule K:
 * `name:[...]`, hashed past 7,500 bytes; arguments of other types than JSON's, Map, Set,
 * Date, Buffer and BigInt are refused with a TypeError) or `key`, a function of the arguments.
 */
export interface CachedOptions<A extends unknown[]> extends CallOptions {
  /** The prefix of the derived keys; required without `key` (fn.name changes under minifiers). */
  name?: string;
  /** The key of a call, written by the caller. */
  key?: (...args: A) => string;
}

/** A cached function: call it as fn; invalidate or refresh the entry of some arguments. */
export interface Cached<A extends unknown[], T> {
  (...args: A): Promise<T>;
  /** once.invalidate_key of these arguments' key: false if it was absent. */
  invalidate(...args: A): Promise<boolean>;
  /** once.refresh_key of these arguments' key, with the wrapper's stale: expired, rerun, pending or absent. */
  refresh(...args: A): Promise<string>;
}

export interface EnqueueOptions {
  /** Handed to the handler (JSON). */
  payload?: Json;
  /** Default 'default'. */
  queue?: string;
  /** Smaller runs first (default 0). */
  priority?: number;
  /** Due at (default now). */
  runAt?: Date | null;
  /** Requeue a key that has a result, served until the new one lands. */
  refresh?: boolean;
  /** Overrides the queue's. */
  maxAttempts?: number | null;
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
  /** How long stop() lets jobs in hand finish before releasing them, in seconds (default 30). */
  stopTimeout?: number;
  /** The worker name recorded in once.attempts (default host:pid). */
  worker?: string;
  /** Stop gracefully on SIGTERM / SIGINT (a second signal stops at once). Default true. */
  handleSignals?: boolean;
  /** Stop when this signal aborts. */
  signal?: AbortSignal;
  /** The results' serializer (default: the client's). */
  serialize?: (value: any) => string;
  deserialize?: (text: string) => any;
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
   * Every caller, the computing one included, gets deserialize(serialize(result)).
   * Rejects with OnceFailed (a failure shared by another caller), OnceTimeout, the
   * compute function's own error, NotSerializable, ResultRefused, ClaimLost,
   * ConfigurationError, the signal's reason, or a TypeError/RangeError for bad input.
   */
  getOrCompute<T = any>(key: string, compute: (context: ComputeContext) => T | Promise<T>, options?: GetOrComputeOptions): Promise<Awaited<T>>;
  /** `fn` wrapped so that its results are cached by key. */
  cached<A extends unknown[], T>(fn: (...args: A) => T | Promise<T>, options: CachedOptions<A>): Cached<A, Awaited<T>>;
  /**
   * One claim_key for code that computes and stores by itself (the idempotency
   * middleware): the stored value, the claim (heartbeated until complete or release),
   * 'mismatch' (held for another fingerprint), the shared failure, or 'wait' when someone
   * else still holds it after `wait` seconds (default 0: ask once). Rejects with OnceTimeout
   * when its own claim_key is still unanswered at the end of a `wait` above 0, or with the
   * signal's reason: a claim that late answer makes is given back.
   */
  claim(key: string, options?: ClaimOptions): Promise<ClaimAnswer>;
  /** once.invalidate_key: forget the key's result or failure; false if it was absent. */
  invalidate(key: string): Promise<boolean>;
  /** once.refresh_key: compute it again, serving the result as stale for `stale` seconds meanwhile. */
  refresh(key: string, options?: { stale?: number | null }): Promise<'expired' | 'rerun' | 'pending' | 'absent'>;
  /** once.enqueue_key: have a queue's workers compute it. */
  enqueue(key: string, options?: EnqueueOptions): Promise<'queued' | 'requeued' | 'duplicate' | 'cached'>;
  /**
   * once.enqueue_keys: enqueue for many keys in one statement; each key's outcome, in the
   * order given. At most 1,000 distinct keys.
   */
  enqueueMany(jobs: Iterable<string | { key: string; payload?: Json }>, options?: Omit<EnqueueOptions, 'payload'>): Promise<Map<string, 'queued' | 'requeued' | 'duplicate' | 'cached'>>;
  /** Work a queue until stopped; the handler's result completes the job, a throw fails it. */
  work<P = Json>(queue: string, handler: (job: Job<P>) => unknown, options?: WorkOptions): Worker;
  /**
   * Stop workers, let background refreshes finish for up to `refreshTimeout` seconds (default
   * 10) and give back the claims of those still running, wait as long for the claim_key
   * answers whose callers left (to give back a claim they made), close the listener, and the
   * pool if connect() made it.
   */
  end(options?: { refreshTimeout?: number }): Promise<void>;
}

export declare class OnceError extends Error {}

/** The derived key of `args` under `name` (docs/clients.md, rule K). */
export declare function defaultKey(name: string, args: unknown[]): string;
/** The server's limit on a key, in UTF-8 bytes. */
export declare const MAX_KEY_BYTES: 7500;

export declare class OnceFailed extends OnceError {
  readonly kind: 'Failed';
  readonly key: string;
  /** The failing computation's error text. */
  readonly error: string;
  /** When the key will be computed again. */
  readonly retryAt: Date;
}

export declare class OnceTimeout extends OnceError {
  readonly kind: 'Timeout';
  readonly key: string;
  /** The caller's wait, in seconds. */
  readonly wait: number;
}

/** The claim ended (lease taken over, or invalidated) before the result was stored; nothing was stored. */
export declare class ClaimLost extends OnceError {
  constructor(key: string);
  readonly kind: 'ClaimLost';
  readonly key: string;
}

/** The result cannot go through the serializer unchanged; the failure is shared with the waiters. */
export declare class NotSerializable extends OnceError {
  readonly kind: 'NotSerializable';
  readonly key: string;
}

/** The server refused to store the result (e.g. 54000, too large); shared with the waiters. */
export declare class ResultRefused extends OnceError {
  readonly kind: 'Refused';
  readonly key: string;
  /** The server's SQLSTATE. */
  readonly code: string | undefined;
}

/** A setup that cannot work, e.g. the LISTEN connection through a transaction pooler. */
export declare class ConfigurationError extends OnceError {
  readonly kind: 'Configuration';
}

export interface ClaimOptions {
  /** The claim's lease in seconds (default: the client's); heartbeats extend it every lease/3. */
  lease?: number;
  /** How long to wait while someone else holds the key, in seconds (default 0). */
  wait?: number;
  /** 1 to 64 bytes (pg_once 0.3.0): a caller with another fingerprint is answered 'mismatch'. */
  fingerprint?: Uint8Array | null;
  /** How often a waiting call asks again without a notification (default: the client's). */
  recheck?: number;
  signal?: AbortSignal;
}

export type ClaimAnswer =
  | { outcome: 'hit'; result: Json }
  | { outcome: 'claimed'; claim: Claim }
  | { outcome: 'failed'; error: string; retryAt: Date }
  | { outcome: 'mismatch' }
  | { outcome: 'wait' };

/** A claim held by the caller (OnceClient.claim): heartbeated until completed or released. */
export declare class Claim {
  readonly key: string;
  /** The fencing token (int8, as a string). */
  readonly token: string;
  /** Aborts with ClaimLost when a heartbeat finds the claim taken over. */
  readonly signal: AbortSignal;
  readonly lost: boolean;
  /** Whether complete or release was called. */
  readonly ended: boolean;
  /** Store `value` (JSON) through the pool, fresh for `ttl` seconds; ClaimLost when no longer ours. */
  complete(value: Json, options?: { ttl?: number | null }): Promise<true>;
  /** The same on the caller's own connection, inside its transaction (rule I8). */
  completeOn(pgClient: { query: (...args: any[]) => Promise<any> }, value: Json, options?: { ttl?: number | null }): Promise<true>;
  /** Give the claim back; false when it was no longer ours. */
  release(): Promise<boolean>;
}

/** The idempotency middleware's options (docs/clients.md, rule I). Seconds and bytes. */
export interface IdempotencyOptions {
  /** The client whose pool and LISTEN connection the middleware uses; or connectionString. */
  client?: OnceClient;
  /** A client of the middleware's own, connected on the first request (close() ends it). */
  connectionString?: string;
  /** How long a stored response is replayed, in seconds (default 24 h). */
  ttl?: number | null;
  /** The claim's lease in seconds (default 30), heartbeated while the handler runs. */
  lease?: number;
  /** 'conflict' (default): 409 while the key runs; 'wait': wait up to `wait` for its response. */
  inFlight?: 'conflict' | 'wait';
  /** Seconds a duplicate waits with inFlight 'wait' (default 10). */
  wait?: number;
  /** The methods covered (default POST and PATCH). */
  methods?: string[];
  /** The header carrying the key (default Idempotency-Key). */
  header?: string;
  /** Answer 400 key_missing to a covered request without the header (default false). */
  required?: boolean;
  /** A prefix of the entries' keys, e.g. 'tenant2/' (default ''). */
  namespace?: string;
  /**
   * Keys the entries (an HMAC of scope and key) and authenticates the stored responses: at
   * least 32 bytes, the same in every process (e.g. from an environment variable). Required
   * with the default scope, which comes from the caller's credentials.
   */
  secret?: string | Uint8Array | null;
  /** Who the key belongs to, the authenticated principal: a string or null (default: the Authorization header, keyed by `secret`). */
  scope?: ((request: any) => string | null) | null;
  /** The request's digest, 1 to 64 bytes, or null for none (default SHA-256 of method, path, query, body). */
  fingerprint?: ((request: { method: string; path: string; query: string; body: Buffer }) => Uint8Array | null) | null;
  /** The most request body read (default 1 MiB; past it, 413). */
  maxRequestBody?: number;
  /** The most response body stored (default 1 MiB; past it, stored without the body). */
  maxBody?: number;
  /** Which statuses are stored (default: below 500); the others give the claim back. */
  store?: (status: number) => boolean;
  /** Store set-cookie headers too (default false). */
  storeCookies?: boolean;
  /** Background errors (pg_once unreachable, a store that failed). Default: console.warn. */
  onError?: (err: Error) => void;
}

/** The claim a request runs under: `req.idempotency` (Express), `request.idempotency` (Fastify). */
export interface IdempotencyClaim {
  /** The pg_once key of the request's entry. */
  readonly key: string;
  /** The Idempotency-Key header's value. */
  readonly idempotencyKey: string;
  /** Aborts with ClaimLost when the claim is taken over. */
  readonly signal: AbortSignal;
  /**
   * Store the response on the handler's own connection, inside its transaction, before it
   * commits (rule I8); ClaimLost when the claim was taken over: roll back. Send the same
   * status, headers and body.
   */
  complete(
    pgClient: { query: (...args: any[]) => Promise<any> },
    status: number,
    headers: Record<string, string | string[]> | Array<[string, string]>,
    body: string | Uint8Array | null,
  ): Promise<void>;
}

/** An Express (or Node http) middleware; close() ends the client made from a connection string. */
export interface IdempotencyMiddleware {
  (req: any, res: any, next: (err?: unknown) => void): void;
  close(): Promise<void>;
}

/**
 * Express: run each POST/PATCH carrying an Idempotency-Key at most once per key. Use it
 * before the body parsers and the routes it covers.
 */
export declare function idempotency(options: IdempotencyOptions): IdempotencyMiddleware;
/**
 * Express: the error handler to put after the routes: problem+json 500 for a handler that
 * threw under a claim (its claim given back), 409 for ClaimLost.
 */
export declare function idempotencyErrors(): (err: unknown, req: any, res: any, next: (err?: unknown) => void) => void;
/**
 * Fastify: the plugin (not encapsulated, as fastify-plugin makes it): covers the routes of
 * the scope it is registered in.
 */
export declare function idempotencyPlugin(fastify: any, options: IdempotencyOptions): Promise<void>;
