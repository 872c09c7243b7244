{{/* Names ------------------------------------------------------------------------------ */}}

{{- define "refit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "refit.fullname" -}}
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

{{/* Redis objects get a suffix; keep room for the StatefulSet's pod ordinal and PVC name. */}}
{{- define "refit.redis.fullname" -}}
{{- printf "%s-redis" (include "refit.fullname" . | trunc 50 | trimSuffix "-") -}}
{{- end -}}

{{- define "refit.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "refit.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels ----------------------------------------------------------------------------- */}}

{{- define "refit.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "refit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: refitplane
{{- end -}}

{{- define "refit.selectorLabels" -}}
app.kubernetes.io/name: {{ include "refit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: coordinator
{{- end -}}

{{- define "refit.redis.selectorLabels" -}}
app.kubernetes.io/name: {{ include "refit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end -}}

{{- define "refit.test.selectorLabels" -}}
app.kubernetes.io/name: {{ include "refit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: test
{{- end -}}

{{/* Images ----------------------------------------------------------------------------- */}}

{{- define "refit.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion | toString -}}
{{- if .Values.image.digest -}}
{{- printf "%s:%s@%s" .Values.image.repository $tag .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "refit.redis.image" -}}
{{- $image := .Values.redis.bundled.image -}}
{{- if $image.digest -}}
{{- printf "%s:%s@%s" $image.repository (toString $image.tag) $image.digest -}}
{{- else -}}
{{- printf "%s:%s" $image.repository (toString $image.tag) -}}
{{- end -}}
{{- end -}}

{{/* Secrets and addresses -------------------------------------------------------------- */}}

{{- define "refit.auth.secretName" -}}
{{- default (printf "%s-auth" (include "refit.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "refit.auth.secretKey" -}}
{{- if .Values.auth.existingSecret -}}{{ .Values.auth.existingSecretKey }}{{- else -}}token{{- end -}}
{{- end -}}

{{- define "refit.redis.secretName" -}}
{{- default (include "refit.redis.fullname" .) .Values.redis.bundled.auth.existingSecret -}}
{{- end -}}

{{- define "refit.redis.secretKey" -}}
{{- if .Values.redis.bundled.auth.existingSecret -}}{{ .Values.redis.bundled.auth.existingSecretKey }}{{- else -}}redis-password{{- end -}}
{{- end -}}

{{/* The Secret (and key) with the coordinator's Redis password: the bundled Redis' or
     redis.external.existingSecret; empty when the external Redis has no password Secret. */}}
{{- define "refit.redis.passwordSecret" -}}
{{- if .Values.redis.bundled.enabled -}}
{{- include "refit.redis.secretName" . -}}
{{- else if .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "refit.redis.passwordKey" -}}
{{- if .Values.redis.bundled.enabled -}}
{{- include "refit.redis.secretKey" . -}}
{{- else -}}
{{- .Values.redis.external.existingSecretKey -}}
{{- end -}}
{{- end -}}

{{- define "refit.redis.url" -}}
{{- if .Values.redis.bundled.enabled -}}
{{- printf "redis://%s:6379/0" (include "refit.redis.fullname" .) -}}
{{- else -}}
{{- .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{- define "refit.tls.caSecretName" -}}
{{- default .Values.tls.secretName .Values.tls.caSecretName -}}
{{- end -}}

{{/* In-cluster addresses clients use. */}}
{{- define "refit.grpcAddress" -}}
{{- printf "%s.%s.svc:%v" (include "refit.fullname" .) .Release.Namespace .Values.service.grpcPort -}}
{{- end -}}

{{- define "refit.httpURL" -}}
{{- printf "%s://%s.%s.svc:%v" (ternary "https" "http" .Values.tls.enabled) (include "refit.fullname" .) .Release.Namespace .Values.service.httpPort -}}
{{- end -}}

{{/*
A generated secret value that survives upgrades: reuse the live Secret's key when lookup
can see it, otherwise a new random string. Offline renders (`helm template`, GitOps) cannot
look up, so they produce a new value each time: use existingSecret there.
Args: (list $ctx secretName key length). Returns the base64-encoded value.
*/}}
{{- define "refit.generatedSecretValue" -}}
{{- $ctx := index . 0 -}}
{{- $name := index . 1 -}}
{{- $key := index . 2 -}}
{{- $length := index . 3 -}}
{{- $live := lookup "v1" "Secret" $ctx.Release.Namespace $name -}}
{{- if and $live $live.data (hasKey $live.data $key) -}}
{{- index $live.data $key -}}
{{- else -}}
{{- randAlphaNum $length | b64enc -}}
{{- end -}}
{{- end -}}

{{/* Validation: inconsistent values stop the render with a message saying what to change. */}}
{{- define "refit.validate" -}}
{{- $v := .Values -}}
{{- if ne (int $v.replicaCount) 1 -}}
{{- fail (printf "replicaCount=%v is not supported: the coordinator is a single active replica (its refit state machine runs in one process; Redis makes it restart-safe, not active-active). Keep replicaCount=1; the Deployment replaces a failed pod (strategy Recreate)." $v.replicaCount) -}}
{{- end -}}
{{- $tag := $v.image.tag | default .Chart.AppVersion | toString -}}
{{- if eq $tag "latest" -}}
{{- fail "image.tag=latest is refused: pin a version (default: the chart's appVersion) so a pod restart cannot change the coordinator's code" -}}
{{- end -}}
{{- if and $v.image.digest (not (regexMatch "^sha256:[a-f0-9]{64}$" $v.image.digest)) -}}
{{- fail (printf "image.digest=%q is not a digest: expected sha256:<64 hex chars>" $v.image.digest) -}}
{{- end -}}
{{- if eq (toString $v.redis.bundled.image.tag) "latest" -}}
{{- fail "redis.bundled.image.tag=latest is refused: pin a Redis version" -}}
{{- end -}}
{{- if and $v.redis.bundled.enabled $v.redis.external.enabled -}}
{{- fail "redis.bundled.enabled and redis.external.enabled are both true: choose one Redis (set redis.bundled.enabled=false to use redis.external.url)" -}}
{{- end -}}
{{- if not (or $v.redis.bundled.enabled $v.redis.external.enabled) -}}
{{- fail "no Redis configured: set redis.bundled.enabled=true or redis.external.enabled=true with redis.external.url (the coordinator's embedded store loses all state on restart and is for single-node demos only)" -}}
{{- end -}}
{{- if $v.redis.external.enabled -}}
{{- if not $v.redis.external.url -}}
{{- fail "redis.external.enabled=true needs redis.external.url (e.g. redis://redis.example:6379/0, or rediss:// for TLS)" -}}
{{- end -}}
{{- if not (regexMatch "^rediss?://[^/\\s]+" $v.redis.external.url) -}}
{{- fail (printf "redis.external.url=%q must start with redis:// or rediss:// and name a host" $v.redis.external.url) -}}
{{- end -}}
{{- if regexMatch "^rediss?://[^/@]*:[^/@]*@" $v.redis.external.url -}}
{{- fail "redis.external.url must not contain a password: put it in a Secret and set redis.external.existingSecret (and existingSecretKey)" -}}
{{- end -}}
{{- end -}}
{{- if and $v.tls.enabled (not $v.tls.secretName) -}}
{{- fail "tls.enabled=true needs tls.secretName: a kubernetes.io/tls Secret with tls.crt and tls.key (e.g. from cert-manager)" -}}
{{- end -}}
{{- if and $v.auth.existingSecret (not $v.auth.enabled) -}}
{{- fail "auth.existingSecret is set but auth.enabled=false: enable auth or drop the secret" -}}
{{- end -}}
{{- if and $v.ingress.enabled (not $v.auth.enabled) -}}
{{- fail "ingress.enabled=true with auth.enabled=false would expose the mutating REST API (trigger, cancel) without authentication: enable auth" -}}
{{- end -}}
{{- if and $v.ingress.enabled (not $v.ingress.hosts) -}}
{{- fail "ingress.enabled=true needs at least one entry in ingress.hosts" -}}
{{- end -}}
{{- if and $v.networkPolicy.enabled $v.ingress.enabled (not $v.networkPolicy.ingressFrom) -}}
{{- fail "ingress.enabled=true with networkPolicy.enabled=true needs networkPolicy.ingressFrom (the ingress controller's pods/namespace), otherwise the policy blocks the controller" -}}
{{- end -}}
{{- if and $v.networkPolicy.enabled $v.serviceMonitor.enabled (not $v.networkPolicy.metricsFrom) -}}
{{- fail "serviceMonitor.enabled=true with networkPolicy.enabled=true needs networkPolicy.metricsFrom (Prometheus' pods/namespace), otherwise the policy blocks scraping" -}}
{{- end -}}
{{- end -}}

{{/* redis.conf of the bundled Redis. */}}
{{- define "refit.redis.conf" -}}
bind * -::*
port 6379
protected-mode yes
dir /data
# Append-only file: every state change of the coordinator (members, leases, layouts,
# refit records, versions) is logged; with appendfsync everysec a crash loses <= ~1 s.
appendonly yes
appendfsync {{ .Values.redis.bundled.appendfsync }}
appenddirname "appendonlydir"
aof-use-rdb-preamble yes
auto-aof-rewrite-percentage 100
auto-aof-rewrite-min-size 64mb
# Refit state must never be evicted: fail writes instead of dropping keys.
maxmemory-policy noeviction
{{- with .Values.redis.bundled.maxmemory }}
maxmemory {{ . }}
{{- end }}
# Written at start from the mounted Secret, so the password is in no ConfigMap or argv.
include /tmp/redis-auth.conf
{{- end -}}
