#!lua flags=allow-cross-slot-keys
-- admitd's shared-store script: every state change of an admission decision, run atomically inside
-- Redis. Loaded once per connection and called by its SHA (EVALSHA; reloaded on NOSCRIPT).
--
-- ARGV[1] names the operation, ARGV[2] is its spec (built by src/store/spec.rs: MessagePack read by
-- position for `decide` and `release`, see `op_decide` and `release_spec`; JSON for the others, off
-- the decision path) and ARGV[3] what a lease keeps for its release (MessagePack, stored as is).
-- Or ARGV[1] is `batch` and the rest are triples of the same (operation, spec, lease data): several
-- decisions of one replica in one call, each all or nothing on its own, answered in order (an
-- error answers `{'error', message}` for its own operation only). Every key the script touches is
-- named in the spec; KEYS[1] is one of them,
-- so that Redis Cluster routes the call to the shard that holds them all (every key of one call
-- shares one hash tag).
--
-- The first line declares the script's flags, which needs Redis 7.0 or newer: `allow-cross-slot-keys`
-- lets a cluster node's batch (`routed`, at the end) touch the slots of several tenants. A script
-- that declares flags gets Redis 7's defaults for the others, where one without that line was
-- checked command by command: Redis refuses the whole call before it runs when it is out of memory
-- (no `allow-oom`) or a replica (no `no-writes`, no `allow-stale`), where a script without flags
-- failed at its first write. Either way admitd sees a script error, and now no operation of the
-- call ran in part.
--
-- Time is the store's own (TIME, read once per script call), in microseconds since the Unix epoch,
-- so replicas whose clocks disagree still enforce one limit. Microseconds keep every instant exact
-- in a Lua double for centuries (2^53 us is 285 years).
--
-- Layout. A tenant's own state is one hash, `h` (the tenant's hash), whose fields are named by
-- layer: a bucket layer's `<prefix>tat` (the instant it is full again) and `<prefix>p` (the
-- promise cursor that spreads retry hints), with the prefix `t|` for the tenant's bucket, `s:NAME|`
-- for a subject's and `u:NAME|` for a per-tenant upstream's; `t|n` and `s:NAME|n`, the leases a
-- concurrency scope counts; `l:ID`, each live lease; `rt:TOOL`, how long the tool's calls run; and
-- two expiry cursors, `x` (the instant the hash's own expiry was last pushed to) and `z` (the same
-- for the tenant's lease set). One HMGET reads every layer of a decision and one HSET writes them.
-- Other bucket layers (a subject's per tool, the cross-tenant ones) are hashes of their own with
-- `tat`, `p` and `x` (a shared upstream's bucket keeps a promise cursor per tenant, `p:TENANT`,
-- which the layer's `pf` names, and the latest of them in `p`, which its slices look at). The
-- lease set `z` holds every lease of the tenant, scored by its end, as
-- `ID` + the scopes it counts in (`t` tenant, `s` subject, `b` both, `-` none) + the subject, and a
-- sentinel `~` at +inf that keeps the set from vanishing when its last lease is released: leases
-- expire by being swept from it (their counts and their fields with them), when a count reaches
-- its cap, and on one call in 64 (the lease id's last digits).
--
-- Every hash the script keeps in this layout is read at most once per script call and written
-- once at its end (a batch of decisions that meet on the same hash, the global bucket for one,
-- pays one HMGET and one HSET for all of them). A key's expiry is pushed only when what it must
-- outlive passes its cursor, and then [`SLACK`] beyond, so a busy key costs one PEXPIRE per SLACK
-- instead of one per call. A key written without its cursor (no cursor, or a hash that expired and
-- came back) reads 0 and is pushed at once.
-- Operations:
--   decide   check and spend every layer of one call, all or nothing; returns ok / shed / busy
--   release  end a lease: free its slots, refund what a cancelled hold took, report the upstream
--   upstream report an upstream's answer seen outside a lease (penalty, AIMD, adaptive window)
--   answers  report a shared upstream's answers one replica gathered (none a 429 or a 503)
--   refund   give back bucket tokens (a cross-shard part of a call refused by another shard)
--   charge   take bucket tokens whatever the bucket holds (a release's cost above the admission's)
--   snapshot read a tenant's state for GET /v1/tenants/{tenant} (its spend of the day included)
--   task     make a lease an MCP task (its end at the task TTL) and schedule its first poll
--   poll     check a task's poll against its schedule; schedule the next one when on time
--   renew    move a live lease's end (and its slots') to its TTL after now
--   probe    write the probe schedule of an upstream admitd computed, unless it moved meanwhile
--   slice    take whole tokens of a cross-tenant bucket for one replica to spend (src/store/slices.rs)

-- Library functions as locals: a global's lookup costs a hash lookup per call in Lua 5.1.
local floor, max, min, ceil = math.floor, math.max, math.min, math.ceil
local format, sub, match = string.format, string.sub, string.match
local tonumber, tostring, ipairs, pairs, unpack, type = tonumber, tostring, ipairs, pairs, unpack, type
local mp_unpack = cmsgpack.unpack

local op = ARGV[1]
local spec, extra -- the operation's spec and lease data, set for each operation of a batch
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

-- The engine's rules, written in by admitd from its own constants when it builds the script it loads
-- (src/store/script.rs, which refuses a placeholder it has no value for; one left unwritten would
-- not be Lua either). Durations in microseconds.
local HORIZON = ${PROMISE_HORIZON}        -- how far ahead bucket promises may run
local GRACE = ${PROMISE_GRACE}            -- how long after its slot a promise still holds
local STAGGER_MIN_WINDOW = ${STAGGER_MIN_WINDOW} -- the least an upstream's hints are spread over
local SRE_SLOTS = ${SRE_SLOTS}            -- slots of an adaptive-throttle window
local MARGIN_SHARE = ${MARGIN_SHARE}      -- a slot hint's margin: the run over this,
local MARGIN_MIN, MARGIN_MAX = ${MARGIN_MIN}, ${MARGIN_MAX} -- within these
local DEFAULT_RUN = ${DEFAULT_RUN}        -- the run of a tool nothing was learned about
local AIMD_SNAP = ${AIMD_SNAP}            -- a recovering multiplier this close to 1 is 1
-- an adaptive refusal's wait: seconds per odds of a refusal (1 - p at least the least accept), within
local ADAPTIVE_WAIT_PER_ODDS, ADAPTIVE_LEAST_ACCEPT = ${ADAPTIVE_WAIT_PER_ODDS}, ${ADAPTIVE_LEAST_ACCEPT}
local ADAPTIVE_WAIT_MIN, ADAPTIVE_WAIT_MAX = ${ADAPTIVE_WAIT_MIN}, ${ADAPTIVE_WAIT_MAX}
local METER_RESTART = ${METER_RESTART}    -- a served meter quiet this many taus starts over
-- The store's own housekeeping: the calendar, and how long counters are kept.
local DAY = 86400e6
local KEEP = 2 * DAY       -- quota counters outlive their day by one

local function num(x, d)
  if x == false or x == nil then return d end
  return tonumber(x) or d
end

-- Integral values (every instant and most durations: microseconds) print as integers, which costs
-- a fraction of a 17-digit float; 2^53 bounds the doubles that are exact integers.
local function fmt(x)
  if x % 1 == 0 and x < 9e15 and x > -9e15 then return format('%d', x) end
  return format('%.17g', x)
end

local NOW = fmt(now) -- formatting a number is a large part of the script's own work: once
local DAYS = format('%d', floor(now / DAY)) -- the UTC day, as quota and lease fields name it

local function expire_at(key, at)
  local ms = ceil((at - now) / 1000)
  if ms < 1 then ms = 1 end
  redis.call('PEXPIRE', key, ms)
end

local SLACK = 10e6 -- how far past what it must outlive a key's expiry is pushed (housekeeping)

-- Makes `key` (which exists) live until at least `at`, given that its expiry was last pushed to
-- `pushed`; returns the instant it lives until now.
local function keep_until(key, at, pushed)
  if pushed >= at then return pushed end
  -- A renewed lease or a task may end long after this call: never cut a set's life short.
  local left = redis.call('PTTL', key)
  if left > 0 and now + left * 1000 >= at + SLACK then return now + left * 1000 end
  expire_at(key, at + SLACK)
  return at + SLACK
end

-- Runs `cmd key item...` over `items` (its first `n`; nil: all) in chunks (Lua's unpack is bounded).
local function chunked(cmd, key, items, n)
  n = n or #items
  for i = 1, n, 1000 do
    redis.call(cmd, key, unpack(items, i, min(i + 999, n)))
  end
end

-- The hashes of this layout, read once and written once per script call. `load` reads the fields
-- of a hash not read yet (and its cursor `x`) in one HMGET; `hget` answers a field loaded before;
-- `hput` changes a field (nil: deletes it); `keep` asks that the hash live until an instant.
-- `flush`, at the end of the script call, writes every changed field in one HSET (and one HDEL)
-- per hash and pushes its expiry when what it must outlive passed its cursor.
local cache, dirty = {}, {}

local function entry(key)
  local e = cache[key]
  if e == nil then
    -- Room for 8 fields in each table (a decision's tenant hash holds 7: x, z, two counts, two
    -- `tat`s and the lease): a table grown key by key is rehashed at its 1st, 2nd, 3rd and 5th key.
    -- A constructor's `k = v` items size its hash part, and a key set to nil takes no field's place
    -- nor shows in `pairs`: `x` named 8 times is one key and room for 8.
    e = {v = {x = nil, x = nil, x = nil, x = nil, x = nil, x = nil, x = nil, x = nil},
      d = {x = nil, x = nil, x = nil, x = nil, x = nil, x = nil, x = nil, x = nil}, need = 0, dirty = false}
    cache[key] = e
  end
  return e
end

local function mark(key, e)
  if not e.dirty then
    e.dirty = true
    dirty[#dirty + 1] = key
  end
end

local function load(key, fields)
  local e = cache[key]
  if e == nil then
    -- A hash not read yet in this script call: its fields as asked, its cursor with them.
    e = entry(key)
    local v = e.v
    local got = redis.call('HMGET', key, 'x', unpack(fields))
    v.x = got[1] or false
    for i = 1, #fields do v[fields[i]] = got[i + 1] or false end
    return e
  end
  local v = e.v
  -- No list is made when every field is loaded already (a hash met again in a batch).
  local want
  if v.x == nil then want = {'x'} end
  for _, f in ipairs(fields) do
    if v[f] == nil then
      if want then want[#want + 1] = f else want = {f} end
    end
  end
  if want then
    local got = redis.call('HMGET', key, unpack(want))
    for i, f in ipairs(want) do v[f] = got[i] or false end
  end
  return e
end

local function hget(key, f)
  local e = cache[key]
  if e == nil then return nil end
  local v = e.v[f]
  if v == false then return nil end
  return v
end

-- A field loaded before, as a number (`d` when absent). The number replaces the string in the
-- cache, so a field read by several decisions of one script call is parsed once; arithmetic
-- coercion parses it once where `tonumber` parses twice (Lua 5.1 checks, then converts).
local function hnum(key, f, d)
  local e = cache[key]
  if e == nil then return d end
  local v = e.v[f]
  if not v then return d end
  v = v + 0
  e.v[f] = v
  return v
end

-- `v`: a string, a number (formatted once, when the script call writes its hashes) or nil; `at`
-- (optional): as `keep`. A value the hash holds already (as read, or as written earlier in this
-- script call) is not written again. (A call of a C function such as `math.max`, or of a Lua one,
-- costs the script about as much as formatting a number: the helpers called per layer and per
-- field compare inline and call nothing they need not.)
local function hput(key, f, v, at)
  local e = cache[key] or entry(key)
  local ev = e.v
  if v == nil then
    ev[f] = false
    e.d[f] = true
  elseif ev[f] ~= v then
    ev[f] = v
    e.d[f] = true
  end
  if at and at > e.need then e.need = at end
  if not e.dirty then
    e.dirty = true
    dirty[#dirty + 1] = key
  end
end

local function keep(key, at)
  local e = entry(key)
  if at > e.need then e.need = at end
  mark(key, e)
end

local function flush()
  -- One list of the fields to write for every hash (its first `n` items): a list made per hash
  -- was a table to make and to collect per decision. Room for 8 fields (a list's items in a
  -- constructor, nil ones too, size its array part).
  local set = {nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil, nil}
  for _, key in ipairs(dirty) do
    local e = cache[key]
    local x = e.v.x
    if x then x = x + 0 else x = 0 end
    local push = e.need > x
    if push then
      x = e.need + SLACK
      e.v.x = fmt(x)
      e.d.x = true
    end
    local del, n = nil, 0
    for f in pairs(e.d) do
      local v = e.v[f]
      if v then
        if v == now then v = NOW elseif type(v) == 'number' then v = fmt(v) end
        set[n + 1], set[n + 2] = f, v
        n = n + 2
      elseif del then
        del[#del + 1] = f
      else
        del = {f}
      end
    end
    if n > 0 then chunked('HSET', key, set, n) end
    if del then chunked('HDEL', key, del) end
    if push then expire_at(key, x) end
    e.need, e.dirty = 0, false
  end
  dirty = {}
end

-- Writes a bucket layer's field `f` (named without the layer's prefix) and keeps its hash until `at`.
local function write_bucket(l, at, f, v)
  hput(l.k, l.fp .. f, v)
  keep(l.k, at)
end
-- The AIMD multiplier of an upstream state hash (1 once a cut is older than `forget`). A hash that
-- holds a probe schedule (`pa`, written by the `probe` operation; src/engine/probe.rs computes it)
-- is never forgotten: its multiplier is the probe's target `pt` from `pa` for `pl` microseconds
-- (when that is above `m`), else `m`.
local function multiplier(key, forget, pl)
  if key == nil or key == '' then return 1 end
  local h = redis.call('HMGET', key, 'm', 'cut', 'pa', 'pt')
  local m, cut = num(h[1], 1), num(h[2], 0)
  if h[3] then
    local pa = num(h[3], 0)
    if pl and pa > 0 and pa <= now and now < pa + pl then return max(num(h[4], m), m) end
    return m
  end
  if now - cut > forget then return 1 end
  return m
end

local function cursor_live(cursor, tat, tau, nb)
  return cursor > max(tat, now) and max(cursor - tau, nb) + GRACE > now
end

-- The slot promised to a refused call of `inc` that cannot come back before `nb`: the next one after
-- those promised earlier. Returns the new cursor, the wait and whether every slot up to the horizon
-- is promised already (booked; nothing is promised then).
local function promise_at(cursor, tat, nb, inc, tau)
  if not cursor_live(cursor, tat, tau, nb) then cursor = 0 end
  local base = max(tat, now, nb)
  local limit = base + inc + max(HORIZON, tau)
  local nxt = max(cursor, base) + inc
  local function at(slot) return max(slot - tau, nb, now) - now end
  if nxt > limit then return cursor, at(limit), 1 end
  return nxt, at(nxt), 0
end

-- A staggered slot on a cursor field: `step` after the last one handed out, never before `base`,
-- starting over at `base` past `base + window`.
local function stagger(key, field, base, step, window)
  local last = num(redis.call('HGET', key, field), 0)
  local nxt = max(last + step, base)
  if nxt > base + window then nxt = base end
  redis.call('HSET', key, field, fmt(nxt))
  expire_at(key, nxt + window + GRACE)
  return nxt
end


-- The same on a field of a hash of this layout.
local function stagger_cached(key, field, base, step, window)
  load(key, {field})
  local last = num(hget(key, field), 0)
  local nxt = max(last + step, base)
  if nxt > base + window then nxt = base end
  hput(key, field, fmt(nxt))
  keep(key, nxt + window + GRACE)
  return nxt
end

-- The window the hints of calls an upstream refuses for `wait` are staggered over (the engine's
-- `bucket::stagger_window`).
local function stagger_window(wait)
  return min(max(wait, STAGGER_MIN_WINDOW), HORIZON)
end

-- How long after a concurrency slot's expected end its promised caller is told to come (the
-- engine's `slots::margin`): the end is an estimate, and the release travels too.
local function slot_margin(run)
  return min(max(run / MARGIN_SHARE, MARGIN_MIN), MARGIN_MAX)
end

local function whole_tokens(burst, T, tat)
  local missing = tat - now
  if missing < 0 then missing = 0 end
  local tokens = burst - missing / T
  if tokens <= 0 then return 0 end
  tokens = tokens + burst * 1e-12
  return tokens - tokens % 1 -- floor
end

-- A decision's spec (`op_decide`) is a list `a` of MessagePack scalars in a fixed order, written by
-- src/store/spec.rs, read by position: no JSON is decoded, no number parsed from text and no table
-- made for its parts (each of those costs the script more than a command does). The header:
--   1 own  2 h  3 z  4 the lease's field (`l:ID`)  5 its member  6 subject  7 tool  8 cost
--   9 max_wait  10 ttl  11 shadow  12 returning  13 rand  14 floor  15 forget  16 index (nil: none)
--   17 what each layer takes, as the lease keeps it (nil: the script writes it; a layer's rate
--      moves with an AIMD multiplier)  18 sweep now (one call in 64)  19 trim the index now
--   20 the number of layers, then each layer's LW values from its offset `o`:
--      o k (nil: the tenant's hash), +1 its `tat` field, +2 its promise field (nil: its prefix +
--      `p`), +3 T, +4 b, +5 n, +6 hold, +7 its AIMD
--      state key (nil: none), +8 forget, +9 probe length, and the state `read_layers` sets in
--      place (sent as 0): +10 T at the multiplier, +11 tau, +12 inc, +13 tat, +14 promise cursor,
--      +15 shortfall, +16 multiplier
-- then each list as its length and its items' values: concurrency scopes (CW values: `f cap sub
-- cursor` and the count, sent as 0; the hint cursor nil: `cs:SUBJECT` or `ct`), penalties `k layer step`, adaptive windows `k w K min step`,
-- quotas `k q sub`, spend units `n t` followed by their budgets as a list of `k s run idle`. The
-- last four are rare and made into tables. An absent string is nil.
local LW, CW = 17, 5
local FIRST = 21            -- the first layer's offset
local NO = {}               -- an empty list, shared (never written)
local layer_end = FIRST     -- the offset after the last layer of the decision being decided

-- Reads every bucket layer of the decision `a`, with `more` fields of the tenant's hash `h` in the
-- same HMGET, and sets each layer's shape at the current AIMD multiplier and its state in place.
local function read_layers(a, h, more)
  local forget = a[15]
  for o = FIRST, layer_end - 1, LW do
    local k = a[o]
    if k == nil then
      a[o] = h
      more[#more + 1] = a[o + 1]
    else
      local v = (cache[k] or NO).v or NO
      if v[a[o + 1]] == nil then load(k, {a[o + 1]}) end
    end
  end
  if h ~= '' then load(h, more) end
  for o = FIRST, layer_end - 1, LW do
    local m = 1
    if a[o + 7] then m = multiplier(a[o + 7], a[o + 8] or forget, a[o + 9]) end
    local T = a[o + 3] / m
    local tau = a[o + 4] * T
    local inc = a[o + 5] * T
    inc = inc - inc % 1 -- floor
    -- The layer's `tat`, parsed once per script call (as `hnum`).
    local v, f = cache[a[o]].v, a[o + 1]
    local tat = v[f]
    if tat then
      tat = tat + 0
      v[f] = tat
    else
      tat = 0
    end
    a[o + 10], a[o + 11], a[o + 12], a[o + 13], a[o + 16] = T, tau, inc, tat, m
    local short = tat
    if short < now then short = now end
    short = short + inc - (now + tau)
    if short < 0 then short = 0 end
    a[o + 15] = short
  end
end

-- The promise cursor of the layer at `o`, read only when the layer is short of tokens (a call that
-- takes its tokens at once neither reads nor moves it; the hash already lives past it: the expiry
-- of a hash only moves forward, and it was pushed past the cursor when the cursor was written).
local function promise(a, o)
  local f = a[o + 2]
  if f == nil then
    f = sub(a[o + 1], 1, -4) .. 'p'
    a[o + 2] = f
  end
  load(a[o], {f})
  local p = hnum(a[o], f, 0)
  a[o + 14] = p
  return p
end

-- Writes the promise cursor of the layer at `o`. A shared upstream's bucket keeps one per tenant
-- (`p:TENANT`) and the latest of them in `p`, which its slices look at (`op_slice`).
local function put_promise(a, o, cursor)
  local k, f = a[o], a[o + 2]
  hput(k, f, cursor)
  if sub(f, 1, 2) == 'p:' then
    load(k, {'p'})
    if cursor > hnum(k, 'p', 0) then hput(k, 'p', cursor) end
  end
end

-- Appends to `r` each layer's whole tokens left and microseconds until full (`taken`: after this
-- call took its tokens), as numbers: Redis answers a Lua number as an integer without formatting
-- it (every instant here is whole microseconds).
local function layer_report(a, r, taken)
  local n = #r
  for o = FIRST, layer_end - 1, LW do
    local tat = a[o + 13]
    if taken then
      if tat < now then tat = now end
      tat = tat + a[o + 12]
    end
    local reset = tat - now
    if reset < 0 then reset = 0 end
    r[n + 1] = whole_tokens(a[o + 4], a[o + 10], tat)
    r[n + 2] = reset - reset % 1
    n = n + 2
  end
  return r
end

-- A lease is the field `l:ID` of the tenant's hash, `day|hold_until|started|ends|[tokens per
-- layer]|flags|d`, and its member in the lease set (scored by `ends`): `d` is what admitd wrote for
-- the release (subject, tool, cost, the layers' keys and prefixes, the quota keys, its member, the
-- upstreams), the rest what was decided here; flag `n`: nothing to give back (shadow mode). A lease
-- whose end has passed is gone, whether or not a sweep has removed it yet.
local Z = {'z'}
local function write_lease(a, day, hold_until, incs, flags, ends, member)
  local h, z = a[2], a[3]
  local e = fmt(ends)
  local hu = NOW
  if hold_until ~= now then hu = fmt(hold_until) end
  hput(h, a[4], day .. '|' .. hu .. '|' .. NOW .. '|' .. e .. '|' .. incs .. '|' .. flags .. '|' .. extra)
  keep(h, ends + GRACE)
  load(h, Z)
  local pushed = hnum(h, 'z', 0)
  if pushed > now then
    -- The set lives until `pushed`, its sentinel with it (nothing takes the sentinel out).
    redis.call('ZADD', z, e, member)
  else
    redis.call('ZADD', z, e, member, '+inf', '~')
  end
  local nz = keep_until(z, ends + GRACE, pushed)
  if nz ~= pushed then hput(h, 'z', nz) end
end

-- A live lease of the tenant's hash `h`, parsed; nil when there is none (or it has ended).
local function read_lease(h, id)
  local f = 'l:' .. id
  load(h, {f})
  local v = hget(h, f)
  if not v then return nil end
  local day, hu, started, ends, incs, flags, d =
    match(v, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|([^|]*)|(.*)$')
  if not d then return nil end
  ends = tonumber(ends)
  if not ends or ends <= now then return nil end
  return {day = day, hold_until = hu, started = started, ends = ends, incs = incs, flags = flags, d = d}
end

-- The counts of a lease-set member (`ID` + scopes + subject) move by `by`.
local function count(h, member, by)
  local scopes = sub(member, 17, 17)
  -- The list made whole (one grown item by item is rehashed at each).
  local fields
  if scopes == 'b' then
    fields = {'t|n', 's:' .. sub(member, 18) .. '|n'}
  elseif scopes == 't' then
    fields = {'t|n'}
  elseif scopes == 's' then
    fields = {'s:' .. sub(member, 18) .. '|n'}
  else
    return
  end
  load(h, fields)
  for _, f in ipairs(fields) do
    hput(h, f, max(hnum(h, f, 0) + by, 0))
  end
end

-- Sweeps the leases of the set `z` (of the hash `h`) that have ended: out of their counts, their
-- fields and the set. At most `limit` (nil: all).
local function sweep(h, z, limit)
  local gone
  if limit then
    gone = redis.call('ZRANGEBYSCORE', z, '-inf', NOW, 'LIMIT', 0, limit)
  else
    gone = redis.call('ZRANGEBYSCORE', z, '-inf', NOW)
  end
  if #gone == 0 then return end
  local fields = {}
  for _, m in ipairs(gone) do
    local s = sub(m, 17, 17)
    if s == 't' or s == 'b' then fields[#fields + 1] = 't|n' end
    if s == 's' or s == 'b' then fields[#fields + 1] = 's:' .. sub(m, 18) .. '|n' end
  end
  load(h, fields)
  for _, m in ipairs(gone) do
    count(h, m, -1)
    hput(h, 'l:' .. sub(m, 1, 16), nil)
  end
  chunked('ZREM', z, gone)
end

-- A refusal of the decision `a`, with the layers' report.
local function shed(a, scope, wait, booked, account_wide, layer)
  if a[11] and a[1] then
    -- Shadow mode admits the call without spending anything: its lease holds no slot and no token.
    write_lease(a, '0', 0, '[]', 'n', now + a[10], sub(a[5], 1, 16) .. '-' .. a[6])
  end
  return layer_report(a, {'shed', scope, fmt(max(wait, 0)), tostring(booked), tostring(account_wide),
    tostring(layer)}, false)
end
-- Adaptive-throttle window: requests and accepts per slot, `r:<slot>` and `a:<slot>` fields.
local function sre_totals(key, window)
  local len = max(floor(window / SRE_SLOTS), 1)
  local slot = floor(now / len)
  local h = redis.call('HGETALL', key)
  local req, acc = 0, 0
  for i = 1, #h, 2 do
    local f = h[i]
    local kind, s = match(f, '^([ra]):(%d+)$')
    if kind then
      s = tonumber(s)
      if s <= slot - SRE_SLOTS then
        redis.call('HDEL', key, f)
      elseif kind == 'r' then
        req = req + tonumber(h[i + 1])
      else
        acc = acc + tonumber(h[i + 1])
      end
    end
  end
  return req, acc, slot
end

local function sre_record(key, window, requests, accepts)
  local len = max(floor(window / SRE_SLOTS), 1)
  local slot = floor(now / len)
  if requests > 0 then redis.call('HINCRBY', key, 'r:' .. slot, requests) end
  if accepts > 0 then redis.call('HINCRBY', key, 'a:' .. slot, accepts) end
end

-- The adaptive throttle's refusal probability over a window of `req` requests and `acc` accepts
-- (the engine's `SreWindow::reject_probability`): none below `least` requests.
local function reject_probability(req, acc, k, least)
  if req < least then return 0 end
  return max(0, (req - k * acc) / (req + 1))
end

-- How long a call the throttle refused with probability `p` waits at least, before the hints of
-- calls refused together are staggered (the engine's `adaptive::adaptive_wait`): the more the
-- upstream rejects, the longer it takes to recover.
local function adaptive_wait(p)
  local secs = ADAPTIVE_WAIT_PER_ODDS * p / max(1 - p, ADAPTIVE_LEAST_ACCEPT)
  return floor(min(max(secs * 1e6, ADAPTIVE_WAIT_MIN), ADAPTIVE_WAIT_MAX))
end

-- The fields of a probe schedule (src/engine/probe.rs) as a state hash holds them, and its version.
local PROBE_FIELDS = {'m', 'c', 'iv', 'sp', 'pa', 'pt', 'ca', 'pu', 'sv', 'st', 's0', 'v'}

-- An answer from an upstream whose rate is probed (`u.pr`: {h = hold, pl = probe length, rp = the
-- probe's uncounted ramp, tau = the served meter's time constant}; `u.q`: what one answer is worth,
-- in multiplier-seconds). The script only counts: a healthy answer goes into the served meter (a
-- sum decaying with `tau`, restarted at `s0` after a quiet spell), into the running probe past its
-- ramp, and wins `u.ar` back up to the hold. Every other change (a cut, a verdict on a probe, the
-- next probe) admitd computes from the fields returned here and writes with the `probe` operation.
-- What admitd reads back after the script counted answers of a probed upstream: the report and
-- the state hash's probe fields.
local function probe_state(u)
  local out = {}
  local v = redis.call('HMGET', u.s, unpack(PROBE_FIELDS))
  for i, k in ipairs(PROBE_FIELDS) do
    if v[i] then out[k] = tonumber(v[i]) end
  end
  out.now = now
  return cjson.encode({u = u, st = out})
end

-- A probed upstream's multiplier, ceiling, probe start, probe's served count and served meter
-- (value, last update, start), as its state hash holds them.
local function probe_read(u)
  local h = redis.call('HMGET', u.s, 'm', 'c', 'pa', 'pu', 'sv', 'st', 's0')
  return num(h[1], 1), num(h[2], 1), num(h[3], 0), num(h[4], 0), num(h[5], 0), num(h[6], 0), num(h[7], 0)
end

local function probe_answer(u, limited)
  local pr = u.pr
  local m, c, pa, pu, sv, st, s0 = probe_read(u)
  if not limited then
    if now - st > METER_RESTART * pr.tau then
      sv, s0 = 0, now
    else
      sv = sv * math.exp(-(now - st) / pr.tau)
    end
    local f = {'sv', fmt(sv + u.q), 'st', NOW, 's0', fmt(s0)}
    if pa > 0 then
      if pa + pr.rp <= now and now < pa + pr.pl then
        f[#f + 1], f[#f + 2] = 'pu', fmt(pu + u.q)
      end
      local hold = min(c * pr.h, 1)
      if m < hold then
        m = m + u.ar
        if m >= 1 - AIMD_SNAP then m = 1 end
        f[#f + 1], f[#f + 2] = 'm', fmt(min(m, hold))
      end
    end
    redis.call('HSET', u.s, unpack(f))
  end
  return probe_state(u)
end

-- Healthy answers of a probed upstream a replica gathered (`a`: see `upstream_answers`), each
-- counted as `probe_answer` counts one at its own instant: the meter is a sum of decaying terms, so
-- an answer older than the meter's last one (another replica's, counted meanwhile) adds its term
-- decayed to that instant, and the meter restarts at an answer after a quiet spell as it would.
local function probe_served(u, a)
  local pr = u.pr
  local m, c, pa, pu, sv, st, s0 = probe_read(u)
  local m0, pu0 = m, pu
  local hold = min(c * pr.h, 1)
  for _, e in ipairs(a) do
    local n = e[2]
    if n > 0 then
      local at = now - e[1]
      local q = u.q
      if at - st > METER_RESTART * pr.tau then
        sv, s0, st = 0, at, at
      elseif at >= st then
        sv = sv * math.exp(-(at - st) / pr.tau)
        st = at
      else
        q = q * math.exp(-(st - at) / pr.tau)
      end
      -- One addition per answer, as one report each adds (the same sum to the last bit).
      local inside = pa > 0 and pa + pr.rp <= at and at < pa + pr.pl
      for _ = 1, n do
        sv = sv + q
        if inside then pu = pu + u.q end
      end
      if pa > 0 then
        for _ = 1, n do
          if m >= hold then break end
          m = m + u.ar
          if m >= 1 - AIMD_SNAP then m = 1 end
          m = min(m, hold)
        end
      end
    end
  end
  local f = {'sv', fmt(sv), 'st', fmt(st), 's0', fmt(s0)}
  if pu ~= pu0 then f[#f + 1], f[#f + 2] = 'pu', fmt(pu) end
  if m ~= m0 then f[#f + 1], f[#f + 2] = 'm', fmt(m) end
  redis.call('HSET', u.s, unpack(f))
  return probe_state(u)
end

-- An upstream's answer: a 429 starts (or extends) its penalty, cuts its AIMD rate and counts as a
-- refusal in its adaptive window; any other answer counts as an accept unless `ok` is false (a
-- 503), and recovers the rate (and counts as served) only when `healthy` (admitd decides both, as
-- the engine does; nil: true). `u`: {p = penalty key, s = state key, af, afl, ar (AIMD factor,
-- floor, recover), aw (adaptive window, 0: off), forget}. Returns the penalty in microseconds (0:
-- none).
local function upstream_answer(u, limited, retry_after, default_penalty, ok, healthy)
  if ok == nil then ok = true end
  if healthy == nil then healthy = true end
  local penalty = 0
  if limited then
    penalty = retry_after
    if penalty == nil or penalty < 0 then penalty = default_penalty end
    local untl = now + penalty
    local cur = num(redis.call('HGET', u.p, 'until'), 0)
    if untl > cur then
      redis.call('HSET', u.p, 'until', fmt(untl))
      expire_at(u.p, untl + HORIZON)
    end
  end
  local probe = ''
  if u.pr then
    if limited or healthy then probe = probe_answer(u, limited) end
  elseif u.af then
    local h = redis.call('HMGET', u.s, 'm', 'cut')
    local m, cut = num(h[1], 1), num(h[2], 0)
    if now - cut > u.forget then m = 1 end
    if limited then
      m = min(max(m * u.af, u.afl), 1)
      redis.call('HSET', u.s, 'm', fmt(m), 'cut', NOW)
    elseif healthy and m < 1 then
      m = m + u.ar
      if m >= 1 - AIMD_SNAP then m = 1 end
      redis.call('HSET', u.s, 'm', fmt(m))
    end
  end
  if u.aw and u.aw > 0 then
    sre_record(u.s, u.aw, 1, (limited or not ok) and 0 or 1)
  end
  if u.af or (u.aw and u.aw > 0) then
    expire_at(u.s, now + max(u.forget, u.aw or 0) + GRACE)
  end
  return penalty, probe
end

-- Answers of a shared upstream's calls that one replica gathered for a while (src/store/answers.rs),
-- none of them a 429 or a 503: `a` lists {age, healthy, accepted} with the age in microseconds
-- before this call (to the millisecond), how many healthy answers arrived then and how many other
-- accepted ones. The same changes as one `upstream_answer` per answer at its own instant: each
-- healthy one wins `ar` back (with the same snap, up to the same cap) and goes into a probed
-- upstream's meter, and every one counts as a request and an accept in the adaptive window's slot
-- of its instant. Returns the probe part as `upstream_answer` does ('' when not probed).
local function upstream_answers(u, a)
  local healthy = 0
  for _, e in ipairs(a) do healthy = healthy + e[2] end
  local probe = ''
  if u.pr then
    if healthy > 0 then probe = probe_served(u, a) end
  elseif u.af and healthy > 0 then
    local h = redis.call('HMGET', u.s, 'm', 'cut')
    local m, cut = num(h[1], 1), num(h[2], 0)
    if now - cut > u.forget then m = 1 end
    if m < 1 then
      for _ = 1, healthy do
        m = m + u.ar
        if m >= 1 - AIMD_SNAP then m = 1 break end
      end
      redis.call('HSET', u.s, 'm', fmt(m))
    end
  end
  if u.aw and u.aw > 0 then
    local len = max(floor(u.aw / SRE_SLOTS), 1)
    local per = {}
    for _, e in ipairs(a) do
      local slot = floor((now - e[1]) / len)
      per[slot] = (per[slot] or 0) + e[2] + e[3]
    end
    for slot, n in pairs(per) do
      if n > 0 then
        redis.call('HINCRBY', u.s, 'r:' .. slot, n)
        redis.call('HINCRBY', u.s, 'a:' .. slot, n)
      end
    end
  end
  if u.af or (u.aw and u.aw > 0) then
    expire_at(u.s, now + max(u.forget, u.aw or 0) + GRACE)
  end
  return probe
end

-- The rare lists of a decision's spec from offset `i` (penalties, adaptive windows, quotas, spend
-- units), as tables; NO for an empty one.
local function rare_lists(a, i)
  local pen, ad, quota, spend = NO, NO, NO, NO
  local n = a[i]
  i = i + 1
  if n > 0 then
    pen = {}
    for j = 1, n do
      pen[j] = {k = a[i], layer = a[i + 1], step = a[i + 2]}
      i = i + 3
    end
  end
  n, i = a[i], i + 1
  if n > 0 then
    ad = {}
    for j = 1, n do
      ad[j] = {k = a[i], w = a[i + 1], K = a[i + 2], min = a[i + 3], step = a[i + 4]}
      i = i + 5
    end
  end
  n, i = a[i], i + 1
  if n > 0 then
    quota = {}
    for j = 1, n do
      quota[j] = {k = a[i], q = a[i + 1], sub = a[i + 2]}
      i = i + 3
    end
  end
  n, i = a[i], i + 1
  if n > 0 then
    spend = {}
    for u = 1, n do
      local unit = {n = a[i], t = a[i + 1], b = {}}
      local nb = a[i + 2]
      i = i + 3
      for j = 1, nb do
        unit.b[j] = {k = a[i], s = a[i + 1], run = a[i + 2], idle = a[i + 3]}
        i = i + 4
      end
      spend[u] = unit
    end
  end
  return pen, ad, quota, spend
end

local function op_decide()
  local a = spec
  local own, h, z = a[1], a[2], a[3]
  layer_end = FIRST + a[20] * LW
  local conc0 = layer_end + 1                     -- the first concurrency scope's offset
  local conc_end = conc0 + a[layer_end] * CW
  -- Room for the tenant hash's fields (the lease set's cursor, the scopes' counts, the layers'
  -- `tat`s) without a rehash as the list grows.
  local more = {nil, nil, nil, nil, nil, nil, nil, nil}
  if own then
    more[1] = 'z'
    if a[16] then more[2] = 'ix' end
    for c = conc0, conc_end - 1, CW do more[#more + 1] = a[c] end
  else
    h = ''
  end
  read_layers(a, h, more)
  local pens, ads, quotas, spend = rare_lists(a, conc_end)

  -- Upstream penalty: refused until the upstream's Retry-After has passed, promised the slot of the
  -- upstream's bucket after it (or a staggered instant, for an upstream without a bucket).
  local pen_wait, pen = 0, nil
  -- The rare lists are walked by index: `ipairs` is two C calls even over an empty list.
  for i = 1, #pens do
    local p = pens[i]
    local untl = num(redis.call('HGET', p.k, 'until'), 0)
    if untl > now and untl - now > pen_wait then pen_wait, pen = untl - now, p end
  end
  if pen then
    local untl = now + pen_wait
    local wait
    if pen.layer > 0 then
      local o = FIRST + (pen.layer - 1) * LW
      local cursor, w = promise_at(promise(a, o), a[o + 13], untl, a[o + 12], a[o + 11])
      put_promise(a, o, cursor)
      keep(a[o], max(cursor, a[o + 13], untl) + GRACE)
      wait = w
    else
      wait = stagger(pen.k, 'c', untl, pen.step, stagger_window(pen_wait)) - now
    end
    return shed(a, 'upstream_penalty', wait, 0, 1, 0)
  end

  -- Adaptive throttling: refuse locally with the SRE probability over the upstream's window.
  for i = 1, #ads do
    local w = ads[i]
    local req, acc = sre_totals(w.k, w.w)
    local prob = reject_probability(req, acc, w.K, w.min or 0)
    if a[13] < prob then
      sre_record(w.k, w.w, 1, 0)
      expire_at(w.k, now + w.w + GRACE)
      local least = adaptive_wait(prob)
      local wait = stagger(w.k, 'c', now + least, w.step, stagger_window(least)) - now
      return shed(a, 'adaptive', wait, 0, 1, 0)
    end
  end

  -- Concurrency: each scope counts its leases in a field of the tenant's hash; the lease set,
  -- scored by the leases' ends, frees the slot of a lease that is never released (its replica
  -- died) at its TTL without a sweeper. Ended leases are swept before counting when a count
  -- reaches its cap (below it, so is the count without them), and on one call in 64 (the lease
  -- id's last two hex digits, `a[18]`) to bound the set.
  if own then
    local full = false
    local v = cache[h].v
    for c = conc0, conc_end - 1, CW do
      local n = v[a[c]]
      if n then
        n = n + 0
        v[a[c]] = n
      else
        n = 0
      end
      a[c + 4] = n
      if n >= a[c + 1] then full = true end
    end
    if full or a[18] then
      if full then sweep(h, z, nil) else sweep(h, z, 256) end
      for c = conc0, conc_end - 1, CW do a[c + 4] = hnum(h, a[c], 0) end
    end
  end
  for c = conc0, conc_end - 1, CW do
    local cap, scoped = a[c + 1], a[c + 2]
    if a[c + 4] >= cap then
      -- The slot expected to free first: each lease's start plus how long this tool's calls run.
      local rf = 'rt:' .. a[7]
      load(h, {rf})
      local run = num(hget(h, rf), DEFAULT_RUN)
      local earliest = nil
      local live = redis.call('ZRANGE', z, 0, -1, 'WITHSCORES')
      for i = 1, #live - 1, 2 do
        local m = live[i]
        local s = sub(m, 17, 17)
        local counted
        if scoped then
          counted = (s == 's' or s == 'b') and sub(m, 18) == a[6]
        else
          counted = s == 't' or s == 'b'
        end
        if counted then
          local started = tonumber(live[i + 1]) - a[10]
          local free = max(started + run, now + a[14])
          if earliest == nil or free < earliest then earliest = free end
        end
      end
      earliest = earliest or (now + run)
      if a[9] > 0 and not a[11] then
        return {'busy', fmt(earliest - now)}
      end
      -- Refused callers are told one slot each, a run's share of a slot apart (the rate at which
      -- slots free), each a margin after the end it waits for: the release travels too.
      local margin = slot_margin(run)
      local step = max((run + margin) / cap, 1e3)
      local cursor = a[c + 3] or (scoped and 'cs:' .. a[6] or 'ct')
      local wait = stagger_cached(h, cursor, earliest + margin, step, HORIZON) - now
      return shed(a, 'concurrency', wait, 0, scoped and 0 or 1, 0)
    end
  end

  -- Daily quota per UTC day of the store's clock.
  local day = floor(now / DAY)
  for i = 1, #quotas do
    local q = quotas[i]
    local used = num(redis.call('HGET', q.k, DAYS), 0)
    if used + a[8] > q.q + 1e-9 then
      local wait = (day + 1) * DAY - now
      return shed(a, 'daily_quota', wait, 0, q.sub and 0 or 1, 0)
    end
  end

  -- Spend budgets: each unit's estimate must fit every budget of the unit, a daily one per UTC day
  -- (a hash by day, like a quota), a run's while the run is remembered (a counter that expires
  -- `idle` after the run's last call). A budget may be below zero (a call cost more than its
  -- estimate): it then refuses until it is back above the estimate.
  for ui = 1, #spend do
    local u = spend[ui]
    for bi, b in ipairs(u.b) do
      local used
      if b.run then used = num(redis.call('GET', b.k), 0) else used = num(redis.call('HGET', b.k, DAYS), 0) end
      local left = b.s - used
      if left + 1e-9 < u.n then
        local wait = 0
        if not b.run then wait = (day + 1) * DAY - now end
        local r = shed(a, 'spend', wait, 0, 0, ui)
        r[#r + 1] = tostring(bi)
        r[#r + 1] = fmt(left)
        return r
      end
      b.left = left - u.n
    end
  end

  -- Buckets, all or nothing. A call is held (its tokens reserved ahead) only within its wait, only on
  -- layers that allow it, and never into tokens promised to callers refused earlier.
  local hold = 0
  for o = FIRST, layer_end - 1, LW do
    local short, tat, tau = a[o + 15], a[o + 13], a[o + 11]
    local max_wait = 0
    if a[o + 6] then max_wait = a[9] end
    local p = 0
    if short > 0 then p = promise(a, o) end
    local behind = short > 0 and not a[12] and cursor_live(p, tat, tau, 0)
    if short > max_wait or behind then
      -- Promise this caller the layer's next slot after earlier promises; the later layers' shortfalls
      -- count too, so the hint covers the whole path.
      local cursor, wait, booked = promise_at(p, tat, 0, a[o + 12], tau)
      if booked == 0 then
        put_promise(a, o, cursor)
        keep(a[o], max(cursor, tat) + GRACE)
      end
      for j = o + LW, layer_end - 1, LW do wait = max(wait, a[j + 15]) end
      local r = shed(a, 'layer', wait, booked, 0, (o - FIRST) / LW + 1)
      r[#r + 1] = fmt(a[o + 16])
      return r
    end
    if short > hold then hold = short end
  end

  local ends = now + hold + a[10]
  for o = FIRST, layer_end - 1, LW do
    local tat = a[o + 13]
    if tat < now then tat = now end
    tat = tat + a[o + 12]
    hput(a[o], a[o + 1], tat, tat + GRACE)
  end
  for i = 1, #quotas do
    local q = quotas[i]
    redis.call('HINCRBYFLOAT', q.k, DAYS, fmt(a[8]))
    expire_at(q.k, (day + 1) * DAY + KEEP)
  end
  for i = 1, #spend do
    local u = spend[i]
    for _, b in ipairs(u.b) do
      if b.run then
        if u.n ~= 0 then redis.call('INCRBYFLOAT', b.k, fmt(u.n)) end
        -- Every call of the run keeps it remembered for `idle` more (an absent key: nothing spent).
        if redis.call('EXISTS', b.k) == 1 then expire_at(b.k, now + b.idle) end
      elseif u.n ~= 0 then
        redis.call('HINCRBYFLOAT', b.k, DAYS, fmt(u.n))
        expire_at(b.k, (day + 1) * DAY + KEEP)
      end
    end
    -- The tenant's day figure without a budget keeping it: counted for GET /v1/tenants/{tenant}.
    if u.t and u.n ~= 0 then
      redis.call('HINCRBYFLOAT', u.t, DAYS, fmt(u.n))
      expire_at(u.t, (day + 1) * DAY + KEEP)
    end
  end
  -- Room for four layers' report (a list grown item by item is rehashed at its 3rd and 5th item).
  local r = layer_report(a, {'ok', hold == 0 and '0' or fmt(hold), nil, nil, nil, nil, nil, nil, nil, nil}, true)
  for i = 1, #spend do
    for _, b in ipairs(spend[i].b) do r[#r + 1] = fmt(b.left) end
  end
  if not own then
    -- A cross-tenant part of a cluster's call (no spend budget: those are the tenant's): what each
    -- layer took, which admitd gives back when another shard refuses the call.
    for o = FIRST, layer_end - 1, LW do r[#r + 1] = a[o + 12] end
  end
  if own then
    for c = conc0, conc_end - 1, CW do hput(h, a[c], a[c + 4] + 1) end
    -- What each layer took, as admitd wrote it when no layer's rate moves with an AIMD multiplier.
    local incs = a[17]
    if not incs then
      local each = {}
      for o = FIRST, layer_end - 1, LW do each[#each + 1] = fmt(a[o + 12]) end
      incs = '[' .. table.concat(each, ',') .. ']'
    end
    write_lease(a, DAYS, now + hold, incs, '', ends, a[5])
  end
  local index = a[16]
  if index then
    -- The subject index: the subject's last sighting (a replica records it once a minute per
    -- subject). Its expiry is pushed as a bucket's is, with its cursor `ix` in the tenant's hash;
    -- on one write in 16 (`a[19]`), subjects not seen for a day leave it, and their fields the
    -- tenant's hash once they are at rest (a bucket full again, nothing promised, no lease
    -- counted). The subject is added first, so that the set never empties behind its cursor.
    redis.call('ZADD', index, NOW, a[6])
    local ix = hnum(h, 'ix', 0)
    local nix = keep_until(index, now + DAY, ix)
    if nix ~= ix then hput(h, 'ix', nix) end
    local old = NO
    if a[19] then
      old = redis.call('ZRANGEBYSCORE', index, '-inf', fmt(now - DAY), 'LIMIT', 0, 64)
    end
    if #old > 0 then
      local fields = {}
      for _, n in ipairs(old) do
        local p = 's:' .. n .. '|'
        fields[#fields + 1] = p .. 'tat'
        fields[#fields + 1] = p .. 'p'
        fields[#fields + 1] = p .. 'n'
      end
      load(h, fields)
      local done = {}
      for _, n in ipairs(old) do
        local p = 's:' .. n .. '|'
        if num(hget(h, p .. 'tat'), 0) + GRACE <= now and num(hget(h, p .. 'p'), 0) + HORIZON + GRACE <= now
          and num(hget(h, p .. 'n'), 0) == 0 then
          for _, f in ipairs({'tat', 'p', 'n'}) do
            if hget(h, p .. f) then hput(h, p .. f, nil) end
          end
          done[#done + 1] = n
        end
      end
      if #done > 0 then chunked('ZREM', index, done) end
    end
  end
  return r
end
-- Gives back tokens: `incs` is a list of {key, field prefix, microseconds}.
local function refund(incs)
  for _, kv in ipairs(incs) do
    local f = kv[2] .. 'tat'
    load(kv[1], {f})
    local tat = num(hget(kv[1], f), nil)
    if tat then hput(kv[1], f, fmt(tat - kv[3])) end
  end
end

-- Takes tokens whatever the bucket holds (the call has already run: it refills later); `incs` as
-- for `refund`.
local function charge(incs)
  for _, kv in ipairs(incs) do
    local f = kv[2] .. 'tat'
    load(kv[1], {f})
    local tat = max(num(hget(kv[1], f), 0), now) + kv[3]
    write_bucket({k = kv[1], fp = kv[2]}, tat + GRACE, 'tat', fmt(tat))
  end
end

-- What a lease keeps for its release: a MessagePack map (JSON from a version before it).
local function lease_data(d)
  if sub(d, 1, 1) == '{' then return cjson.decode(d) end
  return mp_unpack(d)
end

-- The spec of `release`: MessagePack scalars `h z id refund report limited retry_after
-- default_penalty duration cancel cost` (cost nil: the admission's stands), then the number of spend
-- units whose actual figure the release reports, and each one's name and figure.
local function release_spec(body)
  local a = {mp_unpack(body)}
  local s = {h = a[1], z = a[2], id = a[3], refund = a[4], report = a[5], limited = a[6],
    retry_after = a[7], default_penalty = a[8], duration = a[9], cancel = a[10], cost = a[11],
    ok = a[12], healthy = a[13]}
  if a[14] > 0 then
    local spent = {}
    for i = 15, 14 + 2 * a[14], 2 do spent[a[i]] = a[i + 1] end
    s.spent = spent
  end
  return s
end

-- What each layer of the lease `l` (its data `d`) took, as {key, field prefix, microseconds}: read
-- only by a release that gives tokens back or settles a cost (decoding it for every release was a
-- JSON decode and a table per layer).
local function lease_incs(l, d)
  local incs = {}
  if l.flags ~= 'n' then
    for i, v in ipairs(cjson.decode(l.incs)) do incs[i] = {d.keys[i][1], d.keys[i][2], v} end
  end
  return incs
end

local function op_release()
  local h = spec.h
  local l = read_lease(h, spec.id)
  if not l then return {'unknown'} end
  local d = lease_data(l.d)
  hput(h, 'l:' .. spec.id, nil)
  if redis.call('ZREM', spec.z, d.m) == 1 then count(h, d.m, -1) end
  if l.flags == 'n' then d.cost, d.quotas = 0, {} end
  -- refund: 'always' (a held caller went away), 'never' (an edge admission ends), or 'hold' (a
  -- cancellation refunds only while the call was still held: after that the call ran).
  local give_back = spec.refund == 'always' or (spec.refund == 'hold' and now < tonumber(l.hold_until))
  if give_back then
    refund(lease_incs(l, d))
    for _, q in ipairs(d.quotas) do
      local used = num(redis.call('HGET', q, l.day), 0)
      redis.call('HSET', q, l.day, fmt(max(used - d.cost, 0)))
    end
  end
  -- Cost: the actual cost units (`spec.cost`; a cache hit reports 0) replace the admission's. The
  -- difference goes back to every bucket layer the call took from, in proportion to what each took,
  -- and to its daily quotas, or is charged on top (a bucket then refills later; a quota may go past
  -- its limit), as the engine settles a release in memory. Quotas settle on the day of the
  -- admission. A call given everything back above, or a shadow lease, has nothing to settle.
  if type(spec.cost) == 'number' and not give_back and l.flags ~= 'n' and (d.cost or 0) > 0 then
    local diff = d.cost - spec.cost
    if diff ~= 0 then
      local share = math.abs(diff) / d.cost
      for _, kv in ipairs(lease_incs(l, d)) do
        local inc = floor(kv[3] * share)
        if inc > 0 and diff > 0 then
          refund({{kv[1], kv[2], inc}})
        elseif inc > 0 then
          charge({{kv[1], kv[2], inc}})
        end
      end
      for _, q in ipairs(d.quotas) do
        local used = num(redis.call('HGET', q, l.day), nil)
        if used then redis.call('HSET', q, l.day, fmt(max(used - diff, 0))) end
      end
    end
  end
  -- Spend: the actual figures replace the estimates (a unit the release does not name keeps its
  -- estimate; a cancellation, or a held caller gone, gives it all back), in each budget that still
  -- counts it: a daily one on the day of the reservation, a run's while it is remembered.
  if l.flags ~= 'n' and d.spend then
    local cancel = spec.cancel or give_back
    for _, u in ipairs(d.spend) do
      local actual = u.n
      if cancel then
        actual = 0
      elseif spec.spent and spec.spent[u.u] then
        actual = tonumber(spec.spent[u.u]) or u.n
      end
      local diff = actual - u.n
      if diff ~= 0 then
        -- A figure the reservation did not write (its estimate was 0) is written here, while its
        -- day is still kept (a daily one) or the run is still remembered (`u.i` after the call).
        local kept = (num(l.day, 0) + 1) * DAY + KEEP
        for _, k in ipairs(u.d) do
          if redis.call('EXISTS', k) == 1 then
            redis.call('HINCRBYFLOAT', k, l.day, fmt(diff))
          elseif kept > now then
            redis.call('HINCRBYFLOAT', k, l.day, fmt(diff))
            expire_at(k, kept)
          end
        end
        local remembered = num(l.started, 0) + num(u.i, 0)
        for _, k in ipairs(u.r) do
          if redis.call('EXISTS', k) == 1 then
            redis.call('INCRBYFLOAT', k, fmt(diff))
          elseif remembered > now then
            redis.call('INCRBYFLOAT', k, fmt(diff))
            expire_at(k, remembered)
          end
        end
      end
    end
  end
  local penalty, probe = 0, ''
  local ups = d.up
  if spec.report then
    for i, u in ipairs(ups) do
      if i == 1 and not u.x then
        penalty, probe = upstream_answer(u, spec.limited, spec.retry_after, spec.default_penalty,
          spec.ok, spec.healthy)
      end
    end
  end
  if spec.duration >= 0 then
    -- How long the tool's calls run (concurrency hints): a moving average, kept a day.
    local rf = 'rt:' .. d.tool
    load(h, {rf})
    local avg = num(hget(h, rf), nil)
    local dur = spec.duration
    if avg then avg = 0.8 * avg + 0.2 * dur else avg = dur end
    hput(h, rf, fmt(avg))
    keep(h, now + DAY)
  end
  local cross, name = '', ''
  if #ups > 0 then
    name = ups[1].n or ''
    if ups[1].x then cross = cjson.encode(ups[1]) end
  end
  local r = {'released', fmt(penalty), d.subject, d.tool, name, cross, l.hold_until, NOW, probe or ''}
  -- In a cluster the cross-tenant layers (`d.x`, on shards of their own) are settled by admitd
  -- after this call: it is told the admission's cost and those layers.
  if d.x and type(spec.cost) == 'number' and not give_back and l.flags ~= 'n' and (d.cost or 0) > 0
      and d.cost ~= spec.cost then
    r[10] = fmt(d.cost)
    r[11] = cjson.encode(d.x)
  end
  return r
end

-- `spec.a` (optional): answers this replica gathered before this one (see `upstream_answers`),
-- counted first so that the store sees them in the order they came. (admitd never sends them with
-- an answer that has a probe part of its own: a probed upstream's 429.)
local function op_upstream()
  local before = ''
  if spec.a and #spec.a > 0 then before = upstream_answers(spec.u, spec.a) end
  local penalty, probe = upstream_answer(spec.u, spec.limited, spec.retry_after, spec.default_penalty,
    spec.ok, spec.healthy)
  if probe == '' then probe = before end
  return {'ok', fmt(penalty), probe}
end

local function op_answers()
  return {'ok', upstream_answers(spec.u, spec.a)}
end

-- Writes a probe schedule admitd computed (`spec.f`: field, value pairs) into the state hash
-- `spec.s`, unless another replica moved it since it was read (its version is no longer `spec.v`):
-- then that replica's change stands, and this one is dropped. Keeps the hash for `spec.keep`.
local function op_probe()
  if num(redis.call('HGET', spec.s, 'v'), 0) ~= spec.v then return {'stale'} end
  redis.call('HSET', spec.s, 'v', fmt(spec.v + 1), unpack(spec.f))
  expire_at(spec.s, now + spec.keep)
  return {'ok'}
end

local function op_refund()
  refund(spec.incs)
  return {'ok'}
end

local function op_charge()
  charge(spec.incs)
  return {'ok'}
end

local function op_snapshot()
  -- An empty hash name skips the tenant's part (a cluster reads cross-tenant upstreams in a second
  -- call).
  local day = tostring(floor(now / DAY))
  local h = spec.h
  local function used(k) if k == '' then return 0 end return num(redis.call('HGET', k, day), 0) end
  local out = {now = now, day_ends = (tonumber(day) + 1) * DAY, tenant_tat = 0, tenant_inflight = 0,
    tenant_quota = used(spec.tenant_quota), subjects = {}, pens = {}, ups = {}, spend = {}}
  -- Each spend unit's figure of the tenant's day (reserved and settled).
  for i, k in ipairs(spec.spend or {}) do out.spend[i] = used(k) end
  if h ~= '' then
    sweep(h, spec.z, nil)
    local names = {}
    if spec.index ~= '' then
      names = redis.call('ZREVRANGEBYSCORE', spec.index, '+inf', fmt(now - DAY), 'LIMIT', 0, spec.max_subjects)
    end
    local fields = {'t|tat', 't|n'}
    for _, n in ipairs(names) do
      fields[#fields + 1] = 's:' .. n .. '|tat'
      fields[#fields + 1] = 's:' .. n .. '|n'
    end
    load(h, fields)
    out.tenant_tat = num(hget(h, 't|tat'), 0)
    out.tenant_inflight = num(hget(h, 't|n'), 0)
    for _, n in ipairs(names) do
      out.subjects[#out.subjects + 1] = {name = n, tat = num(hget(h, 's:' .. n .. '|tat'), 0),
        inflight = num(hget(h, 's:' .. n .. '|n'), 0), quota = used(spec.subject_quota .. n)}
    end
  end
  for i, k in ipairs(spec.pens) do
    out.pens[i] = num(redis.call('HGET', k, 'until'), 0)
  end
  for i, k in ipairs(spec.ups) do
    out.ups[i] = multiplier(k, spec.forget, spec.pl)
  end
  return cjson.encode(out)
end

-- Tasks and renewals. A renewed lease or a task keeps `due|ttl` in its own key `x` beside the
-- lease, living as long as the lease: `due` its next poll (empty for a lease that is not a task),
-- `ttl` its own TTL. The tenant's tasks are the set `tasks`, scored by their ends; `cur` is the
-- tenant's poll cursor. The interval arithmetic is the engine's (src/engine/poll.rs), written again
-- here on the store's clock: spec {min, spacing, max, grace} in microseconds.

-- Makes `key` live until at least `at` (a key without an expiry gets one; a missing key stays so).
local function outlive(key, at)
  local left = redis.call('PTTL', key)
  if left == -2 then return end
  if left == -1 or now + left * 1000 < at then expire_at(key, at + SLACK) end
end

-- Moves a live lease's end to `ttl` after now (after its hold), its place in the lease set with it.
-- Returns the new end, or nil when the lease is gone.
local function extend(ttl)
  local h = spec.h
  local l = read_lease(h, spec.id)
  if not l then return nil end
  local ends = max(now, tonumber(l.hold_until) or now) + ttl
  local ok, data = pcall(lease_data, l.d)
  if ok and type(data) == 'table' and type(data.m) == 'string' then
    redis.call('ZADD', spec.z, 'XX', fmt(ends), data.m)
  end
  hput(h, 'l:' .. spec.id, l.day .. '|' .. l.hold_until .. '|' .. l.started .. '|' .. fmt(ends) .. '|' ..
    l.incs .. '|' .. l.flags .. '|' .. l.d)
  keep(h, ends + GRACE)
  load(h, {'z'})
  local z = num(hget(h, 'z'), 0)
  local nz = keep_until(spec.z, ends + GRACE, z)
  if nz ~= z then hput(h, 'z', fmt(nz)) end
  return ends
end

-- The tenant's tasks in flight: those whose lease is still there (a released task's lease is gone).
local function tasks_in_flight()
  redis.call('ZREMRANGEBYSCORE', spec.tasks, '-inf', NOW)
  local ids = redis.call('ZRANGE', spec.tasks, 0, -1)
  local fields = {}
  for i, id in ipairs(ids) do fields[i] = 'l:' .. id end
  load(spec.h, fields)
  local n, gone = 0, {}
  for _, id in ipairs(ids) do
    if read_lease(spec.h, id) then n = n + 1 else gone[#gone + 1] = id end
  end
  if #gone > 0 then chunked('ZREM', spec.tasks, gone) end
  return n
end

-- The next poll of a task with `n` tasks in flight: never before now + max(min, n * spacing), never
-- after now + max, no earlier than the cursor; whole milliseconds from now. Returns it and the ms.
local function schedule(n)
  local base = min(max(spec.spacing * n, spec.min), spec.max)
  local at = min(max(now + base, num(redis.call('GET', spec.cur), 0)), now + spec.max)
  local ms = ceil((at - now) / 1000)
  local due = now + ms * 1000
  redis.call('SET', spec.cur, fmt(due + spec.spacing), 'PX', ceil((spec.max + spec.spacing) / 1000) + 1000)
  return due, ms
end

local function op_task()
  local ends = extend(spec.ttl)
  if not ends then return {'unknown'} end
  local n = tasks_in_flight() + 1
  redis.call('ZADD', spec.tasks, fmt(ends), spec.id)
  outlive(spec.tasks, ends)
  local due, ms = schedule(n)
  redis.call('SET', spec.x, fmt(due) .. '|' .. fmt(spec.ttl), 'PX', max(ceil((ends - now) / 1000), 1))
  return {'ok', fmt(ms), fmt(n)}
end

local function op_poll()
  local l = read_lease(spec.h, spec.id)
  if not l then return {'unknown'} end
  local x = redis.call('GET', spec.x)
  if not x then return {'unknown'} end
  local due, ttl = match(x, '^([^|]*)|(.*)$')
  due = tonumber(due)
  if not due then return {'unknown'} end
  if now + spec.grace < due then return {'early', fmt(due - now)} end
  local n = tasks_in_flight()
  local next, ms = schedule(n)
  redis.call('SET', spec.x, fmt(next) .. '|' .. ttl, 'KEEPTTL')
  return {'due', fmt(ms), fmt(n)}
end

local function op_renew()
  local x = redis.call('GET', spec.x)
  local due, own = '', nil
  if x then due, own = match(x, '^([^|]*)|(.*)$') end
  local ttl = spec.ttl
  if ttl < 0 then ttl = tonumber(own) or spec.dttl end
  local ends = extend(ttl)
  if not ends then return {'unknown'} end
  redis.call('SET', spec.x, (due or '') .. '|' .. fmt(ttl), 'PX', max(ceil((ends - now) / 1000), 1))
  if due and due ~= '' then
    redis.call('ZADD', spec.tasks, 'XX', fmt(ends), spec.id)
    outlive(spec.tasks, ends)
  end
  return {'ok', fmt(ends - now)}
end

-- A slice of a cross-tenant bucket for one replica to spend itself: up to `n` whole tokens the
-- bucket holds now (never tokens a call would wait for, so a slice holds no one up), taken at once;
-- none while callers refused earlier hold promises on the bucket (its tokens are theirs as they
-- free: a shared upstream's bucket, whose promises are per tenant, keeps the latest in `p` too).
-- spec {k, T, b, n}; for a shared upstream's bucket also what else decides its calls: `m` its state
-- key (the slice is taken at the rate after its AIMD multiplier, as `read_layers` applies it, with
-- `forget` and `pl`), `pk` its penalty key and `a` its adaptive window (`aw`, `K`, `min`): none is
-- taken while the penalty runs or the throttle would refuse any share of calls. Answers the tokens
-- taken, the bucket's whole tokens left and microseconds until full after it, the penalty's
-- microseconds left, the throttle's refusal probability and the microseconds per token it was
-- taken at.
local function op_slice()
  local T, b = spec.T, spec.b
  if spec.m then T = T / multiplier(spec.m, spec.forget, spec.pl) end
  local wait, prob = 0, 0
  if spec.pk then
    local untl = num(redis.call('HGET', spec.pk, 'until'), 0)
    if untl > now then wait = untl - now end
  end
  if spec.a and spec.aw > 0 then
    local req, acc = sre_totals(spec.a, spec.aw)
    prob = reject_probability(req, acc, spec.K, spec.min or 0)
  end
  load(spec.k, {'tat', 'p'})
  local s = {tat = num(hget(spec.k, 'tat'), 0), p = num(hget(spec.k, 'p'), 0)}
  local free = math.floor((now + b * T - math.max(s.tat, now)) / T + 1e-9)
  if cursor_live(s.p, s.tat, b * T, 0) or wait > 0 or prob > 0 then free = 0 end
  local g = math.max(math.min(math.floor(spec.n), free), 0)
  local tat = s.tat
  if g > 0 then
    tat = math.max(s.tat, now) + math.ceil(g * T)
    write_bucket({k = spec.k, fp = ''}, math.max(tat, s.p) + GRACE, 'tat', fmt(tat))
  end
  return {'ok', tostring(g), tostring(whole_tokens(b, T, tat)), fmt(math.max(tat - now, 0)), fmt(wait),
    tostring(prob), fmt(T)}
end

local ops = {decide = op_decide, release = op_release, upstream = op_upstream, refund = op_refund,
  answers = op_answers,
  charge = op_charge,
  snapshot = op_snapshot, task = op_task, poll = op_poll, renew = op_renew, probe = op_probe,
  slice = op_slice}

local function run(name, body, data)
  local f = ops[name]
  if f == nil then return redis.error_reply('admitd: unknown operation ' .. tostring(name)) end
  if name == 'decide' then
    spec = {mp_unpack(body)}
  elseif name == 'release' then
    spec = release_spec(body)
  else
    spec = cjson.decode(body)
  end
  extra = data or ''
  return f()
end

-- A Redis Cluster node's batch (src/store/nodes.rs): quadruples (probe, operation, spec, lease data)
-- of any tenants whose slots the node serves, no key declared (the `allow-cross-slot-keys` flag of
-- the first line lets one script call touch several slots of its node). Before an operation runs,
-- its probe (a key of its hash tag that admitd never writes) is looked up, once per probe and call:
-- on a node that does not serve the slot now (moved, being migrated away or in, the cluster down)
-- Redis refuses that lookup, and the operation answers {'elsewhere', why} without having read or
-- written anything, for admitd to send it where the slot is. A lookup that passes keeps every key
-- of the slot on this node until the script call ends.
if op == 'routed' then
  local out, here = {}, {}
  for i = 2, #ARGV, 4 do
    local probe = ARGV[i]
    if here[probe] == nil then
      local ok, e = pcall(redis.call, 'EXISTS', probe)
      if ok then here[probe] = true
      else here[probe] = tostring(type(e) == 'table' and e.err or e) end
    end
    local r
    if here[probe] ~= true then
      r = {'elsewhere', here[probe]}
    else
      local ok
      ok, r = pcall(run, ARGV[i + 1], ARGV[i + 2], ARGV[i + 3])
      if not ok or (type(r) == 'table' and r.err) then
        if type(r) == 'table' and r.err then r = r.err end
        r = {'error', tostring(r)}
      end
    end
    out[#out + 1] = r
  end
  flush()
  return out
end

if op == 'batch' then
  local out = {}
  for i = 2, #ARGV, 3 do
    local ok, r = pcall(run, ARGV[i], ARGV[i + 1], ARGV[i + 2])
    if not ok or (type(r) == 'table' and r.err) then
      if type(r) == 'table' and r.err then r = r.err end
      r = {'error', tostring(r)}
    end
    out[#out + 1] = r
  end
  flush()
  return out
end

local r = run(op, ARGV[2], ARGV[3])
flush()
return r
