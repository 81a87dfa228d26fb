// How results become the jsonb the server stores, and come back. The caller that
// computes gets deserialize(serialize(value)), exactly what every other caller (in this
// process or another) reads, never its own object (docs/clients.md).
'use strict';

const { NotSerializable } = require('./errors.cjs');

/**
 * The serializer of a call: `serialize(value)` returns JSON text (the server stores it as
 * jsonb), `deserialize(text)` turns stored JSON text back into a value. The default is
 * JSON, refusing what JSON would not give back unchanged.
 */
function serializer({ serialize, deserialize } = {}) {
  if ((serialize === undefined) !== (deserialize === undefined)) {
    throw new TypeError('pg-once: pass serialize and deserialize together (one undoes the other)');
  }
  if (serialize === undefined) return JSON_SERIALIZER;
  if (typeof serialize !== 'function' || typeof deserialize !== 'function') {
    throw new TypeError('pg-once: serialize and deserialize must be functions');
  }
  return { serialize, deserialize };
}

const JSON_SERIALIZER = {
  serialize(value) {
    const problem = notJson(value, '$', new Set());
    if (problem) throw new TypeError(problem);
    return JSON.stringify(value);
  },
  deserialize: (text) => JSON.parse(text),
};

/**
 * `value` as JSON text for key `key`, or NotSerializable saying why: a throwing serialize,
 * or one that returns something other than a string.
 */
function toText(key, value, { serialize }) {
  let text;
  try {
    text = serialize(value);
  } catch (err) {
    throw new NotSerializable(key, err.message, { cause: err });
  }
  if (typeof text !== 'string') throw new NotSerializable(key, `serialize returned ${typeof text}, not a string`);
  return text;
}

const describe = (v) => (v?.constructor?.name ? `a ${v.constructor.name}` : typeof v);

/**
 * Why JSON.stringify then JSON.parse would not give `value` back (null if it would):
 * the type and where it is, e.g. "a Date at $.when".
 */
function notJson(value, path, seen) {
  switch (typeof value) {
    case 'string':
    case 'boolean':
      return null;
    case 'number':
      return Number.isFinite(value) ? null : `${value} at ${path} (JSON writes it as null)`;
    case 'undefined':
      return `undefined at ${path} (return null to cache "nothing")`;
    case 'object':
      break;
    default:
      return `a ${typeof value} at ${path}`;
  }
  if (value === null) return null;
  if (seen.has(value)) return `a cycle at ${path}`;
  const proto = Object.getPrototypeOf(value);
  const plain = proto === Object.prototype || proto === null;
  if (!Array.isArray(value) && !plain) return `${describe(value)} at ${path}`;
  seen.add(value);
  try {
    if (Array.isArray(value)) {
      for (let i = 0; i < value.length; i += 1) {
        const problem = notJson(value[i], `${path}[${i}]`, seen);
        if (problem) return problem;
      }
      return null;
    }
    for (const [k, v] of Object.entries(value)) {
      const problem = notJson(v, `${path}.${k}`, seen);
      if (problem) return problem;
    }
    return null;
  } finally {
    seen.delete(value);
  }
}

module.exports = { serializer, JSON_SERIALIZER, toText };
