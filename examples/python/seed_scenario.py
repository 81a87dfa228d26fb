"""The seed scenario: many pods ask for the same URLs, whose scrape takes seconds.

    PG_ONCE_DSN="host=127.0.0.1 port=55433 user=postgres dbname=postgres" \
        python seed_scenario.py --pods 20 --urls 3 --scrape-seconds 2

Every pod is a thread with its own connection. Each asks for every URL; pg_once makes one
pod scrape each URL and hands the page to the others.
"""

import argparse
import os
import threading
import time

from pg_once_client import OnceClient

scrapes = 0
scrapes_lock = threading.Lock()


def scrape(url: str, seconds: float) -> dict:
    global scrapes
    with scrapes_lock:
        scrapes += 1
    time.sleep(seconds)
    return {"url": url, "title": f"Page of {url}"}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--urls", type=int, default=3)
    parser.add_argument("--scrape-seconds", type=float, default=2.0)
    parser.add_argument("--protocol", choices=("server", "listen"), default="server")
    args = parser.parse_args()
    dsn = os.environ["PG_ONCE_DSN"]
    run = time.time_ns()
    urls = [f"https://shop.example/{run}/product/{i}" for i in range(args.urls)]
    served = []

    def pod(n: int) -> None:
        client = OnceClient(dsn, protocol=args.protocol)
        for url in urls[n % len(urls):] + urls[:n % len(urls)]:
            page = client.get(url, lambda url=url: scrape(url, args.scrape_seconds), ttl=3600)
            served.append(page["title"])
        client.close()

    started = time.monotonic()
    pods = [threading.Thread(target=pod, args=(n,)) for n in range(args.pods)]
    for p in pods:
        p.start()
    for p in pods:
        p.join()
    print(f"{len(served)} requests served by {scrapes} scrapes in "
          f"{time.monotonic() - started:.1f} s ({args.protocol} protocol)")


if __name__ == "__main__":
    main()
