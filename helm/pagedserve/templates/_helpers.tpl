{{/* Names, labels and the pieces shared by the gateway and engine pods. */}}

{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pagedserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Suffixed names stay within the 63 characters of a DNS label. */}}
{{- define "pagedserve.gatewayName" -}}
{{- printf "%s-gateway" (include "pagedserve.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{- define "pagedserve.engineName" -}}
{{- printf "%s-engine" (include "pagedserve.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}

{{- define "pagedserve.eppName" -}}
{{- printf "%s-epp" (include "pagedserve.fullname" . | trunc 59 | trimSuffix "-") }}
{{- end }}

{{/* Whether our gateway Deployment (and its Services) is rendered: gateway.enabled, or when that is
null, unless the engines sit behind an InferencePool (whose endpoint picker routes to each engine
pod's own OpenAI front instead). "true" or "" (false). */}}
{{- define "pagedserve.gatewayEnabled" -}}
{{- $enabled := .Values.gateway.enabled -}}
{{- if kindIs "invalid" $enabled -}}
{{- $enabled = not .Values.inferencePool.enabled -}}
{{- end -}}
{{- if $enabled }}true{{ end -}}
{{- end }}

{{/* The EPP Service the InferencePool names: the chart's own, or inferencePool.endpointPicker.serviceName. */}}
{{- define "pagedserve.eppServiceName" -}}
{{- $epp := .Values.inferencePool.endpointPicker -}}
{{- if $epp.enabled }}{{ include "pagedserve.eppName" . }}{{ else }}{{ $epp.serviceName }}{{ end -}}
{{- end }}

{{/* Labels of one component's objects ("gateway" or "engine"): pass (list $ "engine"). */}}
{{- define "pagedserve.labels" -}}
{{- $root := index . 0 -}}
helm.sh/chart: {{ printf "%s-%s" $root.Chart.Name $root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/version: {{ $root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ $root.Release.Service }}
{{- end }}

{{/* Selector labels of one component ("gateway" or "engine"): pass (list $ "engine"). */}}
{{- define "pagedserve.selectorLabels" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "pagedserve.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{/* The image of one component: (list $ "engine"). Gateways need no GPU, so without an
explicit image.tag they run the slim CPU variant; engines the CUDA one unless gpu.mode=none. */}}
{{- define "pagedserve.image" -}}
{{- $root := index . 0 -}}
{{- $cpu := or (eq (index . 1) "gateway") (eq $root.Values.gpu.mode "none") -}}
{{- $tag := $root.Values.image.tag | default (printf "%s-%s" $root.Chart.AppVersion (ternary "cpu" "cuda" $cpu)) -}}
{{- printf "%s:%s" $root.Values.image.repository $tag }}
{{- end }}

{{- define "pagedserve.cacheDir" -}}/var/cache/pagedserve{{- end }}

{{/* The memory service's socket: one path, used by both engine containers. */}}
{{- define "pagedserve.socketPath" -}}
{{- /* A subdirectory the memory service creates 0700: an emptyDir itself is world-writable (0777),
       and the memory service refuses a socket directory that others could write to. */ -}}
{{- printf "%s/memory/memory.sock" (trimSuffix "/" .Values.engine.socketDir) }}
{{- end }}

{{/* What the compute service's --model gets, per model.source. */}}
{{- define "pagedserve.modelArg" -}}
{{- if eq .Values.model.source "default" -}}
default
{{- else if eq .Values.model.source "pvc" -}}
{{- trimSuffix "/" (printf "/models/%s" (trimPrefix "/" .Values.model.pvc.path)) }}
{{- else -}}
{{- printf "%s/models/%s" (include "pagedserve.cacheDir" .) (.Values.model.download.repo | replace "/" "--") }}
{{- end }}
{{- end }}

{{/* Environment every container shares: caches under the cache volume, nothing under $HOME. */}}
{{- define "pagedserve.commonEnv" -}}
- name: HOME
  value: /tmp
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
- name: PYTHONUNBUFFERED
  value: "1"
- name: PAGEDSERVE_CACHE_DIR
  value: {{ include "pagedserve.cacheDir" . }}
- name: HF_HOME
  value: {{ include "pagedserve.cacheDir" . }}/huggingface
- name: TRITON_CACHE_DIR
  value: {{ include "pagedserve.cacheDir" . }}/triton
{{- end }}

{{/* The Secret holding the service token (engine.auth), and where compute and gateway read it. */}}
{{- define "pagedserve.tokenSecretName" -}}
{{- .Values.engine.auth.existingSecret | default (printf "%s-token" (include "pagedserve.engineName" .)) }}
{{- end }}

{{- define "pagedserve.tokenFile" -}}
{{- printf "/etc/pagedserve/service-token/%s" .Values.engine.auth.key }}
{{- end }}

{{/* The token's volume (in both pods): readable by the pod's group only (fsGroup). */}}
{{- define "pagedserve.tokenVolume" -}}
- name: service-token
  secret:
    secretName: {{ include "pagedserve.tokenSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.engine.auth.key }}
        path: {{ .Values.engine.auth.key }}
{{- end }}

{{/* The memory service's token (engine.memory.auth): in the engine pod only, read by both containers. */}}
{{- define "pagedserve.memoryTokenSecretName" -}}
{{- .Values.engine.memory.auth.existingSecret | default (printf "%s-memory-token" (include "pagedserve.engineName" .)) }}
{{- end }}

{{- define "pagedserve.memoryTokenFile" -}}
{{- printf "/etc/pagedserve/memory-token/%s" .Values.engine.memory.auth.key }}
{{- end }}

{{- define "pagedserve.memoryTokenVolume" -}}
- name: memory-token
  secret:
    secretName: {{ include "pagedserve.memoryTokenSecretName" . }}
    defaultMode: 0440
    items:
      - key: {{ .Values.engine.memory.auth.key }}
        path: {{ .Values.engine.memory.auth.key }}
{{- end }}

{{/* Mounts both engine containers have, at identical paths. */}}
{{- define "pagedserve.engineMounts" -}}
- name: tmp
  mountPath: /tmp
- name: socket
  mountPath: {{ .Values.engine.socketDir }}
- name: memory-token
  mountPath: /etc/pagedserve/memory-token
  readOnly: true
- name: dshm
  mountPath: /dev/shm
- name: cache
  mountPath: {{ include "pagedserve.cacheDir" . }}
{{- end }}

{{/*
An engine container's resources plus its GPU: (list $ resources withGpu).
dra: both containers list the pod's one claim, so both see the same device.
device-plugin: only the memory container (which allocates the KV pool) requests the GPU.
*/}}
{{- define "pagedserve.engineResources" -}}
{{- $root := index . 0 -}}
{{- $res := deepCopy (index . 1) -}}
{{- $withGpu := index . 2 -}}
{{- $mode := $root.Values.gpu.mode -}}
{{- if and $withGpu (eq $mode "dra") -}}
{{- $_ := set $res "claims" (list (dict "name" "gpu")) -}}
{{- else if and $withGpu (eq $mode "device-plugin") -}}
{{- $limits := deepCopy (default (dict) $res.limits) -}}
{{- $_ := set $limits $root.Values.gpu.devicePlugin.resourceName 1 -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res }}
{{- end }}

{{/* A resource quantity ("2Gi", "512Mi", "1G", "1073741824") in bytes, for the checks below. */}}
{{- define "pagedserve.bytes" -}}
{{- $q := toString . -}}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 -}}
{{- $suffix := regexFind "[A-Za-z]+$" $q -}}
{{- $number := trimSuffix $suffix $q -}}
{{- if $suffix -}}
{{- mulf (float64 $number) (get $units $suffix | default 0) | int64 -}}
{{- else -}}
{{- float64 $number | int64 -}}
{{- end -}}
{{- end }}

{{/* Graceful drain (pagedserve/drain.py). A pod's terminationGracePeriodSeconds: its preStop sleep,
then its drain timeout, then the seconds each of its containers takes to stop after the drain:
COMPUTE_STOP_S + MEMORY_STOP_S for an engine pod (the memory sidecar stops after compute; the
per-pod OpenAI front of an InferencePool drains beside compute, and GATEWAY_STOP_S <= COMPUTE_STOP_S),
GATEWAY_STOP_S for a gateway pod. tests/helm checks these numbers against pagedserve/drain.py.
Argument: (list <drain values> "engine"|"gateway"). */}}
{{- define "pagedserve.drainGrace" -}}
{{- $drain := index . 0 -}}
{{- $stopSeconds := dict "engine" (add 5 10) "gateway" 5 -}}
{{- add (int $drain.preStopSeconds) (int $drain.timeoutSeconds) (get $stopSeconds (index . 1)) -}}
{{- end }}

{{/* The preStop sleep of a container that drains (Kubernetes' sleep action, 1.30+: no binary needed in
the image); none when preStopSeconds is 0. Argument: the drain values. */}}
{{- define "pagedserve.preStop" -}}
{{- if .preStopSeconds }}
lifecycle:
  preStop:
    sleep:
      seconds: {{ int .preStopSeconds }}
{{- end }}
{{- end }}
