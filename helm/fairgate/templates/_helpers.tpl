{{/* Chart name, truncated to the DNS label limit. */}}
{{- define "fairgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified app name: release name, plus the chart name unless it already contains it. */}}
{{- define "fairgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "fairgate.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fairgate.labels" -}}
helm.sh/chart: {{ include "fairgate.chart" . }}
app.kubernetes.io/name: {{ include "fairgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Selector labels; call with (dict "root" $ "component" "gateway"). */}}
{{- define "fairgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fairgate.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "fairgate.gatewayName" -}}
{{- printf "%s-gateway" (include "fairgate.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fairgate.redisName" -}}
{{- printf "%s-redis" (include "fairgate.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fairgate.keysSecretName" -}}
{{- if .Values.gateway.keys.existingSecret -}}
{{- .Values.gateway.keys.existingSecret -}}
{{- else -}}
{{- printf "%s-keys" (include "fairgate.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/*
Name of a vLLM pool's StatefulSet and of its headless Service: <release>-<pool>.
Pod i is then reachable at <release>-<pool>-<i>.<release>-<pool>.
Call with (dict "root" $ "pool" $pool). 52 chars leave room for the pod ordinal and
the controller-revision-hash label; a longer name is cut to 45 and gets a hash of the
whole, so two pools never collide after truncation.
*/}}
{{- define "fairgate.poolName" -}}
{{- $full := printf "%s-%s" .root.Release.Name .pool.name -}}
{{- if le (len $full) 52 -}}
{{- $full -}}
{{- else -}}
{{- printf "%s-%s" ($full | trunc 45 | trimSuffix "-") ($full | sha256sum | trunc 6) -}}
{{- end -}}
{{- end -}}

{{/*
A pool's KEDA scaling (vllm.autoscaling, overridden by the pool's own `autoscaling`): JSON
{"min": N, "max": M}, or "" when KEDA does not scale it. Call with (dict "root" $ "pool" $pool).
*/}}
{{- define "fairgate.poolKeda" -}}
{{- $a := .root.Values.vllm.autoscaling -}}
{{- $p := .pool.autoscaling | default dict -}}
{{- $on := (hasKey $p "enabled") | ternary $p.enabled $a.enabled -}}
{{- if $on -}}
{{- $min := (hasKey $p "minReplicas") | ternary $p.minReplicas $a.minReplicas | int -}}
{{- $max := (hasKey $p "maxReplicas") | ternary $p.maxReplicas $a.maxReplicas | int -}}
{{- if gt $min $max -}}
{{- fail (printf "vllm.pools[%s]: autoscaling minReplicas must not exceed maxReplicas" .pool.name) -}}
{{- end -}}
{{- if lt $max 1 -}}
{{- fail (printf "vllm.pools[%s]: autoscaling maxReplicas must be at least 1" .pool.name) -}}
{{- end -}}
{{- dict "min" $min "max" $max | toJson -}}
{{- end -}}
{{- end -}}

{{/* Whether KEDA scales any pool: "true" or "". */}}
{{- define "fairgate.anyPoolKeda" -}}
{{- range $pool := .Values.vllm.pools -}}
{{- if include "fairgate.poolKeda" (dict "root" $ "pool" $pool) -}}true{{- end -}}
{{- end -}}
{{- end -}}

{{/* Redis URL the gateway uses: the in-chart StatefulSet, or redis.externalUrl. */}}
{{- define "fairgate.redisUrl" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s:%d/0" (include "fairgate.redisName" .) (int .Values.redis.port) -}}
{{- else -}}
{{- required "redis.externalUrl is required when redis.enabled=false" .Values.redis.externalUrl -}}
{{- end -}}
{{- end -}}

{{- define "fairgate.redisClusterName" -}}
{{- printf "%s-valkey" (include "fairgate.fullname" .) | trunc 52 | trimSuffix "-" -}}
{{- end -}}

{{/* Whether the store is a Redis Cluster (in-chart or external). */}}
{{- define "fairgate.usesCluster" -}}
{{- if or .Values.redisCluster.enabled .Values.redisCluster.externalNodes -}}
{{- if .Values.redis.enabled -}}
{{- fail "redisCluster replaces redis: set redis.enabled=false" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* The cluster's nodes as a JSON list: every in-chart pod, or redisCluster.externalNodes. */}}
{{- define "fairgate.redisClusterNodes" -}}
{{- $c := .Values.redisCluster -}}
{{- if $c.enabled -}}
{{- $name := include "fairgate.redisClusterName" . -}}
{{- $nodes := list -}}
{{- range $i, $_ := until (int (mul $c.masters (add1 $c.replicasPerMaster))) -}}
{{- $nodes = append $nodes (printf "%s-%d.%s-headless:%d" $name $i $name (int $c.port)) -}}
{{- end -}}
{{- toJson $nodes -}}
{{- else -}}
{{- toJson $c.externalNodes -}}
{{- end -}}
{{- end -}}

{{- define "fairgate.sentinelName" -}}
{{- printf "%s-redis-sentinel" (include "fairgate.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fairgate.sentinelTopology" -}}
{{- if and .Values.redis.enabled (eq .Values.redis.topology "sentinel") -}}true{{- end -}}
{{- end -}}

{{/* The store group of the gateway config: redis_cluster, redis_sentinel (in-chart) or
redis_url. */}}
{{- define "fairgate.storeConfig" -}}
{{- if not (has .Values.redis.topology (list "standalone" "sentinel")) -}}
{{- fail (printf "redis.topology must be standalone or sentinel, not %q" .Values.redis.topology) -}}
{{- end -}}
{{- if include "fairgate.usesCluster" . -}}
redis_cluster:
  nodes: {{ include "fairgate.redisClusterNodes" . }}
{{- else if include "fairgate.sentinelTopology" . -}}
{{- $s := .Values.redis.sentinel -}}
{{- $name := include "fairgate.sentinelName" . -}}
redis_sentinel:
  master_name: {{ $s.masterName | quote }}
  nodes:
  {{- range $i, $_ := until (int $s.sentinels) }}
    - {{ printf "%s-%d.%s:%d" $name $i $name (int $s.port) | quote }}
  {{- end }}
store_failover_wait_s: {{ $s.failoverWaitSeconds }}
{{- else -}}
redis_url: {{ include "fairgate.redisUrl" . | quote }}
{{- end -}}
{{- end -}}

{{/* The gateway's config.yaml (settings grouped as in docs/configuration.md): every pod
of every pool is one backend. */}}
{{- define "fairgate.gatewayConfig" -}}
store:
{{ include "fairgate.storeConfig" . | indent 2 }}
  data_dir: {{ .Values.gateway.dataDir | quote }}
listen:
  host: 0.0.0.0
  port: {{ .Values.gateway.port }}
backends:
{{- range $pool := .Values.vllm.pools }}
{{- $poolName := include "fairgate.poolName" (dict "root" $ "pool" $pool) }}
{{- $keda := include "fairgate.poolKeda" (dict "root" $ "pool" $pool) }}
{{- /* a pool KEDA scales: every pod it may start (those not running fail their scrape) */}}
{{- $count := ternary (int (fromJson $keda).max) (int $pool.replicas) (ne $keda "") }}
{{- range $i, $_ := until $count }}
  - name: {{ printf "%s-%d" $pool.name $i | quote }}
    url: {{ printf "http://%s-%d.%s:%d" $poolName $i $poolName (int $.Values.vllm.port) | quote }}
    model: {{ $pool.servedModelName | quote }}
    pool: {{ $pool.name | quote }}
    max_num_batched_tokens: {{ int $pool.maxNumBatchedTokens }}
    {{- with $pool.minPromptTokens }}
    min_prompt_tokens: {{ int . }}
  {{- end }}
    {{- with $pool.maxPromptTokens }}
    max_prompt_tokens: {{ int . }}
  {{- end }}
{{- end }}
{{- end }}
{{- with .Values.gateway.config.extraBackends }}
{{ toYaml . | indent 2 }}
{{- end }}
classes:
{{ toYaml .Values.gateway.config.classes | indent 2 }}
fairness:
  policy: {{ .Values.gateway.config.fairness | quote }}
{{- if include "fairgate.anyPoolKeda" . }}
fleet:
  # scale from zero: a request waits this long for a pool at zero to start a backend
  cold_start_wait_s: {{ .Values.vllm.autoscaling.coldStartWaitSeconds }}
{{- end }}
{{- end -}}

{{/* TCP port of a URL: its explicit port, else the scheme's default (redis 6379, http 80, https 443). */}}
{{- define "fairgate.urlPort" -}}
{{- $u := urlParse . -}}
{{- $hostport := splitList ":" $u.host -}}
{{- if gt (len $hostport) 1 -}}
{{- last $hostport -}}
{{- else -}}
{{- get (dict "redis" "6379" "rediss" "6379" "http" "80" "https" "443") $u.scheme | default "80" -}}
{{- end -}}
{{- end -}}
