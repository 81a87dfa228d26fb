// Failover (docs/clients.md, N7, R2, L4): a client given both servers of a primary and its
// hot standby (PG_ONCE_FAILOVER_URL and PG_ONCE_FAILOVER_DSN, the key/value form) goes on
// when the primary dies and the standby is promoted: a computation in flight is stored on
// the new primary if its claim survived there (a lease-only claim, replicated before the
// crash) and otherwise reported as ClaimLost, never stored twice; the LISTEN connection and
// the pool move to the new primary. scripts/failover.sh (PG_ONCE_FAILOVER) kills and
// promotes; scripts/test.sh step 6 starts the pair.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { promisify } from 'node:util';
import { randomUUID } from 'node:crypto';
import pg from 'pg';
import { OnceClient, ClaimLost } from '../src/index.mjs';
import hosts from '../src/hosts.cjs';

const { HostList, parseHosts } = hosts;
const FAILOVER = process.env.PG_ONCE_FAILOVER;
const URL = process.env.PG_ONCE_FAILOVER_URL;
const KV = process.env.PG_ONCE_FAILOVER_DSN;
const OUTAGE_MS = 2000;
const BOUND_MS = 60_000; // what a loaded 2-core machine may take to replicate, kill, promote
const run = promisify(execFile);
const failover = (command) => run(FAILOVER, [command], { timeout: BOUND_MS });

/** A query on the server of `target` kind among the pair's. */
async function one(target, sql, params = []) {
  const list = new HostList(parseHosts(URL.replace('target_session_attrs=read-write', `target_session_attrs=${target}`)));
  const client = await list.connect({ connectionTimeoutMillis: 5000 }, (config) => new pg.Client(config));
  try {
    return (await client.query(sql, params)).rows[0];
  } finally {
    await client.end();
  }
}

async function until(condition, what) {
  const deadline = Date.now() + BOUND_MS;
  while (!(await condition())) {
    assert.ok(Date.now() < deadline, `never: ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

test('a client follows a failover', { skip: !(FAILOVER && URL && KV) && 'PG_ONCE_FAILOVER and PG_ONCE_FAILOVER_URL / _DSN are not set (scripts/test.sh step 6)' }, async () => {
  await failover('ready');
  // Claims owned by its LISTEN connection's backend; a URL.
  const owned = await OnceClient.connect(URL, { onError: () => {} });
  // Lease-only claims, which survive a promotion; the key/value form.
  const leased = await OnceClient.connect(KV, { listen: false, onError: () => {} });
  const prefix = `node-failover/${randomUUID()}`;
  const [kOwned, kLeased, kAfter] = ['owned', 'leased', 'after'].map((k) => `${prefix}/${k}`);
  let open;
  const gate = new Promise((resolve) => { open = resolve; });
  try {
    // Idle pooled connections to the server that will die.
    for (const client of [owned, leased]) {
      const held = await Promise.all(Array.from({ length: 6 }, () => client.pool.connect()));
      held.forEach((c) => c.release());
    }
    const settle = (p) => p.then((value) => ({ value }), (error) => ({ error }));
    const calls = [
      settle(owned.getOrCompute(kOwned, async () => { await gate; return 'owned'; }, { lease: 60, wait: 60 })),
      settle(leased.getOrCompute(kLeased, async () => { await gate; return 'leased'; }, { lease: 60, wait: 60 })),
    ];
    await until(async () => Number((await one('standby',
      "SELECT count(*) AS n FROM once.entries WHERE key IN ($1, $2) AND state = 'running'", [kOwned, kLeased])).n) === 2,
    'both claims replayed on the standby');
    const oldPid = owned.ownerPid;
    await failover('kill');
    open(); // the computations end while no server takes writes
    // The outage lasts as a failover manager's would, seconds: longer than the half second
    // of retries R2 allowed before 0.3.0. What is tested is the client across it, not how
    // fast the machine promotes.
    await new Promise((resolve) => setTimeout(resolve, OUTAGE_MS));
    await failover('promote');
    const [ownedResult, leasedResult] = await Promise.all(calls);
    // L4: the lease-only claim survived on the new primary: its completion, retried across
    // the promotion (R2), is stored there, once.
    assert.deepEqual(leasedResult, { value: 'leased' });
    const row = (key) => one('read-write', "SELECT state::text AS state, result #>> '{}' AS result FROM once.entries WHERE key = $1", [key]);
    assert.deepEqual({ ...(await row(kLeased)) }, { state: 'done', result: 'leased' });
    // The owned claim named a backend of the old primary: stored if the completion came
    // before the new primary's reaper, else ClaimLost; never a connection error.
    const got = { ...(await row(kOwned)) };
    if ('value' in ownedResult) {
      assert.equal(ownedResult.value, 'owned');
      assert.deepEqual(got, { state: 'done', result: 'owned' });
    } else {
      assert.ok(ownedResult.error instanceof ClaimLost, String(ownedResult.error));
      assert.notDeepEqual(got, { state: 'done', result: 'owned' });
    }
    // N4, N7: the pool's calls and the LISTEN connection are on the new primary.
    assert.equal(await owned.getOrCompute(kAfter, async () => 'after', { wait: 60 }), 'after');
    const newPid = owned.ownerPid;
    assert.ok(newPid && newPid !== oldPid, `owner pid ${oldPid} -> ${newPid}`);
    assert.equal(Number((await one('read-write', 'SELECT count(*) AS n FROM pg_stat_activity WHERE pid = $1', [newPid])).n), 1);
  } finally {
    open();
    await owned.end();
    await leased.end();
  }
});
