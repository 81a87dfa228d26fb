// Connection strings that name several servers (docs/clients.md, N7).
//
// libpq, and so psycopg and tokio-postgres, take `host=db1,db2 port=5432,5433
// target_session_attrs=read-write` or `postgresql://db1:5432,db2:5433/app?...` and connect to
// the first server that qualifies. node-postgres connects to one host, and its URL parser
// (pg-connection-string) refuses a host list ("Invalid URL"), nor does it read libpq's
// key/value form. So the list is split here into one single-host URL per server, each of
// which pg-connection-string then parses as usual (TLS options and all), and a connection
// is kept only if its server satisfies `target_session_attrs`.
'use strict';

const { ConfigurationError } = require('./errors.cjs');

const TARGETS = ['any', 'read-write', 'read-only', 'primary', 'standby'];

// What tells a server's kind, asked once per new connection (never on a single-host string
// without target_session_attrs, which connects exactly as before).
const KIND_SQL = "SELECT current_setting('transaction_read_only') AS read_only, pg_is_in_recovery() AS standby";

/** The `key=value` pairs of libpq's keyword form: values bare or single-quoted, `\` escaping. */
function keywordPairs(s) {
  const pairs = [];
  let i = 0;
  const space = () => { while (i < s.length && /\s/.test(s[i])) i += 1; };
  for (;;) {
    space();
    if (i >= s.length) return pairs;
    let key = '';
    while (i < s.length && s[i] !== '=' && !/\s/.test(s[i])) key += s[i++];
    space();
    if (s[i] !== '=') throw new ConfigurationError(`pg-once: connection string: "${key}" has no "=" after it`);
    i += 1;
    space();
    const quoted = s[i] === "'";
    if (quoted) i += 1;
    let value = '';
    for (;;) {
      if (i >= s.length) {
        if (quoted) throw new ConfigurationError(`pg-once: connection string: the value of ${key} has no closing quote`);
        break;
      }
      const c = s[i++];
      if (quoted && c === "'") break;
      if (!quoted && /\s/.test(c)) break;
      if (c === '\\') {
        if (i < s.length) value += s[i++];
      } else {
        value += c;
      }
    }
    pairs.push([key, value]);
  }
}

const isUrl = (s) => /^postgres(ql)?:\/\//i.test(s.trimStart());

/** `host[:port]` items of a URL's authority, brackets kept around IPv6 addresses. */
function splitHostPorts(list) {
  return list.split(',').map((item) => {
    const m = /^(\[[^\]]*\]|[^:]*)(?::(\d*))?$/.exec(item);
    if (!m) throw new ConfigurationError(`pg-once: connection string: cannot read the host "${item}"`);
    return { host: m[1], port: m[2] || '' };
  });
}

function checkTarget(target) {
  if (!TARGETS.includes(target)) {
    throw new ConfigurationError(`pg-once: target_session_attrs=${target}: expected one of ${TARGETS.join(', ')}`);
  }
  return target;
}

/** One port per host, or one for all (libpq's rule). */
function portsFor(hosts, ports) {
  if (ports.length <= 1) return hosts.map(() => ports[0] ?? '');
  if (ports.length !== hosts.length) {
    throw new ConfigurationError(`pg-once: connection string: ${hosts.length} hosts but ${ports.length} ports (give one port, or one per host)`);
  }
  return ports;
}

