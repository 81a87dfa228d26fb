// The conformance runner's TCP proxy (clients/conformance/README.md, "proxy": true): a
// client's pool reaches the server through it, and a scenario can make it hold what the
// server sends, so that a statement has run on the server while its answer is still on
// its way to the client.
import net from 'node:net';
import { parse } from 'pg-connection-string';

/**
 * A proxy on 127.0.0.1 (an ephemeral port) forwarding to `target` ({ host, port }).
 * `pause()` holds every byte the server sends, on the connections open and on those
 * accepted later; `resume()` forwards what was held and goes on forwarding. What the client
 * sends always flows. `close()` ends every connection and the listening socket.
 */
export async function startProxy(target) {
  const links = new Set();
  let paused = false;

  /** Sends what a link held while paused, and the server's end of it if that came too. */
  const flush = (link) => {
    for (const chunk of link.held.splice(0)) link.client.write(chunk);
    if (link.serverEnded) link.client.end();
  };

  const listener = net.createServer((client) => {
    const server = net.connect(target);
    const link = { client, server, held: [], serverEnded: false };
    links.add(link);
    client.on('data', (chunk) => server.write(chunk));
    client.on('end', () => server.end());
    server.on('data', (chunk) => {
      if (paused) link.held.push(chunk);
      else client.write(chunk);
    });
    // The server closing its side is part of what it sends: held, in order, while paused.
    server.on('end', () => {
      link.serverEnded = true;
      if (!paused) flush(link);
    });
    // Either side failing takes the other down, as a dropped connection would.
    const drop = () => {
      client.destroy();
      server.destroy();
      links.delete(link);
    };
    client.on('error', drop).on('close', drop);
    server.on('error', drop).on('close', () => {
      // A close after an end may still have bytes held for the client: they go on resume.
      if (!link.serverEnded || !paused) drop();
    });
  });
  await new Promise((resolve, reject) => {
    listener.once('error', reject);
    listener.listen(0, '127.0.0.1', resolve);
  });

  return {
    host: '127.0.0.1',
    port: listener.address().port,
    pause() {
      paused = true;
    },
    resume() {
      paused = false;
      for (const link of links) flush(link);
    },
    /** Resolves once the listening socket and every connection are closed. */
    async close() {
      paused = false;
      for (const link of links) {
        link.client.destroy();
        link.server.destroy();
      }
      links.clear();
      await new Promise((resolve) => listener.close(() => resolve()));
    },
  };
}

/**
 * The server `dsn` (a postgresql:// URL) names, and the same URL pointed at `proxy`
 * instead: host and port replaced, and any host, hostaddr or port query parameters (which
 * would override them) removed. Null for a DSN that is not a URL of one TCP host.
 */
export function throughProxy(dsn) {
  let url;
  try {
    url = new URL(dsn);
  } catch {
    return null;
  }
  if (!/^postgres(ql)?:$/.test(url.protocol)) return null;
  // pg-connection-string reads it as node-postgres does, query overrides included.
  const { host, port } = parse(dsn);
  if (!host || host.startsWith('/') || host.includes(',')) return null;
  const target = { host, port: Number(port ?? 5432) };
  return {
    target,
    dsnFor(proxy) {
      const proxied = new URL(dsn);
      proxied.hostname = proxy.host;
      proxied.port = String(proxy.port);
      for (const name of ['host', 'hostaddr', 'port']) proxied.searchParams.delete(name);
      return proxied.toString();
    },
  };
}
