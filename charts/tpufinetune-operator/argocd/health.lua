-- Argo CD health check for tpufinetune.dev/TPUFinetune.
-- Install it under argocd-cm `resource.customizations.health.tpufinetune.dev_TPUFinetune`
-- (see README.md next to this file). Plain Lua 5.1 (Argo CD runs gopher-lua): no libraries.
--
--   status.phase            health       message
--   Succeeded               Healthy      status.message (else Ready/TrainingSucceeded condition's)
--   Pending, Queued,        Progressing  "<phase>: " .. status.message (else the message of
--   Provisioning,                        that phase's condition, else Ready's); Queued: waiting
--   VerifyingCollectives,                for Kueue's admission (or preempted), in Kueue's words
--   Training
--   Failed                  Degraded     Failed condition message (else Ready's, else status.message)
--   Suspended               Suspended    status.message (else Ready condition's)
--   Serving, Ready True     Healthy      status.message (the model's in-cluster URL)
--   Serving, Ready not True Progressing  "Serving: " .. status.message (else the Serving condition's):
--                                        the app is deploying (or stopped running); the operator
--                                        fails it with ServeFailed after spec.serve.timeoutSeconds
--   no status, or status.observedGeneration < metadata.generation: Progressing
--   (the operator has not looked at the latest spec yet; judging the old status would
--   flap between the old and the new outcome)
--   anything else           Unknown
-- status.message is the operator's one-line summary of the current phase; conditions keep
-- the last message of each step, which can lag behind it.

local hs = {}

local function find_condition(status, ctype)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == ctype then
      return c
    end
  end
  return nil
end

-- Message of the first of `types` whose condition has a non-empty message, else
-- status.message, else `default`.
local function condition_message(status, types, default)
  for _, ctype in ipairs(types) do
    local c = find_condition(status, ctype)
    if c ~= nil and c.message ~= nil and c.message ~= "" then
      return c.message
    end
  end
  if status.message ~= nil and status.message ~= "" then
    return status.message
  end
  return default
end

-- status.message if set, else condition_message(status, types, default).
local function summary(status, types, default)
  if status.message ~= nil and status.message ~= "" then
    return status.message
  end
  return condition_message(status, types, default)
end

local status = obj.status
if status == nil or status.phase == nil or status.phase == "" then
  hs.status = "Progressing"
  hs.message = "Waiting for the TPUFinetune operator to report a status"
  return hs
end

local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
local observed = status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation) ..
    " (observed: " .. tostring(observed) .. ")"
  return hs
end

local phase = status.phase

-- The condition that describes progress in each in-flight phase.
local progress_condition = {
  Pending = "SliceProvisioned",
  Queued = "Admitted",
  Provisioning = "SliceProvisioned",
  VerifyingCollectives = "CollectivesVerified",
  Training = "TrainingSucceeded",
  Serving = "Serving",
}

local ready = find_condition(status, "Ready")

if phase == "Succeeded" then
  hs.status = "Healthy"
  hs.message = summary(status, {"Ready", "TrainingSucceeded"}, "Fine-tuning succeeded")
elseif phase == "Failed" then
  hs.status = "Degraded"
  hs.message = condition_message(status, {"Failed", "Ready"}, "Fine-tuning failed")
elseif phase == "Serving" and ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = summary(status, {"Serving", "Ready"}, "Serving")
elseif phase == "Suspended" then
  hs.status = "Suspended"
  hs.message = summary(status, {"Ready"}, "Suspended")
elseif progress_condition[phase] ~= nil then
  hs.status = "Progressing"
  local detail = summary(status, {progress_condition[phase], "Ready"}, nil)
  if detail ~= nil then
    hs.message = phase .. ": " .. detail
  else
    hs.message = phase
  end
else
  hs.status = "Unknown"
  hs.message = "Unknown phase " .. tostring(phase)
end
return hs
