"""Tests of the Python client against a running server (PG_ONCE_DSN); run by scripts/test.sh.

    python -m unittest -v test_client
"""

import os
import threading
import time
import unittest
import uuid

import psycopg

from pg_once_client import OnceClient, OnceFailed

DSN = os.environ["PG_ONCE_DSN"]


def fresh(name: str) -> str:
    return f"python/{name}/{uuid.uuid4()}"


def run_concurrently(n, fn):
    """Run fn(i) in n threads at once; return results (or exceptions) in order."""
    results = [None] * n
    barrier = threading.Barrier(n)

    def call(i):
        barrier.wait()
        try:
            results[i] = fn(i)
        except Exception as exc:  # noqa: BLE001 - collected for the assertions
            results[i] = exc

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


class OnceClientTest(unittest.TestCase):
    def many_callers_one_computation(self, protocol):
        key, computed = fresh(protocol), []

        def compute():
            computed.append(1)
            time.sleep(0.5)
            return {"value": 42}

        def caller(_):
            client = OnceClient(DSN, protocol=protocol)
            try:
                return client.get(key, compute)
            finally:
                client.close()

        results = run_concurrently(20, caller)
        self.assertEqual(len(computed), 1, "exactly one caller computes")
        self.assertEqual(results, [{"value": 42}] * 20, "every caller gets the result")

    def test_many_callers_one_computation_server_side_waiting(self):
        self.many_callers_one_computation("server")

    def test_many_callers_one_computation_listen_first(self):
        self.many_callers_one_computation("listen")

    def test_a_failure_is_shared_not_retried_by_every_caller(self):
        key, attempts = fresh("failure"), []

        def compute():
            attempts.append(1)
            time.sleep(0.3)
            raise RuntimeError("upstream returned 503")

        def caller(_):
            client = OnceClient(DSN)
            try:
                return client.get(key, compute, retry_after=30)
            finally:
                client.close()

        results = run_concurrently(10, caller)
        self.assertEqual(len(attempts), 1)
        self.assertTrue(all(isinstance(r, (OnceFailed, RuntimeError)) for r in results), results)
        shared = [r for r in results if isinstance(r, OnceFailed)]
        self.assertEqual(len(shared), 9)
        self.assertIn("upstream returned 503", shared[0].error)

    def test_a_killed_caller_is_taken_over(self):
        key = fresh("killed")
        admin = psycopg.connect(DSN, autocommit=True)
        victim = OnceClient(DSN)
        victim_pid = victim.conn.info.backend_pid
        started = threading.Event()

        def doomed():
            started.set()
            time.sleep(10)  # never finishes: its connection is killed first
            return "never"

        victim_thread = threading.Thread(
            target=lambda: self.assertRaises(Exception, victim.get, key, doomed), daemon=True)
        victim_thread.start()
        started.wait(5)
        successor = OnceClient(DSN)
        admin.execute("SELECT pg_terminate_backend(%s)", (victim_pid,))
        begun = time.monotonic()
        value = successor.get(key, lambda: "second try")
        self.assertEqual(value, "second try")
        self.assertLess(time.monotonic() - begun, 2.0)
        successor.close()
        admin.close()

    def test_the_decorator_caches_by_key(self):
        client, calls = OnceClient(DSN), []
        prefix = fresh("decorated")

        @client.cached(key=lambda n: f"{prefix}/{n}", ttl=60)
        def square(n):
            calls.append(n)
            return n * n

        self.assertEqual([square(3), square(3), square(4)], [9, 9, 16])
        self.assertEqual(calls, [3, 4])
        client.close()


if __name__ == "__main__":
    unittest.main()
