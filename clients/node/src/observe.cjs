// What a call tells the application about itself (docs/clients.md, O): the outcome hook,
// and OpenTelemetry spans when @opentelemetry/api is installed (an optional peer
// dependency: without it nothing is imported and nothing is traced).
'use strict';

const { performance } = require('node:perf_hooks');

/** The outcome kinds a finished call reports. */
const OUTCOMES = ['hit', 'stale', 'refresh', 'claimed', 'waited', 'coalesced', 'failed'];

let otel = null; // the module, once loaded; false when it is not installed
const loading = import('@opentelemetry/api').then((m) => { otel = m; }, () => { otel = false; });

/** Resolves once it is known whether @opentelemetry/api is there (at most one import). */
const tracingReady = () => loading;

/**
 * One call being observed: `span` is its OpenTelemetry span (null without the API),
 * `end(kind, error)` reports its outcome to the hook and ends the span.
 */
class Observation {
  #started = performance.now();
  #key;
  #hook;
  #onError;
  span = null;

  /** `links`: the span contexts this call's span links to (the call that computed). */
  constructor(key, hook, onError, links = []) {
    this.#key = key;
    this.#hook = hook;
    this.#onError = onError;
    if (otel) {
      this.span = otel.trace.getTracer('pg-once').startSpan('pg_once.get_or_compute', {
        attributes: { 'pg_once.key': key },
        links: links.map((context) => ({ context })),
      });
    }
  }

  /** Run `fn` with this call's span as the active one, so that spans compute makes are its children. */
  inSpan(fn) {
    if (!this.span) return fn();
    return otel.context.with(otel.trace.setSpan(otel.context.active(), this.span), fn);
  }

  end(kind, error) {
    const duration = performance.now() - this.#started;
    if (this.span) {
      this.span.setAttribute('pg_once.outcome', kind);
      if (error) {
        this.span.recordException(error);
        this.span.setStatus({ code: otel.SpanStatusCode.ERROR, message: String(error?.message ?? error) });
      }
      this.span.end();
    }
    if (!this.#hook) return;
    try {
      this.#hook({ kind, key: this.#key, duration, ...(error === undefined ? {} : { error }) });
    } catch (err) {
      this.#onError(err); // a hook that throws is reported, never the caller's problem
    }
  }
}

module.exports = { OUTCOMES, tracingReady, Observation };
