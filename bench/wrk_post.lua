-- wrk script for bench/peer_proxy_bench.py: POSTs head .. n .. tail with n counting up, so every body
-- is new (a new last turn or prompt suffix), and prints one JSON line of results when done.
-- Arguments after `--`: request path, head file, tail file.
local counter = 0
local path, head, tail

local function slurp(name)
  local f = assert(io.open(name, "rb"))
  local s = f:read("*a")
  f:close()
  return s
end

function init(args)
  path, head, tail = args[1], slurp(args[2]), slurp(args[3])
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  counter = counter + 1
  return wrk.format("POST", path, nil, head .. counter .. tail)
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"duration_us":%d,"errors":%d,"status_errors":%d,"p50_us":%.1f,"p99_us":%.1f}\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99)))
end
