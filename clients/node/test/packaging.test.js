// How the package is consumed (no server): require() and import give the same objects,
// index.d.cts declares what the code exports, package.json points at files that exist.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { createRequire } from 'node:module';
import { existsSync, readFileSync } from 'node:fs';
import * as esm from 'pg-once';

const require = createRequire(import.meta.url);
const manifest = JSON.parse(readFileSync(new URL('../package.json', import.meta.url), 'utf8'));
const here = (path) => new URL(`../${path}`, import.meta.url);

test('require("pg-once") and import give the same classes', () => {
  const cjs = require('pg-once');
  assert.deepEqual(Object.keys(esm).sort(), Object.keys(cjs).sort());
  for (const name of Object.keys(cjs)) assert.equal(esm[name], cjs[name], name);
  assert.ok(new cjs.ClaimLost('k') instanceof esm.OnceError);
});

test('index.d.cts declares exactly what the package exports', () => {
  const declared = [...readFileSync(here('index.d.cts'), 'utf8').matchAll(/^export declare (?:class|function|const) (\w+)/gm)]
    .map((m) => m[1]).sort();
  assert.deepEqual(declared, Object.keys(require('pg-once')).sort());
});

test('every file package.json names exists', () => {
  const targets = JSON.stringify(manifest.exports).match(/"\.\/[^"]+"/g).map((t) => JSON.parse(t));
  for (const path of [manifest.main, manifest.types, ...targets]) assert.ok(existsSync(here(path)), path);
  for (const path of manifest.files) assert.ok(existsSync(here(path)), path);
});

test('repository, homepage and bugs', { todo: 'the project has no public URL yet: fill in package.json' }, () => {
  for (const field of ['repository', 'homepage', 'bugs']) assert.ok(manifest[field], field);
});
