-- modelops: the LLM parts of the local router, loaded by HAProxy 2.6 (Lua 5.3, `lua-load`).
--
--   http-request lua.modelops_affinity <prefix_bytes> <load_bound_percent>   picks the instance of a
--       request that has an affinity key (modelops/routing.py) and sets txn.modelops_server, which
--       the backend's `use-server` rules follow; lua.modelops_session_affinity <load_bound_percent>
--       does the same from X-Session-Id alone (gRPC)
--   http-request lua.modelops_start / http-response lua.modelops_observe
--       time each routed request from its arrival to the response headers the instance sends
--   http-request use-service lua.modelops_metrics
--       those counts and histograms, plus each server's retries and redispatches, in
--       Prometheus' text format (labels model, version, instance, protocol; code on requests)
--
-- HAProxy runs Lua under one lock shared by its threads (no lua-load-per-thread), so the tables
-- below are consistent; they live as long as the worker, like HAProxy's own counters (a reload
-- starts from zero). Facts: HAProxy 2.6 Lua API reference (txn.f, txn.http, core.now,
-- core.backends, Server.get_stats; stats columns wretr and wredis).

local AFFINITY_FIELDS = { messages = true, prompt = true, input = true, text_input = true, query = true,
                          text_1 = true }
local BUCKETS = { 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60 }
-- backend name prefix -> protocol (tasks/traffic/haproxy.py: _PROTOCOLS)
local PROTOCOLS = { m = "openai", mv = "openai", k = "kserve_http", kv = "kserve_http", kg = "kserve_http",
                    kgv = "kserve_http", g = "kserve_grpc", gv = "kserve_grpc" }

-- The end (index of the closing quote) of the JSON string whose opening quote is at i.
local function string_end(body, i)
    local j = i + 1
    while true do
        local k = body:find('["\\]', j)
        if k == nil then return nil end
        if body:byte(k) == 34 then return k end -- '"'
        j = k + 2                                -- skip the escaped character
    end
end

-- The end of the JSON value starting at i (a string, number, literal, object or array).
local function value_end(body, i)
    local c = body:byte(i)
    if c == 34 then return string_end(body, i) end
    if c ~= 123 and c ~= 91 then -- not '{' or '['
        local k = body:find('[,}%]%s]', i)
        return k and k - 1 or #body
    end
    local depth, j = 0, i
    while true do
        local k = body:find('["{}%[%]]', j)
        if k == nil then return nil end
        local b = body:byte(k)
        if b == 34 then
            k = string_end(body, k)
            if k == nil then return nil end
        elseif b == 123 or b == 91 then
            depth = depth + 1
        else
            depth = depth - 1
            if depth == 0 then return k end
        end
        j = k + 1
    end
end

