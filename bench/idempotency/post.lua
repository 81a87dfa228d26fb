-- wrk script of bench.py: POST the order, with a fresh Idempotency-Key per request when
-- the first argument is "keyed" (the second makes keys unique across runs); one JSON
-- line on stdout at the end.

local keyed, run, sent = false, "", 0
local next_id = 0

-- Runs in the main state, once per thread: thread_id becomes a global of that thread's.
function setup(thread)
  next_id = next_id + 1
  thread:set("thread_id", next_id)
end

function init(args)
  keyed, run = args[1] == "keyed", args[2] or ""
end

function request()
  sent = sent + 1
  local headers = {["Content-Type"] = "application/json"}
  if keyed then
    headers["Idempotency-Key"] = string.format("%s-%d-%d", run, thread_id, sent)
  end
  return wrk.format("POST", nil, headers, '{"sku": "bench"}')
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, '
      .. '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect, e.read, e.write, e.status, e.timeout))
end
