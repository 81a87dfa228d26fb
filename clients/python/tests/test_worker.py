"""The queue worker loop: every job processed exactly once across worker processes,
failures recorded, a graceful stop on SIGTERM that finishes what it holds."""

import signal
import time
import uuid

import pytest

from conftest import Child


@pytest.fixture
def queue(admin):
    name = f"py-{uuid.uuid4().hex[:10]}"
    admin.execute("SELECT once.create_queue(%s, max_attempts => 3, backoff => '1 second')", (name,))
    yield name
    admin.execute("SELECT once.invalidate_keys(queue => %s)", (name,))
    admin.execute("SELECT once.drop_queue(%s)", (name,))


def enqueue(admin, queue, keys, payload=None):
    for k in keys:
        admin.execute("SELECT once.enqueue_key(%s, %s::jsonb, %s)",
                      (k, payload and __import__("json").dumps(payload), queue))


def attempts(admin, queue):
    return admin.execute(
        "SELECT a.key, a.outcome FROM once.attempts a JOIN once.entries e USING (key_hash)"
        " WHERE e.queue = %s", (queue,)).fetchall()


def wait_until(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("mode", ["worker", "aworker"])
def test_worker_processes_each_job_once_and_stops_on_sigterm(setup, admin, queue, mode):
    keys = [f"{queue}/job/{i}" for i in range(60)]
    workers = [Child(mode, setup, queue=queue, concurrency=4) for _ in range(2)]
    for w in workers:
        assert w.line()["ready"]
    enqueue(admin, queue, keys)
    assert wait_until(lambda: admin.execute(
        "SELECT count(*) FROM once.entries WHERE queue = %s AND state = 'done'",
        (queue,)).fetchone()[0] == len(keys), 20)
    for w in workers:
        w.proc.send_signal(signal.SIGTERM)
    reports = [w.finish(timeout=10) for w in workers]
    assert sum(r["completed"] for r in reports) == len(keys)
    rows = attempts(admin, queue)
    assert sorted(k for k, _ in rows) == sorted(keys)            # one attempt per job
    assert {o for _, o in rows} == {"completed"}
    results = admin.execute("SELECT key, result FROM once.entries WHERE queue = %s", (queue,)).fetchall()
    assert all(r["key"] == k for k, r in results)


@pytest.mark.parametrize("mode", ["worker", "aworker"])
def test_sigterm_lets_running_jobs_finish(setup, admin, queue, mode):
    worker = Child(mode, setup, queue=queue, concurrency=2)
    assert worker.line()["ready"]
    enqueue(admin, queue, [f"{queue}/slow/{i}" for i in range(2)], {"seconds": 1.5})
    assert wait_until(lambda: admin.execute(
        "SELECT count(*) FROM once.entries WHERE queue = %s AND state = 'running'",
        (queue,)).fetchone()[0] == 2, 10)
    t0 = time.monotonic()
    worker.proc.send_signal(signal.SIGTERM)
    report = worker.finish(timeout=15)
    assert report == {"completed": 2, "failed": 0, "released": 0}
    assert time.monotonic() - t0 < 5
    assert {o for _, o in attempts(admin, queue)} == {"completed"}


def test_handler_errors_fail_the_job(clients, admin, queue):
    client = clients()
    enqueue(admin, queue, [f"{queue}/bad", f"{queue}/object"])
    seen = []

    def handler(job):
        seen.append(job.key)
        if job.key.endswith("bad"):
            raise RuntimeError("cannot thumbnail")
        return object()   # not JSON

    w = client.worker(queue, handler, concurrency=2, idle_wait=0.2, signals=False)
    import threading
    t = threading.Thread(target=w.run)
    t.start()
    assert wait_until(lambda: len(seen) >= 2, 10)
    w.stop()
    t.join(10)
    assert not t.is_alive()
    assert (w.completed, w.failed) == (0, 2)
    errors = dict(admin.execute(
        "SELECT a.key, a.error FROM once.attempts a JOIN once.entries e USING (key_hash)"
        " WHERE e.queue = %s", (queue,)).fetchall())
    assert "RuntimeError: cannot thumbnail" in errors[f"{queue}/bad"]
    assert "object has no JSON form" in errors[f"{queue}/object"]
