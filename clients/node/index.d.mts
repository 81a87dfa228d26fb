// Types of pg-once for ESM's import: the same declarations as require('pg-once') (index.d.cts).
export * from './index.cjs';
