-- Move a batch to a new status only from one of the expected ones (compare-and-set).
-- KEYS[1] batch hash
-- ARGV[1] allowed current statuses, comma separated  ARGV[2] new status
-- ARGV[3] timestamp field to set ("" for none)  ARGV[4] now (s)
-- Returns 1 when moved, 0 when the batch was in another status (or does not exist).
local current = redis.call('HGET', KEYS[1], 'status')
if not current then return 0 end
local allowed = false
for status in string.gmatch(ARGV[1], '[^,]+') do
  if status == current then allowed = true end
end
if not allowed then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[2])
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], ARGV[3], ARGV[4]) end
return 1