local ESCAPES = { b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" }

-- The text of a raw JSON string's inside (between its quotes), escapes decoded as a JSON parser
-- decodes them (a \uD8xx\uDCxx surrogate pair is one code point).
local function unescape(raw)
    if not raw:find("\\", 1, true) then return raw end
    local out, i = {}, 1
    while true do
        local j = raw:find("\\", i, true)
        if j == nil then
            out[#out + 1] = raw:sub(i)
            break
        end
        out[#out + 1] = raw:sub(i, j - 1)
        local c = raw:sub(j + 1, j + 1)
        local hex = c == "u" and raw:sub(j + 2, j + 5):match("^%x%x%x%x$")
        if hex then
            local cp, after = tonumber(hex, 16), j + 6
            local low = cp >= 0xD800 and cp <= 0xDBFF and raw:sub(after, after + 1) == "\\u" and
                raw:sub(after + 2, after + 5):match("^%x%x%x%x$")
            if low and tonumber(low, 16) >= 0xDC00 and tonumber(low, 16) <= 0xDFFF then
                cp, after = 0x10000 + (cp - 0xD800) * 0x400 + (tonumber(low, 16) - 0xDC00), after + 6
            end
            out[#out + 1], i = utf8.char(cp), after
        else
            out[#out + 1], i = ESCAPES[c] or c, j + 2
        end
    end
    return table.concat(out)
end

-- Walks the top-level object of a JSON body, once per request (kept in the transaction's
-- private slot): the `model` field (its text when it is a string, and how many times the key
-- occurs: a parser keeps the last of duplicates, so two are refused rather than routed by one
-- and served by the other), the raw `user` string (quotes included), and the start and end of
-- the first prompt field's value. Stops at the first malformed token: the instance answers a
-- malformed body; what came before it still routes.
local function scan(body)
    local found = { models = 0 }
    local i = body:find("%S")
    if i == nil or body:byte(i) ~= 123 then return found end
    i = i + 1
    while i <= #body do
        local k = body:find("%S", i)
        if k == nil or body:byte(k) ~= 34 then break end
        local kend = string_end(body, k)
        if kend == nil then break end
        local key = unescape(body:sub(k + 1, kend - 1))
        local colon = body:find("%S", kend + 1)
        if colon == nil or body:byte(colon) ~= 58 then break end -- ':'
        local v = body:find("%S", colon + 1)
        if v == nil then break end
        local vend = value_end(body, v)
        if vend == nil then break end
        if key == "model" then
            found.models = found.models + 1
            found.model = body:byte(v) == 34 and unescape(body:sub(v + 1, vend - 1)) or nil
            -- HAProxy compares variables as C strings: "m\u0000x" would match model m. A control
            -- character is in no model id; the raw text keeps it from matching one.
            if found.model and found.model:find("%c") then found.model = body:sub(v + 1, vend - 1) end
        elseif key == "user" and body:byte(v) == 34 and vend > v + 1 and found.user == nil then
            found.user = body:sub(v, vend) -- an empty user is none: the prompt keys the request
        elseif AFFINITY_FIELDS[key] and found.prompt == nil then
            found.prompt, found.prompt_end = v, vend
        end
        local sep = body:find("%S", vend + 1)
        if sep == nil or body:byte(sep) ~= 44 then break end -- ','
        i = sep + 1
    end
    return found
end

-- scan() of this transaction's body, walked on first use.
local function scanned(txn)
    local found = txn:get_priv()
    if found == nil then
        local body = txn.f:req_body()
        local ok, result = pcall(scan, body or "")
        found = ok and result or { models = 0 }
        txn:set_priv(found)
    end
    return found
end

local EXPERIMENT_KEY_BYTES = 256 -- modelops/experiments.py MAX_KEY_BYTES

-- Sets txn.model to the body's top-level `model` string, and txn.model_problem when there is
-- none to route by: "type" (not a string), "duplicate" (the key twice), "missing".
core.register_action("modelops_model", { "http-req" }, function(txn)
    local found = scanned(txn)
    if found.models > 1 then
        txn:set_var("txn.model_problem", "duplicate")
    elseif found.model ~= nil then
        txn:set_var("txn.model", found.model)
    else
        txn:set_var("txn.model_problem", found.models == 1 and "type" or "missing")
    end
    -- An experiment's key when it is the body's `user` (modelops/experiments.py): the raw JSON
    -- string, quotes included; a longer one than EXPERIMENT_KEY_BYTES is none (the default arm).
    if found.user ~= nil and #found.user <= EXPERIMENT_KEY_BYTES then txn:set_var("txn.user_key", found.user) end
end, 0)

-- Session ids and users longer than this share their key with those that start alike: a key is
-- hashed per request, and a client must not make that cost grow with what it sends.
local SESSION_BYTES = 256
-- A prompt is matched in chunks of prefix_bytes, at most this many: past MAX_LEVELS x
-- prefix_bytes of shared prompt, requests are alike enough to meet (and the hashing per request
-- stays a few microseconds: HAProxy's xxh64 converter runs at ~2 GB/s).
local MAX_LEVELS = 32

-- The affinity keys of a request, shortest first: X-Session-Id, else the body's top-level
-- `user`, as one key; else the chained hashes of the prompt field's raw JSON cut after every
-- prefix_bytes bytes (the first cut also when shorter, the others only when whole), so two
-- prompts share as many keys as whole chunks they share from the start. nil when it has none.
local function affinity_keys(txn, prefix_bytes)
    local c = txn.c
    local session = txn.http:req_get_headers()["x-session-id"]
    if session and session[0] and session[0] ~= "" then return { c:xxh64("s:" .. session[0]:sub(1, SESSION_BYTES)) } end
    local found = scanned(txn)
    local body, user, prompt, prompt_end = txn.f:req_body(), found.user, found.prompt, found.prompt_end
    if user then return { c:xxh64("u:" .. user:sub(1, SESSION_BYTES)) } end
    if prompt == nil or body == nil then return nil end
    local keys, h = {}, 0
    for level = 1, MAX_LEVELS do
        local last = prompt + level * prefix_bytes - 1
        if last > prompt_end and level > 1 then break end
        h = c:xxh64(tostring(h) .. body:sub(prompt + (level - 1) * prefix_bytes, math.min(last, prompt_end)))
        keys[level] = h
        if last >= prompt_end then break end
    end
    return keys
end

-- Which instances of each backend were sent each key, by the key's 64-bit hash (a collision only
-- shares a placement): two generations of KEYS_PER_GENERATION keys, the older dropped when the
-- newer fills, so memory is bounded, and a key in use moves to the newer. Per instance, how many
-- keys it holds (`held`, both generations): the share of the prompts it was sent, which a new
-- prompt evens out.
local KEYS_PER_GENERATION = 32768
local placed = {} -- backend name -> {new = {key -> {server -> true}}, old = {...}, n = keys in new,
                  --                  held = {server -> keys in new}, old_held = {server -> keys in old}}

-- The instances sent key (a table server -> true), moved into the newer generation; nil if none.
local function recall(memory, key)
    local servers = memory.new[key]
    if servers ~= nil then return servers end
    servers = memory.old[key]
    if servers == nil then return nil end
    memory.old[key], memory.new[key], memory.n = nil, servers, memory.n + 1
    for s in pairs(servers) do
        memory.old_held[s] = (memory.old_held[s] or 1) - 1
        memory.held[s] = (memory.held[s] or 0) + 1
    end
    return servers
end

local function remember(memory, keys, server)
    for _, key in ipairs(keys) do
        local servers = recall(memory, key)
        if servers == nil then
            servers = {}
            memory.new[key], memory.n = servers, memory.n + 1
        end
        if not servers[server] then
            servers[server] = true
            memory.held[server] = (memory.held[server] or 0) + 1
        end
    end
    if memory.n >= KEYS_PER_GENERATION then
        memory.old, memory.old_held = memory.new, memory.held
        memory.new, memory.held, memory.n = {}, {}, 0
    end
end

-- Whether instance a (within the load guard: fits_a; tie-break tie_a) goes before instance b:
-- the longer match; for a prompt neither holds, one at most at its share of the requests in
-- flight before one above it (no cache to gain anywhere, so no load to trade for it: a backlogged
-- instance, as one the autoscaler is relieving, would otherwise take every other new prompt while
-- it holds fewer keys), then the one holding fewer keys for its weight (as SGLang's cache-aware
-- router sends a new prefix to the instance with the smallest prefix tree), then the less
-- loaded; for equal matches, the less loaded, then the one holding fewer keys.
local function better(fits_a, a, tie_a, fits_b, b, tie_b)
    if fits_a ~= fits_b then return fits_a end
    if a.match ~= b.match then return a.match > b.match end
    local la, lb, ha, hb = a.load / a.weight, b.load / b.weight, a.held / a.weight, b.held / b.weight
    if a.match == 0 and a.over ~= b.over then return b.over end
    if a.match == 0 and ha ~= hb then return ha < hb end
    if la ~= lb then return la < lb end
    if ha ~= hb then return ha < hb end
    return tie_a > tie_b
end

-- Prefix affinity with a load guard (modelops/routing.py). Each request goes to the instance
-- that was sent the most of its keys from the first on (the longest shared prompt start, so the
-- longest run its prefix cache may hold), among the instances whose requests in flight stay
-- within load_bound x their weighted share of all in flight (+1, this request); a prompt none
-- holds goes to the one holding the fewest keys, relative to weight; equal matches go to the
-- least loaded relative to weight (see better()), then to the same instance for the same keys. An
-- instance sent a request is remembered for its keys too: a prompt that overflows its instance
-- is then held by two, and its later requests go to the less loaded of them. Instances out of
-- rotation (down, draining, weight 0) take nothing. Sets txn.modelops_server, which the
-- backend's use-server rules follow; with no key, or no instance in rotation, the backend's
-- leastconn decides.
local function place(txn, keys, bound_percent)
    if keys == nil or keys[1] == nil then return end
    local name = txn.f:be_name()
    local backend = core.backends[name]
    if backend == nil then return end
    local live, total, weights = {}, 0, 0
    for sname, server in pairs(backend.servers) do
        local stats, weight = server:get_stats(), server:get_weight()
        if weight > 0 and tostring(stats.status):sub(1, 2) == "UP" then
            local load = tonumber(stats.scur) or 0
            live[#live + 1] = { name = sname, load = load, weight = weight, match = 0, held = 0 }
            total, weights = total + load, weights + weight
        end
    end
    if #live == 0 then return end
    local memory = placed[name]
    if memory == nil then
        memory = { new = {}, old = {}, n = 0, held = {}, old_held = {} }
        placed[name] = memory
    end
    for _, s in ipairs(live) do s.held = (memory.held[s.name] or 0) + (memory.old_held[s.name] or 0) end
    -- How many keys from the first each instance was sent: stop at the first key none was sent.
    for level, key in ipairs(keys) do
        local servers = recall(memory, key)
        if servers == nil then break end
        local any = false
        for _, s in ipairs(live) do
            if s.match == level - 1 and servers[s.name] then s.match, any = level, true end
        end
        if not any then break end
    end
    local bound = tonumber(bound_percent) / 100
    local best, best_fits, best_tie
    for _, s in ipairs(live) do s.over = s.load * weights > total * s.weight end -- above its share in flight
    for _, s in ipairs(live) do
        local fits = s.load + 1 <= math.ceil(bound * (total + 1) * s.weight / weights)
        local tie = txn.c:xxh32(s.name .. tostring(keys[#keys]))
        if best == nil or better(fits, s, tie, best_fits, best, best_tie) then best, best_fits, best_tie = s, fits, tie end
    end
    remember(memory, keys, best.name)
    txn:set_var("txn.modelops_server", best.name)
end

core.register_action("modelops_affinity", { "http-req" }, function(txn, prefix_bytes, bound_percent)
    place(txn, affinity_keys(txn, tonumber(prefix_bytes)), bound_percent)
end, 2)

-- The same placement keyed by X-Session-Id alone: for gRPC, whose body is a stream of protobuf
-- frames the router neither buffers nor reads.
core.register_action("modelops_session_affinity", { "http-req" }, function(txn, bound_percent)
    local session = txn.http:req_get_headers()["x-session-id"]
    if session and session[0] and session[0] ~= "" then
        place(txn, { txn.c:xxh64("s:" .. session[0]:sub(1, SESSION_BYTES)) }, bound_percent)
    end
end, 1)

-- -- metrics ----------------------------------------------------------------------------------

local requests = {}   -- label string -> count
local assigned = {}   -- label string (model, version, assigned) -> requests an experiment sent there
local histograms = {} -- label string -> {counts per bucket (non-cumulative), sum, count}

local function now_us()
    local t = core.now()
    return t.sec * 1000000 + t.usec
end

local function escape(v)
    return (tostring(v or ""):gsub('\\', '\\\\'):gsub('"', '\\"'):gsub("\n", "\\n"))
end

-- (model, version, protocol) of a routed backend: m_<model>, mv_<model>__<version>, ...
local function backend_labels(backend)
    local prefix, rest = backend:match("^(%a+)_(.+)$")
    local protocol = prefix and PROTOCOLS[prefix]
    if protocol == nil then return nil end
    local model, version = rest:match("^(.-)__(.+)$")
    return model or rest, version, protocol
end

-- "<model>/<server>" -> the version whose pinned route (mv_<model>__<version>, ...) holds that
-- server: a weighted route's servers belong to the versions its pinned routes name. Built once
-- per worker (a reload starts a new one, with the new servers).
local server_versions = nil
local function version_of(model, server)
    if server_versions == nil then
        server_versions = {}
        for name, backend in pairs(core.backends) do
            local m, version = backend_labels(name)
            if m and version then
                for sname in pairs(backend.servers) do server_versions[m .. "/" .. sname] = version end
            end
        end
    end
    return server_versions[model .. "/" .. server]
end

core.register_action("modelops_start", { "http-req" }, function(txn)
    txn:set_var("txn.modelops_t0", now_us())
end, 0)

core.register_action("modelops_observe", { "http-res" }, function(txn)
    local model, pinned, protocol = backend_labels(txn.f:be_name() or "")
    if model == nil then return end
    local server = txn.f:srv_name() or ""
    local version = pinned or version_of(model, server)
    local base = string.format('model="%s",version="%s",instance="%s",protocol="%s"', escape(model), escape(version),
        escape(server), protocol)
    local code = tostring(txn.f:status() or "")
    local grpc = txn.http:res_get_headers()["grpc-status"] -- a trailers-only gRPC answer
    if grpc and grpc[0] then code = code .. '",grpc_status="' .. escape(grpc[0]) end
    local key = base .. ',code="' .. code .. '"'
    requests[key] = (requests[key] or 0) + 1
    local how = txn:get_var("txn.exp_assigned") -- "key" or "default": an experiment chose the version
    if how ~= nil and pinned ~= nil then
        local arm = string.format('model="%s",version="%s",assigned="%s"', escape(model), escape(pinned), how)
        assigned[arm] = (assigned[arm] or 0) + 1
    end
    local t0 = txn:get_var("txn.modelops_t0")
    if t0 == nil then return end
    local seconds = (now_us() - t0) / 1e6
    local h = histograms[base]
    if h == nil then
        h = { counts = {}, sum = 0, count = 0 }
        for b = 1, #BUCKETS + 1 do h.counts[b] = 0 end
        histograms[base] = h
    end
    local b = 1
    while b <= #BUCKETS and seconds > BUCKETS[b] do b = b + 1 end
    h.counts[b] = h.counts[b] + 1
    h.sum = h.sum + seconds
    h.count = h.count + 1
end, 0)

core.register_service("modelops_metrics", "http", function(applet)
    local out = {
        "# HELP modelops_router_requests_total Requests the router sent to an instance, by the status it answered.",
        "# TYPE modelops_router_requests_total counter",
    }
    for labels, n in pairs(requests) do
        out[#out + 1] = "modelops_router_requests_total{" .. labels .. "} " .. n
    end
    out[#out + 1] = "# HELP modelops_router_ttfb_seconds From a request's arrival at the router to the response " ..
        "headers of the instance that answered it."
    out[#out + 1] = "# TYPE modelops_router_ttfb_seconds histogram"
    for labels, h in pairs(histograms) do
        local cumulative = 0
        for b = 1, #BUCKETS do
            cumulative = cumulative + h.counts[b]
            out[#out + 1] = string.format('modelops_router_ttfb_seconds_bucket{%s,le="%s"} %d', labels, BUCKETS[b],
                cumulative)
        end
        out[#out + 1] = string.format('modelops_router_ttfb_seconds_bucket{%s,le="+Inf"} %d', labels, h.count)
        out[#out + 1] = string.format("modelops_router_ttfb_seconds_sum{%s} %.6f", labels, h.sum)
        out[#out + 1] = string.format("modelops_router_ttfb_seconds_count{%s} %d", labels, h.count)
    end
    out[#out + 1] = "# HELP modelops_router_experiment_requests_total Requests an experiment sent to an arm, by " ..
        "how: by the hash of their key, or to the default arm (no key, or one too long)."
    out[#out + 1] = "# TYPE modelops_router_experiment_requests_total counter"
    for labels, n in pairs(assigned) do
        out[#out + 1] = "modelops_router_experiment_requests_total{" .. labels .. "} " .. n
    end
    local counters = {
        { "retries", "wretr", "Connection attempts the router made again on a server that failed one." },
        { "redispatches", "wredis", "Requests the router sent to another server after this one failed them." },
    }
    for _, c in ipairs(counters) do
        out[#out + 1] = "# HELP modelops_router_" .. c[1] .. "_total " .. c[3]
        out[#out + 1] = "# TYPE modelops_router_" .. c[1] .. "_total counter"
        for name, backend in pairs(core.backends) do
            local model, version, protocol = backend_labels(name)
            if model then
                for sname, server in pairs(backend.servers) do
                    local stats = server:get_stats()
                    out[#out + 1] = string.format(
                        'modelops_router_%s_total{model="%s",version="%s",instance="%s",protocol="%s",route="%s"} %d',
                        c[1], escape(model), escape(version or version_of(model, sname)), escape(sname),
                        protocol, version and "pinned" or "weighted", tonumber(stats[c[2]]) or 0)
                end
            end
        end
    end
    local text = table.concat(out, "\n") .. "\n"
    applet:set_status(200)
    applet:add_header("content-type", "text/plain; version=0.0.4; charset=utf-8")
    applet:add_header("content-length", tostring(#text))
    applet:start_response()
    applet:send(text)
end)
