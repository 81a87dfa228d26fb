// Connection strings that name several servers (docs/clients.md, N7), read without a
// server: each host becomes a single-host URL that node-postgres (pg-connection-string)
// reads as usual, and target_session_attrs is kept for the client to check.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { parse } from 'pg-connection-string';
import hosts from '../src/hosts.cjs';

const { parseHosts, HostList } = hosts;
const read = (s, env = {}) => {
  const list = parseHosts(s, env);
  return list && { target: list.target, servers: list.urls.map((u) => { const c = parse(u); return `${c.user}@${c.host}:${c.port}/${c.database}`; }) };
};

test('a URL with several hosts', () => {
  assert.deepEqual(read('postgresql://app:pw@db1:5432,db2:5433/shop?target_session_attrs=read-write&sslmode=disable'), {
    target: 'read-write', servers: ['app@db1:5432/shop', 'app@db2:5433/shop'],
  });
  const [first] = parseHosts('postgres://a@[::1]:5,db2/x?application_name=y', {}).urls;
  assert.equal(first, 'postgres://a@[::1]:5/x?application_name=y');
});

test('the key/value form, one port for all or one per host', () => {
  assert.deepEqual(read("host=db1,db2 port=5432,5433 user=app password='a b' dbname=shop target_session_attrs=primary"), {
    target: 'primary', servers: ['app@db1:5432/shop', 'app@db2:5433/shop'],
  });
  assert.deepEqual(read('host=db1,db2 port=6432 user=app dbname=shop').servers, ['app@db1:6432/shop', 'app@db2:6432/shop']);
  assert.equal(parse(parseHosts("host=h password='it\\'s' sslmode=require", {}).urls[0]).password, "it's");
  assert.throws(() => parseHosts('host=a,b,c port=1,2', {}), /3 hosts but 2 ports/);
  assert.throws(() => parseHosts('host=a target_session_attrs=prefer-standby', {}), /prefer-standby.*expected one of/);
});

test('the environment: PGHOST lists, PGTARGETSESSIONATTRS', () => {
  assert.deepEqual(read('', { PGHOST: 'db1,db2', PGPORT: '7', PGTARGETSESSIONATTRS: 'read-write' }), {
    target: 'read-write', servers: ['@db1:7/null', '@db2:7/null'], // user and database: pg's defaults
  });
  assert.equal(parseHosts('', { PGHOST: 'db1' }), null); // node-postgres reads it as always
});

test('one host without a target is left to node-postgres as it was', () => {
  assert.equal(parseHosts('postgres://u@h:5/db?sslmode=disable', {}), null);
  assert.ok(parseHosts('postgres://u@h:5/db?target_session_attrs=any', {}));
});

test('hosts are tried in order, from the last that qualified', async () => {
  const list = new HostList({ urls: ['postgres://a/x', 'postgres://b/x', 'postgres://c/x'], target: 'read-write' });
  const tried = [];
  const make = ({ connectionString }) => ({
    host: new URL(connectionString).hostname,
    async connect() { tried.push(this.host); if (this.host === 'a') throw Object.assign(new Error('refused'), { code: 'ECONNREFUSED' }); },
    async query() { return { rows: [{ read_only: this.host === 'b' ? 'on' : 'off', standby: this.host === 'b' }] }; },
    async end() {},
  });
  assert.equal((await list.connect({}, make)).host, 'c');
  assert.deepEqual(tried, ['a', 'b', 'c']);
  tried.length = 0;
  assert.equal((await list.connect({}, make)).host, 'c');
  assert.deepEqual(tried, ['c']);
});
