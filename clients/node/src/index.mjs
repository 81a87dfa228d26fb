// pg-once for ESM's import: the same objects as require('pg-once') (index.cjs, whose
// `module.exports = { ... }` Node reads the names from), so that an application mixing
// both sees one OnceClient class and one set of error classes.
export * from './index.cjs';
