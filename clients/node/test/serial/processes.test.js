// Across processes: child processes as other pods, killed owners, recycled connections.
// In test/serial: it closes every test pool's server connections, so it runs alone, after the
// other files (which run four at a time: package.json's test script).
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import {
  setups, makeClient, closeClient, freshKey, sleep, child, recyclePooledConnections,
} from '../helpers.js';

for (const setup of setups) {
  describe(`processes (${setup.name})`, () => {
    test('4 processes x 10 callers on 3 keys: each key computed once in all, every caller answered', async () => {
      const keys = Array.from({ length: 3 }, (_, i) => freshKey(`procs${i}`));
      const children = Array.from({ length: 4 }, () => child(setup, 'callers', { keys, callers: 10, computeMs: 500 }));
      const reports = await Promise.all(children.map((c) => c.next((m) => m.answers)));
      const exits = await Promise.all(children.map((c) => c.exit));
      assert.deepEqual(exits.map((e) => e.code), [0, 0, 0, 0]);
      for (const key of keys) {
        const total = reports.reduce((sum, r) => sum + (r.computed[key] ?? 0), 0);
        assert.equal(total, 1, `${key} computed ${total} times across processes`);
      }
      const answers = reports.flatMap((r) => r.answers);
      assert.equal(answers.length, 4 * 10 * 3);
      // Everyone got the one stored result: the same computing pid per key.
      for (const key of keys) {
        const by = new Set(answers.filter((a) => a.key === key).map((a) => a.by));
        assert.equal(by.size, 1);
      }
    });

    test('an owner process killed with SIGKILL mid-compute is taken over within a couple of seconds, not its lease', async () => {
      const key = freshKey('sigkill');
      const owner = child(setup, 'hang', { key, callOptions: { lease: 30 } });
      await owner.next((m) => m.computing === key);
      const client = makeClient(setup);
      try {
        await client.ready();
        let computed = 0;
        const waiting = client.getOrCompute(key, () => { computed += 1; return 'taken over'; }, { wait: 20 });
        await sleep(300);
        assert.equal(computed, 0, 'the live owner is waited for');
        const killedAt = Date.now();
        owner.proc.kill('SIGKILL');
        assert.equal(await waiting, 'taken over');
        const took = Date.now() - killedAt;
        assert.equal(computed, 1);
        assert.ok(took < 2500, `taken over ${took} ms after the kill (lease 30 s)`);
        assert.equal((await owner.exit).signal, 'SIGKILL');
      } finally {
        owner.proc.kill('SIGKILL');
        await closeClient(client);
      }
    });

    test('an owner whose pooled server connections are closed mid-compute keeps its claim: one computation', async () => {
      // Lease 2 s, computation 3.5 s: heartbeats must get through on new connections, and
      // the claim must not end with the pooled connection that made it (owner_pid).
      const key = freshKey('recycled');
      const owner = makeClient(setup, { lease: 2 });
      const other = makeClient(setup);
      try {
        await Promise.all([owner.ready(), other.ready()]);
        let computed = 0;
        const compute = async () => {
          computed += 1;
          await sleep(3500);
          return 'survived';
        };
        const mine = owner.getOrCompute(key, compute);
        await sleep(200);
        const theirs = other.getOrCompute(key, compute);
        await sleep(300);
        let closed = await recyclePooledConnections(setup);
        await sleep(1200);
        closed += await recyclePooledConnections(setup);
        assert.ok(closed >= 2, `terminated ${closed} pooled server connections`);
        assert.equal(await mine, 'survived');
        assert.equal(await theirs, 'survived');
        assert.equal(computed, 1, 'nobody took the claim over');
      } finally {
        await closeClient(owner);
        await closeClient(other);
      }
    });
  });
}