function fromUrl(s) {
  const m = /^(postgres(?:ql)?:\/\/)([^/?#]*)(.*)$/i.exec(s.trim());
  const [, scheme, authority, rest] = m;
  const at = authority.lastIndexOf('@');
  const userinfo = at >= 0 ? authority.slice(0, at + 1) : '';
  const hostPart = at >= 0 ? authority.slice(at + 1) : authority;
  // The query, without target_session_attrs (pg-connection-string would pass it on to the
  // server as a startup parameter, which refuses it).
  const q = rest.indexOf('?');
  const path = q >= 0 ? rest.slice(0, q) : rest;
  let target = 'any';
  const kept = [];
  if (q >= 0) {
    for (const pair of rest.slice(q + 1).split('&')) {
      const [k, v = ''] = pair.split('=');
      if (decodeURIComponent(k) === 'target_session_attrs') target = checkTarget(decodeURIComponent(v));
      else if (pair !== '') kept.push(pair);
    }
  }
  const query = kept.length ? `?${kept.join('&')}` : '';
  const items = hostPart === '' ? [{ host: '', port: '' }] : splitHostPorts(hostPart);
  const urls = items.map((h) => `${scheme}${userinfo}${h.host}${h.port ? `:${h.port}` : ''}${path}${query}`);
  return { urls, target };
}

// libpq keywords whose node-postgres names differ; the rest travel under their own name
// (pg-connection-string reads sslmode, sslrootcert, application_name, options, ...).
const RENAMED = { dbname: 'database' };

function fromKeywords(s, env) {
  const values = new Map(keywordPairs(s)); // a keyword given twice takes its last value
  const take = (k) => {
    const v = values.get(k);
    values.delete(k);
    return v;
  };
  const hosts = (take('host') ?? env.PGHOST ?? '').split(',');
  const portList = take('port') ?? env.PGPORT;
  const ports = portsFor(hosts, portList === undefined || portList === '' ? [] : portList.split(','));
  const target = checkTarget(take('target_session_attrs') ?? env.PGTARGETSESSIONATTRS ?? 'any');
  const database = take('dbname');
  const enc = encodeURIComponent;
  // user and password travel as query parameters too, which pg-connection-string prefers
  // to the URL's own: a password without a user is kept that way.
  const userinfo = '';
  const params = [...values].map(([k, v]) => `${enc(RENAMED[k] ?? k)}=${enc(v)}`);
  const urls = hosts.map((host, i) => {
    const query = [...params];
    let authority = '';
    if (host.startsWith('/')) query.push(`host=${enc(host)}`); // a socket directory
    else authority = `${host.includes(':') ? `[${host}]` : host}${ports[i] ? `:${ports[i]}` : ''}`;
    return `postgresql://${userinfo}${authority}/${database === undefined ? '' : enc(database)}${query.length ? `?${query.join('&')}` : ''}`;
  });
  return { urls, target };
}

/**
 * The servers a connection string names: `{ urls, target }`, one single-host URL per
 * server in the order given and target_session_attrs (`any` unless given, here or in
 * PGTARGETSESSIONATTRS), or null for a single-host URL without target_session_attrs,
 * which node-postgres takes as it is.
 */
function parseHosts(connectionString, env = process.env) {
  if (typeof connectionString !== 'string' || connectionString.trim() === '') {
    // From the environment: only when PGHOST lists several hosts or a target is set.
    if (!(env.PGHOST ?? '').includes(',') && !env.PGTARGETSESSIONATTRS) return null;
    return fromKeywords('', env);
  }
  if (!isUrl(connectionString)) return fromKeywords(connectionString, env);
  const list = fromUrl(connectionString);
  if (list.urls.length === 1 && list.target === 'any' && !/[?&]target_session_attrs=/.test(connectionString)) return null;
  return list;
}

/** Why a server was passed over: a connection failure (R1), so that the call is retried. */
function notTheTarget(target, kind) {
  return Object.assign(new Error(`pg-once: the server is ${kind}, not ${target} (target_session_attrs)`), { code: '08001' });
}

/**
 * The hosts of a parsed string and which of them to try first: the last one that
 * qualified, so that a new connection goes where the others are (and, after a failover,
 * the first to qualify becomes it).
 */
class HostList {
  constructor({ urls, target }) {
    this.urls = urls;
    this.target = target;
    this.preferred = 0;
  }

  /** Throws (a connection failure) unless the connected `client` is a server of the target kind. */
  async check(client) {
    if (this.target === 'any') return;
    const { rows: [{ read_only: readOnly, standby }] } = await client.query(KIND_SQL);
    const ok = {
      'read-write': readOnly === 'off',
      'read-only': readOnly === 'on',
      primary: !standby,
      standby,
    }[this.target];
    if (!ok) throw notTheTarget(this.target, standby ? 'a standby' : readOnly === 'on' ? 'read-only' : 'writable');
  }

  /** Host `i` failed or did not qualify: the next one is tried first from now on. */
  skip(i) {
    if (this.preferred === i) this.preferred = (i + 1) % this.urls.length;
  }

  /** Host `i` qualified. */
  keep(i) {
    this.preferred = i;
  }

  /**
   * One connected pg.Client (made with `make(config)`) on the first host, from the
   * preferred one on in order, that qualifies; the last failure if none does.
   */
  async connect(base, make) {
    let failure;
    const start = this.preferred;
    for (let k = 0; k < this.urls.length; k += 1) {
      const i = (start + k) % this.urls.length;
      const client = make({ ...base, connectionString: this.urls[i] });
      try {
        await client.connect();
        await this.check(client);
        this.keep(i);
        return client;
      } catch (err) {
        client.end().catch(() => {});
        failure = err;
        this.skip(i);
      }
    }
    throw failure;
  }
}

/**
 * pg.Pool options that make each of its connections on one host of `list` (the preferred
 * one) and keep it only if it qualifies: the pool's `Client` and `onConnect` hook. A host
 * that fails or does not qualify fails that connection, which the client's retry (R2)
 * replaces at once by one on the next host.
 */
function poolOptions(pg, list) {
  class HostListClient extends pg.Client {
    constructor(options) {
      const i = list.preferred;
      super({ ...options, connectionString: list.urls[i] });
      this.hostIndex = i;
    }

    connect(callback) {
      const failed = (err) => {
        if (err) list.skip(this.hostIndex);
        return err;
      };
      if (callback) return super.connect((err) => callback(failed(err)));
      return super.connect().catch((err) => { throw failed(err); });
    }
  }
  return {
    Client: HostListClient,
    hostList: list,
    onConnect: async (client) => {
      try {
        await list.check(client);
        list.keep(client.hostIndex);
      } catch (err) {
        list.skip(client.hostIndex);
        throw err;
      }
    },
  };
}

module.exports = { parseHosts, HostList, poolOptions, keywordPairs, TARGETS };
