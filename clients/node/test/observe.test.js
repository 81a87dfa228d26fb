// The outcome hook and OpenTelemetry spans (docs/clients.md, O1, O2), against a real server.
import { describe, test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { context, trace } from '@opentelemetry/api';
import { AsyncLocalStorageContextManager } from '@opentelemetry/context-async-hooks';
import { BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor } from '@opentelemetry/sdk-trace-base';
import {
  setups, makeClient, closeClient, freshKey, sleep, announced,
} from './helpers.js';

const exporter = new InMemorySpanExporter();
context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
trace.setGlobalTracerProvider(new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] }));

for (const setup of setups.slice(0, 1)) {
  describe(`outcome hook and tracing (${setup.name})`, () => {
    const events = [];
    let client;
    let other;
    before(() => {
      client = makeClient(setup, { onOutcome: (e) => events.push(e) });
      other = makeClient(setup);
    });
    after(() => Promise.all([closeClient(client), closeClient(other)]));

    test('each call reports one outcome with its duration: claimed, coalesced, hit, waited, stale, failed', async () => {
      const key = freshKey('hook');
      await Promise.all([
        client.getOrCompute(key, async () => { await sleep(200); return 1; }),
        client.getOrCompute(key, () => 2),
      ]);
      await client.getOrCompute(key, () => 3);
      const elsewhere = freshKey('hook-waited');
      // Another process claims it (its computation has started, so the claim is
      // committed) and computes for a second, far longer than a claim takes: waited.
      const { started, compute } = announced(async () => { await sleep(1000); return 1; });
      const computing = other.getOrCompute(elsewhere, compute);
      await started;
      await client.getOrCompute(elsewhere, () => 2);
      await computing;
      const fresh = freshKey('hook-stale');
      await client.getOrCompute(fresh, () => 1, { ttl: 0.2, stale: 60 });
      await sleep(300);
      await client.getOrCompute(fresh, async () => { await sleep(500); return 2; }, { ttl: 0.2, stale: 60 }); // refresh
      await client.getOrCompute(fresh, () => 3, { ttl: 0.2, stale: 60 }); // stale, the refresh still runs
      const failing = freshKey('hook-failed');
      await assert.rejects(client.getOrCompute(failing, () => { throw new Error('boom'); }));
      const seen = events.map((e) => e.kind);
      assert.deepEqual(seen, ['claimed', 'coalesced', 'hit', 'waited', 'claimed', 'refresh', 'stale', 'failed']);
      for (const e of events) assert.ok(typeof e.duration === 'number' && e.duration >= 0);
      assert.ok(events[0].duration >= 180, 'the computing call took its computation');
      assert.equal(events.at(-1).error.message, 'boom');
      assert.equal(events[0].key, key);
    });

    test('a throwing hook goes to onError, the call still answers', async () => {
      const errors = [];
      const c = makeClient(setup, { onOutcome: () => { throw new Error('hook'); }, onError: (e) => errors.push(e) });
      try {
        assert.equal(await c.getOrCompute(freshKey('hookthrows'), () => 'v'), 'v');
        assert.equal(errors[0]?.message, 'hook');
      } finally {
        await closeClient(c);
      }
    });

    test('spans: compute runs in the computing call\'s span, a coalesced call links to it', async () => {
      exporter.reset();
      const key = freshKey('span');
      const tracer = trace.getTracer('test');
      await Promise.all([
        client.getOrCompute(key, async () => {
          await sleep(100);
          tracer.startSpan('inside compute').end();
          return 1;
        }),
        client.getOrCompute(key, () => 2),
      ]);
      const spans = exporter.getFinishedSpans();
      const calls = spans.filter((s) => s.name === 'pg_once.get_or_compute');
      assert.equal(calls.length, 2);
      const computing = calls.find((s) => s.attributes['pg_once.outcome'] === 'claimed');
      const coalesced = calls.find((s) => s.attributes['pg_once.outcome'] === 'coalesced');
      assert.equal(computing.attributes['pg_once.key'], key);
      const inside = spans.find((s) => s.name === 'inside compute');
      assert.equal(inside.parentSpanContext?.spanId, computing.spanContext().spanId);
      assert.deepEqual(coalesced.links.map((l) => l.context.spanId), [computing.spanContext().spanId]);
    });
  });
}
