// The seed scenario: many pods ask for the same URLs, whose scrape takes seconds.
//
//   PG_ONCE_DSN="host=127.0.0.1 port=55433 user=postgres dbname=postgres" node seed.js 20 3 2
//                                                           (pods, urls, scrape seconds)
import { OnceClient } from './once.js';

const [pods = 20, urlCount = 3, seconds = 2] = process.argv.slice(2).map(Number);
const run = Date.now();
const urls = Array.from({ length: urlCount }, (_, i) => `https://shop.example/${run}/product/${i}`);
let scrapes = 0;
const scrape = async (url) => {
  scrapes += 1;
  await new Promise((r) => setTimeout(r, seconds * 1000));
  return { url, title: `Page of ${url}` };
};

const started = Date.now();
const served = (await Promise.all(Array.from({ length: pods }, async (_, n) => {
  const once = await OnceClient.connect(process.env.PG_ONCE_DSN);
  const pages = [];
  for (const url of [...urls.slice(n % urlCount), ...urls.slice(0, n % urlCount)]) {
    pages.push(await once.get(url, () => scrape(url), { ttl: 3600 }));
  }
  await once.end();
  return pages;
}))).flat();
console.log(`${served.length} requests served by ${scrapes} scrapes in ${((Date.now() - started) / 1000).toFixed(1)} s`);
